"""IOS stages: the DP against exhaustive search, the stage record, buffers and the driver."""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.multibranch import nasnet_a_graph, randwire_graph, watts_strogatz_dag
from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.record import KernelStep, Plan, PlanError
from tunedb.plan.stages import (
    StageEstimator,
    apply_stages,
    components,
    ios_search,
    operator_units,
    schedule_plan,
    search_blocks,
    split_blocks,
    stage_key,
    step_dag,
)
from tunedb.runtime.inputs import make_inputs

ROOT = Path(__file__).resolve().parents[1]
INCEPTION = ROOT / "data" / "graphs" / "ios" / "inception_v3_b1.onnx"


def random_steps(n: int, seed: int, p: float = 0.3) -> list[KernelStep]:
    """``n`` steps of a random DAG: step j reads the output of each earlier step with chance p."""
    rng = random.Random(seed)
    steps = []
    for j in range(n):
        ins = [f"v{i}" for i in range(j) if rng.random() < p] or ["x"]
        steps.append(KernelStep(kind="fused", inputs=tuple(ins), outputs=(f"v{j}",), nodes=(j,),
                                ops=("relu",), workload_hash=f"w{j}"))
    return steps


def random_cost(seed: int):
    """A stage cost that rewards some concurrency and punishes some: each group sums its members'
    weights; the stage takes the longest group, the total times a per-stage factor in [0.3, 1],
    whichever is larger, plus an overhead per extra group."""
    rng = random.Random(seed)
    w = [rng.uniform(1, 10) for _ in range(64)]

    def cost(groups):
        text = json.dumps(sorted(list(g) for g in groups))
        f = 0.3 + 0.7 * (int(hashlib.sha256(f"{seed}{text}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF)
        times = [sum(w[i] for i in g) for g in groups]
        return max(max(times), f * sum(times)) + 0.5 * (len(groups) - 1)

    return cost


def brute_force(steps, cost, r: int, s: int) -> float:
    """Exhaustive: every ending of every remaining set, checked subset by subset."""
    preds, succs = step_dag(steps)
    n = len(steps)
    memo: dict[frozenset, float] = {frozenset(): 0.0}

    def best(S: frozenset) -> float:
        if S in memo:
            return memo[S]
        members = sorted(S)
        top = float("inf")
        for mask in range(1, 1 << len(members)):
            E = {members[i] for i in range(len(members)) if mask >> i & 1}
            if any(succs[u] & (S - E) for u in E):
                continue
            groups = components(sorted(E), preds, succs)
            if len(groups) > s or any(len(g) > r for g in groups):
                continue
            top = min(top, best(S - E) + cost(groups))
        memo[S] = top
        return top

    return best(frozenset(range(n)))


@pytest.mark.parametrize("seed", range(12))
def test_dp_matches_exhaustive_search_on_small_dags(seed):
    steps = random_steps(8 + seed % 3, seed)
    cost = random_cost(seed)
    r, s = (2, 2) if seed % 2 else (3, 8)
    # one block: cuts between blocks are a heuristic that the exhaustive search does not make
    total, stages, stats = ios_search(steps, cost, r=r, s=s, max_block=64, cut_width=0, max_states=10**6)
    assert stats.blocks == 1
    assert total == pytest.approx(brute_force(steps, cost, r, s))
    # the stages it returns cost what it says, cover every step once and respect the pruning
    assert total == pytest.approx(sum(cost(st) for st in stages))
    assert sorted(i for st in stages for g in st for i in g) == list(range(len(steps)))
    assert all(len(st) <= s and all(len(g) <= r for g in st) for st in stages)
    assert stats.candidates > 0 and stats.states > 0


def test_stages_respect_dependencies_and_groups_are_independent():
    steps = random_steps(10, 3, p=0.25)
    preds, _ = step_dag(steps)
    _, stages, _ = ios_search(steps, random_cost(3), r=3, s=8)
    when = {i: k for k, st in enumerate(stages) for g in st for i in g}
    group = {i: (k, gi) for k, st in enumerate(stages) for gi, g in enumerate(st) for i in g}
    for j, ps in enumerate(preds):
        for i in ps:
            assert when[i] < when[j] or group[i] == group[j]


def test_blocks_cut_where_the_graph_narrows():
    # two diamonds joined at one step: a natural cut after the join
    steps = [KernelStep(kind="fused", inputs=ins, outputs=(o,), nodes=(k,), ops=("relu",))
             for k, (ins, o) in enumerate([(("x",), "a"), (("a",), "b"), (("a",), "c"), (("b", "c"), "d"),
                                           (("d",), "e"), (("d",), "f"), (("e", "f"), "g")])]
    preds, succs = step_dag(steps)
    assert [list(b) for b in split_blocks(len(steps), succs, preds)] == [[0], [1, 2, 3], [4, 5, 6]]
    # a block over the state budget is split again
    assert len(split_blocks(len(steps), succs, preds, max_states=3)) > 3



def test_one_block_searched_alone_is_the_whole_search_inside_it():
    # the block oracle: every block of the whole search, searched alone with only=, gives that
    # search's stages and cost; NASNet has epilogues with a second producer outside their block,
    # which a search over the block's steps alone glued to their conv (a smaller space)
    plan = compile_plan(nasnet_a_graph(1, channels=8, size=8, cells=1), device=None, cost_model=False,
                        horizontal=False)
    est = StageEstimator(plan.steps)
    total, stages, _ = ios_search(plan.steps, est)
    blocks = search_blocks(plan.steps)
    assert sorted(i for b in blocks for i in b) == list(range(len(plan.steps)))
    parts = [ios_search(plan.steps, est, only=b) for b in blocks]
    assert sum(p[0] for p in parts) == pytest.approx(total)
    assert [st for p in parts for st in p[1]] == stages
    conv_relu = next(u for u in operator_units(plan.steps, *step_dag(plan.steps)) if len(u) > 1)
    with pytest.raises(PlanError, match="cuts operator"):
        ios_search(plan.steps, est, only=conv_relu[:1])
    with pytest.raises(PlanError, match="consecutive"):
        ios_search(plan.steps, est, only=blocks[0] + blocks[2])

def _branchy_graph(batch: int = 1):
    b = GraphBuilder("branches")
    x = b.input("x", (batch, 16, 12, 12))
    outs = []
    for k in range(3):
        w = b.input(f"w{k}", (16, 16, 3, 3))
        y = b.relu(b.conv2d(x, w, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), groups=1))
        outs.append(b.mul(y, b.scalar(0.5 + k, y)))
    return b.build([b.concat(*outs, axis=1)])


def _ios_plan(graph):
    plan = compile_plan(graph, device=None, cost_model=False, horizontal=False)
    staged, info = schedule_plan(plan)
    return plan, staged, info


def test_staged_plan_round_trips_and_computes_the_graph():
    plan, staged, info = _ios_plan(_branchy_graph())
    assert any(len(st) > 1 for st in staged.stages), staged.stages
    assert info["ios_predicted_us"] < info["sequential_predicted_us"]
    again = Plan.from_json(staged.dumps())
    assert again.stages == staged.stages and again.steps == staged.steps
    again.check()
    assert [(s.stage, s.stream) for s in again.steps] == [
        (si, gi) for si, st in enumerate(again.stages) for gi, g in enumerate(st) for _ in g]
    dev, ref_in = make_inputs(staged.graph, 3)
    ref = run_reference(staged.graph, ref_in)
    got = staged.run(ref_in, backend="reference")
    for v in staged.graph.outputs:
        np.testing.assert_allclose(got[v], ref[v], rtol=1e-12)
    assert "stages (IOS)" in staged.explain() and "stage/stream" in staged.explain()
    assert "stages" not in plan.to_json()  # a plan without stages writes what it always did


def test_values_of_one_stage_never_share_bytes():
    _, staged, _ = _ios_plan(nasnet_a_graph(1, channels=8, size=8, cells=1))
    where = {v: (b, off, n) for v, b, off, n in staged.buffers.assign}
    for st in staged.stages:
        vals = [v for g in st for i in g for v in staged.steps[i].outputs + staged.steps[i].inputs
                if v in where and where[v][0] == 0]
        spans = sorted({(where[v][1], where[v][1] + where[v][2], v) for v in vals})
        roots = {}
        for lo, hi, v in spans:
            roots.setdefault((lo, hi), v)
        ranges = sorted(roots)
        for (lo1, hi1), (lo2, hi2) in zip(ranges, ranges[1:]):
            assert hi1 <= lo2 or (lo1, hi1) == (lo2, hi2), f"overlap in stage {st}"


def test_bad_stages_are_refused_in_one_line():
    _, staged, _ = _ios_plan(_branchy_graph())
    d = staged.to_json()
    wide = next(k for k, st in enumerate(d["stages"]) if len(st) > 1)
    d2 = json.loads(json.dumps(d))
    d2["stages"][wide] = [sum(d2["stages"][wide], [])[::-1]]  # one group, wrong order
    with pytest.raises(PlanError, match="plan order|stage"):
        Plan.from_json(d2).check()
    d3 = json.loads(json.dumps(d))
    d3["stages"] = [[["a"]]]
    with pytest.raises(PlanError, match="step indices"):
        Plan.from_json(d3)
    # a group that reads what another group of its stage writes
    steps = random_steps(3, 0, p=1.0)  # a chain
    g = GraphBuilder("chain")
    x = g.input("x", (4,))
    g.build([g.relu(g.relu(x))])
    with pytest.raises(PlanError, match="cover every step"):
        apply_stages(_ios_plan(_branchy_graph())[0], [((0,),)])
    assert steps[1].inputs == ("v0",)


def test_stage_key_names_what_runs_not_where():
    _, staged, _ = _ios_plan(_branchy_graph())
    st = next(st for st in staged.stages if len(st) > 1)
    assert stage_key(staged.steps, st) == stage_key(staged.steps, tuple(reversed(st)))
    assert stage_key(staged.steps, st) != stage_key(staged.steps, (tuple(i for g in st for i in g),))


def test_estimator_overlaps_small_kernels_and_not_full_ones():
    est_small = StageEstimator(_ios_plan(_branchy_graph(1))[0].steps)
    est_big = StageEstimator(_ios_plan(_branchy_graph(1024))[0].steps)
    convs = [i for i, s in enumerate(est_small.profiles) if s.share < 0.5]
    assert len(convs) >= 3
    a, b = convs[:2]
    assert est_small(((a,), (b,))) < est_small(((a,),)) + est_small(((b,),))
    # kernels that fill the GPU overlap only their launch overheads
    full = [i for i, s in enumerate(est_big.profiles) if s.share == 1.0]
    a, b = full[:2]
    kernel_us = sum(est_big.profiles[i].us - est_big.launch_us * est_big.profiles[i].kernels for i in (a, b))
    assert est_big(((a,), (b,))) >= kernel_us


def test_driver_schedules_and_refuses_unknown():
    g = _branchy_graph()
    ios = compile_plan(g, device=None, cost_model=False, schedule="ios")
    assert ios.stages and dict(ios.search)["schedule"] == "ios"
    seq = compile_plan(g, device=None, cost_model=False)
    assert not seq.stages
    auto = compile_plan(g, device=None, cost_model=False, schedule="auto")
    search = dict(auto.search)
    ios_us, seq_us = search["auto_predicted_ios_us"], search["auto_predicted_sequential_us"]
    assert (auto.stages and ios_us < 0.9 * seq_us and search["schedule"] == "ios (auto)") or (
        not auto.stages and ios_us >= 0.9 * seq_us and search["schedule"] == "sequential (auto)")
    with pytest.raises(PlanError, match="unknown schedule"):
        compile_plan(g, device=None, cost_model=False, schedule="parallel")


def test_multibranch_graphs_build_and_run_in_the_reference():
    for g in (nasnet_a_graph(1, channels=8, size=6, cells=1), randwire_graph(1, channels=4, size=5, nodes=8)):
        _, ref_in = make_inputs(g, 0)
        out = run_reference(g, ref_in)
        assert all(np.isfinite(v).all() for v in out.values())
    preds = watts_strogatz_dag(16, 4, 0.75, 0)
    assert all(all(u < v for u in ps) for v, ps in enumerate(preds))
    assert watts_strogatz_dag(16, 4, 0.75, 0) == preds and watts_strogatz_dag(16, 4, 0.75, 1) != preds


@pytest.mark.slow
def test_inception_v3_search_time_on_this_machine():
    if not INCEPTION.is_file():
        pytest.skip("data/graphs/ios/inception_v3_b1.onnx not exported")
    plan = compile_plan(str(INCEPTION), device=None, cost_model=False, horizontal=False)
    t0 = time.perf_counter()
    staged, info = schedule_plan(plan)
    seconds = time.perf_counter() - t0
    print(f"\nInception V3 IOS search: {seconds:.1f} s, {info['ios_states']} states, "
          f"{info['ios_candidates']} stage candidates, {info['ios_stages']} stages")
    assert seconds < 60
    assert len(staged.steps) == len(plan.steps) and info["ios_truncated"] == 0


def test_bench_cases_load_the_shipped_graphs():
    from tunedb.bench.stages import cases

    names = []
    for name, load in cases():
        graph, model = load()
        names.append(name)
        assert graph.inputs[0] == "x" and len(graph.outputs) == 1
        assert (model is not None) == (name.startswith(("inception", "squeezenet")))
        batch = int(name.rsplit("_b", 1)[1])
        assert graph.type_of("x").shape[0] == batch
    assert names[0] == "inception_v3_b1" and len(names) == 7
