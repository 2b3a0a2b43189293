"""Why the fusion cost model misses issue 22's targets: a learning curve and where the held-out
errors sit, for the shipped recipe (``TrainParams()``) held out by workload.

    python benchmarks/costmodel_diagnose.py --export data/fusion_h200_v2 --out diagnose.json

Learning curve (``--split``, by workload unless told): each of the 5 folds trains on a random
fraction of its training workloads (``--fractions``, ``--reps`` draws each; 1.0 is the card's
protocol) and is scored on the whole held-out fold, so every point is scored on the same rows.
Errors (fraction 1.0): decisive pairs by how far apart their medians are and by what their
configs differ in, per family, and the first pick by how many candidates of the workload sit
within 2 % of its best.

``--all-boards`` learns every board of the export's device model (pairs within a board);
``--score-on OTHER`` also scores each point on OTHER's workloads alone; ``--grow-from BASE``
keeps BASE's workloads in every fold's training and draws the fraction from the others only
(fraction 0: BASE alone), the curve of adding new workloads to a dataset:

    python benchmarks/costmodel_diagnose.py --export COMBINED --all-boards \
        --grow-from data/fusion_h200_v2 --score-on data/fusion_h200_v2 --fractions 1 0.5 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from costmodel_variants import load, workload_hashes

from tunedb.bench.provenance import provenance
from tunedb.costmodel.evaluate import SPLITS, Labels, hide_measured, out_of_fold, score, split_folds
from tunedb.costmodel.features import FEATURE_NAMES
from tunedb.costmodel.metrics import METRIC_KEYS
from tunedb.costmodel.train import TrainParams, predict_us, train_booster
from tunedb.costmodel.workload import WORKLOAD_FEATURES

GAPS = (0.02, 0.05, 0.10, 0.20, 0.50, float("inf"))


def training_rows(tr: np.ndarray, workload: np.ndarray, fraction: float, seed: int,
                  base: np.ndarray | None = None) -> np.ndarray:
    """The rows of ``tr`` a fold trains on: whole workloads, ``fraction`` of them drawn at random
    (at least 3); with ``base`` (a per-row mask), every base row and ``fraction`` of the other
    workloads (none at fraction 0)."""
    if fraction >= 1.0:
        return tr
    always = np.zeros(len(tr), dtype=bool) if base is None else base[tr]
    wl = np.unique(workload[tr[~always]])
    n = min(len(wl), round(fraction * len(wl)) if base is not None else max(3, round(fraction * len(wl))))
    keep = np.random.default_rng(seed).choice(wl, n, replace=False)
    return tr[always | np.isin(workload[tr], keep)]


def held_out(X: np.ndarray, y: np.ndarray, labels: Labels, params: TrainParams, fraction: float,
             rep: int, split: str = "by_workload", base: np.ndarray | None = None) -> np.ndarray:
    """Out-of-fold predictions of ``split``, each fold trained on ``fraction`` of its workloads
    (with ``base``, a per-row mask: all of the base rows' workloads, ``fraction`` of the rest)."""
    def predict(i: int, tr: np.ndarray, te: np.ndarray) -> tuple[np.ndarray]:
        tr = training_rows(tr, labels.workload, fraction, 100 * rep + i, base)
        query = None if labels.compare is None else labels.compare[tr]
        r = train_booster(X[tr], y[tr], labels.workload[tr], replace(params, seed=params.seed + i),
                          query=query)
        return (predict_us(r.booster, hide_measured(X[te]), r.objective, r.calibration, r.calibration_floor),)
    (pred,) = out_of_fold(len(y), split_folds(labels, split, 5), predict, workers=2)
    return pred


def errors(X: np.ndarray, y: np.ndarray, pred: np.ndarray, labels: Labels) -> dict[str, Any]:
    """Decisive pairs by gap and by config difference, per family; first picks by near-best count."""
    cfg = X[:, len(WORKLOAD_FEATURES):len(WORKLOAD_FEATURES) + 28]
    names = FEATURE_NAMES[len(WORKLOAD_FEATURES):len(WORKLOAD_FEATURES) + 28]
    mapping = [i for i, n in enumerate(names) if n.startswith("mapping_")]
    lo, hi = labels.lo, labels.hi
    by_gap = np.zeros((len(GAPS) - 1, 2))
    by_diff: dict[str, list[int]] = {}
    fam: dict[str, list[float]] = {}
    picks: dict[str, list[int]] = {}
    for w in np.unique(labels.cmp):
        r = np.flatnonzero(labels.cmp == w)
        a, b = (r[i] for i in np.triu_indices(len(r), 1))
        gap = np.expm1(np.abs(np.log(y[a] / y[b])))
        dec = gap > 0.02
        if lo is not None and hi is not None:
            dec &= (hi[a] < lo[b]) | (hi[b] < lo[a])
        a, b, gap = a[dec], b[dec], gap[dec]
        ok = np.sign(y[a] - y[b]) == np.sign(pred[a] - pred[b])
        k = np.searchsorted(GAPS, gap, side="left") - 1
        np.add.at(by_gap, (k, 0), 1)
        np.add.at(by_gap, (k, 1), ~ok)
        diff = cfg[a] != cfg[b]
        for j in range(len(a)):
            d = np.flatnonzero(diff[j])
            key = ("mapping differs" if np.isin(d, mapping).any() else f"only {names[d[0]]}" if len(d) == 1
                   else f"{min(len(d), 5)}{'+' if len(d) >= 5 else ''} knobs, same mapping")
            by_diff.setdefault(key, [0, 0])
            by_diff[key][0] += 1
            by_diff[key][1] += int(not ok[j])
        f = str(labels.family[r[0]]) if labels.family is not None else "all"
        best = y[r].min()
        pick = r[np.argmin(pred[r])]
        hit = bool(y[pick] <= 1.02 * best)
        fam.setdefault(f, [0, 0, 0, 0])
        fam[f] = [fam[f][0] + 1, fam[f][1] + len(a), fam[f][2] + int((~ok).sum()), fam[f][3] + hit]
        near = int((y[r] <= 1.02 * best).sum())
        bucket = next(name for name, top in (("1", 1), ("2", 2), ("3-5", 5), ("6-10", 10), ("11+", 1 << 30))
                      if near <= top)
        picks.setdefault(bucket, [0, 0, 0])
        picks[bucket] = [picks[bucket][0] + 1, picks[bucket][1] + hit, picks[bucket][2]]
        picks[bucket][2] += near / len(r)
    wrong = by_gap[:, 1].sum()
    return {
        "decisive_by_gap": [{"gap": f"{GAPS[i]:.2f}-{GAPS[i + 1]:.2f}", "pairs": int(n),
                             "share": n / by_gap[:, 0].sum(), "accuracy": 1 - e / max(n, 1),
                             "share_of_wrong": e / max(wrong, 1)}
                            for i, (n, e) in enumerate(by_gap)],
        "decisive_by_config_difference": {k: {"pairs": n, "accuracy": 1 - e / n,
                                              "share_of_wrong": e / max(wrong, 1)}
                                          for k, (n, e) in sorted(by_diff.items(), key=lambda kv: -kv[1][1])},
        "families": {f: {"workloads": n, "decisive_pooled": 1 - e / max(p, 1), "top1_within_2pct": h / n}
                     for f, (n, p, e, h) in sorted(fam.items())},
        "first_pick_by_near_best": {k: {"workloads": n, "within_2pct": h / n, "random_pick": s / n}
                                    for k, (n, h, s) in picks.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, default=Path("data/fusion_h200_v2"))
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--reps", type=int, default=2, help="draws of the workload subset per fraction below 1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--split", default="by_workload", choices=list(SPLITS), help="the curve's held-out split")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--all-boards", action="store_true",
                    help="every board of the export's device model, pairs compared within a board")
    ap.add_argument("--score-on", type=Path, default=None,
                    help="an export whose workloads alone are also scored at every point")
    ap.add_argument("--grow-from", type=Path, default=None,
                    help="an export whose workloads every fold keeps; fractions draw from the others")
    args = ap.parse_args(argv)
    X, y, labels, board, hashes = load(args.export, args.all_boards)

    def rows_of(export: Path | None) -> np.ndarray | None:
        if export is None:
            return None
        keep = workload_hashes(export)
        return np.asarray([w in keep for w in hashes], dtype=bool)

    base, subset = rows_of(args.grow_from), rows_of(args.score_on)
    if (base is not None and not base.any()) or (subset is not None and not subset.any()):
        print("--grow-from / --score-on: none of that export's workloads is in --export", file=sys.stderr)
        return 2
    # Regression, as every fold of the shipped card chose ("auto" may pick ranking on a fold).
    params = replace(TrainParams(), nthread=args.threads, objective="reg:squarederror")
    out: dict[str, Any] = {**provenance(), "export": str(args.export), "board": board, "split": args.split,
                           "grow_from": str(args.grow_from) if args.grow_from else None,
                           "score_on": str(args.score_on) if args.score_on else None, "curve": []}
    for f in args.fractions:
        for rep in range(1 if f >= 1.0 or (f <= 0.0 and base is not None) else args.reps):
            cpu = time.process_time()
            pred = held_out(X, y, labels, params, f, rep, args.split, base)
            m = score(y, pred, labels)
            point: dict[str, Any] = {"fraction": f, "rep": rep, **{k: m[k] for k in METRIC_KEYS},
                                     "cpu_s": time.process_time() - cpu}
            print(f"fraction {f} draw {rep}: " + " ".join(f"{k} {m[k]:.4f}" for k in METRIC_KEYS), flush=True)
            if subset is not None:
                rows = np.flatnonzero(subset)
                sm = score(y[rows], pred[rows], labels.take(rows))
                point["score_on"] = {k: sm[k] for k in METRIC_KEYS}
                print("  on --score-on: " + " ".join(f"{k} {sm[k]:.4f}" for k in METRIC_KEYS), flush=True)
            out["curve"].append(point)
            if f >= 1.0 and "errors" not in out:
                out["errors"] = errors(X, y, pred, labels)
    print(json.dumps(out.get("errors", {}), indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
