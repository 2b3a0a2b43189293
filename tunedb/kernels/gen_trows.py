"""Rows of a transposed input (``trows``): ConvNeXt's channels-last LayerNorm of an NCHW
tensor, ``transpose(x, (0, 2, 3, 1))`` then a normalization over the new last axis, as one kernel
instead of a transpose copy and a row kernel (issue 21, cause G: 16 windowed ConvNeXt workloads
of the suite had the copy between their depthwise conv and the norm).

The row generators refuse a reduction of a transposed input: read row by row, the C values of a
row are H*W apart. Here a block stages a tile of ``TILE`` consecutive positions (h, w) of one
image in shared memory, loaded along the positions (coalesced, ``[C][TILE + 1]`` so both the
fill and the reads are free of bank conflicts); then a warp a row: lane ``lane`` holds channels
``lane + 32 j``, the graph's nodes run in order (row reductions as warp sums, per-row values as
scalars, per-channel operands loaded at the lane's channels) and the full-size outputs are
written along C, coalesced. The graph: one such transpose of a floating graph input, nodes that
are elementwise or reduce the last axis (keepdims), at least one reduction, operands per channel
(``[C]``) or scalars, outputs full-size ``[N, H, W, C]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import canonical_attrs, is_elementwise
from tunedb.kernels.analysis import UnsupportedFusion
from tunedb.kernels.expr import FLOATS, RED_INIT, STORAGE, flit, literal, load_conv, op_expr, store_conv
from tunedb.kernels.gen_window import GraphView, WindowKernel
from tunedb.kernels.prelude import PRELUDE
from tunedb.records import sha256_hex

PERM = (0, 2, 3, 1)
REDUCTIONS = {"reduce_sum": "tdb_wsum", "reduce_mean": "tdb_wsum", "reduce_max": "tdb_wmax"}
COMB = {"reduce_sum": "{a} + {b}", "reduce_mean": "{a} + {b}", "reduce_max": "fmaxf({a}, {b})"}
SMEM_LIMIT = 48 * 1024  # the tile in the default dynamic shared memory of a block


@dataclass(frozen=True)
class TRowsMatch:
    transpose: Node
    nodes: tuple[Node, ...]  # the rest, in graph order
    shape: tuple[int, int, int, int]  # the input's N, C, H, W


def _reduces_rows(g: Graph, n: Node) -> bool:
    if n.op not in REDUCTIONS:
        return False
    a = canonical_attrs(n, [g.type_of(v) for v in n.inputs])
    rank = g.type_of(n.inputs[0]).rank
    return tuple(x % rank for x in a["axes"]) == (rank - 1,) and bool(a["keepdims"])


def match_trows(g: Graph) -> TRowsMatch:
    """``g`` as a transposed-rows kernel; raises ``UnsupportedFusion`` outside the pattern."""
    ts = [n for n in g.nodes if n.op == "transpose"]
    if len(ts) != 1:
        raise UnsupportedFusion("a transposed-rows kernel needs exactly one transpose")
    t = ts[0]
    x = t.inputs[0]
    xt = g.type_of(x)
    if x not in g.inputs or xt.rank != 4 or xt.dtype not in FLOATS:
        raise UnsupportedFusion("the transpose must read a 4-D floating graph input")
    if tuple(canonical_attrs(t, [xt])["perm"]) != PERM:
        raise UnsupportedFusion("only the NCHW -> NHWC transpose (0, 2, 3, 1)")
    N, C, H, W = xt.shape
    full, row = (N, H, W, C), (N, H, W, 1)
    rest = tuple(n for n in g.nodes if n is not t)
    if not any(_reduces_rows(g, n) for n in rest):
        raise UnsupportedFusion("no reduction over the transposed rows")
    for n in rest:
        if not (is_elementwise(n.op) or _reduces_rows(g, n)):
            raise UnsupportedFusion(f"{n.op} {n.outputs[0]!r} is neither elementwise nor a row reduction")
        if g.type_of(n.outputs[0]).dtype not in FLOATS:
            raise UnsupportedFusion(f"{n.outputs[0]!r} is not floating-point")
        shape = tuple(g.type_of(n.outputs[0]).shape)
        if shape not in (full, row) and _leaf_class(g, n.outputs[0], C) is None:
            raise UnsupportedFusion(f"{n.outputs[0]!r} is no full, row, per-channel or scalar value")
    for v in g.inputs:
        if v != x and _leaf_class(g, v, C) is None:
            raise UnsupportedFusion(f"input {v!r} is neither per channel nor a scalar")
    for v in g.outputs:
        if tuple(g.type_of(v).shape) != full or v == x:
            raise UnsupportedFusion(f"output {v!r} is not a full [N, H, W, C] value")
    return TRowsMatch(t, rest, (N, C, H, W))


def is_trows(g: Graph) -> bool:
    try:
        match_trows(g)
    except UnsupportedFusion:
        return False
    return True


def _leaf_class(g: Graph, v: str, C: int) -> str | None:
    t = g.type_of(v)
    if t.numel == 1:
        return "scalar"
    if t.numel == C and tuple(t.shape)[-1:] == (C,):
        return "col"
    return None


def tile_rows(C: int) -> int:
    """Positions a block stages: 32 (128-byte loads) where the tile fits, else 16 or 8."""
    for tile in (32, 16, 8):
        if C * (tile + 1) * 4 <= SMEM_LIMIT:
            return tile
    raise UnsupportedFusion(f"{C} channels: no tile of 8 rows fits in shared memory")


def trows_kernel(g: Graph, sm_count: int = 132, block: int = 256) -> WindowKernel:
    """One kernel computing every output of ``g`` (see the module); raises ``UnsupportedFusion``."""
    m = match_trows(g)
    N, C, H, W = m.shape
    HW, T, npl = H * W, tile_rows(C), -(-C // 32)
    if block % 32:
        raise ValueError(f"block {block}: a transposed-rows kernel needs whole warps")
    view = GraphView(g)
    ids = {v: i for i, v in enumerate(sorted(g.type_map))}
    params = {v: f"p{ids[v]}" for v in list(g.inputs) + list(g.outputs)}
    consts: list[str] = []
    x = m.transpose.inputs[0]
    xload = load_conv(g.type_of(x).dtype, f"{params[x]}[((long long)n * {C} + c) * {HW} + hw]")
    each = f"for (int j = 0; j < {npl}; ++j) {{ const int c = lane + 32 * j; (void)c;"
    body = [f"const float* tile = tiles;  // [{C}][{T + 1}]",
            "const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;",
            f"for (int b = blockIdx.x; b < {N * -(-HW // T)}; b += gridDim.x) {{",
            f"  const int n = b / {-(-HW // T)}, hw0 = (b % {-(-HW // T)}) * {T};",
            "  __syncthreads();  // the last tile is read",
            # 8 loads a thread in flight (indices clamped, no branch around a load), then stores
            f"  for (int k0 = threadIdx.x; k0 < {C * T}; k0 += {8 * block}) {{",
            "    float ld[8];", "    #pragma unroll",
            "    for (int u = 0; u < 8; ++u) {",
            f"      const int k = min(k0 + u * {block}, {C * T - 1}), c = k / {T};",
            f"      const int hw = min(hw0 + k % {T}, {HW - 1});",
            f"      ld[u] = {xload};", "    }", "    #pragma unroll",
            "    for (int u = 0; u < 8; ++u) {",
            f"      const int k = k0 + u * {block}, l = k % {T};",
            f"      if (k < {C * T}) tiles[k / {T} * {T + 1} + l] = hw0 + l < {HW} ? ld[u] : 0.0f;",
            "    }", "  }", "  __syncthreads();",
            f"  for (int l = warp; l < {T} && hw0 + l < {HW}; l += {block // 32}) {{",
            f"    const long long r = (long long)n * {HW} + hw0 + l;"]
    env: dict[str, tuple[str, str]] = {m.transpose.outputs[0]: ("full", "f_x")}
    lines = [f"float f_x[{npl}];", "#pragma unroll",
             f"for (int j = 0; j < {npl}; ++j) {{ const int c = lane + 32 * j; "
             f"f_x[j] = c < {C} ? tile[c * {T + 1} + l] : 0.0f; }}"]

    def leaf(v: str) -> tuple[str, str]:
        c = g.constant_map.get(v)
        kind = _leaf_class(g, v, C)
        if kind == "scalar":
            if c is not None:
                return "scalar", literal(c.array.reshape(-1)[0].item(), c.type.dtype)
            return "scalar", load_conv(g.type_of(v).dtype, f"{params[v]}[0]")
        if kind != "col":
            raise UnsupportedFusion(f"operand {v!r} is neither per channel nor a scalar")
        if c is None:
            buf = params[v]
        else:
            buf = f"@P@_c{len(consts)}"
            consts.append(f"__device__ __align__(16) const float {buf}[{C}] = "
                          f"{{{', '.join(flit(float(a)) for a in c.array.reshape(-1))}}};")
        dt = "float32" if c is not None else g.type_of(v).dtype
        return "col", load_conv(dt, f"{buf}[c < {C} ? c : 0]")

    for n in m.nodes:
        args = [env[v] if v in env else leaf(v) for v in n.inputs]
        k = ids[n.outputs[0]]
        if _reduces_rows(g, n):
            kind, name = args[0]
            if kind != "full":
                raise UnsupportedFusion(f"{n.outputs[0]!r} reduces a {kind} value")
            init = RED_INIT[n.op]
            comb = COMB[n.op].format(a=f"r{k}", b=f"{name}[j]")
            lines += [f"float r{k} = {init};", "#pragma unroll",
                      f"for (int j = 0; j < {npl}; ++j) if (lane + 32 * j < {C}) r{k} = {comb};",
                      f"r{k} = {REDUCTIONS[n.op]}<32>(r{k});"]
            if n.op == "reduce_mean":
                lines.append(f"r{k} = r{k} * {flit(1.0 / C)};")
            env[n.outputs[0]] = ("row", f"r{k}")
            continue
        kinds = {a[0] for a in args}
        if "full" in kinds or ("col" in kinds and "row" in kinds):
            ex = op_expr(view, n, [f"{a[1]}[j]" if a[0] == "full" else a[1] for a in args])
            lines += [f"float f{k}[{npl}];", "#pragma unroll",
                      f"{each} f{k}[j] = {ex}; }}"]
            env[n.outputs[0]] = ("full", f"f{k}")
        elif "col" in kinds:  # per channel: inlined where a full value reads it
            env[n.outputs[0]] = ("col", f"({op_expr(view, n, [a[1] for a in args])})")
        else:
            lines.append(f"const float r{k} = {op_expr(view, n, [a[1] for a in args])};")
            env[n.outputs[0]] = ("row", f"r{k}")
    for v in g.outputs:
        kind, name = env[v]
        val = f"{name}[j]" if kind == "full" else name
        lines += ["#pragma unroll", each,
                  f"  if (c < {C}) {params[v]}[r * {C} + c] = {store_conv(g.type_of(v).dtype, val)}; }}"]
    body += ["    " + t for t in "\n".join(lines).split("\n")] + ["  }", "}"]
    ps = [f"const {STORAGE[g.type_of(v).dtype]}* __restrict__ {params[v]}" for v in g.inputs]
    ps += [f"{STORAGE[g.type_of(v).dtype]}* __restrict__ {params[v]}" for v in g.outputs]
    ps += ["long long R", "long long C"]
    sig = f'extern "C" __global__ void __launch_bounds__({block}) @K@(\n    ' + ",\n    ".join(ps) + ")"
    head = ["extern __shared__ __align__(16) unsigned char tdb_smem[];",
            "float* tiles = reinterpret_cast<float*>(tdb_smem);"]
    text = ("\n".join([PRELUDE] + consts) + "\n" + sig + " {\n"
            + "\n".join("  " + b for b in head + body) + "\n}\n")
    prefix = "tdb_t" + sha256_hex(text)[:16]
    name = f"{prefix}_k0"
    src = text.replace("@K@", name).replace("@P@", prefix)
    blocks = max(1, min(N * -(-HW // T), sm_count * 8))
    args_ = tuple(g.inputs) + tuple(g.outputs) + (np.int64(N * HW), np.int64(C))
    return WindowKernel(name, src, (blocks, 1, 1), (block, 1, 1), args_, N * HW, C, C * (T + 1) * 4)
