"""Cost-model variants scored on the four held-out splits (by workload, leave op / shape /
family out), on the same features and rows, one after the other in this process.

    python benchmarks/costmodel_variants.py --export data/fusion_h200_v2 --out variants.json

``--all-boards`` keeps every board of the export's device model (pairs never cross boards);
``--score-on OTHER_EXPORT`` also scores the same held-out predictions on OTHER_EXPORT's
workloads alone (a larger dataset against a smaller one, like for like); with it,
``--others-weight W`` trains the rows of every other workload at weight W (0: as if absent
from training, with the same folds; 1: as much as the rest).

Variants: ``regression`` (squared error on log latency over the floor), ``top_weighted``
(the default: the same with row weights 0.1 + exp(-gap / 0.1), gap = latency / best of the
workload - 1), ``top_weighted_wide`` (gap scale 0.2), ``top_weighted_long`` (each bag member up
to 300 rounds, not 100; ``top_weighted_r200``: 200), ``balanced_half`` / ``balanced``
(top_weighted with ``TrainParams.workload_balance`` 0.5 / 1: a workload's rows weigh
n ** -alpha), ``top_weighted_mono`` (with
``TrainParams.monotone``: latency monotone in traffic, roofline time, lane use and wave
efficiency), ``near_best`` (top_weighted plus as
many members trained only on each workload's candidates within 30 % of its best),
``over_best`` (``TrainParams.target`` "log_over_best": the bag learns log(latency / best of
the workload), level members the best from the workload's facts alone, summed into one booster),
``rank_pairwise`` and ``rank_ndcg`` (XGBoost's ranking objectives, calibrated to microseconds),
``rank_pairwise_bin`` (rank_pairwise on labels in 2 % steps from the workload's best: pairs
closer than that, within the timing noise, are not trained on).
Blends train their members on each fold once and average them in log space: ``blend_rp_cal``
/ ``blend_rpn_cal`` (top_weighted with rank_pairwise / and rank_ndcg, each member's calibrated
microseconds: a row-wise model), ``blend_rp_z`` / ``blend_rpn_z`` (the members' z-scores within
each workload, mapped back to the regression's per-workload mean and spread: a prediction that
depends on the other candidates predicted with it); ``blend_rpb_z`` / ``blend_rpb_cal`` the same
with ``rank_pairwise_bin``, ``blend_rpb_cal_02`` with the ranker at weight 0.2.
Prints one table per split and writes every number, the CPU seconds of each variant, argv and
the git commit as JSON.

    python benchmarks/costmodel_variants.py --kind packing --export data/packing_h200

scores the packing kind's model (``tunedb.costmodel.packing``: its features, settings and rounds,
one thread) on the same four splits through ``evaluate_fits``: op is the scenario part of the
workload's name (``bert_ffn_up``, ``replicas_r8``), shape its member shapes or the tenants'
sequence lengths, family its scenario family.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunedb.bench.provenance import provenance as _provenance
from tunedb.costmodel.evaluate import (
    SPLITS,
    Labels,
    evaluate_fits,
    evaluate_splits,
    hide_measured,
    out_of_fold,
    score,
    split_folds,
)
from tunedb.costmodel.features import DeviceFacts, featurize_frame
from tunedb.costmodel.fit import clean_frame, device_facts_for, frame_labels, group_codes
from tunedb.costmodel.metrics import METRIC_KEYS, METRIC_SHORT_NAMES
from tunedb.costmodel.train import TrainParams, predict_us, train_booster
from tunedb.store import TuningStore

VARIANTS: dict[str, dict[str, Any]] = {
    "regression": {"objective": "reg:squarederror"},
    "top_weighted": {"objective": "reg:squarederror", "top_weight": 0.1},
    "top_weighted_wide": {"objective": "reg:squarederror", "top_weight": 0.2},
    # Each bag member up to 300 rounds instead of 100: on 2x the data the cap binds (every
    # member of the v2 card stopped at round 98-99 of 100).
    "top_weighted_long": {"objective": "reg:squarederror", "top_weight": 0.1, "bag_rounds": 300},
    "top_weighted_r200": {"objective": "reg:squarederror", "top_weight": 0.1, "bag_rounds": 200},
    "balanced_half": {"objective": "reg:squarederror", "top_weight": 0.1, "workload_balance": 0.5},
    "balanced": {"objective": "reg:squarederror", "top_weight": 0.1, "workload_balance": 1.0},
    "top_weighted_mono": {"objective": "reg:squarederror", "top_weight": 0.1, "monotone": True},
    # As many near-best members as --bag members (a 1:1 blend), on rows within 30 % of the best.
    "near_best": {"objective": "reg:squarederror", "top_weight": 0.1, "near_best_gap": 0.3},
    # Distance from the workload's best, plus level members for the best from the workload alone.
    "over_best": {"objective": "reg:squarederror", "top_weight": 0.1, "target": "log_over_best"},
    "rank_pairwise": {"objective": "rank:pairwise"},
    "rank_ndcg": {"objective": "rank:ndcg"},
    # Ranking labels in 2 % steps from the workload's best: pairs within the noise form no pair.
    "rank_pairwise_bin": {"objective": "rank:pairwise", "rank_bin": 0.02},
}
# Blends: (members, how they are averaged, the weight of every member after the first: equal
# weights when None); members are VARIANTS.
BLENDS: dict[str, tuple[tuple[str, ...], str, float | None]] = {
    "blend_rp_cal": (("top_weighted", "rank_pairwise"), "cal", None),
    "blend_rpn_cal": (("top_weighted", "rank_pairwise", "rank_ndcg"), "cal", None),
    "blend_rp_z": (("top_weighted", "rank_pairwise"), "z", None),
    "blend_rpn_z": (("top_weighted", "rank_pairwise", "rank_ndcg"), "z", None),
    "blend_rpb_z": (("top_weighted", "rank_pairwise_bin"), "z", None),
    "blend_rpb_cal": (("top_weighted", "rank_pairwise_bin"), "cal", None),
    "blend_rpb_cal_02": (("top_weighted", "rank_pairwise_bin"), "cal", 0.2),
}
SHORT = METRIC_SHORT_NAMES


def _zscores(v: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row z-score of ``v`` within its group, and the group's mean and spread per row."""
    _, inv, counts = np.unique(groups, return_inverse=True, return_counts=True)
    mean = np.bincount(inv, v) / counts
    sd = np.sqrt(np.maximum(np.bincount(inv, v * v) / counts - mean ** 2, 0.0))
    sd = np.where(sd > 0, sd, 1.0)
    return (v - mean[inv]) / sd[inv], mean[inv], sd[inv]


def blend_log_us(logs: list[np.ndarray], how: str, groups: np.ndarray,
                 weight: float | None = None) -> np.ndarray:
    """Members' log latencies (the first a regression) -> the blend's log latency; ``weight``:
    of each member after the first (None: equal weights)."""
    w = np.full(len(logs), 1.0 / len(logs)) if weight is None else np.r_[1.0 - weight * (len(logs) - 1),
                                                                         [weight] * (len(logs) - 1)]
    if how == "cal":
        return np.tensordot(w, np.asarray(logs), axes=1)
    z = np.tensordot(w, np.asarray([_zscores(v, groups)[0] for v in logs]), axes=1)
    _, mean, sd = _zscores(logs[0], groups)
    return mean + sd * z


def blend_results(X: np.ndarray, y: np.ndarray, labels: Labels, names: list[str], bag: int, threads: int,
                  splits: list[str], folds: int) -> dict[str, Any]:
    """The blends ``names`` on ``splits``: every member trained once per fold (compile facts hidden
    on the held-out rows, fold i seeded i, as ``evaluate_splits``), every blend scored on them."""
    members = sorted({m for n in names for m in BLENDS[n][0]}, key=list(VARIANTS).index)
    out: dict[str, Any] = {n: {} for n in names}
    for split in splits:
        parts = split_folds(labels, split, folds)
        if not parts:
            continue
        cpu = time.process_time()

        def predict(i: int, tr: np.ndarray, te: np.ndarray) -> list[np.ndarray]:
            query = None if labels.compare is None else labels.compare[tr]
            preds = []
            for m in members:
                p = replace(TrainParams(), bag=bag, nthread=threads, seed=i, **VARIANTS[m])
                r = train_booster(X[tr], y[tr], labels.workload[tr], p, query=query)
                preds.append(predict_us(r.booster, hide_measured(X[te]), r.objective, r.calibration,
                                        r.calibration_floor))
            return preds

        pooled = dict(zip(members, out_of_fold(len(y), parts, predict, outputs=len(members))))
        rows = np.flatnonzero(np.isfinite(pooled[members[0]]))
        sub = labels.take(rows)
        for n in names:
            logs = [np.log(pooled[m][rows]) for m in BLENDS[n][0]]
            m = score(y[rows], np.exp(blend_log_us(logs, BLENDS[n][1], sub.cmp, BLENDS[n][2])), sub)
            out[n][split] = {k: m[k] for k in METRIC_KEYS} | {
                "folds": len(parts), "rows": int(len(rows)), "workloads": int(len(np.unique(sub.workload)))}
        print(f"  blends: {split} ({len(members)} members, {time.process_time() - cpu:.0f} CPU s)",
              file=sys.stderr, flush=True)
    for n in names:
        out[n]["params"] = {"members": list(BLENDS[n][0]), "average": BLENDS[n][1], "weight": BLENDS[n][2],
                            "bag": bag}
    return out


def load(export: Path, all_boards: bool = False) -> tuple[np.ndarray, np.ndarray, Any, str, list[str]]:
    """Features, latencies and labels of the board with the most measurements in ``export``, or
    (``all_boards``) of every board of its device model, pairs compared within one board."""
    with tempfile.TemporaryDirectory() as tmp, TuningStore.open(Path(tmp) / "v.duckdb") as store:
        store.import_parquet(export)
        frame = store.training_frame(kind="fusion")
        devices = {d.id: d for d in store.devices()}
    ids = frame["device_id"].to_pylist()
    board = max(set(ids), key=ids.count)
    if all_boards:
        t = clean_frame(frame)
        X = featurize_frame(t, device_facts_for(t, list(devices.values())))
        boards = t["device_id"].to_pylist()
        pairs = group_codes(pc.binary_join_element_wise(t["workload_hash"], t["device_id"], "|")) \
            if len(set(boards)) > 1 else None
        return (X, t["median_us"].to_numpy(zero_copy_only=False).astype(np.float64),
                frame_labels(t, pairs), ",".join(sorted(set(boards))), t["workload_hash"].to_pylist())
    t = clean_frame(frame.filter(pa.array([i == board for i in ids])))
    X = featurize_frame(t, DeviceFacts.from_device_info(devices[board]))
    return (X, t["median_us"].to_numpy(zero_copy_only=False).astype(np.float64), frame_labels(t), board,
            t["workload_hash"].to_pylist())


def workload_hashes(export: Path) -> set[str]:
    """The workload hashes an export holds (the subset to score on with ``--score-on``)."""
    import pyarrow.parquet as pq

    return set(pq.read_table(export / "workloads.parquet", columns=["hash"])["hash"].to_pylist())


def packing_results(export: Path, splits: list[str], folds: int) -> tuple[dict[str, Any], int]:
    """The packing kind's model on the four splits (held-out metrics per split) and its rows."""
    import pyarrow.parquet as pq
    import xgboost as xgb

    from tunedb.costmodel import packing

    frame = packing.load_frame(export)
    names = {r["hash"]: r["name"] for r in pq.read_table(export / "workloads.parquet").to_pylist()}
    parts = [names[g].rsplit("_", 2) for g in frame["groups"]]  # <scenario>_<shapes>_<dtype>
    labels = Labels.of(frame["groups"], op=[p[0] for p in parts], shape=[p[1] for p in parts],
                       family=frame["families"])
    X, y = frame["X"], frame["y"]

    def fit(tr: np.ndarray) -> Any:
        # One thread: on a couple of thousand rows more threads only wait for each other.
        b = xgb.train({**packing.PARAMS, "nthread": 1}, xgb.DMatrix(X[tr], label=np.log(y[tr])),
                      packing.ROUNDS)
        return lambda te: np.exp(b.predict(xgb.DMatrix(X[te])))

    cpu = time.process_time()
    ev = evaluate_fits(fit, y, labels, splits=splits, folds=folds)
    out: dict[str, Any] = {s: {k: ev[s].get(k) for k in (*METRIC_KEYS, "folds", "rows", "workloads")}
                           for s in splits if ev[s]}
    out["cpu_s"] = time.process_time() - cpu
    out["params"] = {**packing.PARAMS, "nthread": 1, "rounds": packing.ROUNDS}
    return out, int(len(y))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, default=Path("data/fusion_h200_v2"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=[*VARIANTS, *BLENDS])
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--bag", type=int, default=5, help="boosters averaged per model (the default is 5)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--all-boards", action="store_true",
                    help="train and score on every board of the device model, not only the largest")
    ap.add_argument("--threads", type=int, default=0, help="XGBoost threads (0: the trainer's default)")
    ap.add_argument("--score-on", type=Path, default=None,
                    help="an export whose workloads alone are also scored (like for like with a smaller one)")
    ap.add_argument("--others-weight", type=float, default=None,
                    help="with --score-on: training weight of the rows of workloads not in that export")
    ap.add_argument("--kind", choices=("fusion", "packing"), default="fusion",
                    help="packing: the packing kind's model on --export (its variants are not tried)")
    args = ap.parse_args(argv)
    if args.kind == "packing":
        res, rows = packing_results(args.export, args.splits, args.folds)
        _print_tables({"packing": res}, args.splits)
        if args.out:
            args.out.write_text(json.dumps({**_provenance(), "export": str(args.export), "kind": "packing",
                                            "rows": rows, "results": {"packing": res}}, indent=1) + "\n")
        return 0
    X, y, labels, board, hashes = load(args.export, args.all_boards)
    subset = None
    if args.score_on:
        keep = workload_hashes(args.score_on)
        subset = np.flatnonzero([w in keep for w in hashes])
        if args.others_weight is not None:
            w = np.full(len(y), float(args.others_weight))
            w[subset] = 1.0
            labels = replace(labels, weight=w)
    print(f"{len(y):,} candidates, {len(np.unique(labels.workload))} workloads, board {board}", flush=True)
    results: dict[str, Any] = {}
    for name in [v for v in args.variants if v in VARIANTS]:
        params = replace(TrainParams(), bag=args.bag, nthread=args.threads, **VARIANTS[name])
        if name == "near_best":
            params = replace(params, near_best_members=args.bag)
        cpu, wall = time.process_time(), time.perf_counter()
        ev = evaluate_splits(X, y, labels, params, splits=args.splits, folds=args.folds,
                             progress=lambda m, n=name: print(f"  {n}: {m}", file=sys.stderr, flush=True))
        results[name] = {s: {k: ev[s].get(k) for k in (*METRIC_KEYS, "folds", "rows", "workloads")}
                         for s in args.splits if ev[s]}
        if subset is not None:
            results[name]["score_on"] = {s: {k: v for k, v in score(
                y[subset], ev[s]["pred"][subset], labels.take(subset)).items() if k in METRIC_KEYS}
                for s in args.splits if ev[s]}
        results[name]["cpu_s"] = time.process_time() - cpu
        results[name]["wall_s"] = time.perf_counter() - wall
        results[name]["params"] = VARIANTS[name] | {"bag": args.bag, "others_weight": args.others_weight}
        print(f"{name}: {results[name]['cpu_s']:.0f} CPU s", flush=True)
    blends = [v for v in args.variants if v in BLENDS]
    if blends:
        cpu = time.process_time()
        results.update(blend_results(X, y, labels, blends, args.bag, args.threads, args.splits, args.folds))
        print(f"{', '.join(blends)}: {time.process_time() - cpu:.0f} CPU s together", flush=True)
    _print_tables(results, args.splits)
    if subset is not None:
        print(f"\nscored on the {len(subset):,} candidates of {args.score_on}'s workloads only")
        _print_tables({n: r["score_on"] for n, r in results.items() if "score_on" in r}, args.splits)
    if args.out:
        args.out.write_text(json.dumps({**_provenance(), "export": str(args.export),
                                        "board": board, "rows": int(len(y)), "results": results},
                                       indent=1) + "\n")
    return 0


def _print_tables(results: dict[str, Any], splits: list[str]) -> None:
    for split in splits:
        print(f"\n{split}")
        print(f"{'variant':<18}" + "".join(f"{SHORT[k]:>10}" for k in METRIC_KEYS))
        for name, res in results.items():
            m = res.get(split, {})
            print(f"{name:<18}" + "".join(f"{(m.get(k) if m.get(k) is not None else float('nan')):>10.4f}"
                                          for k in METRIC_KEYS))


if __name__ == "__main__":
    raise SystemExit(main())
