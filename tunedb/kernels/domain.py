"""The [R, C] domain of a fusion subgraph: candidate splits, the class of a broadcast operand,
batched transposes, and index maps (the offsets of operands no simpler class reads).

Split out of ``tunedb.kernels.analysis`` (which re-exports the class names and
``UnsupportedFusion``), so that module stays about classifying values.
"""

from __future__ import annotations

import math
from typing import Any

from tunedb.graph.ir import Graph, GraphError
from tunedb.graph.ops import canonical_attrs

FULL, ROW, COL, SCALAR, TRANS, BCOL, IDX = "full", "row", "col", "scalar", "trans", "bcol", "idx"
REDUCE_OPS = frozenset(("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod"))
# An index map: offset of flat domain element i = sum of ((i / div) % mod) * stride over its terms;
# a term (div, mod, stride, add, wrap) first shifts that coordinate: ((i / div) % mod + add) % wrap
# (a read rolled along one axis: rotary embeddings' halves, concat branches).
IndexMap = tuple[tuple[int, ...], ...]


class UnsupportedFusion(ValueError):
    """The subgraph is outside what the fused-kernel generator handles; the message says why."""


def split_at(shape: tuple[int, ...], R: int) -> int | None:
    """The first q with prod(shape[:q]) == R (rows | columns split of a full-size shape)."""
    p = 1
    for q in range(len(shape) + 1):
        if p == R:
            return q
        if q < len(shape):
            p *= shape[q]
    return None


def broadcast_class(si: tuple[int, ...], so: tuple[int, ...], R: int,
                     what: str) -> tuple[str, tuple[int, int] | None]:
    """Class of an operand of shape ``si`` broadcast to the full-size output shape ``so``, and
    (Q, P) where the class is bcol; ``idx`` where no simpler class reads it (an index map,
    ``index_map``, which only graph inputs and constants may take)."""
    q = split_at(so, R)
    if q is None:
        return IDX, None  # the rows of the domain cut through a dim: only an index map reads it
    si = (1,) * (len(so) - len(si)) + tuple(si)
    rows_full = all(si[i] == so[i] for i in range(q))
    rows_one = all(si[i] == 1 for i in range(q))
    cols_full = all(si[i] == so[i] for i in range(q, len(so)))
    cols_one = all(si[i] == 1 for i in range(q, len(so)))
    if rows_full and cols_full:
        return FULL, None
    if rows_one and cols_full:
        return COL, None
    if rows_full and cols_one:
        return ROW, None
    if rows_one and cols_one:
        return SCALAR, None
    j = 0
    while j < q and si[j] == so[j]:
        j += 1
    k = q
    while k > j and si[k - 1] == so[k - 1]:
        k -= 1
    if cols_full and all(si[i] == 1 for i in range(j, k)):
        # row dims so[:j] kept, so[j:k] broadcast, so[k:q] kept: value[(r // Q) * P + r % P, c]
        return BCOL, (math.prod(so[j:q]), math.prod(so[k:q]))
    return IDX, None


def batched_transpose(perm: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(B, P, C) if ``perm`` (size-1 dims ignored) keeps a prefix of batch dims in place and
    block-swaps the rest: the result is B matrices [P, C] read from [C, P]; else None."""
    keep = [p for p in perm if shape[p] != 1]
    order = sorted(keep)
    for nb in range(len(keep) - 1):
        if keep[:nb] != order[:nb]:
            break
        rest, rest_order = keep[nb:], order[nb:]
        for i in range(1, len(rest_order)):
            if rest == rest_order[i:] + rest_order[:i]:
                size = lambda dims: math.prod(shape[d] for d in dims)  # noqa: E731
                return size(keep[:nb]), size(rest_order[i:]), size(rest_order[:i])
    return None



_VIEW_OPS = frozenset(("reshape", "squeeze", "unsqueeze", "identity"))


def domains(graph: Graph) -> list[tuple[int, int]]:
    """Candidate (R, C) splits, most natural first: reductions and transposes fix the split;
    otherwise C is the innermost dim of the largest value, then wider column blocks."""
    types = graph.type_map
    # an input read only in pieces (slices, splits, rolled reads) is not evaluated on the domain
    # (through reshapes of it too: GPT-2's fused QKV projection is viewed [B, S, 3E], then split)
    readers: dict[str, list] = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    pieces: set[str] = set()
    for v in reversed([*graph.inputs, *(n.outputs[0] for n in graph.nodes if n.op in _VIEW_OPS)]):
        if readers.get(v) and all(r.op in ("slice", "split", "gather") or
                                  (r.op in _VIEW_OPS and r.outputs[0] in pieces) for r in readers[v]):
            pieces.add(v)
    big = max((t.numel for v, t in types.items() if v not in pieces), default=0)
    out: list[tuple[int, int]] = []

    def add(R: int, C: int) -> None:
        if R * C == big and (R, C) not in out and C >= 1 and R >= 1:
            out.append((R, C))

    for n in graph.nodes:
        t = types[n.inputs[0]] if n.inputs else None
        if t is None or t.numel != big:
            continue
        try:
            attrs = canonical_attrs(n, [types[v] for v in n.inputs])
        except GraphError:
            continue
        if n.op in REDUCE_OPS and attrs["axes"]:
            ax = attrs["axes"]
            if ax[-1] == t.rank - 1:
                add(math.prod(t.shape[:ax[0]]), math.prod(t.shape[ax[0]:]))
            if ax[0] == 0 or tuple(ax) == tuple(range(ax[0], ax[-1] + 1)):
                # leading axes: a column reduction; a middle block: one per block of rows
                add(math.prod(t.shape[:ax[-1] + 1]), math.prod(t.shape[ax[-1] + 1:]))
        if n.op == "transpose":
            split = batched_transpose(tuple(attrs["perm"]), t.shape)
            if split is not None:
                add(split[0] * split[1], split[2])
    for t in sorted({t.shape for v, t in types.items() if t.numel == big and v not in pieces},
                    key=lambda s: (-len(s), s)):
        for q in range(len(t) - 1, 0, -1):
            add(math.prod(t[:q]), math.prod(t[q:]))
        add(1, big)
    return out



def index_map(si: tuple[int, ...], so: tuple[int, ...]) -> IndexMap:
    """Where element i (row-major flat index) of the broadcast ``si -> so`` lives in the operand:
    one (div, mod, stride) term per run of kept dims that step as one (a [64, 1, 1] scale of
    [8, 64, 56, 56] is the single term (3136, 64, 1): offset (i / 3136) % 64)."""
    si = (1,) * (len(so) - len(si)) + tuple(si)
    terms: list[tuple[int, int, int]] = []
    inner, stride = 1, 1
    for d in reversed(range(len(so))):
        if si[d] == so[d] and so[d] > 1:
            if terms and terms[-1][0] * terms[-1][1] == inner and terms[-1][2] * terms[-1][1] == stride:
                div, mod, st = terms[-1]
                terms[-1] = (div, mod * so[d], st)   # contiguous with the dim inside it
            else:
                terms.append((inner, so[d], stride))
            stride *= si[d]
        inner *= so[d]
    return tuple(reversed(terms))


def index_expr(m: IndexMap, flat: str, numel: int) -> str:
    """C expression of the offset ``m`` gives for the flat index expression ``flat``."""
    parts = []
    for div, mod, st, *shift in m:
        x = f"({flat})" if div == 1 else f"({flat}) / {div}LL"
        if div * mod < numel:
            x = f"({x}) % {mod}LL"
        if shift and shift[0]:
            x = f"(({x}) + {shift[0]}LL) % {shift[1]}LL"
        elif shift and shift[1] < mod:
            x = f"({x}) % {shift[1]}LL"  # a branch narrower than the axis: any in-bounds read
        parts.append(x if st == 1 else f"({x}) * {st}LL")
    return " + ".join(parts) or "0LL"


# A strided view of an input, one (size, stride, shift, wrap) per dim of the view in row-major
# order: coordinate c of a dim reads source coordinate (c + shift) % wrap (shift 0 and wrap 0: c).
View = tuple[tuple[int, int, int, int], ...]


def contiguous_view(shape: tuple[int, ...]) -> View:
    out, stride = [], 1
    for d in reversed(shape):
        out.append((d, stride, 0, 0))
        stride *= d
    return tuple(reversed(out))


def view_map(view: View) -> IndexMap:
    """The index map of a view: a term per dim, dims that step as one merged (shifted dims
    stay alone: their wrap is their own)."""
    terms: list[tuple[int, ...]] = []
    inner = 1
    for size, stride, shift, wrap in reversed(view):
        if shift or (wrap and wrap != size):
            terms.append((inner, size, stride, shift % wrap, wrap))
        elif size > 1 and stride:  # stride 0: a broadcast dim reads no offset
            last = terms[-1] if terms else (0, 0, 0, 0)
            if len(last) == 3 and last[0] * last[1] == inner and last[2] * last[1] == stride:
                terms[-1] = (last[0], last[1] * size, last[2])  # steps with the dim inside it
            else:
                terms.append((inner, size, stride))
        inner *= size
    return tuple(reversed(terms))


def shifted_view(view: View, axis: int, size: int, shift: int) -> View | None:
    """``view`` read along ``axis`` at (c + shift) % its size, ``size`` long (a slice, a roll);
    None where that dim is shifted already."""
    n, stride, old, wrap = view[axis]
    if old or wrap:
        return None
    return view[:axis] + ((size, stride, shift % n, n),) + view[axis + 1:]


def reshaped_view(view: View, shape: tuple[int, ...]) -> View | None:
    """``view`` read as the row-major reshape ``shape`` of itself: size-1 dims come and go,
    a dim splits into several (a slice's offset goes to the outermost part when it divides),
    contiguous unshifted dims merge; None for anything else (a roll split, strides that do
    not step as one)."""
    src = [d for d in view if d[0] != 1]
    out: list[tuple[int, int, int, int]] = []
    for want in (d for d in shape if d != 1):
        if not src:
            return None
        size, stride, shift, wrap = src.pop(0)
        if size == want:
            out.append((size, stride, shift, wrap))
        elif size % want == 0:  # split off the outer part
            inner = size // want
            if shift % inner or (wrap and (wrap % inner or shift + size > wrap)):
                return None  # a roll, or an offset inside the inner part
            out.append((want, stride * inner, shift // inner, wrap // inner))
            src.insert(0, (inner, stride, 0, 0))
        else:  # merge with the dims inside while they step as one
            while size < want and src and not shift and not wrap:
                s2, st2, sh2, w2 = src.pop(0)
                if sh2 or w2 or stride != st2 * s2:
                    return None
                size, stride = size * s2, st2
            if size != want or shift or wrap:
                return None
            out.append((size, stride, 0, 0))
    if src:
        return None
    it = iter(out)
    return tuple(next(it) if d != 1 else (1, 0, 0, 0) for d in shape)


def broadcast_view(view: View, si: tuple[int, ...], so: tuple[int, ...]) -> View:
    """``view`` (shaped ``si``) broadcast to ``so``: broadcast dims read stride 0."""
    pad = len(so) - len(si)
    return tuple((n, 0, 0, 0) if d < pad or si[d - pad] != n else view[d - pad] for d, n in enumerate(so))


def rolled_map(shape: tuple[int, ...], src_shape: tuple[int, ...], axis: int, shift: int) -> IndexMap:
    """Index map of ``src`` read as ``shape`` (equal to ``src_shape`` but on ``axis``) with
    coordinate c of ``axis`` taken from (c + shift) % src_shape[axis] of the source."""
    view = shifted_view(contiguous_view(src_shape), axis, shape[axis], shift)
    assert view is not None
    return view_map(view)


def permuted_view(src_shape: tuple[int, ...], perm: tuple[int, ...]) -> View:
    src = contiguous_view(src_shape)
    return tuple(src[p] for p in perm)


def permuted_map(src_shape: tuple[int, ...], perm: tuple[int, ...]) -> IndexMap:
    """Index map of ``transpose(src, perm)`` read in its own row-major order: output dim d steps
    through source dim perm[d] (dims that stay in step are merged, so an attention head split
    [B, S, H, D] -> [B, H, S, D] keeps its D-long runs contiguous and vector-loadable)."""
    return view_map(permuted_view(src_shape, perm))


def bcol_blocks(k: Any) -> dict[str, tuple[int, int]]:
    """(Q, P) of every bcol value. A value computed from bcol values shares their row mapping
    (its elements are evaluated from theirs), so each connected group of bcol values takes the
    (Q, P) of its broadcasts; a group broadcast two ways is refused. ``k``: the analysis'
    classifier once it has run."""
    parent: dict[str, str] = {}

    def find(v: str) -> str:
        while parent.get(v, v) != v:
            v = parent[v]
        return v

    for n in k.nodes:
        out = n.outputs[0]
        if k.cls.get(out) != BCOL:
            continue
        for i in n.inputs:
            ri = k.resolve(i)
            if k.cls.get(ri) == BCOL and find(ri) != find(out):
                parent[find(ri)] = find(out)
    groups: dict[str, list[str]] = {}
    for v, c in k.cls.items():
        if c == BCOL:
            groups.setdefault(find(v), []).append(v)
    out: dict[str, tuple[int, int]] = {}
    for vs in groups.values():
        qps = set().union(*(k.bqp.get(v, set()) for v in vs))
        if len(qps) > 1:
            ways = " and ".join(f"value[(r // {q}) * {p} + r % {p}, c]" for q, p in sorted(qps))
            raise UnsupportedFusion(f"bcol values {', '.join(sorted(vs))} are broadcast as {ways}")
        # never broadcast (an unused input): the plain block of today's rows, P = 1
        qp = qps.pop() if qps else (k.N // k.numel(vs[0]), 1)
        out.update((v, qp) for v in vs)
    return out
