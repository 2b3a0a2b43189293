"""Held-out evaluation on four splits, with baselines; any candidate kind.

Every prediction scored here comes from a model that never saw the rows' workload
(``by_workload``), nor any workload of the same op (``leave_op_out``), shape (``leave_shape_out``)
or family (``leave_family_out``). Each split is a GroupKFold over its label: ``folds`` folds, each
holding out whole ops (shapes, families) at once. The suite is a grid of ops x shapes, so a
workload held out by workload usually has a twin of the same op or shape in training; the other
three splits say how the model fares on a graph unlike the ones it learnt from.

Out-of-fold predictions are pooled and scored once with ``metrics.all_metrics``; the baselines
(``roofline``: the analytic roofline feature as the prediction; ``random``: seeded) are scored on
the same rows. Compile-time facts (registers, shared memory, spills) are hidden from the held-out
rows by default: the planner predicts candidates before compiling them.

``Labels`` carries what a kind must give per row: the workload, op, shape and family labels, the
rows compared with each other (``compare``: with several boards, workload|board, so that pairs,
top-k and Spearman never mix two boards' measurements), the p20/p80 spreads for decisive pairs,
and ``merge`` (per-row candidate labels: train each fold on one row per candidate, the median
over its boards, and still score every (candidate, board) row).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
    SMALL_DATA,
    TrainError,
    TrainParams,
    auto_threads,
    group_codes,
    predict_us,
    train_booster,
)

SPLITS: tuple[str, ...] = ("by_workload", "leave_op_out", "leave_shape_out", "leave_family_out")
# Which Labels field each split holds out together.
SPLIT_LABEL = {"by_workload": "workload", "leave_op_out": "op", "leave_shape_out": "shape",
               "leave_family_out": "family"}

# Suite workload names: <op>_<dims joined by x>[_<dtype>], e.g. add_layernorm_8192x128_f16.
_NAME = re.compile(r"^(?P<op>.+?)_(?P<shape>\d+(?:x\d+)+)(?:_(?P<dtype>[a-z][a-z0-9]*))?$")


def op_and_shape(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Op and shape labels from workload names (``<op>_<RxC>[_<dtype>]``). A name without that
    form is its own op and its own shape, so those splits hold it out like by_workload."""
    ops, shapes = [], []
    for name in names:
        m = _NAME.match(str(name))
        ops.append(m["op"] if m else str(name))
        shapes.append(m["shape"] if m else str(name))
    return np.asarray(ops, dtype=object), np.asarray(shapes, dtype=object)


@dataclass(frozen=True)
class Labels:
    """Per-row labels of an evaluation; arrays of one length. Only ``workload`` is required:
    a missing op, shape or family label skips that split."""

    workload: np.ndarray  # integer codes, as compare and merge; op, shape, family as text
    op: np.ndarray | None = None
    shape: np.ndarray | None = None
    family: np.ndarray | None = None
    compare: np.ndarray | None = None  # default: workload
    lo: np.ndarray | None = None  # p20 of the samples (decisive pairs)
    hi: np.ndarray | None = None  # p80
    merge: np.ndarray | None = None
    # Training weight of each row (times the trainer's own weights; default 1): a secondary
    # dataset's rows can count less. Scores ignore it.
    weight: np.ndarray | None = None

    @staticmethod
    def of(workload: Any, *, names: Sequence[str] | None = None, op: Any = None, shape: Any = None,
           family: Any = None, compare: Any = None, lo: Any = None, hi: Any = None,
           merge: Any = None, weight: Any = None) -> Labels:
        """Labels from any per-row arrays; op and shape from workload ``names`` unless given."""
        if names is not None and (op is None or shape is None):
            parsed = op_and_shape(names)
            op = parsed[0] if op is None else op
            shape = parsed[1] if shape is None else shape

        def codes(v: Any) -> np.ndarray | None:
            return None if v is None else group_codes(v)

        def floats(v: Any) -> np.ndarray | None:
            return None if v is None else np.asarray(v, dtype=np.float64).reshape(-1)

        def names_of(v: Any) -> np.ndarray | None:  # kept as text: tables are keyed by them
            return None if v is None else np.asarray([str(x) for x in v], dtype=object)

        lo_f, hi_f = floats(lo), floats(hi)
        if lo_f is None or hi_f is None or not (np.isfinite(lo_f).all() and np.isfinite(hi_f).all()):
            lo_f = hi_f = None
        out = Labels(group_codes(workload), names_of(op), names_of(shape), names_of(family),
                     codes(compare), lo_f, hi_f, codes(merge), floats(weight))
        n = len(out.workload)
        for name in ("op", "shape", "family", "compare", "lo", "hi", "merge", "weight"):
            v = getattr(out, name)
            if v is not None and len(v) != n:
                raise TrainError(f"{len(v)} {name} labels for {n} rows")
        return out

    @property
    def cmp(self) -> np.ndarray:
        return self.workload if self.compare is None else self.compare

    def take(self, rows: np.ndarray) -> Labels:
        def sub(v: np.ndarray | None) -> np.ndarray | None:
            return None if v is None else v[rows]
        return Labels(self.workload[rows], sub(self.op), sub(self.shape), sub(self.family),
                      sub(self.compare), sub(self.lo), sub(self.hi), sub(self.merge), sub(self.weight))


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


def split_folds(labels: Labels, split: str, folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train rows, held-out rows) of each fold of ``split``: GroupKFold over the split's label,
    at most ``folds`` folds; a fold whose training side holds fewer than 3 workloads (too few to
    early-stop on a workload split) is left out. [] when the split has no label or one value."""
    if split not in SPLIT_LABEL:
        raise TrainError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    key = getattr(labels, SPLIT_LABEL[split])
    if key is None or len(np.unique(key)) < 2:
        return []
    k = max(2, min(folds, len(np.unique(key))))
    out = []
    for tr, te in GroupKFold(n_splits=k).split(np.zeros(len(key)), groups=key):
        if len(np.unique(labels.workload[tr])) >= 3:
            out.append((tr, te))
    return out


def _fold_params(params: TrainParams, i: int) -> TrainParams:
    return TrainParams.from_json({**params.to_json(), "seed": params.seed + i})


# Per fold: (fold index, training rows, held-out rows) -> predictions of the held-out rows.
FoldPredict = Callable[[int, np.ndarray, np.ndarray], Sequence[np.ndarray]]


def out_of_fold(n_rows: int, parts: Sequence[tuple[np.ndarray, np.ndarray]], predict: FoldPredict,
                outputs: int = 1, workers: int = 1) -> list[np.ndarray]:
    """The fold loop of every kind: ``predict`` on each fold of ``parts`` (in ``workers``
    threads), its ``outputs`` arrays of held-out predictions pooled into arrays over all
    ``n_rows`` rows (NaN where no fold held the row out)."""
    pooled = [np.full(n_rows, np.nan) for _ in range(outputs)]

    def one(i: int) -> tuple[np.ndarray, Sequence[np.ndarray]]:
        tr, te = parts[i]
        return te, predict(i, tr, te)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for te, preds in pool.map(one, range(len(parts))):
            if len(preds) != outputs:
                raise TrainError(f"a fold gave {len(preds)} predictions, expected {outputs}")
            for out, p in zip(pooled, preds):
                out[te] = np.asarray(p, dtype=np.float64).reshape(-1)
    return pooled


def held_out(X: np.ndarray, y: np.ndarray, labels: Labels, splits: list[tuple[np.ndarray, np.ndarray]],
             params: TrainParams, hide: bool = True) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Out-of-fold predictions (µs; NaN on rows no fold held out): with compile facts hidden
    (when ``hide``) and as given; the objective of each fold's model. Folds train in parallel
    threads when each is small enough to train on one thread (XGBoost releases the GIL)."""
    objectives = [""] * len(splits)

    def predict(i: int, tr: np.ndarray, te: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fold = _fold_params(params, i)
        if labels.merge is not None:
            rows, y_tr = merge_rows(tr, labels.merge, y)
            result = train_booster(X[rows], y_tr, labels.workload[rows], fold)
        else:
            query = None if labels.compare is None else labels.compare[tr]
            weight = None if labels.weight is None else labels.weight[tr]
            result = train_booster(X[tr], y[tr], labels.workload[tr], fold, query=query, weight=weight)
        objectives[i] = result.objective
        given = _predict_us(result, X[te])
        return (_predict_us(result, hide_measured(X[te])) if hide else given), given

    small = all(len(tr) < SMALL_DATA for tr, _ in splits) and params.nthread <= 0
    workers = min(len(splits), auto_threads()) if small else 1
    pred, pred_m = out_of_fold(len(y), splits, predict, outputs=2, workers=workers)
    return pred, pred_m, objectives


def score(y: np.ndarray, pred: np.ndarray, labels: Labels, seed: int = 0,
          with_mape: bool = True) -> dict[str, float]:
    """``all_metrics`` over the rows compared together (``labels.cmp``), with decisive pairs
    judged by the labels' spreads when there are any."""
    return all_metrics(y, pred, labels.cmp, seed=seed, with_mape=with_mape, lo=labels.lo, hi=labels.hi)


def per_label(y: np.ndarray, pred: np.ndarray, labels: Labels, names: np.ndarray,
              seed: int = 0) -> dict[str, dict[str, Any]]:
    """METRIC_KEYS per value of ``names`` (e.g. each family), plus rows and workloads."""
    out = {}
    names = np.asarray(names).astype(str)
    for name in sorted(set(names.tolist())):
        rows = np.flatnonzero(names == name)
        m = score(y[rows], pred[rows], labels.take(rows), seed)
        out[name] = {k: m[k] for k in METRIC_KEYS} | {
            "rows": int(len(rows)), "workloads": int(len(np.unique(labels.workload[rows])))}
    return out


def _need_workloads(labels: Labels) -> None:
    # Each training fold is split again for early stopping, so it needs two workloads.
    n = len(np.unique(labels.workload))
    if n < 3:
        raise TrainError(f"held-out evaluation needs at least 3 workloads, got {n}")


def _split_result(y: np.ndarray, pred: np.ndarray, labels: Labels, split: str, folds: int, seed: int,
                  with_mape: bool = True) -> tuple[dict[str, Any], np.ndarray, Labels]:
    """The metrics of one split's pooled out-of-fold predictions, its counts, ``pred`` and (for
    ``leave_family_out``) ``families``; and the scored rows and their labels."""
    rows = np.flatnonzero(np.isfinite(pred))
    sub = labels.take(rows)
    res: dict[str, Any] = score(y[rows], pred[rows], sub, seed, with_mape)
    res.update(folds=folds, rows=int(len(rows)), workloads=int(len(np.unique(sub.workload))),
               held_out=SPLIT_LABEL[split], pred=pred)
    if split == "leave_family_out" and labels.family is not None:
        res["families"] = per_label(y[rows], pred[rows], sub, labels.family[rows], seed)
    return res, rows, sub


def evaluate_split(X: np.ndarray, latency_us: np.ndarray, labels: Labels, split: str = "by_workload",
                   params: TrainParams | None = None, folds: int = 5, hide_measured_facts: bool = True,
                   seed: int = 0) -> dict[str, Any]:
    """One split: its metrics on the pooled out-of-fold predictions, the same metrics with
    compile facts given (``with_measured``), folds, rows and workloads scored, the objective of
    each fold, ``pred`` (µs per row, NaN where not held out) and, for ``leave_family_out``,
    ``families``. {} when the split does not apply (no label, or a single value)."""
    params = params or TrainParams()
    X = np.asarray(X, dtype=np.float32)
    y = np.asarray(latency_us, dtype=np.float64)
    parts = split_folds(labels, split, folds)
    if not parts:
        return {}
    pred, pred_m, objectives = held_out(X, y, labels, parts, params, hide_measured_facts)
    out, rows, sub = _split_result(y, pred, labels, split, len(parts), seed)
    if hide_measured_facts:
        given = score(y[rows], pred_m[rows], sub, seed)
        out["with_measured"] = {k: given[k] for k in METRIC_KEYS}
    out.update(fold_objectives=objectives, measured_facts="hidden" if hide_measured_facts else "given")
    return out


# fit(train rows) -> predict(held-out rows) -> µs (or any cost, lower is faster), per row.
FoldFit = Callable[[np.ndarray], Callable[[np.ndarray], np.ndarray]]


def evaluate_fits(fit: FoldFit, latency_us: np.ndarray, labels: Labels, splits: Sequence[str] = SPLITS,
                  folds: int = 5, seed: int = 0, with_mape: bool = True) -> dict[str, Any]:
    """The four splits for any model kind: ``fit`` trains on a fold's training rows (indices
    into ``latency_us`` and ``labels``) and returns a predictor of the held-out rows. Each split
    holds METRIC_KEYS (and the counts ``evaluate_split`` gives) and ``pred``; a split that does
    not apply is {}. ``leave_family_out`` also holds ``families``. ``with_mape=False`` for a
    predictor whose output is a score, not a latency."""
    y = np.asarray(latency_us, dtype=np.float64)
    _need_workloads(labels)
    out: dict[str, Any] = {}
    for split in splits:
        parts = split_folds(labels, split, folds)
        if not parts:
            out[split] = {}
            continue
        (pred,) = out_of_fold(len(y), parts, lambda _i, tr, te: (fit(tr)(te),))
        out[split] = _split_result(y, pred, labels, split, len(parts), seed, with_mape)[0]
    return out


def baselines(X: np.ndarray, latency_us: np.ndarray, labels: Labels, seed: int = 0) -> dict[str, Any]:
    """The metrics of the roofline and random predictors on every row."""
    y = np.asarray(latency_us, dtype=np.float64)
    return {name: score(y, p, labels, seed)
            for name, p in baseline_predictions(np.asarray(X, dtype=np.float32), seed).items()}


def evaluate_splits(X: np.ndarray, latency_us: np.ndarray, labels: Labels, params: TrainParams | None = None,
                    splits: Sequence[str] = SPLITS, folds: int = 5, hide_measured_facts: bool = True,
                    seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every split of ``splits`` (``evaluate_split``; a split that does not apply is {}), and
    ``baselines``. ``leave_family_out`` also holds ``families``: the metrics of each family."""
    say = progress or (lambda _msg: None)
    y = np.asarray(latency_us, dtype=np.float64)
    _need_workloads(labels)
    out: dict[str, Any] = {}
    for split in splits:
        say(f"held out: {split} ({folds} folds)")
        out[split] = evaluate_split(X, y, labels, split, params, folds, hide_measured_facts, seed)
    out["baselines"] = baselines(X, y, labels, seed)
    return out


def cross_validate(X: np.ndarray, latency_us: np.ndarray, groups: Any, params: TrainParams | None = None,
                   folds: int = 5, hide_measured_facts: bool = True, seed: int = 0,
                   pairs: Any = None, merge: Any = None, lo: Any = None, hi: Any = None) -> dict[str, Any]:
    """GroupKFold by workload (the ``by_workload`` split) with the baselines on the same rows;
    ``lo``/``hi``: per-row p20/p80 for the decisive pairs."""
    labels = Labels.of(groups, compare=pairs, merge=merge, lo=lo, hi=hi)
    _need_workloads(labels)
    out = evaluate_split(X, latency_us, labels, "by_workload", params, folds, hide_measured_facts, seed)
    out["baselines"] = baselines(X, latency_us, labels, seed)
    return out


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """One split's headline dict: its METRIC_KEYS (and the baselines' when it holds them)."""
    out: dict[str, Any] = {k: result[k] for k in METRIC_KEYS}
    if "baselines" in result:
        out["baselines"] = {name: {k: m[k] for k in METRIC_KEYS} for name, m in result["baselines"].items()}
    return out
