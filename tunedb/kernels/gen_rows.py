"""Row-mapped kernels (warp_per_row, block_per_row, rows_per_block): a group of T threads owns a
row; thread ``lane`` holds columns (i*T + lane)*V .. +V for i < NIT. The row is read once (pass
0) into the row cache (registers or shared memory) or re-read each pass; pass l finishes the
level-l row reductions (shuffles within a warp, shared memory across warps); the last pass
writes the full-size outputs. Column reductions (multi pattern) accumulate per thread across
its rows, combine per block, and go to a second kernel as per-block partials."""

from __future__ import annotations

import math

from tunedb.kernels.analysis import BCOL, COL, FULL, IDX, ROW
from tunedb.kernels.domain import index_expr
from tunedb.kernels.expr import RCP, RED_INIT, RED_WARP, emit_nodes, flit, reciprocals, red_comb
from tunedb.kernels.frame import Frame, KText, indent
from tunedb.kernels.gen_cols import gen_col_finish
from tunedb.kernels.passes import cache_values
from tunedb.kernels.schedule import DTYPE_BYTES, MAX_UNROLLED, row_smem_layout

SMEM_PER_SM = 228 * 1024
# Asynchronous global -> shared copies (sm_80+), emitted only into kernels that prefetch rows,
# so every other generated source stays byte-identical. Host compilers (the CPU emulation of
# the tests) get a plain copy.
CP_ASYNC = r"""#ifndef TDB_CP_ASYNC
#define TDB_CP_ASYNC
#if defined(__CUDA_ARCH__)
template <int N> static __device__ __forceinline__ void tdb_cp_async(void* s, const void* g) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(s);
  if (N == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(g) : "memory");
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(a), "l"(g), "n"(N) : "memory");
}
static __device__ __forceinline__ void tdb_cp_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
static __device__ __forceinline__ void tdb_cp_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }
#else
template <int N> static inline void tdb_cp_async(void* s, const void* g) { memcpy(s, g, N); }
static inline void tdb_cp_commit() {}
static inline void tdb_cp_wait() {}
#endif
#endif
"""


class _Row:
    def __init__(self, f: Frame) -> None:
        self.f = f
        a, s = f.a, f.s
        self.a, self.s = a, s
        self.T = s.threads_per_row
        self.B = s.block
        self.S = s.row_split          # blocks of one cluster sharing a row (split_row)
        self.G = self.B // self.T
        self.V = s.vec
        self.TS = self.T * self.S       # threads across a row
        self.NIT = math.ceil(a.C / (self.TS * self.V))
        self.cover = a.C % (self.TS * self.V) == 0
        self.mode = s.row_cache
        # prefetch: the row cache is in registers, and the next row's full-size inputs stream
        # into shared memory (cp.async) while this row is reduced and written
        self.regs = self.mode in ("registers", "prefetch")
        self.pf = self.mode == "prefetch"
        self.pf_leaves: list[str] = []
        self.cached = list(cache_values(a, s.cache)) if self.mode != "reread" else []
        self.rowreds = [r for r in a.reductions if r.axis == "row"]
        self.colreds = [r for r in a.reductions if r.axis == "col"]
        self.nlev = a.row_levels
        self.dep = a.dep
        fo = f.full_outputs()
        self.pre_outs = [v for v in fo if self.dep.get(v, 0) == 0]
        self.post_outs = [v for v in fo if self.dep.get(v, 0) > 0]
        conds = (["rv"] if self.G > 1 else []) + ([] if self.cover else [f"col < {a.C}"])
        self.cond = " && ".join(conds) or "true"
        self.renv: dict[str, str] = {}
        self.unroll = "#pragma unroll" if self.NIT <= MAX_UNROLLED else "#pragma unroll 4"

    def cache_ref(self, v: str) -> str:
        k = self.cached.index(v)
        if self.regs:
            return f"rc{k}[i * {self.V} + k]"
        return f"rcs[({k * self.NIT * self.V} + i * {self.V} + k) * {self.T} + lane]"

    # -- per-row scalar scope ---------------------------------------------------------------
    def row_scope(self, d: int, lines: list[str]) -> None:
        """ROW leaves (d = 0) and the ROW nodes whose inputs are ready after d levels."""
        f, a = self.f, self.a
        cls = a.cls
        if d == 0:
            for v in a.graph.inputs:
                if cls.get(v) == ROW:
                    name = f.n(v, "r")
                    lines.append(f"const {f.ct(v)} {name} = rv ? {f.conv(v, f'{f.param[v]}[row]')} : 0;")
                    self.renv[v] = name
            for v, _c in a.graph.constants:
                if cls.get(v) == ROW:
                    name = f.n(v, "r")
                    lines.append(f"const {f.ct(v)} {name} = rv ? {f.conv(v, f'{f.param[v]}[row]')} : 0;")
                    self.renv[v] = name
        for n in a.nodes:
            v = n.outputs[0]
            if cls.get(v) != ROW or self.dep.get(v, 0) != d or v in self.renv or n.op.startswith("reduce_"):
                continue
            if n.op == "gather_elements":
                self.gather(n, lines)
            else:
                emit_nodes(a, f.names, [n], self.renv_all(), lines, self.s.fast_math, prefix="r")
                self.renv[v] = f.n(v, "r")
        self.hoist_reciprocals(lines)

    def hoist_reciprocals(self, lines: list[str]) -> None:
        env = self.renv_all()
        reciprocals(self.a, [v for v in self.renv if not v.startswith(RCP)], env, lines, "rcp")
        self.renv.update({k: x for k, x in env.items() if k.startswith(RCP)})

    def renv_all(self) -> dict[str, str]:
        e = dict(self.senv)
        e.update(self.renv)
        return e

    def gather(self, n, lines: list[str]) -> None:
        """x[row, idx[row]]: evaluate the data expression at one element (point evaluation)."""
        f, a = self.f, self.a
        data, idx, out = a.resolve(n.inputs[0]), a.resolve(n.inputs[1]), n.outputs[0]
        env = self.renv_all()
        name = f.n(out, "r")
        gi = f"gi{f.names.idx[out]}"
        C = a.C
        lines.append(f"float {name};")
        lines.append("{")
        body = [f"long long {gi} = (long long)({env[idx]});",
                f"if ({gi} < 0) {gi} += {C}LL;",
                f"{gi} = {gi} < 0 ? 0 : ({gi} >= {C}LL ? {C - 1}LL : {gi});"]
        nodes, leaves = f.leaves_of([data], set(env))
        e = dict(env)
        for v in leaves:
            k = a.cls[v]
            if k == FULL:
                e[v] = f.conv(v, f"{f.param[v]}[(rv ? rbase : 0LL) + {gi}]")
            elif k == COL:
                e[v] = f.conv(v, f"{f.param[v]}[{gi}]")
            elif k == BCOL:
                e[v] = f.conv(v, f"{f.param[v]}[{f.bcol_index(v, 'rv ? row : 0LL', gi)}]")
            elif k == IDX:
                flat = f"(rv ? row : 0LL) * {C}LL + {gi}"
                e[v] = f.conv(v, f"{f.param[v]}[{index_expr(dict(a.idx_maps)[v], flat, a.R * C)}]")
        emit_nodes(a, f.names, nodes, e, body, self.s.fast_math, prefix=f"g{f.names.idx[out]}_")
        body.append(f"{name} = {e[data]};")
        lines += indent(body)
        lines.append("}")
        self.renv[out] = name

    # -- passes over the row ----------------------------------------------------------------
    def emit_pass(self, p: int, lines: list[str]) -> None:
        f, a, V = self.f, self.a, self.V
        reds = [r for r in self.rowreds if r.level == p]
        final = p == self.nlev
        outs = (self.pre_outs if p == 0 else []) + (self.post_outs if final else [])
        creds = self.colreds if final else []
        store_cache = p == 0 and self.mode != "reread"
        targets = ([r.input for r in reds] + outs + [r.input for r in creds]
                   + (self.cached if store_cache else []))
        have = set(self.renv_all())
        cache_avail = p > 0 and self.mode != "reread"
        if cache_avail:
            have |= set(self.cached)
        nodes, leaves = f.leaves_of(targets, have)
        lc = f.leaf_classes(leaves)
        for r in reds:
            lines.append(f"float acc{f.names.idx[r.value]} = {RED_INIT[r.op]};")
        preload = p == 0 and self.regs
        if preload and self.pf:
            self.pf_leaves = [v for v in lc[FULL] if v in f.param]
        if preload and lc[FULL]:
            for v in lc[FULL]:
                lines.append(f"tdb_vec<{f.st(v)}, {V}> ld_{f.n(v)}[{self.NIT}];")
            if self.pf_leaves:
                lines.append("tdb_cp_wait();  // this row, prefetched during the previous one")
            lines.append(f"#pragma unroll\nfor (int i = 0; i < {self.NIT}; ++i) {{")
            lines.append(f"  const int col = (i * {self.TS} + glane) * {V};")
            lines.append(f"  if ({self.cond}) {{")
            for v in lc[FULL]:
                slot = f"pf_{f.n(v)} + (i * {self.T} + lane) * {V}"
                src = (f"*reinterpret_cast<const tdb_vec<{f.st(v)}, {V}>*>({slot})"
                       if v in self.pf_leaves else f.vec_load(v, "rbase + col", V))
                lines.append(f"    ld_{f.n(v)}[i] = {src};")
            lines.append("  }\n}")
        lines.append(f"{self.unroll}\nfor (int i = 0; i < {self.NIT}; ++i) {{")
        body = [f"const int col = (i * {self.TS} + glane) * {V};", f"if ({self.cond}) {{"]
        inner: list[str] = []
        e = self.renv_all()
        if not preload:
            for v in lc[FULL]:
                ld = f.vec_load(v, "rbase + col", V)
                inner.append(f"const tdb_vec<{f.st(v)}, {V}> ld_{f.n(v)} = {ld};")
        cols = {v: f.col_load(v, "col", V, inner) for v in lc[COL]}
        f.bcol_loads(lc[BCOL] + lc[IDX], "row", "col", V, inner, e)
        for v in outs:
            inner.append(f"{f.ct(v)} res_{f.n(v)}[{V}];")
        el: list[str] = []
        for v in lc[FULL]:
            e[v] = f.conv(v, f"ld_{f.n(v)}[i].v[k]" if preload else f"ld_{f.n(v)}.v[k]")
        e.update(cols)
        if cache_avail:
            for v in self.cached:
                e[v] = self.cache_ref(v)
        emit_nodes(a, f.names, nodes, e, el, self.s.fast_math)
        if store_cache:
            el += [f"{self.cache_ref(v)} = {e[v]};" for v in self.cached]
            for v in self.cached:
                e[v] = self.cache_ref(v)
        for r in reds:
            acc = f"acc{f.names.idx[r.value]}"
            el.append(f"{acc} = {red_comb(r.op, acc, e[r.input])};")
        for r in creds:
            ca = f"ca{f.names.idx[r.value]}[i * {V} + k]"
            el.append(f"{ca} = {red_comb(r.op, ca, e[r.input])};")
        el += [f"res_{f.n(v)}[k] = {e[v]};" for v in outs]
        inner.append(f"#pragma unroll\nfor (int k = 0; k < {V}; ++k) {{")
        inner += indent(el)
        inner.append("}")
        for v in outs:
            inner += f.vec_store_lines(v, "rbase + col", V, f"res_{f.n(v)}")
        body += indent(inner)
        body.append("}")
        lines += indent(body)
        lines.append("}")
        if preload and self.pf_leaves:
            # every prefetched value was read into registers above (the loop consumed them), so
            # the buffers are free: start the next row of this group
            lines += self.prefetch(f"row + (long long)gridDim.x * {self.G}")
        if reds:
            self.reduce(reds, lines)

    def prefetch(self, row: str) -> list[str]:
        """cp.async of row ``row``'s full-size inputs into this thread's own shared-memory slots
        (each thread later reads only what it copied, so no barrier is needed)."""
        f, V, C = self.f, self.V, self.a.C
        out = [f"{{\n  const long long nrow = {row};", f"  if (nrow < {self.a.R}LL) {{",
               f"#pragma unroll\n    for (int i = 0; i < {self.NIT}; ++i) {{",
               f"      const int col = (i * {self.TS} + glane) * {V};",
               f"      if (col < {C}) {{"]
        for v in self.pf_leaves:
            nb = V * DTYPE_BYTES[f.dtype(v)]
            out.append(f"        tdb_cp_async<{nb}>(pf_{f.n(v)} + (i * {self.T} + lane) * {V}, "
                       f"{f.param[v]} + nrow * {C}LL + col);")
        out += ["      }", "    }", "  }", "  tdb_cp_commit();", "}"]
        return out

    def reduce(self, reds, lines: list[str]) -> None:
        f, T = self.f, self.T
        slots = [self.rowreds.index(r) for r in reds]
        if T <= 32:
            for r in reds:
                acc = f"acc{f.names.idx[r.value]}"
                lines.append(f"{acc} = {RED_WARP[r.op]}<{T}>({acc});")
        else:
            nw = T // 32
            for r, sl in zip(reds, slots):
                acc = f"acc{f.names.idx[r.value]}"
                lines.append(f"{acc} = {RED_WARP[r.op]}<32>({acc});")
                lines.append(f"if ((tid & 31) == 0) red[{sl * 32} + (tid >> 5)] = {acc};")
            lines.append("__syncthreads();")
            for r, sl in zip(reds, slots):
                acc = f"acc{f.names.idx[r.value]}"
                lines.append(f"{acc} = (tid & 31) < {nw} ? red[{sl * 32} + (tid & 31)] : {RED_INIT[r.op]};")
                # every lane needs the result: reduce across the whole warp (lanes >= nw hold
                # the identity), not only the nw lanes that hold partials
                lines.append(f"{acc} = {RED_WARP[r.op]}<32>({acc});")
            if self.S > 1:
                # block partials -> cluster: each block publishes its value in its own shared
                # memory, a cluster barrier, then every thread combines all S in rank order
                # (the same order in every block, so all blocks agree bit for bit)
                nred = len(self.rowreds)
                for r, sl in zip(reds, slots):
                    lines.append(f"if (tid == 0) red[{32 * nred + sl}] = acc{f.names.idx[r.value]};")
                lines.append("tdb_csync();")
                for r, sl in zip(reds, slots):
                    acc = f"acc{f.names.idx[r.value]}"
                    lines.append(f"{acc} = tdb_dsmem_ld(red + {32 * nred + sl}, 0);")
                    peer = red_comb(r.op, acc, f"tdb_dsmem_ld(red + {32 * nred + sl}, q)")
                    lines.append(f"#pragma unroll\nfor (unsigned q = 1; q < {self.S}; ++q) {acc} = {peer};")
        for r in reds:
            acc = f"acc{f.names.idx[r.value]}"
            val = f"{acc} * {flit(1.0 / self.a.C)}" if r.op == "reduce_mean" else acc
            name = f.n(r.value, "r")
            lines.append(f"const float {name} = {val};")
            self.renv[r.value] = name

    def kernel(self) -> tuple[KText, int]:
        f, a, s = self.f, self.a, self.s
        T, B, G, V, NIT = self.T, self.B, self.G, self.V, self.NIT
        at, smem = row_smem_layout(a, s)
        bps = max(1, min(2048 // B, SMEM_PER_SM // max(1, smem + 1024)))
        full = s.grid == "full"  # a block (cluster) per row group, no grid-stride trips
        if self.S > 1:
            P = self.S * max(1, a.R if full else min(a.R, f.sm * bps // self.S))
        else:
            P = max(1, math.ceil(a.R / G) if full else min(math.ceil(a.R / G), f.sm * bps))
        lines = ["extern __shared__ __align__(16) unsigned char tdb_smem[];",
                 "const int tid = threadIdx.x;",
                 f"const int lane = tid % {T};" if G > 1 else "const int lane = tid;",
                 f"const int grp = tid / {T};" if G > 1 else "const int grp = 0;"]
        self.senv = f.prologue(lines)
        if "red" in at:
            lines.append("float* red = reinterpret_cast<float*>(tdb_smem);")
        if self.mode == "smem":
            per = len(self.cached) * NIT * V * T
            lines.append(f"float* rcs = reinterpret_cast<float*>(tdb_smem + {at['rcs']}) + grp * {per};")
        if self.colreds:
            lines.append(f"float* cpart = reinterpret_cast<float*>(tdb_smem + {at['cpart']});")
        for r in self.colreds:
            ca = f"ca{f.names.idx[r.value]}"
            lines.append(f"float {ca}[{NIT * V}];")
            lines.append(f"#pragma unroll\nfor (int j = 0; j < {NIT * V}; ++j) {ca}[j] = {RED_INIT[r.op]};")
        if self.S > 1:
            lines.append(f"const int glane = (int)tdb_crank() * {T} + lane;")
            lines.append(f"for (long long rb = (long long)(blockIdx.x / {self.S}); rb < R; "
                         f"rb += (long long)(gridDim.x / {self.S})) {{")
        else:
            lines.append("const int glane = lane;")
            lines.append(f"for (long long rb = (long long)blockIdx.x * {G}; rb < R; "
                         f"rb += (long long)gridDim.x * {G}) {{")
        lines.append("(void)lane; (void)grp; (void)glane;")
        it = ["const long long row = rb + grp;",
              f"const bool rv = row < {a.R}LL;",
              f"const long long rbase = row * {a.C}LL;",
              "(void)rv;"]
        self.renv = {}
        self.row_scope(0, it)
        if self.regs:
            it += [f"float rc{k}[{NIT * V}];" for k in range(len(self.cached))]
        last = self.nlev if (self.post_outs or self.colreds) else self.nlev - 1
        for p in range(last + 1):
            self.emit_pass(p, it)
            if p < self.nlev:
                self.row_scope(p + 1, it)
        for v in f.outputs_of(ROW):
            it.append("if (rv && lane == 0) { " + " ".join(f.store_lines(v, "row", self.renv[v])) + " }")
        if self.S > 1:
            it.append("tdb_csync();  // peers may still read this row's partials")
        elif T > 32:
            it.append("__syncthreads();")
        lines += indent(it)
        lines.append("}")
        if self.pf_leaves:  # known once pass 0 is emitted
            pre = []
            for v in self.pf_leaves:
                base = f"tdb_smem + {at['pf:' + v]}"
                pre.append(f"{f.st(v)}* pf_{f.n(v)} = reinterpret_cast<{f.st(v)}*>({base}) + "
                           f"grp * {NIT * V * T};")
            pre += self.prefetch(f"(long long)blockIdx.x * {G} + grp")
            loop = max(i for i, ln in enumerate(lines) if ln.startswith("for (long long rb"))
            lines[loop:loop] = pre
        if self.colreds:
            lines += self.col_partials(P)
        scratch = ("colpart",) if self.colreds else ()
        attr = f"__cluster_dims__({self.S}, 1, 1)" if self.S > 1 else ""
        body = f.signature("@K@", list(scratch), B, attr) + " {\n" + "\n".join(indent(lines)) + "\n}\n"
        if self.pf_leaves:
            body = CP_ASYNC + body
        return KText(body, (P, 1, 1), (B, 1, 1), smem, scratch), P

    def col_partials(self, P: int) -> list[str]:
        """Per-block column partials -> colpart[(k * P + block) * C + col]."""
        f, T, V, G, C = self.f, self.T, self.V, self.G, self.a.C
        out: list[str] = []
        for kk, r in enumerate(self.colreds):
            ca = f"ca{f.names.idx[r.value]}"
            dst = f"colpart[({kk}LL * {P} + blockIdx.x) * {C}LL + col + k]"
            if G == 1:
                out.append(f"#pragma unroll\nfor (int i = 0; i < {self.NIT}; ++i) {{")
                out.append(f"  const int col = (i * {T} + lane) * {V};")
                out.append(f"  if (col < {C}) {{\n#pragma unroll\n    for (int k = 0; k < {V}; ++k) "
                           f"{dst} = {ca}[i * {V} + k];\n  }}\n}}")
                continue
            out.append(f"for (int g = 0; g < {G}; ++g) {{")
            out.append("  if (grp == g) {")
            out.append(f"#pragma unroll\n    for (int i = 0; i < {self.NIT}; ++i) {{")
            out.append(f"      const int col = (i * {T} + lane) * {V};")
            cp = f"cpart[{kk * C} + col + k]"
            out.append(f"      if (col < {C}) {{\n#pragma unroll\n        for (int k = 0; k < {V}; ++k) "
                       f"{cp} = g == 0 ? {ca}[i * {V} + k] : {red_comb(r.op, cp, f'{ca}[i * {V} + k]')};")
            out.append("      }\n    }\n  }\n  __syncthreads();\n}")
            out.append(f"for (int c = tid; c < {C}; c += {self.B}) "
                       f"colpart[({kk}LL * {P} + blockIdx.x) * {C}LL + c] = cpart[{kk * C} + c];")
        return out


def gen_rows(f: Frame) -> tuple[list[KText], list[tuple[str, int]]]:
    r = _Row(f)
    k1, P = r.kernel()
    if not r.colreds:
        return [k1], []
    k2 = gen_col_finish(f, r.colreds, P)
    return [k1, k2], [("colpart", 4 * len(r.colreds) * P * f.a.C)]
