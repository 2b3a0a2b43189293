"""``tunedb bench``: benchmarks on a GPU. ``bench fusion`` puts tunedb's fused kernels next to
torch eager, torch.compile and JAX/XLA on the anchor cases; ``bench plan`` compiles whole graphs
into plans and times them next to the same peers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from tunedb.cli.bench_packing import packing
from tunedb.cli.collect import SUITE_NAMES
from tunedb.cli.common import (
    DB_ENV,
    CostModelOption,
    JsonOption,
    cost_model_arg,
    default_db_path,
    fail,
    handle_errors,
    parse_bindings,
    print_json,
    usage_error,
    writable_file,
)

# In the working folder, never the shipped data/bench files (a run that stops early would
# overwrite a published result).
FUSION_OUT = Path("bench-fusion.json")
PLAN_OUT = Path("bench-plan.json")
PEER_NAMES = ("torch_eager", "torch_compile", "torch_compile_ro", "jax")


def _database(db: Path | None) -> Path | None:
    """The database to take measured candidates from: --db / $TUNEDB_DB (must exist), else the
    default path if it exists, else none."""
    if db is not None:
        db = db.expanduser()
        if not db.is_file():
            fail(f"database {db} does not exist")
        return db
    path = default_db_path()
    return path if path.is_file() else None


def _peers(text: str) -> list[str]:
    if text.strip().lower() in ("", "none"):
        return []
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PEER_NAMES]
    if bad:
        usage_error(f"unknown peer(s) {', '.join(bad)}; expected some of {', '.join(PEER_NAMES)} "
                    "(comma separated) or none")
    return names


def fusion(
    db: Annotated[Path | None, typer.Option(
        "--db", envvar=DB_ENV, show_default=False,
        help="Tuning database with measured candidates (top-K per workload on this device); "
             "default $TUNEDB_DB, else the default database if it exists, else search.")] = None,
    suite: Annotated[str, typer.Option("--suite", help="anchors (the 12 ANCHORS.md cases) or a "
                                       f"workload suite: {', '.join(SUITE_NAMES)}.")] = "anchors",
    top: Annotated[int, typer.Option("--top", min=1, help="Candidates per case timed in "
                                     "throughput mode.")] = 3,
    out: Annotated[Path, typer.Option("--out", help="JSON result, rewritten after every "
                                      "case.")] = FUSION_OUT,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.0, help="Seconds after which "
                                              "no new case starts (0: no limit).")] = 480.0,
    search_time: Annotated[float, typer.Option("--search-time", min=0.0, help="Seconds of schedule "
                                               "search per case (once one candidate verified); the "
                                               "rest of the space is skipped and counted.")] = 60.0,
    max_search: Annotated[int, typer.Option("--max-search", min=0, help="Schedules tried per case "
                                            "without database hits (0: all legal).")] = 0,
    workers: Annotated[int | None, typer.Option("--workers", min=0, show_default=False,
                                                help="Compile processes; default: CPU cores - 4.")] = None,
    case: Annotated[list[str] | None, typer.Option("--case", help="Only these cases of the suite "
                                                   "(by name; repeatable).")] = None,
    json_out: JsonOption = False,
) -> None:
    """tunedb's fused kernels next to torch eager, torch.compile and JAX on the same inputs.

    Needs a GPU with CuPy (torch and JAX optional: a missing peer is recorded with its error).
    Prints a line per finished case on stderr, then a table (or the JSON with --json).

    Example: tunedb bench fusion --db h200.duckdb --top 3 --out fusion_h200.json
    """
    if suite not in SUITE_NAMES:
        usage_error(f"unknown suite {suite!r}; choose one of {', '.join(SUITE_NAMES)}")
    out = writable_file(out)
    from tunedb.bench.fusion import run_bench
    from tunedb.bench.tables import fusion_progress_line, fusion_summary_line, fusion_table, load_cases
    from tunedb.runtime.device import import_cupy

    import_cupy()  # no GPU: one-line error before anything else happens
    path = _database(db)
    cases = load_cases(suite)
    if case:
        unknown = sorted(set(case) - {c.name for c in cases})
        if unknown:
            usage_error(f"suite {suite!r} has no case named {', '.join(unknown)}")
        cases = [c for c in cases if c.name in set(case)]
    if not cases:
        fail(f"suite {suite!r} has no cases")
    typer.echo(f"{len(cases)} case(s); candidates from "
               f"{path if path else 'the schedule space (no database)'}", err=True)
    result = run_bench(cases, out, db=path, top=top, time_limit_s=time_limit, search_s=search_time,
                       max_search=max_search, workers=workers, suite=suite,
                       progress=lambda line: typer.echo(line, err=True),
                       on_case=lambda i, n, rec: typer.echo(fusion_progress_line(i, n, rec), err=True))
    if json_out:
        print_json(result)
        return
    from rich.console import Console

    Console().print(fusion_table(result))
    typer.echo(fusion_summary_line(result))
    typer.echo(f"wrote {os.fspath(out)}")


def plan(
    models: Annotated[list[Path] | None, typer.Argument(
        help="ONNX models or tunedb graph JSON files ('anchors': the 12 fusion anchor subgraphs).",
        show_default=False)] = None,
    graphs: Annotated[Path | None, typer.Option(
        "--graphs", help="Also every .onnx / .json graph in this folder (e.g. data/graphs), plus "
                         "the 12 fusion anchor subgraphs.")] = None,
    anchors: Annotated[bool, typer.Option("--anchors/--no-anchors",
                                          help="With --graphs: add the anchor subgraphs.")] = True,
    db: Annotated[Path | None, typer.Option(
        "--db", envvar=DB_ENV, show_default=False,
        help="Tuning database for exact hits; default $TUNEDB_DB, else the default database "
             "if it exists, else none.")] = None,
    cost_model: CostModelOption = None,
    batch: Annotated[list[int] | None, typer.Option(
        "--batch", min=1, help="Run ONNX models at this batch (repeatable; needs a symbolic "
                               "batch dim).")] = None,
    bind: Annotated[list[str] | None, typer.Option(
        "--bind", help="Size of a symbolic input dim, NAME=INT (repeatable).")] = None,
    peers: Annotated[str, typer.Option(
        "--peers", help="Comma-separated peers: torch_eager, torch_compile, torch_compile_ro, "
                        "jax; or none.")] = "torch_eager,torch_compile,torch_compile_ro,jax",
    out: Annotated[Path, typer.Option(
        "--out", help="JSON result, rewritten after every graph.")] = PLAN_OUT,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", min=0.0, help="Seconds after which no new graph starts (0: no limit).")] = 0.0,
    json_out: JsonOption = False,
) -> None:
    """Compile whole graphs into plans, verify them, and time them next to their peers.

    Each plan runs as one CUDA graph of its kernels (fused kernels, cuBLAS GEMMs, im2col
    convolutions) and is checked against the float64 reference and, for ONNX models,
    onnxruntime. Peers run the same graph translated to torch / JAX on the same inputs.
    Under the table: the geomean speedup over JAX and torch.compile across the memory-bound
    subgraphs, and each whole model's kernel count against op by op. Needs a GPU with CuPy
    (a missing torch or JAX is recorded with its error).

    Example: tunedb bench plan --graphs data/graphs --db h200.duckdb --model models/
    """
    names = _peers(peers)
    bindings = parse_bindings(bind)
    out = writable_file(out)
    if db is not None and not db.expanduser().is_file():
        fail(f"database {db} does not exist")
    from tunedb.bench.plan import collect_entries, run_bench
    from tunedb.runtime.device import import_cupy

    entries = collect_entries(models or [], graphs, anchors, batch or [], bindings)
    db = _database(db)
    import_cupy()  # no GPU: one-line error before the heavy imports
    typer.echo(f"{len(entries)} graph(s); database: {db or 'none'}; "
               f"cost model: {cost_model or 'default'}", err=True)
    from tunedb.bench.tables import plan_entry_line, plan_summary_line, plan_table

    result = run_bench(entries, out, db=db, cost_model=cost_model_arg(cost_model), peers=names,
                       time_limit_s=time_limit,
                       progress=lambda line: typer.echo(line, err=True),
                       on_entry=lambda i, n, rec: typer.echo(plan_entry_line(i, n, rec), err=True))
    if json_out:
        print_json(result)
        return
    import sys

    from rich.console import Console

    from tunedb.bench.plan import summary_lines

    # A wide table: when piped (a log file), rich would squeeze it into 80 columns.
    Console(width=None if sys.stdout.isatty() else 240).print(plan_table(result))
    typer.echo(plan_summary_line(result))
    for line in summary_lines(result):  # memory-bound geomeans, per-model kernel reduction
        typer.echo(line)
    typer.echo(f"wrote {os.fspath(out)}")


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(help="Benchmarks on a GPU: tunedb next to its peers.", no_args_is_help=True)
    app.add_typer(bench_app, name="bench")
    bench_app.command("fusion")(handle_errors(fusion))
    bench_app.command("plan")(handle_errors(plan))
    bench_app.command("packing")(handle_errors(packing))
