"""The ``tunedb`` command line: typer app ``app`` and the ``db`` command group.

Each command parses its options, calls one library function and prints the result (rich tables,
or JSON with ``--json``). Other command groups live in ``tunedb/cli_<name>.py`` modules that
expose ``register(app)``; the ones listed in ``_COMMAND_MODULES`` are registered at import time.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tunedb import __version__
from tunedb.cli_common import DbOption, JsonOption, handle_errors, open_store, print_json, resolve_db

app = typer.Typer(
    name="tunedb",
    help="Autotuning database and XGBoost cost-model trainer for GPU kernel fusion and scheduling.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(
    help="Inspect, export, import and merge tuning databases (DuckDB files).",
    no_args_is_help=True,
)
app.add_typer(db_app, name="db")

# Show a progress bar only for imports big enough to take a moment, and only on a terminal.
_PROGRESS_MIN_ROWS = 200_000


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tunedb {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Autotuning database and XGBoost cost-model trainer for GPU kernel fusion and scheduling."""


def _progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:<13}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


def _with_progress(total_rows: Callable[[], int], work: Callable[[Any], dict[str, int]]) -> dict[str, int]:
    """Run ``work(progress_callback)``, drawing a bar per table when it is worth it."""
    console = Console(stderr=True)
    if not console.is_terminal or total_rows() < _PROGRESS_MIN_ROWS:
        return work(None)
    with _progress_bar(console) as bar:
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
    table = Table(title=title)
    table.add_column("table")
    table.add_column("rows", justify="right")
    for name, n in counts.items():
        table.add_row(name, f"{n:,}")
    Console().print(table)


@db_app.command("info")
@handle_errors
def db_info(db: DbOption = None, json_out: JsonOption = False) -> None:
    """Show a database's schema version, row counts per table and the devices it holds.

    Opens the file read-only and never changes it. With --json, prints one JSON object with the
    keys path, schema_version, counts (rows per table) and devices.

    Example: tunedb db info --db runs/h200.duckdb --json
    """
    path = resolve_db(db)
    with open_store(path, read_only=True) as store:
        counts, devices, version = store.counts(), store.devices(), store.schema_version
    if json_out:
        print_json({"path": str(path.resolve()), "schema_version": version, "counts": counts,
                    "devices": [{"id": d.id, **asdict(d)} for d in devices]})
        return
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


@db_app.command("export")
@handle_errors
def db_export(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write (created if missing).")],
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Export every table as Parquet (one file per table) plus manifest.json.

    The export is a consistent snapshot, sorted by natural key, so the same data always gives
    the same files. Use it to ship measurements between machines; `tunedb db import` reads it.

    Example: tunedb db export shards/h200-run7 --db h200.duckdb
    """
    with open_store(db, read_only=True) as store:
        manifest = store.export_parquet(out_dir)
    _print_counts(f"exported to {out_dir}", manifest["counts"], json_out)


@db_app.command("import")
@handle_errors
def db_import(
    path: Annotated[Path, typer.Argument(help="Export directory, or one table's Parquet file.")],
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Import a Parquet export (from `tunedb db export`) into the database.

    Columns are checked first; then all tables go in one transaction, skipping rows whose natural
    key is already stored, so importing the same export twice adds nothing. Prints new rows.

    Example: tunedb db import shards/h200-run7 --db all.duckdb
    """
    with open_store(db) as store:
        added = _with_progress(lambda: _export_rows(path), lambda cb: store.import_parquet(path, progress=cb))
    _print_counts(f"new rows from {path}", added, json_out)


@db_app.command("merge")
@handle_errors
def db_merge(
    other_db: Annotated[Path, typer.Argument(help="Another tunedb database file (read only).")],
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Merge every row of another tunedb database file into this one.

    Works like import: one transaction, duplicates skipped, the other file opened read-only and
    never changed. Prints the number of new rows per table.

    Example: tunedb db merge gpu3.duckdb --db all.duckdb
    """
    def total() -> int:
        with open_store(other_db, read_only=True) as other:
            return sum(other.counts().values())

    with open_store(db) as store:
        added = _with_progress(total, lambda cb: store.merge(other_db, progress=cb))
    _print_counts(f"new rows from {other_db}", added, json_out)


def _export_rows(path: Path) -> int:
    """Rows an export holds, from its manifest (0 if unknown: then no progress bar)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return int(sum(manifest["counts"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def main() -> None:
    app(prog_name="tunedb")


# Command groups written as separate modules; a module that does not exist (yet) is skipped.
_COMMAND_MODULES = [
    "tunedb.cli_graph",
    "tunedb.cli_collect",
    "tunedb.cli_train",
    "tunedb.cli_models",
    "tunedb.cli_plan",
    "tunedb.cli_bench",
    "tunedb.cli_bench_plan",
    "tunedb.cli_report",
]


def _register_command_modules(target: typer.Typer = app) -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise  # the module exists but one of its imports is missing: that is a real bug
        module.register(target)


def reflow_help(text: str) -> str:
    """A docstring as ``--help`` prose: the lines of each paragraph joined, so that the terminal
    wraps them (typer keeps a docstring's line breaks, which left ragged lines at 80 columns).
    Paragraphs of bullets ("- ") or indented lines keep their breaks."""
    paragraphs = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines = para.splitlines()
        keep = any(line.startswith(("- ", " ")) for line in lines)
        paragraphs.append(para if keep else " ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def _reflow_commands(target: typer.Typer) -> None:
    for info in target.registered_commands:
        doc = info.help or inspect.getdoc(info.callback) or ""
        if doc:
            info.help = reflow_help(doc)
    for group in target.registered_groups:
        if group.typer_instance is not None:
            _reflow_commands(group.typer_instance)


_register_command_modules()
_reflow_commands(app)
