"""Collect the ``splitk`` and ``chunks`` candidates of the packing suite next to stored rows.

    python benchmarks/packing_collect_extra.py --known data/packing_h200 --db extra.duckdb \
        --per-workload 6 --time 80

A new board's rows join the stored ones through ``board_labels``, which scales a board to a
workload's reference board by the candidates both measured (at least ``MIN_COMMON``). So each
workload gets its anchors first (``whole:serial`` and the stored best ``--anchors - 1``), then a
sample of its split-K and chunked candidates (``--per-workload``, both backends alternating, a
fixed shuffle per workload; 0 = all). Workloads come round-robin over families (a time limit cuts
every family), the stored ones first; ``--first FAM,..`` puts those families' workloads before the
rest. ``--skip-stored`` leaves out the split-K / chunked candidates ``--known`` already holds (the
anchors are still re-measured; a workload with nothing new gets no job), so a later Run continues
the same shuffle where the last stopped. ``--device replay:PATH`` replays stored rows (a CPU check
of the path; the new candidates are then ``missing``). Prints the engine's summary as JSON;
afterwards ``tunedb db import`` the export of ``--db`` next to ``--known``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from collectors.packing import PackingCollector, candidate_config, workload_record
from tunedb.collect import Job
from tunedb.costmodel.packing import MIN_COMMON
from tunedb.kernels.packing import Candidate, PackingWorkload, chunk_candidates, splitk_candidates
from tunedb.kernels.packing_suites import interleave, suite
from tunedb.records import canonical_json
from tunedb.store import TuningStore


def stored_best(known: Path) -> dict[str, list[Candidate]]:
    """Per workload hash, its stored candidates fastest first (median of all ok rows)."""
    cands = {r["hash"]: r for r in pq.read_table(known / "candidates.parquet").to_pylist()
             if r["kind"] == "packing"}
    times: dict[str, list[float]] = defaultdict(list)
    for r in pq.read_table(known / "measurements.parquet",
                           columns=["candidate_hash", "status", "median_us"]).to_pylist():
        if r["status"] == "ok" and r["candidate_hash"] in cands and r["median_us"]:
            times[r["candidate_hash"]].append(r["median_us"])
    per: dict[str, list[tuple[float, Candidate]]] = defaultdict(list)
    for ch, ts in times.items():
        c = cands[ch]
        cfg = json.loads(c["config_json"])
        cand = Candidate.from_json({"partition": cfg["partition"], "concurrent": cfg["concurrent"],
                                    "clusters": json.loads(cfg["clusters"])})
        per[c["workload_hash"]].append((sorted(ts)[len(ts) // 2], cand))
    return {wh: [c for _, c in sorted(v, key=lambda t: t[0])] for wh, v in per.items()}


def stored_keys(known: Path) -> dict[str, set[str]]:
    """Per workload hash, the canonical cluster JSON of every candidate measured ``ok``."""
    ok = {r["candidate_hash"] for r in pq.read_table(
        known / "measurements.parquet", columns=["candidate_hash", "status"]).to_pylist()
        if r["status"] == "ok"}
    out: dict[str, set[str]] = defaultdict(set)
    for r in pq.read_table(known / "candidates.parquet").to_pylist():
        if r["kind"] == "packing" and r["hash"] in ok:
            out[r["workload_hash"]].add(canonical_json(json.loads(json.loads(r["config_json"])["clusters"])))
    return out


def extra_sample(w: PackingWorkload, n: int) -> list[Candidate]:
    """Up to ``n`` (0: all) split-K and chunked candidates of ``w``, the two kinds alternating,
    each kind in a fixed shuffle seeded by the workload's hash."""
    rng = random.Random(w.hash)
    kinds = [splitk_candidates(w), chunk_candidates(w)]
    for k in kinds:
        rng.shuffle(k)
    out: list[Candidate] = []
    while any(kinds) and (n <= 0 or len(out) < n):
        for k in kinds:
            if k and (n <= 0 or len(out) < n):
                out.append(k.pop(0))
    return out


class ExtraCollector(PackingCollector):
    """Anchors and a sample of the split-K / chunked candidates per workload (module docstring)."""

    extra = True

    def __init__(self, best: dict[str, list[Candidate]], per_workload: int, anchors: int,
                 stored: dict[str, set[str]] | None = None, first: tuple[str, ...] = ()) -> None:
        self.best, self.per_workload, self.anchors = best, per_workload, anchors
        self.stored, self.first = stored, first

    def jobs(self, suite_name: str) -> Iterator[Job]:
        ws = list({w.hash: w for w in interleave(suite(suite_name))}.values())
        # stable: the --first families, then stored workloads first, families interleaved
        ws.sort(key=lambda w: (w.family not in self.first, w.hash not in self.best))
        for w in ws:
            serial = Candidate.from_json({"partition": "whole", "clusters": [
                {"members": list(range(len(w.members))), "backend": "serial"}]})
            picks: dict[str, Candidate] = {}
            for c in [serial] + self.best.get(w.hash, []):
                if len(picks) >= self.anchors:
                    break
                picks.setdefault(canonical_json(c.to_json()), c)
            new = extra_sample(w, 0 if self.stored is not None else self.per_workload)
            if self.stored is not None:
                done = self.stored.get(w.hash, set())
                new = [c for c in new if canonical_json(c.to_json()["clusters"]) not in done]
                new = new[:self.per_workload] if self.per_workload > 0 else new
                if not new:
                    continue  # nothing left to learn here: spend no anchors on it
            for c in new:
                picks.setdefault(canonical_json(c.to_json()), c)
            yield Job(workload_record(w), [(candidate_config(w, c), c) for c in picks.values()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--known", type=Path, required=True, help="the export the rows will join")
    ap.add_argument("--db", type=Path, required=True)
    ap.add_argument("--suite", default="standard")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--per-workload", type=int, default=6, help="new candidates per workload (0: all)")
    ap.add_argument("--anchors", type=int, default=MIN_COMMON + 1,
                    help="stored candidates re-measured per workload (serial and the best)")
    ap.add_argument("--time", type=float, default=None, help="stop after S seconds")
    ap.add_argument("--skip-stored", action="store_true",
                    help="leave out the split-K / chunked candidates --known already holds")
    ap.add_argument("--first", default="", help="families (comma-separated) measured before the rest")
    args = ap.parse_args(argv)
    if args.anchors < MIN_COMMON:
        print(f"--anchors {args.anchors}: at least {MIN_COMMON} (board_labels needs them)", file=sys.stderr)
        return 2
    try:
        best = stored_best(args.known)
        stored = stored_keys(args.known) if args.skip_stored else None
    except (OSError, KeyError) as e:
        print(f"--known {args.known}: no readable packing export ({e})", file=sys.stderr)
        return 2
    first = tuple(f for f in args.first.split(",") if f)
    coll = ExtraCollector(best, args.per_workload, args.anchors, stored, first)
    jobs = list(coll.jobs(args.suite))
    print(f"{len(jobs)} workloads, {sum(len(j.specs) for j in jobs)} candidates to measure",
          file=sys.stderr)
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
