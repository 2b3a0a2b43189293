"""The noise ceiling of the cost-model metrics, from stored re-measurements of the same candidates.

    python benchmarks/noise_ceiling.py data/fusion_h200 data/fusion_h200_v2 data/fusion_h200_boards \
        --out ceiling.json

Imports the Parquet exports into one temporary DuckDB file and scores every measurement set
(board, run) as the "model" of every other set sharing at least --min-candidates candidates
(``tunedb.costmodel.ceiling``): the metrics an exact model of one measurement reaches against a
re-measurement. Then, where three sets share candidates, the consensus estimate of an exact
model's scores (one reference, the geometric mean of two, extrapolated to no noise). Prints one
row per ordered pair and per estimate and writes them, argv and the git commit as JSON.
``--split-samples`` also scores each measurement set's stored samples against themselves (first
half against second, odd against even: ``split_sample_ceiling``), the same board and run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import duckdb

from tunedb.bench.provenance import provenance as _provenance
from tunedb.costmodel.ceiling import consensus_ceiling, remeasurement_ceiling, split_sample_ceiling
from tunedb.costmodel.metrics import METRIC_KEYS, METRIC_SHORT_NAMES
from tunedb.store import TuningStore

SHORT = METRIC_SHORT_NAMES


def _protocols(path: Path) -> dict[tuple[str, str], str]:
    """The measuring protocol of each (board, run), e.g. how many launches one sample batches."""
    with duckdb.connect(str(path), read_only=True) as con:
        rows = con.execute("SELECT device_id, run_id, any_value(protocol_json) FROM measurements "
                           "GROUP BY device_id, run_id").fetchall()
    return {(d, r): p for d, r, p in rows}


def _sample_splits(exports: list[Path], min_candidates: int) -> list[dict[str, object]]:
    """``split_sample_ceiling`` of every (export, board, run) with enough ok measurements."""
    import pyarrow.parquet as pq

    out: list[dict[str, object]] = []
    for d in exports:
        workload = {r["hash"]: r["workload_hash"] for r in
                    pq.read_table(d / "candidates.parquet", columns=["hash", "workload_hash"]).to_pylist()}
        sets: dict[tuple[str, str], tuple[list[list[float]], list[str]]] = {}
        for r in pq.read_table(d / "measurements.parquet", columns=[
                "candidate_hash", "device_id", "run_id", "status", "samples_us"]).to_pylist():
            if r["status"] == "ok" and r["candidate_hash"] in workload:
                s, w = sets.setdefault((r["device_id"], r["run_id"]), ([], []))
                s.append(r["samples_us"])
                w.append(workload[r["candidate_hash"]])
        for (dev, run), (s, w) in sorted(sets.items()):
            for how in ("halves", "alternate") if len(s) >= min_candidates else ():
                r = split_sample_ceiling(s, w, how)
                if r["candidates"] >= min_candidates:
                    out.append({"export": d.name, "device_id": dev, "run_id": run, **r})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exports", nargs="+", type=Path, help="tunedb Parquet export directories")
    ap.add_argument("--kind", default="fusion")
    ap.add_argument("--min-candidates", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--split-samples", action="store_true",
                    help="also score each set's stored samples split in two (same board and run)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "all.duckdb"
        with TuningStore.open(path) as store:
            for d in args.exports:
                store.import_parquet(d)
            frame = store.training_frame(kind=args.kind, include_graph=False)
        protocols = _protocols(path)
    rows = remeasurement_ceiling(frame, min_candidates=args.min_candidates)
    consensus = consensus_ceiling(frame)
    for r in rows:
        for side in ("reference", "remeasured"):
            r[side]["protocol"] = protocols.get((r[side]["device_id"], r[side]["run_id"]))
    keys = [k for k in METRIC_KEYS if k != "mape"]
    head = "".join(f"{SHORT[k]:>10}" for k in keys)
    print(f"{'reference -> re-measurement':<36}{'cands':>7}{'wls':>5}{head}")
    for r in rows:
        pair = f"{r['reference']['device_id'][:8]}/{r['reference']['run_id'][:4]} -> " \
               f"{r['remeasured']['device_id'][:8]}/{r['remeasured']['run_id'][:4]}"
        print(f"{pair:<36}{r['candidates']:>7}{r['workloads']:>5}" + "".join(f"{r[k]:>10.4f}" for k in keys))
    print(f"\n{'exact-model estimate for':<36}{'cands':>7}{'wls':>5}{head}")
    for c in consensus:
        target = f"{c['remeasured']['device_id'][:8]}/{c['remeasured']['run_id'][:4]}"
        for what in ("one_reference", "two_references", "exact_estimate"):
            label = f"{target} {what.replace('_', ' ')}"
            cells = "".join(f"{c[what][k]:>10.4f}" for k in keys)
            print(f"{label:<36}{c['candidates']:>7}{c['workloads']:>5}{cells}")
    splits = _sample_splits(args.exports, args.min_candidates) if args.split_samples else []
    if splits:
        print(f"\n{'samples split in two (one set)':<36}{'cands':>7}{'wls':>5}{head}")
    for r in splits:
        label = f"{r['export']} {r['device_id'][:8]}/{r['run_id'][:4]} {r['split']}"
        print(f"{label:<36}{r['candidates']:>7}{r['workloads']:>5}" + "".join(f"{r[k]:>10.4f}" for k in keys))
    if args.out:
        args.out.write_text(json.dumps({**_provenance(),
                                        "exports": [str(e) for e in args.exports], "pairs": rows,
                                        "consensus": consensus, "sample_splits": splits},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
