"""``tunedb db``: inspect, export, import and merge tuning databases."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from tunedb.cli.common import (
    DbOption,
    JsonOption,
    db_path,
    existing_db,
    fail,
    handle_errors,
    open_store,
    print_json,
    resolve_db,
)

# Show a progress bar only for imports big enough to take a moment, and only on a terminal.
_PROGRESS_MIN_ROWS = 200_000


def _with_progress(total_rows: Callable[[], int], work: Callable[[Any], dict[str, int]]) -> dict[str, int]:
    """Run ``work(progress_callback)``, drawing a bar per table when it is worth it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal or total_rows() < _PROGRESS_MIN_ROWS:
        return work(None)
    with Progress(TextColumn("{task.description:<13}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def update(table: str, done: int, total: int) -> None:
            if table not in tasks:
                tasks[table] = bar.add_task(table, total=total)
            bar.update(tasks[table], completed=done)

        return work(update)


def _print_counts(title: str, counts: dict[str, int], json_out: bool) -> None:
    if json_out:
        print_json(counts)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("table")
    table.add_column("rows", justify="right")
    for name, n in counts.items():
        table.add_row(name, f"{n:,}")
    Console().print(table)


@contextmanager
def _no_new_empty_db(path: Path) -> Iterator[Path]:
    """The database an import or merge writes, its folders created if missing. If the work
    fails, a database that did not exist before leaves nothing behind: no file, no folders."""
    missing = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
    existed = path.exists()
    resolve_db(path)
    try:
        yield path
    except BaseException:
        if not existed:
            for leftover in (path, path.with_name(path.name + ".wal")):
                leftover.unlink(missing_ok=True)
            for folder in missing:  # innermost first
                try:
                    folder.rmdir()
                except OSError:
                    break
        raise


def db_info(db: DbOption = None, json_out: JsonOption = False) -> None:
    """Show a database's schema version, row counts per table and the devices it holds.

    Opens the file read-only and never changes it; while a collector writes the file, waits for
    its commit. With --json, prints one JSON object with the keys path, schema_version, counts
    (rows per table) and devices.

    Example: tunedb db info --db runs/h200.duckdb --json
    """
    from dataclasses import asdict

    path = existing_db(db)
    with open_store(path, read_only=True) as store:
        counts, devices, version = store.counts(), store.devices(), store.schema_version
    if json_out:
        print_json({"path": str(path.resolve()), "schema_version": version, "counts": counts,
                    "devices": [{"id": d.id, **asdict(d)} for d in devices]})
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{path.resolve()}[/bold]  schema v{version}", highlight=False, markup=True)
    _print_counts("rows", counts, json_out=False)
    if devices:
        table = Table(title="devices")
        for col in ("id", "name", "cc", "SMs", "L2 MiB", "memory GiB", "driver", "CUDA"):
            table.add_column(col)
        for d in devices:
            table.add_row(d.id, d.name, d.compute_capability, str(d.sm_count), f"{d.l2_bytes / 2**20:g}",
                          f"{d.memory_bytes / 2**30:.1f}", d.driver, d.cuda_runtime)
        console.print(table)


def db_export(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write (created if its parent exists).")],
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Export every table as Parquet (one file per table) plus manifest.json.

    The export is a consistent snapshot, sorted by natural key, so the same data always gives
    the same files. Use it to ship measurements between machines; `tunedb db import` reads it.

    Example: tunedb db export shards/h200-run7 --db h200.duckdb
    """
    import os

    out_dir = out_dir.expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"export folder {out_dir} is a file")
    parent = out_dir.parent
    if not parent.is_dir():
        fail(f"cannot export to {out_dir}: folder {parent} does not exist")
    if not os.access(out_dir if out_dir.is_dir() else parent, os.W_OK):
        fail(f"cannot export to {out_dir}: not writable")
    with open_store(db, read_only=True) as store:
        manifest = store.export_parquet(out_dir)
    _print_counts(f"exported to {out_dir}", manifest["counts"], json_out)


def _sum_counts(parts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for table, n in part.items():
            total[table] = total.get(table, 0) + n
    return total


def db_import(
    paths: Annotated[list[Path], typer.Argument(help="Export directories, or tables' Parquet files.")],
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Import a Parquet export (from `tunedb db export`) into the database.

    Columns are checked first; then all tables go in one transaction, skipping rows whose natural
    key is already stored, so importing the same export twice adds nothing. A row that differs
    from the stored row of the same key is refused. Prints new rows and the database written.

    Several paths (one per host) go in one after another, each in its own transaction; all must
    exist before anything is written. Prints new rows (summed over the paths) and the database.

    Example: tunedb db import shards/h200-run7 --db all.duckdb
    """
    target = db_path(db)
    for path in paths:
        if not path.exists():
            fail(f"{path} does not exist")
    _ingest_all(target, paths, _export_rows, lambda store, p, cb: store.import_parquet(p, progress=cb),
                json_out)


def _ingest_all(target: Path, sources: list[Path], count: Callable[[Path], int],
                ingest: Callable[[Any, Path, Any], dict], json_out: bool) -> None:
    """Each source into ``target`` in its own transaction with a progress bar; prints the new
    rows summed over the sources. A failure leaves no new empty database behind."""
    parts = []
    with _no_new_empty_db(target), open_store(target) as store:
        for src in sources:
            parts.append(_with_progress(lambda s=src: count(s), lambda cb, s=src: ingest(store, s, cb)))
    _print_counts(f"new rows from {', '.join(map(str, sources))} in {target}", _sum_counts(parts), json_out)


def db_merge(
    other_dbs: Annotated[list[Path], typer.Argument(help="Other tunedb database files (read only).")],
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Merge every row of another tunedb database file into this one.

    Works like import: one transaction, duplicates skipped, conflicting rows refused, the other
    file opened read-only and never changed. Prints the number of new rows per table.

    Several files (one per host: tunedb db merge A B C) go in one after another, each in its own
    transaction; all are checked to exist first. Prints new rows summed over the files.

    Example: tunedb db merge gpu3.duckdb --db all.duckdb
    """
    target = db_path(db)
    for other_db in other_dbs:
        if target.exists() and target.resolve() == other_db.resolve():
            fail(f"cannot merge {other_db} into itself")
        if not other_db.exists():
            fail(f"{other_db} does not exist")

    def total(other_db: Path) -> int:
        with open_store(other_db, read_only=True) as other:
            return sum(other.counts().values())

    _ingest_all(target, other_dbs, total, lambda store, o, cb: store.merge(o, progress=cb), json_out)


def _export_rows(path: Path) -> int:
    """Rows an export holds, from its manifest (0 if unknown: then no progress bar)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return int(sum(manifest["counts"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def register(app: typer.Typer) -> None:
    db_app = typer.Typer(help="Inspect, export, import and merge tuning databases (DuckDB files).",
                         no_args_is_help=True)
    app.add_typer(db_app, name="db")
    for name, func in (("info", db_info), ("export", db_export), ("import", db_import),
                       ("merge", db_merge)):
        db_app.command(name)(handle_errors(func))

