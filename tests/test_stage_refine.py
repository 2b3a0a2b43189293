"""The measured-refinement loop of the IOS search, against full profiling (the oracle), on CPU
with synthetic 'measured' stage times (the GPU version is in tunedb/bench/stages.py)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.test_stages import random_cost, random_steps
from tunedb.graph.multibranch import nasnet_a_graph
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.stage_refine import refine_stages
from tunedb.plan.stages import StageEstimator, StageKeys, ios_search


@pytest.fixture
def window_config_of_the_stored_runs(monkeypatch):
    """The stage keys name each step's schedule; the stored runs and the seeded truths below were
    made before window kernels took fast math, so their plans are built with that config."""
    monkeypatch.setattr("tunedb.plan.cost.WINDOW_CONFIG", {"mapping": "elementwise", "block": 256})



def _truth(steps, seed: int, sigma: float = 0.15):
    """Stage times the estimate does not know: wider stages cost more than predicted (x1.25 to
    x1.6), and every stage has its own log-normal error."""
    est, keys = StageEstimator(steps), StageKeys(steps)
    bias = [1.0, 1.25, 1.4, 1.6]

    def truth(groups):
        h = int(hashlib.sha256(f"{seed}{keys(groups)}".encode()).hexdigest()[:12], 16)
        noise = float(np.exp(sigma * np.random.default_rng(h).standard_normal()))
        return est(groups) * bias[min(len(groups), 4) - 1] * noise

    return truth


@pytest.mark.parametrize("seed", range(6))
def test_with_a_lower_bound_the_loop_finds_the_oracle_schedule(seed):
    steps = random_steps(10, seed)
    truth = random_cost(seed)

    def bound(groups):  # never above the truth
        return 0.85 * truth(groups)

    oracle, _, stats = ios_search(steps, truth, max_block=64, cut_width=0, max_states=10**6)
    kw = {"max_block": 64, "cut_width": 0, "max_states": 10**6}
    r = refine_stages(steps, truth, estimator=bound, optimism=0.0, cap=1.0, max_rounds=500,
                      search_kwargs=kw)
    assert r.converged
    assert r.total_us == pytest.approx(oracle)
    assert sum(truth(st) for st in r.stages) == pytest.approx(oracle)
    assert len(r.measured) < stats.candidates


@pytest.mark.slow
def test_refinement_measures_few_stages_and_beats_predictions_alone(window_config_of_the_stored_runs):
    plan = compile_plan(nasnet_a_graph(1, cells=1), device=None, cost_model=False, horizontal=False)
    est = StageEstimator(plan.steps)
    closed = []
    for seed in range(3):
        truth = _truth(plan.steps, seed)
        oracle, _, stats = ios_search(plan.steps, truth)
        _, predicted, _ = ios_search(plan.steps, est)
        r = refine_stages(plan.steps, truth, max_rounds=40)
        refined = sum(truth(st) for st in r.stages)
        by_prediction = sum(truth(st) for st in predicted)
        assert refined == pytest.approx(r.total_us)  # every stage of the result was measured
        assert refined <= by_prediction + 1e-9
        assert len(r.measured) <= 0.1 * stats.candidates
        # each stage's own 15 % noise is no bound the loop can lean on: close to full profiling,
        # not at it (this plan: 1.000-1.043), but most of the predicted schedule's gap is closed
        assert refined <= 1.06 * oracle
        closed.append((by_prediction - refined) / (by_prediction - oracle))
        print(f"\nseed {seed}: refined/oracle {refined / oracle:.4f}, predicted/oracle "
              f"{by_prediction / oracle:.4f}, measured {len(r.measured)} of {stats.candidates} candidates, "
              f"{len(r.rounds)} rounds")
    assert min(closed) >= 0.5 and sum(closed) / len(closed) >= 0.7


@pytest.mark.slow
@pytest.mark.parametrize("oracle", ["block", "full"])
def test_bench_refine_bookkeeping_with_synthetic_times(oracle):
    import time

    from tunedb.bench.stages import refine

    plan = compile_plan(nasnet_a_graph(1, channels=8, size=8, cells=1), device=None, cost_model=False,
                        horizontal=False)
    truth = _truth(plan.steps, 0)
    out = refine(plan, lambda msg: None, time.perf_counter() + 300, oracle, time_stage=truth)
    assert out["measured"] == len({r["key"] for r in out["stage_rows"]}) > 0
    assert out["refined_us_sum"] == pytest.approx(sum(truth(tuple(map(tuple, st))) for st in out["stages"]),
                                                  abs=0.01)
    res = out["oracle_full" if oracle == "full" else "oracle_block"]
    assert res["complete"]
    # the block oracle searches the refinement's own block with the whole plan's operators, so
    # the refined stages cover it and cannot beat it (they did when it re-derived operators from
    # the block's steps alone, gluing epilogues whose other producer lies outside)
    assert oracle == "full" or res["comparable"]
    assert res["refined_vs_oracle"] >= 1 - 1e-9
    if oracle == "full":
        oracle_us, _, _ = ios_search(plan.steps, truth)
        assert res["oracle_us"] == pytest.approx(oracle_us, abs=0.01)


@pytest.mark.parametrize("seed", range(3))
def test_top_schedules_are_the_loops_best_distinct_schedules_measured_in_full(seed):
    from tunedb.plan.stage_refine import top_schedules

    steps = random_steps(16, seed)
    truth = random_cost(seed)
    keys = StageKeys(steps)

    def estimate(groups):  # off by x0.5 to x1.3, so the loop wanders through several schedules
        h = int(hashlib.sha256(keys(groups).encode()).hexdigest()[:8], 16)
        return truth(groups) * (0.5 + 0.8 * (h % 1000) / 1000)

    r = refine_stages(steps, truth, estimator=estimate, max_rounds=60)
    top = top_schedules(r, 4)
    assert len(top) == 4 and len(r.schedules) > 4
    assert top[0][0] == pytest.approx(r.total_us)  # the loop's winner first
    assert [t for t, _ in top] == sorted(t for t, _ in top)
    shapes = {tuple(tuple(sorted(tuple(sorted(g)) for g in st)) for st in stages) for _, stages in top}
    assert len(shapes) == len(top)  # distinct schedules
    for total, stages in top:  # each measured in full, its sum the measured sum
        assert all(keys(st) in r.measured for st in stages)
        assert total == pytest.approx(sum(truth(st) for st in stages))
        assert sorted(i for st in stages for g in st for i in g) == list(range(len(steps)))
    assert top_schedules(r, 0) == []
