"""Every way opening or importing can go wrong gives a one-line StoreError and leaves data alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_store_helpers import fill, make_data

from tunedb.store import SCHEMA_VERSION, StoreError, TuningStore

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_random_bytes_file_is_rejected_and_untouched(tmp_path):
    path = tmp_path / "x.duckdb"
    junk = os.urandom(64 * 1024)
    path.write_bytes(junk)
    for ro in (False, True):
        with pytest.raises(StoreError) as e:
            TuningStore.open(path, read_only=ro)
        assert _one_line(e) == f"{path} is not a tunedb database (not a DuckDB file or corrupt)"
    assert path.read_bytes() == junk
    assert not Path(str(path) + ".wal").exists()


def test_foreign_duckdb_file_is_rejected_and_untouched(tmp_path):
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE measurements (x INTEGER)")
    con.execute("INSERT INTO measurements VALUES (1)")
    con.close()
    before = path.read_bytes()
    for ro in (False, True):
        with pytest.raises(StoreError) as e:
            TuningStore.open(path, read_only=ro)
        assert _one_line(e) == f"{path} is a DuckDB database but not a tunedb database (no tunedb marker)"
    assert path.read_bytes() == before


def test_empty_duckdb_file_is_initialised_read_write_only(tmp_path):
    path = tmp_path / "empty.duckdb"
    duckdb.connect(str(path)).close()
    with pytest.raises(StoreError, match="is an empty DuckDB database; open it read-write"):
        TuningStore.open(path, read_only=True)
    with TuningStore.open(path) as db:
        assert db.schema_version == SCHEMA_VERSION


def test_newer_schema_is_refused_and_untouched(tmp_path):
    path = tmp_path / "new.duckdb"
    TuningStore.open(path).close()
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO schema_version VALUES (?, current_timestamp)", [SCHEMA_VERSION + 7])
    con.close()
    before = path.read_bytes()
    for ro in (False, True):
        with pytest.raises(StoreError) as e:
            TuningStore.open(path, read_only=ro)
        assert _one_line(e) == (f"database schema v{SCHEMA_VERSION + 7} is newer than this tunedb "
                                f"(v{SCHEMA_VERSION}); upgrade tunedb")
    assert path.read_bytes() == before


def test_missing_file_read_only_and_directory(tmp_path):
    path = tmp_path / "nope.duckdb"
    with pytest.raises(StoreError) as e:
        TuningStore.open(path, read_only=True)
    assert _one_line(e) == f"database {path} does not exist"
    assert not path.exists()
    with pytest.raises(StoreError, match="is a directory, not a database file"):
        TuningStore.open(tmp_path)


def test_second_writer_is_refused_with_the_holders_pid(tmp_path):
    path = tmp_path / "locked.duckdb"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys\nfrom tunedb.store import TuningStore\n"
         "db = TuningStore.open(sys.argv[1])\nprint('ready', flush=True)\nsys.stdin.readline()\n"
         "db.add_workloads([])\ndb.close()\nprint('closed', flush=True)\n",
         str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "ready"
        for ro in (False, True):
            with pytest.raises(StoreError) as e:
                TuningStore.open(path, read_only=ro)
            assert _one_line(e) == (f"database {path} is locked by another process (pid {holder.pid}); "
                                    "tunedb allows one writer per file")
        out, _ = holder.communicate("\n", timeout=60)
        assert holder.returncode == 0 and out.strip() == "closed"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    with TuningStore.open(path) as db:  # free again once the holder is gone
        assert db.counts()["runs"] == 0


@pytest.fixture()
def export_dir(tmp_path):
    with TuningStore.open(tmp_path / "src.duckdb") as db:
        fill(db, make_data(n_workloads=3, configs=5, runs=range(2)))
        db.export_parquet(tmp_path / "exp")
    return tmp_path / "exp"


def _assert_unchanged(path: Path, counts: dict[str, int]) -> None:
    with TuningStore.open(path, read_only=True) as db:
        assert db.counts() == counts


def test_parquet_with_wrong_columns_is_refused_before_any_write(tmp_path, export_dir):
    t = pq.read_table(export_dir / "measurements.parquet")
    pq.write_table(t.drop_columns(["error"]).append_column("comment", pa.array(["x"] * t.num_rows)),
                   export_dir / "measurements.parquet")
    target = tmp_path / "dst.duckdb"
    with TuningStore.open(target) as db:
        with pytest.raises(StoreError) as e:
            db.import_parquet(export_dir)
        assert _one_line(e) == (f"{export_dir / 'measurements.parquet'}: wrong columns for table "
                                "measurements: missing columns error; unexpected columns comment")
        assert db.counts() == dict.fromkeys(db.counts(), 0)  # devices etc. were not written either


def test_parquet_with_wrong_types_or_values(tmp_path, export_dir):
    t = pq.read_table(export_dir / "devices.parquet")
    bad = t.set_column(t.schema.get_field_index("sm_count"), "sm_count", pa.array([[1]] * t.num_rows))
    pq.write_table(bad, export_dir / "devices.parquet")
    with TuningStore.open(tmp_path / "dst.duckdb") as db:
        with pytest.raises(StoreError, match=r"devices.parquet: column sm_count has type list<\w+: int64>, "
                                             r"expected int32"):
            db.import_parquet(export_dir)
    # Castable type but impossible values: found while streaming, still nothing written.
    bad = t.set_column(t.schema.get_field_index("sm_count"), "sm_count", pa.array(["many"] * t.num_rows))
    pq.write_table(bad, export_dir / "devices.parquet")
    with TuningStore.open(tmp_path / "dst.duckdb") as db:
        with pytest.raises(StoreError, match=r"devices.parquet: bad values for table devices"):
            db.import_parquet(export_dir)
        assert db.counts()["devices"] == 0
    t = pq.read_table(export_dir / "measurements.parquet")
    status = t.schema.get_field_index("status")
    pq.write_table(t.set_column(status, "status", pa.array(["fast"] * t.num_rows)),
                   export_dir / "measurements.parquet")
    good = bad.set_column(bad.schema.get_field_index("sm_count"), "sm_count", pa.array([132] * bad.num_rows))
    pq.write_table(good, export_dir / "devices.parquet")
    with TuningStore.open(tmp_path / "dst.duckdb") as db:
        with pytest.raises(StoreError, match="unknown measurement status 'fast'"):
            db.import_parquet(export_dir)
        assert db.counts() == dict.fromkeys(db.counts(), 0)


def test_not_parquet_unknown_table_newer_manifest_and_orphans(tmp_path, export_dir):
    target = tmp_path / "dst.duckdb"
    TuningStore.open(target).close()
    junk = tmp_path / "runs.parquet"
    junk.write_text("not parquet")
    odd = tmp_path / "stuff.parquet"
    pq.write_table(pa.table({"a": [1]}), odd)
    manifest = json.loads((export_dir / "manifest.json").read_text())
    with TuningStore.open(target) as db:
        with pytest.raises(StoreError, match=r"runs.parquet is not a readable Parquet file"):
            db.import_parquet(junk)
        with pytest.raises(StoreError, match=r"stuff.parquet: cannot tell which tunedb table it holds"):
            db.import_parquet(odd)
        with pytest.raises(StoreError, match=r"does not exist"):
            db.import_parquet(tmp_path / "missing")
        (tmp_path / "empty_dir").mkdir()
        with pytest.raises(StoreError, match="empty_dir holds no tunedb Parquet files"):
            db.import_parquet(tmp_path / "empty_dir")
        # A lone measurements file refers to candidates this database lacks.
        with pytest.raises(StoreError, match="measurement refers to unknown candidate"):
            db.import_parquet(export_dir / "measurements.parquet")
        (export_dir / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
        with pytest.raises(StoreError) as e:
            db.import_parquet(export_dir)
        assert _one_line(e) == (f"{export_dir / 'manifest.json'}: export schema v99 is newer than this "
                                f"tunedb (v{SCHEMA_VERSION}); upgrade tunedb")
        (export_dir / "manifest.json").write_text("{")
        with pytest.raises(StoreError, match="is not a tunedb export manifest"):
            db.import_parquet(export_dir)
        assert db.counts() == dict.fromkeys(db.counts(), 0)


def test_merge_refuses_itself_and_bad_files(tmp_path):
    path = tmp_path / "a.duckdb"
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"\0" * 8192)
    with TuningStore.open(path) as db:
        with pytest.raises(StoreError, match="cannot merge database .* into itself"):
            db.merge(path)
        with pytest.raises(StoreError, match="junk.duckdb is not a tunedb database"):
            db.merge(junk)
        with pytest.raises(StoreError, match="does not exist"):
            db.merge(tmp_path / "missing.duckdb")
