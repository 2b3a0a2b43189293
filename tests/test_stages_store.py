"""Stage rows in a real DuckDB file: measured stages come back as exact hits for the search."""

from __future__ import annotations

import pytest

from collectors.stage import stage_records, store_stage_rows
from tunedb.graph.multibranch import randwire_graph
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.stage_refine import stored_stage_times, stored_times
from tunedb.plan.stages import StageEstimator, StageKeys, ios_search, schedule_plan
from tunedb.records import DeviceInfo
from tunedb.store.core import TuningStore

DEVICE = DeviceInfo("NVIDIA H200", "u1", "9.0", 132, 60 << 20, 141 << 30, "test", "13.0", "14.0")


def _plan():
    return compile_plan(randwire_graph(1, channels=4, size=6, nodes=10), device=None, cost_model=False,
                        horizontal=False)


def test_a_stage_row_names_what_runs_not_where():
    plan = _plan()
    keys = StageKeys(plan.steps)
    _, stages, _ = ios_search(plan.steps, StageEstimator(plan.steps))
    st = next(s for s in stages if len(s) > 1)
    w1, c1 = stage_records(plan.steps, st, keys(st))
    w2, c2 = stage_records(plan.steps, tuple(reversed(st)), keys(tuple(reversed(st))))
    assert (w1.hash, c1.hash) == (w2.hash, c2.hash)  # group order does not matter
    merged = (tuple(i for g in st for i in g),)
    w3, c3 = stage_records(plan.steps, merged, keys(merged))
    assert w3.hash == w1.hash and c3.hash != c1.hash  # same members, other grouping


@pytest.mark.slow
def test_stored_stages_are_exact_hits_for_the_next_search(tmp_path):
    plan = _plan()
    keys = StageKeys(plan.steps)
    _, stages, _ = ios_search(plan.steps, StageEstimator(plan.steps))
    rows = [{"groups": [list(g) for g in st], "key": keys(st), "status": "ok", "samples_us": [7.0, 9.0, 8.0]}
            for st in stages]
    odd = ((0, 1, 2),)  # not a stage of the schedule: a failed row of its own
    assert keys(odd) not in {r["key"] for r in rows}
    rows.append({"groups": [list(g) for g in odd], "key": keys(odd), "status": "runtime_error",
                 "message": "boom"})
    db = tmp_path / "t.duckdb"
    counts = store_stage_rows(db, plan, rows, DEVICE, {"source": "test"})
    assert counts["measurements"] == len({r["key"] for r in rows})  # repeated stages are one row
    with TuningStore.open(db, read_only=True) as store:
        times = stored_stage_times(store, DEVICE.id)
        failed = [m for m in store.measurements(device_id=DEVICE.id) if m.status != "ok"]
    assert failed and failed[0].error == "boom"
    assert {keys(st) for st in stages} <= set(times) and all(t == pytest.approx(8.0) for t in times.values())
    staged, info = schedule_plan(plan, measured=times)
    # every stage of the first schedule now costs 8 µs: the search prices them from the store
    assert info["ios_predicted_us"] <= 8.0 * len(stages) + 1e-9
    with TuningStore.open(db, read_only=True) as store:
        assert stored_stage_times(store, "other-device") == {}
    # the driver reads them from the database for the plan's device
    device = f"{DEVICE.name} ({DEVICE.id})"
    assert stored_times(db, device) == times and stored_times(None, device) == {}
    assert info["ios_stage_hits"] > 0  # the new winner uses stored stages where they pay
