"""Support for CLI tests (not a test module): small typer apps holding one command module."""

from __future__ import annotations

import typer


def collect_app() -> typer.Typer:
    """A typer app with only ``tunedb collect`` registered, as ``tunedb.cli`` would."""
    from tunedb.cli.collect import register

    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """tunedb"""

    register(app)
    return app
