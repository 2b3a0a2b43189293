"""Parquet export/import and database merge: how shards from many GPUs come together.

An export is a directory with one Parquet file per table (rows sorted by natural key, so the same
data gives the same bytes) and ``manifest.json`` (format, schema version, row counts, files),
written last: a directory without a manifest is an unfinished export. Each Parquet file also
names its table and schema version in its key-value metadata, so a lone file can be imported.

Imports and merges check every file's columns before writing anything, then insert all tables in
ONE transaction, de-duplicating on natural keys: a failure or a kill -9 leaves the database as it
was, and importing the same data twice changes nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from tunedb._version import __version__
from tunedb.store.arrow import Progress, arrow_reader
from tunedb.store.errors import StoreError, first_line
from tunedb.store.schema import TABLES, latest_version

if TYPE_CHECKING:  # the store calls this module; it hands itself in
    from tunedb.store.core import TuningStore

FORMAT = "tunedb-parquet"
MANIFEST = "manifest.json"
_TABLE_KEY = b"tunedb.table"
_VERSION_KEY = b"tunedb.schema_version"
_BATCH = 65536


def _file_schema(table: str) -> pa.Schema:
    meta = {_TABLE_KEY: table.encode(), _VERSION_KEY: str(latest_version()).encode()}
    return TABLES[table].arrow_schema.with_metadata(meta)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export_parquet(store: TuningStore, out_dir: str | Path) -> dict[str, Any]:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise StoreError(f"cannot export to {out}: it is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    con = store.con
    counts: dict[str, int] = {}
    files: dict[str, str] = {}
    con.execute("BEGIN TRANSACTION")  # one snapshot across all tables
    try:
        for name, spec in TABLES.items():
            schema = _file_schema(name)
            rel = con.sql(f"SELECT {', '.join(spec.names)} FROM main.{name} ORDER BY {', '.join(spec.key)}")
            tmp, final = out / f".{name}.parquet.tmp", out / f"{name}.parquet"
            n = 0
            with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
                for batch in arrow_reader(rel, _BATCH):
                    # DuckDB names list children and time zones its own way; cast to our schema.
                    writer.write_table(pa.Table.from_batches([batch]).cast(schema))
                    n += batch.num_rows
            os.replace(tmp, final)
            counts[name], files[name] = n, final.name
    except OSError as e:
        raise StoreError(f"cannot export to {out}: {e.strerror or e}") from None
    except duckdb.Error as e:
        raise StoreError(f"cannot export to {out}: {first_line(e)}") from None
    finally:
        con.execute("ROLLBACK")  # a read-only snapshot: nothing to commit
    manifest = {"format": FORMAT, "schema_version": latest_version(), "tunedb_version": __version__,
                "counts": counts, "files": files}
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _check_version(version: int, origin: Path | str) -> None:
    if version > latest_version():
        raise StoreError(f"{origin}: export schema v{version} is newer than this tunedb "
                         f"(v{latest_version()}); upgrade tunedb")


def _plan(path: Path) -> dict[str, Path]:
    """Which file holds which table; reads the manifest if there is one."""
    if not path.exists():
        raise StoreError(f"{path} does not exist")
    if not path.is_dir():
        return {_table_of_file(path): path}
    mpath = path / MANIFEST
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text())
            fmt, version, files = manifest["format"], int(manifest["schema_version"]), manifest["files"]
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{mpath} is not a tunedb export manifest ({first_line(e)})") from None
        if fmt != FORMAT:
            raise StoreError(f"{mpath} is not a tunedb export manifest (format {fmt!r})")
        _check_version(version, mpath)
        unknown = sorted(set(files) - set(TABLES))
        if unknown:
            raise StoreError(f"{mpath} lists unknown tables: {', '.join(unknown)}")
        if not isinstance(files, dict):
            raise StoreError(f"{mpath} is not a tunedb export manifest (files is not a mapping)")
        plan = {t: _inside(path, f, mpath) for t, f in files.items()}
        for f in plan.values():
            if not f.is_file():
                raise StoreError(f"{mpath} lists {f.name}, which is missing")
        return plan
    plan = {t: path / f"{t}.parquet" for t in TABLES if (path / f"{t}.parquet").is_file()}
    if not plan:
        raise StoreError(f"{path} holds no tunedb Parquet files (expected <table>.parquet and {MANIFEST})")
    return plan


def _inside(folder: Path, name: Any, manifest: Path) -> Path:
    """A file the manifest names: a plain file name inside the export folder, nothing else (an
    export must not make the importer read ``../x.parquet`` or an absolute path)."""
    text = str(name)
    if not isinstance(name, str) or not text or Path(text).name != text or text in (".", ".."):
        raise StoreError(f"{manifest} names {text!r}; an export lists plain file names in its folder")
    return folder / text


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise StoreError(f"{path} is not a readable Parquet file ({first_line(e)})") from None


def _table_of_file(path: Path) -> str:
    meta = _open_parquet(path).schema_arrow.metadata or {}
    name = meta.get(_TABLE_KEY, b"").decode() or path.stem
    if name not in TABLES:
        raise StoreError(f"{path}: cannot tell which tunedb table it holds (name it <table>.parquet, "
                         f"one of {', '.join(TABLES)})")
    return name


def _validate(table: str, path: Path) -> pq.ParquetFile:
    """Columns and types must match the table's schema before anything is written."""
    pf = _open_parquet(path)
    schema = pf.schema_arrow
    meta = schema.metadata or {}
    if _VERSION_KEY in meta:
        try:
            _check_version(int(meta[_VERSION_KEY]), path)
        except ValueError:
            raise StoreError(f"{path}: bad schema version in its metadata") from None
    expected = TABLES[table].arrow_schema
    missing = [n for n in expected.names if n not in schema.names]
    extra = [n for n in schema.names if n not in expected.names]
    if missing or extra:
        parts = ([f"missing columns {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected columns {', '.join(extra)}"] if extra else [])
        raise StoreError(f"{path}: wrong columns for table {table}: {'; '.join(parts)}")
    for field in expected:
        have = schema.field(field.name).type
        if have == field.type:
            continue
        try:
            pa.array([], type=have).cast(field.type)
        except (pa.ArrowException, NotImplementedError):
            raise StoreError(f"{path}: column {field.name} has type {have}, expected {field.type}") from None
    return pf


class _Feed:
    """Arrow batches cast to a table's schema, counted for progress. DuckDB pulls them from its
    own threads and reports failures in its words; ``error`` keeps ours so we can raise it."""

    def __init__(self, table: str, batches: Iterable[pa.RecordBatch], total: int, origin: str,
                 progress: Progress | None) -> None:
        self.table, self.total, self.origin, self.progress = table, total, origin, progress
        self.schema = TABLES[table].arrow_schema
        self.batches = batches
        self.error: BaseException | None = None

    def _gen(self) -> Iterator[pa.RecordBatch]:
        done = 0
        try:
            for batch in self.batches:
                try:
                    t = pa.Table.from_batches([batch]).select(self.schema.names).cast(self.schema)
                except (pa.ArrowException, ValueError) as e:
                    raise StoreError(f"{self.origin}: bad values for table {self.table} "
                                     f"({first_line(e)})") from None
                done += t.num_rows
                yield from t.to_batches()
                if self.progress is not None:
                    self.progress(self.table, done, self.total)
        except BaseException as e:
            self.error = e
            raise

    def reader(self) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(self.schema, self._gen())


def _load(store: TuningStore, feeds: list[_Feed], what: str) -> dict[str, int]:
    """Insert every feed in one transaction; returns new rows per table."""
    tables = [f.table for f in feeds]
    before = store._counts_of(tables)
    current: _Feed | None = None
    try:
        with store.transaction(what):
            for feed in feeds:
                current = feed
                store.ingest(feed.table, feed.reader(), feed.origin, refuse_conflicts=True)
    except StoreError:
        if current is not None and current.error is not None:
            raise current.error from None  # our own message, not DuckDB's rewording of it
        raise
    after = store._counts_of(tables)
    return {t: after[t] - before[t] for t in tables}


def import_parquet(store: TuningStore, path: str | Path, progress: Progress | None = None) -> dict[str, int]:
    p = Path(path)
    plan = _plan(p)
    files = {t: _validate(t, f) for t, f in plan.items()}  # every check before any write
    feeds = [
        _Feed(t, files[t].iter_batches(batch_size=_BATCH), files[t].metadata.num_rows, str(plan[t]), progress)
        for t in TABLES if t in files
    ]
    return _load(store, feeds, f"import {p}")


def _query_batches(store: TuningStore, sql: str) -> Iterator[pa.RecordBatch]:
    # Lazy: a DuckDB connection streams one result at a time, so each table's query starts only
    # when the previous table has been consumed.
    yield from arrow_reader(store.con.sql(sql), _BATCH)


def merge(store: TuningStore, other_db_path: str | Path, progress: Progress | None = None) -> dict[str, int]:
    other_path = Path(other_db_path).expanduser()
    if store.path is not None and other_path.exists() and store.path.exists() \
            and os.path.samefile(store.path, other_path):
        raise StoreError(f"cannot merge database {other_path} into itself")
    with type(store).open(other_path, read_only=True) as other:
        counts = other.counts()
        feeds = []
        for t, spec in TABLES.items():
            sql = f"SELECT {', '.join(spec.names)} FROM main.{t}"
            feeds.append(_Feed(t, _query_batches(other, sql), counts[t], str(other_path), progress))
        return _load(store, feeds, f"merge {other_path}")
