"""Plans with IOS stages on the GPU: one CUDA graph that forks and joins streams per stage.

``StagedExecutor(plan)`` is a ``PlanExecutor`` whose launches follow ``plan.stages``: the first
group of a stage runs on the executor's stream, every other group on a stream of a
``StreamPool`` (each with its own cuBLAS handle and workspace, and its own scratch buffer, so
that concurrent GEMMs and im2col convolutions never share memory). A stage with several groups
is a fork (an event on the main stream that the branch streams wait on) and a join (the main
stream waits on one event per branch); captured once, that is one graph with parallel branches.
A plan without stages runs as ``PlanExecutor`` does.

``joins="dataflow"`` drops the barrier between stages: each group waits only on the earlier
groups it reads from or whose bytes it reuses (``stage_flow.flow_schedule``), on a lane chosen so
that the stream order adds no wait; ``joins="stage"`` is the fork and join per stage above. The
default (``resolve_joins``) keeps the barriers for schedules chosen on measured stage times and
drops them for predicted ones (``TUNEDB_STAGE_JOINS`` overrides it). With ``priority=True`` the
dataflow schedule puts the groups of the longest predicted path on lane 1 (with stage joins:
each wide stage's longest predicted group), whose stream gets the device's highest priority,
and the graph is instantiated to honour it (``graph_priority``).

``StagedExecutor(plan, stage_streams=W)`` is the measurement harness: every step is built once
per stream index ``0..W-1``, so that ``time_stage(groups)`` can run any candidate stage (at most
``W`` groups) with its groups on distinct streams. Give it a plan whose buffers keep every value
apart (no reuse), so that members of any candidate stage can run at once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tunedb.runtime.device import current_stream, import_cupy
from tunedb.runtime.executor import ExecutorError, executor_for
from tunedb.runtime.graph_priority import capture_with_priorities, greatest_priority
from tunedb.runtime.lanes import LaneExecutor
from tunedb.runtime.stage_flow import FlowSchedule, critical_groups, flow_schedule
from tunedb.runtime.stage_prefetch import PREFETCH_CHUNK, prefetch_for
from tunedb.runtime.streams import gc_paused

Groups = Sequence[Sequence[int]]
JOINS = ("stage", "dataflow")
DEFAULT_JOINS = "auto"
# a schedule chosen on stage times measured under barriers keeps them (see ``resolve_joins``)
_MEASURED_SCHEDULES = ("measured", "oracle", "stored")


def resolve_joins(plan: Any, joins: str | None = None) -> str:
    """The joins a staged plan runs with: ``joins``, else ``TUNEDB_STAGE_JOINS``, else
    ``auto``: stage barriers where the plan's schedule was chosen on measured stage times (they
    were measured with a barrier on either side; without one, groups meet neighbours the
    measurement never saw: v6's refined and oracle schedules ran 1.1 % and 2.7 % slower
    without), dataflow where it was predicted (IOS 1.7 %, RandWire 2.7 %, NASNet 4.1 % faster
    on the H200, session 8 call 2)."""
    joins = joins or os.environ.get("TUNEDB_STAGE_JOINS") or DEFAULT_JOINS
    if joins == "auto":
        how = str(dict(plan.search).get("schedule", ""))
        return "stage" if any(w in how for w in _MEASURED_SCHEDULES) else "dataflow"
    if joins not in JOINS:
        raise ExecutorError(f"joins must be one of auto, {', '.join(JOINS)}, got {joins!r}")
    return joins


def _longest_second(plan: Any, stage: Groups) -> tuple[tuple[int, ...], ...]:
    """A wide stage's groups with its longest by the steps' predictions second (on lane 1)."""
    groups = [tuple(g) for g in stage]
    if len(groups) < 2:
        return tuple(groups)
    cost = [sum(plan.steps[k].predicted_us + plan.launch_us * plan.steps[k].launches for k in g)
            for g in groups]
    top = groups.pop(max(range(len(groups)), key=lambda i: cost[i]))
    return (groups[0], top, *groups[1:])


class StagedExecutor(LaneExecutor):
    """See the module docstring. ``streams`` (streams in use at most) and ``stages`` (stages with
    more than one group) are added to ``summary()``."""

    def __init__(self, plan: Any, *, capture: bool = True, verify_capture: bool = True,
                 sm_count: int | None = None, stage_streams: int = 0, joins: str | None = None,
                 priority: bool = False, prefetch: bool = False) -> None:
        if not hasattr(plan, "stages"):
            raise ExecutorError("StagedExecutor takes a Plan (load JSON with Plan.from_json first)")
        joins = resolve_joins(plan, joins)
        stages = tuple(plan.stages)
        self._ios_stages = stages
        self._ios_harness = stage_streams > 0
        width = max([len(st) for st in stages] + [1, stage_streams])
        self._ios_stream_of = {i: gi for st in stages for gi, g in enumerate(st) for i in g}
        self._flow: FlowSchedule | None = None
        lane_priority: dict[int, int] = {}
        if joins == "dataflow" and not self._ios_harness and width > 1:
            # one lane more than the widest stage, so that a group rarely waits on a stranger
            self._flow = flow_schedule(plan, width + 1, critical_groups(plan) if priority else None)
            width = max(width, self._flow.lanes)
            self._ios_stream_of = {i: fg.lane for fg in self._flow.groups for i in fg.steps}
            if priority:
                lane_priority = {1: greatest_priority()}
        elif priority and not self._ios_harness and width > 1:
            # stage barriers: each wide stage's longest predicted group on lane 1
            stages = tuple(_longest_second(plan, st) for st in stages)
            self._ios_stages = stages
            self._ios_stream_of = {i: gi for st in stages for gi, g in enumerate(st) for i in g}
            lane_priority = {1: greatest_priority()}
        self.joins = joins if self._flow is not None else "stage"
        self.priority = bool(lane_priority)
        self._ios_width = width
        self._init_lanes(width - 1, lane_priority)
        self._ios_fns: dict[tuple[int, int], list[Any]] = {}
        self._ios_events: dict[tuple[int, int], Any] = {}
        # stage_prefetch: the next unit's weights into L2 (stage joins and plans without stages)
        self._want_prefetch = prefetch and not self._ios_harness and self._flow is None
        self._prefetch: Any = None
        super().__init__(plan, capture=capture, verify_capture=verify_capture, sm_count=sm_count)
        if self._ios_harness:
            # Every stream's copy of every step runs once eagerly: lazy kernel loads and scratch
            # allocations happen here, not inside a stage's capture.
            for g in range(1, self._ios_width):
                with current_stream(self.cp, self._stream(g)):
                    self._run_group(g, range(len(self.plan.steps)))
                self._stream(g).synchronize()

    # -- building: each step with the cuBLAS handle and scratch of its stream ----------------------
    def _stream(self, g: int) -> Any:
        return self.stream if g == 0 else self._lane_pool.stream(g - 1)

    def _build(self, k: int, step: Any) -> None:
        targets = range(self._ios_width) if self._ios_harness else (self._ios_stream_of.get(k, 0),)
        launches = self.launches
        first = None
        for g in targets:
            self._ios_fns[(g, k)] = self._build_on_lane(g, k, step)
            if first is None:
                first = (self.launches - launches, len(self.paths), len(self.fallbacks))
        # the harness builds a step once per stream: report it once
        assert first is not None
        self.launches = launches + first[0]
        del self.paths[first[1]:]
        del self.fallbacks[first[2]:]

    # -- launching -------------------------------------------------------------------------------
    def _event(self, stage: int, g: int) -> Any:
        ev = self._ios_events.get((stage, g))
        if ev is None:
            ev = self._ios_events[(stage, g)] = self.cp.cuda.Event(disable_timing=True)
        return ev

    def _run_group(self, g: int, steps: Sequence[int]) -> None:
        for k in steps:
            for fn in self._ios_fns[(g, k)]:
                fn()

    def _enqueue_stage(self, si: int, groups: Groups) -> None:
        """One stage on the current (main) stream: groups 1.. forked onto the pool's streams."""
        if len(groups) == 1:
            self._run_group(0, groups[0])
            return
        if len(groups) > self._ios_width:
            raise ExecutorError(f"stage of {len(groups)} groups; this executor has {self._ios_width} streams")
        main = self.stream
        fork = self._event(si, 0)
        fork.record(main)
        joins = []
        for g in range(1, len(groups)):
            s = self._stream(g)
            s.wait_event(fork)
            with current_stream(self.cp, s):
                self._run_group(g, groups[g])
            done = self._event(si, g)
            done.record(s)
            joins.append(done)
        self._run_group(0, groups[0])
        for done in joins:
            main.wait_event(done)

    def _enqueue_flow(self, flow: FlowSchedule) -> None:
        """Every group on its lane after the groups it waits on; lanes fork from the main
        stream at the start and all join it at the end."""
        main = self.stream
        start = self._event(-2, 0)
        start.record(main)
        joined = {0}
        for i, fg in enumerate(flow.groups):
            s = self._stream(fg.lane)
            if fg.lane not in joined:
                s.wait_event(start)
                joined.add(fg.lane)
            for j in fg.waits:
                s.wait_event(self._event(-3, j))
            with current_stream(self.cp, s):
                self._run_group(fg.lane, fg.steps)
            self._event(-3, i).record(s)
        for j in flow.end_waits:
            main.wait_event(self._event(-3, j))

    def _record(self) -> tuple[Any, Any, BaseException | None]:
        if not self.priority:
            return super()._record()
        cp = self.cp
        pool = cp.cuda.MemoryPool()
        graph, err = None, None
        with gc_paused(), current_stream(cp, self.stream), cp.cuda.using_allocator(pool.malloc):
            try:
                graph = capture_with_priorities(self.stream, self._enqueue)
            except Exception as e:  # noqa: BLE001 - the executor launches eagerly and says why
                err = e
        return graph, pool, err

    def _capture(self, verify: bool) -> None:
        if self._want_prefetch:  # after the first eager run: the weights' arrays are in place
            self._prefetch = prefetch_for(self, self.cp.cuda.Stream(non_blocking=True))
        super()._capture(verify)

    def _enqueue(self) -> None:
        pf = self._prefetch
        if not self._ios_stages:
            for k in range(len(self.plan.steps)):
                if pf is not None and k % PREFETCH_CHUNK == 0:
                    pf.point(k // PREFETCH_CHUNK, self.stream)
                self._run_group(0, (k,))
        elif self._flow is not None:
            self._enqueue_flow(self._flow)
        else:
            for si, st in enumerate(self._ios_stages):
                if pf is not None:
                    pf.point(si, self.stream)
                self._enqueue_stage(si, st)
        if pf is not None:
            pf.end(self.stream)

    # -- measuring one stage (harness) -----------------------------------------------------------
    def time_stage(self, groups: Groups, *, copies: int = 10, reps: int = 20) -> float:
        """Median µs of ``groups`` run as one stage (fork/join when several), from a CUDA graph of
        ``copies`` back-to-back copies of the stage replayed ``reps`` times (the graph launch is
        spread over the copies, as a stage inside a plan's graph pays none)."""
        cp = self.cp
        main = self.stream
        graph = None
        alloc = self._lane_pool.memory_pool.malloc
        with gc_paused(), current_stream(cp, main), cp.cuda.using_allocator(alloc):
            main.begin_capture()
            try:
                for _ in range(copies):
                    self._enqueue_stage(-1, groups)
            finally:
                graph = main.end_capture()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(3):
            graph.launch(main)
        samples = []
        for _ in range(5):
            start.record(main)
            for _ in range(reps):
                graph.launch(main)
            end.record(main)
            end.synchronize()
            samples.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / (reps * copies))
        return sorted(samples)[len(samples) // 2]

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["streams"] = max([len(st) for st in self._ios_stages] + [1])
        out["stages"] = sum(1 for st in self._ios_stages if len(st) > 1)
        out["joins"] = self.joins
        out["priority"] = self.priority
        out["prefetch_bytes"] = self._prefetch.bytes if self._prefetch is not None else 0
        if self._flow is not None:
            out["lanes"] = self._flow.lanes
            out["waits"] = sum(len(fg.waits) for fg in self._flow.groups) + len(self._flow.end_waits)
        return out


# -- Plan.run(backend="cuda") for plans with stages ----------------------------------------------
def execute_plan(plan: Any, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Run a plan with stages on ``inputs`` on the GPU; NumPy outputs (executors cached by plan
    identity through ``executor.executor_for``)."""
    cp = import_cupy()
    return {k: cp.asnumpy(v) for k, v in executor_for(plan, StagedExecutor).run(inputs).items()}
