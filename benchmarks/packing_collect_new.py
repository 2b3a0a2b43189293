"""Collect only the packing workloads an export does not hold yet (docs/packing.md, "Data").

    python benchmarks/packing_collect_new.py --known data/packing_h200 --db new.duckdb --time 150

``tunedb collect --collector packing --suite standard`` on a board that has not measured before
re-measures every stored workload first (the suite interleaves families); this measures the
suite's workloads whose hash is not in ``--known``'s ``workloads.parquet``, on any board, with the
same plugin, engine and protocol. ``--device replay:PATH`` replays stored rows instead (a CPU
check of the path). Prints the engine's summary as JSON; afterwards ``tunedb db import`` the
export of ``--db`` next to ``--known``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from collectors.packing import PackingCollector
from tunedb.collect import Job
from tunedb.store import TuningStore


class NewWorkloadsCollector(PackingCollector):
    """The packing plugin without the workloads of ``known`` (workload hashes)."""

    def __init__(self, known: set[str]) -> None:
        self.known = known

    def jobs(self, suite_name: str) -> Iterator[Job]:
        # in hash order, a fixed shuffle: a time limit cuts across shapes, R and dtypes alike
        new = [j for j in super().jobs(suite_name) if j.workload.hash not in self.known]
        return iter(sorted(new, key=lambda j: j.workload.hash))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--known", type=Path, required=True, help="an export whose workloads to skip")
    ap.add_argument("--db", type=Path, required=True)
    ap.add_argument("--suite", default="standard")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time", type=float, default=None, help="stop after S seconds")
    args = ap.parse_args(argv)
    try:
        known = set(pq.read_table(args.known / "workloads.parquet", columns=["hash"])["hash"].to_pylist())
    except OSError as e:
        print(f"--known {args.known}: no readable workloads.parquet ({e})", file=sys.stderr)
        return 2
    coll = NewWorkloadsCollector(known)
    todo = sum(1 for _ in coll.jobs(args.suite))
    print(f"{len(known)} known workloads; {todo} of suite {args.suite!r} to measure", file=sys.stderr)
    dev = coll.open_device(args.device)
    try:
        with TuningStore.open(args.db) as store:
            summary = coll.run(store, dev, args.suite, time_s=args.time)
    finally:
        dev.close()
    print(json.dumps(summary.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
