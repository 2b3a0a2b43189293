"""Graphs with a symbolic batch dimension and the exported fusion subgraphs.

A hand-written ONNX model with a ``batch`` dim and the shape arithmetic a PyTorch export emits
for it (Shape -> Gather -> Unsqueeze -> Concat -> Reshape) imports at any batch through
``bindings``, agrees with onnxruntime, plans, and runs in ``bench plan`` at several batches. The
files ``benchmarks/export_graphs.py`` writes under ``data/graphs/dynamic`` and
``data/graphs/fusion`` are checked when they are present: batch dims, size, no weights, the
anchors' workload hashes, and LayerNorm backward against finite differences of LayerNorm.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tunedb.bench.plan import batch_bindings, collect_entries, is_memory_bound, load_entry
from tunedb.graph.hashing import graph_hash
from tunedb.graph.ir import GraphError
from tunedb.graph.onnx_import import import_onnx
from tunedb.graph.reference import example_feeds, run_reference
from tunedb.plan import compile

GRAPHS = Path(__file__).resolve().parents[1] / "data" / "graphs"
DYNAMIC = GRAPHS / "dynamic"
FUSION = GRAPHS / "fusion"


def attention_like(path: Path) -> Path:
    """[batch, 8, 16] hidden states, an int64 [batch, 8] mask; two heads of 8, softmax attention;
    every reshape target computed from Shape(hidden), as dynamic-axis exports write it."""
    c = numpy_helper.from_array
    inits = [c(np.array(0, np.int64), "zero"), c(np.array([0], np.int64), "axis0"),
             c(np.array([8, 2, 8], np.int64), "heads"), c(np.array([8, 16], np.int64), "merged"),
             c(np.array([1, 2], np.int64), "axes12"), c(np.array(1.0, np.float32), "one"),
             c(np.array(-1e4, np.float32), "neg")]
    n = helper.make_node
    nodes = [n("Shape", ["hidden"], ["s"]), n("Gather", ["s", "zero"], ["b"], axis=0),
             n("Unsqueeze", ["b", "axis0"], ["b1"]), n("Concat", ["b1", "heads"], ["shape4"], axis=0),
             n("Reshape", ["hidden", "shape4"], ["h4"]), n("Transpose", ["h4"], ["q"], perm=[0, 2, 1, 3]),
             n("Transpose", ["q"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["q", "kt"], ["scores"]),
             n("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT), n("Sub", ["one", "mf"], ["inv"]),
             n("Mul", ["inv", "neg"], ["madd"]), n("Unsqueeze", ["madd", "axes12"], ["m4"]),
             n("Add", ["scores", "m4"], ["masked"]), n("Softmax", ["masked"], ["probs"], axis=-1),
             n("MatMul", ["probs", "q"], ["ctx"]), n("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
             n("Concat", ["b1", "merged"], ["shape3"], axis=0), n("Reshape", ["ctx_t", "shape3"], ["output"])]
    ins = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", 8, 16]),
           helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", 8])]
    outs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 8, 16])]
    model = helper.make_model(helper.make_graph(nodes, "attention_like", ins, outs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _feeds(graph, seed: int) -> dict[str, np.ndarray]:
    return example_feeds(graph, seed, masked_tail=3)  # the last tokens are padding


def test_a_symbolic_batch_imports_at_any_batch_and_matches_onnxruntime(tmp_path):
    path = attention_like(tmp_path / "attn.onnx")
    assert batch_bindings(path, 3) == {"batch": 3}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ops = None
    for b in (1, 3):
        g = import_onnx(path, {"batch": b})
        assert [str(g.type_of(v)) for v in ("hidden", "output")] == [f"float32[{b},8,16]"] * 2
        # The shape arithmetic folded away: only the computation is left, the same at every batch.
        got_ops = Counter(n.op for n in g.nodes)
        assert got_ops["matmul"] == 2 and "gather" not in got_ops and "concat" not in got_ops
        assert ops is None or got_ops == ops
        ops = got_ops
        feeds = _feeds(g, b)
        want = sess.run(None, feeds)[0]
        got = run_reference(g, feeds)["output"]
        assert got.shape == want.shape == (b, 8, 16)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        plan = compile(path, device="generic", bindings={"batch": b})
        plan.check()
        assert plan.kernels < len(g.nodes)
    with pytest.raises(GraphError, match="symbolic dim 'batch'"):
        import_onnx(path)


def test_bench_entries_run_a_symbolic_model_at_each_batch(tmp_path):
    path = attention_like(tmp_path / "attn.onnx")
    entries = collect_entries([path], batches=[1, 32])
    assert [(e.name, e.bindings, e.error) for e in entries] == [("attn b1", {"batch": 1}, ""),
                                                                ("attn b32", {"batch": 32}, "")]
    g, model = load_entry(entries[1])
    assert str(g.type_of("mask")) == "int64[32,8]" and model is not None


# -- the exported files, where they are present -----------------------------------------------------
DYNAMIC_FILES = sorted(DYNAMIC.glob("*.onnx"))
FUSION_FILES = sorted(FUSION.glob("fusion_*.onnx"))
ANCHOR_NAMES = ("bias_gelu_8192x4096", "add_layernorm_8192x4096", "add_layernorm_65536x768",
                "scale_mask_softmax_8192x4096", "softmax_262144x128", "softmax_1024x32768",
                "rmsnorm_8192x4096", "transpose_add_8192x4096", "col_center_8192x4096",
                "eltwise_chain8_8192x4096", "softmax_xent_8192x4096", "swiglu_8192x4096")
NORM_BACKWARD = ("layernorm_backward_8192x4096", "layernorm_backward_65536x768")


def _needs(files: list[Path], what: str) -> None:
    if not files:
        pytest.skip(f"no {what} exported yet (benchmarks/export_graphs.py writes them)")


def test_dynamic_exports_have_a_batch_dim_and_the_static_graphs_ops():
    _needs(DYNAMIC_FILES, "dynamic-batch graphs")
    assert {p.stem for p in DYNAMIC_FILES} == {"bert_layer", "gpt2_block"}
    for p in DYNAMIC_FILES:
        assert p.stat().st_size < 200 * 1024
        model = onnx.load(str(p))
        data_inputs = [i for i in model.graph.input if i.name in ("hidden_states", "attention_mask")]
        for vi in data_inputs + list(model.graph.output):
            assert vi.type.tensor_type.shape.dim[0].dim_param == "batch", (p.name, vi.name)
        static = import_onnx(GRAPHS / p.name, fill_initializers=True)
        for b in (1, 4):
            g = import_onnx(p, {"batch": b}, fill_initializers=True)
            assert [g.type_of(v).shape[0] for v in g.inputs + g.outputs] == [b] * len(g.inputs + g.outputs)
            assert Counter(n.op for n in g.nodes) == Counter(n.op for n in static.nodes)


def test_dynamic_exports_match_onnxruntime_at_batch_2():
    _needs(DYNAMIC_FILES, "dynamic-batch graphs")
    from tunedb.graph.onnx_import import fill_model

    for p in DYNAMIC_FILES:
        g = import_onnx(p, {"batch": 2}, fill_initializers=True, seed=3)
        sess = ort.InferenceSession(fill_model(p, seed=3).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        feeds = _feeds(g, 0)
        want = sess.run(None, feeds)[0]
        got = run_reference(g, feeds)[g.outputs[0]]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))


def test_fusion_exports_are_tiny_and_hash_like_the_anchor_cases():
    _needs(FUSION_FILES, "fusion subgraphs")
    from tunedb.kernels.suites import ANCHOR_CASES

    assert {p.stem for p in FUSION_FILES} == {f"fusion_{n}" for n in ANCHOR_NAMES + NORM_BACKWARD}
    anchors = {c.name: c.graph for c in ANCHOR_CASES}
    for p in FUSION_FILES:
        assert p.stat().st_size < 8 * 1024
        model = onnx.load(str(p))
        onnx.checker.check_model(model)
        assert all(len(i.raw_data) <= 1024 for i in model.graph.initializer)
        g = import_onnx(p)
        assert is_memory_bound(g)
        name = p.stem[len("fusion_"):]
        if name in anchors:
            a = anchors[name]
            assert [str(g.type_of(v)) for v in g.inputs] == [str(a.type_of(v)) for v in a.inputs], name
            # Same workload as the suite case: the collected measurements are exact DB hits.
            assert graph_hash(g) == graph_hash(a), name
        else:
            r, c = (int(x) for x in name.rsplit("_", 1)[1].split("x"))
            assert [str(g.type_of(v)) for v in g.inputs] == [f"float32[{r},{c}]", f"float32[{c}]",
                                                             f"float32[{r},{c}]"]
            assert [str(g.type_of(v)) for v in g.outputs] == [f"float32[{r},{c}]", f"float32[{c}]",
                                                              f"float32[{c}]"]


def _shrunk(path: Path, out: Path, rows: int, cols: int) -> Path:
    """The LayerNorm-backward model at [rows, cols] (it has no shape constants to follow)."""
    m = onnx.load(str(path))
    for vi in list(m.graph.input) + list(m.graph.output):
        dims = vi.type.tensor_type.shape.dim
        for d, v in zip(dims, (rows, cols) if len(dims) == 2 else (cols,)):
            d.dim_value = v
    del m.graph.value_info[:]
    onnx.save(m, out)
    return out


def _layernorm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(axis=1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=1, keepdims=True) + eps) * g + b


@pytest.mark.parametrize("name", NORM_BACKWARD)
def test_layernorm_backward_export_is_the_gradient_of_layernorm(name, tmp_path):
    _needs(FUSION_FILES, "fusion subgraphs")
    g = import_onnx(_shrunk(FUSION / f"fusion_{name}.onnx", tmp_path / "lnb.onnx", 6, 5))
    assert [str(g.type_of(v)) for v in g.inputs] == ["float32[6,5]", "float32[5]", "float32[6,5]"]
    rng = np.random.default_rng(0)
    x, gamma, dy = rng.standard_normal((6, 5)), rng.standard_normal(5), rng.standard_normal((6, 5))
    beta = np.zeros(5)
    dx, dgamma, dbeta = (run_reference(g, {"x": x.astype(np.float32), "gamma": gamma.astype(np.float32),
                                           "dy": dy.astype(np.float32)})[v] for v in g.outputs)

    def loss(x_, g_, b_):  # <dy, layernorm(x)>: its gradients are what the backward computes
        return float((dy * _layernorm(x_, g_, b_)).sum())

    h = 1e-6
    for arr, got in ((x, dx), (gamma, dgamma), (beta, dbeta)):
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            up, dn = arr.copy(), arr.copy()
            up[i] += h
            dn[i] -= h
            args = [up if a is arr else a for a in (x, gamma, beta)]
            args_dn = [dn if a is arr else a for a in (x, gamma, beta)]
            num[i] = (loss(*args) - loss(*args_dn)) / (2 * h)
        np.testing.assert_allclose(got, num, rtol=1e-3, atol=1e-4)
