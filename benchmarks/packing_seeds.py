"""The packing model's held-out choice scores over several seeds of the folds.

    python benchmarks/packing_seeds.py --data data/packing_h200 --seeds 0 1 2 --out seeds.json

``tunedb train --kind packing`` evaluates one seed; a score at a bar (within 5 % of the best on
90 % of workloads) needs the spread of the folds too. Per seed and split (by workload, by family)
this prints the share of held-out workloads whose model choice is within 5 % of the best
measured candidate, the exact best's share, and the pooled 10 % measure-top replay; then the
mean and the range over seeds, overall and for the workloads whose split-K / chunked candidates
were measured (where the new backends compete); and the pooled replay with 10 % of every
candidate the workloads have (``all_candidates``, stored or not).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import tunedb.costmodel.packing as P
from tunedb.bench.provenance import provenance
from tunedb.costmodel.packing import _score, fit, load_frame, measure_top_replay, predict_us


def extra_workloads(frame: dict[str, Any]) -> set[str]:
    """Workload hashes with at least one measured split-K or chunked candidate."""
    return {str(g) for g, n in zip(frame["groups"], frame["names"])
            if "splitk" in str(n) or "chunks" in str(n)}


def held_out(frame: dict[str, Any], seed: int, split: str, folds: int) -> np.ndarray:
    """Held-out µs of every row: the split's groups (workloads, or families) shuffled by ``seed``
    into ``folds`` folds, each predicted by a model (XGBoost seed ``seed``) trained on the rest."""
    X, y, groups = frame["X"], frame["y"], frame["groups"]
    key = groups if split == "by_workload" else frame["families"]
    uniq = np.unique(key)
    np.random.default_rng(seed).shuffle(uniq)
    pred = np.full(len(y), np.nan)
    for part in np.array_split(uniq, min(folds, len(uniq))):
        te = np.isin(key, part)
        model = fit(X[~te], y[~te], groups[~te])
        pred[te] = predict_us(model, X[te], groups[te])
    return pred


def scores(frame: dict[str, Any], seed: int, splits: tuple[str, ...], folds: int) -> dict[str, Any]:
    P.PARAMS["seed"] = P.RANK_PARAMS["seed"] = seed  # the boosters' sampling seed too
    y, groups = frame["y"], frame["groups"]
    extra = np.isin(groups, sorted(extra_workloads(frame)))
    out = {}
    for split in splits:
        pred = held_out(frame, seed, split, folds)
        res = {}
        for name, mask in (("all", np.ones(len(y), bool)), ("extra", extra)):
            rows = np.flatnonzero(mask)
            ratio = np.asarray(_score(y, pred, groups, frame["names"], rows)["model_ratio"])
            res[name] = {"workloads": len(ratio), "within_5pct": float(np.mean(ratio <= 1.05)),
                         "best": float(np.mean(ratio <= 1.0 + 1e-9)),
                         "measure_top_10pct": measure_top_replay(y[rows], pred[rows], groups[rows]),
                         "measure_top_10pct_space": measure_top_replay(y[rows], pred[rows], groups[rows],
                                                                       space=frame["space"])}
        out[split] = res
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a packing Parquet export")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--splits", nargs="+", default=["by_workload", "leave_family_out"],
                    choices=["by_workload", "leave_family_out"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        frame = load_frame(args.data)
    except (OSError, ValueError) as e:
        print(f"error: {args.data}: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 1
    per = {s: scores(frame, s, tuple(args.splits), args.folds) for s in args.seeds}
    print(f"{len(np.unique(frame['groups']))} workloads, {len(frame['y'])} measured candidates, "
          f"{len(extra_workloads(frame))} workloads with split-K/chunked rows")
    print(f"{'split':18s} {'seed':>4s} {'within 5%':>9s} {'best':>6s} {'mt within 5%':>12s} "
          f"{'mt best':>7s} {'mt share':>8s} {'extra: within 5%':>16s} {'mt best':>7s} "
          f"{'10% of all: best':>16s} {'within 5%':>9s}")
    for s, res in per.items():
        for split, r in res.items():
            a, e = r["all"], r["extra"]
            print(f"{split:18s} {s:4d} {100 * a['within_5pct']:8.1f}% {100 * a['best']:5.1f}% "
                  f"{100 * a['measure_top_10pct']['within_5pct']:11.1f}% "
                  f"{100 * a['measure_top_10pct']['reaches_best']:6.1f}% "
                  f"{100 * a['measure_top_10pct']['measured_share']:7.1f}% "
                  f"{100 * e['within_5pct']:15.1f}% {100 * e['measure_top_10pct']['reaches_best']:6.1f}% "
                  f"{100 * a['measure_top_10pct_space']['reaches_best']:15.1f}% "
                  f"{100 * a['measure_top_10pct_space']['within_5pct']:8.1f}%")
    for split in args.splits:
        v = [per[s][split]["all"]["within_5pct"] for s in args.seeds]
        print(f"{split}: within 5 % mean {100 * np.mean(v):.1f}% "
              f"(range {100 * min(v):.1f}-{100 * max(v):.1f})")
    if args.out:
        args.out.write_text(json.dumps({**provenance(argv), "data": str(args.data.name), "seeds": per},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
