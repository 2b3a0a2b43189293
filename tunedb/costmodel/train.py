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

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import xgboost as xgb
from sklearn.model_selection import GroupShuffleSplit

from tunedb.costmodel.errors import TrainError
from tunedb.costmodel.features import (
    FEATURE_NAMES,
    MEASURED_FEATURES,
    UNKNOWN,
    WORKLOAD_LEVEL_FEATURES,
    feature_index,
)
from tunedb.costmodel.metrics import pairwise_accuracy

REGRESSION = "reg:squarederror"
RANKING = ("rank:pairwise", "rank:ndcg")
OBJECTIVES: tuple[str, ...] = (REGRESSION, *RANKING)
TARGETS: tuple[str, ...] = ("log_over_floor", "log_us", "log_over_best")
# Below this many training rows one thread is faster than several: per-round synchronisation
# costs more than the histogram work it splits (and far more on a busy machine).
SMALL_DATA = 100_000
# From this many training rows on, ``large_data`` settings apply: shallower trees on half the
# rows and columns with a larger step, about six times less work for 1M rows (which then fit
# the one-minute budget on two cores) at little cost in accuracy, since data is plentiful.
LARGE_DATA = 300_000
# The level members of target "log_over_best" learn from one row per workload (hundreds of rows).
LEVEL_SETTINGS: dict[str, Any] = {"max_depth": 6, "eta": 0.1, "min_child_weight": 1.0}
LEVEL_ROUNDS = 500
# Direction of latency in a feature, all else equal (TrainParams.monotone): more bytes moved or a
# longer roofline time is never faster; more lanes busy or fuller waves never slower.
MONOTONE: dict[str, int] = {
    "traffic_ratio": 1, "extra_bytes": 1, "est_bytes": 1, "log2_est_bytes": 1, "roofline_us": 1,
    "log2_roofline_us": 1, "lane_utilization": -1, "wave_efficiency": -1}


def auto_threads() -> int:
    """Cores not busy with other work. XGBoost's threads spin while they wait for each other,
    so on a loaded machine one thread per idle core beats one per core by far (measured: 30
    rounds on 800k rows took 11 s with 2 threads and 5 s with 1 while another job ran)."""
    n = os.cpu_count() or 1
    try:
        others = max(0, round(os.getloadavg()[0]) - 1)  # the load includes this process
    except OSError:
        others = 0
    return max(1, min(n, n - others))


@dataclass(frozen=True)
class TrainParams:
    """Everything that decides a trained model; recorded on the model card."""

    objective: str = "auto"  # "auto" tries regression and the objectives in ``rank_objectives``
    rank_objectives: tuple[str, ...] = ("rank:pairwise",)
    device: str = "cpu"  # "cuda" passes through to xgboost
    # eta 0.2: a single booster is ~0.007 worse in held-out pairwise accuracy than at 0.1 on the
    # H200 data, but a bag of five is within 0.002 of five at 0.1 with half the trees (size, time).
    max_depth: int = 8
    eta: float = 0.2
    num_boost_round: int = 1000
    early_stopping_rounds: int = 50
    min_child_weight: float = 2.0
    subsample: float = 0.8
    colsample_bytree: float = 0.8
    reg_lambda: float = 1.0
    max_bin: int = 128
    nthread: int = 0  # 0: one thread below SMALL_DATA rows, else the idle cores (auto_threads)
    seed: int = 0
    valid_fraction: float = 0.2
    # Fraction of rows whose compile-time facts (registers, shared memory, spills) are hidden
    # in training, so that the model also predicts well before a candidate is compiled.
    mask_measured: float = 0.5
    rank_pairs_per_sample: int = 8
    # Ranking labels in steps of 1 + rank_bin from the workload's best (pairs closer than a
    # step, within the timing noise, are not trained on); 0: continuous labels.
    rank_bin: float = 0.0
    # How much higher validation pairwise accuracy a ranking objective needs to be kept. On
    # the H200 data one validation split put ranking 0.008 ahead while 5-fold CV had the two
    # within 0.003, and the ranking model's calibrated times were 3.5x less accurate (MAPE).
    rank_margin: float = 0.01
    # "auto" compares the objectives on at most about this many training rows (whole workloads).
    select_rows: int = 100_000
    large_data: tuple[tuple[str, float], ...] = (
        ("max_depth", 7), ("eta", 0.3), ("subsample", 0.5), ("colsample_bytree", 0.5), ("max_bin", 64))
    large_data_rounds: int = 150
    large_data_early_stopping: int = 20
    # "log_over_floor": regression on log(us / (floor_us + 2.5)); "log_us": on log(us);
    # "log_over_best": the bag on log(us / best us of the workload) plus ``level_members``
    # boosters on the workload's facts alone for log(best / (floor_us + 2.5)), summed into one
    # booster (see train_booster).
    target: str = "log_over_floor"
    level_members: int = 5
    # Boosters averaged into the model; from LARGE_DATA rows on, ``large_data_bag`` (the
    # one-minute budget for 1M rows has room for one, and big data has less variance to average).
    bag: int = 5
    large_data_bag: int = 1
    # Round cap of each member when there are several. At 100 every member of the H200 card
    # stopped at the cap; 200 (a 6.8 MB model file, 1.7x the training) gave held out by
    # workload top-1 0.968 -> 0.969, decisive pairs 0.916 -> 0.922, the pick within 2 %
    # 0.575 -> 0.584, by op 0.962 -> 0.963; 300 a little more for 2.6x (docs/costmodel-metrics.md).
    bag_rounds: int = 200
    # Regression row weights 0.1 + exp(-gap / top_weight), gap = latency / best of its workload
    # - 1: the fast end of each workload, where the planner picks, weighs most. 0: unweighted.
    # On the H200 data 0.1 lifted top-1 on all four held-out splits (by workload 0.964 -> 0.968,
    # op 0.953 -> 0.962, shape 0.946 -> 0.948, family 0.872 -> 0.893) and the pick within 2 % of
    # the best (0.51 -> 0.57 by workload), for -0.003 pairwise by workload.
    top_weight: float = 0.1
    # Regression row weights also times n ** -workload_balance (n: the rows of the row's
    # workload and board), rescaled to a mean of 1: the metrics are means over workloads, while
    # unbalanced rows let the workloads with most candidates steer the loss. 0: off, 1: equal.
    workload_balance: float = 0.0
    # Extra regression members trained only on each workload's near-best candidates (latency
    # within 1 + ``near_best_gap`` of its best), averaged in with the bag: they spend every
    # split on telling the fast candidates apart. 0: none.
    near_best_members: int = 0
    near_best_gap: float = 0.3
    # Regression only: latency may not fall as the estimated traffic or roofline time grows, nor
    # rise as lane use or wave efficiency grows (MONOTONE), where the rest of the row is equal.
    monotone: bool = False

    def __post_init__(self) -> None:
        # Accept the JSON forms (lists, a dict) too: the fields stay hashable tuples.
        ld = self.large_data.items() if isinstance(self.large_data, dict) else self.large_data
        object.__setattr__(self, "large_data", tuple((str(k), v) for k, v in ld))
        object.__setattr__(self, "rank_objectives", tuple(self.rank_objectives))
        if self.objective != "auto" and self.objective not in OBJECTIVES:
            raise TrainError(f"unknown objective {self.objective!r}; expected auto or one of {OBJECTIVES}")
        bad = [o for o in self.rank_objectives if o not in RANKING]
        if bad:
            raise TrainError(f"unknown ranking objective {bad[0]!r}; expected one of {RANKING}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise TrainError(f"device must be cpu or cuda, got {self.device!r}")
        if not 0.0 < self.valid_fraction < 1.0:
            raise TrainError(f"valid_fraction must be in (0, 1), got {self.valid_fraction}")
        if self.target not in TARGETS:
            raise TrainError(f"unknown target {self.target!r}; expected one of {TARGETS}")
        if not 0.0 <= float(self.top_weight) < float("inf"):
            raise TrainError(f"top_weight must be 0 (off) or a positive gap scale, got {self.top_weight}")
        if not 0.0 <= float(self.workload_balance) <= 1.0:
            raise TrainError(f"workload_balance must be in [0, 1], got {self.workload_balance}")
        if int(self.near_best_members) < 0 or not float(self.near_best_gap) > 0:
            raise TrainError(f"near_best_members must be >= 0 and near_best_gap > 0, got "
                             f"{self.near_best_members} and {self.near_best_gap}")
        if not 0.0 <= float(self.rank_bin) < 1.0:
            raise TrainError(f"rank_bin must be in [0, 1), got {self.rank_bin}")
        if int(self.level_members) < 1:
            raise TrainError(f"level_members must be at least 1, got {self.level_members}")
        if int(self.bag) < 1 or int(self.large_data_bag) < 1 or int(self.bag_rounds) < 1:
            raise TrainError(f"bag, large_data_bag and bag_rounds must be at least 1, got {self.bag}, "
                             f"{self.large_data_bag} and {self.bag_rounds}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rank_objectives"] = list(self.rank_objectives)
        d["large_data"] = {k: v for k, v in self.large_data}
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> TrainParams:
        known = set(TrainParams.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in known}
        return TrainParams(**kw)

    def xgb_params(self, objective: str, n_rows: int | None = None) -> dict[str, Any]:
        """XGBoost's parameters for ``n_rows`` training rows (see SMALL_DATA, LARGE_DATA)."""
        p: dict[str, Any] = {
            "objective": objective, "tree_method": "hist", "device": self.device,
            "max_depth": self.max_depth, "eta": self.eta, "min_child_weight": self.min_child_weight,
            "subsample": self.subsample, "colsample_bytree": self.colsample_bytree,
            "lambda": self.reg_lambda, "max_bin": self.max_bin, "seed": self.seed,
        }
        if n_rows is not None and n_rows >= LARGE_DATA:
            p.update({k: (int(v) if k in ("max_depth", "max_bin") else float(v)) for k, v in self.large_data})
        if self.nthread > 0:
            p["nthread"] = self.nthread
        elif n_rows is not None and n_rows < SMALL_DATA:
            p["nthread"] = 1
        elif n_rows is not None:
            p["nthread"] = auto_threads()
        if objective == REGRESSION:
            p["eval_metric"] = "rmse"
            if self.monotone:
                signs = ",".join(str(MONOTONE.get(n, 0)) for n in FEATURE_NAMES)
                p["monotone_constraints"] = f"({signs})"
        else:
            # Labels are continuous relevances (log-latency gaps); exponential gain needs ints.
            p.update(eval_metric="ndcg", ndcg_exp_gain=False,
                     lambdarank_num_pair_per_sample=self.rank_pairs_per_sample)
            if objective == "rank:pairwise":
                p["lambdarank_pair_method"] = "mean"
        return p


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
             Xva: np.ndarray, yva: np.ndarray, gva: np.ndarray, profile_rows: int) -> tuple[xgb.Booster, int]:
    """One early-stopped booster; ``profile_rows`` picks the settings (a subsample that
    compares objectives is trained like the full data it stands for)."""
    rank = objective != REGRESSION
    xp = params.xgb_params(objective, profile_rows)
    if len(Xtr) < SMALL_DATA and params.nthread <= 0:
        xp["nthread"] = 1
    threads = int(xp.get("nthread", -1))
    # Ranking objectives weigh whole queries, not rows: top weights apply to regression only.
    wtr = None if rank else row_weights(ytr, gtr, params)
    wva = None if rank else row_weights(yva, gva, params)
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
                  params: TrainParams | None = None, query: Any = None) -> TrainResult:
    """Train on features ``X`` (float32), measured latencies (µs) and per-row workload labels.

    ``query`` (per-row labels, default ``groups``) names the rows that are compared with each
    other: with several boards of one device model, (workload, board), so that the ranking
    objective and the validation pairs never set a candidate on one board against one on
    another board. Splits stay by workload (``groups``): a workload's rows on every board fall
    on the same side."""
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
                               _rows(Xva, a_va), _rows(lva, a_va), _dense(_rows(gva, a_va)), len(tr))
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
        booster, it = _fit_one(obj, fit, Xtr, ltr, gtr, Xva, lva, gva, len(tr))
        acc = pairwise_accuracy(lva, to_cost(predict_margin(booster, Xva), obj), gva)
    members, iterations = [booster], [it]
    for m in range(1, n_bag):
        # Another workload split and another seed per member: they differ where the data
        # leaves the answer open, and their average is steadier than any one of them.
        seed = params.seed + 7919 * m
        mXtr, mltr, mgtr, mXva, mlva, mgva, _, _ = _split(g_all, q_all, X, label, params, seed)
        b, i = _fit_one(obj, replace(fit, seed=seed), mXtr, mltr, mgtr, mXva, mlva, mgva, len(tr))
        members.append(b)
        iterations.append(i)
    if obj == REGRESSION:
        for m in range(int(params.near_best_members)):
            seed = params.seed + 104729 * (m + 1)
            near = _near_best(label, g_all, params.near_best_gap)
            mXtr, mltr, mgtr, mXva, mlva, mgva, _, _ = _split(g_all[near], q_all[near], X[near], label[near],
                                                              params, seed)
            b, i = _fit_one(obj, replace(fit, seed=seed), mXtr, mltr, mgtr, mXva, mlva, mgva, len(tr))
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


def _leaf_scaled(tree: dict[str, Any], factor: float) -> dict[str, Any]:
    """A tree of XGBoost's JSON model with every leaf value (and node weight) times ``factor``."""
    t = dict(tree)
    leaf = [child == -1 for child in t["left_children"]]
    t["split_conditions"] = [v * factor if is_leaf else v for v, is_leaf in zip(t["split_conditions"], leaf)]
    t["base_weights"] = [v * factor for v in t["base_weights"]]
    return t


def _base_score(doc: dict[str, Any]) -> float:
    return float(str(doc["learner"]["learner_model_param"]["base_score"]).strip("[]"))


def average_boosters(boosters: list[xgb.Booster]) -> xgb.Booster:
    """One booster whose margin is the mean of the members' margins: every member's trees with
    leaf values divided by their number, and the mean intercept. Built through XGBoost's JSON
    model format, so the result saves, loads and predicts like any booster."""
    return combine_boosters([boosters])


def combine_boosters(groups: list[list[xgb.Booster]]) -> xgb.Booster:
    """One booster whose margin is the sum over ``groups`` of the mean margin of each group's
    members (``average_boosters`` is one group)."""
    if len(groups) == 1 and len(groups[0]) == 1:
        return groups[0][0]
    docs = [(json.loads(bytes(b.save_raw(raw_format="json"))), len(g)) for g in groups for b in g]
    out = docs[0][0]
    trees: list[dict[str, Any]] = []
    info: list[int] = []
    for d, n in docs:
        m = d["learner"]["gradient_booster"]["model"]
        if int(m["gbtree_model_param"]["num_parallel_tree"]) != 1:
            raise TrainError("cannot average boosters with parallel trees")
        for t in m["trees"]:
            t = _leaf_scaled(t, 1.0 / n)
            t["id"] = len(trees)
            trees.append(t)
        info += m["tree_info"]
    model = out["learner"]["gradient_booster"]["model"]
    model.update(trees=trees, tree_info=info, iteration_indptr=list(range(len(trees) + 1)))
    model["gbtree_model_param"]["num_trees"] = str(len(trees))
    base = float(sum(_base_score(d) / n for d, n in docs))
    out["learner"]["learner_model_param"]["base_score"] = f"[{base!r}]"
    # Early-stopping marks (best_iteration) of the first member would cut the others off.
    out["learner"]["attributes"] = {}
    merged = xgb.Booster()
    merged.load_model(bytearray(json.dumps(out).encode()))
    return merged


def _rows(a: np.ndarray, idx: np.ndarray | None) -> np.ndarray:
    return a if idx is None else a[idx]


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
