"""Graph rewrites before planning that save kernels in attention layers as exporters write them.

Scaled dot-product attention from the dynamo exporter multiplies the transposed queries and
the transposed keys by sqrt(scale) each, and the query, key and value projections are three
GEMMs on the same input, each followed by its bias add. As exported, every head transpose feeds
an elementwise op, so each is a copy kernel, and the scales are one more kernel. Two rewrites:

- ``fold_matmul_scales``: ``matmul(mul(A, c), mul(B, d))`` -> ``mul(matmul(A, B), c*d)`` for
  one-element constants: the scale joins the softmax kernel after the matmul, and the
  transposes feed the matmul directly. Exact in real arithmetic; in floating point the product
  is rounded once instead of each factor (no less accurate).
- ``merge_parallel_matmuls``: GEMMs of one input by constant weights with the same rows (and
  their constant bias adds) become one GEMM on the weights side by side, one bias add and a
  ``split``. Kept only where every part of the split is read by matmuls alone, through
  reshapes and transposes: then the split and the head transposes are strided views
  (``tunedb.plan.views``) and no copy kernel appears. Values are unchanged.

BERT-base goes from 19 kernels a layer to 12 (11 with output views, ``tunedb.plan.views``).

- ``fold_matmul_bias`` (``compile(gemm_epilogue=True)``): ``add(matmul(x, W), b)`` whose add
  would be a kernel of its own (nothing elementwise reads it: the merged QKV projection's add
  feeds a split) becomes ``gemm(x, W, b)`` between two reshapes (views), so the bias is the
  GEMM's epilogue (cuBLASLt's, ``tunedb.runtime.executor_lt``). Values are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tunedb.graph.ir import Constant, Graph, Node, TensorType, fresh_name, spliced_nodes
from tunedb.graph.ops import infer_graph
from tunedb.plan.views import strided_view_nodes, transpose_perm


def _readers(nodes: Sequence[Node]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for v in dict.fromkeys(n.inputs):
            out.setdefault(v, []).append(i)
    return out


def _rebuild(graph: Graph, nodes: Sequence[Node], types: dict[str, TensorType],
             constants: dict[str, Constant]) -> Graph:
    used = {v for n in nodes for v in n.inputs}
    live = {k: c for k, c in constants.items() if k in used}
    defined = set(graph.inputs) | set(live) | {o for n in nodes for o in n.outputs}
    return infer_graph(Graph(graph.inputs, graph.outputs, tuple(nodes),
                             {v: t for v, t in types.items() if v in defined}, live, graph.name))


def fold_matmul_scales(graph: Graph) -> Graph:
    """``matmul(mul(A, c), mul(B, d))`` -> ``mul(matmul(A, B), c*d)`` (module docstring); a
    multiply is taken only when the matmul is its one reader and it does not broadcast."""
    consts, types = dict(graph.constant_map), dict(graph.type_map)
    producer = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    readers = _readers(graph.nodes)
    outputs = set(graph.outputs)
    taken = set(types)
    nodes: list[Node | None] = list(graph.nodes)
    after: dict[int, Node] = {}
    for i, m in enumerate(graph.nodes):
        if m.op != "matmul" or m.inputs[0] == m.inputs[1]:
            continue
        ins, scale = list(m.inputs), 1.0
        for k in (0, 1):
            p = producer.get(ins[k])
            n = graph.nodes[p] if p is not None else None
            if (n is None or n.op != "mul" or nodes[p] is None or ins[k] in outputs
                    or readers.get(ins[k]) != [i]):
                continue
            side = [j for j in (0, 1) if n.inputs[j] in consts and consts[n.inputs[j]].type.numel == 1]
            if len(side) != 1:
                continue
            other = n.inputs[1 - side[0]]
            if types[other].shape != types[ins[k]].shape or types[other].dtype != types[ins[k]].dtype:
                continue
            scale *= float(consts[n.inputs[side[0]]].array.reshape(()))
            ins[k] = other
            nodes[p] = None
        if tuple(ins) == m.inputs:
            continue
        out_t = types[m.outputs[0]]
        raw = fresh_name(taken, f"{m.outputs[0]}__unscaled")
        c = fresh_name(taken, f"{m.outputs[0]}__scale")
        consts[c] = Constant.from_array(np.array(scale, np.float32), out_t.dtype)
        types[raw], types[c] = out_t, consts[c].type
        nodes[i] = Node("matmul", tuple(ins), (raw,), m.attrs)
        after[i] = Node("mul", (raw, c), m.outputs)
    if not after:
        return graph
    order: list[Node] = []
    for i, n in enumerate(nodes):
        if n is not None:
            order.append(n)
        if i in after:
            order.append(after[i])
    return _rebuild(graph, order, types, consts)


def _storage(c: Constant) -> np.ndarray:
    dt = "<u2" if c.type.dtype == "bfloat16" else np.dtype(c.type.dtype).newbyteorder("<")
    return np.frombuffer(c.data, dtype=dt).reshape(c.type.shape)


def _side_by_side(cs: Sequence[Constant]) -> Constant:
    """Constants concatenated along their last axis, bytes unchanged."""
    a = np.concatenate([_storage(c) for c in cs], axis=-1)
    return Constant(TensorType(a.shape, cs[0].type.dtype), np.ascontiguousarray(a).tobytes())


def _bias_add(graph: Graph, consts: dict[str, Constant], readers: dict[str, list[int]],
              v: str) -> tuple[int, str] | None:
    """(index, bias constant) of the one reader of ``v`` when it is ``v + bias[N]``."""
    r = readers.get(v, [])
    if len(r) != 1 or v in graph.outputs:
        return None
    n = graph.nodes[r[0]]
    if n.op != "add" or len(n.inputs) != 2 or v not in n.inputs or n.inputs[0] == n.inputs[1]:
        return None
    b = n.inputs[1] if n.inputs[0] == v else n.inputs[0]
    t = graph.type_of(v)
    if b not in consts or consts[b].type.shape != (t.shape[-1],) or consts[b].type.dtype != t.dtype:
        return None
    return r[0], b


def merge_parallel_matmuls(graph: Graph) -> Graph:
    """GEMMs of one input by constant weights with the same rows, and their bias adds, as one
    GEMM, one add and a ``split`` (module docstring); each group is kept only where its split
    plans as a strided view."""
    for key in list(_parallel_groups(graph)):
        group = _parallel_groups(graph).get(key, [])  # indices move as groups merge
        merged = _merge(graph, group) if len(group) > 1 else None
        if merged is not None:
            graph = merged
    return graph


def _parallel_groups(graph: Graph) -> dict[tuple, list[int]]:
    """(input, weight rows, dtype) -> indices of the matmuls of that input by such constants,
    where there are two or more."""
    consts = graph.constant_map
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        if n.op != "matmul" or n.inputs[0] in consts or n.inputs[1] not in consts:
            continue
        w = consts[n.inputs[1]].type
        if w.rank == 2:
            groups.setdefault((n.inputs[0], w.shape[0], w.dtype), []).append(i)
    return {k: g for k, g in groups.items() if len(g) > 1}


def _merge(graph: Graph, group: list[int]) -> Graph | None:
    consts, types = dict(graph.constant_map), dict(graph.type_map)
    readers = _readers(graph.nodes)
    mms = [graph.nodes[i] for i in group]
    adds = [_bias_add(graph, consts, readers, m.outputs[0]) for m in mms]
    with_bias = all(a is not None for a in adds)
    if not with_bias and any(a is not None for a in adds):
        return None
    if any(m.outputs[0] in graph.outputs for m in mms):
        return None
    taken = set(types)
    x = mms[0].inputs[0]
    w = fresh_name(taken, f"{mms[0].inputs[1]}__merged")
    consts[w] = _side_by_side([consts[m.inputs[1]] for m in mms])
    y = fresh_name(taken, f"{mms[0].outputs[0]}__merged")
    sizes = tuple(consts[m.inputs[1]].type.shape[1] for m in mms)
    xt = types[x]
    types[w], types[y] = consts[w].type, TensorType(xt.shape[:-1] + (sum(sizes),), xt.dtype)
    new = [Node("matmul", (x, w), (y,))]
    drop = set(group)
    if with_bias:
        b = fresh_name(taken, f"{adds[0][1]}__merged")
        consts[b] = _side_by_side([consts[a[1]] for a in adds])
        z = fresh_name(taken, f"{y}__biased")
        types[b], types[z] = consts[b].type, types[y]
        new.append(Node("add", (y, b), (z,)))
        parts = tuple(graph.nodes[a[0]].outputs[0] for a in adds)
        drop |= {a[0] for a in adds}
    else:
        z, parts = y, tuple(m.outputs[0] for m in mms)
    split = Node("split", (z,), parts, {"axis": -1, "sizes": sizes})
    new.append(split)
    order: list[Node] = []
    for i, n in enumerate(graph.nodes):
        if i == group[0]:
            order += new
        if i not in drop:
            order.append(n)
    out = _rebuild(graph, order, types, consts)
    at = out.nodes.index(split)
    found = strided_view_nodes(out.nodes, out.type_map, _readers(out.nodes), set(out.outputs))
    return out if at in found else None


# Readers of a bias add that leave it a kernel of its own (views, GEMMs), so folding it into the
# GEMM saves a kernel; an elementwise reader would take the add into its fused kernel anyway.
_NOT_FUSING = frozenset(("split", "reshape", "squeeze", "unsqueeze", "transpose", "matmul", "gemm"))
_RESHAPES = frozenset(("reshape", "squeeze", "unsqueeze", "identity"))
GEMM_DTYPES = frozenset(("float32", "float16", "bfloat16"))


def fold_matmul_bias(graph: Graph) -> Graph:
    """``add(matmul(x, W), b)`` -> ``reshape(gemm(reshape(x), W, b))`` for constant ``W`` [K, N]
    and ``b`` [N] where only views and GEMMs read the sum (module docstring); a ``gemm`` without
    C (GPT-2's projections) takes the bias as its C. The graph as it is when a rewrite would cost
    a strided view its place."""
    consts, types = dict(graph.constant_map), dict(graph.type_map)
    readers = _readers(graph.nodes)
    producer = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    taken = set(types)
    repl: dict[int, list[Node]] = {}
    drop: set[int] = set()
    for i, n in enumerate(graph.nodes):
        if n.op not in ("matmul", "gemm") or n.inputs[1] not in consts or types[n.inputs[1]].rank != 2:
            continue
        if n.op == "gemm" and (len([v for v in n.inputs if v]) != 2 or n.attr("trans_a")
                               or n.attr("alpha", 1.0) != 1.0):
            continue  # a gemm that already adds C, or scales, or reads A transposed
        x, y = n.inputs[0], n.outputs[0]
        xt = types[x]
        nout = types[y].shape[-1]
        end, add = y, _bias_add(graph, consts, readers, y)
        while add is None and xt.rank == 2:  # GPT-2: the gemm's rows reshaped, then the bias
            r = readers.get(end, [])
            nxt = graph.nodes[r[0]] if len(r) == 1 and end not in graph.outputs else None
            if nxt is None or nxt.op not in _RESHAPES or types[nxt.outputs[0]].shape[-1:] != (nout,):
                break
            end = nxt.outputs[0]
            add = _bias_add(graph, consts, readers, end)
        if add is None or xt.rank < 2 or xt.dtype not in GEMM_DTYPES:
            continue
        a, b = add
        z = graph.nodes[a].outputs[0]
        if z in graph.outputs or not all(graph.nodes[r].op in _NOT_FUSING for r in readers.get(z, ())):
            continue
        if producer.get(x) is None and x not in graph.inputs:
            continue  # a constant left operand: nothing to gain
        trans_b = bool(n.attr("trans_b")) if n.op == "gemm" else False
        k, nout = reversed(types[n.inputs[1]].shape) if trans_b else types[n.inputs[1]].shape
        rows = 1
        for d in xt.shape[:-1]:
            rows *= int(d)
        x2 = fresh_name(taken, f"{x}__rows")
        g2 = fresh_name(taken, f"{z}__gemm")
        types[x2] = TensorType((rows, k), xt.dtype)
        types[g2] = TensorType((rows, nout), xt.dtype)
        gemm = Node("gemm", (x2, n.inputs[1], b), (g2,),
                    {"alpha": 1.0, "beta": 1.0, "trans_a": 0, "trans_b": int(trans_b)})
        if end != y:  # the reshapes stay; the add, now done, becomes a free view of their end
            repl[i] = [Node("gemm", (x, n.inputs[1], b), (y,), gemm.attrs)]
            repl[a] = [Node("identity", (end,), (z,))]
        elif xt.rank == 2:  # no reshapes around it
            repl[i] = [Node("gemm", (x, n.inputs[1], b), (z,), gemm.attrs)]
        else:
            repl[i] = [Node("reshape", (x,), (x2,), {"shape": (rows, k)}), gemm,
                       Node("reshape", (g2,), (z,), {"shape": types[z].shape})]
        drop |= {i, a}
    if not repl:
        return graph
    order = spliced_nodes(graph.nodes, repl, drop)
    out = _rebuild(graph, order, types, consts)
    before = strided_view_nodes(graph.nodes, graph.type_map, readers, set(graph.outputs))
    after = strided_view_nodes(out.nodes, out.type_map, _readers(out.nodes), set(out.outputs))
    return out if len(after) >= len(before) else graph


def _merged_prefix(src: tuple[int, ...], dst: tuple[int, ...]) -> int:
    """How many leading dims of ``src`` the reshape to ``dst`` merges into ``dst[0]`` (the rest
    unchanged); 0 if it is no such reshape or merges fewer than two."""
    if not dst:  # a reshape to a scalar merges everything into no dim at all
        return 0
    rest = len(dst) - 1
    p = len(src) - rest
    if p < 2 or tuple(src[p:]) != tuple(dst[1:]):
        return 0
    prod = 1
    for d in src[:p]:
        prod *= int(d)
    return p if prod == dst[0] else 0


def fold_batch_reshapes(graph: Graph) -> Graph:
    """``reshape(transpose(reshape(x, [B*H, ...]), perm), [B, H, ...])`` with ``perm[0] == 0``
    -> ``transpose(x, perm')``: the exporters' key transpose at batch > 1 (``[B, H, S, D]`` ->
    ``[B*H, S, D]`` -> ``[B*H, D, S]`` -> ``[B, H, D, S]``). Merging B and H of a head view
    needs a copy (the two dims do not step evenly), so without this the transpose is a copy
    kernel and the QKV split no view; one 4-d transpose is a view. Values are unchanged."""
    types = graph.type_map
    readers = _readers(graph.nodes)
    outputs = set(graph.outputs)
    nodes: list[Node | None] = list(graph.nodes)

    def only_reader(v: str) -> int | None:
        r = readers.get(v, [])
        return r[0] if len(r) == 1 and v not in outputs else None

    for i, r1 in enumerate(graph.nodes):
        if r1.op != "reshape" or nodes[i] is None:
            continue
        x, m = r1.inputs[0], r1.outputs[0]
        p = _merged_prefix(types[x].shape, types[m].shape)
        t = only_reader(m) if p else None
        if t is None or graph.nodes[t].op != "transpose":
            continue
        perm = transpose_perm(graph.nodes[t], len(types[m].shape))
        r2 = only_reader(graph.nodes[t].outputs[0])
        if perm[0] != 0 or r2 is None or graph.nodes[r2].op != "reshape":
            continue
        end = graph.nodes[r2].outputs[0]
        tshape = types[graph.nodes[t].outputs[0]].shape
        if tuple(types[end].shape) != tuple(types[x].shape[:p]) + tuple(tshape[1:]):
            continue
        full = tuple(range(p)) + tuple(p - 1 + k for k in perm[1:])
        nodes[i], nodes[t] = None, None
        nodes[r2] = Node("transpose", (x,), (end,), {"perm": full})
    if all(n is not None for n in nodes):
        return graph
    kept = [n for n in nodes if n is not None]
    return _rebuild(graph, kept, dict(graph.type_map), dict(graph.constant_map))


def rewrite_for_plan(graph: Graph) -> Graph:
    """Every rewrite of this module, in the order they need (folded scales first: a scaled
    head would stop its split from being a view; batch reshapes folded before the merge, whose
    split must be a view). ``fold_grouped_kv``
    (tunedb.plan.rewrite_gqa) is not among them: the copy fusion of repeated heads (208fd4d)
    plans Llama in as few kernels, and which runs faster is for the GPU to say."""
    return merge_parallel_matmuls(fold_batch_reshapes(fold_matmul_scales(graph)))
