"""Column-reduction kernels (col_tiled): a block owns a strip of TX*V columns and TY row lanes;
each thread accumulates its V columns over rows r = ty, ty + TY, ... of the block's row range
(U rows per trip, loads first), the TY partials combine in shared memory. With one row range
(split 1) the block then finishes the columns itself and writes the outputs that need them
(col_center: x - mean(x, 0)) in a second sweep over the rows, bottom-up so that the most
recently read rows are still in L2. With split S > 1 the partials go to global memory and a
second kernel finishes them (and sweeps the rows again where full-size outputs need them)."""

from __future__ import annotations

import math

from tunedb.kernels.analysis import COL, FULL, Reduction
from tunedb.kernels.expr import RED_INIT, emit_nodes, flit, red_comb
from tunedb.kernels.frame import Frame, KText, indent


def _leaf_loads(f: Frame, lc: dict, V: int, lines: list[str]) -> dict[str, str]:
    env = {}
    for v in lc[COL]:
        env[v] = f.col_load(v, "col", V, lines, guard="cok")
    return env


def acc_decls(f: Frame, reds: list, V: int) -> list[str]:
    """Per-thread accumulators of V columns for each column reduction, at their identity."""
    out = []
    for r in reds:
        acc = f"acc{f.names.idx[r.value]}"
        out.append(f"float {acc}[{V}];")
        out.append(f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) {acc}[k] = {RED_INIT[r.op]};")
    return out


def _element_loop(f: Frame, nodes: list, env: dict[str, str], reds: list, outs: list[str], V: int,
                  C: int, stores: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The unrolled loop over one vector of a row segment: evaluate ``nodes``, store each
    ``(destination, value)`` of ``stores`` (a row cache: the value may be one of ``nodes``), fold
    into the column accumulators, then store the outputs."""
    el: list[str] = []
    emit_nodes(f.a, f.names, nodes, env, el, f.s.fast_math)
    el += [f"{dst} = {env[v]};" for dst, v in stores]
    for r in reds:
        acc = f"acc{f.names.idx[r.value]}[k]"
        el.append(f"{acc} = {red_comb(r.op, acc, env[r.input])};")
    el += [f"res_{f.n(v)}[k] = {env[v]};" for v in outs]
    lines = [f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) {{", *indent(el), "}"]
    for v in outs:
        lines += f.vec_store_lines(v, f"r * {C}LL + col", V, f"res_{f.n(v)}")
    return lines


def _sweep(f: Frame, env: dict[str, str], targets: list[str], reds: list[Reduction], outs: list[str],
           TX: int, TY: int, V: int, U: int, reverse: bool, lines: list[str]) -> None:
    """One sweep over the block's rows: accumulate ``reds`` and store the full-size ``outs``."""
    C = f.C
    nodes, leaves = f.leaves_of(targets, set(env))
    lc = f.leaf_classes(leaves)
    e = dict(env)
    e.update(_leaf_loads(f, lc, V, lines))
    lines += acc_decls(f, reds, V)
    if reverse:
        lines.append(f"for (long long r0 = rend - 1 - ty; r0 >= rbeg; r0 -= {TY * U}) {{")
        rexpr, okexpr = f"r0 - u * {TY}", "r >= rbeg"
    else:
        lines.append(f"for (long long r0 = rbeg + ty; r0 < rend; r0 += {TY * U}) {{")
        rexpr, okexpr = f"r0 + u * {TY}", "r < rend"
    body = f.batched_loads(lc[FULL], V, U, "u", f"r = {rexpr}", f"cok && {okexpr}", f"r * {C}LL + col")
    body.append(f"#pragma unroll\nfor (int u = 0; u < {U}; ++u) {{")
    body.append(f"  const long long r = {rexpr};")
    body.append(f"  if (cok && {okexpr}) {{")
    inner: list[str] = []
    ee = dict(e)
    f.row_element_env(lc, "u", V, inner, ee)
    inner += [f"{f.ct(v)} res_{f.n(v)}[{V}];" for v in outs]
    inner += _element_loop(f, nodes, ee, reds, outs, V, C)
    body += indent(inner, 2)
    body.append("  }\n}")
    lines += indent(body)
    lines.append("}")


def _combine(f: Frame, reds: list[Reduction], allreds: list[Reduction], TX: int, TY: int, V: int,
             lines: list[str], dst: str) -> None:
    """TY partials per column -> thread tid < strip holds its column's value in ``a{n}``; then
    ``dst`` ("scol" or "part") receives it."""
    strip = TX * V
    for kk, r in enumerate(reds):
        acc = f"acc{f.names.idx[r.value]}"
        lines.append(f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) "
                     f"sred[({kk * TY} + ty) * {strip} + tx * {V} + k] = {acc}[k];")
    lines.append("__syncthreads();")
    lines.append(f"if (tid < {strip}) {{")
    inner = [f"const long long c = (long long)blockIdx.x * {strip} + tid;"]
    for kk, r in enumerate(reds):
        a = f"a{f.names.idx[r.value]}"
        inner.append(f"float {a} = sred[{kk * TY * strip} + tid];")
        part = red_comb(r.op, a, f"sred[({kk * TY} + t) * {strip} + tid]")
        inner.append(f"for (int t = 1; t < {TY}; ++t) {a} = {part};")
        if dst == "scol":
            if r.op == "reduce_mean":
                inner.append(f"{a} = {a} * {flit(1.0 / f.a.seg)};")
            inner.append(f"scol[{allreds.index(r) * strip} + tid] = {a};")
        else:
            g = allreds.index(r)
            inner.append(f"if (c < {f.C}LL) part[({g}LL * gridDim.y + blockIdx.y) * {f.C}LL + c] = {a};")
    lines += indent(inner)
    lines.append("}")
    lines.append("__syncthreads();")


def _col_outputs(f: Frame, reds: list[Reduction], strip: int, env: dict[str, str], lines: list[str],
                 arr: str = "scol", who: str = "blockIdx.y == 0", strip_id: str = "blockIdx.x") -> None:
    """Per-column outputs, by threads tid < strip from the finished values in ``arr``."""
    outs = f.outputs_of(COL)
    if not outs:
        return
    lines.append(f"if (tid < {strip} && {who}) {{")
    inner = [f"const long long c = (long long)({strip_id}) * {strip} + tid;", f"if (c < {f.C}LL) {{"]
    at = f"sg * {f.C}LL + c" if f.a.col_seg else "c"  # segment sg's row of the [R / seg, C] results
    e = dict(env)
    for kk, r in enumerate(reds):
        e[r.value] = f"{arr}[{kk * strip} + tid]"
    nodes, leaves = f.leaves_of(outs, set(e))
    for v in leaves:
        if f.cls.get(v) == COL:
            e[v] = f.conv(v, f"{f.param[v]}[c]")
    el: list[str] = []
    emit_nodes(f.a, f.names, nodes, e, el, f.s.fast_math, prefix="o")
    for v in outs:
        el += f.store_lines(v, at, e[v])
    inner += indent(el)
    inner.append("}")
    lines += indent(inner)
    lines.append("}")


def _head(f: Frame, TX: int, V: int, RS: int, S: int = 1) -> list[str]:
    """Thread coordinates and the block's rows [rbeg, rend): range blockIdx.y of R rows cut in
    RS; segmented (``col_seg``), range blockIdx.y % S of segment sg = blockIdx.y / S."""
    strip = TX * V
    out = ["extern __shared__ __align__(16) unsigned char tdb_smem[];",
           "const int tid = threadIdx.x;",
           f"const int tx = tid % {TX}, ty = tid / {TX};",
           f"const long long col = (long long)blockIdx.x * {strip} + tx * {V};",
           f"const bool cok = col < {f.C}LL;"]
    if f.a.col_seg:
        seg = f.a.col_seg
        return out + [f"const long long sg = (long long)blockIdx.y / {S};",
                      f"const long long rbeg = sg * {seg}LL + (long long)(blockIdx.y % {S}) * {RS};",
                      f"const long long rend = rbeg + {RS} < sg * {seg}LL + {seg}LL ? rbeg + {RS} "
                      f": sg * {seg}LL + {seg}LL;",
                      "(void)tx; (void)ty; (void)cok; (void)rbeg; (void)rend; (void)sg;"]
    return out + [f"const long long rbeg = (long long)blockIdx.y * {RS};",
                  f"const long long rend = rbeg + {RS} < {f.R}LL ? rbeg + {RS} : {f.R}LL;",
                  "(void)tx; (void)ty; (void)cok; (void)rbeg; (void)rend;"]


def _finished_env(f: Frame, reds: list[Reduction], TX: int, V: int, lines: list[str],
                  only: list[Reduction] | None = None, arr: str = "scol") -> dict[str, str]:
    env = {}
    strip = TX * V
    for kk, r in enumerate(reds):
        if only is not None and r not in only:
            continue
        cr = f"cr{f.names.idx[r.value]}"
        lines.append(f"float {cr}[{V}];")
        lines.append(f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) "
                     f"{cr}[k] = {arr}[{kk * strip} + tx * {V} + k];")
        env[r.value] = f"{cr}[k]"
    return env


def gen_col_tiled(f: Frame) -> tuple[list[KText], list[tuple[str, int]]]:
    s, a = f.s, f.a
    TX, B, V, U, S = s.group, s.block, s.vec, s.unroll, s.split
    TY = B // TX
    strip = TX * V
    GX = math.ceil(f.C / strip)
    reds = [r for r in a.reductions if r.axis == "col"]
    dep = a.dep
    fo = f.full_outputs()
    pre = [v for v in fo if dep.get(v, 0) == 0]
    post = [v for v in fo if dep.get(v, 0) > 0]
    A = f.R // a.seg  # segments (1 unless the reductions are over a middle block of axes)
    RS = math.ceil(a.seg / S)
    smem = 4 * (len(reds) * TY * strip + len(reds) * strip)
    lines = _head(f, TX, V, RS, S)
    senv = f.prologue(lines)
    lines.append("float* sred = reinterpret_cast<float*>(tdb_smem);")
    lines.append(f"float* scol = sred + {len(reds) * TY * strip};")
    lines.append("(void)scol;")
    env = dict(senv)
    levels = a.col_levels if S == 1 else 1
    for lev in range(levels):
        lr = [r for r in reds if r.level == lev]
        outs = pre if lev == 0 else []
        _sweep(f, env, [r.input for r in lr] + outs, lr, outs, TX, TY, V, U, False, lines)
        _combine(f, lr, reds, TX, TY, V, lines, "scol" if S == 1 else "part")
        if S == 1 and (lev + 1 < levels or post):
            fin = _finished_env(f, reds, TX, V, lines, only=lr)
            env.update(fin)
    if S == 1:
        _col_outputs(f, reds, strip, senv, lines, who="true" if A > 1 else "blockIdx.y == 0")
    texts = []
    if S == 1:
        if post:
            _sweep(f, env, post, [], post, TX, TY, V, U, True, lines)
        body = f.signature("@K@", [], B) + " {\n" + "\n".join(indent(lines)) + "\n}\n"
        return [KText(body, (GX, A, 1), (B, 1, 1), smem)], []
    body = f.signature("@K@", ["part"], B) + " {\n" + "\n".join(indent(lines)) + "\n}\n"
    texts.append(KText(body, (GX, A * S, 1), (B, 1, 1), smem, ("part",)))
    S2 = S if post else 1
    texts.append(_finish(f, reds, "part", S, TX, TY, V, U, S2, post))
    return texts, [("part", 4 * len(reds) * A * S * f.C)]


def _finish(f: Frame, reds: list[Reduction], src: str, P: int, TX: int, TY: int, V: int, U: int,
            S2: int, post: list[str]) -> KText:
    """Second kernel: column c's value = combine of P partials src[(k * P + p) * C + c]; then the
    per-column outputs and, where full-size outputs need the columns, a sweep over the rows."""
    B = TX * TY
    strip = TX * V
    GX = math.ceil(f.C / strip)
    A = f.R // f.a.seg
    RS = math.ceil(f.a.seg / S2)
    lines = _head(f, TX, V, RS, S2)
    senv = f.prologue(lines)
    lines.append("float* scol = reinterpret_cast<float*>(tdb_smem);")
    lines.append(f"if (tid < {strip}) {{")
    inner = [f"const long long c = (long long)blockIdx.x * {strip} + tid;", f"if (c < {f.C}LL) {{"]
    for kk, r in enumerate(reds):
        a = f"a{f.names.idx[r.value]}"
        # partial p of segment sg: written by the first kernel's block row y = sg * P + p
        first = f"({kk}LL * {A} + sg) * {P}" if A > 1 else f"{kk}LL * {P}"
        inner.append(f"  float {a} = {src}[{first} * {f.C}LL + c];")
        inner.append(f"  for (int p = 1; p < {P}; ++p) "
                     f"{a} = {red_comb(r.op, a, f'{src}[({first} + p) * {f.C}LL + c]')};")
        if r.op == "reduce_mean":
            inner.append(f"  {a} = {a} * {flit(1.0 / f.a.seg)};")
        inner.append(f"  scol[{kk * strip} + tid] = {a};")
    inner.append("}")
    lines += indent(inner)
    lines.append("}")
    lines.append("__syncthreads();")
    _col_outputs(f, reds, strip, senv, lines, who=f"blockIdx.y % {S2} == 0" if A > 1 else "blockIdx.y == 0")
    if post:
        env = dict(senv)
        env.update(_finished_env(f, reds, TX, V, lines))
        _sweep(f, env, post, [], post, TX, TY, V, U, True, lines)
    body = f.signature("@K@", [src], B) + " {\n" + "\n".join(indent(lines)) + "\n}\n"
    return KText(body, (GX, A * S2, 1), (B, 1, 1), 4 * len(reds) * strip, (src,))


def gen_col_finish(f: Frame, reds: list[Reduction], P: int) -> KText:
    """Finish kernel for a row-mapped multi pattern: 256 columns per block, no row sweep."""
    return _finish(f, reds, "colpart", P, 256, 1, 1, 1, 1, [])
