"""``tunedb bench plan`` on the CPU: which graphs run, batch bindings, verification against the
reference and onnxruntime, the peers' op coverage, the table, and the CLI's one-line errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from tunedb.bench.fusion import BenchError
from tunedb.bench.peer_ops import JAX_OPS, TORCH_OPS
from tunedb.bench.plan import (
    PEERS,
    Entry,
    batch_bindings,
    collect_entries,
    is_memory_bound,
    load_entry,
    onnxruntime_outputs,
    op_by_op_count,
    summarize,
    summary_lines,
    verify,
)
from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import OP_SPECS
from tunedb.graph.onnx_import import import_onnx
from tunedb.graph.reference import run_reference
from tunedb.runtime.inputs import make_inputs

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT / "data" / "graphs"
SHIPPED = sorted(GRAPHS.glob("*.onnx"))


def invoke(*args: str):
    from tunedb.cli import app

    return CliRunner().invoke(app, list(args), env={"TUNEDB_DB": None, "XDG_DATA_HOME": None},
                              terminal_width=200)


# -- the peers' translations ----------------------------------------------------------------------
def test_every_op_of_the_shipped_graphs_has_a_torch_and_a_jax_translation():
    assert len(SHIPPED) >= 8
    ops: set[str] = set()
    for p in SHIPPED:
        ops |= {n.op for n in import_onnx(p).nodes}
    assert {"conv2d", "max_pool2d", "avg_pool2d", "gemm", "matmul", "split", "concat"} <= ops
    assert ops <= set(TORCH_OPS), sorted(ops - set(TORCH_OPS))
    assert ops <= set(JAX_OPS), sorted(ops - set(JAX_OPS))


def test_every_op_of_the_anchors_and_of_the_ir_is_translated():
    from tunedb.kernels.suites import ANCHOR_CASES

    anchor_ops = {n.op for c in ANCHOR_CASES for n in c.graph.nodes}
    assert anchor_ops <= set(TORCH_OPS) and anchor_ops <= set(JAX_OPS)
    assert set(OP_SPECS) - set(TORCH_OPS) == set()
    assert set(OP_SPECS) - set(JAX_OPS) == set()
    assert set(TORCH_OPS) <= set(OP_SPECS) and set(JAX_OPS) <= set(OP_SPECS)


# -- which graphs -----------------------------------------------------------------------------------
def test_graphs_folder_gives_every_shipped_graph_then_the_anchors():
    entries = collect_entries([], GRAPHS)
    names = [e.name for e in entries]
    assert names[:len(SHIPPED)] == [p.stem for p in SHIPPED]
    assert len(entries) == len(SHIPPED) + 12
    assert all(e.source == "anchor" and e.graph is not None for e in entries[len(SHIPPED):])
    assert len(collect_entries([GRAPHS / "bert_layer.onnx"], GRAPHS, anchors=False)) == len(SHIPPED)
    assert [e.source for e in collect_entries(["anchors"])] == ["anchor"] * 12
    only = collect_entries([GRAPHS / "resnet_piece.onnx"])
    assert [e.name for e in only] == ["resnet_piece"] and only[0].path == GRAPHS / "resnet_piece.onnx"


def test_collect_entries_errors(tmp_path):
    with pytest.raises(BenchError, match="nothing to run"):
        collect_entries([])
    with pytest.raises(BenchError, match="no such model file"):
        collect_entries([tmp_path / "x.onnx"])
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(BenchError, match="neither an ONNX model"):
        collect_entries([tmp_path / "m.txt"])
    with pytest.raises(BenchError, match="holds no .onnx or .json graph"):
        collect_entries([], tmp_path)


def _symbolic_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_batch_bindings(tmp_path):
    sym = _symbolic_model(tmp_path / "relu.onnx")
    assert batch_bindings(sym, 8) == {"batch": 8}
    entries = collect_entries([sym], batches=[1, 8])
    assert [e.name for e in entries] == ["relu b1", "relu b8"]
    graph, _ = load_entry(entries[1])
    assert graph.type_of("x").shape == (8, 4)
    assert batch_bindings(GRAPHS / "bert_layer.onnx", 1) == {}
    with pytest.raises(BenchError, match="static batch of 1; --batch 4"):
        batch_bindings(GRAPHS / "bert_layer.onnx", 4)
    with pytest.raises(BenchError, match="static batch of 1; --batch 4"):
        collect_entries([GRAPHS / "bert_layer.onnx"], batches=[4])
    # graphs of a folder: the static ones are kept with their error, the others still run
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "relu.onnx").write_bytes(sym.read_bytes())
    (tmp_path / "dir" / "bert.onnx").write_bytes((GRAPHS / "bert_layer.onnx").read_bytes())
    entries = collect_entries([], tmp_path / "dir", anchors=False, batches=[4])
    assert [(e.name, bool(e.error)) for e in entries] == [("bert b4", True), ("relu b4", False)]
    assert entries[1].bindings == {"batch": 4}


# -- inputs, verification -------------------------------------------------------------------------
def test_bench_inputs_make_masks_of_zeros_and_ones():
    graph, _ = load_entry(Entry("bert", "x", path=GRAPHS / "bert_layer.onnx"))
    dev, ref = make_inputs(graph, 3)
    mask = dev["attention_mask"]
    assert mask.dtype == np.int64 and set(np.unique(mask)) <= {0, 1} and mask.min() == 0 and mask.max() == 1
    assert np.array_equal(ref["attention_mask"], mask)
    out = run_reference(graph, ref)["output"]
    assert np.isfinite(out).all()
    b = GraphBuilder("g")
    x, idx = b.input("x", (5, 3)), b.input("i", (7,), "int64")
    g = b.build([b.gather(x, idx, axis=0)])
    dev, _ = make_inputs(g, 0)
    assert dev["i"].min() >= 0 and dev["i"].max() < 5  # indices keep their range


def test_verify_reports_the_worst_output():
    b = GraphBuilder("two")
    x = b.input("x", (64, 32))
    g = b.build([b.exp(x), b.reduce_sum(x, axes=(1,))])
    ref = run_reference(g, {"x": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)})
    good = {k: v.astype(np.float32) for k, v in ref.items()}
    res = verify(g, good, ref)
    assert res["ok"] is True and res["rel_err"] < 1e-6
    bad = dict(good)
    o2 = g.outputs[1]
    bad[o2] = good[o2] + 1e-2
    res = verify(g, bad, ref)
    assert res["ok"] is False and res["worst_output"] == o2
    assert res["max_abs_err"] == pytest.approx(1e-2, rel=1e-3)
    assert verify(g, bad, ref, slack=2000.0)["ok"] is True  # atol ~1e-5 x 2000 > 1e-2


def test_onnxruntime_agrees_with_the_reference_on_a_shipped_graph():
    graph, model = load_entry(Entry("resnet", "x", path=GRAPHS / "resnet_piece.onnx"))
    dev, ref_in = make_inputs(graph, 5)
    ort_out = onnxruntime_outputs(model, graph, dev)
    refs = run_reference(graph, ref_in)
    res = verify(graph, ort_out, refs, slack=4.0)
    assert res["ok"], res
    assert list(ort_out) == list(graph.outputs)


def test_op_by_op_count_leaves_out_views():
    graph, _ = load_entry(Entry("bert", "x", path=GRAPHS / "bert_layer.onnx"))
    views = sum(1 for n in graph.nodes if n.op in ("reshape", "squeeze", "unsqueeze", "identity"))
    assert views > 0 and op_by_op_count(graph) == len(graph.nodes) - views


# -- summary, table, CLI --------------------------------------------------------------------------
def _result():
    def entry(name, t, peers, ok=True):
        return {"name": name, "graph": {"op_by_op": 50}, "plan": {"kernels": 17, "launches": 18,
                                                                   "graph_capture": True},
                "verify": {"reference": {"ok": ok, "rel_err": 1e-7}}, "tunedb": {"us": t, "error": None},
                "peers": {p: {"us": u} for p, u in zip(PEERS, peers)},
                "speedup": {p: (u / t if t and u else None) for p, u in zip(PEERS, peers)}}

    return {"device": {"name": "H200"}, "peers": list(PEERS),
            "entries": [entry("a", 100.0, [400.0, 200.0, 100.0, 150.0]),
                        entry("b", 50.0, [300.0, 200.0, 25.0, None]),
                        entry("c", None, [10.0, 10.0, 10.0, 10.0], ok=False)]}


def test_summary_and_table():
    from tunedb.bench.tables import plan_summary_line as summary_line
    from tunedb.bench.tables import plan_table as render_table

    r = _result()
    r["summary"] = s = summarize(r)
    assert s["graphs"] == 3 and s["verified"] == 2 and s["timed"] == 2 and s["failed"] == ["c"]
    assert s["speedup_vs_torch_eager"] == pytest.approx(math.sqrt(4.0 * 6.0))
    assert s["speedup_vs_torch_compile_ro"] == pytest.approx(math.sqrt(1.0 * 0.5))
    assert s["min_speedup_vs_torch_compile_ro"] == pytest.approx(0.5)
    assert s["speedup_vs_jax"] == pytest.approx(1.5)
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(render_table(r))
    text = console.export_text()
    assert "torch.compile" in text and "100.0" in text and "error" in text
    line = summary_line(r)
    assert "3 graph(s), 2 verified" in line and "failed: c" in line


def _entry(name, t, jax, tc, memory_bound=None, source="x.onnx", ok=True, ops=50, kernels=17):
    peers = {"torch_eager": None, "torch_compile": tc, "torch_compile_ro": None, "jax": jax}
    graph = {"op_by_op": ops} if memory_bound is None else {"op_by_op": ops, "memory_bound": memory_bound}
    return {"name": name, "source": source, "graph": graph, "plan": {"kernels": kernels, "launches": kernels},
            "verify": {"reference": {"ok": ok}}, "tunedb": {"us": t},
            "peers": {p: {"us": u} for p, u in peers.items()},
            "speedup": {p: (u / t if t and u else None) for p, u in peers.items()}}


def test_summary_separates_memory_bound_subgraphs_from_whole_models():
    r = {"peers": list(PEERS), "entries": [
        _entry("bert_layer b1", 150.0, 100.0, 450.0, memory_bound=False, ops=53, kernels=17),
        _entry("bert_layer b32", 1000.0, 900.0, 1500.0, memory_bound=False, ops=53, kernels=20),
        _entry("fusion_softmax_262144x128", 70.0, 140.0, 84.0, memory_bound=True),
        _entry("softmax_1024x32768", 80.0, 90.0, 100.0, source="anchor"),  # older results: no flag
        _entry("fusion_bad", 10.0, 1000.0, 1000.0, memory_bound=True, ok=False),  # wrong: left out
        _entry("fusion_no_jax", 50.0, None, 55.0, memory_bound=True),
    ]}
    s = summarize(r)
    mb = s["memory_bound"]
    assert mb["graphs"] == ["fusion_softmax_262144x128", "softmax_1024x32768", "fusion_bad", "fusion_no_jax"]
    assert mb["speedup_vs_jax"] == pytest.approx(math.sqrt(2.0 * 1.125)) and mb["n_vs_jax"] == 2
    assert mb["speedup_vs_torch_compile"] == pytest.approx((1.2 * 1.25 * 1.1) ** (1 / 3))
    assert mb["min_speedup_vs_torch_compile"] == pytest.approx(1.1) and mb["n_vs_torch_compile"] == 3
    assert [(m["name"], m["op_by_op"], m["kernels"]) for m in s["models"]] == [
        ("bert_layer b1", 53, 17), ("bert_layer b32", 53, 20)]
    assert s["models"][0]["reduction"] == pytest.approx(53 / 17)
    r["summary"] = s
    lines = summary_lines(r)
    assert lines[0].startswith("memory-bound subgraphs (4): geomean 1.50x over jax.jit (min 1.12x, 2 graphs, "
                               "target 1.5x); 1.18x over torch.compile (min 1.10x, 3 graphs, target 1.1x)")
    assert lines[1:] == ["bert_layer b1: 53 ops op by op -> 17 kernels (3.12x fewer)",
                         "bert_layer b32: 53 ops op by op -> 20 kernels (2.65x fewer)"]
    # A run without the JAX and torch.compile peers says so rather than printing blanks.
    assert "no JAX / torch.compile peer" in summary_lines({**r, "peers": ["torch_eager"]})[0]


def test_memory_bound_graphs_are_the_ones_without_compute_ops():
    from tunedb.kernels.suites import ANCHOR_CASES

    assert all(is_memory_bound(c.graph) for c in ANCHOR_CASES)
    bert, _ = load_entry(Entry("bert", "x", path=GRAPHS / "bert_layer.onnx"))
    assert not is_memory_bound(bert)


def test_cli_help_and_bench_group():
    r = invoke("bench", "--help")
    assert r.exit_code == 0 and "fusion" in r.output and "plan" in r.output
    r = invoke("bench", "plan", "--help")
    assert r.exit_code == 0
    for opt in ("--graphs", "--db", "--model", "--batch", "--bind", "--out", "--peers", "--time-limit",
                "--json"):
        assert opt in r.output


@pytest.mark.parametrize("args,msg", [
    ((), "error: nothing to run"),
    (("missing.onnx",), "error: no such model file: missing.onnx"),
    ((str(GRAPHS / "bert_layer.onnx"), "--batch", "4"), "error: bert_layer.onnx has a static batch of 1"),
    ((str(GRAPHS / "bert_layer.onnx"), "--peers", "torch,jax"), "error: unknown peer(s) torch"),
    ((str(GRAPHS / "bert_layer.onnx"), "--bind", "batch"), "error: --bind expects NAME=INT"),
    ((str(GRAPHS / "bert_layer.onnx"), "--db", "nope.duckdb"), "error: database nope.duckdb does not exist"),
])
def test_cli_argument_errors_are_one_line(args, msg, tmp_path):
    r = invoke("bench", "plan", *args, "--out", str(tmp_path / "o.json"))
    assert r.exit_code == (2 if "peer" in msg or "--bind" in msg else 1)  # 2: usage errors
    assert r.output.strip().startswith(msg), r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.json").exists()


@pytest.mark.nogpu
def test_cli_without_gpu_is_one_line_error(tmp_path):
    out = tmp_path / "p.json"
    r = invoke("bench", "plan", "--graphs", str(GRAPHS), "--out", str(out))
    assert r.exit_code == 1
    assert r.output.strip().startswith("error: no CUDA device")
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists()


# -- the translations against the reference (where torch / JAX are installed; on the CPU) ---------
def _tricky_graphs():
    out = []
    b = GraphBuilder("conv_groups_dilated")
    x, w, bias = b.input("x", (2, 4, 11, 9)), b.input("w", (6, 2, 3, 2)), b.input("bias", (6,))
    out.append(b.build([b.conv2d(x, w, bias, strides=(2, 1), pads=(0, 2, 1, 0), dilations=(1, 2), groups=2)]))
    b = GraphBuilder("pools")
    x = b.input("x", (2, 3, 9, 8))
    ys = [b.max_pool2d(x, kernel=(2, 3), strides=(2, 2), pads=(0, 1, 1, 0), dilations=(2, 1), ceil_mode=True),
          b.max_pool2d(x, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
          b.avg_pool2d(x, kernel=(3, 2), strides=(2, 2), pads=(1, 0, 0, 1), ceil_mode=True,
                       count_include_pad=False),
          b.avg_pool2d(x, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), ceil_mode=True,
                       count_include_pad=True),
          b.global_max_pool(x), b.global_avg_pool(x)]
    out.append(b.build(ys))
    b = GraphBuilder("layout")
    x = b.input("x", (7, 10))
    parts = b.split(x, axis=1, sizes=(3, 3, 4))
    ys = [b.slice(x, starts=(6, 1), ends=(-8, 10), axes=(0, 1), steps=(-2, 3)),
          b.pad(x, pads=(1, -2, 0, 3), value=0.25), b.concat(parts[2], parts[0], axis=1),
          b.transpose(x, perm=(1, 0)), b.argmax(x, axis=1, keepdims=True),
          b.reduce_prod(b.clip(x, min=-1.5, max=1.5), axes=(0,), keepdims=False)]
    out.append(b.build(ys))
    b = GraphBuilder("gemm_ints")
    a, m, c = b.input("a", (5, 4)), b.input("m", (6, 5)), b.input("c", (6,))
    i, j = b.input("i", (4, 5), "int64"), b.input("j", (4, 5), "int64")
    two, three = b.constant(np.array(2, np.int64)), b.constant(np.array(-3, np.int64))
    # i, j are 0/1: -i / (j + 2) truncates toward zero; mod is floored, with the divisor's sign
    ys = [b.gemm(a, m, c, alpha=0.5, beta=2.0, trans_a=True, trans_b=True),
          b.div(b.neg(i), b.add(j, two)), b.mod(b.neg(i), b.add(j, two)), b.mod(i, b.add(j, three)),
          b.mod(b.neg(a), b.constant(np.array(0.75, np.float32)))]
    out.append(b.build(ys))
    return out


def _run_peer(fw: str, graph, dev):
    from tunedb.bench.peers import jax_function, outputs_float64, torch_function

    if fw == "torch":
        import torch

        fn = torch_function(graph, device="cpu")
        return outputs_float64(fn(*[torch.from_numpy(dev[v]) for v in graph.inputs]))
    import jax.numpy as jnp

    return outputs_float64(jax_function(graph)(*[jnp.asarray(dev[v]) for v in graph.inputs]))


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_translations_match_the_reference(fw):
    pytest.importorskip(fw)
    graphs = _tricky_graphs() + [load_entry(Entry(p.stem, "x", path=p))[0] for p in SHIPPED[::2]]
    for g in graphs:
        dev, ref_in = make_inputs(g, 0)
        refs = run_reference(g, ref_in)
        outs = _run_peer(fw, g, dev)
        assert len(outs) == len(g.outputs)
        for o, v in zip(outs, g.outputs):
            r = refs[v]
            assert o.shape == r.shape, (g.name, v, o.shape, r.shape)
            scale = max(1.0, float(np.abs(r).max()))
            assert np.allclose(o, r, rtol=1e-4, atol=1e-4 * scale), (g.name, v, float(np.abs(o - r).max()))
