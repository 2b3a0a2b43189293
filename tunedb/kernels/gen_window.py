"""Windowed memory-bound kernels: a depthwise convolution or a max/average pool with its
elementwise neighbours fused in, as one generated kernel (``generate_window(graph)``).

The graph holds exactly one window node (``conv2d`` with ``groups == C_in == C_out`` and weight
``[C, 1, KH, KW]``, optional bias; or ``max_pool2d`` / ``avg_pool2d``; or a *resample*: one
``gather`` along H or W of the tensor, or one along each, at indices that are an input or a
constant, as a nearest upsample exports) over an NCHW tensor, plus elementwise nodes:

* a *prologue*: nodes upstream of the window's input, applied to every tap as it is loaded (the
  convolution's zero padding is padding of the prologue's result, so out-of-bounds taps are
  skipped, never evaluated);
* an *epilogue*: nodes downstream of the window, per output element (bias, BN affine, ReLU6,
  SiLU / HardSwish, a residual add of a full-shaped graph input).

Operands of either side are full-shaped tensors of that side, per-channel tensors (``[1,C,1,1]``
after right alignment) or scalars. A thread computes a strip of adjacent outputs of a row
(``strip_width``), each input column loaded (the prologue run on it) once for all of them, or a
block holds its input planes in shared memory ("plane"); fp32 accumulation, one rounding per
stored value. ``codegen.generate`` makes it a one-kernel plan (graph inputs, graph outputs, then
R = N*C and C = OH*OW) that the emulator, the executor and CuPy run like any other; of the
schedule only the block size and fast math count (``WINDOW_CONFIG``, the planner's for these
steps).
"""

from __future__ import annotations

import math

import numpy as np

from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import canonical_attrs
from tunedb.kernels.analysis import UnsupportedFusion
from tunedb.kernels.expr import COMPUTE, FLOATS, STORAGE, flit, literal, load_conv, op_expr, store_conv
from tunedb.kernels.gen_resample import is_resample, resample_body
from tunedb.kernels.gen_window_match import (  # the match's names stay importable from here
    WINDOW_OPS,
    GraphView,
    WindowKernel,
    WindowMatch,
    match_window,
)
from tunedb.kernels.gen_window_match import (
    is_window_node as is_window_node,
)
from tunedb.kernels.gen_window_match import (
    plane_mean as plane_mean,
)
from tunedb.kernels.prelude import PRELUDE
from tunedb.records import sha256_hex

# Fast math (``__expf``, ``__fdividef``): EfficientNet's SiLU before and after the conv is two
# sigmoids an element, tens of instructions each in IEEE form, where the bytes take a few; within
# the intrinsics' documented error the plan's tolerance holds (tests/test_gen_fast_math.py).
WINDOW_CONFIG = {"mapping": "elementwise", "block": 256, "fast_math": True}
MAX_CONST_ELEMS = 4096
STRIP = 2  # outputs per thread along a row of a strip kernel (``strip_width``)
PLANE_STRIP = 4  # the same for stride-1 plane kernels
PLANE_MIN_KW = 7  # stride-1 windows this wide default to the plane (ConvNeXt's 7x7: 1.15x)
# Input planes in shared memory: 112x112 fp32 (49 KB) lost to separate kernels, 56x56 won.
PLANE_MAX_BYTES = 16 * 1024
LOAD_BATCH = 8  # a plane kernel's loads a thread in flight while it fills the tiles


def _aligned(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape) if len(shape) <= 4 else tuple(shape)


class _Gen:
    def __init__(self, g: Graph, m: WindowMatch, fast: bool = False) -> None:
        self.g, self.m, self.fast = g, m, fast
        self.view = GraphView(g)
        self.ids = {v: i for i, v in enumerate(sorted(g.type_map))}
        self.params = {v: f"p{self.ids[v]}" for v in list(g.inputs) + list(g.outputs)}
        self.consts: list[str] = []
        self.const_names: dict[str, str] = {}

    def leaf(self, v: str, full: str, space: tuple[int, ...]) -> str:
        """A leaf operand's value at the current element: ``full`` indexes a full-shaped one."""
        t = self.g.type_of(v)
        c = self.g.constant_map.get(v)
        if t.numel == 1:
            if c is not None:
                return literal(c.array.reshape(-1)[0].item(), t.dtype)
            return load_conv(t.dtype, f"{self.params[v]}[0]")
        sh = _aligned(t.shape)
        if sh == (1, space[1], 1, 1):
            index = "c"
        elif sh == space:
            index = full
        else:
            raise UnsupportedFusion(f"operand {v!r} of shape {t.shape} broadcasts neither per "
                                    f"channel nor fully against {space}")
        return load_conv(t.dtype, f"{self.buffer(v)}[{index}]")

    def buffer(self, v: str) -> str:
        c = self.g.constant_map.get(v)
        if c is None:
            if v not in self.params:
                raise UnsupportedFusion(f"internal: {v!r} is neither an input nor a constant")
            return self.params[v]
        if v not in self.const_names:
            if c.type.numel > MAX_CONST_ELEMS:
                raise UnsupportedFusion(f"constant {v!r} has {c.type.numel} elements > {MAX_CONST_ELEMS}")
            arr = c.array.reshape(-1)
            if c.type.dtype in FLOATS:  # kept as float: the loads below then need no conversion
                items, typ = [flit(float(x)) for x in arr], "float"
            else:
                items, typ = [literal(x.item(), c.type.dtype) for x in arr], STORAGE[c.type.dtype]
            name = f"@P@_c{len(self.const_names)}"
            self.consts.append(f"__device__ __align__(16) const {typ} {name}[{len(items)}] = "
                               f"{{{', '.join(items)}}};")
            self.const_names[v] = name
        return self.const_names[v]

    def cone(self, nodes: tuple[Node, ...], target: str, full: str, space: tuple[int, ...],
             env: dict[str, str], prefix: str, lines: list[str]) -> str:
        """Emit the nodes of ``nodes`` that ``target`` needs; returns its expression."""
        prod = {n.outputs[0]: n for n in nodes}
        need: list[Node] = []

        def walk(v: str) -> None:
            if v in env or any(n.outputs[0] == v for n in need):
                return
            n = prod.get(v)
            if n is None:
                env[v] = self.leaf_expr(v, full, space)
                return
            for i in n.inputs:
                walk(i)
            need.append(n)

        walk(target)
        for n in need:
            args = [env[i] for i in n.inputs]
            name = f"{prefix}{self.ids[n.outputs[0]]}"
            lines.append(f"const {COMPUTE[self.g.type_of(n.outputs[0]).dtype]} {name} = "
                         f"{op_expr(self.view, n, args, self.fast)};")
            env[n.outputs[0]] = name
        return env[target]

    def leaf_expr(self, v: str, full: str, space: tuple[int, ...]) -> str:
        return self.leaf(v, full, space)


def strip_width(out_w: int, stride_w: int = 1, layout: str = "strip", kernel_w: int = 1,
                sfu: bool = False) -> int:
    """Outputs of one row a thread computes, as timed on the H200 (generalization_steps*_h200):
    strips of 2 at stride 1, or with an SFU prologue (EfficientNet's SiLU: 2 share its columns,
    1 ran 22 % slower), else 1 (2.5 % faster on da1f); planes 8 for 7x7 (ConvNeXt: 20.3 against
    24.8 µs for 4), 4 at stride 1, else 1."""
    if layout == "plane":
        return max(1, min(1 if stride_w > 1 else 8 if kernel_w >= PLANE_MIN_KW else PLANE_STRIP, out_w))
    return max(1, min(STRIP if stride_w == 1 or sfu else 1, out_w))


def window_stride(g: Graph, m: WindowMatch) -> int:
    """The window node's stride along a row (a resample's: 1, an output a thread)."""
    w = m.node
    return 1 if w.op == "gather" else int(canonical_attrs(w, [g.type_of(v) for v in w.inputs])["strides"][1])


def _window_body(gen: _Gen, lines: list[str], strip: int, it: str, tile: bool = False,
                 hoisted: bool = False) -> list[str]:
    """Lines accumulating the windows of the ``strip`` outputs at (n, c, oh, ow0 + v) into
    ``acc[v]``; returns the per-output float expressions (``v`` is the loop index). ``tile``:
    the input columns come from the plane in shared memory (prologue applied), not global."""
    g, m = gen.g, gen.m
    w = m.node
    a = canonical_attrs(w, [g.type_of(v) for v in w.inputs])
    _, _, H, W = m.in_shape
    sh, sw = a["strides"]
    pt, pl, pb, pr = a["pads"]
    dh, dw = a.get("dilations", (1, 1))
    if w.op == "conv2d":
        KH, KW = g.type_of(w.inputs[1]).shape[2:]
    else:
        KH, KW = a["kernel"]
    x = w.inputs[0]
    op = w.op
    span = (strip - 1) * sw + (KW - 1) * dw + 1  # input columns the strip's windows cover
    init, pad = ("-TDB_INF", "-TDB_INF") if op == "max_pool2d" else ("0.0f", "0.0f")
    lines.append(f"float acc[{strip}];")
    lines.append(f"#pragma unroll\nfor (int v = 0; v < {strip}; ++v) acc[v] = {init};")
    if op == "avg_pool2d":
        lines.append(f"int cnt[{strip}];")
        lines.append(f"#pragma unroll\nfor (int v = 0; v < {strip}; ++v) cnt[v] = 0;")
    if not tile:
        lines.append(f"const {it} xb = nc * {H * W};")
    lines.append(f"#pragma unroll\nfor (int kh = 0; kh < {KH}; ++kh) {{")
    lines.append(f"  const int ih = oh * {sh} - {pt} + kh * {dh};")
    if op == "avg_pool2d" and a["count_include_pad"]:  # taps inside the padded extent count
        lines.append(f"  if (ih < {H + pb}) {{\n    #pragma unroll\n    for (int v = 0; v < {strip}; ++v) {{")
        lines.append(f"      #pragma unroll\n      for (int kw = 0; kw < {KW}; ++kw) "
                     f"cnt[v] += ((ow0 + v) * {sw} - {pl} + kw * {dw} < {W + pr}) ? 1 : 0;\n    }}\n  }}")
    if tile:  # shared-memory taps: a branch around the row (all rows in flight spill there)
        lines.append(f"  if (ih < 0 || ih >= {H}) continue;\n  const bool rin = true;")
    else:  # global taps: the row's bounds join each column's test, or every row's loads wait
        # for the last row's (a branch there ran 1.2-1.4x slower than bcaadf4's per-tap test)
        lines.append(f"  const bool rin = ih >= 0 && ih < {H};")
    per_tap = strip == 1 and not tile  # bcaadf4's loop: a row array of one output spilled
    if op == "conv2d":
        wload = f"{gen.buffer(w.inputs[1])}[c * {KH * KW} + kh * {KW} + kw]"
        wv = f"wr[kh * {KW} + kw]" if hoisted else load_conv(g.type_of(w.inputs[1]).dtype, wload)
        add = [f"acc[v] += tap * {wv};"]
    elif op == "max_pool2d":
        add = ["acc[v] = fmaxf(acc[v], tap);"]
    elif a["count_include_pad"]:
        add = ["acc[v] += tap;"]
    elif per_tap:  # the average over the taps inside the input only (the others skipped)
        add = ["acc[v] += tap;", "++cnt[v];"]
    else:
        add = [f"const int iw = (ow0 + v) * {sw} - {pl} + kw * {dw};",
               f"if (rin && iw >= 0 && iw < {W}) {{ acc[v] += tap; ++cnt[v]; }}"]
    if per_tap:
        lines.append(f"  #pragma unroll\n  for (int kw = 0; kw < {KW}; ++kw) {{")
        lines.append(f"    const int iw = ow0 * {sw} - {pl} + kw * {dw};")
        lines.append(f"    if (!rin || iw < 0 || iw >= {W}) continue;")
        tap = [f"const {it} xi = xb + ({it})ih * {W} + iw;"]
        xv = gen.cone(m.prologue, x, "xi", m.in_shape, {}, "q", tap)
        tap.append(f"const float tap = {xv if g.type_of(x).dtype in FLOATS else f'(float)({xv})'};")
        tap += ["const int v = 0;"] + add
        lines += ["    " + t for t in tap]
        lines.append("  }\n}")
    else:
        lines.append(f"  float row[{span}];")
        lines.append(f"  #pragma unroll\n  for (int j = 0; j < {span}; ++j) {{")
        lines.append(f"    const int iw = ow0 * {sw} - {pl} + j;")
        lines.append(f"    if (!rin || iw < 0 || iw >= {W}) {{ row[j] = {pad}; continue; }}")
        if tile:
            tap = [f"row[j] = tile[ih * {W} + iw];"]
        else:
            tap = [f"const {it} xi = xb + ({it})ih * {W} + iw;"]
            xv = gen.cone(m.prologue, x, "xi", m.in_shape, {}, "q", tap)
            tap.append(f"row[j] = {xv if g.type_of(x).dtype in FLOATS else f'(float)({xv})'};")
        lines += ["    " + t for t in tap]
        lines.append("  }")
        lines.append(f"  #pragma unroll\n  for (int v = 0; v < {strip}; ++v) {{")
        lines.append(f"    #pragma unroll\n    for (int kw = 0; kw < {KW}; ++kw) {{")
        lines.append(f"      const float tap = row[v * {sw} + kw * {dw}];")
        lines += ["      " + t for t in add]
        lines.append("    }\n  }\n}")
    result = "acc[v]"
    if op == "avg_pool2d":
        result = "acc[v] / (float)cnt[v]"
    if op == "conv2d" and len(w.inputs) == 3:
        b = w.inputs[2]
        result = f"acc[v] + {load_conv(g.type_of(b).dtype, f'{gen.buffer(b)}[c]')}"
    return [result]


def _outputs(gen: _Gen, strip: int, it: str, acc: str) -> list[str]:
    """Lines storing the strip's outputs (element ``i`` of the output shape, the window value
    ``wout``) and adding each plane mean's term to this thread's ``ps<k>``."""
    m, g = gen.m, gen.g
    _, _, OH, OW = m.out_shape
    lines = [f"#pragma unroll\nfor (int v = 0; v < {strip}; ++v) {{", f"  if (ow0 + v >= {OW}) break;",
             f"  const {it} i = (nc * {OH} + oh) * {OW} + ow0 + v;", f"  const float wout = {acc};"]
    env = {m.out: "wout"}
    epi: list[str] = []
    pooled = {n.outputs[0] for n in m.pooled}
    for v in g.outputs:
        if v not in pooled:
            e = gen.cone(m.epilogue, v, "i", m.out_shape, env, "e", epi)
            epi.append(f"{gen.params[v]}[i] = {store_conv(g.type_of(v).dtype, e)};")
    for k, n in enumerate(m.pooled):
        epi.append(f"ps{k} += {gen.cone(m.epilogue, n.inputs[0], 'i', m.out_shape, env, 'e', epi)};")
    return lines + ["  " + t for t in "\n".join(epi).split("\n")] + ["}"]


def plane_packing(m: WindowMatch, block: int, strip: int) -> tuple[int, int]:
    """``(threads a plane, planes a block)``: a power of two of whole warps covering a plane's
    strips (small planes share a block), at most ``PLANE_MAX_BYTES`` of tiles."""
    strips = m.out_shape[2] * -(-m.out_shape[3] // strip)
    tpp = 32
    while tpp < min(strips, block):
        tpp *= 2
    cap = min(block // min(tpp, block), PLANE_MAX_BYTES // plane_bytes(m), m.out_shape[0] * m.out_shape[1])
    per_block = 1
    while per_block * 2 <= cap and block % (64 * per_block) == 0:  # whole warps a plane
        per_block *= 2
    return block // per_block, per_block


def _plane_body(gen: _Gen, it: str, block: int, strip: int, hoist: bool = False) -> list[str]:
    """A block per ``PB`` consecutive (n, c) planes (``plane_packing``): the input planes are
    loaded once, coalesced and through the prologue, into shared memory; ``TPP`` threads a plane
    then compute strips of ``strip`` outputs from its tile, as the strip kernel does from global
    memory, and sum the plane means (warp sums, a partial a warp after the tiles, one thread a
    plane adds its warps')."""
    g, m = gen.g, gen.m
    N, C, OH, OW = m.out_shape
    _, _, H, W = m.in_shape
    x = m.node.inputs[0]
    sw_ = -(-OW // strip)
    tpp, pb = plane_packing(m, block, strip)
    lines = ["extern __shared__ __align__(16) unsigned char tdb_smem[];",
             "float* tiles = reinterpret_cast<float*>(tdb_smem);",
             f"const int p = threadIdx.x / {tpp}, lt = threadIdx.x % {tpp};",
             f"for ({it} nb = blockIdx.x; nb < {-(-N * C // pb)}; nb += gridDim.x) {{",
             # the block's planes (fewer at the end): LOAD_BATCH loads a thread in flight, then
             # the stores, or a 50 KB plane would be read one latency per element a thread
             f"  const int n_in = (int)({N * C * H * W}LL - (long long)nb * {pb * H * W} < {pb * H * W} "
             f"? {N * C * H * W}LL - (long long)nb * {pb * H * W} : {pb * H * W});",
             f"  for (int j0 = threadIdx.x; j0 < n_in; j0 += {LOAD_BATCH * block}) {{",
             f"    float ld[{LOAD_BATCH}];",
             "    #pragma unroll",
             f"    for (int u = 0; u < {LOAD_BATCH}; ++u) {{",
             # clamped to the last element, not branched around: the batch's loads issue together
             f"      const {it} xi = nb * {pb * H * W} + min(j0 + u * {block}, n_in - 1);",
             f"      const int c = (int)(xi / {H * W} % {C});"]
    tap: list[str] = []
    xv = gen.cone(m.prologue, x, "xi", m.in_shape, {}, "q", tap)
    tap.append(f"ld[u] = {xv if g.type_of(x).dtype in FLOATS else f'(float)({xv})'};")
    lines += ["      " + t for t in tap]
    lines += ["    }", "    #pragma unroll", f"    for (int u = 0; u < {LOAD_BATCH}; ++u)",
              f"      if (j0 + u * {block} < n_in) tiles[j0 + u * {block}] = ld[u];"]
    lines += ["  }", "  __syncthreads();"] + [f"  float ps{k} = 0.0f;" for k in range(len(m.pooled))]
    lines += [f"  const {it} nc = nb * {pb} + p;", f"  const int c = (int)(nc % {C});"]
    hoist = hoist and m.node.op == "conv2d"
    if hoist:  # the plane's weights in registers once, not re-read for every strip
        wt = g.type_of(m.node.inputs[1])
        kk = wt.shape[2] * wt.shape[3]
        wl = load_conv(wt.dtype, f"{gen.buffer(m.node.inputs[1])}[c * {kk} + k]")
        lines += [f"  float wr[{kk}];", "  #pragma unroll", f"  for (int k = 0; k < {kk}; ++k) wr[k] = {wl};"]
    lines += [f"  const float* tile = tiles + p * {H * W};",
              f"  for (int s = lt; s < {OH * sw_} && nc < {N * C}; s += {tpp}) {{",
              f"    const int ow0 = (s % {sw_}) * {strip};", f"    const int oh = s / {sw_};"]
    el: list[str] = []
    (acc,) = _window_body(gen, el, strip, it, tile=True, hoisted=hoist)
    el += _outputs(gen, strip, it, acc)
    lines += ["    " + t for t in "\n".join(el).split("\n")]
    lines.append("  }")
    if m.pooled:
        P, wpp = len(m.pooled), tpp // 32
        lines.append(f"  float* red = tiles + {pb * H * W};")
        for k in range(P):
            lines += [f"  ps{k} = tdb_wsum<32>(ps{k});",
                      f"  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32 * {P} + {k}] = ps{k};"]
        lines += ["  __syncthreads();", f"  if (lt == 0 && nc < {N * C}) {{"]
        for k, n in enumerate(m.pooled):
            lines += [f"    float t{k} = 0.0f;",
                      f"    for (int q = p * {wpp}; q < (p + 1) * {wpp}; ++q) t{k} += red[q * {P} + {k}];",
                      f"    {gen.params[n.outputs[0]]}[nc] = "
                      f"{store_conv(g.type_of(n.outputs[0]).dtype, f't{k} / {float(OH * OW)!r}f')};"]
        lines.append("  }")
    lines += ["  __syncthreads();  // the next planes overwrite the tiles", "}"]
    return lines


# SFU-bound prologue ops, run once a tap: a SiLU before a 3x3 stride-1 conv is ~18 SFU ops an
# element, ~2.5x the H200's SFU rate at the bandwidth floor (``costly_prologue``).
MAX_TAPS_AN_ELEMENT = 3
TAP_COSTLY_OPS = frozenset(("exp", "log", "sigmoid", "tanh", "erf", "gelu", "sin", "cos", "pow",
                            "sqrt", "rsqrt", "reciprocal"))


def default_layout(m: WindowMatch, stride_w: int = 1, kernel_w: int = 1) -> str:
    """The layout ``window_kernel`` gives ``m`` unless told: a plane mean needs the plane; a
    stride-1 window ``PLANE_MIN_KW`` wide takes it when the plane fits (ConvNeXt's 7x7 re-reads
    its rows from L1 7 times in a strip kernel: 24.9 µs as a plane, 28.6-29.5 as strips)."""
    if m.pooled:
        return "plane"
    fits = m.in_shape[2] * m.in_shape[3] * 4 <= PLANE_MAX_BYTES
    return "plane" if stride_w == 1 and kernel_w >= PLANE_MIN_KW and fits else "strip"


def window_width(g: Graph, m: WindowMatch) -> int:
    """The window node's kernel width (a resample's: 1)."""
    w = m.node
    if w.op == "gather":
        return 1
    return int(g.type_of(w.inputs[1]).shape[3] if w.op == "conv2d" else w.attr("kernel")[1])


def costly_prologue(g: Graph, m: WindowMatch) -> bool:
    """Whether ``m``'s prologue runs an SFU-bound op at over ``MAX_TAPS_AN_ELEMENT`` taps a float32
    input element, half that for 16-bit (a plane: once an element). 3x3 stride 2 (2.25): fused,
    EfficientNet's SiLU saves ~36 µs for ~20 of SFU in fp32; bf16 b8: 18.4 apart, 22.7-26.1 fused."""
    w = m.node
    if w.op == "gather" or default_layout(m, window_stride(g, m), window_width(g, m)) == "plane":
        return False
    a, x = canonical_attrs(w, [g.type_of(v) for v in w.inputs]), g.type_of(w.inputs[0])
    taps = math.prod(g.type_of(w.inputs[1]).shape[2:]) if w.op == "conv2d" else math.prod(a["kernel"])
    limit = MAX_TAPS_AN_ELEMENT * min(4, x.nbytes // max(1, x.numel)) / 4
    return any(n.op in TAP_COSTLY_OPS for n in m.prologue) and taps / math.prod(a["strides"]) > limit


def has_window_op(g: Graph) -> bool:
    """Whether ``g`` is for this generator rather than the row/column ones."""
    return any(n.op in WINDOW_OPS or is_resample(g, n) for n in g.nodes)


def window_kernel(g: Graph, sm_count: int = 132, block: int = 256,
                  strip: int | None = None, layout: str | None = None, hoist: bool = False,
                  fast: bool = False) -> WindowKernel:
    """One kernel computing every output of ``g`` (a window node with its elementwise
    neighbours); raises ``UnsupportedFusion`` for graphs outside the pattern. ``layout``:
    "strip" (a thread a strip of ``strip`` outputs along a row, from global memory; default
    ``strip_width``'s rule) or "plane" (a block an input plane in shared memory, its threads
    strips of it, and means over the output plane); None: ``default_layout``. ``hoist``: a
    plane kernel's conv weights go to registers once a plane (a variant, not yet timed).
    ``fast``: the elementwise nodes with fast-math intrinsics (``Schedule.fast_math``)."""
    m = match_window(g)
    N, C, OH, OW = m.out_shape
    for v in list(g.inputs) + list(g.outputs):
        if g.type_of(v).dtype not in STORAGE:
            raise UnsupportedFusion(f"value {v!r} has dtype {g.type_of(v).dtype}")
    gen = _Gen(g, m, fast)
    resample = m.node.op == "gather"
    if resample and layout == "plane":
        raise UnsupportedFusion("a resample has no plane layout")
    layout, strip = ("strip", 1) if resample else (layout, strip)  # a thread an output, one tap
    chosen = layout is None
    if layout is None:
        layout = default_layout(m, window_stride(g, m), window_width(g, m))
    if chosen and layout == "plane" and m.in_shape[2] * m.in_shape[3] * 4 <= PLANE_MAX_BYTES:
        # the rules were timed at batch 16: a plane kernel of under a wave of blocks (batch 1)
        # leaves SMs idle while a strip kernel spreads its outputs over all of them
        rule = strip_width(OW, window_stride(g, m), "plane", window_width(g, m))
        pb = plane_packing(m, block, strip or rule)[1]
        if -(-N * C // pb) < sm_count:
            if m.pooled:
                raise UnsupportedFusion(f"{N * C} planes: under a wave of plane-kernel blocks")
            layout = "strip"
    if strip is None:
        sfu = any(n.op in TAP_COSTLY_OPS for n in m.prologue)
        strip = strip_width(OW, window_stride(g, m), layout, window_width(g, m), sfu)
    elif strip < 1:
        raise ValueError(f"strip {strip}: a thread computes at least one output")
    strip = min(strip, OW)
    if layout == "plane":
        if m.pooled and block % 32:
            raise ValueError(f"block {block}: a plane mean needs whole warps")
        tpp, pb = plane_packing(m, block, strip)
        return _finish(g, gen, _plane_body(gen, _index_type(m), block, strip, hoist), block,
                       max(1, min(-(-N * C // pb), sm_count * 8)),
                       pb * plane_bytes(m) + 4 * len(m.pooled) * (block // 32))
    if layout != "strip":
        raise ValueError(f"window layout {layout!r}: expected strip or plane")
    if m.pooled:
        raise UnsupportedFusion("a plane mean needs the plane layout")
    strips = N * C * OH * -(-OW // strip)
    it = _index_type(m)
    body: list[str] = [
        f"const {it} total = {strips};",
        f"for ({it} s = ({it})blockIdx.x * {block} + threadIdx.x; s < total; "
        f"s += ({it})gridDim.x * {block}) {{"]
    el = [f"const int ow0 = (int)(s % {-(-OW // strip)}) * {strip};",
          f"const int oh = (int)((s / {-(-OW // strip)}) % {OH});",
          f"const {it} nc = s / {OH * -(-OW // strip)};", f"const int c = (int)(nc % {C});"]
    if resample:
        el, acc = resample_body(gen, el, it), "acc[v]"
    else:
        (acc,) = _window_body(gen, el, strip, it)
    el += _outputs(gen, strip, it, acc)
    body += ["  " + t for t in "\n".join(el).split("\n")]
    body.append("}")
    return _finish(g, gen, body, block, max(1, min(-(-strips // block), sm_count * 16)), 0)


def _index_type(m: WindowMatch) -> str:
    """32-bit indices when no index (nor a grid-stride step past the last one) can overflow."""
    N, C, OH, OW = m.out_shape
    _, _, H, W = m.in_shape
    return "int" if max(N * C * H * W, N * C * OH * OW) < 2**31 - 2**24 else "long long"


def plane_bytes(m: WindowMatch) -> int:
    """Shared memory of a "plane" kernel; raises ``UnsupportedFusion`` above ``PLANE_MAX_BYTES``."""
    nbytes = m.in_shape[2] * m.in_shape[3] * 4
    if nbytes > PLANE_MAX_BYTES:
        raise UnsupportedFusion(f"input plane of {nbytes} bytes > {PLANE_MAX_BYTES} for shared memory")
    return nbytes


def _finish(g: Graph, gen: _Gen, body: list[str], block: int, blocks: int, shared: int) -> WindowKernel:
    m = gen.m
    N, C, OH, OW = m.out_shape
    ps = [f"const {STORAGE[g.type_of(v).dtype]}* __restrict__ {gen.params[v]}" for v in g.inputs]
    ps += [f"{STORAGE[g.type_of(v).dtype]}* __restrict__ {gen.params[v]}" for v in g.outputs]
    ps += ["long long R", "long long C"]
    sig = (f'extern "C" __global__ void __launch_bounds__({block}) @K@(\n    ' + ",\n    ".join(ps) + ")")
    text = ("\n".join([PRELUDE] + gen.consts) + "\n" + sig + " {\n"
            + "\n".join("  " + b for b in body) + "\n}\n")
    prefix = "tdb_w" + sha256_hex(text)[:16]
    name = f"{prefix}_k0"
    src = text.replace("@K@", name).replace("@P@", prefix)
    args = tuple(g.inputs) + tuple(g.outputs) + (np.int64(N * C), np.int64(OH * OW))
    return WindowKernel(name, src, (blocks, 1, 1), (block, 1, 1), args, N * C, OH * OW, shared)
