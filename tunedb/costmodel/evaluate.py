"""Held-out evaluation: GroupKFold by workload and leave-one-family-out, with baselines.

Every prediction scored here comes from a model that never saw the workload (or, for
leave-one-family-out, any workload of the family). Out-of-fold predictions are pooled and
scored once with the metrics of ``metrics.py``; the baselines are scored on the same rows:
``roofline`` (the analytic roofline feature as the prediction) and ``random`` (seeded).

Compile-time facts (registers, shared memory, spills) are hidden from the held-out rows by
default: the planner predicts candidates before compiling them.

Several boards of one device model: rows are (candidate, board); folds stay by workload (a
workload's rows on every board are held out together), while ``pairs`` (per-row labels, e.g.
workload|board) decides which rows the metrics compare: pairs, top-k and Spearman never mix two
boards' measurements. ``merge`` (per-row candidate labels) trains each fold on one row per
candidate, the median over its boards, and still scores every (candidate, board) row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.model_selection import GroupKFold

from tunedb.costmodel.features import MEASURED_FEATURES, ROOFLINE_FEATURE, UNKNOWN, feature_index
from tunedb.costmodel.metrics import (  # noqa: F401  (re-exported: the metric API lives here too)
    METRIC_KEYS,
    all_metrics,
    mape,
    pairwise_accuracy,
    spearman,
    top_k_score,
)
from tunedb.costmodel.train import (
    TrainError,
    TrainParams,
    group_codes,
    predict_us,
    train_booster,
)


def hide_measured(X: np.ndarray) -> np.ndarray:
    """A copy of ``X`` with the compile-time facts set to unknown."""
    X = np.array(X, dtype=np.float32, copy=True)
    for name in MEASURED_FEATURES:
        X[:, feature_index(name)] = UNKNOWN
    return X


def baseline_predictions(X: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """Roofline time (µs) and a seeded random latency for every row."""
    rng = np.random.default_rng(seed)
    return {"roofline": X[:, feature_index(ROOFLINE_FEATURE)].astype(np.float64),
            "random": rng.lognormal(0.0, 1.0, len(X))}


def _predict_us(result: Any, X: np.ndarray) -> np.ndarray:
    return predict_us(result.booster, X, result.objective, result.calibration,
                      getattr(result, "calibration_floor", 0.0))


def _score(y: np.ndarray, groups: np.ndarray, pred: np.ndarray, pred_measured: np.ndarray | None,
           X: np.ndarray, seed: int, workloads: np.ndarray | None = None) -> dict[str, Any]:
    """Metrics over ``groups`` (the rows compared with each other); ``workloads`` counts them."""
    out: dict[str, Any] = all_metrics(y, pred, groups, seed=seed)
    if pred_measured is not None:
        out["with_measured"] = {
            "pairwise_accuracy": pairwise_accuracy(y, pred_measured, groups),
            "top1_score": top_k_score(y, pred_measured, groups, k=1, seed=seed),
        }
    out["baselines"] = {name: all_metrics(y, p, groups, seed=seed)
                        for name, p in baseline_predictions(X, seed).items()}
    out["rows"] = int(len(y))
    out["workloads"] = int(len(np.unique(groups if workloads is None else workloads)))
    return out


def merge_rows(rows: np.ndarray, merge: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row per ``merge`` label among ``rows`` and the median of ``y`` over the label's rows:
    a candidate measured on several boards becomes one training row (its features do not
    depend on the board)."""
    rows = np.asarray(rows)
    order = rows[np.lexsort((y[rows], merge[rows]))]
    _, counts = np.unique(merge[rows], return_counts=True)
    starts = np.cumsum(counts) - counts
    med = (y[order[starts + (counts - 1) // 2]] + y[order[starts + counts // 2]]) / 2.0
    return order[starts], med


def _held_out(X: np.ndarray, y: np.ndarray, groups: np.ndarray, splits: list[tuple[np.ndarray, np.ndarray]],
              params: TrainParams, hide: bool, pairs: np.ndarray | None = None,
              merge: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Out-of-fold predictions (µs): hidden compile facts, and as given."""
    pred = np.full(len(y), np.nan)
    pred_m = np.full(len(y), np.nan)
    for i, (tr, te) in enumerate(splits):
        fold = TrainParams.from_json({**params.to_json(), "seed": params.seed + i})
        if merge is not None:
            rows, y_tr = merge_rows(tr, merge, y)
            result = train_booster(X[rows], y_tr, groups[rows], fold)
        else:
            result = train_booster(X[tr], y[tr], groups[tr], fold,
                                   query=None if pairs is None else pairs[tr])
        pred_m[te] = _predict_us(result, X[te])
        pred[te] = _predict_us(result, hide_measured(X[te])) if hide else pred_m[te]
    return pred, pred_m


def _codes(labels: Any) -> np.ndarray | None:
    return None if labels is None else group_codes(labels)


def cross_validate(X: np.ndarray, latency_us: np.ndarray, groups: Any, params: TrainParams | None = None,
                   folds: int = 5, hide_measured_facts: bool = True, seed: int = 0,
                   pairs: Any = None, merge: Any = None) -> dict[str, Any]:
    """GroupKFold by workload: metrics of the pooled out-of-fold predictions (``pred``, µs per
    row), plus baselines. ``pairs`` and ``merge``: see the module's docstring."""
    params = params or TrainParams()
    X = np.asarray(X, dtype=np.float32)
    y = np.asarray(latency_us, dtype=np.float64)
    g = group_codes(groups)
    p, mg = _codes(pairs), _codes(merge)
    n_groups = len(np.unique(g))
    # Each training fold is split again for early stopping, so it needs two workloads.
    if n_groups < 3:
        raise TrainError(f"cross-validation needs at least 3 workloads, got {n_groups}")
    k = max(2, min(folds, n_groups))
    splits = list(GroupKFold(n_splits=k).split(X, groups=g))
    pred, pred_m = _held_out(X, y, g, splits, params, hide_measured_facts, p, mg)
    out = _score(y, g if p is None else p, pred, pred_m if hide_measured_facts else None, X, seed, g)
    out["pred"] = pred
    out["folds"] = k
    out["measured_facts"] = "hidden" if hide_measured_facts else "given"
    return out


def leave_one_family_out(X: np.ndarray, latency_us: np.ndarray, groups: Any, families: Any,
                         params: TrainParams | None = None, hide_measured_facts: bool = True,
                         seed: int = 0, pairs: Any = None, merge: Any = None) -> dict[str, Any]:
    """Train without each family in turn, score on it. Returns per-family metrics and the
    pooled metrics over all held-out families ({} when there is only one family)."""
    params = params or TrainParams()
    X = np.asarray(X, dtype=np.float32)
    y = np.asarray(latency_us, dtype=np.float64)
    g = group_codes(groups)
    p, mg = _codes(pairs), _codes(merge)
    cmp = g if p is None else p
    fam = np.asarray(families).astype(str)
    names = sorted(set(fam.tolist()))
    if len(names) < 2:
        return {}
    splits, held = [], []
    for name in names:
        te = np.flatnonzero(fam == name)
        tr = np.flatnonzero(fam != name)
        if len(np.unique(g[tr])) < 2:
            continue
        splits.append((tr, te))
        held.append(name)
    pred, pred_m = _held_out(X, y, g, splits, params, hide_measured_facts, p, mg)
    per_family = {}
    for name, (_, te) in zip(held, splits):
        m = all_metrics(y[te], pred[te], cmp[te], seed=seed)
        per_family[name] = {k: m[k] for k in METRIC_KEYS} | {"rows": int(len(te))}
    rows = np.concatenate([te for _, te in splits])
    given = pred_m[rows] if hide_measured_facts else None
    pooled = _score(y[rows], cmp[rows], pred[rows], given, X[rows], seed, g[rows])
    return {"families": per_family, "pooled": pooled}


def summary(cv: dict[str, Any]) -> dict[str, Any]:
    """The headline dict: METRIC_KEYS of the model, and the same for each baseline."""
    out: dict[str, Any] = {k: cv[k] for k in METRIC_KEYS}
    out["baselines"] = {name: {k: m[k] for k in METRIC_KEYS} for name, m in cv["baselines"].items()}
    return out
