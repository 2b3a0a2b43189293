"""Column reductions over a thread-block cluster (col_cluster, sm_90): a cluster of S blocks owns
a strip of TX*V columns, block q of it the rows [q*RS, (q+1)*RS). Each thread keeps its rows of
the strip in registers, so the input is read once even when full-size outputs need the column
results (col_center: x - mean(x, 0)); block partials meet through distributed shared memory.

Per level: sweep the cached rows, combine the TY partials of the block in shared memory
(``scol``), cluster barrier, each block combines the S block partials of its columns in rank
order (all blocks agree bit for bit) into ``sfin``; then the next level, the full-size outputs
from the registers, and the per-column outputs (rank 0). A final cluster barrier keeps every
block's shared memory alive until its peers have read it."""

from __future__ import annotations

import math

from tunedb.kernels.analysis import FULL
from tunedb.kernels.expr import red_comb
from tunedb.kernels.frame import Frame, KText, indent
from tunedb.kernels.gen_cols import (
    _col_outputs,
    _combine,
    _element_loop,
    _finished_env,
    _leaf_loads,
    acc_decls,
)
from tunedb.kernels.passes import cache_values


def _pass(f: Frame, env: dict[str, str], cached: list[str], first: bool, reds: list, outs: list[str],
          NJ: int, TY: int, V: int, lines: list[str]) -> None:
    C = f.C
    targets = [r.input for r in reds] + outs + (cached if first else [])
    have = set(env) | (set() if first else set(cached))
    nodes, leaves = f.leaves_of(targets, have)
    lc = f.leaf_classes(leaves)
    e = dict(env)
    e.update(_leaf_loads(f, lc, V, lines))
    lines += acc_decls(f, reds, V)
    if lc[FULL]:
        lines += f.batched_loads(lc[FULL], V, NJ, "j", f"r = rbeg + ty + j * {TY}", "cok && r < rend",
                                 f"r * {C}LL + col")
    lines.append(f"#pragma unroll\nfor (int j = 0; j < {NJ}; ++j) {{")
    body = [f"const long long r = rbeg + ty + j * {TY};", "if (cok && r < rend) {"]
    inner: list[str] = []
    f.row_element_env(lc, "j", V, inner, e)
    if not first:
        for i, v in enumerate(cached):
            e[v] = f"rc{i}[j * {V} + k]"
    inner += [f"{f.ct(v)} res_{f.n(v)}[{V}];" for v in outs]
    stores = tuple((f"rc{i}[j * {V} + k]", v) for i, v in enumerate(cached)) if first else ()
    inner += _element_loop(f, nodes, e, reds, outs, V, C, stores)
    body += indent(inner)
    body.append("}")
    lines += indent(body)
    lines.append("}")


def gen_col_cluster(f: Frame) -> tuple[list[KText], list[tuple[str, int]]]:
    s, a = f.s, f.a
    TX, B, V, S = s.group, s.block, s.vec, s.split
    TY = B // TX
    strip = TX * V
    GX = math.ceil(f.C / strip)
    RS = math.ceil(f.R / S)
    NJ = math.ceil(RS / TY)
    reds = [r for r in a.reductions if r.axis == "col"]
    dep = a.dep
    fo = f.full_outputs()
    pre = [v for v in fo if dep.get(v, 0) == 0]
    post = [v for v in fo if dep.get(v, 0) > 0]
    cached = list(cache_values(a, s.cache))
    n = len(reds)
    lines = ["extern __shared__ __align__(16) unsigned char tdb_smem[];",
             "const int tid = threadIdx.x;",
             f"const int tx = tid % {TX}, ty = tid / {TX};",
             "const unsigned rank = tdb_crank();",
             f"const long long col = (long long)(blockIdx.x / {S}) * {strip} + tx * {V};",
             f"const bool cok = col < {f.C}LL;",
             f"const long long rbeg = (long long)rank * {RS};",
             f"const long long rend = rbeg + {RS} < {f.R}LL ? rbeg + {RS} : {f.R}LL;",
             "(void)tx; (void)cok;"]
    senv = f.prologue(lines)
    lines.append("float* sred = reinterpret_cast<float*>(tdb_smem);")
    lines.append(f"float* scol = sred + {n * TY * strip};")
    lines.append(f"float* sfin = scol + {n * strip};")
    lines += [f"float rc{i}[{NJ * V}];" for i in range(len(cached))]
    env = dict(senv)
    for lev in range(a.col_levels):
        lr = [r for r in reds if r.level == lev]
        _pass(f, env, cached, lev == 0, lr, pre if lev == 0 else [], NJ, TY, V, lines)
        _combine(f, lr, reds, TX, TY, V, lines, "scol")  # block partials (means pre-scaled)
        lines.append("tdb_csync();")
        lines.append(f"if (tid < {strip}) {{")
        for r in lr:
            g = reds.index(r)
            fin = f"fin{f.names.idx[r.value]}"
            peer = red_comb(r.op, fin, f"tdb_dsmem_ld(scol + {g * strip} + tid, q)")
            lines.append(f"  float {fin} = tdb_dsmem_ld(scol + {g * strip} + tid, 0);")
            lines.append(f"#pragma unroll\n  for (unsigned q = 1; q < {S}; ++q) {fin} = {peer};")
            lines.append(f"  sfin[{g * strip} + tid] = {fin};")
        lines.append("}")
        lines.append("__syncthreads();")
        if lev + 1 < a.col_levels or post:
            env.update(_finished_env(f, reds, TX, V, lines, only=lr, arr="sfin"))
    if post:
        _pass(f, env, cached, False, [], post, NJ, TY, V, lines)
    _col_outputs(f, reds, strip, senv, lines, arr="sfin", who="rank == 0", strip_id=f"blockIdx.x / {S}")
    lines.append("tdb_csync();  // peers may still read this block's partials")
    smem = 4 * (n * TY * strip + 2 * n * strip)
    attr = f"__cluster_dims__({S}, 1, 1)"
    body = f.signature("@K@", [], B, attr) + " {\n" + "\n".join(indent(lines)) + "\n}\n"
    return [KText(body, (GX * S, 1, 1), (B, 1, 1), smem)], []
