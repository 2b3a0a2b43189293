"""Intermediate buffers of a plan: one arena shared by liveness, placed greedy-by-size.

Every value a step writes lives from the step that defines it to the last step that reads it
(views extend their source's life and share its bytes; an output view's input, which a matmul
writes before the view step, shares its output's bytes from the matmul on; so does each input of a
concat view, at its slice's offset, from the first producer on). Values are placed
largest first at the lowest arena offset that does not overlap, in time and in space, any value
placed before (the greedy-by-size offset planner of TFLite). Intervals are inclusive, so a step
never reads and writes overlapping bytes. Graph outputs get buffers of their own: the caller keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tunedb.graph.ir import Graph
from tunedb.plan.record import BufferPlan
from tunedb.runtime.executor_views import concat_slices, is_concat_view, is_output_view

ALIGN = 256


def _align(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def _view_sources(step: Any) -> dict[str, str]:
    """Each output of a view step -> the step input whose bytes it shares (a split's outputs
    all share its one input; chains of views are followed back through the step's nodes)."""
    sub = step.graph
    src = dict(zip(sub.inputs, step.inputs))
    for node in sub.nodes:
        for o in node.outputs:
            src[o] = src.get(node.inputs[0], "") if node.inputs else ""
    return {v: src[o] for o, v in zip(sub.outputs, step.outputs) if src.get(o)}


def plan_buffers(graph: Graph, steps: Sequence[Any], times: Sequence[int] | None = None) -> BufferPlan:
    """``times[k]``: when step ``k`` runs (default ``k``). Steps of one IOS stage share a time, so
    values of concurrent steps never share bytes."""
    at = list(times) if times is not None else list(range(len(steps)))
    types = graph.type_map
    external = set(graph.inputs) | set(graph.constant_map)
    alias: dict[str, str] = {}      # view output -> the value whose bytes it shares
    shift: dict[str, int] = {}      # byte offset of an aliased value in its alias (concat slices)
    defined: dict[str, int] = {}
    for k, s in enumerate(steps):
        for v in s.outputs:
            defined.setdefault(v, at[k])
        if is_output_view(s):  # the matmul writes its input into this step's output
            alias[s.inputs[0]] = s.outputs[0]
        elif is_concat_view(s):  # each producer writes its slice of this step's output
            for v, off in concat_slices(s).items():
                alias[v], shift[v] = s.outputs[0], off
        elif s.kind == "layout_view":
            alias.update(_view_sources(s))

    def root(v: str) -> str:
        while v in alias:
            v = alias[v]
        return v

    def offset_in_root(v: str) -> int:
        off = 0
        while v in alias:
            off, v = off + shift.get(v, 0), alias[v]
        return off

    last: dict[str, int] = {}
    members: dict[str, list[str]] = {}
    for v in defined:
        r = root(v)
        members.setdefault(r, []).append(v)
        last[r] = max(last.get(r, defined[r] if r in defined else 0), defined[v])
    for k, s in enumerate(steps):
        for v in s.inputs:
            r = root(v)
            if r in defined:
                last[r] = max(last.get(r, at[k]), at[k])
    outputs = set(graph.outputs)
    sizes: list[int] = [0]
    assign: list[tuple[str, int, int, int]] = []
    arena: list[tuple[int, int, int, str]] = []  # (nbytes, first, last, root)
    for r, vs in members.items():
        if r in external:
            continue  # views of inputs/constants: the runtime reshapes those, no buffer
        nbytes = types[r].nbytes
        if any(v in outputs for v in vs):
            sizes.append(nbytes)
            assign += [(v, len(sizes) - 1, offset_in_root(v), types[v].nbytes) for v in vs]
        else:
            # An output view's root is defined after the matmul that writes through it.
            arena.append((nbytes, min(defined[v] for v in vs), last[r], r))
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, first, last)
    offsets: dict[str, int] = {}
    for nbytes, first, end, r in sorted(arena, key=lambda a: (-a[0], a[1], a[3])):
        size = _align(nbytes)
        busy = sorted((o, o + sz) for o, sz, f, e in placed if not (e < first or end < f))
        off = 0
        for lo, hi in busy:
            if off + size <= lo:
                break
            off = max(off, hi)
        placed.append((off, size, first, end))
        offsets[r] = off
    sizes[0] = max((o + sz for o, sz, _, _ in placed), default=0)
    for _, _, _, r in arena:
        assign += [(v, 0, offsets[r] + offset_in_root(v), types[v].nbytes) for v in members[r]]
    naive = sum(_align(a[0]) for a in arena)
    return BufferPlan(tuple(sizes), tuple(assign), naive)
