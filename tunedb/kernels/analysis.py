"""Canonicalise a fusion subgraph onto a 2-D domain [R, C] and classify every value.

The domain is the largest tensor of the subgraph viewed as R rows of C contiguous elements
(leading dims collapsed into R; C is the innermost axis, or the axes a row reduction runs over).
Every value is then evaluated "at element (r, c)" of that domain, and its class says which
coordinates it depends on:

* ``full``   [R, C]  one value per element (row-major, so reshapes of contiguous dims are free)
* ``row``    [R, 1]  one value per row (row-reduction results, per-row inputs, gathered picks)
* ``col``    [1, C]  one value per column (bias/gamma vectors, column-reduction results)
* ``scalar`` [1, 1]
* ``trans``  a graph input read transposed: element (r, c) lives at offset ``c * R + r``
* ``bcol``   [R/Q*P, C]  an operand broadcast over a middle block of rows: element (r, c) lives
  at row ``(r // Q) * P + r % P``, offset ``((r // Q) * P + r % P) * C + c`` (P divides Q). Its
  row dims are the domain's leading dims, then size-1 dims, then the domain's trailing row dims
  (P is their product, Q that of the size-1 and trailing ones). An attention mask [B, 1, 1, S]
  added to scores [B, H, S, S] (R = B*H*S, C = S) is one with Q = H*S, P = 1 (value[r // Q, c]);
  GPT-2's causal mask [1, 1, S, S] is one with Q = R, P = S (value[r % S, c]), and a [B, 1, S, S]
  mask one with Q = H*S, P = S. The class and (Q, P) are decided where the value is broadcast;
  values computed from bcol leaves only (cast, 1 - m, * -10000) are bcol too, with the same
  (Q, P) (a value never broadcast keeps P = 1, Q = R*C / numel), and kernels evaluate them per
  element from the leaves (recompute). Q is kept per value in ``Analysis.bcol_q``, P where it
  is above 1 in ``Analysis.bcol_p``.

Layout ops (reshape, squeeze, unsqueeze, expand, identity, transpose of an input) produce no
code: their outputs are aliases of their inputs under this evaluation rule. Reductions are
``row`` (over C) or ``col`` (over R); each has a *level*: the number of reductions that must
finish before it can start (softmax: max is level 0, sum of exp(x - max) level 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import canonical_attrs, slice_bounds
from tunedb.kernels.domain import (  # noqa: F401  (class names and the error, re-exported)
    BCOL,
    COL,
    FULL,
    IDX,
    REDUCE_OPS,
    ROW,
    SCALAR,
    TRANS,
    IndexMap,
    UnsupportedFusion,
    View,
    batched_transpose,
    bcol_blocks,
    broadcast_class,
    broadcast_view,
    contiguous_view,
    domains,
    index_map,
    permuted_view,
    reshaped_view,
    shifted_view,
    split_at,
    view_map,
)
from tunedb.kernels.movement import lower_concats, sink_slices, sink_transposes

PATTERNS = ("elementwise", "row_reduce", "col_reduce", "transpose", "multi")

ALIAS_OPS = frozenset(("reshape", "squeeze", "unsqueeze", "expand", "identity"))
COMPUTE_UNARY = frozenset((
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid",
    "relu", "erf", "floor", "ceil", "sign", "not", "gelu", "clip", "cast", "leaky_relu"))
COMPUTE_BINARY = frozenset((
    "add", "sub", "mul", "div", "pow", "max", "min", "mod",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or"))
TRANSCENDENTAL = frozenset(("exp", "log", "sin", "cos", "tanh", "sigmoid", "erf", "gelu", "pow"))


@dataclass(frozen=True)
class Reduction:
    value: str      # the reduction's output value
    op: str         # reduce_sum | reduce_mean | reduce_max | reduce_min | reduce_prod
    input: str      # the (alias-resolved) value reduced
    axis: str       # "row" (over C) or "col" (over R)
    level: int


@dataclass(frozen=True)
class Analysis:
    graph: Graph
    R: int
    C: int
    pattern: str
    classes: tuple[tuple[str, str], ...]    # value -> class, for every non-alias value
    deps: tuple[tuple[str, int], ...]       # value -> number of reduction levels it waits on
    aliases: tuple[tuple[str, str], ...]    # alias value -> the value it stands for
    nodes: tuple[Node, ...]                 # compute nodes (layout ops removed), topological
    reductions: tuple[Reduction, ...]
    bcol_q: tuple[tuple[str, int], ...] = ()  # bcol value -> Q (rows per block)
    bcol_p: tuple[tuple[str, int], ...] = ()  # bcol value -> P, where P > 1 (inner rows kept)
    # transposed input -> its rows per batch index, where a batch prefix is kept (period < R):
    # domain row r reads batch r // period, row r % period of that batch's [C, period] matrix
    trans_periods: tuple[tuple[str, int], ...] = ()
    # idx leaf -> its index map (``tunedb.kernels.domain.index_map``): broadcasts that fit no
    # simpler class (a per-channel scale of a group norm's [N*G, C/G*H*W] domain), read element
    # by element at offset map(r * C + c)
    idx_maps: tuple[tuple[str, IndexMap], ...] = ()
    # rows per segment of the column reductions, where they reduce a middle block of axes
    # (mean over M of [A, M, B]: R = A*M, C = B, segments of M rows, results [A, B] at
    # row r // M of an [R / M, C] array); 0 where they reduce all R rows
    col_seg: int = 0
    # idx value -> the graph input whose buffer its index map reads (a rolled read, ``gather``
    # of constant indices (c + s) % n: ``tunedb.kernels.movement``); leaves read themselves
    idx_src: tuple[tuple[str, str], ...] = ()
    permuted_reads: int = 0  # transposes read through index maps (no tile fits this domain)

    @property
    def seg(self) -> int:
        """Rows per column-reduction segment (R unless ``col_seg``)."""
        return self.col_seg or self.R

    @property
    def q(self) -> dict[str, int]:
        return dict(self.bcol_q)

    @property
    def p(self) -> dict[str, int]:
        """P of every bcol value (1 where ``bcol_p`` has none)."""
        out = {v: 1 for v, _ in self.bcol_q}
        out.update(self.bcol_p)
        return out

    @property
    def cls(self) -> dict[str, str]:
        return dict(self.classes)

    @property
    def dep(self) -> dict[str, int]:
        return dict(self.deps)

    def resolve(self, v: str) -> str:
        a = dict(self.aliases)
        while v in a:
            v = a[v]
        return v

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.graph.inputs

    @property
    def transposed_inputs(self) -> tuple[str, ...]:
        c = self.cls
        return tuple(v for v in self.graph.inputs if c.get(v) == TRANS)

    def period(self, v: str) -> int:
        """Rows per batch index of transposed input ``v`` (R for a plain 2-D transpose)."""
        return dict(self.trans_periods).get(v, self.R)

    @property
    def trans_rows(self) -> int:
        """What every transposed input's vector width must divide: the gcd of their periods."""
        return math.gcd(*(p for _, p in self.trans_periods)) if self.trans_periods else self.R

    @property
    def row_levels(self) -> int:
        return 1 + max((r.level for r in self.reductions if r.axis == "row"), default=-1)

    @property
    def col_levels(self) -> int:
        return 1 + max((r.level for r in self.reductions if r.axis == "col"), default=-1)

    def summary(self) -> dict:
        """Compact JSON description (pattern, domain, counts) for features and reports."""
        c = self.cls
        return {"pattern": self.pattern, "R": self.R, "C": self.C,
                "row_reductions": sum(r.axis == "row" for r in self.reductions),
                "col_reductions": sum(r.axis == "col" for r in self.reductions),
                "row_levels": self.row_levels, "col_levels": self.col_levels,
                "transposed_inputs": len(self.transposed_inputs),
                "classes": {k: sum(1 for v in c.values() if v == k)
                            for k in (FULL, ROW, COL, SCALAR, TRANS, BCOL)},
                "transcendentals": sum(n.op in TRANSCENDENTAL for n in self.nodes)}


class _Classifier:
    def __init__(self, graph: Graph, R: int, C: int) -> None:
        self.g, self.R, self.C, self.N = graph, R, C, R * C
        self.types = graph.type_map
        self.cls: dict[str, str] = {}
        self.alias: dict[str, str] = {}
        self.dep: dict[str, int] = {}
        self.nodes: list[Node] = []
        self.reds: list[Reduction] = []
        self.bqp: dict[str, set[tuple[int, int]]] = {}  # bcol value -> (Q, P) of its broadcasts
        self.leaves = set(graph.inputs) | set(graph.constant_map)
        self.periods: dict[str, int] = {}  # transposed input -> rows per batch index
        self.imaps: dict[str, IndexMap] = {}  # idx leaf -> its index map
        self.seg = 0  # rows per segment of the column reductions (0: all R)
        self.isrc: dict[str, str] = {}  # rolled read -> the graph input it reads
        self.permuted = 0  # transposes read through index maps
        self.views: dict[str, View] = {}  # idx value -> the strided view of its input

    def resolve(self, v: str) -> str:
        while v in self.alias:
            v = self.alias[v]
        return v

    def numel(self, v: str) -> int:
        return self.types[v].numel

    def assign(self, v: str, k: str, what: str) -> None:
        v = self.resolve(v)
        old = self.cls.get(v)
        if old is None:
            self.cls[v] = k
            self.dep.setdefault(v, 0)
        elif old != k and not (k == FULL and old == TRANS):
            raise UnsupportedFusion(f"{what}: value {v!r} is used both as {old} and as {k}")

    def guess(self, v: str) -> str:
        """Class of a small leaf seen without a full-size context (e.g. rstd_in * 2)."""
        n, t = self.numel(v), self.types[v]
        if n == 1:
            return SCALAR
        if n == self.N:
            return FULL
        if n == self.R and n != self.C:
            return ROW
        if n == self.C and n != self.R:
            return COL
        if n == self.R:
            return ROW if t.rank >= 2 and t.shape[-1] == 1 else COL
        if n % self.C == 0 and self.R % (n // self.C) == 0 and split_at(t.shape, n // self.C) is not None:
            return BCOL  # [P, C] with P | R: confirmed (or refused) where it is broadcast
        raise UnsupportedFusion(f"value {v!r} {t} does not fit the [{self.R}, {self.C}] domain")

    def operand(self, v: str, out_shape: tuple[int, ...], out_cls: str, what: str) -> None:
        rv = self.resolve(v)
        si = self.types[v].shape
        if rv in self.views and rv not in self.imaps and self.numel(rv) < self.N:
            view = self.view_of(v) if out_cls == FULL else None
            if view is None:
                raise UnsupportedFusion(f"{what}: a piece of {rv!r} read as {out_cls}")
            self.imaps[rv] = view_map(broadcast_view(view, si, out_shape))
            self.cls[rv], self.dep[rv], k = IDX, 0, IDX
        elif out_cls == FULL:
            if self.numel(v) == self.N:
                # an expand alias stands for its (smaller) source, classified at the expand
                k = FULL if self.numel(rv) == self.N else self.cls[rv]
            else:
                k, qp = broadcast_class(si, out_shape, self.R, what)
                if qp is not None and self.cls.get(rv) == COL and self.seg and qp == (self.seg, 1):
                    k, qp = COL, None  # a segmented column result broadcast over its segment
                if qp is not None:
                    self.bqp.setdefault(rv, set()).add(qp)
                if k == IDX:
                    self.index_mapped(rv, index_map(si, out_shape), si, out_shape, what)
        elif self.numel(v) == 1:
            k = SCALAR
        elif self.numel(v) == math.prod(out_shape):
            k = self.cls.get(rv) or out_cls
        else:
            raise UnsupportedFusion(f"{what}: cannot broadcast {si} inside a {out_cls} value")
        known = self.cls.get(rv)
        if known is None:
            self.assign(rv, k, what)
        elif (known != k and SCALAR not in (known, k) and not (known == TRANS and k == FULL)
              and not (known == IDX and k == FULL and rv in self.isrc)):
            raise UnsupportedFusion(f"{what}: value {rv!r} is {known} but used as {k}")

    def index_mapped(self, rv: str, m: IndexMap, si: tuple[int, ...], so: tuple[int, ...], what: str) -> None:
        if rv not in self.leaves:
            raise UnsupportedFusion(
                f"{what}: operand of shape {si} broadcast to {so} is neither per-row, per-column, "
                f"per-column of a block of rows nor scalar in the [{self.R}, {self.N // self.R}] "
                f"domain, and not a graph input that an index map could read")
        if self.imaps.setdefault(rv, m) != m:
            raise UnsupportedFusion(f"{what}: {rv!r} is broadcast in two different ways")

    def elementwise(self, node: Node) -> None:
        out = node.outputs[0]
        so = self.types[out].shape
        what = f"{node.op} {out!r}"
        if math.prod(so) == self.N and self.N > 1:
            oc = FULL
        else:
            kinds = set()
            for v in node.inputs:
                rv = self.resolve(v)
                k = self.cls.get(rv) or (self.guess(v) if self.numel(v) != 1 else SCALAR)
                if k != SCALAR:
                    kinds.add(k)
            if len(kinds) > 1:
                raise UnsupportedFusion(f"{what}: mixes {' and '.join(sorted(kinds))} operands")
            oc = kinds.pop() if kinds else SCALAR
        for v in node.inputs:
            self.operand(v, so, oc, what)
        self.cls[out] = oc
        self.dep[out] = max(self.dep.get(self.resolve(v), 0) for v in node.inputs)
        self.nodes.append(node)

    def run(self) -> None:
        for node in self.g.nodes:
            op, out = node.op, node.outputs[0]
            what = f"{op} {out!r}"
            ins = [self.types[v] for v in node.inputs]
            attrs = canonical_attrs(node, ins)
            if op in COMPUTE_UNARY or op in COMPUTE_BINARY or op == "where":
                self.elementwise(node)
            elif op in ALIAS_OPS:
                src = node.inputs[0]
                if op == "expand" and self.numel(out) != self.numel(src):
                    oc = FULL if self.numel(out) == self.N else None
                    if oc is None:
                        raise UnsupportedFusion(f"{what}: expand to a partial domain")
                    base = self.view_of(src) if self.resolve(src) in self.views else None
                    if base is not None:  # GQA's repeat_kv of a transposed input: one view
                        self.mapped(out, broadcast_view(base, self.types[src].shape,
                                                        self.types[out].shape), self.resolve(src))
                        continue
                    self.operand(src, self.types[out].shape, oc, what)
                self.alias[out] = src
            elif op == "transpose":
                self.transpose(node, attrs, what)
            elif op in REDUCE_OPS:
                self.reduce(node, attrs, what)
            elif op == "gather_elements":
                self.gather(node, attrs, what)
            elif op == "gather":
                self.rolled(node, attrs, what)
            elif op in ("slice", "split"):
                self.sliced(node, attrs, what)
            else:
                raise UnsupportedFusion(f"{what}: op {op!r} is not supported by the fused-kernel generator")

    def transpose(self, node: Node, attrs: dict, what: str) -> None:
        src, out = node.inputs[0], node.outputs[0]
        shape = self.types[src].shape
        perm = tuple(attrs["perm"])
        if [p for p in perm if shape[p] != 1] == sorted(p for p in perm if shape[p] != 1):
            self.alias[out] = src  # moves only size-1 dims: a reshape
            return
        base = self.view_of(src)
        runs = [p for p in perm if shape[p] > 1][-1:] == [d for d, n in enumerate(shape) if n > 1][-1:]
        if base is not None and runs and (self.resolve(src) not in self.leaves or self.numel(src) != self.N):
            # a view of an input (a split piece, a smaller input), rows permuted: whole runs
            self.mapped(out, tuple(base[p] for p in perm), self.resolve(src))
            return
        if self.resolve(src) not in self.leaves or self.numel(src) != self.N:
            raise UnsupportedFusion(f"{what}: only full-size graph inputs can be read transposed")
        split = batched_transpose(perm, shape)
        rs = self.resolve(src)
        if split is None or split[0] * split[1] != self.R or split[2] != self.C:
            # no transpose tile on this domain (rows permuted, as an attention head split's):
            # read the input through the permuted index map
            self.mapped(out, permuted_view(shape, perm), rs)
            self.permuted += split is not None  # a tile would read it on another domain
            return
        if self.periods.setdefault(rs, split[1]) != split[1]:
            raise UnsupportedFusion(f"{what}: {src!r} is read transposed in two ways")
        self.assign(src, TRANS, what)
        self.alias[out] = rs

    def reduce(self, node: Node, attrs: dict, what: str) -> None:
        src, out = node.inputs[0], node.outputs[0]
        rs = self.resolve(src)
        shape = self.types[src].shape
        axes = tuple(attrs["axes"])
        if self.numel(src) != self.N:
            raise UnsupportedFusion(f"{what}: reduces a {self.types[src]} value, not the full domain")
        n = len(shape)
        kind = None
        if axes and axes == tuple(range(axes[0], n)) and math.prod(shape[:axes[0]]) == self.R:
            kind = ROW
        elif (axes and axes == tuple(range(axes[0], axes[-1] + 1))
              and math.prod(shape[:axes[-1] + 1]) == self.R):
            kind = COL  # leading axes; a middle block reduces each segment of rows on its own
            seg = math.prod(shape[axes[0]:axes[-1] + 1]) if axes[0] > 0 else self.R
            if seg != self.R:
                if self.seg and self.seg != seg:
                    raise UnsupportedFusion(f"{what}: column reductions over segments of {self.seg} "
                                            f"and {seg} rows")
                self.seg = seg
            elif self.seg:
                raise UnsupportedFusion(f"{what}: column reductions over all rows and over segments")
        if kind is None:
            raise UnsupportedFusion(f"{what}: axes {axes} of {shape} are neither the trailing (row), "
                                    f"the leading (column) nor a middle block (segmented column) "
                                    f"of axes of the [{self.R}, {self.C}] domain")
        if self.types[src].dtype not in ("float32", "float16", "bfloat16"):
            raise UnsupportedFusion(f"{what}: only floating-point reductions are generated")
        self.assign(rs, FULL, what)
        if self.cls[rs] == TRANS:
            raise UnsupportedFusion(f"{what}: reduction of a transposed input")
        level = self.dep.get(rs, 0)
        self.reds.append(Reduction(out, node.op, rs, "row" if kind == ROW else "col", level))
        self.cls[out] = kind
        self.dep[out] = level + 1
        self.nodes.append(node)

    def rolled(self, node: Node, attrs: dict, what: str) -> None:
        """A full-size read of a graph input along one axis at (c + s) % n: an index map."""
        data, idx, out = node.inputs[0], node.inputs[1], node.outputs[0]
        c = self.g.constant_map.get(idx)
        ax = attrs["axis"]
        n = self.types[data].shape[ax]
        vals = (np.frombuffer(c.data, dtype="<i8" if c.type.dtype == "int64" else "<i4") % n
                if c is not None and c.type.rank == 1 else None)
        base = self.view_of(data)
        view = (None if base is None or vals is None or not len(vals)  # computed indices: no map
                else shifted_view(base, ax, self.types[out].shape[ax], int(vals[0])))
        if (view is None or vals is None or self.numel(out) != self.N
                or any(int(x) != (int(vals[0]) + j) % n for j, x in enumerate(vals))):
            raise UnsupportedFusion(f"{what}: only a full-size read of a graph input at constant "
                                    f"indices (c + s) % n along one axis is generated")
        self.mapped(out, view, data)
        self.cls[idx] = IDX  # the indices are folded into the map
        self.dep[idx] = 0

    def view_of(self, v: str) -> View | None:
        """``v`` as a strided view of a graph input: the input itself, or a transpose of one
        read through a permuted map (then rolls and slices of it compose)."""
        rv = self.resolve(v)  # a reshape of an input is contiguous in its own shape too
        if rv in self.g.inputs and self.numel(rv) == self.numel(v):
            return contiguous_view(self.types[v].shape)
        if rv in self.views and self.numel(rv) == self.numel(v):
            return reshaped_view(self.views[rv], self.types[v].shape)
        return None

    def mapped(self, out: str, view: View, data: str) -> None:
        self.views[out] = view
        self.imaps[out] = view_map(view)
        data = self.resolve(data)  # a reshape of an input reads the input
        self.isrc[out] = self.isrc.get(data, data)
        self.cls[out] = IDX
        self.dep[out] = 0

    def sliced(self, node: Node, attrs: dict, what: str) -> None:
        """Full-size pieces of a graph input cut along one axis (the halves of a fused gate/up
        projection): each an index map of the input at an offset, never a copy."""
        data = node.inputs[0]
        shape = self.types[data].shape
        if node.op == "split":
            starts = [sum(attrs["sizes"][:k]) for k in range(len(node.outputs))]
            pieces = [(o, attrs["axis"], st) for o, st in zip(node.outputs, starts)]
        else:
            bounds = slice_bounds([shape[a] for a in attrs["axes"]], attrs["starts"], attrs["ends"],
                                  attrs["steps"])
            cut = [(a, b[0]) for a, b, st in zip(attrs["axes"], bounds, attrs["steps"])
                   if b[2] != shape[a] or st != 1]
            if len(cut) != 1 or any(st != 1 for st in attrs["steps"]):
                raise UnsupportedFusion(f"{what}: only a unit-step slice along one axis is read in place")
            pieces = [(node.outputs[0], cut[0][0], cut[0][1])]
        base = self.view_of(data)
        for out, ax, start in pieces:
            view = None if base is None else shifted_view(base, ax, self.types[out].shape[ax], start)
            if view is not None and self.numel(out) < self.N:  # a piece of a broadcast operand:
                self.views[out] = view  # mapped where it is broadcast (``operand``)
                self.isrc[out] = self.isrc.get(self.resolve(data), self.resolve(data))
                continue
            if view is None or self.numel(out) != self.N:
                raise UnsupportedFusion(f"{what}: only full-size pieces of graph inputs are read in place")
            self.mapped(out, view, data)

    def gather(self, node: Node, attrs: dict, what: str) -> None:
        data, idx, out = node.inputs[0], node.inputs[1], node.outputs[0]
        shape = self.types[data].shape
        if (self.numel(data) != self.N or attrs["axis"] != len(shape) - 1 or shape[-1] != self.C
                or self.numel(idx) != self.R or self.types[idx].dtype not in ("int32", "int64")):
            raise UnsupportedFusion(f"{what}: only a per-row pick x[r, idx[r]] along the last axis "
                                    f"of the [{self.R}, {self.C}] domain is supported")
        self.assign(data, FULL, what)
        self.assign(idx, ROW, what)
        self.cls[out] = ROW
        self.dep[out] = max(self.dep.get(self.resolve(data), 0), self.dep.get(self.resolve(idx), 0))
        self.nodes.append(node)


def _analyze_with(graph: Graph, R: int, C: int) -> Analysis:
    k = _Classifier(graph, R, C)
    k.run()
    for v in graph.outputs:
        rv = k.resolve(v)
        if rv in k.leaves:
            raise UnsupportedFusion(f"output {v!r} is a graph input or constant, not computed")
        if k.numel(v) != k.numel(rv):
            raise UnsupportedFusion(f"output {v!r} is an expanded value; materialise it with a compute op")
    for v in k.isrc.values():
        k.cls.setdefault(v, IDX)  # read only through rolled maps: an argument, never loaded
        k.dep.setdefault(v, 0)
    for v in graph.inputs:
        if k.resolve(v) not in k.cls:
            k.cls[v] = k.guess(v)  # unused input: still an argument of the kernel
            k.dep[v] = 0
    for v in graph.constant_map:
        if v not in k.cls:
            k.cls[v] = k.guess(v)
            k.dep[v] = 0
    rows = any(r.axis == "row" for r in k.reds)
    cols = any(r.axis == "col" for r in k.reds)
    if rows or cols:
        # a reduction kernel walks rows, not transpose tiles: read transposed inputs by index map
        for v in [v for v, c in k.cls.items() if c == TRANS]:
            p = k.periods.get(v, R)
            k.cls[v], k.imaps[v] = IDX, ((C * p, R // p, C * p), (C, p, 1), (1, C, p))
        k.periods.clear()
    trans = any(c == TRANS for c in k.cls.values())
    pattern = ("transpose" if trans else "multi" if rows and cols else "row_reduce" if rows
               else "col_reduce" if cols else "elementwise")
    outs = {k.resolve(v): k.cls.get(k.resolve(v)) for v in graph.outputs}
    if None in outs.values():  # a piece of an input never read at the domain's size
        raise UnsupportedFusion("an output is a piece of an input smaller than the domain")
    # an output that is a view of an input (a split piece, a repeated head) is a gathered copy
    copies = {v for v, c in outs.items() if c == IDX and v in k.isrc and pattern == "elementwise"}
    if pattern in ("elementwise", "transpose") and any(c != FULL and v not in copies
                                                       for v, c in outs.items()):
        raise UnsupportedFusion("an elementwise subgraph with a non-full-size output")
    colred = {r.value for r in k.reds if r.axis == "col"}
    if k.seg and pattern != "col_reduce":
        raise UnsupportedFusion("a middle-axis (segmented) column reduction with a row reduction "
                                "or transpose in one kernel")

    def waits_on_col(v: str, seen: dict[str, bool]) -> bool:
        if v in seen:
            return seen[v]
        prod = {o: n for n in k.nodes for o in n.outputs}
        n = prod.get(v)
        r = v in colred or (n is not None and any(waits_on_col(k.resolve(i), seen) for i in n.inputs))
        seen[v] = r
        return r

    seen: dict[str, bool] = {}
    if pattern == "multi":
        for r in k.reds:
            if r.axis == "row" and waits_on_col(r.input, seen):
                raise UnsupportedFusion(f"row reduction {r.value!r} depends on a column reduction")
        for v, c in outs.items():
            if c in (FULL, ROW) and waits_on_col(v, seen):
                raise UnsupportedFusion(f"output {v!r} needs a column reduction inside a row-mapped kernel")
    if pattern == "col_reduce":
        for v, c in outs.items():
            if c == ROW:
                raise UnsupportedFusion(f"output {v!r} is per-row in a column-reduction subgraph")
    if pattern == "row_reduce":
        for v, c in outs.items():
            if c == COL:
                raise UnsupportedFusion(f"output {v!r} is per-column in a row-reduction subgraph")
    for v, c in outs.items():
        if c == SCALAR:
            raise UnsupportedFusion(f"output {v!r} is a scalar")
        if c == BCOL:
            raise UnsupportedFusion(f"output {v!r} is per-column of a block of rows (bcol); "
                                    f"only its full-size consumers are generated")
    blocks = bcol_blocks(k)
    bq = tuple(sorted((v, q) for v, (q, _) in blocks.items()))
    bp = tuple(sorted((v, p) for v, (_, p) in blocks.items() if p > 1))
    periods = tuple(sorted((v, p) for v, p in k.periods.items() if p != R))
    imaps = tuple(sorted((v, m) for v, m in k.imaps.items() if k.cls.get(v) == IDX))
    return Analysis(graph, R, C, pattern, tuple(sorted(k.cls.items())), tuple(sorted(k.dep.items())),
                    tuple(sorted(k.alias.items())), tuple(k.nodes), tuple(k.reds), bq, bp, periods,
                    imaps, k.seg, tuple(sorted(k.isrc.items())), k.permuted)


def analyze(graph: Graph) -> Analysis:
    """Classify ``graph`` on the first domain split under which it is supported, preferring
    splits where no bcol value keeps inner rows (P > 1): x[B, 8, C] + bias[8, C] reads the bias
    per column of [B, 8*C] more simply than as value[r % 8, c] of [B*8, C]."""
    if not graph.nodes:
        raise UnsupportedFusion("empty subgraph")
    # concats of slices: rolled reads and selects; slices and transposes of computed values:
    # of inputs
    graph = sink_transposes(sink_slices(lower_concats(graph)))
    for v, t in graph.types:
        if t.numel == 0:
            raise UnsupportedFusion(f"value {v!r} is empty ({t})")
        if t.numel >= 2 ** 31:
            raise UnsupportedFusion(f"value {v!r} has {t.numel} elements; the limit is 2^31 - 1")
    first: UnsupportedFusion | None = None
    inner: Analysis | None = None
    permuted: Analysis | None = None  # a transpose read element-wise where a tile could read it
    for R, C in domains(graph):
        try:
            a = _analyze_with(graph, R, C)
        except UnsupportedFusion as e:
            first = first or e
            continue
        if a.permuted_reads:
            permuted = permuted or a
        elif not a.bcol_p:
            return a
        else:
            inner = inner or a
    if inner is not None or permuted is not None:
        return inner or permuted
    raise first or UnsupportedFusion("no [R, C] domain fits the subgraph")
