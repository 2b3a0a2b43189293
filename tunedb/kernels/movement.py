"""Data movement as index maps: a concat of slices becomes rolled reads and a select.

Rotary embeddings rotate half of each head, ``concat(-x[..., h:], x[..., :h])``, and a KV-cache
update appends ``concat(past, new)``: as ops, every slice and the concat are copies between
kernels (7 kernels for a rotary embedding in issue 21). Evaluated at element c of the concat's
axis, branch k is its own elementwise chain over the source read at c - o_k + start_k, so the
concat is

    where(c < o_1, branch_0(x_0 read rolled), where(c < o_2, branch_1(...), ...))

with each branch evaluated at full size. ``lower_concats`` rewrites the subgraph that way before
it is classified: a read rolled along the concat axis is ``gather(x, [(c + s) % n for c], axis)``
(the analysis turns it into an index map of ``x``, never a copy) and the conditions are small
boolean constants along the axis. Every element computes each branch; the branches are cheap
elementwise chains (negation, casts, scalar scales), and the reads hit the same cache lines.
"""

from __future__ import annotations

import numpy as np

from tunedb.graph.ir import Constant, Graph, Node, TensorType, fresh_name, spliced_nodes
from tunedb.graph.ops import canonical_attrs, infer_graph

# ops a branch may apply between its slice and the concat (one tensor operand, scalars besides)
BRANCH_OPS = frozenset((
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid",
    "relu", "erf", "floor", "ceil", "sign", "gelu", "clip", "cast", "leaky_relu",
    "add", "sub", "mul", "div", "pow", "max", "min"))


def _branch(graph: Graph, v: str, axis: int, producer: dict[str, Node], readers: dict[str, int],
            outputs: set[str]) -> tuple[list[Node], str, int, Node | None] | None:
    """(chain nodes from the source outwards, source input, start on ``axis``, the slice) of a
    concat input, or None when it is not an elementwise chain over a slice of a graph input."""
    consts, types = graph.constant_map, graph.type_map
    chain: list[Node] = []
    while v in producer and producer[v].op in BRANCH_OPS:
        n = producer[v]
        tensors = [i for i in n.inputs if not (i in consts and consts[i].type.numel == 1)]
        if len(tensors) != 1 or types[tensors[0]].shape != types[v].shape:
            return None
        if chain and (readers.get(v, 0) != 1 or v in outputs):
            return None
        chain.append(n)
        v = tensors[0]
    if chain and (readers.get(v, 0) != 1 or v in outputs):
        return None
    if v in graph.inputs:
        return chain[::-1], v, 0, None
    n = producer.get(v)
    if n is None or n.op != "slice":
        return None  # (a slice of a transposed input passes: the analysis composes the reads)
    attrs = canonical_attrs(n, [types[n.inputs[0]]])
    src = types[n.inputs[0]]
    out = types[v]
    if any(st != 1 for st in attrs["steps"]):
        return None
    if any(src.shape[d] != out.shape[d] for d in range(src.rank) if d != axis):
        return None  # sliced on another axis too: not a read along the concat axis
    start = 0
    for ax, s in zip(attrs["axes"], attrs["starts"]):
        if ax == axis:
            start = s if s >= 0 else s + src.shape[axis]
    return chain[::-1], n.inputs[0], max(0, start), n


def lower_concats(graph: Graph) -> Graph:
    """``graph`` with each concat whose inputs are elementwise chains over slices of graph
    inputs (or graph inputs themselves) rewritten as rolled reads and selects (module
    docstring); ``graph`` itself when there is none. Values and outputs are unchanged."""
    producer = {o: n for n in graph.nodes for o in n.outputs}
    readers: dict[str, int] = {}
    for n in graph.nodes:
        for v in set(n.inputs):
            readers[v] = readers.get(v, 0) + 1
    outputs = set(graph.outputs)
    types = dict(graph.types)
    consts = list(graph.constants)
    drop: set[int] = set()
    replace: dict[int, list[Node]] = {}
    taken = set(types)

    ids = {id(n): i for i, n in enumerate(graph.nodes)}
    for i, n in enumerate(graph.nodes):
        if n.op != "concat":
            continue
        t = types[n.outputs[0]]
        axis = canonical_attrs(n, [types[v] for v in n.inputs])["axis"]
        branches = [_branch(graph, v, axis, producer, readers, outputs) for v in n.inputs]
        if any(b is None for b in branches) or any(readers.get(v, 0) != 1 for v in set(n.inputs)):
            continue
        new: list[Node] = []
        vals: list[str] = []
        off = 0
        for v, (chain, src, start, cut) in zip(n.inputs, branches):
            st = types[src]
            idx = np.array([(c - off + start) % st.shape[axis] for c in range(t.shape[axis])], np.int64)
            cname = fresh_name(taken, f"{n.outputs[0]}__roll{len(vals)}")
            consts.append((cname, Constant(TensorType((len(idx),), "int64"), idx.tobytes())))
            types[cname] = TensorType((len(idx),), "int64")
            cur = fresh_name(taken, f"{n.outputs[0]}__read{len(vals)}")
            types[cur] = TensorType(t.shape, st.dtype)
            new.append(Node("gather", (src, cname), (cur,), {"axis": axis}))
            for c in chain:
                out = fresh_name(taken, f"{c.outputs[0]}__full")
                scalar = graph.constant_map
                ins = tuple(x if x in scalar and scalar[x].type.numel == 1 else cur for x in c.inputs)
                types[out] = TensorType(t.shape, types[c.outputs[0]].dtype)
                new.append(Node(c.op, ins, (out,), c.attrs))
                drop.add(ids[id(c)])
                cur = out
            if cut is not None:
                drop.add(ids[id(cut)])
            vals.append(cur)
            off += types[v].shape[axis]
        # select from the last branch backwards: element c of the axis takes branch k when c < o_{k+1}
        acc = vals[-1]
        bounds = np.cumsum([types[v].shape[axis] for v in n.inputs])
        mshape = (t.shape[axis],) + (1,) * (t.rank - 1 - axis)
        for k in range(len(vals) - 2, -1, -1):
            mask = (np.arange(t.shape[axis]) < bounds[k]).astype(np.uint8).reshape(mshape)
            mname = fresh_name(taken, f"{n.outputs[0]}__first{k}")
            consts.append((mname, Constant(TensorType(mshape, "bool"), mask.tobytes())))
            types[mname] = TensorType(mshape, "bool")
            out = n.outputs[0] if k == 0 else fresh_name(taken, f"{n.outputs[0]}__sel{k}")
            types[out] = t
            new.append(Node("where", (mname, vals[k], acc), (out,)))
            acc = out
        replace[i] = new
        drop.add(i)
    if not replace:
        return graph
    nodes = spliced_nodes(graph.nodes, replace, drop)
    used = {v for n in nodes for v in n.inputs} | set(graph.outputs)
    keep_types = {v: tt for v, tt in types.items() if v in used or v in graph.inputs
                  or any(v in n.outputs for n in nodes)}
    return infer_graph(Graph(graph.inputs, graph.outputs, tuple(nodes), keep_types,
                             tuple((c, k) for c, k in consts if c in used), graph.name))


ALIASES = frozenset(("reshape", "squeeze", "unsqueeze", "identity"))
ELEMENTWISE = BRANCH_OPS | frozenset(("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "mod", "where"))


def _grouped(shape: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pairs (dims of ``shape``, dims of ``new``) holding the same elements, in order, for a
    row-major reshape ``shape -> new`` (size-1 dims belong to no pair)."""
    a = [i for i, d in enumerate(shape) if d != 1]
    b = [j for j, d in enumerate(new) if d != 1]
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i]], [b[j]]
        pa, pb = shape[a[i]], new[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(a[i])
                pa *= shape[a[i]]
                i += 1
            elif pb < pa and j < len(b):
                gb.append(b[j])
                pb *= new[b[j]]
                j += 1
            else:
                return None
        out.append((ga, gb))
    return out if i == len(a) and j == len(b) else None


def _broadcast_view(si: tuple[int, ...], so: tuple[int, ...], ps: tuple[int, ...],
                    perm: tuple[int, ...]) -> tuple[int, ...] | None:
    """Shape of an operand broadcast ``si -> so`` once ``so`` is reshaped to ``ps`` and
    transposed by ``perm``, when that is a plain reshape of the operand (each reshape group
    wholly kept or wholly broadcast, and the transpose moving only size-1 dims of it)."""
    si = (1,) * (len(so) - len(si)) + tuple(si)
    groups = _grouped(so, ps)
    if groups is None:
        return None
    shape = [1] * len(ps)
    for ga, gb in groups:
        kept = [si[d] == so[d] for d in ga]
        if all(kept):
            for d in gb:
                shape[d] = ps[d]
        elif any(kept) or any(si[d] != 1 for d in ga):
            return None
    out = tuple(shape[p] for p in perm)
    moved = [p for p in perm if shape[p] != 1]
    return out if moved == sorted(moved) else None


def _leafy(v: str, producer: dict[str, Node], inputs: set[str], consts: dict) -> bool:
    """A graph input or constant, or a view of one (reshape-like ops only)."""
    while v in producer and producer[v].op in ALIASES:
        v = producer[v].inputs[0]
    return v in inputs or v in consts


def sink_transposes(graph: Graph, passes: int = 8) -> Graph:
    """``transpose(reshape(f(a, b, ...)))`` -> ``f(transpose(reshape(a)), b', ...)`` for an
    elementwise f, pass after pass, and ``transpose(transpose(x))`` -> one transpose (none
    when they cancel): transposes end on graph inputs, read in place (a tiled transposed read,
    or an index map) instead of copying computed values. An attention head split
    (``(x @ W + bias).view(B, S, H, D).transpose(1, 2)``, its bias add cut into this subgraph)
    becomes one kernel, and so does ConvNeXt's NHWC -> NCHW -> NHWC detour around a LayerNorm.
    Broadcast operands must stay plain reshapes of themselves."""
    for _ in range(passes):
        new = _sink_once(graph)
        if new is graph:
            return graph
        graph = new
    return graph


def _sink_once(graph: Graph) -> Graph:
    producer = {o: n for n in graph.nodes for o in n.outputs}
    readers: dict[str, int] = {}
    for n in graph.nodes:
        for v in set(n.inputs):
            readers[v] = readers.get(v, 0) + 1
    outputs, inputs = set(graph.outputs), set(graph.inputs)
    consts = graph.constant_map
    types = dict(graph.types)
    taken = set(types)
    drop: set[int] = set()
    replace: dict[int, list[Node]] = {}
    ids = {id(n): i for i, n in enumerate(graph.nodes)}

    for i, t in enumerate(graph.nodes):
        if t.op != "transpose" or i in drop:
            continue
        perm = canonical_attrs(t, [types[t.inputs[0]]])["perm"]
        ps = types[t.inputs[0]].shape
        chain, v = [], t.inputs[0]
        while v in producer and producer[v].op in ALIASES and readers.get(v) == 1 and v not in outputs:
            chain.append(producer[v])
            v = producer[v].inputs[0]
        e = producer.get(v)
        if e is None or readers.get(v) != 1 or v in outputs or ids[id(e)] in drop:
            continue
        if e.op == "transpose" and types[v].shape == ps:
            # transpose of a transpose (through same-shape views): one, or none
            first = canonical_attrs(e, [types[e.inputs[0]]])["perm"]
            both = tuple(first[p] for p in perm)
            out = t.outputs[0]
            op = "reshape" if both == tuple(sorted(both)) else "transpose"
            attrs = {"shape": types[out].shape} if op == "reshape" else {"perm": both}
            replace[i] = [Node(op, e.inputs[:1], (out,), attrs)]
            drop.update(ids[id(n)] for n in chain + [e])
            continue
        if e.op not in ELEMENTWISE or types[v].numel != types[t.outputs[0]].numel:
            continue
        so = types[v].shape
        new: list[Node] = []
        ins: list[str] = []
        for o in e.inputs:
            ti = types[o]
            if o in consts and ti.numel == 1:
                ins.append(o)
            elif ti.numel == types[v].numel:
                # full size (an input, or a computed value the next pass sinks into)
                r = fresh_name(taken, f"{o}__as_pre")
                types[r] = TensorType(ps, ti.dtype)
                tr = fresh_name(taken, f"{o}__transposed")
                types[tr] = TensorType(types[t.outputs[0]].shape, ti.dtype)
                new += [Node("reshape", (o,), (r,), {"shape": ps}),
                        Node("transpose", (r,), (tr,), {"perm": perm})]
                ins.append(tr)
            elif _leafy(o, producer, inputs, consts):
                shape = _broadcast_view(ti.shape, so, ps, perm)
                if shape is None:
                    break
                r = fresh_name(taken, f"{o}__as_post")
                types[r] = TensorType(shape, ti.dtype)
                new.append(Node("reshape", (o,), (r,), {"shape": shape}))
                ins.append(r)
            else:
                break
        else:
            new.append(Node(e.op, tuple(ins), t.outputs, e.attrs))
            replace[i] = new
            drop.update(ids[id(n)] for n in chain + [e])
    if not replace:
        return graph
    nodes = spliced_nodes(graph.nodes, replace, drop)
    used = {v for n in nodes for v in (*n.inputs, *n.outputs)} | set(graph.inputs) | set(graph.outputs)
    return infer_graph(Graph(graph.inputs, graph.outputs, tuple(nodes),
                             {v: tt for v, tt in types.items() if v in used}, graph.constants, graph.name))


def sink_slices(graph: Graph, passes: int = 8) -> Graph:
    """``slice(f(a, b, ...))`` -> ``f(slice(a), slice(b'), ...)`` for an elementwise f whose
    result is only sliced, pass after pass: the slices end on graph inputs and constants,
    where the analysis reads them in place (a full-size piece, or a piece of a broadcast
    operand through an index map). A GEGLU over a projection with its bias add cut into the
    subgraph (``h = x + bias; h[..., :F] * gelu(h[..., F:])``) becomes one kernel; each half
    computes its own elements of f, no element twice."""
    for _ in range(passes):
        new = _sink_slices_once(graph)
        if new is graph:
            return graph
        graph = new
    return graph


def _sink_slices_once(graph: Graph) -> Graph:
    producer = {o: n for n in graph.nodes for o in n.outputs}
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for v in dict.fromkeys(n.inputs):
            readers.setdefault(v, []).append(n)
    outputs, inputs = set(graph.outputs), set(graph.inputs)
    consts = graph.constant_map
    types = dict(graph.types)
    taken = set(types)
    ids = {id(n): i for i, n in enumerate(graph.nodes)}
    for e in graph.nodes:
        v = e.outputs[0]
        rs = readers.get(v, [])
        if (e.op not in ELEMENTWISE or v in outputs or not rs or any(r.op != "slice" for r in rs)
                or any(o not in consts and not _leafy(o, producer, inputs, consts)
                       and types[o].numel != types[v].numel for o in e.inputs)):
            continue
        so = types[v].shape
        replace: dict[int, list[Node]] = {}
        for s in rs:
            attrs = canonical_attrs(s, [types[v]])
            if any(st != 1 for st in attrs["steps"]):
                break
            new: list[Node] = []
            ins: list[str] = []
            for o in e.inputs:
                si = types[o].shape
                pad = len(so) - len(si)
                cut = [(ax - pad, st, en) for ax, st, en in zip(attrs["axes"], attrs["starts"], attrs["ends"])
                       if ax >= pad and si[ax - pad] == so[ax] and so[ax] > 1]
                if not cut:  # broadcast along every sliced axis (a scalar, a per-row scale)
                    ins.append(o)
                    continue
                r = fresh_name(taken, f"{o}__piece")  # typed by infer_graph below
                new.append(Node("slice", (o,), (r,), {"starts": tuple(c[1] for c in cut),
                                                       "ends": tuple(c[2] for c in cut),
                                                       "axes": tuple(c[0] for c in cut),
                                                       "steps": (1,) * len(cut)}))
                ins.append(r)
            new.append(Node(e.op, tuple(ins), s.outputs, e.attrs))
            replace[ids[id(s)]] = new
        else:
            nodes = spliced_nodes(graph.nodes, replace, {ids[id(e)]})
            used = {x for n in nodes for x in (*n.inputs, *n.outputs)} | inputs | outputs
            return infer_graph(Graph(graph.inputs, graph.outputs, tuple(nodes),
                                     {x: t for x, t in types.items() if x in used},
                                     graph.constants, graph.name))
    return graph
