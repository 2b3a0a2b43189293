"""Pieces every tunedb command module shares: the database option, error handling, output.

A command module (``tunedb/cli_<name>.py``) exposes ``register(app)`` and writes its commands as:

    @app.command("train")
    @handle_errors
    def train(db: DbOption = None, json_out: JsonOption = False) -> None:
        with open_store(db, read_only=True) as store:
            ...

Known errors (StoreError, GraphError and any type passed to ``register_error``) become
``error: <message>`` on stderr with exit status 1, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from tunedb.graph.ir import GraphError
from tunedb.store import StoreError, TuningStore

DB_ENV = "TUNEDB_DB"

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
        "only. Default: the model registered for the device's GPU under $TUNEDB_MODELS, else under "
        "models/ of the tunedb source tree, when there is one.",
    ),
]


def cost_model_arg(value: Path | None) -> Path | bool | None:
    """``--model`` as ``tunedb.compile``'s ``cost_model``: ``none`` is ``False`` (no model)."""
    return False if value is not None and str(value) == "none" else value

_KNOWN_ERRORS: list[type[BaseException]] = [StoreError, GraphError]

F = TypeVar("F", bound=Callable[..., Any])


def default_db_path() -> Path:
    """$XDG_DATA_HOME/tunedb/tunedb.duckdb, else ~/.local/share/tunedb/tunedb.duckdb."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tunedb" / "tunedb.duckdb"


def resolve_db(db: Path | None) -> Path:
    """The database file a command uses: ``--db``, else $TUNEDB_DB, else the user data path.

    Creates the parent directory, so that a first ``tunedb collect`` just works."""
    path = db if db is not None else Path(os.environ.get(DB_ENV) or default_db_path())
    path = path.expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create directory {path.parent}: {e.strerror or e}")
    return path


def open_store(db: Path | None, read_only: bool = False) -> TuningStore:
    return TuningStore.open(resolve_db(db), read_only=read_only)


def register_error(cls: type[BaseException]) -> None:
    """Make ``cls`` a known error: shown as ``error: <message>``, exit 1."""
    if cls not in _KNOWN_ERRORS:
        _KNOWN_ERRORS.append(cls)


def fail(message: str) -> NoReturn:
    # Plain echo, not rich: rich would wrap long lines and interpret [brackets] in messages.
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(1)


@contextmanager
def cli_errors() -> Iterator[None]:
    try:
        yield
    except tuple(_KNOWN_ERRORS) as e:
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
            fail(f"--bind expects NAME=INT (e.g. batch=1), got {item!r}")
    return out
