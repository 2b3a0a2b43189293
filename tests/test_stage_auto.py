"""``schedule="auto"``: stored stage times decide when they cover both plans, else predictions
with a margin; replayed against the H200 run's measured sequential and IOS times."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunedb.bench.stages import auto_replay
from tunedb.graph.multibranch import randwire_graph
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.stage_refine import (
    AUTO_PREDICTED_MARGIN,
    choose_auto,
    plan_stages,
    predicted_total,
    stored_total,
)
from tunedb.plan.stages import StageKeys, schedule_plan

BENCH = Path(__file__).resolve().parents[1] / "data" / "bench" / "stages_h200_v2.json"


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
    assert search["auto_sequential_us"] == pytest.approx(stored_total(seq, stored), abs=0.01)
    assert search["auto_ios_us"] == pytest.approx(stored_total(staged, stored), abs=0.01)


def test_a_missing_stored_stage_falls_back_to_the_prediction_with_its_margin():
    seq, staged = _plans()
    stored = _table(seq, 5.0, 5.0)  # the staged plan's wide stages were never measured
    assert stored_total(staged, stored) is None
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
