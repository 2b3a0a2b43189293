"""collectors/packing.py: bench-packing results into a real DuckDB store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.packing import ingest, main
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
    assert main(["ingest", "--db", str(db), str(other)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a bench-packing JSON" in err
    doc = json.loads(BENCH.read_text())
    doc["results"][0]["workload"]["members"][0]["m"] += 1  # the stored hash no longer matches
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(doc))
    assert main(["ingest", "--db", str(db), str(stale)]) == 1
    assert "hash" in capsys.readouterr().err
    with TuningStore.open(db) as store:
        assert store.counts() == n


@pytest.mark.parametrize("bad", ["missing.json"])
def test_missing_file(tmp_path, bad, capsys):
    assert main(["ingest", "--db", str(tmp_path / "p.duckdb"), str(tmp_path / bad)]) == 1
    assert "No such file" in capsys.readouterr().err
