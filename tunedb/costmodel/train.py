"""XGBoost training: regression on log latency and ranking within workloads; keep the better.

Rows are split by workload (GroupShuffleSplit) into train and validation, never at random:
the model is always judged on workloads it has not seen. Each objective early-stops on the
validation set; the winner is the one with the higher validation pairwise accuracy (near-ties,
within ``rank_margin``, go to regression, whose output is a latency the planner can compare
across workloads).

A ranking model's score is only meaningful within a workload; to still answer in microseconds
it carries a calibration ``log(us) = a * cost + b + c * log(floor_us + 2.5)`` fitted on its
training rows (``calibration_base``: constant within a workload, so the order is the model's).

Regression learns ``log(us) - log(floor_us + 2.5)`` (target ``log_over_floor``): how far a
candidate is from its workload's floor. Removing the workload's scale leaves the trees to
spend their splits on what separates candidates of one workload (held-out pairwise accuracy
on the H200 data 0.878 -> 0.887); the same calibration form (a=1, b=0, c=1) adds the scale back.

The model is a bag of ``bag`` boosters, each early-stopped on its own workload split (different
seeds), averaged into one booster (``average_boosters``). On the H200 data five members of at
most 100 rounds took held-out pairwise accuracy from 0.881 to 0.892 and top-1 from 0.944 to 0.955
(a single booster at the same settings).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import xgboost as xgb
from sklearn.model_selection import GroupShuffleSplit

# Settings and booster merging live in their own modules; their names stay importable from here.
from tunedb.costmodel.boosters import average_boosters, combine_boosters
from tunedb.costmodel.errors import TrainError
from tunedb.costmodel.features import (
    MEASURED_FEATURES,
    UNKNOWN,
    WORKLOAD_LEVEL_FEATURES,
    feature_index,
)
from tunedb.costmodel.metrics import pairwise_accuracy
from tunedb.costmodel.params import (
    LARGE_DATA,
    LEVEL_ROUNDS,
    LEVEL_SETTINGS,
    MONOTONE,
    OBJECTIVES,
    RANKING,
    REGRESSION,
    SMALL_DATA,
    TARGETS,
    TrainParams,
    auto_threads,
)

__all__ = [
    "LARGE_DATA", "MONOTONE", "OBJECTIVES", "RANKING", "REGRESSION", "SMALL_DATA", "TARGETS", "TrainError",
    "TrainParams", "TrainResult", "auto_threads", "average_boosters", "calibration_base", "combine_boosters",
    "group_codes", "mask_measured", "predict_margin", "predict_us", "row_weights", "split_by_group",
    "to_cost", "top_weights", "train_booster",
]


@dataclass
class TrainResult:
    booster: xgb.Booster
    objective: str
    best_iteration: int
    # log(us) = a * cost + b + c * calibration_base(X), where cost is the booster's margin
    # (negated for ranking models) and c is ``calibration_floor``.
    calibration: tuple[float, float]
    valid_metrics: dict[str, float]
    tried: dict[str, dict[str, float]] = field(default_factory=dict)
    n_train: int = 0
    n_valid: int = 0
    calibration_floor: float = 0.0
    # Best round of every bag member (the first is ``best_iteration``).
    best_iterations: list[int] = field(default_factory=list)
    # Best round of every level member (target "log_over_best"; their trees come last).
    level_iterations: list[int] = field(default_factory=list)


def group_codes(groups: Any) -> np.ndarray:
    """Integer codes 0..G-1 for any per-row group labels (workload hashes, names, ints), in
    the sorted order of the labels, so that splits do not depend on the order of the rows."""
    if isinstance(groups, (pa.Array, pa.ChunkedArray)):
        arr = groups
    else:
        g = groups if isinstance(groups, np.ndarray) else np.asarray(groups, dtype=object)
        if g.dtype.kind in "iub":
            return np.unique(g, return_inverse=True)[1].reshape(-1).astype(np.int64)
        flat = g.astype(object).reshape(-1)
        try:
            arr = pa.array(flat)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed label types: compare as text
            arr = pa.array([str(v) for v in flat])
    # Strings: Arrow's hash table, then sort only the distinct labels (NumPy sorting 1M
    # strings took seconds).
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if not pa.types.is_string(arr.type) and not pa.types.is_large_string(arr.type):
        arr = pa.array([str(v) for v in arr.to_pylist()])
    enc = arr.dictionary_encode()
    labels = np.asarray(enc.dictionary.to_pylist(), dtype=object)
    rank = np.empty(len(labels), dtype=np.int64)
    rank[np.argsort(labels, kind="stable")] = np.arange(len(labels))
    return rank[enc.indices.to_numpy(zero_copy_only=False)]


def split_by_group(groups: np.ndarray, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, validation rows), whole workloads on each side."""
    n_groups = len(np.unique(groups))
    if n_groups < 2:
        raise TrainError(f"need at least 2 workloads to hold some out, got {n_groups}")
    split = GroupShuffleSplit(n_splits=1, test_size=valid_fraction, random_state=seed)
    tr, va = next(split.split(np.zeros(len(groups)), groups=groups))
    return tr, va


def mask_measured(X: np.ndarray, fraction: float, seed: int) -> None:
    """Hide the compile-time facts of a random ``fraction`` of rows, in place."""
    if fraction <= 0:
        return
    rows = np.random.default_rng(seed).random(len(X)) < fraction
    for name in MEASURED_FEATURES:
        X[rows, feature_index(name)] = UNKNOWN


def _relevance(log_us: np.ndarray, groups: np.ndarray, bin_width: float = 0.0) -> np.ndarray:
    """Ranking label: how much faster than the workload's slowest candidate, in log units; with
    ``bin_width``, in whole steps of log(1 + bin_width) from the workload's best, so that
    candidates in one step share a label and form no pair."""
    if bin_width > 0:
        log_us = np.floor((log_us - _group_min(log_us, groups)) / np.log1p(bin_width))
    worst = np.full(groups.max() + 1, -np.inf)
    np.maximum.at(worst, groups, log_us)
    return (worst[groups] - log_us).astype(np.float32)


def top_weights(label: np.ndarray, groups: np.ndarray, scale: float) -> np.ndarray | None:
    """Row weights 0.1 + exp(-gap / scale) from log-latency labels (any per-workload offset
    cancels): gap = latency / best latency of the row's group - 1. None when ``scale`` is 0."""
    if scale <= 0:
        return None
    best = np.full(groups.max() + 1, np.inf)
    np.minimum.at(best, groups, label)
    gap = np.expm1(label - best[groups])
    return (0.1 + np.exp(-gap / scale)).astype(np.float32)


def row_weights(label: np.ndarray, groups: np.ndarray, params: TrainParams) -> np.ndarray | None:
    """Regression row weights: the top weights times the workload balance (None: unweighted)."""
    w = top_weights(label, groups, params.top_weight)
    alpha = float(params.workload_balance)
    if alpha > 0 and len(groups):
        per_row = np.bincount(groups)[groups].astype(np.float64) ** -alpha
        per_row /= per_row.mean()
        w = per_row.astype(np.float32) if w is None else (w * per_row).astype(np.float32)
    return w


def to_cost(margin: np.ndarray, objective: str) -> np.ndarray:
    """Booster margin -> a cost where lower is faster (ranking scores rise with speed)."""
    return margin if objective == REGRESSION else -margin


def calibration_base(X: np.ndarray) -> np.ndarray:
    """log(floor time + one launch): the workload's scale, the same for all its candidates."""
    return np.log(np.asarray(X, dtype=np.float64)[:, feature_index("floor_us")] + 2.5)


def _calibrate(cost: np.ndarray, log_us: np.ndarray, base: np.ndarray) -> tuple[float, float, float]:
    """Least squares of log latency on (cost, workload scale, 1)."""
    A = np.stack([cost.astype(np.float64), base, np.ones(len(cost))], axis=1)
    (a, c, b), *_ = np.linalg.lstsq(A, log_us, rcond=None)
    if a > 1e-6:
        return float(a), float(b), float(c)
    # The calibration must keep the model's order; a flat or inverted fit keeps it barely.
    c, b = np.polyfit(base, log_us, 1)
    return 1e-6, float(b), float(c)


def predict_us(booster: xgb.Booster, X: np.ndarray, objective: str, calibration: Any,
               calibration_floor: float = 0.0) -> np.ndarray:
    """Latency in µs from a booster and its calibration (what ``CostModel.predict`` does)."""
    a, b = calibration
    log_us = float(a) * to_cost(predict_margin(booster, X), objective) + float(b)
    if calibration_floor:
        log_us = log_us + float(calibration_floor) * calibration_base(X)
    return np.exp(log_us)


def _fit_one(objective: str, params: TrainParams, Xtr: np.ndarray, ytr: np.ndarray, gtr: np.ndarray,
             Xva: np.ndarray, yva: np.ndarray, gva: np.ndarray, profile_rows: int,
             extra: tuple[np.ndarray | None, np.ndarray | None] = (None, None)) -> tuple[xgb.Booster, int]:
    """One early-stopped booster; ``profile_rows`` picks the settings (a subsample that
    compares objectives is trained like the full data it stands for); ``extra``: per-row
    weight multipliers of the training and validation rows (regression only)."""
    rank = objective != REGRESSION
    xp = params.xgb_params(objective, profile_rows)
    if len(Xtr) < SMALL_DATA and params.nthread <= 0:
        xp["nthread"] = 1
    threads = int(xp.get("nthread", -1))
    # Ranking objectives weigh whole queries, not rows: top weights apply to regression only.
    wtr = None if rank else _times(row_weights(ytr, gtr, params), extra[0])
    wva = None if rank else _times(row_weights(yva, gva, params), extra[1])
    dtr = xgb.QuantileDMatrix(Xtr, label=_relevance(ytr, gtr, params.rank_bin) if rank else ytr, weight=wtr,
                              qid=gtr if rank else None, max_bin=xp["max_bin"], nthread=threads)
    dva = xgb.QuantileDMatrix(Xva, label=_relevance(yva, gva, params.rank_bin) if rank else yva, weight=wva,
                              qid=gva if rank else None, ref=dtr, max_bin=xp["max_bin"], nthread=threads)
    large = profile_rows >= LARGE_DATA
    rounds = min(params.num_boost_round, params.large_data_rounds) if large else params.num_boost_round
    patience = min(params.early_stopping_rounds, params.large_data_early_stopping) if large \
        else params.early_stopping_rounds
    booster = xgb.train(xp, dtr, num_boost_round=rounds,
                        evals=[(dva, "valid")], early_stopping_rounds=patience,
                        verbose_eval=False)
    best = int(getattr(booster, "best_iteration", booster.num_boosted_rounds() - 1))
    # Keep only the trees up to the best round, so that the saved model needs no range.
    return booster[: best + 1], best


def predict_margin(booster: xgb.Booster, X: np.ndarray) -> np.ndarray:
    return np.asarray(booster.inplace_predict(np.asarray(X, dtype=np.float32), predict_type="margin"),
                      dtype=np.float64).reshape(-1)


def _split(g_all: np.ndarray, q_all: np.ndarray, X: np.ndarray, label: np.ndarray, params: TrainParams,
           seed: int) -> tuple[np.ndarray, ...]:
    """Train and validation sides of one workload split (``g_all``), rows sorted by query
    (``q_all``: ranking needs rows grouped by query), compile facts hidden at random, dense
    0..Q-1 query codes per side."""
    tr, va = split_by_group(g_all, params.valid_fraction, seed)
    tr = tr[np.argsort(q_all[tr], kind="stable")]
    va = va[np.argsort(q_all[va], kind="stable")]
    Xtr, Xva = X[tr], X[va]
    mask_measured(Xtr, params.mask_measured, seed)
    mask_measured(Xva, params.mask_measured, seed + 1)
    return Xtr, label[tr], _dense(q_all[tr]), Xva, label[va], _dense(q_all[va]), tr, va


def train_booster(X: np.ndarray, latency_us: np.ndarray, groups: Any,
                  params: TrainParams | None = None, query: Any = None, weight: Any = None) -> TrainResult:
    """Train on features ``X`` (float32), measured latencies (µs) and per-row workload labels.

    ``query`` (per-row labels, default ``groups``) names the rows that are compared with each
    other: with several boards of one device model, (workload, board), so that the ranking
    objective and the validation pairs never set a candidate on one board against one on
    another board. Splits stay by workload (``groups``): a workload's rows on every board fall
    on the same side. ``weight`` (per row, default 1) multiplies the regression row weights:
    how much a row of a secondary dataset counts next to the primary one."""
    params = params or TrainParams()
    X = np.asarray(X, dtype=np.float32)
    y = np.asarray(latency_us, dtype=np.float64).reshape(-1)
    if X.ndim != 2 or len(X) != len(y):
        raise TrainError(f"features {X.shape} do not match {len(y)} latencies")
    if not np.all(np.isfinite(y) & (y > 0)):
        raise TrainError("latencies must be finite and positive (filter failed measurements first)")
    g_all = group_codes(groups)
    if len(g_all) != len(y):
        raise TrainError(f"{len(g_all)} group labels for {len(y)} rows")
    q_all = g_all if query is None else group_codes(query)
    if len(q_all) != len(y):
        raise TrainError(f"{len(q_all)} query labels for {len(y)} rows")
    w_all = None if weight is None else np.asarray(weight, dtype=np.float32).reshape(-1)
    if w_all is not None and (len(w_all) != len(y) or not np.all(np.isfinite(w_all) & (w_all >= 0))):
        raise TrainError(f"weight must hold a finite value >= 0 for each of the {len(y)} rows")
    log_y = np.log(y)
    # The floor offset is constant within a workload: ranking labels and pairwise accuracy are
    # the same with or without it, so every objective trains on the same label.
    offset = np.zeros(len(y)) if params.target == "log_us" else calibration_base(X)
    label = log_y - offset
    # log_over_best: the bag learns each candidate's distance from its workload's best (no tree
    # spends a split on the workload's scale), the level members that scale from the workload.
    level = _group_min(label, q_all) if params.target == "log_over_best" else None
    if level is not None:
        label = label - level
    Xtr, ltr, gtr, Xva, lva, gva, tr, va = _split(g_all, q_all, X, label, params, params.seed)
    n_bag = int(params.large_data_bag if len(tr) >= LARGE_DATA else params.bag)
    rounds = params.num_boost_round if n_bag == 1 else min(params.num_boost_round, params.bag_rounds)
    fit = replace(params, num_boost_round=rounds)

    objectives = [REGRESSION, *params.rank_objectives] if params.objective == "auto" else [params.objective]
    tried: dict[str, dict[str, float]] = {}
    best: tuple[float, str, xgb.Booster, int] | None = None
    # On big data the objectives are compared on a workload subsample and only the winner is
    # trained on everything: the comparison needs a fair race, not the full data.
    subsample = len(objectives) > 1 and len(tr) > params.select_rows
    a_tr = _workload_subset(gtr, params.select_rows, params.seed) if subsample else None
    a_va = _workload_subset(gva, int(params.select_rows * params.valid_fraction), params.seed + 1) \
        if subsample else None
    for obj in objectives:
        booster, it = _fit_one(obj, fit, _rows(Xtr, a_tr), _rows(ltr, a_tr), _dense(_rows(gtr, a_tr)),
                               _rows(Xva, a_va), _rows(lva, a_va), _dense(_rows(gva, a_va)), len(tr),
                               (_rows(_rows(w_all, tr), a_tr), _rows(_rows(w_all, va), a_va)))
        pred = to_cost(predict_margin(booster, _rows(Xva, a_va)), obj)
        acc = pairwise_accuracy(_rows(lva, a_va), pred, _rows(gva, a_va))
        tried[obj] = {"pairwise_accuracy": acc, "best_iteration": float(it),
                      "train_rows": float(len(tr) if a_tr is None else len(a_tr))}
        # Regression is tried first and wins near-ties: it answers in microseconds that compare
        # across workloads (a ranking model's calibrated times are rough), and one validation
        # split measures pairwise accuracy only to about a percent.
        if best is None or acc > best[0] + params.rank_margin:
            best = (acc, obj, booster, it)
    assert best is not None
    acc, obj, booster, it = best
    if a_tr is not None or a_va is not None:
        booster, it = _fit_one(obj, fit, Xtr, ltr, gtr, Xva, lva, gva, len(tr),
                               (_rows(w_all, tr), _rows(w_all, va)))
        acc = pairwise_accuracy(lva, to_cost(predict_margin(booster, Xva), obj), gva)
    members, iterations = [booster], [it]
    for m in range(1, n_bag):
        # Another workload split and another seed per member: they differ where the data
        # leaves the answer open, and their average is steadier than any one of them.
        seed = params.seed + 7919 * m
        mXtr, mltr, mgtr, mXva, mlva, mgva, mtr, mva = _split(g_all, q_all, X, label, params, seed)
        b, i = _fit_one(obj, replace(fit, seed=seed), mXtr, mltr, mgtr, mXva, mlva, mgva, len(tr),
                        (_rows(w_all, mtr), _rows(w_all, mva)))
        members.append(b)
        iterations.append(i)
    if obj == REGRESSION:
        for m in range(int(params.near_best_members)):
            seed = params.seed + 104729 * (m + 1)
            near = _near_best(label, g_all, params.near_best_gap)
            mXtr, mltr, mgtr, mXva, mlva, mgva, mtr, mva = _split(
                g_all[near], q_all[near], X[near], label[near], params, seed)
            w_near = _rows(w_all, near)
            b, i = _fit_one(obj, replace(fit, seed=seed), mXtr, mltr, mgtr, mXva, mlva, mgva, len(tr),
                            (_rows(w_near, mtr), _rows(w_near, mva)))
            members.append(b)
            iterations.append(i)
    groups, level_its = [members], []
    if obj == REGRESSION and level is not None:
        fitted = [_fit_level(X, level, g_all, q_all, fit, params.seed + 15485863 * (m + 1))
                  for m in range(int(params.level_members))]
        groups.append([b for b, _ in fitted])
        level_its = [i for _, i in fitted]
    booster = combine_boosters(groups)
    if obj == REGRESSION:
        a, b0, c = 1.0, 0.0, (0.0 if params.target == "log_us" else 1.0)
    else:
        a, b0, c = _calibrate(to_cost(predict_margin(booster, Xtr), obj), log_y[tr], calibration_base(Xtr))
    return TrainResult(booster=booster, objective=obj, best_iteration=it, calibration=(a, b0),
                       valid_metrics={"pairwise_accuracy": acc}, tried=tried,
                       n_train=len(tr), n_valid=len(va), calibration_floor=c, best_iterations=iterations,
                       level_iterations=level_its)


def _group_min(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Per row: the least of ``values`` over its group."""
    best = np.full(groups.max() + 1, np.inf)
    np.minimum.at(best, groups, values)
    return best[groups]


def _fit_level(X: np.ndarray, level: np.ndarray, g_all: np.ndarray, q_all: np.ndarray, params: TrainParams,
               seed: int) -> tuple[xgb.Booster, int]:
    """A booster for the workload's level (``level``: one value per query) from its workload
    facts alone: one row per query, every other column missing, so no tree splits on it."""
    _, first = np.unique(q_all, return_index=True)
    cols = [feature_index(n) for n in WORKLOAD_LEVEL_FEATURES]
    Xw = np.full((len(first), X.shape[1]), np.nan, dtype=np.float32)
    Xw[:, cols] = X[first][:, cols]
    tr, va = split_by_group(g_all[first], params.valid_fraction, seed)
    lp = replace(params, seed=seed, num_boost_round=LEVEL_ROUNDS, early_stopping_rounds=50,
                 subsample=0.8, colsample_bytree=0.8, **LEVEL_SETTINGS)
    yl = level[first]
    return _fit_one(REGRESSION, lp, Xw[tr], yl[tr], np.arange(len(tr)), Xw[va], yl[va], np.arange(len(va)),
                    len(tr))


def _near_best(label: np.ndarray, groups: np.ndarray, gap: float) -> np.ndarray:
    """Rows whose latency is within 1 + ``gap`` of their group's best (labels in log units)."""
    best = np.full(groups.max() + 1, np.inf)
    np.minimum.at(best, groups, label)
    return np.flatnonzero(label <= best[groups] + np.log1p(gap))


def _rows(a: Any, idx: np.ndarray | None) -> Any:
    return a if idx is None or a is None else a[idx]


def _times(w: np.ndarray | None, extra: np.ndarray | None) -> np.ndarray | None:
    """Row weights times per-row multipliers (either may be None: all ones)."""
    if extra is None:
        return w
    return extra.astype(np.float32) if w is None else (w * extra).astype(np.float32)


def _dense(codes: np.ndarray) -> np.ndarray:
    """Sorted group codes -> 0..G-1 in the same order."""
    return np.unique(codes, return_inverse=True)[1].reshape(-1)


def _workload_subset(codes: np.ndarray, max_rows: int, seed: int) -> np.ndarray | None:
    """Rows of a random set of whole workloads holding about ``max_rows`` rows (in row order),
    or None when all rows fit anyway."""
    if len(codes) <= max_rows:
        return None
    counts = np.bincount(codes)
    order = np.random.default_rng(seed).permutation(len(counts))
    take = order[: max(2, int(np.searchsorted(np.cumsum(counts[order]), max_rows)) + 1)]
    return np.flatnonzero(np.isin(codes, take))
