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
written along C, coalesced. The graph: full-size values in two layouts, [N, H, W, C] and
[N, C, H, W], with transposes between them (ConvNeXt's residual: the block's NHWC output back to
NCHW, the layer scale and the residual added there, then to NHWC for the next LayerNorm, whose
result goes back to NCHW); nchw inputs come through tiles as above, nhwc inputs are read along C,
nchw outputs are kept in tiles and written along the positions. Nodes are elementwise or reduce
the last axis of an nhwc value (keepdims), at least one reduction, operands per channel (``[C]``
with nhwc values, ``[C, 1, 1]`` with nchw ones) or scalars.
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

PERM = (0, 2, 3, 1)  # NCHW -> NHWC
INV = (0, 3, 1, 2)  # NHWC -> NCHW
REDUCTIONS = {"reduce_sum": "tdb_wsum", "reduce_mean": "tdb_wsum", "reduce_max": "tdb_wmax"}
COMB = {"reduce_sum": "{a} + {b}", "reduce_mean": "{a} + {b}", "reduce_max": "fmaxf({a}, {b})"}
SMEM_LIMIT = 48 * 1024  # the tile in the default dynamic shared memory of a block


@dataclass(frozen=True)
class TRowsMatch:
    transpose: Node  # the first transpose between the two layouts
    nodes: tuple[Node, ...]  # the rest, in graph order (other transposes among them)
    shape: tuple[int, int, int, int]  # N, C, H, W
    layouts: dict[str, str]  # full-size value -> "nhwc" or "nchw"


def _reduces_rows(g: Graph, n: Node) -> bool:
    if n.op not in REDUCTIONS:
        return False
    a = canonical_attrs(n, [g.type_of(v) for v in n.inputs])
    rank = g.type_of(n.inputs[0]).rank
    return tuple(x % rank for x in a["axes"]) == (rank - 1,) and bool(a["keepdims"])


def _perm(g: Graph, n: Node) -> tuple[int, ...]:
    return tuple(canonical_attrs(n, [g.type_of(n.inputs[0])])["perm"])


def match_trows(g: Graph) -> TRowsMatch:
    """``g`` as a transposed-rows kernel; raises ``UnsupportedFusion`` outside the pattern.

    Every full-size value is [N, H, W, C] ("nhwc") or [N, C, H, W] ("nchw"); transposes (0, 2,
    3, 1) and (0, 3, 1, 2) turn one into the other (no copy here: an element is an element),
    reductions are over C of nhwc values, per-channel operands broadcast along C of the layout
    they meet ([C] with nhwc, [C, 1, 1] with nchw)."""
    ts = [n for n in g.nodes if n.op == "transpose"]
    if not ts:
        raise UnsupportedFusion("a transposed-rows kernel needs a transpose")
    t = ts[0]
    xt = g.type_of(t.inputs[0])
    if xt.rank != 4 or xt.dtype not in FLOATS or _perm(g, t) not in (PERM, INV):
        raise UnsupportedFusion("only the NCHW <-> NHWC transposes (0, 2, 3, 1) and (0, 3, 1, 2)")
    N, a, b, c = xt.shape
    N, C, H, W = (N, a, b, c) if _perm(g, t) == PERM else (N, c, a, b)
    shapes = {(N, H, W, C): "nhwc", (N, C, H, W): "nchw"}
    if len(shapes) != 2:
        raise UnsupportedFusion(f"[{N}, {C}, {H}, {W}]: the two layouts have one shape")
    row = (N, H, W, 1)
    rest = tuple(n for n in g.nodes if n is not t)
    if not any(_reduces_rows(g, n) for n in rest):
        raise UnsupportedFusion("no reduction over the transposed rows")
    layouts: dict[str, str] = {}
    for v in g.inputs:
        lay = shapes.get(tuple(g.type_of(v).shape))
        if lay is not None and g.type_of(v).dtype in FLOATS:
            layouts[v] = lay
        elif _leaf_class(g, v, C) is None:
            raise UnsupportedFusion(f"input {v!r} is neither full-size, per channel nor a scalar")
    for n in g.nodes:
        out, ot = n.outputs[0], g.type_of(n.outputs[0])
        if ot.dtype not in FLOATS:
            raise UnsupportedFusion(f"{out!r} is not floating-point")
        if n.op == "transpose":
            src = layouts.get(n.inputs[0])
            want = {"nchw": PERM, "nhwc": INV}.get(src or "")
            if want is None or _perm(g, n) != want:
                raise UnsupportedFusion(f"transpose {out!r} is not between the two layouts")
            layouts[out] = "nhwc" if src == "nchw" else "nchw"
            continue
        if not (is_elementwise(n.op) or _reduces_rows(g, n)):
            raise UnsupportedFusion(f"{n.op} {out!r} is neither elementwise nor a row reduction")
        full = {layouts[v] for v in n.inputs if v in layouts}
        if len(full) > 1:
            raise UnsupportedFusion(f"{out!r} mixes the two layouts")
        lay = full.pop() if full else None
        shape = tuple(ot.shape)
        if _reduces_rows(g, n):
            if lay != "nhwc":
                raise UnsupportedFusion(f"{out!r} reduces no nhwc value")
            continue
        if lay is not None:
            if shapes.get(shape) != lay:
                raise UnsupportedFusion(f"{out!r} is not shaped like its full-size operand")
            layouts[out] = lay
            for v in n.inputs:  # per-channel operands must broadcast along C of that layout
                if v not in layouts and _leaf_class(g, v, C) == "col" and _col_layout(g, v, C) != lay:
                    raise UnsupportedFusion(f"{v!r} does not broadcast along C of an {lay} value")
        elif shapes.get(shape) == "nhwc":  # a row value times a per-channel one
            layouts[out] = "nhwc"
            for v in n.inputs:
                if v not in layouts and _leaf_class(g, v, C) == "col" and _col_layout(g, v, C) != "nhwc":
                    raise UnsupportedFusion(f"{v!r} does not broadcast along C of an nhwc value")
        elif shape != row and _leaf_class(g, out, C) is None:
            raise UnsupportedFusion(f"{out!r} is no full, row, per-channel or scalar value")
    rows = {n.outputs[0] for n in g.nodes if tuple(g.type_of(n.outputs[0]).shape) == row}
    for n in g.nodes:
        if any(v in rows for v in n.inputs) and layouts.get(n.outputs[0], "nhwc") != "nhwc":
            raise UnsupportedFusion(f"{n.outputs[0]!r} broadcasts a row value over nchw")
    for v in g.outputs:
        if v not in layouts or v in g.inputs:
            raise UnsupportedFusion(f"output {v!r} is not a full [N, H, W, C] or [N, C, H, W] value")
    return TRowsMatch(t, rest, (N, C, H, W), layouts)


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
    if t.numel == C and _col_layout(g, v, C) is not None:
        return "col"
    return None


def _col_layout(g: Graph, v: str, C: int) -> str | None:
    """The layout a per-channel operand broadcasts along C of: [.., C] nhwc, [.., C, 1, 1] nchw."""
    shape = tuple(g.type_of(v).shape)
    if shape[-1:] == (C,):
        return "nhwc"
    if shape[-3:] == (C, 1, 1):
        return "nchw"
    return None


def _at(offset: int) -> str:
    return f"{offset} + " if offset else ""


def tile_rows(C: int, tiles: int = 1) -> int:
    """Positions a block stages: 32 (128-byte loads) where ``tiles`` tiles fit, else 16 or 8."""
    for tile in (32, 16, 8):
        if tiles * C * (tile + 1) * 4 <= SMEM_LIMIT:
            return tile
    raise UnsupportedFusion(f"{C} channels: no {tiles} tile(s) of 8 rows fit in shared memory")


def trows_kernel(g: Graph, sm_count: int = 132, block: int = 256) -> WindowKernel:
    """One kernel computing every output of ``g`` (see the module); raises ``UnsupportedFusion``.
    A block stages a tile of T positions of each nchw input (loaded along the positions), runs a
    warp a position (nhwc inputs read along C), keeps nchw outputs in tiles of their own and
    writes those along the positions after the tile's positions are done."""
    m = match_trows(g)
    N, C, H, W = m.shape
    if block % 32:
        raise ValueError(f"block {block}: a transposed-rows kernel needs whole warps")
    nchw_in = [v for v in g.inputs if m.layouts.get(v) == "nchw"]
    nchw_out = [v for v in dict.fromkeys(g.outputs) if m.layouts[v] == "nchw"]
    tiles = {v: i for i, v in enumerate(nchw_in + nchw_out)}
    HW, T, npl = H * W, tile_rows(C, max(1, len(tiles))), -(-C // 32)
    TS = C * (T + 1)  # floats a tile
    nt = -(-HW // T)
    view = GraphView(g)
    ids = {v: i for i, v in enumerate(sorted(g.type_map))}
    params = {v: f"p{ids[v]}" for v in list(g.inputs) + list(g.outputs)}
    consts: list[str] = []
    each = f"for (int j = 0; j < {npl}; ++j) {{ const int c = lane + 32 * j; (void)c;"
    body = ["const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;",
            f"for (int b = blockIdx.x; b < {N * nt}; b += gridDim.x) {{",
            f"  const int n = b / {nt}, hw0 = (b % {nt}) * {T};",
            "  __syncthreads();  // the last tiles are read and written out"]
    for v in nchw_in:  # 8 loads a thread in flight (indices clamped, no branch around a load)
        xload = load_conv(g.type_of(v).dtype, f"{params[v]}[((long long)n * {C} + c) * {HW} + hw]")
        body += [f"  for (int k0 = threadIdx.x; k0 < {C * T}; k0 += {8 * block}) {{",
                 "    float ld[8];", "    #pragma unroll",
                 "    for (int u = 0; u < 8; ++u) {",
                 f"      const int k = min(k0 + u * {block}, {C * T - 1}), c = k / {T};",
                 f"      const int hw = min(hw0 + k % {T}, {HW - 1});",
                 f"      ld[u] = {xload};", "    }", "    #pragma unroll",
                 "    for (int u = 0; u < 8; ++u) {",
                 f"      const int k = k0 + u * {block}, l = k % {T};",
                 f"      if (k < {C * T}) tiles[{_at(tiles[v] * TS)}k / {T} * {T + 1} + l] = "
                 f"hw0 + l < {HW} ? ld[u] : 0.0f;",
                 "    }", "  }"]
    body += ["  __syncthreads();",
             f"  for (int l = warp; l < {T} && hw0 + l < {HW}; l += {block // 32}) {{",
             f"    const long long r = (long long)n * {HW} + hw0 + l;"]
    env: dict[str, tuple[str, str]] = {}
    lines: list[str] = []

    def leaf(v: str) -> tuple[str, str]:
        lay = m.layouts.get(v)
        if lay is not None:  # a full-size graph input: from its tile, or along C
            k = ids[v]
            src = (f"tiles[{_at(tiles[v] * TS)}c * {T + 1} + l]" if lay == "nchw" else
                   load_conv(g.type_of(v).dtype, f"{params[v]}[r * {C} + c]"))
            lines.extend([f"float f{k}[{npl}];", "#pragma unroll",
                          f"{each} f{k}[j] = c < {C} ? {src} : 0.0f; }}"])
            env[v] = ("full", f"f{k}")
            return env[v]
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

    for n in g.nodes:
        args = [env[v] if v in env else leaf(v) for v in n.inputs]
        k = ids[n.outputs[0]]
        if n.op == "transpose":  # an element is an element: the same values, the other layout
            env[n.outputs[0]] = args[0]
            continue
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
    for v in dict.fromkeys(g.outputs):
        kind, name = env[v]
        val = f"{name}[j]" if kind == "full" else name
        if v in tiles:  # the nchw output's tile, written out below (values rounded there)
            lines += ["#pragma unroll", each,
                      f"  if (c < {C}) tiles[{_at(tiles[v] * TS)}c * {T + 1} + l] = {val}; }}"]
        else:
            lines += ["#pragma unroll", each,
                      f"  if (c < {C}) {params[v]}[r * {C} + c] = {store_conv(g.type_of(v).dtype, val)}; }}"]
    body += ["    " + t for t in "\n".join(lines).split("\n")] + ["  }"]
    if nchw_out:
        body.append("  __syncthreads();")
    for v in nchw_out:  # along the positions: a warp writes 32 of one channel
        out = store_conv(g.type_of(v).dtype, f"tiles[{_at(tiles[v] * TS)}c * {T + 1} + l]")
        body += [f"  for (int k = threadIdx.x; k < {C * T}; k += {block}) {{",
                 f"    const int c = k / {T}, l = k % {T};",
                 f"    if (hw0 + l < {HW}) {params[v]}[((long long)n * {C} + c) * {HW} + hw0 + l] = {out};",
                 "  }"]
    body.append("}")
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
    blocks = max(1, min(N * nt, sm_count * 8))
    args_ = tuple(g.inputs) + tuple(g.outputs) + (np.int64(N * HW), np.int64(C))
    return WindowKernel(name, src, (blocks, 1, 1), (block, 1, 1), args_, N * HW, C,
                        max(1, len(tiles)) * TS * 4)
