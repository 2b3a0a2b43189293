"""IOS's second strategy, *merge*: sibling convolutions that read one tensor become one.

Convolutions of one input with the same strides and dilations, ``groups == 1`` and constant
weights (a SqueezeNet fire module's expand1x1 and expand3x3, an Inception block's 1x1 heads) are
one convolution whose filters are the members' filters, each zero-padded into a common kernel
window where its pads put it (a 1x1 with pad 0 sits at the centre of a 3x3 with pad 1), stacked
along output channels, biases stacked likewise. Zero weights add exact zeros, so every output
channel is the member's own. Each member's output is then a channel slice of the merged one.

Two patterns lose their slices: members each read by the same unary elementwise op (their ReLU)
take it once on the merged output; and when the members' outputs (after that op) are exactly the
inputs of one channel concat, in order, the merged output *is* the concat (the fire module: the
concat and one GEMM launch, with the 1x1's bias/ReLU kernel, disappear).

A merge adds FLOPs (the zero taps), so whether it pays is a prediction of the plans with and
without it (``tunedb.plan.stage_refine.compile_staged(merge="auto")``); a merged plan records its
merges in ``plan.search["merged_convs"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tunedb.graph.ir import Constant, Graph, Node, TensorType, fresh_name
from tunedb.graph.ops import ELEMENTWISE_UNARY, conv_out_dim, infer_graph
from tunedb.plan.record import PlanError


@dataclass(frozen=True)
class MergeGroup:
    """Sibling convolutions (node indices, in output-channel order) that merge into one."""
    nodes: tuple[int, ...]
    input: str
    kernel: tuple[int, int]
    pads: tuple[int, int, int, int]
    offsets: tuple[tuple[int, int], ...]   # each member's (row, column) in the merged window


def _window(graph: Graph, members: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int, int, int],
                                                           tuple[tuple[int, int], ...]]:
    """The merged kernel size, pads and each member's offset; PlanError when there is none."""
    nodes = [graph.nodes[i] for i in members]
    (sh, sw), (dh, dw) = nodes[0].attr("strides"), nodes[0].attr("dilations", (1, 1))
    shapes = [graph.type_of(n.inputs[1]).shape for n in nodes]
    pt, pl = max(n.attr("pads")[0] for n in nodes), max(n.attr("pads")[1] for n in nodes)
    offsets = []
    for n in nodes:
        t, left = n.attr("pads")[:2]
        if (pt - t) % dh or (pl - left) % dw:
            raise PlanError(f"conv {n.outputs[0]}: its pads do not fit the common window")
        offsets.append(((pt - t) // dh, (pl - left) // dw))
    kh = max(o[0] + s[2] for o, s in zip(offsets, shapes))
    kw = max(o[1] + s[3] for o, s in zip(offsets, shapes))
    pb = max(n.attr("pads")[2] + (kh - o[0] - s[2]) * dh for n, o, s in zip(nodes, offsets, shapes))
    pr = max(n.attr("pads")[3] + (kw - o[1] - s[3]) * dw for n, o, s in zip(nodes, offsets, shapes))
    _, _, h, w = graph.type_of(nodes[0].inputs[0]).shape
    out = (conv_out_dim(h, kh, sh, pt, pb, dh), conv_out_dim(w, kw, sw, pl, pr, dw))
    for n in nodes:
        if graph.type_of(n.outputs[0]).shape[2:] != out:
            raise PlanError(f"conv {n.outputs[0]}: its output size differs in the common window")
    return (kh, kw), (pt, pl, pb, pr), tuple(offsets)


def check_mergeable(graph: Graph, members: Sequence[int]) -> MergeGroup:
    """The ``MergeGroup`` of these conv nodes, or a PlanError naming why they cannot merge."""
    if len(members) < 2:
        raise PlanError("a merge needs at least two convolutions")
    nodes = [graph.nodes[i] for i in members]
    consts = graph.constant_map
    first = nodes[0]
    for n in nodes:
        name = n.outputs[0]
        if n.op != "conv2d":
            raise PlanError(f"{name} is a {n.op}, not a conv2d")
        if n.inputs[0] != first.inputs[0]:
            raise PlanError(f"conv {name} reads {n.inputs[0]}, not {first.inputs[0]}")
        if n.attr("groups", 1) != 1:
            raise PlanError(f"conv {name} has groups={n.attr('groups')}: only groups=1 merges")
        if n.attr("strides") != first.attr("strides"):
            raise PlanError(f"conv {name} has strides {n.attr('strides')}, not {first.attr('strides')}")
        if n.attr("dilations", (1, 1)) != first.attr("dilations", (1, 1)):
            raise PlanError(f"conv {name} has other dilations than {first.outputs[0]}")
        for v in n.inputs[1:]:
            if v and v not in consts:
                raise PlanError(f"conv {name}: {v} is not a constant (weights must be constant to merge)")
        if graph.type_of(n.outputs[0]).dtype != graph.type_of(first.outputs[0]).dtype:
            raise PlanError(f"conv {name} has another dtype")
    kernel, pads, offsets = _window(graph, members)
    return MergeGroup(tuple(members), first.inputs[0], kernel, pads, offsets)


def merge_candidates(graph: Graph) -> list[MergeGroup]:
    """Every set of sibling convolutions that can merge: per input tensor, the convolutions of
    it grouped by strides and dilations (those that fail ``check_mergeable`` left out)."""
    by_key: dict[tuple, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        if n.op == "conv2d" and n.attr("groups", 1) == 1:
            key = (n.inputs[0], n.attr("strides"), n.attr("dilations", (1, 1)))
            by_key.setdefault(key, []).append(i)
    out = []
    for members in by_key.values():
        members = [i for i in members if all(v in graph.constant_map for v in graph.nodes[i].inputs[1:] if v)]
        if len(members) < 2:
            continue
        try:
            out.append(check_mergeable(graph, members))
        except PlanError:
            continue
    return out


def _readers(graph: Graph) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        for v in dict.fromkeys(n.inputs):
            out.setdefault(v, []).append(i)
    return out


def _shared_unary(graph: Graph, readers: dict[str, list[int]], members: Sequence[int]) -> list[int] | None:
    """The nodes of one unary elementwise op (same attrs) that each member's output alone feeds."""
    found = []
    for i in members:
        y = graph.nodes[i].outputs[0]
        r = readers.get(y, [])
        if len(r) != 1 or y in graph.outputs:
            return None
        u = graph.nodes[r[0]]
        if u.op not in ELEMENTWISE_UNARY or (found and (u.op, u.attrs) != (graph.nodes[found[0]].op,
                                                                            graph.nodes[found[0]].attrs)):
            return None
        found.append(r[0])
    return found


def _concat_of(graph: Graph, readers: dict[str, list[int]], values: Sequence[str]) -> int | None:
    """The concat node (channels) whose inputs are exactly ``values`` in some order, each read
    by it alone."""
    r = [readers.get(v, []) for v in values]
    if any(len(x) != 1 or v in graph.outputs for x, v in zip(r, values)) or len({x[0] for x in r}) != 1:
        return None
    c = graph.nodes[r[0][0]]
    if c.op != "concat" or c.attr("axis") != 1 or sorted(c.inputs) != sorted(values) or \
            len(set(c.inputs)) != len(c.inputs):
        return None
    return r[0][0]


@dataclass(frozen=True)
class MergeDone:
    """One merge made: the members' output names, and the values of the nodes it removed
    (``old``) and added (``new``)."""
    members: tuple[str, ...]
    old: frozenset[str]
    new: frozenset[str]


def merge_sibling_convs(graph: Graph, groups: Sequence[MergeGroup] | None = None
                        ) -> tuple[Graph, list[MergeDone]]:
    """``graph`` with ``groups`` (default: every ``merge_candidates`` group) merged, and a
    ``MergeDone`` for each."""
    groups = merge_candidates(graph) if groups is None else list(groups)
    if not groups:
        return graph, []
    consts, types = dict(graph.constant_map), dict(graph.type_map)
    taken = set(types) | set(consts)
    readers = _readers(graph)
    drop: set[int] = set()
    at: dict[int, list[Node]] = {}   # new nodes, placed where the last dropped node was
    done: list[MergeDone] = []
    for g in groups:
        g = check_mergeable(graph, g.nodes)  # recheck: a caller's group may not fit this graph
        members = list(g.nodes)
        unary = _shared_unary(graph, readers, members)
        tails = [graph.nodes[u].outputs[0] for u in unary] if unary else [graph.nodes[i].outputs[0]
                                                                          for i in members]
        concat = _concat_of(graph, readers, tails)
        if concat is not None:  # channels in the concat's order
            order = [tails.index(v) for v in graph.nodes[concat].inputs]
            members, tails = [members[k] for k in order], [tails[k] for k in order]
            offsets = [g.offsets[k] for k in order]
            unary = [unary[k] for k in order] if unary else None
        else:  # slices: each branch keeps its own bias and activation, fused after its slice
            offsets, unary, tails = list(g.offsets), None, [graph.nodes[i].outputs[0] for i in members]
        nodes = [graph.nodes[i] for i in members]
        first = nodes[0]
        wts = [consts[n.inputs[1]].array for n in nodes]
        dtype = consts[first.inputs[1]].type.dtype
        kh, kw = g.kernel
        c_in = wts[0].shape[1]
        weight = np.zeros((sum(w.shape[0] for w in wts), c_in, kh, kw), np.float32)
        bias = np.zeros(weight.shape[0], np.float32)
        has_bias, row = False, 0
        for n, w, (oy, ox) in zip(nodes, wts, offsets):
            weight[row:row + w.shape[0], :, oy:oy + w.shape[2], ox:ox + w.shape[3]] = w
            if len(n.inputs) > 2 and n.inputs[2] and concat is not None:
                bias[row:row + w.shape[0]] = consts[n.inputs[2]].array
                has_bias = True
            row += w.shape[0]
        base = "+".join(n.outputs[0] for n in nodes)
        w_name = fresh_name(taken, f"merged({base}).weight", sep="")
        consts[w_name] = Constant.from_array(weight, dtype)
        taken.add(w_name)
        ins = [first.inputs[0], w_name]
        if has_bias:
            b_name = fresh_name(taken, f"merged({base}).bias", sep="")
            consts[b_name] = Constant.from_array(bias, dtype)
            taken.add(b_name)
            ins.append(b_name)
        out_t = graph.type_of(first.outputs[0])
        merged_t = TensorType((out_t.shape[0], weight.shape[0]) + out_t.shape[2:], out_t.dtype)
        attrs = {**first.attr_dict, "pads": g.pads, "groups": 1}
        new: list[Node] = []
        y = fresh_name(taken, f"merged({base})", sep="")
        taken.add(y)
        types[y] = merged_t
        new.append(Node("conv2d", tuple(ins), (y,), attrs))
        if unary:
            z = (graph.nodes[concat].outputs[0] if concat is not None
                 else fresh_name(taken, f"{y}.act", sep=""))
            taken.add(z)
            types[z] = merged_t
            u = graph.nodes[unary[0]]
            new.append(Node(u.op, (y,), (z,), u.attrs))
            drop.update(unary)
            y = z
        elif concat is not None:  # the merged conv writes the concat's value itself
            new[0] = Node("conv2d", tuple(ins), (graph.nodes[concat].outputs[0],), attrs)
            types[graph.nodes[concat].outputs[0]] = merged_t
        if concat is not None:
            drop.add(concat)
        else:
            row = 0
            for v, n, w in zip(tails, nodes, wts):
                part = {"starts": (row,), "ends": (row + w.shape[0],), "axes": (1,), "steps": (1,)}
                row += w.shape[0]
                if len(n.inputs) < 3 or not n.inputs[2]:
                    new.append(Node("slice", (y,), (v,), part))
                    continue
                raw, shaped = fresh_name(taken, f"{v}.part", sep=""), fresh_name(taken, f"{v}.bias", sep="")
                taken.update((raw, shaped))
                types[raw], types[shaped] = graph.type_of(v), TensorType((w.shape[0], 1, 1), dtype)
                new += [Node("slice", (y,), (raw,), part), Node("reshape", (n.inputs[2],), (shaped,),
                                                                {"shape": (w.shape[0], 1, 1)}),
                        Node("add", (raw, shaped), (v,))]
        drop.update(members)
        # the merged nodes go where the first member was: its readers come later in the order
        at.setdefault(min(members), []).extend(new)
        removed = [*members, *(unary or ()), *([concat] if concat is not None else [])]
        done.append(MergeDone(tuple(n.outputs[0] for n in nodes),
                              frozenset(graph.nodes[i].outputs[0] for i in removed),
                              frozenset(o for n in new for o in n.outputs)))
    order: list[Node] = []
    for i, n in enumerate(graph.nodes):
        order.extend(at.get(i, ()))
        if i not in drop:
            order.append(n)
    used = {v for n in order for v in n.inputs}
    live = {k: c for k, c in consts.items() if k in used}
    defined = set(graph.inputs) | set(live) | {o for n in order for o in n.outputs}
    out = infer_graph(Graph(graph.inputs, graph.outputs, tuple(order),
                            {v: t for v, t in types.items() if v in defined}, live, graph.name))
    return out, done


def bind_constants(graph: Graph, values: dict[str, np.ndarray], names: Sequence[str]) -> Graph:
    """``graph`` with the inputs ``names`` turned into constants holding ``values`` (a model's
    weights, fed as inputs, become the constants a merge needs)."""
    consts = dict(graph.constant_map)
    for v in names:
        if v not in graph.inputs:
            raise PlanError(f"{v} is not an input of the graph")
        consts[v] = Constant.from_array(np.asarray(values[v]), graph.type_of(v).dtype)
    inputs = tuple(v for v in graph.inputs if v not in set(names))
    return infer_graph(Graph(inputs, graph.outputs, graph.nodes, graph.type_map, consts, graph.name))
