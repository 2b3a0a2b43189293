"""Collection strategies: in which order (and how many of) a suite's candidates are measured.

``Collector.run`` asks its strategy for a *round* of work (sub-jobs: a workload and some of its
specs), measures it, reports every measurement back (``observe``) and asks again, until the
strategy has nothing left, the budget, time or round limit is reached.

- ``exhaustive``: every candidate in suite order, in one round (the collector's historic order).
- ``random``: round-robin over workloads, each round a seeded-random batch from each workload.
- ``roofline``: round-robin, each workload's candidates in order of the analytic roofline time.
- ``model``: breadth first (the workloads with the fewest known latencies lead each round, the
  families taking turns); each round a workload gets the cost model's best predicted unmeasured
  candidates plus an exploration share (the lowest optimistic bound, mean - kappa * spread, of a
  small bootstrap ensemble: candidates the ensemble disagrees on and might be fast). The ensemble
  is retrained as measurements arrive (every ``retrain_every`` new ok ones; small boosters, so a
  retrain takes well under a second on thousands of rows). Cold start (fewer than ``min_train``
  ok measurements): roofline order plus a random exploration share. ``allocate="ei"`` instead
  gives each workload only its exploitation share and spends the rest of the round on the
  candidates of any workload with the highest expected improvement (ensemble spread plus the
  model's measured held-out error); on synthetic data it did no better than the even split, so
  it is an option to try on real data (``python -m tunedb.bench.active --allocate ei``).

Every strategy proposes a candidate at most once per run and never one already measured on
the device, so a collection never measures a candidate twice; ``model`` also skips the
candidates measured on another board of the same device model (they are its training rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunedb.collect.jobs import Job
from tunedb.costmodel.features import (
    FEATURE_NAMES,
    ROOFLINE_FEATURE,
    DeviceFacts,
    feature_index,
    featurize,
    featurize_frame,
)
from tunedb.records import Candidate

STRATEGIES: tuple[str, ...] = ("exhaustive", "random", "roofline", "model")


class Strategy:
    """Base: bookkeeping of candidates, what is done, and the measurement history."""

    name = "strategy"
    wants_prior = False  # True: ``start`` also gets the store's earlier measurements (a frame)

    def __init__(self, per_round: int = 8, seed: int = 0) -> None:
        if per_round < 1:
            raise ValueError(f"per_round must be >= 1, got {per_round}")
        self.per_round = int(per_round)
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)
        # (workload hash, candidate hash, status, median µs or None), in measurement order.
        self.history: list[tuple[str, str, str, float | None]] = []
        self.rounds_done = 0

    # -- set-up ------------------------------------------------------------------------------
    def start(self, jobs: list[Job], measured: set[str], device_info: Any = None, kind: str = "fusion",
              prior: Any = None) -> int:
        """Index the suite's candidates; returns how many were measured before (skipped)."""
        self.jobs = jobs
        self.kind = kind
        self.device_info = device_info
        self.cand_hash: list[str] = []
        self.job_of: list[int] = []
        self.spec_of: list[int] = []
        self.configs: list[dict] = []
        already = 0
        seen: set[str] = set()
        done: list[bool] = []
        for j, job in enumerate(jobs):
            for s, (config, _) in enumerate(job.specs):
                h = Candidate(job.workload.hash, kind, config).hash
                if h in measured or h in seen:  # a repeated config counts as measured, like before
                    already += 1
                    if h in seen:
                        continue
                seen.add(h)
                self.cand_hash.append(h)
                self.job_of.append(j)
                self.spec_of.append(s)
                self.configs.append(config)
                done.append(h in measured)
        self.index = {h: i for i, h in enumerate(self.cand_hash)}
        self.done = np.array(done, dtype=bool)
        self.latency = np.full(len(self.cand_hash), np.nan)
        self.job_of_arr = np.array(self.job_of, dtype=np.int64)
        self.by_job: list[np.ndarray] = [np.flatnonzero(self.job_of_arr == j) for j in range(len(jobs))]
        self.prepare(prior)
        return already

    def prepare(self, prior: Any) -> None:
        """Strategy-specific set-up after indexing (features, orders)."""

    def describe(self) -> dict[str, Any]:
        """The strategy's parameters, recorded in the Run's config."""
        return {"strategy": self.name, "per_round": self.per_round, "seed": self.seed}

    # -- rounds ------------------------------------------------------------------------------
    def remaining(self, j: int) -> np.ndarray:
        idx = self.by_job[j]
        return idx[~self.done[idx]]

    def propose(self, limit: int | None = None) -> list[Job]:
        """The next round: sub-jobs of unmeasured candidates; [] when the strategy is done.
        ``limit`` (what is left of the budget) is spread evenly over the workloads."""
        active = [j for j in range(len(self.jobs)) if len(self.remaining(j))]
        if not active or (limit is not None and limit <= 0):
            return []
        self.before_round()
        n = self.per_round
        if limit is not None:
            n = max(1, min(n, math.ceil(limit / len(active))))
        plan = self.plan(self.round_order(active), n, limit)
        self.rounds_done += 1
        out: list[Job] = []
        for j, picks in plan:
            if not len(picks):
                continue
            self.done[picks] = True
            job = self.jobs[j]
            out.append(Job(job.workload, [job.specs[self.spec_of[int(i)]] for i in picks]))
        return out

    def round_order(self, active: list[int]) -> list[int]:
        """The order in which a round visits the workloads that have candidates left."""
        # Rotate the starting workload so that a budget cut does not always hit the same ones.
        shift = self.rounds_done % len(active)
        return active[shift:] + active[:shift]

    def plan(self, order: list[int], n: int, limit: int | None) -> list[tuple[int, np.ndarray]]:
        """(workload, candidate indices) of one round: ``n`` of each workload in ``order``,
        ``limit`` in all."""
        out = []
        total = 0
        for j in order:
            k = n if limit is None else min(n, limit - total)
            if k <= 0:
                break
            picks = np.asarray(self.pick(j, self.remaining(j), k), dtype=np.int64)
            total += len(picks)
            out.append((j, picks))
        return out

    def before_round(self) -> None:
        """Hook: retrain models before picking."""

    def pick(self, j: int, remaining: np.ndarray, k: int) -> np.ndarray:
        """``k`` of the workload's remaining candidate indices, in measurement order."""
        return remaining[:k]

    def observe(self, candidate_hash: str, status: str, median_us: float | None) -> None:
        """A measurement of a proposed candidate arrived."""
        i = self.index.get(candidate_hash)
        if i is None:
            return
        ok = status == "ok" and median_us is not None and math.isfinite(median_us) and median_us > 0
        if ok:
            self.latency[i] = float(median_us)
        self.history.append((self.jobs[self.job_of[i]].workload.hash, candidate_hash, status,
                             float(median_us) if ok else None))


class ExhaustiveStrategy(Strategy):
    """Every candidate in suite order, in a single round."""

    name = "exhaustive"

    def propose(self, limit: int | None = None) -> list[Job]:
        if self.rounds_done:
            return []
        out = []
        for j, job in enumerate(self.jobs):
            rem = self.remaining(j)
            if len(rem):
                out.append(Job(job.workload, [job.specs[self.spec_of[i]] for i in rem]))
        self.done[:] = True
        self.rounds_done += 1
        return out

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name}


class RandomStrategy(Strategy):
    """Round-robin over workloads; each workload's candidates in a seeded random order."""

    name = "random"

    def prepare(self, prior: Any) -> None:
        self.order = self.rng.random(len(self.cand_hash))

    def pick(self, j: int, remaining: np.ndarray, k: int) -> np.ndarray:
        return remaining[np.argsort(self.order[remaining], kind="stable")[:k]]


class RooflineStrategy(Strategy):
    """Round-robin; each workload's candidates fastest-first by the analytic roofline feature
    (a static ranking: the model strategy's cold start, and a baseline for it)."""

    name = "roofline"

    def prepare(self, prior: Any) -> None:
        self.X, self.has_features = self._features()
        self.roofline = self.X[:, feature_index(ROOFLINE_FEATURE)].astype(np.float64)
        self.tiebreak = self.rng.random(len(self.cand_hash))

    def _device_facts(self) -> Any:
        info = self.device_info
        if info is not None and getattr(info, "sm_count", 0):
            return DeviceFacts.from_device_info(info)
        return DeviceFacts()

    def _features(self) -> tuple[np.ndarray, np.ndarray]:
        """Features of every candidate (compile-time facts unknown). A workload the featuriser
        cannot read keeps NaN rows and is ordered at random instead."""
        facts = self._device_facts()
        X = np.full((len(self.cand_hash), len(FEATURE_NAMES)), np.nan, dtype=np.float32)
        ok = np.zeros(len(self.cand_hash), dtype=bool)
        for j, idx in enumerate(self.by_job):
            if not len(idx):
                continue
            w = self.jobs[j].workload
            try:
                X[idx] = featurize({w.hash: w.graph_json}, [w.hash] * len(idx),
                                   [self.configs[i] for i in idx], facts)
                ok[idx] = True
            except (ValueError, KeyError, TypeError):  # GraphError is a ValueError
                continue
        return X, ok

    def static_key(self, idx: np.ndarray) -> np.ndarray:
        """Lower = measure sooner: roofline time; random for rows without features."""
        key = np.where(self.has_features[idx], self.roofline[idx], np.inf)
        return np.where(np.isfinite(key), key, np.inf)

    def pick(self, j: int, remaining: np.ndarray, k: int) -> np.ndarray:
        order = np.lexsort((self.tiebreak[remaining], self.static_key(remaining)))
        return remaining[order[:k]]


class ModelStrategy(RooflineStrategy):
    """Cost-model-guided: best predicted first, plus an optimistic exploration share."""

    name = "model"
    wants_prior = True

    def __init__(self, per_round: int = 8, seed: int = 0, explore: float = 0.25, ensemble: int = 3,
                 retrain_every: int = 64, min_train: int = 32, kappa: float = 1.5,
                 num_boost_round: int = 30, max_depth: int = 5, max_prior_rows: int = 200_000,
                 nthread: int = 1, allocate: str = "even") -> None:
        super().__init__(per_round, seed)
        if allocate not in ("ei", "even"):
            raise ValueError(f"allocate must be 'ei' or 'even', got {allocate!r}")
        self.allocate = allocate
        if not 0.0 <= explore <= 1.0:
            raise ValueError(f"explore must be in [0, 1], got {explore}")
        if ensemble < 1 or retrain_every < 1 or min_train < 1 or num_boost_round < 1:
            raise ValueError("ensemble, retrain_every, min_train and num_boost_round must be >= 1")
        self.explore = float(explore)
        self.ensemble = int(ensemble)
        self.retrain_every = int(retrain_every)
        self.min_train = int(min_train)
        self.kappa = float(kappa)
        self.num_boost_round = int(num_boost_round)
        self.max_depth = int(max_depth)
        self.max_prior_rows = int(max_prior_rows)
        # One thread: the models are small (thousands of rows), and more threads mostly spin
        # against the compile workers that share the host during a collection.
        self.nthread = int(nthread)
        self.boosters: list[Any] = []
        self.residuals: list[float] = []  # held-out errors: label - prediction at pick time
        self.trained_on = 0
        self.retrains = 0

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "explore": self.explore, "ensemble": self.ensemble,
                "retrain_every": self.retrain_every, "min_train": self.min_train, "kappa": self.kappa,
                "num_boost_round": self.num_boost_round, "max_depth": self.max_depth,
                "allocate": self.allocate}

    def prepare(self, prior: Any) -> None:
        super().prepare(prior)
        fi = feature_index("floor_us")
        # Label: log(latency / floor time). The floor depends on the workload only, so the
        # order within a workload is unchanged, but workloads of very different sizes share one
        # scale and the trees spend their splits on what the schedule changes.
        self.log_floor = np.log(np.maximum(np.nan_to_num(self.X[:, fi].astype(np.float64), nan=1.0), 1e-3))
        self.prior_X, self.prior_y = self._prior_rows(prior, fi)
        self.mu = np.full(len(self.cand_hash), np.nan)
        self.sigma = np.zeros(len(self.cand_hash))

    def _prior_rows(self, prior: Any, fi: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Earlier ok measurements on this device (and other boards of its model: ``prior`` may be
        a list of frames) warm-start the model: those of this run's candidates as their labels,
        the rest (other suites, other workloads) as extra training rows."""
        if isinstance(prior, (list, tuple)):
            prior = pa.concat_tables([t for t in prior if t.num_rows]) if any(t.num_rows for t in prior) \
                else None
        if prior is None or getattr(prior, "num_rows", 0) == 0:
            return None, None
        t = prior
        if "status" in t.column_names:
            t = t.filter(pc.equal(t["status"], "ok"))
        for h, lat in zip(t["candidate_hash"].to_pylist(), t["median_us"].to_pylist()):
            i = self.index.get(h)
            if i is not None and lat is not None and lat > 0:
                # Measured here or on another board of this model: a training row, and not
                # proposed again (boards of one model order schedules alike; a re-measurement
                # would spend the time a new workload needs).
                self.latency[i] = float(lat)
                self.done[i] = True
        keep = np.array([h not in self.index for h in t["candidate_hash"].to_pylist()], dtype=bool)
        t = t.filter(keep)
        if t.num_rows > self.max_prior_rows:
            t = t.take(np.sort(self.rng.choice(t.num_rows, self.max_prior_rows, replace=False)))
        if t.num_rows == 0:
            return None, None
        try:
            X = featurize_frame(t.drop_columns([c for c in ("registers", "shared_bytes", "local_bytes")
                                                if c in t.column_names]), self._device_facts())
        except (ValueError, KeyError, TypeError):
            return None, None
        lat = t["median_us"].to_numpy(zero_copy_only=False).astype(np.float64)
        y = np.log(lat) - np.log(np.maximum(np.nan_to_num(X[:, fi].astype(np.float64), nan=1.0), 1e-3))
        ok = np.isfinite(y)
        return X[ok], y[ok]

    def round_order(self, active: list[int]) -> list[int]:
        """Breadth first: the workloads with the fewest known latencies (measured in this run,
        or before on a board of this model) lead, and among equals the families take turns, so
        that a time limit cuts the best-known workloads rather than a whole family."""
        rotated = super().round_order(active)
        known = np.bincount(self.job_of_arr[np.isfinite(self.latency)], minlength=len(self.jobs))
        turn: dict[tuple[int, str], int] = {}
        key = {}
        for j in rotated:
            group = (int(known[j]), self.jobs[j].workload.family)
            key[j] = (group[0], turn.get(group, 0))
            turn[group] = turn.get(group, 0) + 1
        return sorted(rotated, key=key.__getitem__)

    # -- the model ---------------------------------------------------------------------------
    def n_ok(self) -> int:
        return int(np.isfinite(self.latency).sum())

    def before_round(self) -> None:
        n = self.n_ok() + (0 if self.prior_y is None else len(self.prior_y))
        if n < self.min_train:
            return
        if self.boosters and n - self.trained_on < self.retrain_every:
            return
        self.train()
        self.trained_on = n

    def train(self) -> None:
        import xgboost as xgb

        from tunedb.costmodel.train import REGRESSION, TrainParams, predict_margin

        rows = np.flatnonzero(np.isfinite(self.latency) & self.has_features)
        X = self.X[rows]
        y = np.log(self.latency[rows]) - self.log_floor[rows]
        if self.prior_X is not None:
            X = np.concatenate([X, self.prior_X])
            y = np.concatenate([y, self.prior_y])
        if len(y) < 2:
            return
        params = TrainParams(max_depth=self.max_depth, eta=0.2, num_boost_round=self.num_boost_round,
                             min_child_weight=1.0, subsample=0.9, colsample_bytree=0.8,
                             max_bin=64, nthread=self.nthread, seed=self.seed + self.retrains
                             ).xgb_params(REGRESSION)
        params.pop("eval_metric", None)
        self.boosters = []
        # Bootstrap resamples of the rows: the members agree where the data pins the answer and
        # disagree where it does not; that spread drives the exploration share.
        for m in range(self.ensemble):
            sample = (np.arange(len(y)) if self.ensemble == 1
                      else self.rng.integers(0, len(y), len(y)))
            d = xgb.DMatrix(X[sample], label=y[sample])
            self.boosters.append(xgb.train({**params, "seed": params["seed"] * 31 + m}, d,
                                           num_boost_round=self.num_boost_round))
        self.retrains += 1
        todo = np.flatnonzero(~self.done & self.has_features)
        if len(todo):
            preds = np.stack([predict_margin(b, self.X[todo]) for b in self.boosters])
            self.mu[todo] = preds.mean(axis=0)
            self.sigma[todo] = preds.std(axis=0) if len(preds) > 1 else 0.0

    def pick(self, j: int, remaining: np.ndarray, k: int) -> np.ndarray:
        n_explore = int(round(k * self.explore))
        if not self.boosters:
            # Cold start: roofline order, plus random picks for a varied first training set.
            base = super().pick(j, remaining, len(remaining))
            first = base[:k - n_explore]
            rest = base[k - n_explore:]
            return np.concatenate([first, self.rng.permutation(rest)[:n_explore]])
        mu = np.where(np.isfinite(self.mu[remaining]), self.mu[remaining], np.inf)
        tie = self.tiebreak[remaining]
        order = np.lexsort((tie, mu))
        first = order[:k - n_explore]
        rest = order[k - n_explore:]
        if n_explore and len(rest):
            bound = mu[rest] - self.kappa * self.sigma[remaining][rest]
            rest = rest[np.lexsort((tie[rest], bound))]
        return remaining[np.concatenate([first, rest[:n_explore]])]

    def observe(self, candidate_hash: str, status: str, median_us: float | None) -> None:
        super().observe(candidate_hash, status, median_us)
        i = self.index.get(candidate_hash)
        if i is not None and np.isfinite(self.latency[i]) and np.isfinite(self.mu[i]):
            # The candidate was not in the training set: an honest sample of the model's error.
            self.residuals.append(float(np.log(self.latency[i]) - self.log_floor[i] - self.mu[i]))
            del self.residuals[:-512]

    def model_error(self) -> float:
        """Typical error of a prediction (log units): RMS of recent held-out residuals."""
        if len(self.residuals) < 8:
            return 0.1
        return float(np.sqrt(np.mean(np.square(self.residuals))))

    def expected_improvement(self, idx: np.ndarray) -> np.ndarray:
        """E[max(0, best - y)] of each candidate's log-latency label y ~ N(mu, sigma^2 + err^2)
        below its workload's best measured label (or, with none yet, its best prediction)."""
        from scipy.special import ndtr

        label = np.log(self.latency) - self.log_floor
        best = np.full(len(self.jobs), np.inf)
        ok = np.flatnonzero(np.isfinite(label))
        np.minimum.at(best, self.job_of_arr[ok], label[ok])
        mu = self.mu[idx]
        b = best[self.job_of_arr[idx]]
        if not np.isfinite(b).all():
            pred_best = np.full(len(self.jobs), np.inf)
            np.minimum.at(pred_best, self.job_of_arr[idx], np.where(np.isfinite(mu), mu, np.inf))
            b = np.where(np.isfinite(b), b, pred_best[self.job_of_arr[idx]])
        sd = np.sqrt(self.sigma[idx] ** 2 + self.model_error() ** 2)
        z = (b - mu) / sd
        ei = sd * (z * ndtr(z) + np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi))
        return np.where(np.isfinite(ei), ei, 0.0)

    def plan(self, order: list[int], n: int, limit: int | None) -> list[tuple[int, np.ndarray]]:
        """With a model and ``allocate='ei'``: every workload gets its best predicted candidates
        (the exploitation share, at least one), and the exploration share of the round goes to
        the candidates of *any* workload with the highest expected improvement over their
        workload's best so far. Workloads whose best is settled give their share to those where
        the model still expects a gain (novel ones, hard ones)."""
        if not self.boosters or self.allocate != "ei" or self.explore == 0.0:
            return super().plan(order, n, limit)
        round_total = n * len(order) if limit is None else min(limit, n * len(order))
        n_exploit = max(1, n - int(round(n * self.explore)))
        picks: dict[int, list[int]] = {}
        used = 0
        for j in order:
            k = min(n_exploit, round_total - used)
            if k <= 0:
                break
            rem = self.remaining(j)
            got = rem[np.lexsort((self.tiebreak[rem], np.where(np.isfinite(self.mu[rem]), self.mu[rem],
                                                                   np.inf)))[:k]]
            picks[j] = [int(i) for i in got]
            used += len(got)
        left = round_total - used
        if left > 0:
            taken = {i for v in picks.values() for i in v}
            pool = np.array([i for j in order for i in self.remaining(j) if int(i) not in taken],
                            dtype=np.int64)
            if len(pool):
                ei = self.expected_improvement(pool)
                for i in pool[np.lexsort((self.tiebreak[pool], -ei))[:left]]:
                    picks.setdefault(int(self.job_of_arr[i]), []).append(int(i))
        return [(j, np.array(picks[j], dtype=np.int64)) for j in order if j in picks]


def make_strategy(name: str, per_round: int = 8, seed: int = 0, **options: Any) -> Strategy:
    """A strategy by name; ``options`` go to ModelStrategy (explore, ensemble, retrain_every, ...)."""
    classes: Mapping[str, type[Strategy]] = {"exhaustive": ExhaustiveStrategy, "random": RandomStrategy,
                                             "roofline": RooflineStrategy, "model": ModelStrategy}
    cls = classes.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    if options and cls is not ModelStrategy:
        raise ValueError(f"strategy {name!r} takes no options ({', '.join(sorted(options))})")
    if cls is ExhaustiveStrategy:
        return cls()
    return cls(per_round, seed, **options)
