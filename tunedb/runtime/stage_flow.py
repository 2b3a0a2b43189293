"""IOS stages run as a dataflow graph: each group waits only on the groups it needs.

A staged plan forks and joins at every wide stage: the next stage starts when the slowest group
of this one ends, even where its groups read nothing of that group. ``flow_schedule(plan, lanes)``
keeps the plan's stages as an order, drops the barriers, and makes each group wait on the
earlier groups it conflicts with: a group reads a value another wrote (through views), or it
writes bytes another read or wrote (the buffer plan reuses memory across stages, so a later
group may overwrite what an earlier one still reads). Groups of one stage never conflict
(values alive in one stage never share bytes). Each group gets a lane (stream) whose previous
group it would wait on anyway where one exists, so the stream order adds no false wait; the
waits it keeps are only those not already implied (vector clocks over the lanes).

The result is data (``FlowSchedule``): the staged executor enqueues it (``joins="dataflow"``),
and a CPU test runs any order it allows against the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tunedb.runtime.executor_views import is_concat_view, is_output_view


@dataclass(frozen=True)
class FlowGroup:
    stage: int
    group: int                  # index of the group in its stage
    steps: tuple[int, ...]
    lane: int                   # 0: the executor's own stream
    waits: tuple[int, ...]      # indices (into FlowSchedule.groups) of groups to wait on first


@dataclass(frozen=True)
class FlowSchedule:
    groups: tuple[FlowGroup, ...]
    lanes: int                  # lanes in use
    end_waits: tuple[int, ...]  # groups lane 0 waits on at the end (every lane joined)

    def happens_before(self) -> list[set[int]]:
        """For each group, every group that must end before it starts (waits and lane order,
        transitively)."""
        before: list[set[int]] = []
        last_on: dict[int, int] = {}
        for i, g in enumerate(self.groups):
            direct = set(g.waits)
            if g.lane in last_on:
                direct.add(last_on[g.lane])
            acc = set(direct)
            for j in direct:
                acc |= before[j]
            before.append(acc)
            last_on[g.lane] = i
        return before


def _plain_view(step: Any) -> bool:
    return step.kind == "layout_view" and not is_concat_view(step) and not is_output_view(step)


def _accesses(plan: Any) -> tuple[list[set[str]], list[set[str]], list[list[tuple[int, int, int]]],
                                  list[list[tuple[int, int, int]]]]:
    """Per step: values read (views followed back to the value they show), values defined,
    byte ranges read and byte ranges written (``(buffer, start, end)``)."""
    steps = plan.steps
    place = {v: (b, off, off + n) for v, b, off, n in plan.buffers.assign}
    source: dict[str, str] = {}
    for s in steps:
        if _plain_view(s):  # a view launches nothing: its readers read what it shows
            for v in s.outputs:
                source[v] = s.inputs[0] if s.inputs else v

    def base(v: str) -> str:
        seen = 0
        while v in source and seen < len(source):
            v, seen = source[v], seen + 1
        return v

    reads, defs, rbytes, wbytes = [], [], [], []
    for s in steps:
        r = {base(v) for v in s.inputs}
        reads.append(r)
        defs.append(set(s.outputs))
        rbytes.append([place[v] for v in r if v in place])
        writes = () if s.kind == "layout_view" else s.outputs
        wbytes.append([place[v] for v in writes if v in place])
    return reads, defs, rbytes, wbytes


def _overlap(a: Sequence[tuple[int, int, int]], b: Sequence[tuple[int, int, int]]) -> bool:
    return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)


def group_conflicts(plan: Any) -> list[tuple[tuple[int, int], set[tuple[int, int]]]]:
    """Each group as ``(stage, group)`` with the earlier groups it must follow."""
    reads, defs, rbytes, wbytes = _accesses(plan)
    done: list[tuple[tuple[int, int], set[str], set[str], list, list]] = []
    out = []
    for si, st in enumerate(plan.stages):
        mine = []
        for gi, g in enumerate(st):
            r = set().union(*(reads[k] for k in g))
            d = set().union(*(defs[k] for k in g))
            rb = [x for k in g for x in rbytes[k]]
            wb = [x for k in g for x in wbytes[k]]
            deps = {key for key, r2, d2, rb2, wb2 in done
                    if r & d2 or _overlap(rb, wb2) or _overlap(wb, rb2) or _overlap(wb, wb2)}
            out.append(((si, gi), deps))
            mine.append(((si, gi), r, d, rb, wb))
        done += mine
    return out


def critical_groups(plan: Any, conflicts: list | None = None) -> set[int]:
    """Indices (in stage order) of the groups on the longest path by the steps' predicted
    times: the chain that a concurrent group should not slow down."""
    conflicts = group_conflicts(plan) if conflicts is None else conflicts
    index = {key: i for i, (key, _) in enumerate(conflicts)}
    cost = [sum(plan.steps[k].predicted_us + plan.launch_us * plan.steps[k].launches
                for k in plan.stages[si][gi]) for (si, gi), _ in conflicts]
    after: list[list[int]] = [[] for _ in conflicts]
    for i, (_, deps) in enumerate(conflicts):
        for d in deps:
            after[index[d]].append(i)
    rank = [0.0] * len(conflicts)
    for i in reversed(range(len(conflicts))):
        rank[i] = cost[i] + max((rank[j] for j in after[i]), default=0.0)
    path: set[int] = set()
    cur = max(range(len(conflicts)), key=lambda i: rank[i], default=None)
    while cur is not None:
        path.add(cur)
        cur = max(after[cur], key=lambda j: rank[j], default=None)
    return path


def flow_schedule(plan: Any, lanes: int, critical: set[int] | None = None) -> FlowSchedule:
    """The dataflow schedule of ``plan``'s stages on at most ``lanes`` streams (module doc).
    ``critical``: groups (``critical_groups``) to put on lane 1 where that adds no wait, and
    the others off it where they can go elsewhere (lane 1 may then run at a higher priority)."""
    lanes = max(1, int(lanes))
    conflicts = group_conflicts(plan)
    index = {key: i for i, (key, _) in enumerate(conflicts)}
    count = [0] * lanes               # groups enqueued on each lane
    clock = [[0] * lanes for _ in range(lanes)]  # clock[L][M]: groups of M known done on L
    done_clock: list[list[int]] = []  # per group: groups of each lane known done when it ends
    lane_of: list[int] = []
    pos: list[int] = []               # position of each group on its lane
    out: list[FlowGroup] = []
    last_stage = [-1] * lanes
    for i, ((si, gi), deps) in enumerate(conflicts):
        direct = sorted(index[d] for d in deps)
        need = [0] * lanes            # done counts the group needs on each lane, transitively
        for j in direct:
            need = [max(a, b) for a, b in zip(need, done_clock[j])]
        # a lane whose groups so far are all needed anyway: its stream order costs nothing
        free = [L for L in range(lanes) if need[L] >= count[L] and last_stage[L] < si]
        if critical is not None and lanes > 2:
            if i in critical and 1 in free:
                free = [1]
            elif i not in critical:
                free = [L for L in free if L != 1] or free
        if free:
            lane = max(free, key=lambda L: (count[L] > 0 and need[L] == count[L], -L))
        else:  # every lane would add a wait: take the one whose last group is oldest
            lane = min(range(lanes), key=lambda L: (last_stage[L], L))
        cur = list(clock[lane])
        waits = []
        for j in sorted(direct, key=lambda j: -conflicts[j][0][0]):
            L = lane_of[j]
            if L != lane and cur[L] < pos[j] + 1:
                waits.append(j)
                cur = [max(a, b) for a, b in zip(cur, done_clock[j])]
        cur[lane] = count[lane] + 1
        lane_of.append(lane)
        pos.append(count[lane])
        count[lane] += 1
        last_stage[lane] = si
        clock[lane] = cur
        done_clock.append(cur)
        out.append(FlowGroup(si, gi, tuple(plan.stages[si][gi]), lane, tuple(sorted(waits))))
    end = []
    main = list(clock[0])
    last_group = {g.lane: i for i, g in enumerate(out)}  # the last group of each lane
    for L in sorted(range(1, lanes), key=lambda L: -count[L]):
        j = last_group.get(L)
        if j is not None and main[L] < count[L]:
            end.append(j)
            main = [max(a, b) for a, b in zip(main, done_clock[j])]
    used = max(lane_of, default=0) + 1
    return FlowSchedule(tuple(out), used, tuple(sorted(end)))
