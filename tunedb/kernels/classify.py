"""The value classifier of the fused-kernel analysis: every value of a subgraph given its class
(full, row, col, scalar, trans, bcol, idx) on one [R, C] domain split. The classes, the domain
and the checks on the outcome are described in ``tunedb.kernels.analysis``, which runs it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import canonical_attrs, slice_bounds
from tunedb.kernels.domain import (
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
    broadcast_class,
    broadcast_view,
    contiguous_view,
    index_map,
    permuted_view,
    reshaped_view,
    shifted_view,
    split_at,
    view_map,
)

ALIAS_OPS = frozenset(("reshape", "squeeze", "unsqueeze", "expand", "identity"))
COMPUTE_UNARY = frozenset((
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid",
    "relu", "erf", "floor", "ceil", "sign", "not", "gelu", "clip", "cast", "leaky_relu"))
COMPUTE_BINARY = frozenset((
    "add", "sub", "mul", "div", "pow", "max", "min", "mod",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or"))


@dataclass(frozen=True)
class Reduction:
    value: str      # the reduction's output value
    op: str         # reduce_sum | reduce_mean | reduce_max | reduce_min | reduce_prod
    input: str      # the (alias-resolved) value reduced
    axis: str       # "row" (over C) or "col" (over R)
    level: int


class Classifier:
    """Walks a subgraph's nodes in order and gives every value its class on the [R, C] domain;
    ``tunedb.kernels.analysis`` checks the outcome and builds the ``Analysis``."""

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
        rs = self.resolve(src)
        # the source itself full-size: an expand in the alias chain (GQA's repeated heads) is
        # no copy of the input, and reading it permuted as if it were would run past its end
        if rs not in self.leaves or self.numel(rs) != self.N:
            raise UnsupportedFusion(f"{what}: only full-size graph inputs can be read transposed")
        split = batched_transpose(perm, shape)
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
