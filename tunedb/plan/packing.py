"""Which independent GEMM-like steps of a graph (or of several tenants' plans) to launch together.

``gemm_member`` reads a ``matmul`` / ``gemm`` / ``conv2d`` node as a packing ``Member`` (a conv
as its im2col GEMM; a weight that is a constant or graph input gets that value's name as its
weight tag, so two nodes reading one weight share it). ``ready_sets`` groups the GEMM-like nodes
of a graph by GEMM depth (1 + the deepest GEMM-like ancestor): nodes of one depth never depend on
each other, so each group of two or more is one packing opportunity (BERT's Q/K/V projections,
an Inception block's parallel 1x1 convolutions). ``pack_tenants`` forms the workload of several
plans' ready layers. ``choose`` ranks a workload's candidates with a packing cost model (or, with
none, the rule of the bench: one padded call where it exists, else 8 streams) and keeps serial
when no candidate is predicted to beat it by ``min_gain``: packing must pay.

This module plans only; executing a pack step inside a plan is not wired yet (docs/packing.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import canonical_attrs, infer_graph
from tunedb.kernels.packing import Candidate, Member, PackingWorkload, candidates

GEMM_OPS = ("matmul", "gemm", "conv2d")
PACK_DTYPES = ("float32", "bfloat16", "float16")


def gemm_member(graph: Graph, node: Node, label: str = "") -> Member | None:
    """``node`` as one packing member, or None (not GEMM-like, a broadcast batch, grouped conv,
    an unsupported dtype)."""
    if node.op not in GEMM_OPS:
        return None
    types = graph.type_map
    ins = [types[v] for v in node.inputs]
    if ins[0].dtype not in PACK_DTYPES:
        return None
    named = {v for v, _ in graph.constants} | set(graph.inputs)
    tag = node.inputs[1] if node.inputs[1] in named else ""
    dt = ins[0].dtype
    if node.op == "matmul":
        xs, ws = ins[0].shape, ins[1].shape
        if len(xs) < 2 or len(ws) < 2:
            return None
        if len(ws) == 2:  # a linear layer: every leading dim of x is rows
            return Member(math.prod(xs[:-1]), ws[1], ws[0], dtype=dt, weight=tag, label=label)
        if xs[:-2] != ws[:-2]:
            return None
        return Member(xs[-2], ws[-1], xs[-1], batch=math.prod(xs[:-2]), dtype=dt, kind="bgemm",
                      weight=tag, label=label)
    attrs = canonical_attrs(node, ins)
    if node.op == "gemm":
        if attrs["trans_a"]:
            return None
        m, k = ins[0].shape
        n = ins[1].shape[0] if attrs["trans_b"] else ins[1].shape[1]
        return Member(m, n, k, dtype=dt, layout="nt" if attrs["trans_b"] else "nn", weight=tag,
                      label=label)
    if attrs["groups"] != 1:
        return None
    out = types[node.outputs[0]].shape
    o, c, kh, kw = ins[1].shape
    return Member(out[0] * out[2] * out[3], o, c * kh * kw, dtype=dt, kind="conv", weight=tag,
                  label=label)


def ready_sets(graph: Graph) -> list[list[Node]]:
    """GEMM-like nodes grouped by GEMM depth, groups of two or more, in depth order."""
    graph = infer_graph(graph)
    depth: dict[str, int] = {}  # value -> deepest GEMM-like producer on any path to it
    groups: dict[int, list[Node]] = {}
    for node in graph.nodes:  # topological order
        d = max((depth.get(v, 0) for v in node.inputs), default=0)
        if node.op in GEMM_OPS:
            d += 1
            groups.setdefault(d, []).append(node)
        for v in node.outputs:
            depth[v] = d
    return [groups[d] for d in sorted(groups) if len(groups[d]) > 1]


def graph_workloads(graph: Graph, name: str, family: str = "graphs") -> list[PackingWorkload]:
    """The packing workloads inside ``graph``: one per ready set, members of one dtype."""
    graph = infer_graph(graph)
    out = []
    for i, nodes in enumerate(ready_sets(graph)):
        by_dtype: dict[str, list[Member]] = {}
        for node in nodes:
            mb = gemm_member(graph, node, label=node.outputs[0])
            if mb is not None:
                by_dtype.setdefault(mb.dtype, []).append(mb)
        for dt, ms in sorted(by_dtype.items()):
            if len(ms) > 1:
                out.append(PackingWorkload(f"{name}.set{i}.{dt}", family, tuple(ms)))
    return out


def pack_tenants(layers: Sequence[Sequence[Member]], name: str) -> PackingWorkload:
    """The ready layers of several plans (one list of members per tenant) as one workload;
    labels say which tenant each member came from, weight tags stay per tenant."""
    ms = []
    for t, layer in enumerate(layers):
        for mb in layer:
            ms.append(Member(mb.m, mb.n, mb.k, mb.batch, mb.dtype, mb.layout, mb.kind,
                             f"t{t}.{mb.weight}" if mb.weight else "", f"t{t}.{mb.label}"))
    return PackingWorkload(name, "tenants", tuple(ms))


def choose(w: PackingWorkload, model: Any = None, min_gain: float = 0.05
           ) -> tuple[Candidate, list[tuple[str, float | None]]]:
    """The candidate to run and the ranking it came from (name, predicted µs or None).

    With ``model`` (a booster of ``tunedb.costmodel.packing``, passed in by the caller so that
    planning does not depend on the cost-model layer) the fastest prediction wins unless it beats
    serial by less than ``min_gain``; without, the rule."""
    cands = candidates(w)
    serial = next(c for c in cands if c.name == "whole:serial")
    if model is None:
        names = [c.name for c in cands]
        for want in ("whole:padded", "whole:streams8"):
            if want in names:
                return cands[names.index(want)], [(want, None)]
        return serial, [(serial.name, None)]
    pred = np.asarray(model(w, cands), dtype=float)
    order = np.argsort(pred, kind="stable")
    ranking = [(cands[i].name, float(pred[i])) for i in order]
    best = cands[int(order[0])]
    serial_us = float(pred[cands.index(serial)])
    if best is not serial and pred[order[0]] > serial_us * (1.0 - min_gain):
        return serial, ranking
    return best, ranking
