"""The measured-refinement loop of the IOS search, stored stages, and ``schedule=`` of the driver.

``refine_stages(steps, measure)`` searches with predicted stage costs, measures the stages of the
winner that are not measured yet (``measure(groups) -> µs``, e.g. ``StagedExecutor.time_stage``
or stored rows), and searches again, until the winner consists of measured stages only.

Predictions are made *optimistic* before each search: every unmeasured candidate's estimate is
multiplied by a low quantile (``optimism``) of the measured/predicted ratios seen so far for
stages of its width (number of groups). A schedule then wins on predictions only if it could
still beat the measured winner, which is what pulls the loop towards the stages it is least sure
about; with a bound that never overestimates, the final winner is the best schedule under the
measured times (the argument of A*). The loop stops at the fixed point or after
``max_rounds`` / ``max_measured``, and returns the best schedule it measured in full.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.plan.record import Plan, PlanError
from tunedb.plan.stages import (
    FORK_US,
    Groups,
    StageEstimator,
    StageKeys,
    ios_search,
    operator_units,
    schedule_plan,
    step_dag,
)
from tunedb.store import TuningStore

WIDTH_BUCKETS = 4  # 1, 2, 3, 4+ groups


@dataclass
class Refinement:
    stages: list[Groups]
    total_us: float                      # the winner's time, all stages measured when converged
    measured: dict[str, float]           # stage key -> µs
    candidates: int                      # distinct stages the last search priced
    rounds: list[dict[str, Any]] = field(default_factory=list)
    converged: bool = False
    search_s: float = 0.0
    measure_s: float = 0.0

    @property
    def measured_fraction(self) -> float:
        return len(self.measured) / max(1, self.candidates)


class AloneEstimator:
    """A stage priced from its operators' measured times alone (``operator_units``): each group
    takes the sum of its operators' times, the stage its longest group plus ``fork_us`` per
    extra group (perfect overlap: a lower bound wherever concurrency never speeds a kernel up)."""

    def __init__(self, steps: Sequence[Any], alone_us: dict[int, float], fork_us: float = FORK_US) -> None:
        preds, succs = step_dag(steps)
        self.unit_of = {i: u for u, m in enumerate(operator_units(steps, preds, succs)) for i in m}
        self.alone_us, self.fork_us = alone_us, fork_us

    def __call__(self, groups: Groups) -> float:
        times = [sum(self.alone_us.get(u, 0.0) for u in {self.unit_of[i] for i in g}) for g in groups]
        return max(times) + self.fork_us * (len(groups) - 1)


def refine_stages(steps: Sequence[Any], measure: Callable[[Groups], float], *,
                  estimator: Callable[[Groups], float] | None = None, optimism: float = 0.05,
                  cap: float = float("inf"),
                  max_rounds: int = 30, max_measured: int | None = None,
                  search_kwargs: dict[str, Any] | None = None, alone: bool = False) -> Refinement:
    """See the module docstring. ``optimism``: the quantile of measured/predicted ratios that
    scales unmeasured estimates (0: the smallest ratio seen; 0.5: the median, no longer a bound);
    ``cap``: the largest scale (1.0 keeps an estimator that never overestimates a lower bound,
    and the result is then the optimum under the measured times). ``alone``: measure every
    operator alone first and price stages from those times (``AloneEstimator``), not
    ``estimator``; those measurements count among the measured stages."""
    keys = StageKeys(steps)
    measured: dict[str, float] = {}
    if alone:
        alone_us = {}
        preds, succs = step_dag(steps)
        for u, m in enumerate(operator_units(steps, preds, succs)):
            if all(steps[i].kind == "layout_view" for i in m):
                continue
            alone_us[u] = measured[keys((tuple(m),))] = float(measure((tuple(m),)))
        est: Callable[[Groups], float] = AloneEstimator(steps, alone_us)
    else:
        est = estimator or StageEstimator(steps)
    ratios: list[list[float]] = [[] for _ in range(WIDTH_BUCKETS)]
    scale = [1.0] * WIDTH_BUCKETS
    cache: dict = {}
    kwargs = dict(search_kwargs or {})
    out = Refinement([], 0.0, measured, 0)

    def bucket(groups: Groups) -> int:
        return min(len(groups), WIDTH_BUCKETS) - 1

    def cost(groups: Groups) -> float:
        hit = measured.get(keys(groups))
        return hit if hit is not None else est(groups) * scale[bucket(groups)]

    best: tuple[float, list[Groups]] | None = None  # the best schedule measured in full so far
    for rnd in range(max_rounds):
        t0 = time.perf_counter()
        total, stages, stats = ios_search(steps, cost, cache=cache, **kwargs)
        out.search_s += time.perf_counter() - t0
        out.candidates = stats.candidates
        new = {keys(st): st for st in stages if keys(st) not in measured}
        if not new:
            out.converged = True
            best = (total, stages)
            break
        if max_measured is not None and len(measured) + len(new) > max_measured:
            break
        t1 = time.perf_counter()
        for k, st in new.items():
            if all(steps[i].kind == "layout_view" for g in st for i in g):
                measured[k] = 0.0  # views only (a bias reshaped): nothing runs
                continue
            measured[k] = float(measure(st))
            ratios[bucket(st)].append(measured[k] / max(est(st), 1e-9))
        out.measure_s += time.perf_counter() - t1
        whole = sum(measured[keys(st)] for st in stages)
        if best is None or whole < best[0]:
            best = (whole, stages)
        pooled = [r for rs in ratios for r in rs]
        for b in range(WIDTH_BUCKETS):
            # a bucket without measurements borrows the quantile of all of them
            rs = ratios[b] if len(ratios[b]) >= 3 else pooled
            if rs:
                scale[b] = min(cap, float(np.quantile(rs, optimism)))
        out.rounds.append({"round": rnd, "predicted_us": round(total, 2), "newly_measured": len(new),
                           "measured": len(measured), "scale": [round(s, 3) for s in scale]})
    if best is not None:
        out.total_us, out.stages = best
    return out


def stored_stage_times(store: Any, device_ids: str | Sequence[str]) -> dict[str, float]:
    """Stage key -> median of every ok sample stored for it on ``device_ids`` (rows of kind
    ``stage``, written by the ``collectors/stage.py`` plugin)."""
    ids = [device_ids] if isinstance(device_ids, str) else list(device_ids)
    samples: dict[str, list[float]] = {}
    for c in store.candidates(kind="stage"):
        key = c.config_dict.get("key")
        for dev in ids:
            for m in store.measurements(candidate_hash=c.hash, device_id=dev):
                if m.status == "ok" and key:
                    samples.setdefault(key, []).extend(m.samples_us)
    return {k: float(np.median(v)) for k, v in samples.items() if v}


SCHEDULES = ("sequential", "ios", "auto")
AUTO_MARGIN = 0.95   # measured auto keeps the stages only when at least 5 % faster
# Predicted auto keeps the stages only when the estimator says 10 % faster: on the H200 run
# (data/bench/stages_h200_v2.json) it predicted 6 % gains at SqueezeNet b1 and b16 (measured +8 %
# and -4 %) and 19-45 % on the graphs where stages won 7-29 %.
AUTO_PREDICTED_MARGIN = 0.90


def compile_staged(compile_fn: Callable[..., Plan], graph: Any, schedule: str, *,
                   horizontal: bool = True, **kwargs: Any) -> Plan:
    """``tunedb.compile(..., schedule="ios" | "auto")``: the IOS plan is built from the fusion
    search without horizontal packing (packing independent kernels into one would tie the
    branches that stages run concurrently), then scheduled. ``auto`` also builds the sequential
    plan and keeps whichever ``choose_auto`` says is faster: on stored stage times when the
    database holds every stage of both plans, else on predictions with a 10 % margin."""
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    base = compile_fn(graph, horizontal=False, schedule="sequential", **kwargs)
    stored = stored_times(kwargs.get("db"), base.device)
    staged, _ = schedule_plan(base, measured=stored)
    if schedule == "ios":
        return staged
    sequential = compile_fn(graph, horizontal=horizontal, schedule="sequential", **kwargs)
    return choose_auto(sequential, staged, stored)


def stored_times(db: Any, device_text: str) -> dict[str, float]:
    """Stage key -> µs of the stages stored (``collectors.stage``) for the plan's device and
    boards of its model; empty without a database or a device. ``device_text`` is
    ``Plan.device`` ("name (id)")."""
    if db is None or not device_text.endswith(")"):
        return {}
    dev_id = device_text.rsplit("(", 1)[1][:-1]
    if hasattr(db, "candidates"):
        store, own = db, False
    elif Path(db).is_file():
        store, own = TuningStore.open(db, read_only=True), True
    else:
        return {}
    try:
        info = next((d for d in store.devices() if d.id == dev_id), None)
        return stored_stage_times(store, store.same_model_ids(info)) if info is not None else {}
    finally:
        if own:
            store.close()


def plan_stages(plan: Plan) -> list[Groups]:
    """``plan``'s stages; a plan without stages runs each step as a stage of its own."""
    return list(plan.stages) if plan.stages else [((i,),) for i in range(len(plan.steps))]


def stored_total(plan: Plan, times: Mapping[str, float]) -> float | None:
    """The sum of ``plan``'s stages at their stored times, or None when one is not stored
    (stages of views only cost nothing)."""
    keys, total = StageKeys(plan.steps), 0.0
    for st in plan_stages(plan):
        if all(plan.steps[i].kind == "layout_view" for g in st for i in g):
            continue
        hit = times.get(keys(st))
        if hit is None:
            return None
        total += hit
    return total


def predicted_total(plan: Plan) -> float:
    """The sum of ``plan``'s stages priced by ``StageEstimator`` (the same prices for a
    sequential plan, each step a stage, and a staged one)."""
    est = StageEstimator(plan.steps, launch_us=plan.launch_us)
    return sum(est(st) for st in plan_stages(plan))


def choose_auto(sequential: Plan, staged: Plan, stored: Mapping[str, float] | None = None) -> Plan:
    """``auto``: when ``stored`` (stage key -> measured µs) holds every stage of both plans,
    the staged plan is kept if its stages sum to ``AUTO_MARGIN`` of the sequential plan's or less
    (``choose_auto_measured``); otherwise both plans are priced by the estimator and the staged
    plan must win by ``AUTO_PREDICTED_MARGIN``. The choice and its numbers go into ``search``."""
    seq_s = stored_total(sequential, stored) if stored else None
    ios_s = stored_total(staged, stored) if stored else None
    if seq_s is not None and ios_s is not None:
        times = {id(sequential): seq_s, id(staged): ios_s}
        return choose_auto_measured(sequential, staged, lambda p: times[id(p)], how="stored")
    seq_us, ios_us = predicted_total(sequential), predicted_total(staged)
    pick = staged if ios_us < AUTO_PREDICTED_MARGIN * seq_us else sequential
    label = "ios" if pick is staged else "sequential"
    search = {**dict(pick.search), "schedule": f"{label} (auto)",
              "auto_predicted_ios_us": round(ios_us, 2), "auto_predicted_sequential_us": round(seq_us, 2)}
    return replace(pick, search=search)


def choose_auto_measured(sequential: Plan, staged: Plan, time_us: Callable[[Plan], float],
                         how: str = "measured") -> Plan:
    """``auto`` with a GPU: both plans timed end to end (``time_us``, e.g. an executor's
    verified replay), the staged plan kept only when it is faster by ``AUTO_MARGIN``; the times
    go into ``search``."""
    seq_us, ios_us = float(time_us(sequential)), float(time_us(staged))
    pick = staged if ios_us < AUTO_MARGIN * seq_us else sequential
    label = "ios" if pick is staged else "sequential"
    search = {**dict(pick.search), "schedule": f"{label} (auto, {how})",
              "auto_sequential_us": round(seq_us, 2), "auto_ios_us": round(ios_us, 2)}
    return replace(pick, search=search)
