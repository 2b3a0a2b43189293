"""Elementwise and tiled-transpose kernels: every output element depends on one input element
(plus per-row/per-column/scalar operands)."""

from __future__ import annotations

import math

from tunedb.kernels.analysis import BCOL, COL, FULL, IDX, ROW, TRANS
from tunedb.kernels.expr import emit_nodes
from tunedb.kernels.frame import Frame, KText, indent


def _element(f: Frame, env: dict[str, str], full: dict[str, str], col: dict[str, str],
             trans: dict[str, str], V: int, store_index: str, lines: list[str]) -> None:
    """The V elements of one vector: ``full``/``col``/``trans`` map leaves to expressions of k."""
    targets = f.full_outputs()
    nodes, _ = f.leaves_of(targets, set(env))
    body: list[str] = []
    e = dict(env)
    e.update(full)
    e.update(col)
    e.update(trans)
    emit_nodes(f.a, f.names, nodes, e, body, f.s.fast_math)
    decl = [f"{f.ct(v)} res_{f.n(v)}[{V}];" for v in targets]
    sets = [f"res_{f.n(v)}[k] = {e[v]};" for v in targets]
    lines += decl
    lines.append(f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) {{")
    lines += indent(body + sets)
    lines.append("}")
    for v in targets:
        lines += f.vec_store_lines(v, store_index, V, f"res_{f.n(v)}")


def _side_loads(f: Frame, lc: dict[str, list[str]], V: int, lines: list[str],
                env: dict[str, str]) -> dict[str, str]:
    """Loads of the per-row, per-column and bcol leaves at (``row``, ``col``): per-row and
    bcol ones go into ``env``; returns the per-column expressions of element k."""
    for v in lc[ROW]:
        lines.append(f"const {f.ct(v)} {f.n(v, 'r')} = {f.conv(v, f'{f.param[v]}[row]')};")
        env[v] = f.n(v, "r")
    cols = {v: f.col_load(v, "col", V, lines) for v in lc[COL]}
    f.bcol_loads(lc[BCOL] + lc[IDX], "row", "col", V, lines, env)
    return cols


def gen_elementwise(f: Frame) -> list[KText]:
    s, R, C = f.s, f.R, f.C
    B, V, U = s.block, s.vec, s.unroll
    N = R * C
    NV, tail = divmod(N, V)
    lines: list[str] = []
    env = f.prologue(lines)
    nodes, leaves = f.leaves_of(f.full_outputs(), set(env))
    lc = f.leaf_classes(leaves)
    need_rc = bool(lc[ROW] or lc[COL] or lc[TRANS] or lc[BCOL] or lc[IDX])
    lines.append(f"constexpr long long NV = {NV}LL;")
    lines.append(f"for (long long base = (long long)blockIdx.x * {B * U} + threadIdx.x; base < NV; "
                 f"base += (long long)gridDim.x * {B * U}) {{")
    inner = f.batched_loads(lc[FULL], V, U, "u", f"ch = base + u * {B}", "ch < NV", f"ch * {V}")
    inner.append(f"#pragma unroll\nfor (int u = 0; u < {U}; ++u) {{")
    inner.append(f"  const long long ch = base + u * {B};")
    inner.append("  if (ch < NV) {")
    el: list[str] = [f"const long long idx = ch * {V};"]
    if need_rc:
        el.append(f"const long long row = idx / {C}LL;")
        el.append(f"const long long col = idx - row * {C}LL;")
    e = dict(env)
    col = _side_loads(f, lc, V, el, e)
    full = {v: f.conv(v, f"ld_{f.n(v)}[u].v[k]") for v in lc[FULL]}
    trans = {v: f.conv(v, f"{f.param[v]}[{f.trans_index(v, '(col + k)', 'row')}]") for v in lc[TRANS]}
    _element(f, e, full, col, trans, V, "idx", el)
    inner += indent(el, 2)
    inner.append("  }\n}")
    lines += indent(inner)
    lines.append("}")
    if tail:
        # Only all-full-size graphs may leave a tail (otherwise vec divides C): scalar epilogue.
        lines.append(f"if (blockIdx.x == 0 && threadIdx.x < {tail}) {{")
        t: list[str] = [f"const long long idx = NV * {V} + threadIdx.x;"]
        full = {v: f.conv(v, f"{f.param[v]}[idx]") for v in lc[FULL]}
        _element(f, env, full, {}, {}, 1, "idx", t)
        lines += indent(t)
        lines.append("}")
    grid = max(1, math.ceil(NV / (B * U)))
    if s.grid == "wave":
        grid = min(grid, f.sm * max(1, 2048 // B))
    body = f.signature("@K@", [], B) + " {\n" + "\n".join(indent(lines)) + "\n}\n"
    return [KText(body, (grid, 1, 1), (B, 1, 1))]


def _transpose_head(f: Frame) -> tuple[list[str], dict[str, str], dict[str, list[str]], int]:
    """Prologue, tile origin and thread coordinates of a transpose kernel: (lines, env, leaf
    classes, shared-memory bytes)."""
    s = f.s
    T, TX = s.tile, s.tile // s.vec
    lines: list[str] = []
    env = f.prologue(lines)
    _, leaves = f.leaves_of(f.full_outputs(), set(env))
    lc = f.leaf_classes(leaves)
    lines.append("extern __shared__ __align__(16) unsigned char tdb_smem[];")
    lines.append(f"const int tx = threadIdx.x % {TX}, ty = threadIdx.x / {TX};")
    lines.append(f"const long long c0 = (long long)blockIdx.x * {T}, r0 = (long long)blockIdx.y * {T};")
    return lines, env, lc, 4 * T * (T + 1) * len(lc[TRANS])


def _transpose_outputs(f: Frame, env: dict[str, str], lc: dict[str, list[str]], head: list[str],
                       full_loads: list[str], full: dict[str, str]) -> list[str]:
    """The loop body computing and storing one vector of tile row ``j`` (coalesced along C):
    ``head`` opens it, ``full_loads``/``full`` give the full-size leaves. Swizzled, the tile
    column is first read into registers in the lane's own order (see ``gen_transpose``)."""
    R, C, V = f.R, f.C, f.s.vec
    el = list(head)
    if f.s.swizzle:
        for v in lc[TRANS]:
            el.append(f"float tr_{f.n(v)}[{V}];")
            el.append(f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) "
                      f"tr_{f.n(v)}[k] = tile_{f.n(v)}[tx * {V} + (k ^ sw)][j];")
        trans = {v: f"(sw ? tr_{f.n(v)}[k ^ {V // 2}] : tr_{f.n(v)}[k])" for v in lc[TRANS]}
    else:
        trans = {v: f"tile_{f.n(v)}[tx * {V} + k][j]" for v in lc[TRANS]}
    el += [f"const long long row = r0 + j, col = c0 + tx * {V};", f"if (row < {R}LL && col < {C}LL) {{"]
    inner = [f"const long long idx = row * {C}LL + col;"] + full_loads
    e = dict(env)
    col = _side_loads(f, lc, V, inner, e)
    _element(f, e, full, col, trans, V, "idx", inner)
    el += indent(inner)
    el.append("}")
    return el


def _transpose_kernel(f: Frame, lines: list[str], smem: int) -> list[KText]:
    s = f.s
    grid = (math.ceil(f.C / s.tile), math.ceil(f.R / s.tile), 1)
    body = f.signature("@K@", [], s.block) + " {\n" + "\n".join(indent(lines)) + "\n}\n"
    return [KText(body, grid, (s.block, 1, 1), smem)]


def gen_transpose(f: Frame) -> list[KText]:
    """32x32 or 64x64 tiles: transposed inputs are read along their contiguous axis into padded
    shared memory, then every access to global memory is coalesced along C. With ``unroll`` > 1
    every global load of the tile (transposed and full-size inputs) is issued into registers
    before the first shared-memory store, so a thread has all of them in flight at once.

    ``swizzle`` (64-wide tiles, hoisted): in the padded tile, lanes tx and tx + 32/V of a warp
    hit the same banks (2-way conflicts on every shared store and load); they instead walk their
    V columns in different orders (element k ^ V/2), which spreads a warp over all 32 banks."""
    if f.s.unroll > 1:
        return _gen_transpose_hoisted(f)
    s, R, C = f.s, f.R, f.C
    T, V, B = s.tile, s.vec, s.block
    TY = B // (T // V)
    lines, env, lc, smem = _transpose_head(f)
    for k, v in enumerate(lc[TRANS]):
        tile = f"tile_{f.n(v)}"
        lines.append(f"float (*{tile})[{T + 1}] = reinterpret_cast<float (*)[{T + 1}]>"
                     f"(tdb_smem + {4 * T * (T + 1) * k});")
        lines.append(f"for (int j = ty; j < {T}; j += {TY}) {{")
        lines.append(f"  const long long c = c0 + j, r = r0 + tx * {V};")
        lines.append(f"  if (c < {C}LL && r < {R}LL) {{")
        lines.append(f"    const tdb_vec<{f.st(v)}, {V}> t = {f.vec_load(v, f.trans_index(v, 'c', 'r'), V)};")
        lines.append(f"#pragma unroll\n    for (int k = 0; k < {V}; ++k) {tile}[j][tx * {V} + k] = "
                     f"{f.conv(v, 't.v[k]')};")
        lines.append("  }\n}")
    if lc[TRANS]:
        lines.append("__syncthreads();")
    lines.append(f"for (int j = ty; j < {T}; j += {TY}) {{")
    loads = [f"const tdb_vec<{f.st(v)}, {V}> ld_{f.n(v)} = {f.vec_load(v, 'idx', V)};" for v in lc[FULL]]
    full = {v: f.conv(v, f"ld_{f.n(v)}.v[k]") for v in lc[FULL]}
    lines += indent(_transpose_outputs(f, env, lc, [], loads, full))
    lines.append("}")
    return _transpose_kernel(f, lines, smem)


def _gen_transpose_hoisted(f: Frame) -> list[KText]:
    s, R, C = f.s, f.R, f.C
    T, V, B = s.tile, s.vec, s.block
    TY = B // (T // V)
    NI = T // TY  # tile rows per thread (legality: TY divides T)
    lines, env, lc, smem = _transpose_head(f)
    if s.swizzle and lc[TRANS]:
        # lanes tx and tx + 32/V share banks; one of the two swaps the halves of its vector
        lines.append(f"const int sw = (tx & {32 // V}) ? {V // 2} : 0;")
    # 1. every global load of the tile, into registers
    for v in lc[TRANS]:
        lines.append(f"tdb_vec<{f.st(v)}, {V}> tl_{f.n(v)}[{NI}];")
    for v in lc[FULL]:
        lines.append(f"tdb_vec<{f.st(v)}, {V}> ld_{f.n(v)}[{NI}];")
    lines.append(f"#pragma unroll\nfor (int i = 0; i < {NI}; ++i) {{")
    lines.append(f"  const int j = ty + i * {TY};")
    if lc[TRANS]:
        lines.append(f"  const long long tc = c0 + j, tr = r0 + tx * {V};")
        lines.append(f"  if (tc < {C}LL && tr < {R}LL) {{")
        lines += [f"    tl_{f.n(v)}[i] = {f.vec_load(v, f.trans_index(v, 'tc', 'tr'), V)};"
                  for v in lc[TRANS]]
        lines.append("  }")
    if lc[FULL]:
        lines.append(f"  const long long row = r0 + j, col = c0 + tx * {V};")
        lines.append(f"  if (row < {R}LL && col < {C}LL) {{")
        lines += [f"    ld_{f.n(v)}[i] = {f.vec_load(v, f'row * {C}LL + col', V)};" for v in lc[FULL]]
        lines.append("  }")
    lines.append("}")
    # 2. transposed tiles through shared memory
    for k, v in enumerate(lc[TRANS]):
        tile = f"tile_{f.n(v)}"
        lines.append(f"float (*{tile})[{T + 1}] = reinterpret_cast<float (*)[{T + 1}]>"
                     f"(tdb_smem + {4 * T * (T + 1) * k});")
        lines.append(f"#pragma unroll\nfor (int i = 0; i < {NI}; ++i) {{")
        loop = f"#pragma unroll\n  for (int k = 0; k < {V}; ++k) {tile}[ty + i * {TY}]"
        val = f.conv(v, f"tl_{f.n(v)}[i].v[k]")
        if s.swizzle:  # element k ^ sw goes to its own column; which one a lane writes first varies
            swapped = f.conv(v, f"tl_{f.n(v)}[i].v[k ^ {V // 2}]")
            lines.append(f"{loop}[tx * {V} + (k ^ sw)] = sw ? {swapped} : {val};")
        else:
            lines.append(f"{loop}[tx * {V} + k] = {val};")
        lines.append("}")
    if lc[TRANS]:
        lines.append("__syncthreads();")
    # 3. compute and store, coalesced along C
    lines.append(f"#pragma unroll\nfor (int i = 0; i < {NI}; ++i) {{")
    full = {v: f.conv(v, f"ld_{f.n(v)}[i].v[k]") for v in lc[FULL]}
    lines += indent(_transpose_outputs(f, env, lc, [f"const int j = ty + i * {TY};"], [], full))
    lines.append("}")
    return _transpose_kernel(f, lines, smem)
