"""``compile(schedule="ios" | "auto", measure_top=...)``: the refinement loop measures the stages
that decide, stores every one, and the next compile gets them as exact hits. Measured here on a
replay database of stage rows (``measure_device="replay:DB"``), in real DuckDB files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from collectors.stage import store_stage_rows
from tests.test_stage_replay import overlap_truth
from tunedb.graph.multibranch import randwire_graph
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.record import Plan
from tunedb.plan.stage_refine import refine_plan
from tunedb.plan.stages import StageKeys, ios_search
from tunedb.records import DeviceInfo
from tunedb.store.core import TuningStore

ROWS = Path(__file__).resolve().parents[1] / "data" / "bench" / "stages_h200_v2_rows.json"
DEVICE = DeviceInfo("NVIDIA H200", "r1", "9.0", 132, 60 << 20, 141 << 30, "test", "13.0", "14.0")

@pytest.fixture
def window_config_of_the_stored_runs(monkeypatch):
    """The stage keys name each step's schedule; the stored runs and the seeded truths below were
    made before window kernels took fast math, so their plans are built with that config."""
    monkeypatch.setattr("tunedb.plan.cost.WINDOW_CONFIG", {"mapping": "elementwise", "block": 256})



@pytest.mark.slow
def test_measure_top_refines_stores_and_hits_next_time(tmp_path, window_config_of_the_stored_runs):
    graph = randwire_graph(1, channels=4, size=6, nodes=10)
    replay, out = tmp_path / "replay.duckdb", tmp_path / "out.duckdb"
    kw = {"device": None, "cost_model": False, "horizontal": False}
    base = compile_plan(graph, pack=False, **kw)
    store_stage_rows(replay, base, [], DEVICE, {"source": "test"})  # the board, no rows yet
    truth, keys = overlap_truth(base.steps, 5), StageKeys(base.steps)
    table: dict = {}

    def record(groups):
        table[keys(groups)] = (groups, truth(groups))
        return table[keys(groups)][1]

    oracle, _, stats = ios_search(base.steps, record)
    singles = {keys(((i,),)): (((i,),), truth(((i,),))) for i in range(len(base.steps))}
    rows = [{"groups": [list(g) for g in st], "key": k, "status": "ok", "samples_us": [us]}
            for k, (st, us) in {**singles, **table}.items()
            if any(base.steps[i].kind != "layout_view" for g in st for i in g)]
    store_stage_rows(replay, base, rows, DEVICE, {"source": "test"})

    dev = f"replay:{replay}"
    plan = compile_plan(graph, schedule="ios", db=out, measure_top=1, measure_device=dev, **kw)
    search = dict(plan.search)
    assert search["schedule"] == "ios (measured)" and plan.stages
    assert 0 < search["refine_measured"] < stats.candidates
    assert search["ios_measured_us"] <= 1.03 * oracle
    with TuningStore.open(out, read_only=True) as store:
        stored = [c for c in store.candidates(kind="stage")]
    assert len(stored) == search["refine_measured"]
    # the next compile on that database measures nothing new: every stage it needs is stored
    again = dict(compile_plan(graph, schedule="ios", db=out, measure_top=1, measure_device=dev, **kw).search)
    assert again["refine_measured"] == 0 and again["refine_stored_hits"] > 0
    assert again["ios_measured_us"] == pytest.approx(search["ios_measured_us"])
    # auto: the sequential plan's steps are measured too, and the measured sums decide
    auto = compile_plan(graph, schedule="auto", db=out, measure_top=1, measure_device=dev, **kw)
    a = dict(auto.search)
    assert a["schedule"].endswith("(auto, stored)")
    assert bool(auto.stages) == (a["auto_ios_us"] < 0.95 * a["auto_sequential_us"])


@pytest.mark.slow
def test_the_driver_loop_replayed_on_the_stored_inception_rows():
    # the H200 run measured all 5,387 Inception V3 b1 candidates: the oracle is known exactly
    doc = json.loads(ROWS.read_text())["cases"]["inception_v3_b1"]
    plan = Plan.from_json(doc["plan"])
    table = {r["key"]: float(np.median(r["samples_us"])) for r in doc["rows"] if r["status"] == "ok"}
    keys = StageKeys(plan.steps)

    def stored_time(groups):
        if all(plan.steps[i].kind == "layout_view" for g in groups for i in g):
            return 0.0
        return table[keys(groups)]

    oracle, _, stats = ios_search(plan.steps, stored_time)
    staged, rows = refine_plan(plan, stored_time)
    search = dict(staged.search)
    assert search["refine_converged"] and len(rows) == search["refine_measured"]
    assert search["ios_measured_us"] <= 1.03 * oracle       # replay: 1.0056
    assert len(rows) <= 0.10 * stats.candidates              # replay: 398 of 5,387
