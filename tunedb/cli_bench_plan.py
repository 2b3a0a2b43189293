"""``tunedb bench plan``: compiled plans of whole graphs next to torch eager, torch.compile (default
and reduce-overhead) and jax.jit. Joins the ``bench`` group of ``tunedb.cli_bench``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from tunedb.cli_common import (
    DB_ENV,
    CostModelOption,
    cost_model_arg,
    default_db_path,
    fail,
    handle_errors,
    parse_bindings,
    print_json,
    register_error,
)

DEFAULT_OUT = Path("data/bench/plan_h200.json")


def _bench_group(app: typer.Typer) -> typer.Typer:
    """The ``bench`` sub-app registered by ``cli_bench`` (created here when it is missing)."""
    for info in getattr(app, "registered_groups", []):
        if info.name == "bench" and info.typer_instance is not None:
            return info.typer_instance
    bench_app = typer.Typer(help="Benchmarks on a GPU: tunedb next to its peers.", no_args_is_help=True)
    app.add_typer(bench_app, name="bench")
    return bench_app


def _peers(text: str) -> list[str]:
    from tunedb.bench.plan import PEERS

    if text.strip().lower() in ("", "none"):
        return []
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PEERS]
    if bad:
        fail(f"unknown peer(s) {', '.join(bad)}; expected some of {', '.join(PEERS)} "
             "(comma separated) or none")
    return names


def render_table(result: dict) -> Any:
    from rich.table import Table

    from tunedb.bench.plan import PEER_LABELS, fmt

    peers = result.get("peers", [])
    table = Table(title=f"plans on {result.get('device', {}).get('name', '?')}, µs (throughput mode)")
    for col in ["graph", "ops", "kernels", "launches", "graph?", "ref err", "ort err", "tunedb"] + \
            [PEER_LABELS[p] for p in peers] + [f"× {PEER_LABELS[p]}" for p in peers]:
        table.add_column(col, justify="left" if col == "graph" else "right")
    for e in result.get("entries", []):
        plan, ver = e.get("plan") or {}, e.get("verify") or {}
        ref, ort = ver.get("reference") or {}, ver.get("onnxruntime") or {}
        t = (e.get("tunedb") or {}).get("us")
        tdb = fmt(t) if t else f"error: {(e.get('tunedb') or {}).get('error') or e.get('error') or '?'}"[:40]
        mark = "" if ref.get("ok") in (True, None) else " ✗"
        table.add_row(
            str(e.get("name")), str((e.get("graph") or {}).get("op_by_op", "—")),
            str(plan.get("kernels", "—")),
            str(plan.get("launches", "—")), "yes" if plan.get("graph_capture") else "no",
            fmt(ref.get("rel_err"), 7) + mark if ref else "—",
            fmt(ort.get("rel_err"), 7) if ort.get("rel_err") is not None else "—", tdb,
            *[fmt((e.get("peers", {}).get(p) or {}).get("us")) for p in peers],
            *[fmt((e.get("speedup") or {}).get(p), 2) for p in peers])
    return table


def summary_line(result: dict) -> str:
    from tunedb.bench.plan import PEER_LABELS, fmt

    s = result.get("summary", {})
    parts = [f"{s.get('graphs', 0)} graph(s), {s.get('verified', 0)} verified, {s.get('timed', 0)} timed"]
    for p in result.get("peers", []):
        parts.append(f"{fmt(s.get(f'speedup_vs_{p}'), 2)}x {PEER_LABELS[p]} "
                     f"(min {fmt(s.get(f'min_speedup_vs_{p}'), 2)}x)")
    if s.get("failed"):
        parts.append("failed: " + ", ".join(map(str, s["failed"])))
    if result.get("stopped"):
        parts.append(f"stopped: {result['stopped']}")
    return "; ".join(parts)


def entry_line(i: int, n: int, rec: dict) -> str:
    from tunedb.bench.plan import fmt

    t = (rec.get("tunedb") or {}).get("us")
    ref = ((rec.get("verify") or {}).get("reference") or {})
    head = f"[{i}/{n}] {rec.get('name')}: "
    if not t:
        return head + f"failed ({(rec.get('tunedb') or {}).get('error') or rec.get('error')})"
    peers = ", ".join(f"{p} {fmt((v or {}).get('us'))}" for p, v in rec.get("peers", {}).items())
    return (head + f"tunedb {fmt(t)} µs ({'verified' if ref.get('ok') else 'NOT verified'}), {peers} "
            f"[{rec.get('elapsed_s', 0):.0f}s]")


def register(app: typer.Typer) -> None:
    from tunedb.bench.fusion import BenchError
    from tunedb.runtime import NoGPUError
    from tunedb.runtime.executor import ExecutorError

    for cls in (NoGPUError, BenchError, ExecutorError):
        register_error(cls)
    bench_app = _bench_group(app)

    @bench_app.command("plan")
    @handle_errors
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
            "--out", help="JSON result, rewritten after every graph.")] = DEFAULT_OUT,
        time_limit: Annotated[float, typer.Option(
            "--time-limit", min=0.0, help="Seconds after which no new graph starts (0: no limit).")] = 0.0,
        json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
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
        from tunedb.bench.plan import collect_entries, run_bench
        from tunedb.runtime.device import import_cupy

        entries = collect_entries(models or [], graphs, anchors, batch or [], parse_bindings(bind))
        names = _peers(peers)
        if db is not None and not db.expanduser().is_file():
            fail(f"database {db} does not exist")
        if db is not None:
            db = db.expanduser()
        elif default_db_path().is_file():
            db = default_db_path()
        import_cupy()  # no GPU: one-line error before the heavy imports
        typer.echo(f"{len(entries)} graph(s); database: {db or 'none'}; "
                   f"cost model: {cost_model or 'default'}", err=True)
        result = run_bench(entries, out, db=db, cost_model=cost_model_arg(cost_model), peers=names,
                           time_limit_s=time_limit,
                           progress=lambda line: typer.echo(line, err=True),
                           on_entry=lambda i, n, rec: typer.echo(entry_line(i, n, rec), err=True))
        if json_out:
            print_json(result)
            return
        import sys

        from rich.console import Console

        # A wide table: when piped (a log file), rich would squeeze it into 80 columns.
        from tunedb.bench.plan import summary_lines

        Console(width=None if sys.stdout.isatty() else 240).print(render_table(result))
        typer.echo(summary_line(result))
        for line in summary_lines(result):  # memory-bound geomeans, per-model kernel reduction
            typer.echo(line)
        typer.echo(f"wrote {os.fspath(out)}")
