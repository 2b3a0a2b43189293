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

from tunedb.graph.ir import Graph, Node
from tunedb.kernels.classify import Classifier, Reduction
from tunedb.kernels.domain import (  # noqa: F401  (class names and the error, re-exported)
    BCOL,
    COL,
    FULL,
    IDX,
    ROW,
    SCALAR,
    TRANS,
    IndexMap,
    UnsupportedFusion,
    bcol_blocks,
    domains,
)
from tunedb.kernels.movement import lower_concats, sink_slices, sink_transposes

PATTERNS = ("elementwise", "row_reduce", "col_reduce", "transpose", "multi")

TRANSCENDENTAL = frozenset(("exp", "log", "sin", "cos", "tanh", "sigmoid", "erf", "gelu", "pow"))


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




def _analyze_with(graph: Graph, R: int, C: int) -> Analysis:
    k = Classifier(graph, R, C)
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
    # written at the domain's indices, so only one of the domain's size (a view of a smaller
    # input, as GQA's key heads beside the query's, would be written past its end)
    copies = {v for v, c in outs.items()
              if c == IDX and v in k.isrc and pattern == "elementwise" and k.numel(v) == R * C}
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
