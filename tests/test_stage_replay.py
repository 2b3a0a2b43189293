"""The refinement loop that measures every operator alone first, and its replay against stored
stage times (``python -m tunedb.bench.stages --replay=ROWS.json``), on the CPU."""

from __future__ import annotations

import json
import random

import pytest

from tests.test_stages import random_steps
from tunedb.bench.stages import main as bench_main
from tunedb.bench.stages import replay
from tunedb.graph.multibranch import randwire_graph
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.stage_refine import AloneEstimator, refine_stages
from tunedb.plan.stages import StageKeys, ios_search, operator_units, step_dag


def overlap_truth(steps, seed: int):
    """Each step has a time; a group takes the sum of its steps, a stage the longest group plus
    a seeded fraction (0..0.5) of the rest, plus 1 per extra group: concurrency pays in part.
    Times follow what runs (the stage key), not where, as stored rows do."""
    keys = StageKeys(steps)
    w = [random.Random(f"{seed}{keys(((i,),))}").uniform(1, 10) for i in range(len(steps))]

    def truth(groups):
        times = sorted(sum(w[i] for i in g) for g in groups)
        frac = random.Random(f"{seed}{keys(groups)}").uniform(0.0, 0.5)
        return times[-1] + frac * sum(times[:-1]) + (len(groups) - 1)

    return truth


@pytest.mark.parametrize("seed", range(4))
def test_alone_estimator_is_a_lower_bound_and_the_loop_finds_the_oracle(seed):
    steps = random_steps(10, seed)
    truth = overlap_truth(steps, seed)
    kw = {"max_block": 64, "cut_width": 0, "max_states": 10**6}
    oracle, _, stats = ios_search(steps, truth, **kw)
    preds, succs = step_dag(steps)
    units = operator_units(steps, preds, succs)
    est = AloneEstimator(steps, {u: truth((m,)) for u, m in enumerate(units)})
    _, stages, _ = ios_search(steps, est, **kw)
    assert all(est(st) <= truth(st) + 1e-9 for st in stages)
    # a bound and no optimism scaling above 1: the loop ends at the oracle's optimum
    r = refine_stages(steps, truth, optimism=0.0, cap=1.0, max_rounds=500, search_kwargs=kw, alone=True)
    assert r.converged and r.total_us == pytest.approx(oracle)
    assert len(r.measured) < stats.candidates
    # every operator was measured alone, and those count
    assert all(StageKeys(steps)((m,)) in r.measured for m in units)


@pytest.mark.slow
def test_replay_of_a_full_table_matches_the_oracle_and_counts_what_it_measures(tmp_path, capsys):
    plan = compile_plan(randwire_graph(1, channels=8, size=8, nodes=8), device=None, cost_model=False,
                        horizontal=False)
    truth = overlap_truth(plan.steps, 3)
    keys = StageKeys(plan.steps)
    rows: dict[str, dict] = {}

    def record(groups):
        t = truth(groups)
        rows[keys(groups)] = {"groups": [list(g) for g in groups], "key": keys(groups), "status": "ok",
                              "samples_us": [t]}
        return t

    oracle, _, stats = ios_search(plan.steps, record)  # full profiling: every candidate
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"device": "synthetic", "cases": {
        "randwire_b1": {"plan": plan.to_json(), "rows": list(rows.values())},
        "partial_b1": {"plan": plan.to_json(), "rows": list(rows.values())[:3]}}}))
    res = replay(path)
    case = res["cases"]["randwire_b1"]
    assert case["oracle_us"] == pytest.approx(oracle, abs=0.01)
    assert case["candidates"] == stats.candidates
    assert 1.0 - 1e-9 <= case["refined_vs_oracle"] and 0 < case["measured"] <= len(rows)
    assert "never measured" in res["cases"]["partial_b1"]["error"]
    out = tmp_path / "replay.json"
    assert bench_main([str(out), f"--replay={path}"]) == 0
    assert json.loads(out.read_text())["cases"]["randwire_b1"]["candidates"] == stats.candidates
    capsys.readouterr()
    assert bench_main([f"--replay={tmp_path / 'missing.json'}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot replay") and "\n" not in err


def test_measured_auto_keeps_the_faster_plan_and_records_both_times():
    from tunedb.plan.stage_refine import choose_auto_measured

    plan = compile_plan(randwire_graph(1, channels=4, size=6, nodes=6), device=None, cost_model=False,
                        horizontal=False)
    staged = compile_plan(randwire_graph(1, channels=4, size=6, nodes=6), device=None, cost_model=False,
                          schedule="ios")
    assert staged.stages and not plan.stages
    slow_stages = choose_auto_measured(plan, staged, lambda p: 120.0 if p.stages else 100.0)
    assert not slow_stages.stages and dict(slow_stages.search)["auto_ios_us"] == 120.0
    # the stages must win by the margin, not by noise
    assert not choose_auto_measured(plan, staged, lambda p: 99.0 if p.stages else 100.0).stages
    fast = choose_auto_measured(plan, staged, lambda p: 80.0 if p.stages else 100.0)
    assert fast.stages and dict(fast.search)["schedule"] == "ios (auto, measured)"
    fast.check()


@pytest.mark.slow
def test_the_stage_space_study_on_the_stored_inception_times(tmp_path):
    """The claims of docs/stages.md about Inception's stage space, from the stored H200 rows."""
    from bench_scripts import load_script

    out = tmp_path / "space.json"
    assert load_script("stage_space").main([f"--out={out}"]) == 0
    doc = json.loads(out.read_text())
    sp = doc["space"]["inception_v3_b1"]
    # larger r or s does not lower the perfect-overlap bound; stages across blocks cannot pay
    assert sp["bound_r10_s8"] == pytest.approx(sp["bound_r3_s8"], rel=1e-3)
    assert sp["block_critical_paths"] == pytest.approx(sp["critical_path"])
    assert sp["critical_path"] <= sp["bound_r3_s8"] < sp["oracle"] < sp["sum_alone"]
    fit = doc["contention"]["in family (Inception)"]
    assert fit["mape_inception"] < 0.12 and fit["vs_oracle"] < 1.03
    before, after = doc["merged"]["contention_dp"]
    assert 1.0 <= before / after < 1.05  # merging same-input 1x1 convs: under 5 %
