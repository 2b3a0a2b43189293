"""Grouped-query attention without the key/value copies.

Llama-family models (and any with fewer key/value heads than query heads) repeat each key/value
head for its group of query heads before the two attention matmuls, as the exporters write
``repeat_kv``: ``unsqueeze(X, 2)`` -> ``expand`` to ``[b, kv, G, n, d]`` -> ``reshape`` to
``[b, kv*G, n, d]`` (for the keys also a transpose of the last two dims). The expand is a
copy kernel, and the head transpose before it can no longer be a strided view, so each layer
pays two or three copies. ``fold_grouped_kv`` multiplies each key/value head by its whole
group of query rows instead::

    matmul(A[b, kv*G, m, k], repeat(X)[b, kv*G, k, n])
      -> reshape(matmul(reshape(A)[b, kv, G*m, k], X[b, kv, k, n]), [b, kv*G, m, n])

Head ``kv*G + g`` of ``A`` is rows ``g*m .. g*m + m`` of group ``kv`` in the reshaped ``A``, so
the values are the same products and sums. The chain from the expand to the matmul is checked
by running it on the element indices of ``X`` (the reference), so only a plain repeat or a
repeat followed by a transpose of the last two dims is taken. The PV product's rows are then
``g*m + i`` within a key/value head, so moving the heads back to rows is a copy, not an output
view: Llama-small (4 layers) plans 68 kernels instead of 76 (3 copies a layer become 1).

Not applied by ``rewrite_for_plan``: since the copy fusion of repeated heads (tunedb.kernels,
208fd4d) Llama-small plans 67-68 kernels either way, with no repeat copy of its own. Here no
data is repeated at all, there the value repeat is one fused copy and the heads go back as a
view. Call it on a graph before ``tunedb.compile`` to plan this way; which is faster needs
the GPU (tests/test_zoo_gqa_plan.py).
"""

from __future__ import annotations

import numpy as np

from tunedb.graph.ir import Graph, Node, TensorType, fresh_name, spliced_nodes
from tunedb.graph.ops import infer_graph
from tunedb.graph.reference import run_reference

_CHAIN_OPS = frozenset(("reshape", "transpose"))
_LARGEST_INDEX = 2**24  # float32 holds every index below this exactly


def _repeat_chain(graph: Graph, b: str, producer: dict[str, int], readers: dict[str, list[int]]
                  ) -> tuple[list[int], int, int, str] | None:
    """``(chain node ids, expand id, unsqueeze id, X)`` when ``b`` is ``X`` repeated per group
    through single-reader reshapes/transposes, else None."""
    outputs = set(graph.outputs)
    chain: list[int] = []
    v = b
    while v in producer and graph.nodes[producer[v]].op in _CHAIN_OPS:
        if v in outputs or len(readers.get(v, [])) != 1:
            return None
        chain.append(producer[v])
        v = graph.nodes[producer[v]].inputs[0]
    if v not in producer or graph.nodes[producer[v]].op != "expand" or v in outputs:
        return None
    if len(readers.get(v, [])) != 1:
        return None
    e = producer[v]
    u = graph.nodes[e].inputs[0]
    if u not in producer or graph.nodes[producer[u]].op != "unsqueeze" or u in outputs:
        return None
    if len(readers.get(u, [])) != 1 or tuple(graph.nodes[producer[u]].attr("axes", ())) != (2,):
        return None
    return chain[::-1], e, producer[u], graph.nodes[producer[u]].inputs[0]


def _layout(graph: Graph, nodes: list[Node], x: str, b: str) -> str | None:
    """``"plain"`` or ``"transposed"``: what ``nodes`` (unsqueeze, expand, chain) make of ``x``,
    found by running them on ``x``'s element indices; None for anything else."""
    types = graph.type_map
    xs = types[x].shape
    if int(np.prod(xs)) >= _LARGEST_INDEX:
        return None
    f32 = {v: TensorType(t.shape, "float32") for v, t in types.items()
           if v == x or any(v in n.outputs for n in nodes)}
    probe = infer_graph(Graph((x,), (b,), tuple(nodes), f32))
    idx = np.arange(int(np.prod(xs)), dtype=np.float32).reshape(xs)
    got = run_reference(probe, {x: idx})[b]
    bs = types[b].shape
    plain = np.broadcast_to(idx[:, :, None], (xs[0], xs[1], bs[1] // xs[1], *xs[2:])).reshape(bs)
    if np.array_equal(got, plain):
        return "plain"
    flipped = np.swapaxes(np.broadcast_to(idx[:, :, None], (xs[0], xs[1], bs[1] // xs[1], *xs[2:]))
                          .reshape(xs[0], bs[1], *xs[2:]), -1, -2)
    if flipped.shape == tuple(bs) and np.array_equal(got, flipped):
        return "transposed"
    return None


def fold_grouped_kv(graph: Graph) -> Graph:
    """Every ``matmul`` whose right operand is a repeated key/value head: one matmul per
    key/value head on its group's query rows (module docstring). Values are unchanged."""
    types = dict(graph.type_map)
    producer = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        for v in dict.fromkeys(n.inputs):
            readers.setdefault(v, []).append(i)
    taken = set(types)
    repl: dict[int, list[Node]] = {}
    drop: set[int] = set()
    for i, m in enumerate(graph.nodes):
        if m.op != "matmul" or len(m.inputs) != 2:
            continue
        a, b = m.inputs
        found = _repeat_chain(graph, b, producer, readers)
        if found is None:
            continue
        chain, e, u, x = found
        xs, as_, bs, ys = (types[v].shape for v in (x, a, b, m.outputs[0]))
        if len(xs) != 4 or len(as_) != 4 or len(bs) != 4 or as_[1] != bs[1] or bs[1] % xs[1]:
            continue
        kv, group = xs[1], bs[1] // xs[1]
        if group < 2 or as_[0] != xs[0]:
            continue
        layout = _layout(graph, [graph.nodes[j] for j in (u, e, *chain)], x, b)
        if layout is None:
            continue
        dtype = types[a].dtype
        a2 = fresh_name(taken, f"{a}__grouped")
        y2 = fresh_name(taken, f"{m.outputs[0]}__grouped")
        types[a2] = TensorType((as_[0], kv, group * as_[2], as_[3]), dtype)
        types[y2] = TensorType((ys[0], kv, group * ys[2], ys[3]), types[m.outputs[0]].dtype)
        new = [Node("reshape", (a,), (a2,), {"shape": types[a2].shape})]
        xb = x
        if layout == "transposed":
            xb = fresh_name(taken, f"{x}__t")
            types[xb] = TensorType((*xs[:2], xs[3], xs[2]), types[x].dtype)
            new.append(Node("transpose", (x,), (xb,), {"perm": (0, 1, 3, 2)}))
        new += [Node("matmul", (a2, xb), (y2,)),
                Node("reshape", (y2,), m.outputs, {"shape": ys})]
        repl[i] = new
        drop |= {i, e, u, *chain}
    if not repl:
        return graph
    order = spliced_nodes(graph.nodes, repl, drop)
    used = {v for n in order for v in n.inputs}
    consts = {k: c for k, c in graph.constant_map.items() if k in used}
    defined = set(graph.inputs) | set(consts) | {o for n in order for o in n.outputs}
    return infer_graph(Graph(graph.inputs, graph.outputs, tuple(order),
                             {v: t for v, t in types.items() if v in defined}, consts, graph.name))
