"""Training settings of the XGBoost cost models: objectives, data-size profiles and ``TrainParams``,
everything that decides a trained model and is recorded on its card."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from tunedb.costmodel.errors import TrainError
from tunedb.costmodel.features import FEATURE_NAMES

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
