"""Measurement fidelity: how far a later run's medians drift from the stored ones.

    python -m tunedb.bench.fidelity LATER.duckdb STORED.duckdb [--out fidelity.json]

LATER is typically ``tunedb collect --strategy random --budget 200`` into a fresh database;
STORED the database (or an import of the Parquet shards) it is compared with. Every candidate
verified in both is a pair; the drift of a pair is ``later / stored - 1`` of the median latencies,
reported as a distribution, overall and split at 20 µs (short kernels are timed in CUDA-graph
batches and drift more in relative terms).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.provenance import provenance
from tunedb.store import TuningStore

SPLIT_US = 20.0


def _ok_medians(store: TuningStore) -> dict[str, float]:
    rows = store.con.execute(
        "SELECT candidate_hash, median(median_us) FROM measurements WHERE status = ? GROUP BY 1",
        ["ok"]).fetchall()
    return {h: float(us) for h, us in rows}


def _summary(drift: np.ndarray) -> dict[str, Any]:
    a = np.abs(drift) * 100.0
    if not len(a):
        return {"n": 0}
    q = np.percentile(a, [50, 75, 90])
    return {"n": int(len(a)), "median_abs_drift_pct": round(float(q[0]), 3),
            "p75_abs_drift_pct": round(float(q[1]), 3), "p90_abs_drift_pct": round(float(q[2]), 3),
            "max_abs_drift_pct": round(float(a.max()), 3),
            "median_signed_drift_pct": round(float(np.median(drift) * 100.0), 3)}


def fidelity(later: str | Path, stored: str | Path) -> dict[str, Any]:
    """Drift distribution of the candidates verified in both databases."""
    with TuningStore.open(later, read_only=True) as a, TuningStore.open(stored, read_only=True) as b:
        new, old = _ok_medians(a), _ok_medians(b)
        devices = sorted({d.name for d in a.devices() + b.devices()})
    both = sorted(set(new) & set(old))
    if not both:
        raise ValueError(f"no candidate is verified in both {later} and {stored}")
    before = np.array([old[h] for h in both])
    drift = np.array([new[h] for h in both]) / before - 1.0
    long = before >= SPLIT_US
    return {"pairs": len(both), "devices": devices, "split_us": SPLIT_US,
            "groups": {"all": _summary(drift), "ge_20us": _summary(drift[long]),
                       "lt_20us": _summary(drift[~long])}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("later", help="database of the re-measurement run")
    ap.add_argument("stored", help="database holding the stored measurements")
    ap.add_argument("--out", help="write the result as JSON here too")
    a = ap.parse_args(argv)
    try:
        result = fidelity(a.later, a.stored)
    except Exception as e:  # one line, non-zero exit: a bad path or an empty overlap
        print(f"error: {e}", file=sys.stderr)
        return 1
    result.update(provenance(None if argv is None else [sys.argv[0], *argv]))
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
