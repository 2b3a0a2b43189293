"""``tunedb plan``: compile a model into a Plan and show every decision (or print its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunedb.cli_common import (
    CostModelOption,
    DbOption,
    JsonOption,
    cost_model_arg,
    default_db_path,
    fail,
    handle_errors,
    parse_bindings,
    resolve_db,
)


def register(app: typer.Typer) -> None:
    # Nothing heavy is imported here: every tunedb command pays for what registration imports.
    @app.command("plan")
    @handle_errors
    def plan(
        model: Annotated[Path, typer.Argument(help="ONNX model, or a tunedb graph JSON file.")],
        db: DbOption = None,
        cost_model: CostModelOption = None,
        device: Annotated[str, typer.Option(
            "--device", help="cuda (this GPU, else the database's only device), a device id or "
                             "name from the database, or generic (H200 facts, no DB hits).")] = "cuda",
        beam: Annotated[int, typer.Option("--beam", min=1,
                                          help="States kept per node by the fusion search.")] = 4,
        measure_top: Annotated[int, typer.Option(
            "--measure-top", min=0, help="Measure the N best-ranked schedules of each fused kernel "
                                         "on --measure-device and store the results in the "
                                         "database (created if missing).")] = 0,
        measure_device: Annotated[str, typer.Option(
            "--measure-device", help="cuda (this GPU), or replay:PATH to look the schedules up in "
                                     "stored measurements.")] = "cuda",
        bind: Annotated[list[str] | None, typer.Option(
            "--bind", help="Size of a symbolic input dim, NAME=INT (repeatable).")] = None,
        json_out: JsonOption = False,
    ) -> None:
        """Plan a model: fusion groups, schedules, stitch schemes, predicted times and buffers.

        Exact database hits come first, then the cost model, then the roofline. Without --db the
        default database is used when it exists. Needs no GPU unless --measure-top is given;
        the measurements are then recorded in the database (--db, else the default one, created
        if missing), so that a later plan gets exact hits for those kernels.

        Example: tunedb plan data/graphs/bert_layer.onnx --db h200.duckdb --model models/
        """
        from tunedb.costmodel.model import CostModelError
        from tunedb.plan.driver import compile as compile_plan
        from tunedb.plan.record import PlanError
        from tunedb.runtime import NoGPUError, ReplayError

        if not model.exists():
            fail(f"no such model file: {model}")
        if db is None and measure_top > 0:
            db = resolve_db(None)  # measurements are kept, in the default database like collect's
        elif db is None and default_db_path().is_file():
            db = default_db_path()
        try:
            result = compile_plan(str(model), db=db, cost_model=cost_model_arg(cost_model), device=device,
                                  measure_top=measure_top, beam=beam, bindings=parse_bindings(bind),
                                  measure_device=measure_device)
        except (PlanError, CostModelError, NoGPUError, ReplayError) as e:
            fail(str(e))
        if measure_top > 0:
            counts = dict(result.search)
            typer.echo(f"measured {counts.get('measured', 0)} schedule(s); stored "
                       f"{counts.get('stored', 0)} measurement(s) in {db}", err=True)
        if json_out:
            typer.echo(result.dumps())
        else:
            typer.echo(result.explain(), nl=False)
