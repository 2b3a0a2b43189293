"""IOS stages on the GPU: the multi-stream CUDA graph computes what the sequential plan does."""

from __future__ import annotations

import numpy as np
import pytest

from tunedb.graph.multibranch import nasnet_a_graph
from tunedb.graph.reference import run_reference
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.tolerance import check_host, tolerance

pytestmark = pytest.mark.gpu


def _check(graph, outs, ref_in):
    refs = run_reference(graph, ref_in)
    for v in graph.outputs:
        ok, err = check_host(np.asarray(outs[v]), refs[v], tolerance(graph, graph.type_of(v).dtype))
        assert ok, f"{graph.name} {v}: max abs error {err:.3g}"


def test_staged_plan_captures_forked_streams_and_matches_the_reference():
    import cupy as cp

    from tunedb.plan.driver import compile as compile_plan
    from tunedb.plan.record import Plan
    from tunedb.runtime.stage_exec import StagedExecutor

    g = nasnet_a_graph(1, channels=16, size=14, cells=1)
    plan = compile_plan(g, device="cuda", schedule="ios")
    assert any(len(st) > 1 for st in plan.stages)
    ex = StagedExecutor(plan)
    assert ex.graph_capture, ex.capture_error
    assert ex.summary()["streams"] > 1 and not ex.fallbacks
    dev, ref_in = make_inputs(g, 5)
    first = {k: cp.asnumpy(v) for k, v in ex.run(dev).items()}
    _check(g, first, ref_in)
    again = StagedExecutor(Plan.from_json(plan.dumps()))  # a plan loaded from JSON replays exactly
    second = {k: cp.asnumpy(v) for k, v in again.run(dev).items()}
    for v in first:
        assert np.array_equal(first[v], second[v])
    for _ in range(20):  # replays on the forked streams keep giving the same answer
        ex.replay()
    ex.synchronize()
    third = {k: cp.asnumpy(v) for k, v in ex.outputs().items()}
    for v in first:
        assert np.array_equal(first[v], third[v])


def test_harness_times_one_stage_of_any_groups():
    from dataclasses import replace

    from tunedb.plan.buffers import plan_buffers
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.plan.stages import StageEstimator, ios_search
    from tunedb.runtime.stage_exec import StagedExecutor

    g = nasnet_a_graph(1, channels=16, size=14, cells=1)
    base = compile_plan(g, device="cuda", horizontal=False)
    sep = replace(base, buffers=plan_buffers(base.graph, base.steps, times=[0] * len(base.steps)))
    ex = StagedExecutor(sep, stage_streams=3, capture=False)
    _, stages, _ = ios_search(base.steps, StageEstimator(base.steps), s=3)
    wide = next(st for st in stages if len(st) > 1)
    alone = [ex.time_stage((grp,)) for grp in wide]
    together = ex.time_stage(wide)
    assert all(t > 0 for t in alone) and together > 0
    ex.close_streams()


def test_plan_run_uses_the_staged_executor():
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime import executor

    g = nasnet_a_graph(1, channels=8, size=8, cells=1)
    plan = compile_plan(g, device="cuda", schedule="ios")
    dev, ref_in = make_inputs(g, 2)
    _check(g, plan.run(dev), ref_in)
    ex = executor._CACHE[id(plan)][1]  # one cache for plain, staged and packed plans
    assert ex.graph_capture and ex.summary()["streams"] > 1


def test_depthwise_kernel_and_bias_epilogue_match_the_reference():
    from tunedb.graph.builder import GraphBuilder
    from tunedb.plan.driver import compile as compile_plan

    b = GraphBuilder("dw_bias")
    x = b.input("x", (2, 12, 15, 13))
    dw = b.conv2d(x, b.input("wd", (12, 1, 5, 5)), b.input("bd", (12,)), strides=(2, 2), pads=(2, 2, 2, 2),
                  dilations=(1, 1), groups=12)
    y = b.relu(b.conv2d(dw, b.input("wp", (20, 12, 3, 3)), b.input("bp", (20,)), strides=(1, 1),
                        pads=(1, 1, 1, 1), dilations=(1, 1), groups=1))
    g = b.build([y])
    dev, ref_in = make_inputs(g, 7)
    for schedule in ("sequential", "ios"):
        plan = compile_plan(g, device="cuda", schedule=schedule, bias_epilogue=True)
        # the 3x3 conv's bias joined the ReLU; the depthwise conv keeps its own (its kernel adds
        # it: the generated window kernel's step, kind fused)
        assert any("add" in s.ops and "relu" in s.ops for s in plan.steps)
        assert sum("conv2d" in s.ops and len(s.inputs) == 3 for s in plan.steps) == 1
        _check(g, plan.run(dev), ref_in)


def test_the_stage_collector_times_every_candidate_of_a_small_graph(tmp_path):
    import json

    from typer.testing import CliRunner

    from tunedb.bench.stages import candidates
    from tunedb.cli import app
    from tunedb.store import TuningStore

    doc = candidates(["randwire_b1"])
    case = doc["cases"]["randwire_b1"]
    case["rows"] = case["rows"][:40]
    suite = tmp_path / "candidates.json"
    suite.write_text(json.dumps(doc))
    db = tmp_path / "stage.duckdb"
    args = ["collect", "--collector", "stage", "--suite", str(suite), "--device", "cuda", "--db", str(db),
            "--json"]
    res = CliRunner().invoke(app, args, env={"TUNEDB_DB": None, "XDG_DATA_HOME": None})
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["measured"] == out["total"] > 0 and out["statuses"].get("ok") == out["measured"]
    with TuningStore.open(db, read_only=True) as store:
        times = [m.median_us for m in store.measurements() if m.status == "ok"]
    assert len(times) == out["measured"] and all(0 < t < 10_000 for t in times)


def test_the_bench_times_an_identical_plan_once_and_only_verified_plans():
    from dataclasses import replace

    from tunedb.bench.stages import time_plans
    from tunedb.plan.driver import compile as compile_plan

    g = nasnet_a_graph(1, channels=16, size=14, cells=1)
    dev, ref_in = make_inputs(g, 5)
    refs = run_reference(g, ref_in)
    ios = compile_plan(g, device="cuda", schedule="ios", bias_epilogue=True)
    again = replace(ios, search=(("schedule", "ios (again)"),))  # another record, the same plan
    seq = compile_plan(g, device="cuda", schedule="sequential", bias_epilogue=True)
    recs = time_plans({"ios": ios, "sequential": seq, "again": again}, dev, refs, None, g, rounds=2)
    assert recs["ios"]["verify"]["reference"]["ok"] and recs["sequential"]["verify"]["reference"]["ok"]
    assert len(recs["ios"]["rounds_us"]) == len(recs["sequential"]["rounds_us"]) == 2
    assert 0 < recs["ios"]["us"] < 10_000 and 0 < recs["sequential"]["us"] < 10_000
    assert recs["again"]["same_plan_as"] == "ios" and recs["again"]["us"] == recs["ios"]["us"]
    assert "verify" not in recs["again"] and "rounds_us" not in recs["again"]
    # a plan whose outputs are wrong is reported, never timed
    wrong = {**refs, g.outputs[0]: refs[g.outputs[0]] + 1.0}
    bad = time_plans({"ios": ios}, dev, wrong, None, g, rounds=1)["ios"]
    assert bad["us"] is None and "differ" in bad["error"]


@pytest.mark.parametrize("graph,joins,priority", [
    ("nasnet", "dataflow", False), ("randwire", "dataflow", False), ("nasnet", "dataflow", True),
    ("nasnet", "stage", True)])
def test_dataflow_joins_replay_the_staged_plan_exactly(graph, joins, priority):
    """``joins="dataflow"`` (no barrier between stages, buffers reused across them) and the
    priority stream give the stage-barrier executor's outputs (each step may sit on another
    stream's cuBLAS handle), and the same bits replay after replay."""
    import cupy as cp

    from tunedb.graph.multibranch import randwire_graph
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime.stage_exec import StagedExecutor

    g = nasnet_a_graph(1) if graph == "nasnet" else randwire_graph(1)
    plan = compile_plan(g, device="cuda", schedule="ios")
    barrier = StagedExecutor(plan, joins="stage")
    flow = StagedExecutor(plan, joins=joins, priority=priority)
    assert flow.graph_capture, flow.capture_error
    assert flow.summary()["joins"] == joins and flow.summary()["priority"] == priority
    dev, ref_in = make_inputs(g, 5)
    want = {k: cp.asnumpy(v) for k, v in barrier.run(dev).items()}
    _check(g, want, ref_in)
    got = {k: cp.asnumpy(v) for k, v in flow.run(dev).items()}
    _check(g, got, ref_in)
    for _ in range(50):
        flow.replay()
    flow.synchronize()
    again = {k: cp.asnumpy(v) for k, v in flow.outputs().items()}
    for v in want:
        assert np.allclose(got[v], want[v], rtol=1e-5, atol=1e-6) and np.array_equal(got[v], again[v])


@pytest.mark.parametrize("schedule", ["ios", "sequential"])
def test_l2_prefetch_gives_the_same_bits(schedule):
    """``prefetch=True`` (the next stage's weights into L2 on a side stream) captures one graph
    and computes what it computes without, the same bits replay after replay."""
    import cupy as cp

    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime.stage_exec import StagedExecutor

    g = nasnet_a_graph(1)
    plan = compile_plan(g, device="cuda", schedule=schedule)
    plain = StagedExecutor(plan, joins="stage")
    pf = StagedExecutor(plan, joins="stage", prefetch=True)
    assert pf.graph_capture, pf.capture_error
    assert pf.summary()["prefetch_bytes"] > 0 and plain.summary()["prefetch_bytes"] == 0
    dev, ref_in = make_inputs(g, 5)
    want = {k: cp.asnumpy(v) for k, v in plain.run(dev).items()}
    got = {k: cp.asnumpy(v) for k, v in pf.run(dev).items()}
    _check(g, got, ref_in)
    for _ in range(50):
        pf.replay()
    pf.synchronize()
    again = {k: cp.asnumpy(v) for k, v in pf.outputs().items()}
    for v in want:
        assert np.allclose(got[v], want[v], rtol=1e-5, atol=1e-6) and np.array_equal(got[v], again[v])
