"""TuningStore on real DuckDB files: schema, batched idempotent writes, queries."""

from __future__ import annotations

import json
import math

import duckdb
import pytest
from test_store_helpers import A100, H200, fill, make_data

from tunedb.records import Candidate, Measurement, Run, Workload
from tunedb.store import SCHEMA_VERSION, StoreError, TuningStore
from tunedb.store import schema as store_schema


def test_new_file_gets_schema_marker_and_empty_tables(tmp_path):
    path = tmp_path / "sub" / "t.duckdb"
    with TuningStore.open(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        assert db.counts() == {t: 0 for t in ("devices", "runs", "workloads", "candidates",
                                               "measurements", "models")}
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("SELECT value FROM meta WHERE key = 'application_id'").fetchall() == [("tunedb",)]
    assert con.execute("SELECT max(version) FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    cols = {r[0]: r[1] for r in con.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'measurements'"
    ).fetchall()}
    con.close()
    assert cols["samples_us"] == "DOUBLE[]" and cols["median_us"] == "DOUBLE"
    assert cols["measured_at"] == "TIMESTAMP WITH TIME ZONE"


def test_add_is_batched_idempotent_and_persistent(tmp_path):
    d = make_data(n_workloads=4, configs=6, runs=range(3), devices=(H200, A100))
    path = tmp_path / "t.duckdb"
    with TuningStore.open(path) as db:
        assert db.add_devices(d.devices + d.devices) == 2  # duplicates inside one batch, too
        assert db.add_runs(d.runs) == 3
        assert db.add_workloads(d.workloads) == 4
        assert db.add_candidates(d.candidates * 2) == 24
        assert db.add_measurements(d.measurements) == len(d.measurements) == 2 * 3 * 24
        again = [db.add_devices(d.devices), db.add_runs(d.runs), db.add_workloads(d.workloads),
                 db.add_candidates(d.candidates), db.add_measurements(d.measurements)]
        assert again == [0, 0, 0, 0, 0]
    with TuningStore.open(path, read_only=True) as db:
        assert db.counts() == d.counts()
        assert db.devices() == sorted(d.devices, key=lambda x: x.id)
        assert db.runs() == d.runs
        assert db.workloads() == sorted(d.workloads, key=lambda w: w.hash)
        assert db.workload(d.workloads[1].hash) == d.workloads[1]
        assert db.workload("0" * 64) is None
        assert sorted(db.candidates(d.workloads[0].hash), key=lambda c: c.hash) == \
            sorted(d.candidates[:6], key=lambda c: c.hash)


def test_measurements_round_trip_with_all_samples_and_quantiles(tmp_path):
    d = make_data(n_workloads=2, configs=7, runs=range(1), samples=13)
    with TuningStore.open(tmp_path / "t.duckdb") as db:
        fill(db, d)
        got = {m.candidate_hash: m for m in db.measurements()}
        assert got == {m.candidate_hash: m for m in d.measurements}  # -1 <-> NULL both ways
        assert len(next(iter(got.values())).samples_us) in (0, 13)
        frame = db.training_frame(kind=None, status=None).to_pylist()
    by_cand = {r["candidate_hash"]: r for r in frame}
    for m in d.measurements:
        row = by_cand[m.candidate_hash]
        assert row["status"] == m.status
        if m.status == "ok":
            assert math.isclose(row["median_us"], m.median_us)
            assert math.isclose(row["p20_us"], m.p20_us) and math.isclose(row["p80_us"], m.p80_us)
            assert row["p20_us"] <= row["median_us"] <= row["p80_us"]
        else:
            assert row["median_us"] is None
        assert row["local_bytes"] == (None if m.local_bytes < 0 else m.local_bytes)


def test_references_are_checked_and_a_bad_batch_adds_nothing(tmp_path):
    d = make_data(n_workloads=1, configs=3, runs=range(1))
    with TuningStore.open(tmp_path / "t.duckdb") as db:
        db.add_devices(d.devices)
        db.add_runs(d.runs)
        with pytest.raises(StoreError, match=r"candidate refers to unknown workload [0-9a-f]{64}; add"):
            db.add_candidates(d.candidates)
        db.add_workloads(d.workloads)
        db.add_candidates(d.candidates[:2])
        with pytest.raises(StoreError, match="measurement refers to unknown candidate"):
            db.add_measurements(d.measurements)  # the third candidate is missing
        orphan_run = Measurement(d.candidates[0].hash, H200.id, "no-such-run", "ok", (1.0,))
        with pytest.raises(StoreError, match="measurement refers to unknown run no-such-run"):
            db.add_measurements([orphan_run])
        orphan_dev = Measurement(d.candidates[0].hash, "feedfeedfeedfeed", d.runs[0].id, "ok", (1.0,))
        with pytest.raises(StoreError, match="unknown device feedfeedfeedfeed"):
            db.add_measurements([orphan_dev])
        with pytest.raises(StoreError, match="add_runs expects Run records, got dict"):
            db.add_runs([{"id": "x"}])
        assert db.counts()["measurements"] == 0
        assert db.add_measurements(d.measurements[:2]) == 2


def test_top_k_measured_candidates_and_training_frame(tmp_path):
    d = make_data(n_workloads=3, configs=10, runs=range(2), devices=(H200, A100))
    w = d.workloads[1]
    with TuningStore.open(tmp_path / "t.duckdb") as db:
        fill(db, d)
        top = db.top_k(w.hash, H200.id, 4)
        assert db.top_k(w.hash, H200.id, 0) == []
        assert db.top_k(w.hash, "nodevice", 3) == []
        assert len(db.measured_candidates(H200.id)) == 30
        assert db.measured_candidates("nodevice") == set()
        assert db.measured_candidates(A100.id, run_id="run-1") == {c.hash for c in d.candidates}
        fusion = db.training_frame()
        everything = db.training_frame(kind=None, status=None, include_graph=False)
        a100_fail = db.training_frame(kind=None, device_id=A100.id, status="compile_error")
    # Expected ranking computed from the records: median over runs of each run's median.
    ok = {}
    for m in d.measurements:
        if m.status == "ok" and m.device_id == H200.id:
            ok.setdefault(m.candidate_hash, []).append(m.median_us)
    cands = {c.hash: c for c in d.candidates if c.workload_hash == w.hash}
    expected = sorted(((h, sum(v) / len(v)) for h, v in ok.items() if h in cands), key=lambda x: (x[1], x[0]))
    assert [c.hash for c, _ in top] == [h for h, _ in expected[:4]]
    assert all(math.isclose(t, e) for (_, t), (_, e) in zip(top, expected))
    assert [t for _, t in top] == sorted(t for _, t in top)
    assert top[0][0] == cands[top[0][0].hash] and isinstance(top[0][0], Candidate)

    assert fusion.column_names == [
        "workload_hash", "family", "workload_name", "graph_json", "candidate_hash", "kind", "config_json",
        "source_hash", "device_id", "device_name", "run_id", "status", "median_us", "p20_us", "p80_us",
        "registers", "shared_bytes", "local_bytes"]
    n_ok_fusion = sum(1 for m in d.measurements if m.status == "ok"
                      and next(c for c in d.candidates if c.hash == m.candidate_hash).kind == "fusion")
    assert fusion.num_rows == n_ok_fusion
    assert set(fusion.column("kind").to_pylist()) == {"fusion"}
    assert set(fusion.column("device_name").to_pylist()) == {"NVIDIA H200", "NVIDIA A100"}
    assert everything.num_rows == len(d.measurements) and "graph_json" not in everything.column_names
    assert set(a100_fail.column("status").to_pylist()) == {"compile_error"}
    assert a100_fail.num_rows == sum(1 for m in d.measurements
                                     if m.device_id == A100.id and m.status == "compile_error")
    row = fusion.slice(0, 1).to_pylist()[0]
    assert json.loads(row["graph_json"])["cols"] == 4096


def test_finish_run_and_models(tmp_path):
    run = Run("r1", "fusion", "0.1.0", "", "host", "{}", "2026-02-01T00:00:00Z",
              clocks_before="{\"sm\":1980}")
    with TuningStore.open(tmp_path / "t.duckdb") as db:
        db.add_runs([run])
        db.finish_run("r1", "2026-02-01T02:00:00Z", "{\"sm\":1755}")
        assert db.runs()[0].finished_at == "2026-02-01T02:00:00Z"
        assert db.runs()[0].clocks_after == "{\"sm\":1755}"
        with pytest.raises(StoreError, match="cannot finish run nope: no such run"):
            db.finish_run("nope", "2026-02-01T02:00:00Z")
        assert db.add_model("m1", "fusion", H200.id, "models/m1.ubj", "{\"metrics\":{}}") == 1
        assert db.add_model("m1", "fusion", H200.id, "models/m1.ubj", "{}") == 0
        (model,) = db.models()
        assert model["id"] == "m1" and model["card_json"] == "{\"metrics\":{}}"
        assert model["created_at"].endswith("Z") and model["created_at"].startswith("20")


def test_read_only_store_refuses_writes(tmp_path):
    path = tmp_path / "t.duckdb"
    TuningStore.open(path).close()
    with TuningStore.open(path, read_only=True) as db:
        with pytest.raises(StoreError, match="cannot add workloads: database .* is open read-only"):
            db.add_workloads([Workload("a" * 64, "f", "n", "{}")])
        assert db.read_only and db.path == path


def test_memory_store_and_large_batch():
    d = make_data(n_workloads=50, configs=40, runs=range(50), samples=10)  # 100k measurements
    assert len(d.measurements) == 100_000
    with TuningStore.open(":memory:") as db:
        fill(db, d)
        assert db.counts() == d.counts()
        n = db.con.execute("SELECT sum(len(samples_us)) FROM measurements").fetchall()[0][0]
    assert n == sum(len(m.samples_us) for m in d.measurements)


def test_pending_migrations_apply_in_one_transaction(tmp_path, monkeypatch):
    path = tmp_path / "t.duckdb"
    with TuningStore.open(path) as db:
        db.add_workloads([Workload("a" * 64, "f", "n", "{}")])

    def broken(con):
        con.execute("CREATE TABLE notes (x INTEGER)")
        con.execute("SELECT * FROM no_such_table")

    monkeypatch.setattr(store_schema, "MIGRATIONS",
                        [*store_schema.MIGRATIONS, (SCHEMA_VERSION + 1, broken)])
    with pytest.raises(StoreError, match=f"schema migration to v{SCHEMA_VERSION + 1} failed"):
        TuningStore.open(path)
    with pytest.raises(StoreError, match="older than this tunedb .* open it read-write once"):
        TuningStore.open(path, read_only=True)
    con = duckdb.connect(str(path), read_only=True)
    tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    con.close()
    assert "notes" not in tables  # the failed migration left nothing behind

    monkeypatch.setattr(store_schema, "MIGRATIONS", [
        *store_schema.MIGRATIONS[:-1],
        (SCHEMA_VERSION + 1, "CREATE TABLE notes (x INTEGER)"),
        (SCHEMA_VERSION + 2, lambda con: con.execute("INSERT INTO notes VALUES (42)")),
    ])
    with TuningStore.open(path) as db:
        assert db.schema_version == SCHEMA_VERSION + 2
        assert db.con.execute("SELECT x FROM notes").fetchall() == [(42,)]
        assert db.counts()["workloads"] == 1
        versions = db.con.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert [v for (v,) in versions] == list(range(1, SCHEMA_VERSION + 3))


def test_same_file_twice_in_one_process(tmp_path):
    path = tmp_path / "t.duckdb"
    with TuningStore.open(path) as writer:
        with TuningStore.open(path) as second:  # shares the writer's DuckDB instance
            second.add_workloads([Workload("b" * 64, "f", "n", "{}")])
        assert writer.counts()["workloads"] == 1
        with pytest.raises(StoreError, match="is already open read-write in this process"):
            TuningStore.open(path, read_only=True)
    with TuningStore.open(path, read_only=True):
        with pytest.raises(StoreError, match="is already open read-only in this process"):
            TuningStore.open(path)
