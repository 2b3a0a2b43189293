"""``tunedb plan``: compile a model into a Plan and show every decision (or print its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunedb.cli.common import (
    CostModelOption,
    DbOption,
    JsonOption,
    cost_model_arg,
    default_db_path,
    fail,
    handle_errors,
    parse_bindings,
    print_json,
    resolve_db,
    usage_error,
)

MERGE_CHOICES: dict[str, bool | str] = {"off": False, "on": True, "exact": "exact", "auto": "auto"}


def check_measure_device(value: str) -> str:
    """``--measure-device``: cuda, emu or replay:PATH (an existing export folder or database)."""
    if value in ("cuda", "emu"):
        return value
    kind, sep, path = value.partition(":")
    if kind != "replay" or not sep or not path:
        usage_error(f"--measure-device must be cuda, emu or replay:PATH, got {value!r}")
    if not Path(path).expanduser().exists():
        usage_error(f"--measure-device {value}: {path} does not exist")
    return value


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
                                     "(and pack candidates of each packable set, plus serial) "
                                     "on --measure-device and store the results in the "
                                     "database (created if missing).")] = 0,
    measure_device: Annotated[str, typer.Option(
        "--measure-device", help="cuda (this GPU), emu (verify in the CPU emulator, no timing), "
                                 "or replay:PATH to look the schedules up in stored "
                                 "measurements.")] = "cuda",
    bind: Annotated[list[str] | None, typer.Option(
        "--bind", help="Size of a symbolic input dim, NAME=INT (repeatable).")] = None,
    schedule: Annotated[str, typer.Option(
        "--schedule", help="sequential (one stream), ios (stages of concurrent groups, one "
                           "stream each) or auto (stages where they are predicted to pay).")
    ] = "sequential",
    merge: Annotated[str | None, typer.Option(
        "--merge", help="off, on (sibling convolutions of one input with constant weights run as "
                        "one convolution: IOS's merge), exact (only those of one kernel size) or "
                        "auto (where the plans predict it pays); default: auto with --schedule "
                        "auto, else off.")
    ] = None,
    json_out: JsonOption = False,
) -> None:
    """Plan a model: fusion groups, schedules, stitch schemes, predicted times and buffers.

    Exact database hits come first, then the cost model, then the roofline. Without --db the
    default database is used when it exists. Needs no GPU unless --measure-top is given;
    the measurements are then recorded in the database (--db, else the default one, created
    if missing), so that a later plan gets exact hits for those kernels. The JSON refers to
    the model file and its bindings; it carries no weights.

    Example: tunedb plan data/graphs/bert_layer.onnx --db h200.duckdb --model models/
    """
    bindings = parse_bindings(bind)
    if schedule not in ("sequential", "ios", "auto"):
        usage_error(f"--schedule must be sequential, ios or auto, got {schedule!r}")
    if merge is not None and merge not in MERGE_CHOICES:
        usage_error(f"--merge must be off, on, exact or auto, got {merge!r}")
    check_measure_device(measure_device)
    if not model.is_file():
        fail(f"no such model file: {model}")
    from tunedb.plan.driver import compile as compile_plan

    if db is None and measure_top > 0:
        db = resolve_db(None)  # measurements are kept, in the default database like collect's
    elif db is None and default_db_path().is_file():
        db = default_db_path()
    result = compile_plan(str(model), db=db, cost_model=cost_model_arg(cost_model), device=device,
                          measure_top=measure_top, beam=beam, bindings=bindings,
                          measure_device=measure_device, schedule=schedule,
                          merge=None if merge is None else MERGE_CHOICES[merge])
    if measure_top > 0:
        counts = dict(result.search)
        typer.echo(f"measured {counts.get('measured', 0)} schedule(s); stored "
                   f"{counts.get('stored', 0)} measurement(s) in {db}", err=True)
    if json_out:
        typer.echo(result.dumps())
    else:
        typer.echo(result.explain(), nl=False)


def plan_check(
    plan_file: Annotated[Path, typer.Argument(help="A plan's JSON (tunedb plan --json).")],
    json_out: JsonOption = False,
) -> None:
    """Check a saved plan: every field well formed, every node of its graph computed once in
    dependency order, each step's sub-graph the cut of its nodes out of the graph, and the
    model file it refers to for its weights present and unchanged.

    Example: tunedb plan-check bert.plan.json
    """
    from tunedb.plan.record import Plan

    try:
        text = plan_file.read_text()
    except OSError as e:
        fail(f"cannot read {plan_file}: {e.strerror or e}")
    except UnicodeDecodeError:
        fail(f"{plan_file} is not a plan JSON (not text)")
    p = Plan.from_json(text)  # checks; PlanError is one line
    totals = p.totals()
    if json_out:
        print_json({"ok": True, **totals})
        return
    typer.echo(f"ok: {totals['steps']} steps, {totals['kernels']} kernel launches, "
               f"{totals['graph_ops']} graph ops, predicted {totals['predicted_us']} us")


def register(app: typer.Typer) -> None:
    app.command("plan")(handle_errors(plan))
    app.command("plan-check")(handle_errors(plan_check))
