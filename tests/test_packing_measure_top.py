"""``tunedb.compile(..., measure_top=N)`` measures pack candidates: the model's top N of each
ready set and serial, on a replay of stored rows (CPU), stored in a real DuckDB file, and the
measured best decides."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from test_packing_driver import attention

from collectors.packing_ingest import candidate_record, store_results
from tunedb.plan import compile
from tunedb.plan.packing import graph_workloads, pack_records, plan_candidates
from tunedb.records import DeviceInfo
from tunedb.store.core import TuningStore

DEV = DeviceInfo("NVIDIA H200", "replayed-board", "9.0", 132, 60 << 20, 141 << 30, "13.0", "13.0", "14.2.0")
# What the "GPU" answers (µs): streams do not pay here, the grouped call does.
MEASURED = {"whole:serial": 10.0, "whole:streams2": 9.9, "whole:grouped": 6.0}


def streams_first(w, cands):
    """A model that is wrong about this set: it ranks streams first, grouped second."""
    guess = {"whole:serial": 100.0, "whole:streams2": 50.0, "whole:grouped": 80.0}
    return [guess.get(c.name, 200.0) for c in cands]


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """A database holding the measurements a replay device answers with."""
    (w,) = graph_workloads(attention(), "qkv")
    rows = [{"system": "tunedb", "variant": c.name, "status": "ok", "candidate": c.to_json(),
             "samples_us": [MEASURED.get(c.name, 12.0)] * 5} for c in plan_candidates(w)]
    db = tmp_path_factory.mktemp("replay") / "gpu.duckdb"
    store_results(db, {"results": [{"workload": w.to_json(), "rows": rows}], "samples": 5}, DEV,
                  {"test": str(uuid.uuid4())})
    return db


def test_records_hash_like_the_collectors():
    (w,) = graph_workloads(attention(), "qkv")
    cands = plan_candidates(w)
    wl, recs = pack_records(w, cands)
    assert wl.hash == w.hash
    assert [r.hash for r in recs] == [candidate_record(w, c).hash for c in cands]


def test_without_measuring_the_wrong_model_packs_streams():
    plan = compile(attention(), cost_model=False, device=None, pack_model=streams_first)
    (pk,) = plan.packs
    assert (pk.source, pk.label) == ("model", "whole:streams2")


def test_measure_top_one_finds_streams_do_not_pay(tmp_path, replay):
    db = tmp_path / "plans.duckdb"
    plan = compile(attention(), cost_model=False, db=db, measure_top=1, measure_device=f"replay:{replay}",
                   pack_model=streams_first)
    assert plan.packs == ()  # streams2 measured 1 % faster than serial: packing must pay 5 %
    assert dict(plan.search)["pack_measured"] == 2 and dict(plan.search)["pack_stored"] == 2
    with TuningStore.open(db) as store:
        names = {c.config_dict["backends"] for c in store.candidates(kind="packing")}
        assert names == {"serial", "streams2"}


def test_measure_top_two_reaches_the_measured_best_and_stores_it(tmp_path, replay):
    db = tmp_path / "plans.duckdb"
    kw = {"cost_model": False, "db": db, "measure_device": f"replay:{replay}", "pack_model": streams_first}
    plan = compile(attention(), measure_top=2, **kw)
    (pk,) = plan.packs
    assert (pk.source, pk.label, pk.predicted_us, pk.serial_us) == ("measured", "whole:grouped", 6.0, 10.0)
    assert dict(plan.search)["pack_measured"] == 3 and dict(plan.search)["pack_stored"] == 3
    with TuningStore.open(db) as store:
        ok = [m for m in store.measurements() if m.status == "ok"]
        packing = {c.hash for c in store.candidates(kind="packing")}
        assert len(packing) == 3 and packing <= {m.candidate_hash for m in ok}
        assert {r.collector for r in store.runs()} == {"plan"}
    # The next compile reuses the stored results: nothing is measured again, same choice.
    again = compile(attention(), measure_top=2, **kw)
    assert dict(again.search)["pack_measured"] == 0 and dict(again.search)["pack_stored"] == 0
    assert [p.label for p in again.packs] == ["whole:grouped"]


def test_a_partition_is_not_stored_against_members_in_another_order(tmp_path):
    from tunedb.kernels.packing import Member, PackingWorkload, candidates
    from tunedb.plan.measure import Recorder
    from tunedb.plan.packing import PackMeasurer
    from tunedb.runtime import open_device

    ms = (Member(64, 96, 96), Member(128, 96, 96), Member(64, 32, 96))
    w, rev = PackingWorkload("het", "graphs", ms), PackingWorkload("het", "graphs", ms[::-1])
    assert w.hash == rev.hash  # the hash ignores the order; cluster indices do not
    cands = [c for c in candidates(rev) if c.name == "whole:serial"]
    cands += [next(c for c in candidates(rev) if c.partition != "whole")]

    def doc(work, cs):
        return {"results": [{"workload": work.to_json(), "rows": [
            {"system": "tunedb", "status": "ok", "candidate": c.to_json(), "samples_us": [5.0] * 3}
            for c in cs]}], "samples": 3}
    store_results(tmp_path / "gpu.duckdb", doc(rev, cands), DEV, {"test": "replay"})
    plans = tmp_path / "plans.duckdb"  # already holds the workload, members in w's order
    store_results(plans, doc(w, [c for c in candidates(w) if c.name == "whole:grouped"]), DEV, {"test": "w"})
    dev = open_device(f"replay:{tmp_path / 'gpu.duckdb'}")
    try:
        with TuningStore.open(plans) as store:
            measure = PackMeasurer(dev, Recorder(store, dev, {"test": "order"}))
            assert set(measure(rev, cands)) == {c.name for c in cands}  # both used for the choice
            assert measure.recorder.flush() == 1  # only the whole one is stored
            stored = {c.hash for c in store.candidates(kind="packing")}
            assert pack_records(rev, cands[:1])[1][0].hash in stored
            assert pack_records(rev, cands[1:])[1][0].hash not in stored
    finally:
        dev.close()


# -- the compile's measure-top replayed on the shipped H200 data (benchmarks/packing_measure_top.py)
def _stored_zoo_workload():
    from pathlib import Path

    from bench_scripts import load_script

    mt = load_script("packing_measure_top")
    data = Path(__file__).resolve().parent.parent / "data" / "packing_h200"
    ws, stored = mt.workloads_of(data)
    h, w = next((h, w) for h, w in sorted(ws.items()) if w.name == "zoo_llama_small_fp32.set0_float32")
    return mt, data, w, stored[h]


def test_replayed_measure_top_measures_the_top_and_serial_and_takes_the_measured_best():
    """One ready set of the zoo (stored on the H200): a model that ranks serial last gets its
    top N and serial measured from the stored rows, and the choice is the best of those."""
    from tunedb.runtime.replay import ReplayDevice

    mt, data, w, stored = _stored_zoo_workload()
    cands = plan_candidates(w)  # the model's set first, then the in-place splitk/chunks ones

    def serial_last(work, cs):
        return [100.0 if c.name == "whole:serial" else float(i) for i, c in enumerate(cs)]
    dev = ReplayDevice(data, "a6d6dc0e3698e90c")
    try:
        found = [(c, dev.lookup(r.hash)) for c, r in zip(cands, pack_records(w, cands)[1])]
        times = {c.name: float(np.median(res.samples_us)) for c, res in found if res is not None}
        assert len(times) >= 3 and stored > len(times)  # the collector timed more than a plan runs
        for top in (1, 2, len(cands)):
            r = mt.one(w, serial_last, dev, top, stored)
            assert r["measured"] == min(top + 1, len(cands)) and r["plan"] == len(cands)
            seen = [c.name for c in cands if c.name != "whole:serial"][:top] + ["whole:serial"]
            best = min((x for x in seen if x in times), key=times.get)
            want = best if times[best] <= 0.95 * times["whole:serial"] else "whole:serial"
            assert r["chosen"] == want
        assert r["ratio"] == 1.0  # everything measured: the best plan decision
    finally:
        dev.close()


@pytest.mark.slow
def test_replayed_measure_top_on_the_zoo_sets_held_out():
    """The 26 ready sets of the model zoo, each decided by a packing model trained without it:
    measuring the model's first plan candidate and serial comes within 5 % of the best plan
    decision on most sets, its first two and serial on nearly all (since the in-place splitk /
    chunks candidates the best is often one of several slice or chunk counts a few % apart)."""
    mt, data, _, _ = _stored_zoo_workload()
    res = mt.run(data, [1, 2], folds=5, only={"zoo"})
    top1, top2 = res["table"]["top 1"], res["table"]["top 2"]
    assert top1["workloads"] == top2["workloads"] == 26
    assert top1["measured_share"] < 0.35 and top1["within_5pct"] >= 0.85
    assert top2["measured_share"] < 0.35 and top2["within_5pct"] >= 0.95
    assert all(r["measured"] <= 2 for r in res["rows"]["1"])


def test_space_replay_charges_unstored_picks_and_never_counts_them_best():
    """benchmarks/packing_seeds.py ``space_replay``: the budget is a share of every candidate;
    a pick without a stored time costs one measurement and cannot be the best; ``diverse``
    measures each backend kind's first before any kind's second."""
    from benchmarks.packing_seeds import space_replay

    nan = np.nan
    # workload a: the model's first is unstored, its second (padded) is the stored best;
    # workload b: the first is the best. 20 candidates in all: 10 % = 2 picks (the two firsts).
    y = np.array([nan, 5.0, 6.0, 9.0, nan, nan, nan, nan, nan, nan,
                  1.0, 2.0, nan, nan, nan, nan, nan, nan, nan, nan])
    groups = np.array(["a"] * 10 + ["b"] * 10)
    kinds = np.array(["chunks", "padded", "padded", "streams"] + ["serial"] * 6
                     + ["padded", "chunks"] + ["serial"] * 8)
    pred = np.array([1.0, 2.0, 1.5, 3.0] + [9.0] * 6 + [1.0, 2.0] + [9.0] * 8)
    space = {"y": y, "groups": groups, "kinds": kinds}
    got = space_replay(space, pred, share=0.10)
    assert got["measured_share"] == pytest.approx(0.10) and got["reaches_best"] == 0.5
    # 20 %: one more pick each (a's next prediction, padded 6.0, is closest): a still misses 5.0;
    # 25 %: a's third, padded 5.0, its best
    assert space_replay(space, pred, share=0.20)["reaches_best"] == 0.5
    assert space_replay(space, pred, share=0.25)["reaches_best"] == 1.0
    # diverse: a measures chunks, padded (its first, 6.0), then streams before a second padded
    div = space_replay(space, pred, share=0.25, order="diverse")
    assert div["reaches_best"] == 0.5 and div["within_5pct"] == 0.5 and div["measured_share"] == 0.25
