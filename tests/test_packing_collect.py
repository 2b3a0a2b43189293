"""collectors/packing.py (the engine plugin) and packing_ingest.py (bench JSON) into real DuckDB stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.packing_ingest import ingest, main
from tunedb.store.core import TuningStore

BENCH = Path(__file__).resolve().parent.parent / "data" / "bench" / "packing_h200.json"


def _tunedb_rows(doc: dict) -> int:
    return sum(r["system"] == "tunedb" for res in doc["results"] for r in res["rows"])


def test_ingest_the_shipped_bench_file(tmp_path):
    doc = json.loads(BENCH.read_text())
    db = tmp_path / "p.duckdb"
    counts = ingest(db, BENCH)
    assert counts == {"workloads": len(doc["results"]), "candidates": _tunedb_rows(doc),
                      "measurements": _tunedb_rows(doc)}
    with TuningStore.open(db) as store:
        cands = store.candidates(kind="packing")
        assert {c.config_dict["backends"] for c in cands} >= {"serial", "padded", "grouped", "concat"}
        ms = store.measurements()
        ok = [m for m in ms if m.status == "ok"]
        assert ok and all(len(m.samples_us) == doc["samples"] for m in ok)
        w = store.workload(doc["results"][0]["hash"])
        assert w is not None and json.loads(w.graph_json)["scheme"] == "tunedb.packing/1"
    again = ingest(db, BENCH)  # a second run: new measurements, nothing else new
    assert again["workloads"] == 0 and again["candidates"] == 0
    assert again["measurements"] == _tunedb_rows(doc)


def test_bad_files_are_refused_in_one_line_and_keep_the_store(tmp_path, capsys):
    db = tmp_path / "p.duckdb"
    ingest(db, BENCH)
    before = TuningStore.open(db)
    n = before.counts()
    before.close()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"bench": "fusion"}))
    assert main(["--db", str(db), str(other)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a bench-packing JSON" in err
    doc = json.loads(BENCH.read_text())
    doc["results"][0]["workload"]["members"][0]["m"] += 1  # the stored hash no longer matches
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(doc))
    assert main(["--db", str(db), str(stale)]) == 1
    assert "hash" in capsys.readouterr().err
    with TuningStore.open(db) as store:
        assert store.counts() == n


@pytest.mark.parametrize("bad", ["missing.json"])
def test_missing_file(tmp_path, bad, capsys):
    assert main(["--db", str(tmp_path / "p.duckdb"), str(tmp_path / bad)]) == 1
    assert "No such file" in capsys.readouterr().err


DATA = Path(__file__).resolve().parent.parent / "data" / "packing_h200"


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_the_plugin_replays_stored_packing_rows_through_the_engine(tmp_path):
    from collectors.packing import PackingCollector
    from tunedb.collect import load_collector
    from tunedb.runtime.replay import ReplayDevice

    coll = load_collector("packing")
    assert isinstance(coll, PackingCollector) and coll.kind == "packing"
    dev = coll.open_device(f"replay:{DATA}")
    assert isinstance(dev, ReplayDevice)
    jobs = list(coll.jobs("standard"))
    assert len(jobs) >= 200 and {j.workload.family for j in jobs} >= {"replicas", "moe", "lora", "zoo"}
    with TuningStore.open(tmp_path / "r.duckdb") as store:
        first = coll.run(store, dev, "standard")
        # the plugin's configs hash like the stored ones: every stored row of the suite is found
        stored = sum(c.hash in dev for c in coll.candidates("standard"))
        assert stored > 2000 and first.measured == stored and first.ok == first.measured
        assert first.missing == first.total - stored
        again = coll.run(store, dev, "standard")
        assert again.measured == 0 and again.already == first.measured
        assert len(store.candidates(kind="packing")) == first.total


def test_the_plugin_refuses_emulation_and_unknown_suites(tmp_path):
    from collectors.packing import PackingCollector
    from tunedb.collect import CollectError
    from tunedb.runtime.replay import ReplayDevice

    coll = PackingCollector()
    with pytest.raises(ValueError, match="no CPU emulation"):
        coll.open_device("emu")
    with TuningStore.open(tmp_path / "r.duckdb") as store, pytest.raises(CollectError, match="packing suite"):
        coll.run(store, ReplayDevice(DATA), "nonesuch")


def test_worker_results_keep_failures_as_rows():
    from tunedb.records import Measurement
    from tunedb.runtime.pack_device import PROTOCOL, result_of
    from tunedb.runtime.results import MeasureResult

    ok = MeasureResult.from_wire(result_of({"status": "ok", "samples_us": [3.0, 2.0]}))
    assert ok.status == "ok" and ok.samples_us == (3.0, 2.0)
    bad = MeasureResult.from_wire(result_of({"status": "incorrect", "error": 7.5}))
    assert bad.status == "incorrect" and "7.5" in bad.error and not bad.samples_us
    oom = MeasureResult.from_wire(result_of({"status": "error", "message": "OutOfMemoryError: 9 GiB"}))
    assert oom.status == "runtime_error" and oom.error.startswith("OutOfMemoryError")
    m = oom.to_measurement("c", "d", "r", PROTOCOL)
    assert isinstance(m, Measurement) and m.status == "runtime_error"
    assert '"flush_l2":false' in m.protocol_json


@pytest.mark.slow  # reads the stored export and replays the quick suite: about 7 s
def test_extra_candidates_are_collected_with_anchors_the_stored_rows_share(tmp_path):
    """benchmarks/packing_collect_extra.py: per workload whole:serial and the stored best first
    (the stored rows' hashes: the replay finds them), then split-K / chunked candidates whose
    configs carry slices, rows and padding waste."""
    from benchmarks.packing_collect_extra import ExtraCollector, extra_sample, stored_best
    from tunedb.kernels.packing import Candidate, candidate_waste
    from tunedb.kernels.packing_suites import bench_cases
    from tunedb.runtime.replay import ReplayDevice

    best = stored_best(DATA)
    assert len(best) > 300 and all(len(v) >= 3 for v in best.values())
    coll = ExtraCollector(best, per_workload=4, anchors=4)
    jobs = {j.workload.hash: j for j in coll.jobs("quick")}
    lora = next(w for w in bench_cases() if w.family == "lora")
    specs = jobs[lora.hash].specs
    assert [c.name for _, c in specs[:4]][0] == "whole:serial"
    assert [c for _, c in specs[1:4]] == best[lora.hash][:3]
    new = [(cfg, c) for cfg, c in specs[4:]]
    assert len(new) == 4 and {cl.backend for _, c in new for cl in c.clusters} - {"serial"} == {
        "splitk", "chunks"}
    for cfg, c in new:
        cl = json.loads(cfg["clusters"])
        assert any(x.get("split", 1) > 1 or x.get("rows", 0) > 0 for x in cl)
        assert cfg["waste"] == round(candidate_waste(lora, c), 6)
        assert Candidate.from_json({"partition": cfg["partition"], "concurrent": cfg["concurrent"],
                                    "clusters": cl}) == c
    assert extra_sample(lora, 4) == extra_sample(lora, 4)  # a fixed shuffle
    assert len(extra_sample(lora, 0)) > 4
    dev = ReplayDevice(DATA)
    with TuningStore.open(tmp_path / "x.duckdb") as store:
        s = coll.run(store, dev, "quick")
    anchors = sum(min(4, 1 + len(best.get(h, []))) for h in jobs)
    assert s.ok > 0 and s.ok <= anchors and s.missing >= s.total - anchors



@pytest.mark.slow  # reads the stored export twice: about 6 s
def test_skip_stored_continues_the_shuffle_past_what_the_export_holds():
    """--skip-stored: the split-K / chunked candidates the export already holds are left out (the
    anchors stay), the rest follow in the same fixed shuffle, a workload with nothing new gets no
    job, and --first families come before the rest."""
    from benchmarks.packing_collect_extra import ExtraCollector, extra_sample, stored_best, stored_keys
    from tunedb.kernels.packing import PackingWorkload
    from tunedb.kernels.packing_suites import suite
    from tunedb.records import canonical_json

    best, stored = stored_best(DATA), stored_keys(DATA)
    first = ("moe", "lora")
    jobs = list(ExtraCollector(best, 5, 3, stored=stored, first=first).jobs("standard"))
    fams = [j.workload.family for j in jobs]
    n_first = sum(f in first for f in fams)
    assert n_first > 0 and set(fams[:n_first]) == set(first)
    held = 0
    for j in jobs:
        w = PackingWorkload.from_json(json.loads(j.workload.graph_json))
        done = stored.get(w.hash, set())
        keys = [canonical_json(json.loads(cfg["clusters"])) for cfg, _ in j.specs]
        assert json.loads(keys[0]) == [{"backend": "serial", "members": list(range(len(w.members))),
                                        "streams": 1}]
        left = [canonical_json(c.to_json()["clusters"]) for c in extra_sample(w, 0)]
        held += sum(k in done for k in left)
        left = [k for k in left if k not in done]
        new = [k for k in keys if k in set(left)]
        assert new == left[:5] and new  # the anchors are stored ones: never among ``left``
    assert held > 500  # the export holds over a thousand split-K / chunked rows
    everyone = {w.hash: w for w in suite("standard")}
    skipped = set(everyone) - {j.workload.hash for j in jobs}
    assert skipped and all(
        all(canonical_json(c.to_json()["clusters"]) in stored.get(h, set())
            for c in extra_sample(everyone[h], 0)) for h in skipped)
