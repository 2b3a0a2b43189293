"""Training benchmark: synthetic fusion candidates -> features -> XGBoost, timed.

    python benchmarks/bench_train.py --rows 1000000 [--device cpu|cuda] [--objective auto]

Prints one JSON object: rows, workloads, seconds to generate, featurise and train, the
objective chosen, validation pairwise accuracy and the peak resident memory of the process.
The budget it checks: one million rows trained in at most 60 s with less than 4 GB.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

import numpy as np
import pyarrow as pa

from tunedb.costmodel.features import featurize_frame
from tunedb.costmodel.fit import clean_frame
from tunedb.costmodel.synthetic import synthetic_frame
from tunedb.costmodel.train import TrainParams, train_booster

BUDGET_SECONDS = 60.0
BUDGET_BYTES = 4 * 2**30


def _reset_peak() -> bool:
    """Restart the peak-RSS counter (Linux), so that training is measured without the data
    generation before it; False where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def run(rows: int = 1_000_000, per_workload: int = 500, device: str = "cpu", objective: str = "auto",
        seed: int = 0) -> dict:
    t0 = time.perf_counter()
    # Small workloads have fewer schedules than ``per_workload``: draw batches until enough rows.
    parts, have, k = [], 0, 0
    while have < rows:
        need = max(3, math.ceil((rows - have) / per_workload))
        part = synthetic_frame(n_workloads=need, candidates_per_workload=per_workload, seed=seed + k,
                               legal_only=False, fail_fraction=0.0)
        parts.append(part)
        have += part.num_rows
        k += 1
    frame = clean_frame(pa.concat_tables(parts).slice(0, rows))
    del parts
    t1 = time.perf_counter()
    X = featurize_frame(frame)
    y = frame["median_us"].to_numpy()
    groups = frame["workload_hash"].to_numpy(zero_copy_only=False)
    n, n_workloads = len(y), len(np.unique(groups))
    del frame
    peak_before = _peak_bytes()
    separate = _reset_peak()
    t2, c2 = time.perf_counter(), time.process_time()
    result = train_booster(X, y, groups, TrainParams(device=device, objective=objective, seed=seed))
    t3, c3 = time.perf_counter(), time.process_time()
    out = {
        "rows": n, "workloads": n_workloads, "features": int(X.shape[1]),
        "generate_s": round(t1 - t0, 2), "featurize_s": round(t2 - t1, 2), "train_s": round(t3 - t2, 2),
        # CPU seconds of all threads: on a shared, contended machine wall time overstates the cost.
        "train_cpu_s": round(c3 - c2, 2),
        "objective": result.objective, "objectives_tried": result.tried,
        "best_iteration": result.best_iteration,
        "valid_pairwise_accuracy": round(result.valid_metrics["pairwise_accuracy"], 4),
        # Peak memory of generating + featurising, and of training alone (it holds the features).
        "prepare_peak_rss_bytes": peak_before,
        "train_peak_rss_bytes": _peak_bytes() if separate else None, "device": device,
    }
    train_peak = out["train_peak_rss_bytes"] or _peak_bytes()
    out["within_budget"] = bool(out["train_s"] <= BUDGET_SECONDS and train_peak < BUDGET_BYTES)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--per-workload", type=int, default=500, help="candidates per workload")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--objective", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.rows < 3 or a.per_workload < 2:
        ap.error("need --rows >= 3 and --per-workload >= 2")
    print(json.dumps(run(a.rows, a.per_workload, a.device, a.objective, a.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
