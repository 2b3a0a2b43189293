"""Reductions over several non-adjacent axes, split into reductions the generator runs.

A fused kernel reduces one block of adjacent axes of its domain: the trailing ones (rows), the
leading ones (columns) or a middle block (segmented columns). Batch-norm statistics reduce
(0, 2, 3) of [N, C, H, W], which is none of these, and went to a library reduction. Every such
reduction is the same reduction applied block by block (sum, mean over equal-sized groups,
max, min and product are all associative that way), so it is rewritten as a chain: the block
with the most elements first (the largest cut in the data: [N, C, H, W] -> [N, C, 1, 1]), then
the next, keeping dims; a reshape gives the original output shape. The first link reads the
full tensor in a generated row or column reduction; the later ones are small.

Global average / max pooling is the mean / max over the spatial axes, keeping them: written as
that reduction it fuses with its neighbours (a squeeze-excite block's pool and the scaling
after it) instead of being a pooling step of its own.
"""

from __future__ import annotations

import math

from tunedb.graph.ir import Graph, Node, TensorType
from tunedb.graph.ops import canonical_attrs, infer_graph
from tunedb.kernels.domain import REDUCE_OPS

GLOBAL_POOLS = {"global_avg_pool": "reduce_mean", "global_max_pool": "reduce_max"}


def axis_blocks(axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Runs of adjacent axes: (0, 2, 3) -> [(0,), (2, 3)]."""
    runs: list[list[int]] = []
    for ax in sorted(axes):
        if runs and ax == runs[-1][-1] + 1:
            runs[-1].append(ax)
        else:
            runs.append([ax])
    return [tuple(r) for r in runs]


def split_reductions(graph: Graph) -> Graph:
    """``graph`` with every reduction over non-adjacent axes split into a chain of reductions
    over adjacent ones, and global pooling as its reduction (module docstring); ``graph``
    itself when there is neither."""
    types = dict(graph.types)
    taken = set(types)
    nodes: list[Node] = []
    changed = False
    for n in graph.nodes:
        if n.op in GLOBAL_POOLS and types[n.inputs[0]].dtype in ("float32", "float16", "bfloat16"):
            changed = True
            rank = types[n.inputs[0]].rank
            nodes.append(Node(GLOBAL_POOLS[n.op], n.inputs[:1], n.outputs,
                              {"axes": tuple(range(2, rank)), "keepdims": 1}))
            continue
        if n.op not in REDUCE_OPS:
            nodes.append(n)
            continue
        src = types[n.inputs[0]]
        attrs = canonical_attrs(n, [types[v] for v in n.inputs])
        # size-1 dims reduce to themselves: leave them out so [N, 1, H, W] over (0, 2, 3) is one block
        axes = tuple(a for a in attrs["axes"] if src.shape[a] != 1)
        blocks = axis_blocks(axes)
        if len(blocks) < 2:
            nodes.append(n)
            continue
        changed = True
        blocks.sort(key=lambda b: -math.prod(src.shape[a] for a in b))
        shape = list(src.shape)
        cur = n.inputs[0]
        for k, b in enumerate(blocks):
            for a in b:
                shape[a] = 1
            name, j = f"{n.outputs[0]}__part{k}", 0
            while name in taken:
                j += 1
                name = f"{n.outputs[0]}__part{k}_{j}"
            taken.add(name)
            types[name] = TensorType(tuple(shape), src.dtype)
            nodes.append(Node(n.op, (cur,), (name,), {"axes": b, "keepdims": 1}))
            cur = name
        out = n.outputs[0]
        nodes.append(Node("reshape", (cur,), (out,), {"shape": types[out].shape}))
    if not changed:
        return graph
    return infer_graph(Graph(graph.inputs, graph.outputs, tuple(nodes), types, graph.constants, graph.name))
