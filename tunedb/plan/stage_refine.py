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

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.collect.stage_rows import write_stage_rows
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.record import Plan, PlanError
from tunedb.plan.stages import (
    FORK_US,
    Groups,
    StageEstimator,
    StageKeys,
    apply_stages,
    ios_search,
    operator_units,
    schedule_plan,
    step_dag,
)
from tunedb.runtime import open_device
from tunedb.runtime.device import device_info
from tunedb.runtime.stage_exec import StagedExecutor
from tunedb.store import BUSY_WAIT_S, TuningStore

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
    # every distinct schedule the loop measured in full, with its stage sum (``top_schedules``)
    schedules: list[tuple[float, list[Groups]]] = field(default_factory=list)

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


def harness_plan(doc: Mapping[str, Any] | str) -> Plan:
    """A plan's JSON as the stage harness runs it: no stages, and buffers that keep every value
    apart, so that the members of any candidate stage can run at once (the ``load_plan`` that
    ``tunedb collect --collector stage`` lends ``collectors.stage``)."""
    plan = Plan.from_json(doc)
    return replace(plan, stages=(), buffers=plan_buffers(plan.graph, plan.steps, times=[0] * len(plan.steps)))


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
            out.schedules.append(best)
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
        out.schedules.append((whole, stages))
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


def top_schedules(ref: Refinement, k: int) -> list[tuple[float, list[Groups]]]:
    """The ``k`` distinct schedules with the least stage sums that ``ref`` measured in full, best
    first: the candidates to time end to end, where the harness's warm stages and a plan's cold
    weights can order near-equal schedules differently than their sums do."""
    seen: dict[tuple, tuple[float, list[Groups]]] = {}
    for total, stages in ref.schedules:
        key = tuple(tuple(sorted(tuple(sorted(g)) for g in st)) for st in stages)
        if key not in seen or total < seen[key][0]:
            seen[key] = (total, stages)
    return sorted(seen.values(), key=lambda t: t[0])[:max(0, k)]


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
# Stored stages that make up this share of both plans' totals decide (the rest priced by the
# estimator scaled to the stored ones): the estimator alone put SqueezeNet's stages 6 % ahead
# at b1 and at b16, where they measured +8 % and -5 % (data/bench/stages_h200_v3.json).
AUTO_STORED_COVER = 0.8


def compile_staged(compile_fn: Callable[..., Plan], graph: Any, schedule: str, *,
                   horizontal: bool = True, pack: bool | str = False, **kwargs: Any) -> Plan:
    """``tunedb.compile(..., schedule="ios" | "auto")``: the IOS plan is built from the fusion
    search without horizontal packing or packs (packing independent kernels into one would tie
    the branches that stages run concurrently), then scheduled. ``auto`` also builds the
    sequential plan, with ``pack`` as ``schedule="sequential"`` would (so ``auto`` is never the
    sequential plan minus its packs), and keeps whichever ``choose_auto`` says is faster: on
    stored stage times when the database holds every stage of both plans, else on predictions
    with a 10 % margin."""
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    base = compile_fn(graph, horizontal=False, schedule="sequential", pack=False, **kwargs)
    stored = stored_times(kwargs.get("db"), base.device)
    if not kwargs.get("measure_top"):
        staged, _ = schedule_plan(base, measured=stored)
        sequential = compile_fn(graph, horizontal=horizontal, schedule="sequential", pack=pack,
                                **kwargs) if schedule == "auto" else None
        return staged if sequential is None else choose_auto(sequential, staged, stored)
    # measure_top: the refinement loop measures the stages that decide (stored ones are hits)
    measuring = StageMeasuring(kwargs.get("measure_device", "cuda"), kwargs.get("db"))
    try:
        staged, fresh = refine_plan(base, measuring.timer(base), stored)
        measuring.save(base, fresh)
        if schedule == "ios":
            return staged
        sequential = compile_fn(graph, horizontal=horizontal, schedule="sequential", pack=pack, **kwargs)
        # the sequential plan's steps, each a stage, measured too: auto decides on measured sums
        timer = measuring.timer(sequential)
        keys = StageKeys(sequential.steps)
        times = {**stored, **{r["key"]: r["samples_us"][0] for r in fresh if r["status"] == "ok"}}
        rows = [_measure_row(timer, st, keys(st)) for st in plan_stages(sequential)
                if keys(st) not in times and any(sequential.steps[i].kind != "layout_view" for i in st[0])]
        measuring.save(sequential, rows)
        times.update({r["key"]: r["samples_us"][0] for r in rows if r["status"] == "ok"})
        return choose_auto(sequential, staged, times)
    finally:
        measuring.close()


def _measure_row(timer: Callable[[Groups], float], groups: Groups, key: str) -> dict[str, Any]:
    row: dict[str, Any] = {"groups": [list(g) for g in groups], "key": key}
    try:
        row.update(status="ok", samples_us=[float(timer(groups))])
    except Exception as e:  # noqa: BLE001 - a stage that fails to run is a row, and never wins
        row.update(status="runtime_error", message=" ".join(str(e).split())[:300])
    return row


def refine_plan(base: Plan, timer: Callable[[Groups], float], stored: Mapping[str, float] | None = None,
                *, max_rounds: int = 40) -> tuple[Plan, list[dict[str, Any]]]:
    """``base`` (a plan without horizontal packing) with the stages of the refinement loop
    (``refine_stages(alone=True)``): stages in ``stored`` (stage key -> µs) are hits, the others
    are timed by ``timer``; returns the plan and one row per stage timed (``collectors.stage``
    row format, failures included)."""
    keys = StageKeys(base.steps)
    stored = stored or {}
    rows: list[dict[str, Any]] = []

    timed: dict[str, float] = {}  # operators of one shape and schedule are one stage: timed once

    def measure(groups: Groups) -> float:
        key = keys(groups)
        hit = stored.get(key, timed.get(key))
        if hit is not None:
            return float(hit)
        rows.append(_measure_row(timer, groups, key))
        timed[key] = rows[-1]["samples_us"][0] if rows[-1]["status"] == "ok" else math.inf
        return timed[key]

    ref = refine_stages(base.steps, measure, estimator=StageEstimator(base.steps, launch_us=base.launch_us),
                        max_rounds=max_rounds, alone=True)
    if not ref.stages:  # no schedule measured in full: the predicted one
        staged, _ = schedule_plan(base, measured=stored)
        return staged, rows
    info = {"schedule": "ios (measured)", "ios_measured_us": round(ref.total_us, 2),
            "refine_candidates": ref.candidates, "refine_measured": len(rows),
            "refine_stored_hits": len({keys(st) for st in ref.stages} & set(stored)),
            "refine_rounds": len(ref.rounds),
            "refine_converged": ref.converged, "refine_search_s": round(ref.search_s, 3)}
    return apply_stages(base, ref.stages, info), rows


class StageMeasuring:
    """Where ``compile(..., measure_top=...)`` times stages and stores them: ``"cuda"`` times
    each stage in a harness executor of the plan whose values never share memory; ``"replay:DB"``
    reads the stage rows stored in DB (a stage it lacks fails). Rows go to ``db`` when it is
    a path or a writable store."""

    def __init__(self, measure_device: str, db: Any) -> None:
        self.spec, self.db = measure_device, db
        if measure_device in ("cuda", "gpu"):  # this GPU's facts, without starting measuring workers
            self.info = device_info()
        else:
            device = open_device(measure_device)
            try:
                self.info = device.info
            finally:
                device.close()
        self.harnesses: list[Any] = []

    def timer(self, plan: Plan) -> Callable[[Groups], float]:
        if self.spec.startswith("replay:"):
            table = stored_times(self.spec[len("replay:"):], f"{self.info.name} ({self.info.id})")
            keys = StageKeys(plan.steps)

            def lookup(groups: Groups) -> float:
                hit = table.get(keys(groups))
                if hit is None:
                    raise PlanError(f"stage {keys(groups)} is not in the replay data")
                return hit
            return lookup
        steps = plan.steps
        separate = replace(plan, buffers=plan_buffers(plan.graph, steps, times=[0] * len(steps)), stages=())
        harness = StagedExecutor(separate, stage_streams=8, capture=False)
        self.harnesses.append(harness)
        return lambda groups: harness.time_stage(groups, copies=5, reps=4)

    def save(self, plan: Plan, rows: list[dict[str, Any]]) -> int:
        if not rows or self.db is None:
            return 0
        config = {"source": "compile", "measure_device": self.spec}
        if hasattr(self.db, "candidates"):
            if getattr(self.db, "read_only", False):
                return 0
            return write_stage_rows(self.db, plan.steps, plan.graph.name, rows, self.info, config,
                                    "plan")["measurements"]
        with TuningStore.open(self.db, wait_s=BUSY_WAIT_S) as store:
            return write_stage_rows(store, plan.steps, plan.graph.name, rows, self.info, config,
                                    "plan")["measurements"]

    def close(self) -> None:
        for h in self.harnesses:
            h.close_streams()


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


def stored_total(plan: Plan, times: Mapping[str, float]) -> tuple[float, float] | None:
    """(total, stored share of it): ``plan``'s stored stages at their stored times, the others
    priced by ``StageEstimator`` scaled by the stored stages' stored/predicted ratio; the share is
    1.0 exactly when every stage that launches is stored (the total is then their sum). None
    when none of them is stored; stages of views only cost nothing."""
    keys, est = StageKeys(plan.steps), StageEstimator(plan.steps, launch_us=plan.launch_us)
    stored = predicted_stored = predicted_missing = 0.0
    missing = 0
    for st in plan_stages(plan):
        if all(plan.steps[i].kind == "layout_view" for g in st for i in g):
            continue
        hit = times.get(keys(st))
        if hit is None:
            missing += 1
            predicted_missing += est(st)
        else:
            stored, predicted_stored = stored + hit, predicted_stored + est(st)
    if not missing:
        return stored, 1.0
    if stored <= 0 or predicted_stored <= 0:
        return None
    total = stored + predicted_missing * stored / predicted_stored
    return total, stored / total


def predicted_total(plan: Plan) -> float:
    """The sum of ``plan``'s stages priced by ``StageEstimator`` (the same prices for a
    sequential plan, each step a stage, and a staged one)."""
    est = StageEstimator(plan.steps, launch_us=plan.launch_us)
    return sum(est(st) for st in plan_stages(plan))


def choose_auto(sequential: Plan, staged: Plan, stored: Mapping[str, float] | None = None) -> Plan:
    """``auto``: when ``stored`` (stage key -> measured µs) holds every stage of both plans,
    the staged plan is kept if its stages sum to ``AUTO_MARGIN`` of the sequential plan's or less
    (``choose_auto_measured``); when stored stages make up ``AUTO_STORED_COVER`` of each plan's
    ``stored_total``, those totals decide with the same margin; otherwise both plans are
    priced by the estimator and the staged plan must win by ``AUTO_PREDICTED_MARGIN``. The
    choice and its numbers go into ``search``."""
    seq_c = stored_total(sequential, stored) if stored else None
    ios_c = stored_total(staged, stored) if stored else None
    if seq_c is not None and ios_c is not None and min(seq_c[1], ios_c[1]) >= AUTO_STORED_COVER:
        totals = {id(sequential): seq_c[0], id(staged): ios_c[0]}
        full = seq_c[1] == ios_c[1] == 1.0
        got = choose_auto_measured(sequential, staged, lambda p: totals[id(p)],
                                   how="stored" if full else "stored and predicted")
        if full:
            return got
        share = {"auto_stored_share": [round(seq_c[1], 3), round(ios_c[1], 3)]}
        return replace(got, search={**dict(got.search), **share})
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
