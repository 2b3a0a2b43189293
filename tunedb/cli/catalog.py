"""``tunedb suites``, ``collectors``, ``models``, ``onnx-ops``: what a command can be given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tunedb.cli.common import JsonOption, handle_errors, print_json


def _print_rows(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def suites(json_out: JsonOption = False) -> None:
    """List the workload suites (`collect --suite`, `bench fusion --suite`) and their sizes.

    Example: tunedb suites
    """
    from tunedb.kernels import suites as suite_lib

    rows = []
    for name in suite_lib.SUITES:
        try:
            cases = suite_lib.suite(name)
        except ValueError as e:  # generalization reads data/ files a wheel does not ship
            rows.append({"name": name, "workloads": 0, "families": [f"unavailable: {e}"]})
            continue
        families = sorted({c.family for c in cases})
        rows.append({"name": name, "workloads": len(cases), "families": families})
    if json_out:
        print_json(rows)
        return
    _print_rows("workload suites", ["suite", "workloads", "families"],
                [[r["name"], str(r["workloads"]), ", ".join(r["families"])] for r in rows])


def collectors(json_out: JsonOption = False) -> None:
    """List the registered collectors (`collect --collector`): entry points of the group
    tunedb.collectors, and the built-in ones.

    Example: tunedb collectors
    """
    from importlib.metadata import entry_points

    from tunedb.collect import BUILTIN_COLLECTORS

    found = {ep.name: ep.value for ep in entry_points(group="tunedb.collectors")}
    for name, target in BUILTIN_COLLECTORS.items():
        found.setdefault(name, target)
    rows = [{"name": n, "target": t} for n, t in sorted(found.items())]
    if json_out:
        print_json(rows)
        return
    _print_rows("collectors", ["collector", "class"], [[r["name"], r["target"]] for r in rows])


def models(
    root: Annotated[list[Path] | None, typer.Argument(
        help="Model registry roots to list; default: the one plans read ($TUNEDB_MODELS, else the "
             "shipped models) and the one `tunedb train` writes to.", show_default=False)] = None,
    json_out: JsonOption = False,
) -> None:
    """List the cost models of model registries: device, kind, creation time and held-out
    pairwise accuracy from each card.json.

    Example: tunedb models
    """
    from tunedb.cli.train import default_out
    from tunedb.costmodel.registry import CARD_FILE, default_models_root

    roots = list(root or [])
    if not roots:
        roots = [r for r in (default_models_root(), default_out()) if r is not None]
    rows = []
    seen: set[Path] = set()
    for base in roots:
        for card_path in sorted(Path(base).expanduser().glob(f"*/*/{CARD_FILE}")):
            where = card_path.parent.resolve()
            if where in seen:
                continue
            seen.add(where)
            try:
                card = json.loads(card_path.read_text())
                metrics = card.get("metrics") or {}
                rows.append({"path": str(where), "device": str(card.get("device_name", "?")),
                             "kind": str(card.get("kind", "?")),
                             "created_at": str(card.get("created_at", "")),
                             "pairwise_accuracy": metrics.get("pairwise_accuracy")})
            except (OSError, ValueError, AttributeError):
                rows.append({"path": str(where), "device": "?", "kind": "?", "created_at": "",
                             "pairwise_accuracy": None, "error": "unreadable card.json"})
    if json_out:
        print_json(rows)
        return
    if not rows:
        typer.echo(f"no models under {', '.join(str(r) for r in roots) or 'any registry'}")
        return
    _print_rows("cost models", ["device", "kind", "created", "held-out pairwise acc", "path"],
                [[r["device"], r["kind"], r["created_at"][:19],
                  "-" if r["pairwise_accuracy"] is None else f"{r['pairwise_accuracy']:.4f}", r["path"]]
                 for r in rows])


def onnx_ops(json_out: JsonOption = False) -> None:
    """List the ONNX ops (default domain, opsets 11-23) that `tunedb plan` imports.

    Example: tunedb onnx-ops
    """
    from tunedb.graph.onnx_import import supported_ops

    ops = list(supported_ops())
    if json_out:
        print_json(ops)
        return
    typer.echo(f"{len(ops)} ONNX ops: {', '.join(ops)}")


def register(app: typer.Typer) -> None:
    app.command("suites")(handle_errors(suites))
    app.command("collectors")(handle_errors(collectors))
    app.command("models")(handle_errors(models))
    app.command("onnx-ops")(handle_errors(onnx_ops))
