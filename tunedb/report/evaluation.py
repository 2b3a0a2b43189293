"""Held-out predictions for the report: GroupKFold by workload, exactly as
``tunedb.costmodel.evaluate.cross_validate`` splits, trains and scores, but keeping the
out-of-fold predictions (which ``cross_validate`` does not return) for the plots, the
per-family table and the anchor cases. ``Evaluation.cv`` has ``cross_validate``'s keys and,
for the same inputs, its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.model_selection import GroupKFold

from tunedb.costmodel.evaluate import (
    METRIC_KEYS,
    all_metrics,
    baseline_predictions,
    hide_measured,
    leave_one_family_out,
    pairwise_accuracy,
    top_k_score,
)
from tunedb.costmodel.train import (
    TrainError,
    TrainParams,
    group_codes,
    predict_us,
    train_booster,
)
from tunedb.report.data import Dataset, ReportError

# Columns of the per-family table: the model's, and the roofline's on the same rows.
FAMILY_KEYS: tuple[str, ...] = (*METRIC_KEYS, "rows", "workloads")
FAMILY_BASELINE_KEYS: tuple[str, ...] = ("pairwise_accuracy", "top1_score", "mape")


@dataclass
class Evaluation:
    cv: dict[str, Any]  # cross_validate's result for the same data and parameters
    pred_us: np.ndarray  # out-of-fold prediction per dataset row (compile facts hidden if asked)
    fold_objectives: list[str]
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    lofo: dict[str, Any] | None = None


def _predict_us(result: Any, X: np.ndarray) -> np.ndarray:
    return predict_us(result.booster, X, result.objective, result.calibration,
                      getattr(result, "calibration_floor", 0.0))


def held_out(ds: Dataset, params: TrainParams, folds: int = 5, hide_measured_facts: bool = True
             ) -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """Out-of-fold predictions (µs): as scored (compile facts hidden if asked) and with the
    facts given; the objective each fold chose; the number of folds."""
    X = np.asarray(ds.X, dtype=np.float32)
    g = group_codes(ds.groups)
    n_groups = len(np.unique(g))
    # Each training fold is split again for early stopping, so it needs two workloads.
    if n_groups < 3:
        raise ReportError(f"held-out evaluation needs at least 3 workloads on the device, got {n_groups}")
    k = max(2, min(folds, n_groups))
    pred = np.full(len(ds.y), np.nan)
    pred_given = np.full(len(ds.y), np.nan)
    objectives = []
    for i, (tr, te) in enumerate(GroupKFold(n_splits=k).split(X, groups=g)):
        # The same per-fold seed as cross_validate, so that both give the same numbers.
        fold_params = TrainParams.from_json({**params.to_json(), "seed": params.seed + i})
        try:
            result = train_booster(X[tr], ds.y[tr], g[tr], fold_params)
        except TrainError as e:
            raise ReportError(f"training fold {i + 1} of {k} failed: {e}") from None
        objectives.append(result.objective)
        pred_given[te] = _predict_us(result, X[te])
        pred[te] = _predict_us(result, hide_measured(X[te])) if hide_measured_facts else pred_given[te]
    return pred, pred_given, objectives, k


def _family_table(ds: Dataset, pred: np.ndarray, seed: int) -> dict[str, dict[str, Any]]:
    g = group_codes(ds.groups)
    roof = baseline_predictions(ds.X, seed)["roofline"]
    out = {}
    for name in sorted(set(ds.families.tolist())):
        m = ds.families == name
        mine = all_metrics(ds.y[m], pred[m], g[m], seed=seed)
        base = all_metrics(ds.y[m], roof[m], g[m], seed=seed)
        out[name] = {k: mine[k] for k in METRIC_KEYS} | {
            "rows": int(m.sum()), "workloads": int(len(np.unique(g[m]))),
            "roofline": {k: base[k] for k in FAMILY_BASELINE_KEYS}}
    return out


def evaluate(ds: Dataset, params: TrainParams, folds: int = 5, seed: int = 0,
             hide_measured_facts: bool = True, lofo: bool = False) -> Evaluation:
    """Out-of-fold predictions and their metrics (overall, per family, baselines); with
    ``lofo`` also leave-one-family-out (a model that never saw the family)."""
    pred, pred_given, objectives, k = held_out(ds, params, folds, hide_measured_facts)
    g = group_codes(ds.groups)
    cv: dict[str, Any] = all_metrics(ds.y, pred, g, seed=seed)
    if hide_measured_facts:
        cv["with_measured"] = {
            "pairwise_accuracy": pairwise_accuracy(ds.y, pred_given, g),
            "top1_score": top_k_score(ds.y, pred_given, g, k=1, seed=seed),
        }
    cv["baselines"] = {name: all_metrics(ds.y, p, g, seed=seed)
                       for name, p in baseline_predictions(ds.X, seed).items()}
    cv["rows"] = int(len(ds.y))
    cv["workloads"] = int(len(np.unique(g)))
    cv["folds"] = k
    cv["measured_facts"] = "hidden" if hide_measured_facts else "given"
    ev = Evaluation(cv, pred, objectives, _family_table(ds, pred, seed))
    if lofo:
        try:
            ev.lofo = leave_one_family_out(ds.X, ds.y, ds.groups, ds.families, params,
                                           hide_measured_facts=hide_measured_facts, seed=seed) or None
        except TrainError as e:
            raise ReportError(f"leave-one-family-out failed: {e}") from None
    return ev


def anchor_picks(anchors: list[dict[str, Any]], ds: Dataset, pred: np.ndarray) -> None:
    """Add to each anchor case the measured latency of the candidate the held-out model ranks
    first (``model_pick_us``), and best / that (``model_pick_score``, the top-1 score)."""
    index = {h: i for i, h in enumerate(ds.frame["candidate_hash"].to_pylist())}
    for a in anchors:
        rows = [index[h] for h in a["candidate_hashes"] if h in index]
        if not rows or a["best_us"] is None:
            a["model_pick_us"] = a["model_pick_score"] = None
            continue
        pick = rows[int(np.argmin(pred[rows]))]
        a["model_pick_us"] = float(ds.y[pick])
        a["model_pick_score"] = a["best_us"] / float(ds.y[pick])
