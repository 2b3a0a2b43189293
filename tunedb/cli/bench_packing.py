"""``tunedb bench packing``: independent GEMMs launched together (tunedb's packing backends)
next to torch's eager loop, CUDA-graph loop, streams in a graph, padded bmm and vmap."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunedb.cli.common import usage_error

PACKING_OUT = Path("bench-packing.json")  # the working folder, never the shipped data file
PACKING_SUITES = ("bench", "quick", "standard")


def packing(
    suite: Annotated[str, typer.Option("--suite", help="bench (the issue's cases: R-sweep, "
                                       "ResNet-18 tenants, three mixes), quick or standard.")] = "bench",
    case: Annotated[list[str] | None, typer.Option("--case", help="Only cases whose name contains "
                                                   "this (repeatable).")] = None,
    reps: Annotated[int, typer.Option("--reps", min=1, help="Launches per timed sample.")] = 20,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Timed samples per variant.")] = 15,
    out: Annotated[Path, typer.Option("--out", help="JSON result, rewritten after every "
                                      "case.")] = PACKING_OUT,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.0, help="Seconds after which "
                                              "no new case starts (0: no limit).")] = 240.0,
    no_peers: Annotated[bool, typer.Option("--no-peers", help="tunedb's candidates only (a "
                                           "collection sweep).")] = False,
    duel: Annotated[int, typer.Option("--duel", min=0, help="Then tunedb's 2 fastest and the 2 "
                                      "fastest torch peers again in this many interleaved "
                                      "rounds.")] = 0,
    no_extra: Annotated[bool, typer.Option("--no-extra", help="Without the split-K and chunked "
                                           "candidates (the cost model's candidate set only).")] = False,
) -> None:
    """Time every packing candidate of each case and the torch peers on the same inputs, each
    checked against a float64 reference first; prints a table and writes the JSON."""
    if suite not in PACKING_SUITES:
        usage_error(f"unknown packing suite {suite!r}; expected one of {', '.join(PACKING_SUITES)}")
    from tunedb.bench.packing import main

    argv = ["--suite", suite, "--reps", str(reps), "--samples", str(samples), "--out", str(out),
            "--time-limit", str(time_limit)]
    for c in case or []:
        argv += ["--case", c]
    if no_peers:
        argv.append("--no-peers")
    if no_extra:
        argv.append("--no-extra")
    if duel:
        argv += ["--duel", str(duel)]
    code = main(argv)
    if code:  # main printed the one-line reason
        raise typer.Exit(code)
