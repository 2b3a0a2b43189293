"""Windowed fusion after the search: a depthwise convolution or 2-D pool (a compute step of its
own in ``fusion.explore``), or a resample (a gather along H and/or W, a copy step of its own:
a nearest upsample, both gathers of one taken together) takes in the elementwise work around
it as one generated kernel (``tunedb.kernels.gen_window``) where the roofline says that is
cheaper.

For each window step, in order:

* the *epilogue*: elementwise nodes of fused groups downstream of the window output, shaped like
  it, whose other operands do not depend on the window (BN affine, ReLU6, SiLU, a residual add);
  the rest of a group they leave keeps its kernel and reads the values it needs from the merged
  kernel's outputs;
* the *prologue*: a fused group of elementwise nodes shaped like the window input whose results
  only the window reads (a ReLU before a separable convolution);
* with ``MERGE_PLANE_MEANS``, a mean over the output plane of the window or epilogue values
  (EfficientNet's squeeze-and-excitation pool): the kernel then holds each input plane in shared
  memory (``gen_window``'s plane layout), which also runs an SFU-bound prologue once an element.

A merge is taken when the merged kernel's price (``Coster``: the roofline, bytes over bandwidth,
never below ``MIN_KERNEL_US``) plus one launch, with what is left of the groups it cut, is below what the
replaced steps cost, and the groups still form a DAG. The roofline prices the merged kernel, as
``cost.unseen_by_model`` does for kernels the model never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tunedb.graph.ops import is_elementwise
from tunedb.kernels.gen_resample import gather_axis, is_resample
from tunedb.kernels.gen_window_match import is_window_node, plane_mean
from tunedb.plan.cost import Coster, GroupCost
from tunedb.plan.subgraph import GraphIndex

# On the H200 EfficientNet's SiLU -> dwconv -> SiLU -> SE mean as one plane kernel ran 1.05-1.6x
# faster than its three kernels where the plane fits (56x56 and smaller; generalization_steps_h200).
MERGE_PLANE_MEANS = True


@dataclass(frozen=True)
class WindowMerge:
    window: int                          # node index of the depthwise conv / pool
    nodes: tuple[int, ...]               # the merged kernel's nodes
    replaced: tuple[tuple[int, ...], ...]  # the groups it replaces
    rest: tuple[tuple[int, ...], ...]    # what is left of groups it cut
    before_us: float                     # replaced steps, launches included
    after_us: float                      # merged kernel and the rest, launches included


def _descendants(ix: GraphIndex, j: int) -> set[int]:
    seen: set[int] = set()
    stack = list(ix.succ[j])
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(ix.succ[x])
    return seen


def _acyclic(ix: GraphIndex, groups: Sequence[tuple[int, ...]]) -> bool:
    where = {j: k for k, g in enumerate(groups) for j in g}
    succ = [{where[s] for j in g for s in ix.succ[j]} - {k} for k, g in enumerate(groups)]
    indeg = [0] * len(groups)
    for ss in succ:
        for t in ss:
            indeg[t] += 1
    todo = [k for k in range(len(groups)) if indeg[k] == 0]
    done = 0
    while todo:
        k = todo.pop()
        done += 1
        for t in succ[k]:
            indeg[t] -= 1
            if indeg[t] == 0:
                todo.append(t)
    return done == len(groups)


class WindowPlanner:
    def __init__(self, index: GraphIndex, coster: Coster, launch_us: float) -> None:
        self.ix, self.coster, self.launch_us = index, coster, launch_us

    def score(self, c: GroupCost | None) -> float | None:
        return None if c is None else c.us + self.launch_us * c.launches

    def _epilogue(self, j: int, fused: set[int], desc: set[int]) -> list[int]:
        ix = self.ix
        out = ix.nodes[j].outputs[0]
        shape = ix.types[out].shape
        have = {out}
        epi: list[int] = []
        for c in sorted(desc):  # topological: node indices are
            n = ix.nodes[c]
            if c not in fused or not is_elementwise(n.op) or ix.types[n.outputs[0]].shape != shape:
                continue
            if not any(v in have for v in n.inputs):
                continue
            ok = True
            for v in n.inputs:
                p = ix.producer.get(v)
                if v in have or p is None:
                    continue
                if p[0] in desc:  # an operand computed after the window, outside the epilogue
                    ok = False
            if ok:
                epi.append(c)
                have.add(n.outputs[0])
        if MERGE_PLANE_MEANS:
            epi += [c for c in sorted(desc)  # a reduce_mean group or a global_avg_pool step
                    if plane_mean(ix.graph, ix.nodes[c]) and ix.nodes[c].inputs[0] in have]
        return epi

    def _resample_tail(self, j: int) -> int | None:
        """The gather along the other axis that alone reads resample ``j``'s value, if any;
        -1 when ``j`` itself is such a second gather (taken with its first)."""
        ix = self.ix
        g = ix.graph
        p = ix.producer.get(ix.nodes[j].inputs[0])
        if p is not None and is_resample(g, ix.nodes[p[0]]):
            return -1
        out = ix.nodes[j].outputs[0]
        readers = ix.consumers.get(out, ())
        if len(readers) == 1 and out not in ix.outputs:
            k = next(iter(readers))
            n = ix.nodes[k]
            if (is_resample(g, n) and n.inputs[0] == out
                    and gather_axis(g, n) != gather_axis(g, ix.nodes[j])):
                return k
        return None

    def _prologue(self, j: int, groups: Sequence[tuple[int, ...]], where: dict[int, int],
                  costs: Sequence[GroupCost]) -> tuple[int, ...]:
        ix = self.ix
        x = ix.nodes[j].inputs[0]
        p = ix.producer.get(x)
        if p is None:
            return ()
        k = where[p[0]]
        g = groups[k]
        if costs[k].kind != "fused" or j in g:  # j in g: the search already took it in
            return ()
        shape = ix.types[x].shape
        inside = set(g) | {j}
        for i in g:
            n = ix.nodes[i]
            if not is_elementwise(n.op) or ix.types[n.outputs[0]].shape != shape:
                return ()
            if any(o in ix.outputs or any(c not in inside for c in ix.consumers.get(o, ()))
                   for o in n.outputs):
                return ()
        return g

    def _try(self, j: int, nodes: tuple[int, ...], base: set[int], groups: list[tuple[int, ...]],
             costs: list[GroupCost], where: dict[int, int]
             ) -> tuple[list[tuple[int, ...]], list[GroupCost], WindowMerge] | None:
        """The groups and costs with ``nodes`` as one kernel, if that is legal and cheaper."""
        ix = self.ix
        if len(nodes) == len(base) and len({where[i] for i in base}) == 1:
            return None  # nothing joins (a resample's two gathers, two steps, do join)
        touched = sorted({where[i] for i in nodes})
        rest = [tuple(i for i in groups[k] if i not in nodes) for k in touched]
        rest = [r for r in rest if r]
        merged = self.coster.group(nodes)  # None: outside the window generator
        if merged is None:
            return None
        rest_costs = [self.coster.group(r) for r in rest]
        rest_costs = [None if c is None else self.coster.choose_schedule(r, c)
                      for r, c in zip(rest, rest_costs)]
        if any(c is None for c in rest_costs):
            return None
        new_groups = [g for k, g in enumerate(groups) if k not in touched] + [nodes] + rest
        if not _acyclic(ix, new_groups):
            return None
        before = sum(self.score(costs[k]) for k in touched)
        after = self.score(merged) + sum(self.score(c) for c in rest_costs)
        if after >= before - 1e-9:
            return None
        merge = WindowMerge(j, nodes, tuple(groups[k] for k in touched), tuple(rest),
                            round(before, 4), round(after, 4))
        new_costs = [c for k, c in enumerate(costs) if k not in touched] + [merged] + rest_costs
        return new_groups, new_costs, merge

    def plan(self, groups: list[tuple[int, ...]], costs: list[GroupCost]
             ) -> tuple[list[tuple[int, ...]], list[GroupCost], list[WindowMerge]]:
        """The groups (and their costs) after every merge taken, and the merges."""
        ix = self.ix
        merges: list[WindowMerge] = []
        for j in range(len(ix.nodes)):
            if not ((ix.compute[j] or ix.nodes[j].op == "gather") and is_window_node(ix.graph, ix.nodes[j])):
                continue
            tail = self._resample_tail(j) if ix.nodes[j].op == "gather" else None
            if tail == -1:
                continue
            last = j if tail is None else tail
            where = {i: k for k, g in enumerate(groups) for i in g}
            fused = {i for k, g in enumerate(groups) if costs[k].kind == "fused" for i in g}
            epi = self._epilogue(last, fused, _descendants(ix, last))
            pro = self._prologue(j, groups, where, costs)
            base = set(groups[where[j]]) | (set(groups[where[tail]]) if tail is not None else set())
            plain = {c for c in epi if not plane_mean(ix.graph, ix.nodes[c])}
            tries = [set(epi) | set(pro) | base] + ([set(epi) | base] if pro else [])
            if len(plain) < len(epi):  # a plane too large for the mean: the merge without it
                tries += [plain | set(pro) | base] + ([plain | base] if pro else [])
            for cand in tries:
                taken = self._try(j, tuple(sorted(cand)), base, groups, costs, where)
                if taken is not None:
                    groups, costs, merge = taken
                    merges.append(merge)
                    break
        return groups, costs, merges


def kernel_count(costs: Sequence[GroupCost]) -> int:
    """Launches of a plan's steps (views launch nothing)."""
    return sum(c.launches for c in costs)


def window_fusion(index: GraphIndex, coster: Coster, groups: list[tuple[int, ...]],
                  costs: list[GroupCost], launch_us: float = 2.5
                  ) -> tuple[list[tuple[int, ...]], list[GroupCost], list[WindowMerge]]:
    """Merge window steps with their elementwise neighbours where cheaper; see the module."""
    return WindowPlanner(index, coster, launch_us).plan(list(groups), list(costs))


__all__ = ["WindowMerge", "kernel_count", "window_fusion"]
