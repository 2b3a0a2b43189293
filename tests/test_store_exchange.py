"""Parquet export/import and merge on real files: round trips, idempotence, atomicity under kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_store_helpers import A100, H200, Data, fill, make_data

from tunedb.records import Run
from tunedb.store import SCHEMA_VERSION, TABLES, StoreError, TuningStore

ROOT = Path(__file__).resolve().parents[1]


def _export_tables(d: Path) -> dict[str, object]:
    return {t: pq.read_table(d / f"{t}.parquet") for t in TABLES}


def _key_counts(path: Path) -> dict[str, tuple[int, int]]:
    """(rows, distinct natural keys) per table: equal means no duplicates."""
    out = {}
    with TuningStore.open(path, read_only=True) as db:
        for name, spec in TABLES.items():
            keys = ", ".join(spec.key)
            out[name] = db.con.execute(
                f"SELECT count(*), (SELECT count(*) FROM (SELECT DISTINCT {keys} FROM {name})) FROM {name}"
            ).fetchall()[0]
    return out


def test_round_trip_export_import_export_merge(tmp_path):
    a = make_data(n_workloads=20, configs=25, runs=range(0, 6), devices=(H200, A100))  # 6000 rows
    b = make_data(n_workloads=30, configs=25, runs=range(4, 10), devices=(H200,))  # overlaps a
    with TuningStore.open(tmp_path / "a.duckdb") as db:
        fill(db, a)
        db.add_model("m1", "fusion", H200.id, "models/m1.ubj", "{}")
        manifest = db.export_parquet(tmp_path / "exp_a")
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["format"] == "tunedb-parquet"
    assert manifest["counts"] == {**a.counts(), "models": 1}
    assert json.loads((tmp_path / "exp_a" / "manifest.json").read_text()) == manifest

    with TuningStore.open(tmp_path / "a2.duckdb") as db:
        assert db.import_parquet(tmp_path / "exp_a") == manifest["counts"]
        db.export_parquet(tmp_path / "exp_a2")
    first, second = _export_tables(tmp_path / "exp_a"), _export_tables(tmp_path / "exp_a2")
    for t in TABLES:
        assert first[t].equals(second[t]), t  # every column incl. samples and measured_at
    assert (tmp_path / "exp_a" / "measurements.parquet").read_bytes() == \
        (tmp_path / "exp_a2" / "measurements.parquet").read_bytes()

    with TuningStore.open(tmp_path / "b.duckdb") as db:
        fill(db, b)
    union = Data(a.devices + b.devices, a.runs + b.runs, a.workloads + b.workloads,
                 a.candidates + b.candidates, a.measurements + b.measurements)
    with TuningStore.open(tmp_path / "a2.duckdb") as db:
        added = db.merge(tmp_path / "b.duckdb")
        assert added["measurements"] == union.counts()["measurements"] - a.counts()["measurements"]
        assert added["runs"] == 4 and added["devices"] == 0
        assert db.counts() == {**union.counts(), "models": 1}
        assert db.merge(tmp_path / "b.duckdb") == dict.fromkeys(TABLES, 0)
        merged_frame = db.training_frame(kind=None, status=None)
    with TuningStore.open(tmp_path / "direct.duckdb") as db:
        fill(db, union)
        direct_frame = db.training_frame(kind=None, status=None)
    assert merged_frame.equals(direct_frame)
    for rows, distinct in _key_counts(tmp_path / "a2.duckdb").values():
        assert rows == distinct


def test_import_twice_changes_nothing_and_progress_is_reported(tmp_path):
    with TuningStore.open(tmp_path / "src.duckdb") as db:
        fill(db, make_data(n_workloads=5, configs=10, runs=range(3)))
        db.export_parquet(tmp_path / "exp")
    calls = []
    with TuningStore.open(tmp_path / "dst.duckdb") as db:
        first = db.import_parquet(tmp_path / "exp", progress=lambda *a: calls.append(a))
        db.export_parquet(tmp_path / "exp1")
        assert db.import_parquet(tmp_path / "exp") == dict.fromkeys(TABLES, 0)
        db.export_parquet(tmp_path / "exp2")
    assert first["measurements"] == 150
    assert ("measurements", 150, 150) in calls and ("devices", 1, 1) in calls
    for name in TABLES:
        assert (tmp_path / "exp1" / f"{name}.parquet").read_bytes() == \
            (tmp_path / "exp2" / f"{name}.parquet").read_bytes()


def test_single_table_files_and_unfinished_runs_complete(tmp_path):
    d = make_data(n_workloads=2, configs=3, runs=range(1))
    with TuningStore.open(tmp_path / "src.duckdb") as db:
        fill(db, d)
        db.export_parquet(tmp_path / "exp")
    renamed = tmp_path / "shard-17.parquet"  # the file names its table in its metadata
    os.replace(tmp_path / "exp" / "workloads.parquet", renamed)
    unfinished = Run(d.runs[0].id, "fusion", "0.1.0", "abc123", "host", d.runs[0].config_json,
                     d.runs[0].started_at, clocks_before="{}")
    with TuningStore.open(tmp_path / "dst.duckdb") as db:
        db.add_runs([unfinished])
        assert db.import_parquet(tmp_path / "exp" / "devices.parquet") == {"devices": 1}
        assert db.import_parquet(renamed) == {"workloads": 2}
        with pytest.raises(StoreError, match="lists workloads.parquet, which is missing"):
            db.import_parquet(tmp_path / "exp")
        os.replace(renamed, tmp_path / "exp" / "workloads.parquet")
        added = db.import_parquet(tmp_path / "exp")
        assert added["runs"] == 0 and added["measurements"] == len(d.measurements)
        assert db.runs() == d.runs  # the finished copy completed the stored unfinished run


_KILL_SCRIPT = """
import sys, time
from tunedb.store import TuningStore

def progress(table, done, total):
    # "half": half the measurements streamed in; "last": all tables but models inserted.
    if (sys.argv[3] == "half" and table == "measurements" and done >= total // 2) or \
            (sys.argv[3] == "last" and table == "models"):
        print("inside", flush=True)  # nothing is committed yet
        time.sleep(120)

db = TuningStore.open(sys.argv[1])
print("started", flush=True)
db.import_parquet(sys.argv[2], progress=progress)
print("done", flush=True)
time.sleep(120)
"""


def _run_and_kill(db: Path, export: Path, mode: str, wait_for: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(db), str(export), mode],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    seen = ""
    try:
        while seen != wait_for:
            line = proc.stdout.readline()
            assert line, f"import process ended early (rc {proc.poll()})"
            seen = line.strip()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return seen


@pytest.mark.slow
def test_kill_9_during_a_large_import_leaves_the_database_as_before(tmp_path):
    # 130k measurements (more than one DuckDB row group, so rows reach the file before commit),
    # 1M samples.
    big = make_data(n_workloads=52, configs=50, runs=range(50), samples=8)
    with TuningStore.open(":memory:") as db:
        fill(db, big)
        db.add_model("m1", "fusion", H200.id, "models/m1.ubj", "{}")  # models come last
        db.export_parquet(tmp_path / "exp")
    # overlaps big's keys row for row (a differing row would be refused as a conflict)
    base = make_data(n_workloads=1, configs=50, runs=range(1), samples=8)
    target = tmp_path / "t.duckdb"
    with TuningStore.open(target) as db:
        fill(db, base)
        before = db.counts()

    for mode in ("half", "last"):  # killed mid-transaction
        _run_and_kill(target, tmp_path / "exp", mode, "inside")
        with TuningStore.open(target) as db:
            assert db.counts() == before
            assert db.measurements() == sorted(base.measurements,
                                               key=lambda m: (m.candidate_hash, m.device_id, m.run_id))
    _run_and_kill(target, tmp_path / "exp", "free", "started")  # killed wherever it got to
    with TuningStore.open(target) as db:
        killed = db.counts()
        db.import_parquet(tmp_path / "exp")  # the file still works, and the import completes
        after = db.counts()
    assert after["measurements"] > before["measurements"]
    assert killed in (before, after)


def test_committed_writes_survive_kill_9(tmp_path):
    """A batch that returned is durable: a kill -9 right after leaves it in the WAL, and both
    read-only and read-write opens see it."""
    path = tmp_path / "t.duckdb"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = ("import sys, time\nfrom tunedb.store import TuningStore\n"
              "from test_store_helpers import fill, make_data\n"
              "db = TuningStore.open(sys.argv[1])\nfill(db, make_data(n_workloads=2, configs=3))\n"
              "print('committed', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**env, "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(ROOT / "tests")},
                            cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "committed"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    expected = make_data(n_workloads=2, configs=3).counts()
    with TuningStore.open(path, read_only=True) as db:
        assert db.counts() == expected
    with TuningStore.open(path) as db:
        assert db.counts() == expected
