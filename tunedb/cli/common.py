"""Pieces every tunedb command module shares: the database option, error handling, output.

A command module (``tunedb/cli/<group>.py``) exposes ``register(app)`` and writes its commands as:

    @app.command("train")
    @handle_errors
    def train(db: DbOption = None, json_out: JsonOption = False) -> None:
        with open_store(db, read_only=True) as store:
            ...

This module imports nothing but typer: every command's ``--help`` pays for what it imports.
Known errors (the ones named in ``_KNOWN_ERRORS``, checked only once one is raised, so that
naming them imports nothing) become ``error: <message>`` on stderr with exit status 1.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from tunedb.store import TuningStore

DB_ENV = "TUNEDB_DB"
BUSY_ENV = "TUNEDB_BUSY_TIMEOUT"

DbOption = Annotated[
    Path | None,
    typer.Option(
        "--db",
        envvar=DB_ENV,
        show_default=False,
        help="Tuning database file; default $TUNEDB_DB, else $XDG_DATA_HOME/tunedb/tunedb.duckdb, "
        "else ~/.local/share/tunedb/tunedb.duckdb.",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
# Planning commands: "none" plans with roofline prices; no option, with the registry's model for
# the device when there is one (tunedb.plan.driver.load_cost_model).
CostModelOption = Annotated[
    Path | None,
    typer.Option(
        "--model",
        show_default=False,
        help="Cost model directory (model.ubj + card.json) or registry root; none: roofline prices "
        "only. Default: the model registered for the device's GPU under $TUNEDB_MODELS, else the "
        "model shipped with tunedb, when there is one.",
    ),
]

# module:class of every error a command may show as one line. Looked up in sys.modules only when
# an exception arrives: an error class whose module was never imported cannot have been raised.
_KNOWN_ERRORS: list[str] = [
    "tunedb.store.errors:StoreError",
    "tunedb.graph.ir:GraphError",
    "tunedb.plan.record:PlanError",
    "tunedb.costmodel.errors:CostModelError",
    "tunedb.costmodel.errors:TrainError",
    "tunedb.runtime.device:NoGPUError",
    "tunedb.runtime:NoGPUError",
    "tunedb.runtime:ReplayError",
    "tunedb.runtime:WorkerError",
    "tunedb.runtime.executor:ExecutorError",
    "tunedb.bench.fusion:BenchError",
    "tunedb.report.data:ReportError",
    "tunedb.collect:CollectError",
]

F = TypeVar("F", bound=Callable[..., Any])


def cost_model_arg(value: Path | None) -> Path | bool | None:
    """``--model`` as ``tunedb.compile``'s ``cost_model``: ``none`` is ``False`` (no model)."""
    return False if value is not None and str(value) == "none" else value


def default_db_path() -> Path:
    """$XDG_DATA_HOME/tunedb/tunedb.duckdb, else ~/.local/share/tunedb/tunedb.duckdb."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tunedb" / "tunedb.duckdb"


def db_path(db: Path | None) -> Path:
    """The database file a command uses: ``--db``, else $TUNEDB_DB, else the user data path."""
    path = db if db is not None else Path(os.environ.get(DB_ENV) or default_db_path())
    return path.expanduser()


def resolve_db(db: Path | None) -> Path:
    """``db_path(db)`` with its folder created, for commands that write (a first ``tunedb collect``
    just works). Reading commands use ``existing_db``, which creates nothing."""
    path = db_path(db)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create directory {path.parent}: {e.strerror or e}")
    return path


def existing_db(db: Path | None) -> Path:
    """The database a reading command uses; a missing one is a one-line error with a hint."""
    path = db_path(db)
    if not path.exists():
        fail(f"database {path} does not exist (give --db or set ${DB_ENV}; "
             "`tunedb collect` or `tunedb db import` creates one)")
    return path


def busy_timeout_s() -> float:
    """Seconds a command waits for a database another process holds: $TUNEDB_BUSY_TIMEOUT, else 30."""
    try:
        return max(0.0, float(os.environ.get(BUSY_ENV) or 30.0))
    except ValueError:
        usage_error(f"${BUSY_ENV} must be a number of seconds, got {os.environ[BUSY_ENV]!r}")


def open_store(db: Path | None, read_only: bool = False) -> TuningStore:
    """Open the command's database. While another process holds it (a collector committing),
    wait up to the busy timeout with a message on stderr instead of failing at once."""
    from tunedb.store import TuningStore

    path = existing_db(db) if read_only else resolve_db(db)
    return TuningStore.open(path, read_only=read_only, wait_s=busy_timeout_s(), on_wait=_say_waiting)


def open_shared_writer(db: Path | None) -> Any:
    """The store of a long writer (collect): the file is held only while it commits."""
    from tunedb.store import SharedWriter

    # Silent waits: a reader holds the file for a moment; a message would break the progress bar.
    return SharedWriter(resolve_db(db), wait_s=busy_timeout_s())


def _say_waiting(message: str) -> None:
    typer.echo(f"waiting: {message}", err=True)


def fail(message: str, code: int = 1) -> NoReturn:
    # Plain echo, not rich: rich would wrap long lines and interpret [brackets] in messages.
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(code)


def usage_error(message: str) -> NoReturn:
    """A bad option value: one line and exit status 2, as click's own usage errors."""
    fail(message, code=2)


def _is_known(exc: BaseException) -> bool:
    for spec in _KNOWN_ERRORS:
        mod, _, name = spec.partition(":")
        cls = getattr(sys.modules.get(mod), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def _interrupted(exc: BaseException | None) -> bool:
    """Ctrl-C, seen as another error: DuckDB raises its own "Query interrupted" (an
    InterruptException, or a RuntimeError in some versions) instead of KeyboardInterrupt, and
    clean-up that fails while Ctrl-C unwinds raises an error whose context is the interrupt."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt) or type(exc).__name__ == "InterruptException" or (
                isinstance(exc, RuntimeError) and "Query interrupted" in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextmanager
def cli_errors() -> Iterator[None]:
    interrupted = "interrupted; every committed measurement is kept (run the command again to resume)"
    try:
        yield
    except KeyboardInterrupt:
        fail(interrupted, 130)
    except BrokenPipeError:
        raise typer.Exit(141) from None
    except Exception as e:
        if _interrupted(e):
            fail(interrupted, 130)
        if not _is_known(e):
            raise
        fail(str(e))


def handle_errors(func: F) -> F:
    """Decorator for a command: known errors become a one-line message and exit status 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cli_errors():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj))


def parse_bindings(items: list[str] | None) -> dict[str, int]:
    """``--bind NAME=INT`` options as a dict (sizes of symbolic ONNX dimensions)."""
    out: dict[str, int] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = int(value)
        except ValueError:
            usage_error(f"--bind expects NAME=INT (e.g. --bind batch=1), got {item!r}")
        if out[name] < 1:
            usage_error(f"--bind {name} must be a positive size, got {out[name]}")
    return out


def writable_file(path: Path, what: str = "--out") -> Path:
    """Check before long work that ``path`` can be written (its folder exists and is writable, it
    is not a folder); one-line usage error otherwise."""
    path = path.expanduser()
    if path.is_dir():
        usage_error(f"{what} {path} is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        usage_error(f"{what} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        usage_error(f"{what} {path} is not writable")
    return path


def writable_dir(path: Path, what: str = "--out") -> Path:
    """Check before long work that the folder ``path`` exists or can be made, and is writable."""
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        usage_error(f"{what} {path} is a file; give a folder")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        usage_error(f"{what} {path} is not writable (at {probe})")
    return path
