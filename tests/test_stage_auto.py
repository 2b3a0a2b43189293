"""``schedule="auto"``: stored stage times decide when they cover both plans (or most of both,
the rest predicted and scaled), else predictions with a margin; replayed against the H200 runs'
measured sequential and IOS times."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunedb.bench.stages import auto_replay
from tunedb.graph.multibranch import randwire_graph
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.stage_refine import (
    AUTO_MARGIN,
    AUTO_PREDICTED_MARGIN,
    AUTO_STORED_COVER,
    choose_auto,
    plan_stages,
    predicted_total,
    stored_total,
)
from tunedb.plan.stages import StageKeys, schedule_plan

BENCH = Path(__file__).resolve().parents[1] / "data" / "bench" / "stages_h200_v2.json"
BENCH_V3 = BENCH.with_name("stages_h200_v3.json")

@pytest.fixture
def window_config_of_the_stored_runs(monkeypatch):
    """The stage keys name each step's schedule; the stored runs and the seeded truths below were
    made before window kernels took fast math, so their plans are built with that config."""
    monkeypatch.setattr("tunedb.plan.cost.WINDOW_CONFIG", {"mapping": "elementwise", "block": 256})



def _plans():
    seq = compile_plan(randwire_graph(1, channels=4, size=6, nodes=10), device=None, cost_model=False,
                       horizontal=False)
    staged, _ = schedule_plan(seq)
    assert any(len(st) > 1 for st in staged.stages)
    return seq, staged


def _table(plan, stage_us: float, wide_us: float) -> dict[str, float]:
    keys = StageKeys(plan.steps)
    return {keys(st): (wide_us if len(st) > 1 else stage_us) for st in plan_stages(plan)}


@pytest.mark.parametrize("wide_us, expect_stages", [(30.0, False), (1.0, True)])
def test_stored_times_of_both_plans_decide(wide_us, expect_stages):
    seq, staged = _plans()
    stored = {**_table(seq, 5.0, 5.0), **_table(staged, 5.0, wide_us)}
    got = choose_auto(seq, staged, stored)
    search = dict(got.search)
    assert bool(got.stages) == expect_stages
    assert search["schedule"] == f"{'ios' if expect_stages else 'sequential'} (auto, stored)"
    assert stored_total(seq, stored)[1] == stored_total(staged, stored)[1] == 1.0  # all stored
    assert search["auto_sequential_us"] == pytest.approx(stored_total(seq, stored)[0], abs=0.01)
    assert search["auto_ios_us"] == pytest.approx(stored_total(staged, stored)[0], abs=0.01)


def test_few_stored_stages_fall_back_to_the_prediction_with_its_margin():
    seq, staged = _plans()
    stored = dict(list(_table(seq, 5.0, 5.0).items())[:2])  # two single steps measured
    ios = stored_total(staged, stored)
    assert ios is None or ios[1] < 1.0
    assert stored_total(seq, stored)[1] < AUTO_STORED_COVER
    got = choose_auto(seq, staged, stored)
    search = dict(got.search)
    ratio = search["auto_predicted_ios_us"] / search["auto_predicted_sequential_us"]
    assert ratio == pytest.approx(predicted_total(staged) / predicted_total(seq), rel=1e-3)
    assert bool(got.stages) == (ratio < AUTO_PREDICTED_MARGIN)
    assert search["schedule"].endswith("(auto)")


@pytest.mark.slow
def test_auto_replayed_on_the_h200_run_is_never_slower_than_sequential():
    # SqueezeNet b16: the stages measured 4 % slower; NASNet b16 and RandWire b1: they won
    res = auto_replay(BENCH, only=["squeezenet1_1_b16", "nasnet_a_b16", "randwire_b1"])["cases"]
    assert set(res) == {"squeezenet1_1_b16", "nasnet_a_b16", "randwire_b1"}
    assert res["squeezenet1_1_b16"]["picks"] == "sequential"
    assert res["nasnet_a_b16"]["picks"] == "ios" and res["randwire_b1"]["picks"] == "ios"
    assert all(c["auto_vs_sequential"] >= 1.0 and c["kept_the_faster"] for c in res.values())


@pytest.mark.parametrize("wide_us, expect_stages", [(40.0, False), (1.0, True)])
def test_stored_stages_covering_most_of_both_plans_decide(wide_us, expect_stages):
    seq, staged = _plans()
    keys = StageKeys(staged.steps)
    wide = [st for st in staged.stages if len(st) > 1]
    # every step alone, and all wide stages but the last (the three-group one): it is priced by
    # the estimator scaled by the stored stages' stored/predicted ratio
    stored = {**_table(seq, 5.0, 5.0), **{keys(st): wide_us for st in wide[:-1]}}
    assert keys(wide[-1]) not in stored
    seq_total, seq_share = stored_total(seq, stored)
    ios_total, ios_share = stored_total(staged, stored)
    assert seq_share == 1.0 and AUTO_STORED_COVER <= ios_share < 1.0
    # every step stored: the total is their sum, nothing priced
    launching = [st for st in plan_stages(seq)
                 if any(seq.steps[i].kind != "layout_view" for g in st for i in g)]
    assert seq_total == pytest.approx(5.0 * len(launching))
    got = choose_auto(seq, staged, stored)
    search = dict(got.search)
    assert search["schedule"].endswith("(auto, stored and predicted)")
    assert search["auto_ios_us"] == pytest.approx(ios_total, abs=0.01)
    assert bool(got.stages) == expect_stages == (ios_total < AUTO_MARGIN * seq_total)


@pytest.mark.slow
@pytest.mark.usefixtures("window_config_of_the_stored_runs")
@pytest.mark.xfail(reason="the v3 run's stored stages are keyed by the schedules of its plans; the "
                   "fusion model retrained in session 9 picks others, so they are no exact hits now",
                   strict=False)
def test_squeezenet_b1_stages_are_kept_once_their_stages_are_stored(monkeypatch):
    # the estimator puts SqueezeNet's stages 6-7 % ahead at b1 and at b16 (measured: +8 % and
    # -5 %), so the prediction keeps the sequential plan at both; the v3 run's stored b1 stages
    # (the staged plan's and most of the sequential plan's steps) decide for the stages at b1.
    # The plans of that run: priced by the shipped models, as the bench's are
    monkeypatch.delenv("TUNEDB_MODELS")
    rows = BENCH_V3.with_name("stages_h200_v3_rows.json")
    res = auto_replay(BENCH_V3, only=["squeezenet1_1_b1", "squeezenet1_1_b16"], stored_rows=rows)["cases"]
    b1, b16 = res["squeezenet1_1_b1"], res["squeezenet1_1_b16"]
    assert b1["how"] == "ios (auto, stored and predicted)" and b1["kept_the_faster"]
    assert b16["how"] == "sequential (auto)" and b16["kept_the_faster"]
    predicted = auto_replay(BENCH_V3, only=["squeezenet1_1_b1"])["cases"]["squeezenet1_1_b1"]
    assert predicted["picks"] == "sequential" and not predicted["kept_the_faster"]


def test_auto_keeping_the_sequential_plan_keeps_its_packs(monkeypatch):
    # auto's sequential candidate is what schedule="sequential" gives, packs included: SqueezeNet
    # b16's auto plan was the sequential plan without its packs (H200 v6: 933.9 against 917.8 us)
    from tests.test_packing_driver import branches, streams_pay
    from tunedb.plan import stage_refine

    kw = dict(device=None, cost_model=False, pack_model=streams_pay, merge=False)
    sequential = compile_plan(branches(), **kw)
    assert sequential.packs  # the packing model says the branch convs pay on two streams
    monkeypatch.setattr(stage_refine, "AUTO_PREDICTED_MARGIN", 0.0)  # the stages never win
    auto = compile_plan(branches(), schedule="auto", **kw)
    assert dict(auto.search)["schedule"] == "sequential (auto)" and not auto.stages
    assert auto.steps == sequential.steps and auto.packs == sequential.packs
    # the stages are still planned without packs: each group runs on its own stream
    assert not compile_plan(branches(), schedule="ios", **kw).packs
