"""Database layout: tables, their Arrow/Parquet schemas, the tunedb marker and ordered migrations.

Every data table is described once in ``TABLES`` (column name, DuckDB type, Arrow type, natural
key). The same description drives the DDL, the Arrow tables that ``add_*`` insert, and the checks
applied to Parquet files on import, so the three cannot drift apart.

Schema changes append a ``(version, sql_or_callable)`` pair to ``MIGRATIONS``; opening a database
read-write applies the missing ones in one transaction. Never edit a released migration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from tunedb.store.errors import StoreError, first_line

# The marker that tells a tunedb file from any other DuckDB file (DuckDB has no application id).
APP_ID = "tunedb"
META_KEY = "application_id"

UTC_TIMESTAMP = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class Column:
    name: str
    sql: str  # DuckDB type plus constraints
    arrow: pa.DataType


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    # Extra DDL after the column list (e.g. a composite PRIMARY KEY).
    extra: str = ""

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.arrow) for c in self.columns])

    def ddl(self) -> str:
        cols = [f"{c.name} {c.sql}" for c in self.columns]
        if self.extra:
            cols.append(self.extra)
        return f"CREATE TABLE {self.name} (\n  " + ",\n  ".join(cols) + "\n)"


def _s(name: str, sql: str = "VARCHAR NOT NULL") -> Column:
    return Column(name, sql, pa.string())


# Insertion order: referenced tables before the tables that refer to them.
TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table("devices", (
            _s("id", "VARCHAR PRIMARY KEY"), _s("name"), _s("uuid_hash"), _s("compute_capability"),
            Column("sm_count", "INTEGER NOT NULL", pa.int32()),
            Column("l2_bytes", "BIGINT NOT NULL", pa.int64()),
            Column("memory_bytes", "BIGINT NOT NULL", pa.int64()),
            _s("driver"), _s("cuda_runtime"), _s("cupy_version"),
        ), key=("id",)),
        # Run timestamps stay ISO-8601 text so that a Run record round-trips byte for byte
        # ("" = not finished yet).
        Table("runs", (
            _s("id", "VARCHAR PRIMARY KEY"), _s("collector"), _s("tunedb_version"), _s("git_sha"),
            _s("host"), _s("config_json"), _s("started_at"), _s("finished_at"),
            _s("clocks_before"), _s("clocks_after"),
        ), key=("id",)),
        Table("workloads", (
            _s("hash", "VARCHAR PRIMARY KEY"), _s("family"), _s("name"), _s("graph_json"),
        ), key=("hash",)),
        Table("candidates", (
            _s("hash", "VARCHAR PRIMARY KEY"), _s("workload_hash"), _s("kind"), _s("config_json"),
            _s("source_hash"),
        ), key=("hash",)),
        # Resource facts are NULL when unknown (the records use -1), so that the training frame
        # hands XGBoost a missing value rather than a fake -1.
        Table("measurements", (
            _s("candidate_hash"), _s("device_id"), _s("run_id"), _s("status"),
            Column("samples_us", "DOUBLE[] NOT NULL", pa.list_(pa.float64())),
            Column("median_us", "DOUBLE", pa.float64()),
            Column("p20_us", "DOUBLE", pa.float64()),
            Column("p80_us", "DOUBLE", pa.float64()),
            _s("error"),
            Column("registers", "INTEGER", pa.int32()),
            Column("shared_bytes", "BIGINT", pa.int64()),
            Column("local_bytes", "BIGINT", pa.int64()),
            _s("protocol_json"),
            Column("measured_at", "TIMESTAMPTZ NOT NULL", UTC_TIMESTAMP),
        ), key=("candidate_hash", "device_id", "run_id"),
            extra="PRIMARY KEY (candidate_hash, device_id, run_id)"),
        Table("models", (
            _s("id", "VARCHAR PRIMARY KEY"), _s("kind"), _s("device"), _s("path"), _s("card_json"),
            Column("created_at", "TIMESTAMPTZ NOT NULL", UTC_TIMESTAMP),
        ), key=("id",)),
    )
}

# (table, column, referenced table, referenced column): checked on every insert and import.
REFERENCES: tuple[tuple[str, str, str, str], ...] = (
    ("candidates", "workload_hash", "workloads", "hash"),
    ("measurements", "candidate_hash", "candidates", "hash"),
    ("measurements", "device_id", "devices", "id"),
    ("measurements", "run_id", "runs", "id"),
)

_V1 = ";\n".join([
    "CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)",
    "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL)",
    *(t.ddl() for t in TABLES.values()),
])

Migration = Callable[[duckdb.DuckDBPyConnection], None]
MIGRATIONS: list[tuple[int, str | Migration]] = [
    (1, _V1),
]
SCHEMA_VERSION: int = MIGRATIONS[-1][0]


def latest_version() -> int:
    """The schema version this code writes (read at call time, so tests can add a migration)."""
    return MIGRATIONS[-1][0]


def inspect(con: duckdb.DuckDBPyConnection) -> tuple[str, int]:
    """Classify an open database: ("empty", 0), ("tunedb", version) or ("foreign", 0)."""
    rows = con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "UNION ALL SELECT view_name FROM duckdb_views() "
        "WHERE database_name = current_database() AND NOT internal"
    ).fetchall()
    names = {r[0] for r in rows}
    if not names:
        return "empty", 0
    if not {"meta", "schema_version"} <= names:
        return "foreign", 0
    # fetchall, never fetchone: DuckDB 2 refuses new queries while a result is half read.
    marker = con.execute("SELECT value FROM meta WHERE key = ?", [META_KEY]).fetchall()
    if not marker or marker[0][0] != APP_ID:
        return "foreign", 0
    version = con.execute("SELECT max(version) FROM schema_version").fetchall()
    return "tunedb", int(version[0][0] or 0)


def migrate(con: duckdb.DuckDBPyConnection, current: int) -> int:
    """Apply the migrations newer than ``current`` in one transaction; returns the new version."""
    pending = [(v, m) for v, m in MIGRATIONS if v > current]
    if not pending:
        return current
    con.execute("BEGIN TRANSACTION")
    try:
        for version, step in pending:
            if callable(step):
                step(con)
            else:
                con.execute(step)
            con.execute(
                "INSERT INTO schema_version (version, applied_at) VALUES (?, current_timestamp)",
                [version],
            )
        con.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT DO NOTHING", [META_KEY, APP_ID]
        )
        con.execute("COMMIT")
    except duckdb.Error as e:
        con.execute("ROLLBACK")
        raise StoreError(f"schema migration to v{pending[-1][0]} failed: {first_line(e)}") from None
    return pending[-1][0]
