"""TuningStore: the DuckDB tuning database (open, add records in batches, query).

One process writes a database file at a time (DuckDB's file lock enforces it); collector workers
hand their results to that process, which adds them in batched transactions. Every ``add_*`` call
is one transaction: it inserts a whole list or nothing, skips rows whose natural key is already
stored, and rejects rows that refer to unknown parents (a measurement needs its candidate, device
and run; a candidate its workload), so that joins never silently drop data.

A connection is not safe to share between threads; open one store per process.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tunedb.records import STATUSES, Candidate, DeviceInfo, Measurement, Run, Workload
from tunedb.store import exchange
from tunedb.store.arrow import Progress, arrow_table
from tunedb.store.errors import StoreError, first_line
from tunedb.store.schema import REFERENCES, TABLES, UTC_TIMESTAMP, inspect, latest_version, migrate

_LOCK_PID = re.compile(r"\(PID (\d+)\)")
_LOCK_POLL_S = 0.05
# How long the library's readers (plan, train) wait for a file another process holds: a
# collector holds it only while it commits, for well under a second.
BUSY_WAIT_S = 30.0
_CORRUPT_HINTS = ("not a valid duckdb database", "corrupt", "checksum", "serialization error")


class _OpenInThisProcess(StoreError):
    """DuckDB keeps one instance per file per process, with one read_only setting."""


class LockedError(StoreError):
    """Another process holds the database file (DuckDB's lock): a writer, or readers while we
    want to write."""


def _open_error(path: Path, exc: duckdb.Error, read_only: bool) -> StoreError:
    text = str(exc)
    if "Could not set lock" in text or "Conflicting lock" in text:
        m = _LOCK_PID.search(text)
        who = f"pid {m.group(1)}" if m else "pid unknown"
        return LockedError(
            f"database {path} is locked by another process ({who}); tunedb allows one writer per file"
        )
    if "different configuration" in text:
        other = "read-write" if read_only else "read-only"
        return _OpenInThisProcess(f"database {path} is already open {other} in this process; "
                                  "use that store or close it first")
    if any(h in text.lower() for h in _CORRUPT_HINTS):
        return StoreError(f"{path} is not a tunedb database (not a DuckDB file or corrupt)")
    return StoreError(f"cannot open database {path}: {first_line(exc)}")


def _connect(path: Path | str, read_only: bool) -> duckdb.DuckDBPyConnection:
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as e:
        raise _open_error(Path(path), e, read_only) from None
    con.execute("SET enable_progress_bar = false")  # it writes to stdout and breaks --json output
    return con


def _checked_inspect(con: duckdb.DuckDBPyConnection, path: Path | str) -> tuple[str, int]:
    """Classify the database; raise for foreign files and newer schemas (which we never touch)."""
    try:
        kind, version = inspect(con)
    except duckdb.Error:
        raise StoreError(f"{path} is not a tunedb database (not a DuckDB file or corrupt)") from None
    if kind == "foreign":
        raise StoreError(f"{path} is a DuckDB database but not a tunedb database (no tunedb marker)")
    if version > latest_version():
        raise StoreError(
            f"database schema v{version} is newer than this tunedb (v{latest_version()}); upgrade tunedb"
        )
    return kind, version


# Columns that may differ between two copies of one row without a conflict: the software a
# board ran, a run that one copy saw finish, where a model file lies on each machine, when a
# measurement's record was made.
_MAY_DIFFER: dict[str, dict[str, str]] = {
    "devices": {"driver": "true", "cuda_runtime": "true", "cupy_version": "true"},
    "runs": {"finished_at": "s.finished_at = '' OR m.finished_at = ''",
             "clocks_after": "s.finished_at = '' OR m.finished_at = ''"},
    "models": {"path": "true", "created_at": "true"},
    "measurements": {"measured_at": "true"},
}


def _key_text(names: Sequence[str], values: Sequence[Any]) -> str:
    return ", ".join(f"{n}={v}" for n, v in zip(names, values))


def _opt(v: int) -> int | None:
    return None if v is None or v < 0 else int(v)


def _iso(epoch_us: int | None) -> str:
    if epoch_us is None:
        return ""
    return datetime.fromtimestamp(epoch_us / 1e6, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def _records(kind: type, items: Iterable[Any], what: str) -> list[Any]:
    items = list(items)
    for it in items:
        if not isinstance(it, kind):
            raise StoreError(f"{what} expects {kind.__name__} records, got {type(it).__name__}")
    return items


class TuningStore:
    """A tunedb DuckDB database. Use ``TuningStore.open(path)``; it is a context manager."""

    def __init__(self, con: duckdb.DuckDBPyConnection, path: Path | None, read_only: bool,
                 version: int) -> None:
        self._con: duckdb.DuckDBPyConnection | None = con
        self._path = path
        self._read_only = read_only
        self._version = version

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, path: str | Path, read_only: bool = False, wait_s: float = 0.0,
             on_wait: Callable[[str], None] | None = None, known: bool = False) -> TuningStore:
        """Open (creating and initialising it if missing, unless ``read_only``) a tunedb file.

        ``":memory:"`` gives a throw-away in-memory database. Existing files are first inspected
        read-only, so a foreign, corrupt or newer-schema file is never written to. While another
        process holds the file, retry for up to ``wait_s`` seconds (a busy timeout: a collector
        holds it only while it commits), telling ``on_wait`` once; then raise the lock error.
        ``known``: this process opened the file read-write before (it is a checked tunedb file),
        so skip the first read-only look (a DuckDB open costs ~80 ms).
        """
        deadline = time.monotonic() + max(0.0, wait_s)
        told = False
        while True:
            try:
                return cls._open(path, read_only, known)
            except LockedError as e:
                if time.monotonic() >= deadline:
                    if told:
                        raise LockedError(f"{e} (waited {wait_s:g} s)") from None
                    raise
                if on_wait is not None and not told:
                    on_wait(f"{e}; waiting up to {wait_s:g} s")
                told = True
                time.sleep(_LOCK_POLL_S)

    @classmethod
    def _open(cls, path: str | Path, read_only: bool, known: bool = False) -> TuningStore:
        if str(path) == ":memory:":
            con = duckdb.connect(":memory:")
            con.execute("SET enable_progress_bar = false")
            return cls(con, None, False, migrate(con, 0))
        p = Path(path).expanduser()
        if p.is_dir():
            raise StoreError(f"{p} is a directory, not a database file")
        con: duckdb.DuckDBPyConnection | None = None
        if p.exists() and not (known and not read_only):
            try:
                con = _connect(p, read_only=True)
            except _OpenInThisProcess:
                # This process already has the file open read-write (so it is a checked tunedb
                # file): a second read-write store shares that DuckDB instance.
                if read_only:
                    raise
        if con is not None:
            try:
                kind, version = _checked_inspect(con, p)
                if read_only and kind == "empty":
                    raise StoreError(f"{p} is an empty DuckDB database; open it read-write to initialise it")
                if read_only and version < latest_version():
                    raise StoreError(f"database schema v{version} is older than this tunedb "
                                     f"(v{latest_version()}); open it read-write once to upgrade it")
            except BaseException:
                con.close()
                raise
            if read_only:
                return cls(con, p, True, version)
            con.close()
        elif read_only:
            raise StoreError(f"database {p} does not exist")
        elif not p.exists():
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create directory {p.parent}: {e.strerror or e}") from None
        con = _connect(p, read_only=False)
        try:
            # Inspect again: another process may have changed the file between the two opens.
            _, version = _checked_inspect(con, p)
            version = migrate(con, version)
        except BaseException:
            con.close()
            raise
        return cls(con, p, False, version)

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None

    def __enter__(self) -> TuningStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def schema_version(self) -> int:
        return self._version

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection, for read queries the API does not cover."""
        if self._con is None:
            raise StoreError(f"database {self._path} is closed")
        return self._con

    # ------------------------------------------------------------------ writing
    @contextmanager
    def transaction(self, what: str) -> Iterator[duckdb.DuckDBPyConnection]:
        """One write transaction: commits on success, rolls back (and raises StoreError) on error."""
        if self._read_only:
            raise StoreError(f"cannot {what}: database {self._path} is open read-only")
        con = self.con
        con.execute("BEGIN TRANSACTION")
        try:
            yield con
            con.execute("COMMIT")
        except BaseException as e:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass  # a failed COMMIT has already ended the transaction
            if isinstance(e, duckdb.Error):
                raise StoreError(f"cannot {what}: {first_line(e)}") from None
            raise

    def ingest(self, table: str, source: pa.Table | pa.RecordBatchReader, origin: str,
               refuse_conflicts: bool = False) -> None:
        """Insert Arrow rows into ``table`` inside the current transaction.

        Rows are staged in a temp table (de-duplicated on the natural key), checked (statuses,
        references to parents), then inserted with ON CONFLICT DO NOTHING. Runs are the exception:
        a stored run that has not finished takes ``finished_at``/``clocks_after`` from an incoming
        finished copy, so a shard exported after its run ended completes the row.
        With ``refuse_conflicts`` (imports and merges), two rows of one key that differ, in the
        source or against the stored row, are an error instead of a silent pick.
        """
        spec = TABLES[table]
        con = self.con
        src, stage = f"_tunedb_src_{table}", f"_tunedb_stage_{table}"
        cols, keys = ", ".join(spec.names), ", ".join(spec.key)
        con.register(src, source)
        try:
            if refuse_conflicts:
                con.execute(f"CREATE OR REPLACE TEMP TABLE {stage} AS SELECT DISTINCT {cols} FROM {src}")
            else:
                con.execute(
                    f"CREATE OR REPLACE TEMP TABLE {stage} AS SELECT DISTINCT ON ({keys}) {cols} FROM {src}"
                )
        finally:
            con.unregister(src)
        try:
            if refuse_conflicts:
                self._check_conflicts(table, stage, origin)
            self._check_stage(table, stage, origin)
            if table == "runs":
                conflict = (
                    "ON CONFLICT (id) DO UPDATE SET finished_at = excluded.finished_at, "
                    "clocks_after = excluded.clocks_after "
                    "WHERE runs.finished_at = '' AND excluded.finished_at <> ''"
                )
            else:
                conflict = "ON CONFLICT DO NOTHING"
            try:
                con.execute(f"INSERT INTO main.{table} BY NAME SELECT {cols} FROM {stage} {conflict}")
            except duckdb.Error as e:  # e.g. a NULL in a NOT NULL column: name it, with the file
                raise StoreError(f"{origin}: cannot add rows to {table}: {first_line(e)}") from None
        finally:
            try:
                con.execute(f"DROP TABLE IF EXISTS {stage}")
            except duckdb.Error:
                pass  # the transaction failed; its rollback drops the temp table

    def _check_conflicts(self, table: str, stage: str, origin: str) -> None:
        spec, con = TABLES[table], self.con
        keys = ", ".join(spec.key)
        dup = con.execute(f"SELECT {keys} FROM {stage} GROUP BY ALL HAVING count(*) > 1 LIMIT 1").fetchall()
        if dup:
            raise StoreError(f"{origin}: two different {table} rows share the key "
                             f"{_key_text(spec.key, dup[0])}")
        loose = _MAY_DIFFER.get(table, {})
        same = [f"s.{c} IS NOT DISTINCT FROM m.{c}" if c not in loose else
                f"(s.{c} IS NOT DISTINCT FROM m.{c} OR {loose[c]})"
                for c in spec.names if c not in spec.key]
        on = " AND ".join(f"s.{k} = m.{k}" for k in spec.key)
        sel = ", ".join(f"s.{k}" for k in spec.key)
        bad = con.execute(f"SELECT {sel} FROM {stage} s JOIN main.{table} m ON {on} "
                          f"WHERE NOT ({' AND '.join(same) or 'true'}) LIMIT 1").fetchall()
        if bad:
            raise StoreError(f"{origin}: a {table[:-1]} row with key {_key_text(spec.key, bad[0])} "
                             "differs from the stored row of that key; nothing was imported")

    def _check_stage(self, table: str, stage: str, origin: str) -> None:
        con = self.con
        if table == "measurements":
            placeholders = ", ".join("?" for _ in STATUSES)
            bad = con.execute(
                f"SELECT status FROM {stage} WHERE status NOT IN ({placeholders}) LIMIT 1", list(STATUSES)
            ).fetchall()
            if bad:
                raise StoreError(f"{origin}: unknown measurement status {bad[0][0]!r}; expected one of "
                                 f"{', '.join(STATUSES)}")
            bad = con.execute(
                f"SELECT candidate_hash FROM {stage} WHERE status = 'ok' "
                "AND (len(samples_us) = 0 OR median_us IS NULL) LIMIT 1"
            ).fetchall()
            if bad:
                raise StoreError(f"{origin}: ok measurement of candidate {bad[0][0]} has no samples")
        for child, col, parent, pcol in REFERENCES:
            if child != table:
                continue
            bad = con.execute(
                f"SELECT s.{col} FROM {stage} s ANTI JOIN main.{parent} p ON p.{pcol} = s.{col} LIMIT 1"
            ).fetchall()
            if bad:
                noun = parent[:-1]
                raise StoreError(f"{origin}: {table[:-1]} refers to unknown {noun} {bad[0][0]}; "
                                 f"add the {noun} first")

    def _add(self, table: str, rows: pa.Table) -> int:
        before = self._count(table)
        with self.transaction(f"add {table}"):
            self.ingest(table, rows, f"add_{table}")
        return self._count(table) - before

    def add_devices(self, devices: Iterable[DeviceInfo]) -> int:
        """Add devices (keyed by ``DeviceInfo.id``); returns how many were new."""
        ds = _records(DeviceInfo, devices, "add_devices")
        rows = [{"id": d.id, **asdict(d)} for d in ds]
        return self._add("devices", pa.Table.from_pylist(rows, schema=TABLES["devices"].arrow_schema))

    def add_runs(self, runs: Iterable[Run]) -> int:
        rs = _records(Run, runs, "add_runs")
        return self._add("runs", pa.Table.from_pylist([asdict(r) for r in rs],
                                                      schema=TABLES["runs"].arrow_schema))

    def add_workloads(self, workloads: Iterable[Workload]) -> int:
        ws = _records(Workload, workloads, "add_workloads")
        return self._add("workloads", pa.Table.from_pylist([asdict(w) for w in ws],
                                                           schema=TABLES["workloads"].arrow_schema))

    def add_candidates(self, candidates: Iterable[Candidate]) -> int:
        cs = _records(Candidate, candidates, "add_candidates")
        rows = [{"hash": c.hash, "workload_hash": c.workload_hash, "kind": c.kind,
                 "config_json": c.config_json, "source_hash": c.source_hash} for c in cs]
        return self._add("candidates", pa.Table.from_pylist(rows, schema=TABLES["candidates"].arrow_schema))

    def add_measurements(self, measurements: Iterable[Measurement]) -> int:
        """Add measurements with all their raw samples; the quantiles are computed here."""
        ms = _records(Measurement, measurements, "add_measurements")
        now = datetime.now(timezone.utc)
        cols = {
            "candidate_hash": [m.candidate_hash for m in ms],
            "device_id": [m.device_id for m in ms],
            "run_id": [m.run_id for m in ms],
            "status": [m.status for m in ms],
            "samples_us": pa.array([m.samples_us for m in ms], type=pa.list_(pa.float64())),
            "median_us": [m.median_us for m in ms],
            "p20_us": [m.p20_us for m in ms],
            "p80_us": [m.p80_us for m in ms],
            "error": [m.error for m in ms],
            "registers": [_opt(m.registers) for m in ms],
            "shared_bytes": [_opt(m.shared_bytes) for m in ms],
            "local_bytes": [_opt(m.local_bytes) for m in ms],
            "protocol_json": [m.protocol_json for m in ms],
            "measured_at": pa.array([now] * len(ms), type=UTC_TIMESTAMP),
        }
        return self._add("measurements", pa.table(cols, schema=TABLES["measurements"].arrow_schema))

    def add_model(self, model_id: str, kind: str, device: str, path: str, card_json: str) -> int:
        """Register a trained model (booster file + card); returns 1 if new, 0 if already known."""
        t = pa.Table.from_pylist(
            [{"id": model_id, "kind": kind, "device": device, "path": path, "card_json": card_json,
              "created_at": datetime.now(timezone.utc)}], schema=TABLES["models"].arrow_schema)
        return self._add("models", t)

    def finish_run(self, run_id: str, finished_at: str, clocks_after: str = "") -> None:
        with self.transaction("finish run") as con:
            found = con.execute(
                "UPDATE runs SET finished_at = ?, clocks_after = ? WHERE id = ? RETURNING id",
                [finished_at, clocks_after, run_id],
            ).fetchall()
            if not found:
                raise StoreError(f"cannot finish run {run_id}: no such run")

    # ------------------------------------------------------------------ reading
    def _count(self, table: str) -> int:
        return int(self.con.execute(f"SELECT count(*) FROM main.{table}").fetchall()[0][0])

    def counts(self) -> dict[str, int]:
        """Row count of every data table."""
        return {t: self._count(t) for t in TABLES}

    def devices(self) -> list[DeviceInfo]:
        fields = [c for c in TABLES["devices"].names if c != "id"]
        rows = self.con.execute(f"SELECT {', '.join(fields)} FROM devices ORDER BY id").fetchall()
        return [DeviceInfo(*r) for r in rows]

    def runs(self) -> list[Run]:
        cols = ", ".join(TABLES["runs"].names)
        rows = self.con.execute(f"SELECT {cols} FROM runs ORDER BY started_at, id").fetchall()
        return [Run(*r) for r in rows]

    def workload(self, workload_hash: str) -> Workload | None:
        r = self.con.execute("SELECT hash, family, name, graph_json FROM workloads WHERE hash = ?",
                             [workload_hash]).fetchall()
        return Workload(*r[0]) if r else None

    def workloads(self, family: str | None = None) -> list[Workload]:
        sql, params = "SELECT hash, family, name, graph_json FROM workloads", []
        if family is not None:
            sql, params = sql + " WHERE family = ?", [family]
        return [Workload(*r) for r in self.con.execute(sql + " ORDER BY hash", params).fetchall()]

    def candidates(self, workload_hash: str | None = None, kind: str | None = None) -> list[Candidate]:
        where, params = self._where({"workload_hash": workload_hash, "kind": kind})
        rows = self.con.execute(
            f"SELECT workload_hash, kind, config_json, source_hash FROM candidates{where} ORDER BY hash",
            params).fetchall()
        return [Candidate(w, k, json.loads(c), s) for w, k, c, s in rows]

    def measurements(self, candidate_hash: str | None = None, device_id: str | None = None,
                     run_id: str | None = None) -> list[Measurement]:
        where, params = self._where({"candidate_hash": candidate_hash, "device_id": device_id,
                                     "run_id": run_id})
        rows = self.con.execute(
            "SELECT candidate_hash, device_id, run_id, status, samples_us, error, registers, "
            f"shared_bytes, local_bytes, protocol_json FROM measurements{where} "
            "ORDER BY candidate_hash, device_id, run_id", params).fetchall()
        return [Measurement(c, d, r, s, tuple(x), e, -1 if g is None else g, -1 if sh is None else sh,
                            -1 if lo is None else lo, p) for c, d, r, s, x, e, g, sh, lo, p in rows]

    def models(self) -> list[dict[str, str]]:
        rows = self.con.execute(
            "SELECT id, kind, device, path, card_json, epoch_us(created_at) FROM models "
            "ORDER BY created_at, id").fetchall()
        keys = ("id", "kind", "device", "path", "card_json")
        return [{**dict(zip(keys, r[:5])), "created_at": _iso(r[5])} for r in rows]

    @staticmethod
    def _where(filters: dict[str, Any], prefix: str = "") -> tuple[str, list[Any]]:
        parts, params = [], []
        for col, val in filters.items():
            if val is not None:
                parts.append(f"{prefix}{col} = ?")
                params.append(val)
        return (" WHERE " + " AND ".join(parts) if parts else ""), params

    def measured_candidates(self, device_id: str, run_id: str | None = None) -> set[str]:
        """Hashes of candidates with any measurement (any status) on ``device_id``."""
        where, params = self._where({"device_id": device_id, "run_id": run_id})
        rows = self.con.execute(f"SELECT DISTINCT candidate_hash FROM measurements{where}", params).fetchall()
        return {r[0] for r in rows}

    def top_k(self, workload_hash: str, device_id: str | Sequence[str], k: int
              ) -> list[tuple[Candidate, float]]:
        """The ``k`` fastest candidates of a workload on a device, or on any of several device
        ids (status ok), best first.

        A candidate measured in several runs is ranked by the median of its runs' medians.
        """
        ids = [device_id] if isinstance(device_id, str) else list(device_id)
        if k <= 0 or not ids:
            return []
        marks = ", ".join("?" for _ in ids)
        rows = self.con.execute(
            "SELECT c.workload_hash, c.kind, c.config_json, c.source_hash, median(m.median_us) AS t "
            "FROM measurements m JOIN candidates c ON c.hash = m.candidate_hash "
            f"WHERE c.workload_hash = ? AND m.device_id IN ({marks}) AND m.status = 'ok' "
            "GROUP BY c.hash, c.workload_hash, c.kind, c.config_json, c.source_hash "
            "ORDER BY t, c.hash LIMIT ?", [workload_hash, *ids, int(k)]).fetchall()
        return [(Candidate(w, kd, json.loads(cfg), s), float(t)) for w, kd, cfg, s, t in rows]

    def same_model_ids(self, device: DeviceInfo) -> list[str]:
        """``device.id`` first, then the stored devices of the same model (name, compute
        capability, SM count): two boards of one model rank kernels alike (on the shipped H200
        data, re-measurements on a second board drift by about as much as on the same board),
        while a new driver or board gets a new device id."""
        rows = self.con.execute(
            "SELECT id FROM devices WHERE name = ? AND compute_capability = ? AND sm_count = ? "
            "AND id <> ? ORDER BY id",
            [device.name, device.compute_capability, int(device.sm_count), device.id]).fetchall()
        return [device.id] + [r[0] for r in rows]

    def training_frame(self, kind: str | None = "fusion", device_id: str | None = None,
                       status: str | None = "ok", include_graph: bool = True) -> pa.Table:
        """One row per measurement, joined with its workload, candidate and device.

        Filters are skipped when None. Columns: workload_hash, family, workload_name, graph_json
        (unless ``include_graph`` is False), candidate_hash, kind, config_json, source_hash,
        device_id, device_name, run_id, status, median_us, p20_us, p80_us, registers,
        shared_bytes, local_bytes (NULL = unknown). Sorted by workload, candidate, device, run.
        """
        where, params = self._where({"c.kind": kind, "m.device_id": device_id, "m.status": status})
        graph = "w.graph_json, " if include_graph else ""
        sql = (
            f"SELECT w.hash AS workload_hash, w.family, w.name AS workload_name, {graph}"
            "c.hash AS candidate_hash, c.kind, c.config_json, c.source_hash, "
            "d.id AS device_id, d.name AS device_name, m.run_id, m.status, m.median_us, m.p20_us, "
            "m.p80_us, m.registers, m.shared_bytes, m.local_bytes "
            "FROM measurements m JOIN candidates c ON c.hash = m.candidate_hash "
            "JOIN workloads w ON w.hash = c.workload_hash JOIN devices d ON d.id = m.device_id"
            f"{where} ORDER BY w.hash, c.hash, d.id, m.run_id"
        )
        return arrow_table(self.con.sql(sql, params=params))

    # ------------------------------------------------------------------ exchange
    def export_parquet(self, out_dir: str | Path) -> dict[str, Any]:
        """Write one Parquet file per table plus ``manifest.json``; returns the manifest."""
        return exchange.export_parquet(self, out_dir)

    def import_parquet(self, path: str | Path, progress: Progress | None = None) -> dict[str, int]:
        """Import an export directory (or one table's Parquet file) in one transaction.

        Rows already stored are skipped; returns the number of new rows per table."""
        return exchange.import_parquet(self, path, progress)

    def merge(self, other_db_path: str | Path, progress: Progress | None = None) -> dict[str, int]:
        """Import every row of another tunedb database file, like ``import_parquet``."""
        return exchange.merge(self, other_db_path, progress)

    def _counts_of(self, tables: Sequence[str]) -> dict[str, int]:
        return {t: self._count(t) for t in tables}
