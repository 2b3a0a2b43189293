"""What every generated kernel shares: parameter names, signature, constants, scalar prologue."""

from __future__ import annotations

import numpy as np

from tunedb.graph.ir import DTYPE_BYTES
from tunedb.kernels.analysis import BCOL, COL, FULL, IDX, ROW, SCALAR, TRANS, Analysis, UnsupportedFusion
from tunedb.kernels.domain import index_expr
from tunedb.kernels.expr import (
    COMPUTE,
    STORAGE,
    Names,
    cone,
    emit_nodes,
    literal,
    load_conv,
    scalar_leaf,
    store_conv,
)
from tunedb.kernels.schedule import Schedule

PH = "@P@"                 # replaced by the plan's unique prefix once the sources are hashed
MAX_CONST_ELEMS = 65536    # larger constants would bloat the source: pass them as inputs


class Frame:
    def __init__(self, a: Analysis, s: Schedule, sm_count: int) -> None:
        self.a, self.s, self.sm = a, s, sm_count
        self.g = a.graph
        self.cls = a.cls
        self.names = Names(a)
        self.R, self.C = a.R, a.C
        self.param: dict[str, str] = {}
        for i, v in enumerate(self.g.inputs):
            self.param[v] = f"in{i}"
        for v, src in a.idx_src:
            self.param[v] = self.param[src]  # a rolled read indexes its source's buffer
        self.out_params: dict[str, list[tuple[str, str]]] = {}   # resolved value -> [(param, dtype)]
        for j, v in enumerate(self.g.outputs):
            self.out_params.setdefault(a.resolve(v), []).append((f"out{j}", self.g.type_of(v).dtype))
        self.const_decls: list[str] = []
        for k, (v, c) in enumerate(self.g.constants):
            if c.type.numel == 1 and self.cls.get(v) in (SCALAR, None):
                continue
            if c.type.numel > MAX_CONST_ELEMS:
                raise UnsupportedFusion(f"constant {v!r} has {c.type.numel} elements > {MAX_CONST_ELEMS}")
            raw = np.frombuffer(c.data, dtype={"float32": "<f4", "float16": "<u2", "bfloat16": "<u2",
                                               "int32": "<i4", "int64": "<i8", "bool": "u1"}[c.type.dtype])
            if c.type.dtype == "float32":
                items = [literal(float(x), "float32") for x in raw]
            else:
                items = [str(int(x)) + ("LL" if c.type.dtype == "int64" else "") for x in raw]
            name = f"{PH}_c{k}"
            self.param[v] = name
            body = ", ".join(items)
            self.const_decls.append(
                f"__device__ __align__(16) const {STORAGE[c.type.dtype]} {name}[{len(items)}] = {{{body}}};")

    # -- values ------------------------------------------------------------------------------
    def dtype(self, v: str) -> str:
        return self.g.type_of(v).dtype

    def st(self, v: str) -> str:
        return STORAGE[self.dtype(v)]

    def ct(self, v: str) -> str:
        return COMPUTE[self.dtype(v)]

    def n(self, v: str, prefix: str = "n") -> str:
        return self.names(v, prefix)

    def leaves_of(self, targets: list[str], have: set[str]) -> tuple[list, list[str]]:
        return cone(self.a, targets, have)

    def full_outputs(self) -> list[str]:
        # an index-mapped output (a view of an input: a split piece) is stored as it is read
        mapped = dict(self.a.idx_src)
        return [v for v in self.out_params if self.cls[v] == FULL or self.cls[v] == IDX and v in mapped]

    def outputs_of(self, k: str) -> list[str]:
        return [v for v in self.out_params if self.cls[v] == k]

    def store_lines(self, v: str, index: str, value: str) -> list[str]:
        return [f"{p}[{index}] = {store_conv(dt, value)};" for p, dt in self.out_params[v]]

    # -- source pieces -----------------------------------------------------------------------
    def signature(self, kname: str, scratch: list[str], block: int, attr: str = "") -> str:
        ps = [f"const {self.st(v)}* __restrict__ {self.param[v]}" for v in self.g.inputs]
        for v in self.g.outputs:
            rv = self.a.resolve(v)
            for p, dt in self.out_params[rv]:
                decl = f"{STORAGE[dt]}* __restrict__ {p}"
                if decl not in ps:
                    ps.append(decl)
        ps += [f"float* __restrict__ {w}" for w in scratch]
        ps += ["long long R", "long long C"]
        attr = attr + " " if attr else ""
        return (f'extern "C" __global__ void {attr}__launch_bounds__({block}) {kname}(\n    '
                + ",\n    ".join(ps) + ")")

    def prologue(self, lines: list[str]) -> dict[str, str]:
        """Kernel-scope scalars: scalar constants/inputs and the nodes computed from them only."""
        env: dict[str, str] = {}
        scal = [v for v, k in self.cls.items() if k == SCALAR]
        nodes, leaves = cone(self.a, scal, set())
        for v in leaves:
            if self.cls.get(v) == SCALAR:
                x = scalar_leaf(self.a, v, lambda u: self.param[u])
                name = self.n(v, "s")
                lines.append(f"const {self.ct(v)} {name} = {x};")
                env[v] = name
        emit_nodes(self.a, self.names, [n for n in nodes if self.cls[n.outputs[0]] == SCALAR], env, lines,
                   self.s.fast_math, prefix="s")
        return env

    def leaf_classes(self, leaves: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {FULL: [], ROW: [], COL: [], TRANS: [], SCALAR: [], BCOL: [], IDX: []}
        for v in leaves:
            k = self.cls.get(v)
            if k not in out:
                raise UnsupportedFusion(f"internal: leaf {v!r} has no class")
            out[k].append(v)
        return out

    def vec_load(self, v: str, index: str, V: int) -> str:
        # every vector load of a streaming schedule, the per-column vectors (a bias) included: the
        # form benchmarks/twins.py measured
        fn = "tdb_ldcs" if self.s.stream else "tdb_ldel" if self.s.evict_last else "tdb_ld"
        return f"{fn}<{self.st(v)}, {V}>({self.param[v]} + ({index}))"

    def trans_index(self, v: str, col: str, row: str) -> str:
        """Offset of domain element (row, col) in transposed input ``v``: col * R + row for a
        2-D transpose; with batches of P rows, batch row / P of [C, P] matrices."""
        p = self.a.period(v)
        if p == self.R:
            return f"{col} * {self.R}LL + {row}"
        r = row if row.isidentifier() else f"({row})"
        return f"{r} / {p}LL * {self.C * p}LL + {col} * {p}LL + {r} % {p}LL"

    def bcol_index(self, v: str, row: str, col: str) -> str:
        """Offset of element (row, col) of bcol value ``v``: ((row / Q) * P + row % P) * C + col,
        written without the terms that are constant (P = 1: row / Q; Q = R: row % P)."""
        r = row if row.isidentifier() else f"({row})"
        q, p = self.a.q[v], self.a.p[v]
        if p == 1:
            return f"{r} / {q}LL * {self.C}LL + {col}"
        if q == self.R:
            return f"{r} % {p}LL * {self.C}LL + {col}"
        return f"({r} / {q}LL * {p}LL + {r} % {p}LL) * {self.C}LL + {col}"

    def bcol_loads(self, leaves: list[str], row: str, col: str, V: int, lines: list[str],
                   env: dict[str, str]) -> None:
        """Loads of the bcol leaves at (row, col .. col + V - 1), vectors like per-column ones
        (V divides C, so a vector stays inside one row of the [R/Q, C] array). A leaf wider than
        the full-size data (an int64 mask next to float scores) does not cap the kernel's vector
        width: where V of its elements exceed 16 bytes it is read element by element (it is
        small and stays in cache). Index-mapped leaves (``idx``) are read element by element at
        offset map(row * C + col + k)."""
        imaps = dict(self.a.idx_maps)
        for v in leaves:
            if v in imaps:
                r = row if row.isidentifier() else f"({row})"
                m = imaps[v]
                at = row_index_expr(m, r, col, self.R, self.C, V)
                if V > 1 and V * DTYPE_BYTES[self.dtype(v)] <= 16 and _vector_map(m, V):
                    # V consecutive elements stay consecutive and aligned in the source: one load
                    load = self.vec_load(v, at, V)
                    lines.append(f"const tdb_vec<{self.st(v)}, {V}> il_{self.n(v)} = {load};")
                    env[v] = self.conv(v, f"il_{self.n(v)}.v[k]")
                    continue
                if V > 1 and self.C % V == 0 and all(t[0] % V == 0 for t in m):
                    # the map steps only every V elements (GroupNorm's per-channel affine): one
                    # element serves the whole vector
                    lines.append(f"const {self.st(v)} iu_{self.n(v)} = {self.param[v]}[{at}];")
                    env[v] = self.conv(v, f"iu_{self.n(v)}")
                    continue
                at = row_index_expr(m, r, f"{col} + k", self.R, self.C, V)
                env[v] = self.conv(v, f"{self.param[v]}[{at}]")
                continue
            idx = self.bcol_index(v, row, col)
            if V * DTYPE_BYTES[self.dtype(v)] > 16:
                lines.append(f"const long long bo_{self.n(v)} = {idx};")
                env[v] = self.conv(v, f"{self.param[v]}[bo_{self.n(v)} + k]")
            else:
                lines.append(f"const tdb_vec<{self.st(v)}, {V}> bl_{self.n(v)} = {self.vec_load(v, idx, V)};")
                env[v] = self.conv(v, f"bl_{self.n(v)}.v[k]")

    def batched_loads(self, vs: list[str], V: int, n: int, var: str, index: str, guard: str,
                      offset: str) -> list[str]:
        """Arrays ``ld_<v>[n]`` of the full-size leaves ``vs``, filled by one unrolled loop over
        ``var`` (declaring ``index``, loading at ``offset`` where ``guard`` holds) before any
        math, so that all ``n`` vector loads of a thread are in flight together."""
        lines = [f"tdb_vec<{self.st(v)}, {V}> ld_{self.n(v)}[{n}];" for v in vs]
        lines.append(f"#pragma unroll\nfor (int {var} = 0; {var} < {n}; ++{var}) {{")
        lines.append(f"  const long long {index};")
        lines.append(f"  if ({guard}) {{")
        lines += [f"    ld_{self.n(v)}[{var}] = {self.vec_load(v, offset, V)};" for v in vs]
        lines.append("  }\n}")
        return lines

    def row_element_env(self, lc: dict[str, list[str]], var: str, V: int, lines: list[str],
                        env: dict[str, str]) -> None:
        """Names in ``env`` of the leaves at row ``r``, columns ``col`` ..: per-row leaves read
        once into ``lines``, bcol and idx leaves loaded, full leaves from ``ld_<v>[var]``
        (``batched_loads``)."""
        for v in lc[ROW]:
            lines.append(f"const {self.ct(v)} {self.n(v, 'r')} = {self.conv(v, f'{self.param[v]}[r]')};")
            env[v] = self.n(v, "r")
        self.bcol_loads(lc[BCOL] + lc[IDX], "r", "col", V, lines, env)
        for v in lc[FULL]:
            env[v] = self.conv(v, f"ld_{self.n(v)}[{var}].v[k]")

    def col_load(self, v: str, col: str, V: int, lines: list[str], guard: str = "") -> str:
        """Load per-column leaf ``v`` at columns col .. col + V - 1 into ``lines``; returns the
        expression of element k. A leaf wider than the kernel's vectors (int64 class ids next
        to float logits) is read element by element: it is small and stays in cache, and it
        must not cap the vector width of the full-size data (``schedule.full_bytes``)."""
        if V * DTYPE_BYTES[self.dtype(v)] > 16:
            return self.conv(v, f"{self.param[v]}[{col} + k]")
        name = f"cl_{self.n(v)}"
        if guard:
            lines.append(f"tdb_vec<{self.st(v)}, {V}> {name};")
            lines.append(f"if ({guard}) {name} = {self.vec_load(v, col, V)};")
        else:
            lines.append(f"const tdb_vec<{self.st(v)}, {V}> {name} = {self.vec_load(v, col, V)};")
        return self.conv(v, f"{name}.v[k]")

    def vec_store_lines(self, v: str, index: str, V: int, vals: str) -> list[str]:
        """Store the V computed values ``vals[v]`` of value ``v`` to every output buffer of it."""
        out = []
        for p, dt in self.out_params[v]:
            t = f"sv_{p}"
            out.append(f"tdb_vec<{STORAGE[dt]}, {V}> {t};")
            conv = store_conv(dt, f"{vals}[k]")
            out.append(f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) {t}.v[k] = {conv};")
            fn = "tdb_stcs" if self.s.stream else "tdb_st"
            out.append(f"{fn}<{STORAGE[dt]}, {V}>({p} + ({index}), {t});")
        return out

    def conv(self, v: str, raw: str) -> str:
        return load_conv(self.dtype(v), raw)


def row_index_expr(m: tuple[tuple[int, ...], ...], row: str, col: str, R: int, C: int, V: int) -> str:
    """``index_expr(m, row * C + col)`` over an [R, C] domain for a ``col`` < C (V divides C): a
    term's quotient split into its row and column parts where its divisor divides C or C
    divides it, in 32-bit arithmetic where every offset fits. A 64-bit division by a constant
    costs tens of instructions an element (GroupNorm's affine behind a reshape had two)."""
    numel = R * C
    span = sum(((t[4] if len(t) == 5 else t[1]) - 1) * t[2] for t in m)
    if C % V or numel >= 1 << 31 or span >= 1 << 31:
        return index_expr(m, f"{row} * {C}LL + {col}", numel)
    r, c = f"(unsigned)({row})", f"(unsigned)({col})"
    parts = []
    for div, mod, st, *shift in m:
        if div % C == 0:
            x = r if div == C else f"{r} / {div // C}u"
        elif C % div == 0:
            x = f"{r} * {C // div}u + {c} / {div}u" if div > 1 else f"{r} * {C}u + {c}"
        else:
            x = f"({r} * {C}u + {c}) / {div}u"
        if div * mod < numel:
            x = f"({x}) % {mod}u"
        if shift and shift[0]:
            x = f"(({x}) + {shift[0]}u) % {shift[1]}u"
        elif shift and shift[1] < mod:
            x = f"({x}) % {shift[1]}u"
        parts.append(x if st == 1 else f"({x}) * {st}u")
    return " + ".join(parts) or "0u"


def _vector_map(m: tuple[tuple[int, ...], ...], V: int) -> bool:
    """Whether an index map sends every V-aligned run of V domain elements to V consecutive,
    V-aligned source elements: its innermost term steps by 1 over whole vectors (a shift and a
    wrap that keep vectors whole) and every other term steps by multiples of V."""
    if not m or m[-1][0] != 1 or m[-1][2] != 1 or m[-1][1] % V:
        return False
    if len(m[-1]) == 5 and (m[-1][3] % V or m[-1][4] % V):
        return False
    return all(t[2] % V == 0 for t in m[:-1])


class KText:
    """One kernel before naming: body text with ``@K@`` for its name, and its launch shape."""

    def __init__(self, body: str, grid: tuple[int, int, int], block: tuple[int, int, int],
                 smem: int = 0, scratch: tuple[str, ...] = ()) -> None:
        self.body, self.grid, self.block, self.smem, self.scratch = body, grid, block, smem, scratch


def indent(lines: list[str], n: int = 1) -> list[str]:
    pad = "  " * n
    return [pad + ln if ln else ln for s in lines for ln in s.split("\n")]
