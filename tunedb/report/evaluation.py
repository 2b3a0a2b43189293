"""Held-out predictions for the report, from the cost model's own evaluation
(``tunedb.costmodel.evaluate.evaluate_splits``): the same splits, training and scoring as
``tunedb train``, keeping the out-of-fold predictions for the plots, the per-family table and
the anchor cases. ``Evaluation.cv`` holds the by_workload split's metrics and baselines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tunedb.costmodel.evaluate import (
    METRIC_KEYS,
    SPLITS,
    Labels,
    baseline_predictions,
    evaluate_splits,
    per_label,
)
from tunedb.costmodel.train import TrainError, TrainParams
from tunedb.report.data import Dataset, ReportError

# Columns of the per-family table: the model's, and the roofline's on the same rows.
FAMILY_KEYS: tuple[str, ...] = (*METRIC_KEYS, "rows", "workloads")
FAMILY_BASELINE_KEYS: tuple[str, ...] = ("pairwise_accuracy", "top1_score", "mape")


@dataclass
class Evaluation:
    cv: dict[str, Any]  # the by_workload split: METRIC_KEYS, baselines, with_measured, counts
    pred_us: np.ndarray  # out-of-fold prediction per dataset row (compile facts hidden if asked)
    fold_objectives: list[str]
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    # leave_family_out as {"families": per family, "pooled": its metrics}; None without lofo
    lofo: dict[str, Any] | None = None
    # every split evaluated (METRIC_KEYS and counts, no predictions)
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)


def labels_of(ds: Dataset) -> Labels:
    """The evaluation labels of a report dataset (as ``fit.frame_labels`` for a training frame)."""
    t = ds.frame

    def floats(name: str) -> np.ndarray | None:
        return t[name].to_numpy(zero_copy_only=False).astype(np.float64) if name in t.column_names else None

    names = t["workload_name"].to_pylist() if "workload_name" in t.column_names else ds.groups
    return Labels.of(ds.groups, names=names, family=ds.families, lo=floats("p20_us"), hi=floats("p80_us"))


def _family_table(ds: Dataset, labels: Labels, pred: np.ndarray, seed: int) -> dict[str, dict[str, Any]]:
    mine = per_label(ds.y, pred, labels, ds.families, seed)
    roof = per_label(ds.y, baseline_predictions(ds.X, seed)["roofline"], labels, ds.families, seed)
    return {name: m | {"roofline": {k: roof[name][k] for k in FAMILY_BASELINE_KEYS}}
            for name, m in mine.items()}


def evaluate(ds: Dataset, params: TrainParams, folds: int = 5, seed: int = 0,
             hide_measured_facts: bool = True, lofo: bool = False) -> Evaluation:
    """Out-of-fold predictions and their metrics (by workload, per family, baselines); with
    ``lofo`` also the leave-op/shape/family-out splits."""
    labels = labels_of(ds)
    if len(np.unique(labels.workload)) < 3:
        raise ReportError(f"held-out evaluation needs at least 3 workloads on the device, "
                          f"got {len(np.unique(labels.workload))}")
    try:
        ev = evaluate_splits(ds.X, ds.y, labels, params, splits=SPLITS if lofo else ("by_workload",),
                             folds=folds, hide_measured_facts=hide_measured_facts, seed=seed)
    except TrainError as e:
        raise ReportError(f"held-out evaluation failed: {e}") from None
    by = ev["by_workload"]
    cv = {k: v for k, v in by.items() if k not in ("pred", "fold_objectives")}
    cv["baselines"] = ev["baselines"]
    out = Evaluation(cv, by["pred"], list(by["fold_objectives"]), _family_table(ds, labels, by["pred"], seed))
    out.splits = {s: {k: v for k, v in ev[s].items() if k not in ("pred", "families")}
                  for s in SPLITS if ev.get(s)}
    lfo = ev.get("leave_family_out")
    if lfo:
        out.lofo = {"families": lfo["families"], "pooled": out.splits["leave_family_out"]}
    return out


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
