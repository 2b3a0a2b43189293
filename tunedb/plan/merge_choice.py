"""Which sibling-convolution merges (``tunedb.plan.merge``) a plan takes.

A merge saves launches (one GEMM, an im2col, the branches' bias/ReLU kernels, a concat) and
adds the FLOPs of its zero taps, so it pays at batch 1 and may lose at batch 16. ``merge="auto"``
prices both sides from the plans themselves: the plan of the graph without merges and the plan
with every merge, each without stages or packs; a merge is kept where the predicted µs (kernel
time plus launches) of the steps computing its merged nodes is below that of the steps
computing the nodes it replaces, and where its zero taps at the GPU's peak FLOP rate
(``zero_tap_us``) cost less than the launches it saves (the estimator put SqueezeNet b16's
merges 10 % ahead; the H200 measured them 0.6 % behind). Those prices are local, so whole
plans decide: the plans with the kept merges, with the merges that add no zero taps (members of
one kernel size: Inception's 1x1 heads), with every merge whose zero taps are cheap, and with
none are compiled and the least predicted stage sum
(``predicted_total``) wins; a merge also takes away concurrency the stages had (Inception's 1x1
heads ran side by side).
``plan.search`` records them (``merged_convs``: each merge's member convolutions) and the
prices (``merge_priced``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from tunedb.plan.merge import MergeDone, MergeGroup, merge_candidates, merge_sibling_convs
from tunedb.plan.record import Plan, PlanError
from tunedb.plan.stage_refine import predicted_total

MERGE_MODES = (False, True, "exact", "auto")
PEAK_FLOPS = 60e12   # fp32 without TF32: StageEstimator's compute roofline
# zero taps must cost under half the launches saved: at SqueezeNet b16 the two merges whose taps
# cost 6.7 of 7.5 us saved ran 2.7 % behind the sequential plan on the H200 (v5)
ZERO_TAP_MARGIN = 2.0


def zero_tap_us(graph: Any, group: MergeGroup) -> float:
    """The time the merged convolution's zero taps take at the GPU's peak: the FLOPs the merge
    adds. At SqueezeNet b16 they outweigh the launches a merge saves (v5: merged 0.6 % slower)."""
    first = graph.nodes[group.nodes[0]]
    n, _, oh, ow = graph.type_of(first.outputs[0]).shape
    cin = graph.type_of(first.inputs[0]).shape[1]
    window = group.kernel[0] * group.kernel[1]
    added = sum(w.shape[0] * (window - w.shape[2] * w.shape[3])
                for w in (graph.type_of(graph.nodes[i].inputs[1]) for i in group.nodes))
    return 2.0 * n * oh * ow * cin * added / PEAK_FLOPS * 1e6


def _touches(value: str, names: Collection[str]) -> bool:
    """``value`` is one of ``names`` or a value a plan rewrite split off it (``v.nobias``)."""
    return any(value == n or value.startswith(n + ".") for n in names)


def region_us(plan: Plan, values: Collection[str]) -> tuple[float, int]:
    """Predicted µs (kernels and their launches) and launches of the steps that compute any of
    ``values``."""
    nodes = plan.graph.nodes
    total, launches = 0.0, 0
    for s in plan.steps:
        if any(_touches(o, values) for i in s.nodes for o in nodes[i].outputs):
            total += s.predicted_us + s.launches * plan.launch_us
            launches += s.launches
    return total, launches


def compile_merged(compile_fn: Callable[..., Plan], graph: Any, merge: bool | str,
                   measure_top: int = 0) -> Plan:
    """``compile_fn(graph)`` on ``graph`` with sibling convolutions merged: all that can
    (``merge=True``), those whose members share one kernel size (``"exact"``: no zero taps) or
    those the prices say pay (``"auto"``). ``measure_top``: what ``compile_fn`` measures with;
    ``"auto"`` compares its candidate plans without measuring and measures only the winner's."""
    if merge not in MERGE_MODES:
        raise PlanError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
    groups = merge_candidates(graph)
    exact = [g for g in groups if all(graph.type_of(graph.nodes[i].inputs[1]).shape[2:] == g.kernel
                                      for i in g.nodes)]  # no zero taps: no FLOPs added
    if merge == "exact":
        groups = exact
    if merge in (True, "exact") or not groups:
        merged, done = merge_sibling_convs(graph, groups) if groups else (graph, [])
        plan = compile_fn(merged)
        search = {**dict(plan.search), "merge": str(merge), "merged_convs": [list(d.members) for d in done]}
        return replace(plan, search=search, steps=_noted(plan, done))
    flat = dict(schedule="sequential", pack=False, horizontal=False, measure_top=0)
    g_all, done_all = merge_sibling_convs(graph, groups)
    plain, merged_all = compile_fn(graph, **flat), compile_fn(g_all, **flat)
    priced, keep, cheap = [], [], []
    for g, d in zip(groups, done_all):
        (before, n_before), (after, n_after) = region_us(plain, d.old), region_us(merged_all, d.new)
        zeros, saved = zero_tap_us(graph, g), (n_before - n_after) * plain.launch_us
        priced.append({"members": list(d.members), "unmerged_us": round(before, 2),
                       "merged_us": round(after, 2), "zero_tap_us": round(zeros, 2),
                       "launches_saved_us": round(saved, 2)})
        if ZERO_TAP_MARGIN * zeros < saved:  # the zero taps cost well under the launches saved
            cheap.append(g)
            if after < before:
                keep.append(g)
    # whole plans decide (the prices are local); each distinct set of merges compiled once
    plan = compile_fn(graph, measure_top=0)
    totals = {"unmerged_predicted_us": round(predicted_total(plan), 2)}
    best, done, best_graph = totals["unmerged_predicted_us"], [], graph
    tried: list[list[Any]] = []
    for name, sel in (("merge_predicted_us", keep), ("merge_exact_predicted_us", exact),
                      ("merge_all_predicted_us", cheap)):
        if not sel or sel in tried:
            continue
        tried.append(sel)
        g2, d2 = merge_sibling_convs(graph, sel)
        p2 = compile_fn(g2, measure_top=0)
        totals[name] = round(predicted_total(p2), 2)
        if totals[name] < best:
            plan, done, best, best_graph = p2, d2, totals[name], g2
    if measure_top:  # one plan measured (its kernels, stages or packs), not every candidate
        plan = compile_fn(best_graph)
    search = {**dict(plan.search), "merge": str(merge), **totals,
              "merged_convs": [list(d.members) for d in done], "merge_priced": priced}
    return replace(plan, search=search, steps=_noted(plan, done))


def _noted(plan: Plan, done: list[MergeDone]) -> tuple[Any, ...]:
    """The plan's steps, each step that runs a merged convolution noting its members."""
    nodes = plan.graph.nodes
    out = []
    for s in plan.steps:
        hit = [d for d in done if s.kind != "layout_view" and any(
            nodes[i].op == "conv2d" and _touches(o, d.new) for i in s.nodes for o in nodes[i].outputs)]
        note = "; ".join(f"merged conv {'+'.join(d.members)}" for d in hit)
        out.append(replace(s, note="; ".join(x for x in (s.note, note) if x)) if note else s)
    return tuple(out)
