"""``tunedb bench``: benchmarks on a GPU. ``bench fusion`` puts tunedb's fused kernels next to
torch eager, torch.compile and JAX/XLA on the anchor cases (a ``bench plan`` can join later)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from tunedb.bench.fusion import BenchError
from tunedb.cli_common import (
    DB_ENV,
    JsonOption,
    default_db_path,
    fail,
    handle_errors,
    print_json,
    register_error,
)

DEFAULT_OUT = Path("data/bench/fusion_h200.json")


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def progress_line(i: int, n: int, case: dict) -> str:
    """One line per finished case (printed as the run goes)."""
    from tunedb.bench.fusion import PEERS, time_of

    parts = [f"[{i}/{n}] {case.get('case')}: floor {_fmt(case.get('floor_us'))}"]
    t = time_of(case, "tunedb")
    tdb = case.get("tunedb") or {}
    parts.append(f"tunedb {_fmt(t)} ({tdb.get('schedule')})" if t else f"tunedb failed ({tdb.get('error')})")
    for p in PEERS:
        t = time_of(case, p)
        parts.append(f"{p} {_fmt(t)}" if t else f"{p} failed")
    return ", ".join(parts) + f" µs [{case.get('elapsed_s', 0):.0f}s]"


def render_table(result: dict) -> Any:
    """The benchmark result as a rich Table: one row per case, then the geomean row."""
    from rich.table import Table

    from tunedb.bench.fusion import PEERS, summarize, time_of

    bw = result.get("copy_TBps")
    table = Table(title=f"fusion suite on {result.get('device', {}).get('name', '?')}, µs "
                        f"(floor: fewest bytes at {_fmt(bw, 2)} TB/s copy)")
    for col in ("case", "floor", "tunedb", "schedule", "torch eager", "torch.compile", "JAX",
                "tunedb/floor", "× compile", "× JAX"):
        table.add_column(col, justify="left" if col in ("case", "schedule") else "right")
    for c in result.get("cases", []):
        t, fl = time_of(c, "tunedb"), c.get("floor_us")
        tdb = c.get("tunedb") or {}
        peers = [time_of(c, p) for p in PEERS]
        comp, jx = peers[1], peers[2]
        sched = tdb.get("schedule") or f"error: {tdb.get('error') or '?'}"[:48]
        table.add_row(str(c.get("case", "?")), _fmt(fl), _fmt(t), sched, *[_fmt(p) for p in peers],
                      _fmt(fl / t if fl and t else None, 3), _fmt(comp / t if comp and t else None, 2),
                      _fmt(jx / t if jx and t else None, 2))
    s = summarize(result)
    fr = s["fraction_of_floor"]
    table.add_section()
    table.add_row("geomean fraction of floor", "1.00", _fmt(fr.get("tunedb"), 3), "",
                  *[_fmt(fr.get(p), 3) for p in PEERS], _fmt(fr.get("tunedb"), 3),
                  _fmt(s.get("speedup_vs_torch_compile"), 2), _fmt(s.get("speedup_vs_jax"), 2))
    return table


def summary_line(result: dict) -> str:
    from tunedb.bench.fusion import summarize

    s = summarize(result)
    slower = s["slower_than_torch_compile"]
    parts = [f"{s['cases']} case(s)",
             f"tunedb geomean {_fmt(s['fraction_of_floor'].get('tunedb'), 3)} of floor",
             f"{_fmt(s['speedup_vs_torch_compile'], 2)}x torch.compile "
             f"(min {_fmt(s['min_speedup_vs_torch_compile'], 2)}x)",
             f"{_fmt(s['speedup_vs_jax'], 2)}x JAX",
             "slower than torch.compile: " + (", ".join(slower) if slower else "none")]
    if result.get("stopped"):
        parts.append(f"stopped: {result['stopped']}")
    return "; ".join(parts)


def load_cases(suite: str) -> list[Any]:
    """``anchors`` -> the 12 ANCHORS.md cases; any other name -> that workload suite."""
    try:
        from tunedb.kernels import suites
    except ImportError as e:
        raise BenchError(f"workload suites are not available: {' '.join(str(e).split())}") from None
    if suite == "anchors" and hasattr(suites, "ANCHOR_CASES"):
        return list(suites.ANCHOR_CASES)
    try:
        return list(suites.suite(suite))
    except (KeyError, ValueError) as e:
        raise BenchError(f"unknown suite {suite!r}: {' '.join(str(e).split())}") from None


def _database(db: Path | None) -> Path | None:
    """The database to take measured candidates from: --db / $TUNEDB_DB (must exist), else the
    default path if it exists, else none (every case searches its schedule space)."""
    if db is not None:
        db = db.expanduser()
        if not db.is_file():
            fail(f"database {db} does not exist")
        return db
    path = default_db_path()
    return path if path.is_file() else None


def register(app: typer.Typer) -> None:
    from tunedb.runtime import NoGPUError

    register_error(NoGPUError)
    register_error(BenchError)
    bench_app = typer.Typer(help="Benchmarks on a GPU: tunedb next to its peers.", no_args_is_help=True)
    app.add_typer(bench_app, name="bench")

    @bench_app.command("fusion")
    @handle_errors
    def fusion(
        db: Annotated[Path | None, typer.Option(
            "--db", envvar=DB_ENV, show_default=False,
            help="Tuning database with measured candidates (top-K per workload on this device); "
                 "default $TUNEDB_DB, else the default database if it exists, else search.")] = None,
        suite: Annotated[str, typer.Option("--suite", help="anchors (the 12 ANCHORS.md cases) or a "
                                                           "workload suite name.")] = "anchors",
        top: Annotated[int, typer.Option("--top", min=1, help="Candidates per case timed in "
                                                             "throughput mode.")] = 3,
        out: Annotated[Path, typer.Option("--out", help="JSON result, rewritten after every "
                                                        "case.")] = DEFAULT_OUT,
        time_limit: Annotated[float, typer.Option("--time-limit", min=0.0, help="Seconds after which "
                                                  "no new case starts (0: no limit).")] = 480.0,
        search_time: Annotated[float, typer.Option("--search-time", min=0.0, help="Seconds of schedule "
                                                   "search per case (once one candidate verified); the "
                                                   "rest of the space is skipped and counted.")] = 60.0,
        max_search: Annotated[int, typer.Option("--max-search", min=0, help="Schedules tried per case "
                                                "without database hits (0: all legal).")] = 0,
        workers: Annotated[int | None, typer.Option("--workers", min=0, help="Compile processes "
                                                    "[default: CPU cores - 4].")] = None,
        case: Annotated[list[str] | None, typer.Option("--case", help="Only these cases of the suite "
                                                       "(by name; repeatable).")] = None,
        json_out: JsonOption = False,
    ) -> None:
        """tunedb's fused kernels next to torch eager, torch.compile and JAX on the same inputs.

        Needs a GPU with CuPy (torch and JAX optional: a missing peer is recorded with its error).
        Prints a line per finished case on stderr, then a table (or the JSON with --json).

        Example: tunedb bench fusion --db h200.duckdb --top 3 --out data/bench/fusion_h200.json
        """
        from tunedb.bench.fusion import run_bench
        from tunedb.runtime.device import import_cupy

        import_cupy()  # no GPU: one-line error before anything else happens
        path = _database(db)
        cases = load_cases(suite)
        if case:
            unknown = sorted(set(case) - {c.name for c in cases})
            if unknown:
                fail(f"suite {suite!r} has no case named {', '.join(unknown)}")
            cases = [c for c in cases if c.name in set(case)]
        if not cases:
            fail(f"suite {suite!r} has no cases")
        typer.echo(f"{len(cases)} case(s); candidates from "
                   f"{path if path else 'the schedule space (no database)'}", err=True)
        result = run_bench(cases, out, db=path, top=top, time_limit_s=time_limit, search_s=search_time,
                           max_search=max_search, workers=workers, suite=suite,
                           progress=lambda line: typer.echo(line, err=True),
                           on_case=lambda i, n, rec: typer.echo(progress_line(i, n, rec), err=True))
        if json_out:
            print_json(result)
            return
        from rich.console import Console

        Console().print(render_table(result))
        typer.echo(summary_line(result))
        typer.echo(f"wrote {os.fspath(out)}")
