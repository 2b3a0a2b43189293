"""The fusion generalization suite (issue 21): tunedb graphs written as ONNX and read back,
the exporter's cut into maximal memory-bound regions, and the shipped suite itself."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from bench_scripts import load_script

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.hashing import graph_hash
from tunedb.graph.onnx_export import graph_to_onnx
from tunedb.graph.onnx_import import import_onnx
from tunedb.graph.reference import run_reference
from tunedb.plan.subgraph import GraphIndex

suite_script = load_script("export_fusion_suite")


def _every_op_graph():
    b = GraphBuilder("every_op")
    x = b.input("x", (4, 6, 8), "float32")
    g = b.input("g", (8,), "float32")
    m = b.input("m", (4, 1, 8), "bool")
    i = b.input("i", (3,), "int64")
    y = b.gelu(b.layernorm(x, g, None), approximate="tanh")
    y = b.where(m, y, b.clip(b.mod(y, 0.7), min=-1.0))
    s = b.softmax(b.transpose(y, perm=(0, 2, 1)), axis=1)
    p = b.pad(b.slice(s, starts=(1,), ends=(5,), axes=(2,), steps=(1,)), pads=(0, 0, 1, 0, 0, 1), value=0.5)
    parts = b.split(b.concat(p, p, axis=1), axis=1, sizes=(3, 13))
    r = b.reduce_max(b.cast(parts[1], to="float16"), axes=(1,), keepdims=False)
    ne = b.ne(x, b.leaky_relu(x, alpha=0.1))
    gathered = b.gather(b.reshape(x, shape=(24, 8)), i, axis=0)
    pooled = b.max_pool2d(b.unsqueeze(x, axes=(0,)), kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1))
    am = b.argmax(b.squeeze(pooled, axes=(0,)), axis=2)
    e = b.rsqrt(b.abs(b.expand(b.unsqueeze(g, axes=(0,)), shape=(3, 8))))
    return b.build([r, ne, gathered, am, b.sqrt(b.reduce_mean(b.exp(e), axes=None))])


def test_graph_to_onnx_reads_back_to_the_same_computation():
    graph = _every_op_graph()
    model = graph_to_onnx(graph)
    back = import_onnx(model)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 6, 8)).astype(np.float32),
             "g": rng.standard_normal(8).astype(np.float32), "m": rng.random((4, 1, 8)) < 0.5,
             "i": np.array([0, 23, 5], np.int64)}
    want = run_reference(graph, feeds)
    got = run_reference(back, feeds)
    ort_out = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, bk, o in zip(graph.outputs, back.outputs, ort_out):
        np.testing.assert_allclose(got[bk], want[a], rtol=1e-12, atol=1e-12)
        tol = 1e-3 if o.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(o.astype(np.float64), want[a], rtol=tol, atol=tol)
    # Read back twice, the same workload: the ONNX spelling is a fixed point.
    assert graph_hash(import_onnx(graph_to_onnx(back))) == graph_hash(back)


def test_rsqrt_and_ne_read_back_as_themselves():
    b = GraphBuilder("spelled")
    x = b.input("x", (8, 16), "float32")
    y = b.where(b.ne(x, b.scalar(0.0, x)), b.rsqrt(b.abs(x)), x)
    graph = b.build([y, b.sqrt(x)])
    back = import_onnx(graph_to_onnx(graph))
    assert graph_hash(back) == graph_hash(graph)
    assert {n.op for n in back.nodes} >= {"rsqrt", "ne"} and "reciprocal" not in {n.op for n in back.nodes}


def _block():
    """matmul -> bias+gelu -> matmul -> residual add + layernorm, and a column sum of x."""
    b = GraphBuilder("block")
    x = b.input("x", (64, 256), "float32")
    w1, w2 = b.input("w1", (256, 512), "float32"), b.input("w2", (512, 256), "float32")
    bias, g = b.input("b", (512,), "float32"), b.input("g", (256,), "float32")
    h = b.gelu(b.add(b.matmul(x, w1), bias))
    y = b.layernorm(b.add(b.matmul(h, w2), x), g, None)
    col = b.reduce_sum(b.mul(x, x), axes=(0,))
    row = b.reduce_max(x, axes=(1,))
    return b.build([y, col, row])


def test_regions_are_the_memory_bound_work_between_compute_ops():
    graph = _block()
    regions = suite_script.memory_bound_regions(graph)
    ops = [sorted({graph.nodes[j].op for j in r}) for r in regions]
    assert ["add", "gelu"] in ops  # the bias epilogue of the first matmul
    # The residual add and the layer norm after the second matmul are one region ...
    assert any({"add", "reduce_mean", "rsqrt"} <= set(o) for o in ops)
    # ... and the two reductions of x are one multi-output region (siblings reading x).
    assert ["mul", "reduce_max", "reduce_sum"] in ops
    assert sum(len(r) for r in regions) == sum(1 for n in graph.nodes if n.op != "matmul")
    ix = GraphIndex(graph)
    for r in regions:  # each is a graph of its own, no matmul inside
        assert "matmul" not in {n.op for n in ix.cut(r).graph.nodes}


def test_depthwise_conv_and_pool_count_as_memory_bound():
    b = GraphBuilder("dw")
    x = b.input("x", (2, 8, 10, 10), "float32")
    dw = b.conv2d(x, b.input("w", (8, 1, 3, 3), "float32"), pads=(1, 1, 1, 1), groups=8)
    y = b.relu(b.add(dw, b.input("bias", (1, 8, 1, 1), "float32")))
    z = b.conv2d(b.avg_pool2d(y, kernel=(2, 2), strides=(2, 2)), b.input("w2", (4, 8, 1, 1), "float32"))
    graph = b.build([b.sigmoid(z)])
    regions = [sorted({graph.nodes[j].op for j in r}) for r in suite_script.memory_bound_regions(graph)]
    assert ["add", "avg_pool2d", "conv2d", "relu"] in regions and ["sigmoid"] in regions


def test_kinds_name_the_pattern():
    assert suite_script.kind_of({"exp", "reduce_max", "reduce_sum", "div"}) == "softmax"
    assert suite_script.kind_of({"reduce_mean", "rsqrt", "mul"}) == "norm"
    assert suite_script.kind_of({"slice", "concat", "mul"}) == "data_movement"
    assert suite_script.kind_of({"add", "gelu"}) == "elementwise"
    assert suite_script.kind_of({"conv2d", "relu"}) == "windowed"


@pytest.mark.parametrize("bad", ["nope"])
def test_graph_to_onnx_refuses_an_output_that_is_an_input(bad):
    b = GraphBuilder("passthrough")
    x = b.input("x", (2, 3), "float32")
    graph = b.build([x])
    with pytest.raises(Exception, match="output"):
        graph_to_onnx(graph)


def test_the_shipped_suite_loads_with_the_hashes_of_its_manifest():
    from tunedb.kernels.suite_generalization import manifest
    from tunedb.kernels.suites import suite

    cases = suite("generalization")
    entries = manifest()["workloads"]
    assert len(cases) >= 80 and len(cases) == len(entries)
    assert len({c.name for c in cases}) == len(cases)
    hashes = [graph_hash(c.graph) for c in cases]
    assert hashes == [w["hash"] for w in entries] and len(set(hashes)) == len(hashes)
    assert all(c.family == f"gen_{w['kind']}" and w["sources"] for c, w in zip(cases, entries))
    # Several shapes of one pattern: batch 1 and a serving batch of the same model.
    sources = {s for w in entries for s in w["sources"]}
    assert any("_b1_" in s for s in sources) and any("_b16_" in s for s in sources)


def test_a_missing_suite_folder_is_one_line(tmp_path, monkeypatch):
    from tunedb.kernels import suite_generalization

    monkeypatch.setenv(suite_generalization.DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError) as e:
        suite_generalization.generalization_cases()
    assert "manifest" in str(e.value) and "\n" not in str(e.value)


def test_tiers_split_the_suite_by_floor():
    from tunedb.kernels.suite_generalization import generalization_cases

    big = generalization_cases(tier="bandwidth")
    small = generalization_cases(tier="launch")
    assert len(big) >= 80 and len(big) + len(small) == len(generalization_cases())
    assert min(g.floor_bytes() for _, _, g in big) >= suite_script.BANDWIDTH_TIER_BYTES
    assert max(g.floor_bytes() for _, _, g in small) < suite_script.BANDWIDTH_TIER_BYTES
    with pytest.raises(ValueError, match="unknown tier"):
        generalization_cases(tier="huge")


def test_report_tables_cover_every_workload():
    from tunedb.kernels.suite_generalization import manifest, suite_dir

    text = suite_script.report(suite_dir())
    total = len(manifest()["workloads"])
    assert f"| all | {total} |" in text
    assert "| ops (one workload) | kernels today |" in text


def test_the_smallest_workload_of_each_kind_runs_in_onnxruntime_as_in_the_reference():
    """The stored ONNX is what the reference computes: onnxruntime agrees on real patterns
    (the smallest workload per kind and dtypes, under 1 MiB; all 189 under 8 MiB agreed when
    written)."""
    from tunedb.kernels.suite_generalization import manifest, suite_dir
    from tunedb.runtime.inputs import make_inputs

    picks: dict[tuple, dict] = {}
    for w in sorted(manifest()["workloads"], key=lambda w: w["floor_bytes"]):
        # Seconds, not minutes, on two cores; onnxruntime has no bfloat16 kernels on the CPU.
        if w["floor_bytes"] <= 2**20 and "bfloat16" not in w["dtypes"]:
            picks.setdefault((w["kind"], tuple(w["dtypes"])), w)
    assert len(picks) >= 6
    for w in picks.values():
        path = suite_dir() / w["file"]
        graph = import_onnx(path)
        _, ref = make_inputs(graph, seed=1)
        want = run_reference(graph, ref)
        feeds = {v: ref[v].astype(np.float16 if graph.type_of(v).dtype == "float16" else np.float32)
                 if ref[v].dtype.kind == "f" else ref[v] for v in graph.inputs}
        got = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"]).run(None, feeds)
        for v, y in zip(graph.outputs, got):
            r = want[v]
            if r.dtype.kind != "f":
                np.testing.assert_array_equal(y, r)
                continue
            tol = 2e-2 if "float16" in w["dtypes"] else 1e-4
            scale = max(1.0, float(np.nanmax(np.abs(r[np.isfinite(r)]), initial=0.0)))
            finite = np.isfinite(r)
            assert np.array_equal(finite, np.isfinite(y)), w["name"]
            np.testing.assert_allclose(y[finite].astype(np.float64), r[finite], rtol=tol, atol=tol * scale,
                                       err_msg=w["name"])


def test_suites_listing_survives_a_missing_suite_folder(tmp_path, monkeypatch, capsys):
    import json

    from tunedb.cli.catalog import suites
    from tunedb.kernels import suite_generalization
    from tunedb.kernels import suites as suite_lib

    monkeypatch.setattr(suite_lib, "SUITES", ("anchors", "generalization"))
    monkeypatch.setenv(suite_generalization.DIR_ENV, str(tmp_path))
    suites(json_out=True)
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["anchors"]["workloads"] == 12 and rows["generalization"]["workloads"] == 0
    assert "unavailable" in rows["generalization"]["families"][0]


def test_bench_plan_takes_the_suite_folder_without_its_manifest():
    from tunedb.bench.plan import collect_entries
    from tunedb.kernels.suite_generalization import manifest, suite_dir

    entries = collect_entries([], suite_dir(), anchors=False)
    assert len(entries) == len(manifest()["workloads"])
    assert all(e.path.suffix == ".onnx" for e in entries)


def test_coverage_audit_flags_copies_splits_and_traffic():
    audit = load_script("generalization_coverage").audit
    from tunedb.kernels.suite_generalization import suite_dir

    ok = audit(suite_dir() / "elementwise_llama_b8_s512_f93794d5.onnx")
    assert (ok["kernels"], ok["launches"], ok["flags"]) == (1, 1, [])
    assert ok["planned_bytes"] == ok["floor_bytes"]
    # ViT's patch tokens: a transpose copy before the concat and LayerNorm (cause G)
    vit = audit(suite_dir() / "norm_vit_b16_s128_8ad28feb.onnx")
    assert vit["kernels"] == 2 and vit["flags"] == ["split", "copy:transpose", "traffic"]
    assert 1.6 < vit["planned_bytes"] / vit["floor_bytes"] < 1.7
    # UNet's nearest upsample (two gathers at indices that are graph inputs, were 2 copies and
    # 2x the floor's bytes): one window kernel with the residual add (gen_resample)
    up = audit(suite_dir() / "data_movement_unet_320x32_b8_6857b207.onnx")
    assert (up["kernels"], up["flags"], up["planned_bytes"]) == (1, [], up["floor_bytes"])


@pytest.mark.slow
def test_tier_run_plans_on_the_cpu_and_resumes(tmp_path):
    import json

    bench = load_script("bench_generalization")
    paths = bench.suite_paths(bench.TIER_KINDS)
    assert len(paths) == 153 and {p.name.split("_")[0] for p in paths[:6]} >= {"norm", "windowed"}
    small = sorted(paths, key=lambda p: p.stat().st_size)[:2]
    first = tmp_path / "first.json"
    res = bench.run_tier(first, 2, 300, True, tmp_path / "lock", paths=small)
    assert res["complete"] and len(res["entries"]) == 2
    for e in res["entries"]:
        assert e["plan"]["kernels"] >= 1 and e["floor_us"] == e["floor_bytes"] / 4.8e6
    # a second call keeps what the first finished and runs only the rest
    again = bench.run_tier(tmp_path / "second.json", 1, 300, True, tmp_path / "lock",
                           paths=small + paths[-1:], resume=first)
    names = [e["name"] for e in json.loads((tmp_path / "second.json").read_text())["entries"]]
    assert names[:2] == [e["name"] for e in res["entries"]] and names[2] == paths[-1].stem
    assert again["resumed_from"]["kept"] == 2


def test_tier_table_ranks_verified_workloads_against_floor_and_peers():
    bench = load_script("bench_generalization")
    ok = {"reference": {"ok": True}}

    def entry(name, us, floor, compile_us, jax_us, verified=ok):
        return {"name": name, "tunedb": {"us": us}, "floor_us": floor, "verify": verified,
                "plan": {"kernels": 1}, "peers": {"torch_compile": {"us": compile_us},
                                                  "jax": {"us": jax_us}, "torch_eager": {"us": None}}}

    result = {"entries": [entry("fast", 10.0, 9.0, 20.0, 15.0), entry("slow", 40.0, 10.0, 30.0, 50.0),
                          entry("wrong", 1.0, 9.0, 20.0, 15.0, {"reference": {"ok": False}})]}
    lines = bench.tier_table(result)
    rows = [ln for ln in lines if ln.startswith("| fast") or ln.startswith("| slow")]
    assert rows[0].startswith("| slow |") and "| 0.25 |" in rows[0] and "0.75×" in rows[0]
    assert "wrong" not in "\n".join(lines)  # an output that failed verification is not timed
    summary = lines[-1]
    assert "2 of 3 workloads verified and timed" in summary and "1 below 0.5" in summary
    assert "geomean 0.474 of the floor" in summary and "(1 behind)" in summary


def test_against_table_puts_each_workload_beside_its_first_earlier_timing():
    bench = load_script("bench_generalization")

    def entry(name, us, ok=True, kernels=1):
        return {"name": name, "tunedb": {"us": us}, "floor_us": 10.0, "plan": {"kernels": kernels},
                "verify": {"reference": {"ok": ok}}, "peers": {"torch_eager": {"us": 50.0}}}

    new = {"entries": [entry("a", 20.0), entry("b", 12.5), entry("c", 10.0), entry("d", 5.0, ok=False)]}
    newer = {"entries": [entry("a", 40.0, kernels=3), entry("b", 25.0, ok=False)]}  # b failed there
    older = {"entries": [entry("b", 50.0), entry("d", 10.0)]}
    lines = bench.against_table(new, [newer, older])
    rows = {ln.split(" | ")[0][2:]: ln for ln in lines if ln.startswith("| ") and " | " in ln[2:]}
    assert "| 3, 1 | 40.0 | 20.0 | 0.50 | 0.25, 0.50 | 50.0, 50.0 |" in rows["a"]
    assert "| 50.0 | 12.5 | 0.25 |" in rows["b"]  # the older run, where the newer one failed
    assert "c" not in rows and "d" not in rows  # never timed before; not verified now
    assert lines[-1].startswith("\n2 workloads timed in both: geomean of the floor 0.224 then, 0.632 now")


def test_merged_tier_keeps_each_workloads_newest_verified_timing():
    bench = load_script("bench_generalization")

    def entry(name, us, ok=True):
        return {"name": name, "tunedb": {"us": us}, "floor_us": 10.0, "verify": {"reference": {"ok": ok}}}

    newest = {"entries": [entry("a", 20.0), entry("b", 5.0, ok=False)]}
    older = {"entries": [entry("a", 40.0), entry("b", 25.0), entry("c", 12.5)]}
    got = {e["name"]: e["tunedb"]["us"] for e in bench.merged([newest, older])["entries"]}
    assert got == {"a": 20.0, "b": 25.0, "c": 12.5}  # b failed verification in the newest run
    assert "3 of 3 workloads verified and timed: geomean 0.543" in bench.tier_table(
        bench.merged([newest, older]))[-1]


def test_tier_only_picks_named_workloads_and_refuses_unknown_names():
    bench = load_script("bench_generalization")
    tier = bench.suite_paths(bench.TIER_KINDS)
    names = [tier[5].stem, tier[0].stem]
    assert [p.stem for p in bench.only_paths(names)] == [tier[0].stem, tier[5].stem]  # tier order
    assert bench.only_paths(None) is None
    with pytest.raises(SystemExit, match="not bandwidth-tier workloads: nonesuch"):
        bench.only_paths([tier[0].stem, "nonesuch"])
