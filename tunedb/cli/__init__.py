"""The ``tunedb`` command line: typer app ``app``, one module per command group.

Each module under ``tunedb/cli/`` exposes ``register(app)``; its commands parse options, call one
library function and print the result (rich tables, or JSON with ``--json``). Modules import only
typer and ``tunedb.cli.common`` at the top, everything else inside the command that needs it, so
that ``tunedb --help`` and ``tunedb --version`` do not load XGBoost, DuckDB or NumPy.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Annotated

import typer

from tunedb import __version__

app = typer.Typer(
    name="tunedb",
    help="Autotuning database and XGBoost cost-model trainer for GPU kernel fusion and scheduling.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command groups, in --help order.
_COMMAND_MODULES = [
    "tunedb.cli.db",
    "tunedb.cli.collect",
    "tunedb.cli.train",
    "tunedb.cli.plan",
    "tunedb.cli.bench",
    "tunedb.cli.report",
    "tunedb.cli.catalog",
]


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


def main(args: list[str] | None = None) -> None:
    """The ``tunedb`` script. Usage errors (a bad option value, a missing argument, an unknown
    command) are one line on stderr with exit status 2, like every other tunedb error."""
    import sys

    try:
        rv = app(args=args, prog_name="tunedb", standalone_mode=False)
    except typer.Abort:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except typer.TyperException as e:
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            typer.echo(ctx.get_help())  # `tunedb db` alone: the group's help, as click shows it
            sys.exit(2)
        message = " ".join(e.format_message().split())  # type: ignore[attr-defined]
        where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        typer.echo(f"error: {message}{where}", err=True)
        sys.exit(getattr(e, "exit_code", 2))
    sys.exit(rv if isinstance(rv, int) else 0)


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


for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)
_reflow_commands(app)
