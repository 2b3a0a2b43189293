"""How the executor runs a convolution that is not depthwise: its form, and the im2col GEMMs.

CuPy 14 has no cuDNN, so a convolution is cuBLAS on NCHW data: a 1x1 stride-1 one is ``W @ x[n]``
per sample (one strided-batched GEMM); any other writes its patches with an im2col kernel and
multiplies them the same way. Per sample, the GEMM's rows are the ``P = OH * OW`` output pixels
and its leading dimension is ``P``: at 14x14 in bfloat16 (392 bytes) the rows are not 16-byte
aligned, and at 7x7 they are also too short for a tile, so cuBLAS runs slow kernels there (ResNet-50
bf16 at batch 8 took 3x its batch-1 time). The batch-merged form writes the patches as
``[C*KH*KW, N*P]`` instead and runs ONE GEMM over all ``N * P`` columns (aligned when ``N * P`` is,
and ``N`` times taller), into scratch as ``[O, N, P]``, then copies that into the ``[N, O, P]``
output (one copy kernel; a 1x1 convolution pays an input transpose too, its im2col).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunedb.runtime.conv_cudnn import conv_layout, cudnn_wanted
from tunedb.runtime.copykernel import strided_copy
from tunedb.runtime.executor_kernels import IM2COL_TILED_SOURCE

Launch = Callable[[], None]

# "auto": batch-merged im2col GEMMs where ``merges_batch`` says so; "auto-unaligned": also 1x1
# convolutions whose rows are unaligned but not short (the rule measured first); "auto-im2col":
# 1x1 stride-1 convolutions never merge; "never" / "always" let the per-conv benchmark
# (benchmarks/bench_conv.py) time both forms.
CONV_BATCH_MERGE = "auto"
MERGE_BELOW_PIXELS = 128
MERGE_POINTWISE_MIN_FLOP = 5e8
# "tiled": threads over (ow, oh) from a 3-D grid, no division per element (H200, ResNet-50 bf16
# b8, verified: 1300 -> 1055 µs); "rows": a block per row, one division per element.
IM2COL_KERNEL = "tiled"
_TILED_MODULES: dict[int, Any] = {}


def tiled_function(cp: Any, name: str) -> Any:
    """A kernel of ``IM2COL_TILED_SOURCE`` (its module compiled once per process)."""
    if id(cp) not in _TILED_MODULES:
        _TILED_MODULES[id(cp)] = cp.RawModule(code=IM2COL_TILED_SOURCE, options=("-std=c++17",))
    return _TILED_MODULES[id(cp)].get_function(name)


def tiled_launch(n: int, c: int, oh: int, ow: int, kh: int, kw: int) -> tuple[tuple, tuple]:
    """(grid, block) of a tiled im2col: x = kernel positions, y = channel groups, z = samples."""
    bx = min(ow, 256)
    by = max(1, min(oh, 256 // bx))
    bz = max(1, min(c, 64, 256 // (bx * by)))
    return (kh * kw, -(-c // bz), min(n, 65535)), (bx, by, bz)


def merges_batch(n: int, p: int, itemsize: int, pointwise_flop: float = 0.0) -> bool:
    """Whether a batch of ``n`` GEMMs of ``p`` output pixels each runs as one GEMM over all
    ``n * p`` columns: 16-bit rows of ``p`` elements that a convolution needing its im2col anyway
    has unaligned (not 16 bytes) or short. A 1x1 stride-1 convolution (``pointwise_flop``: its
    GEMM's flops, else 0) pays an input transpose to merge, which only large GEMMs on short rows
    win back (H200, ResNet-50 bf16 b8: 14x14, 10.4 µs per sample against 13.2 merged; 7x7 at
    0.8 GFLOP, 50.0 against 20.6; MobileNetV3's small 1x1 GEMMs lost 8 % merged). float32 GEMMs
    run on the SIMT cores (no TF32 unless asked) and keep the per-sample form unless forced."""
    if n < 2 or CONV_BATCH_MERGE == "never":
        return False
    if CONV_BATCH_MERGE == "always":
        return True
    if itemsize != 2:
        return False
    short, unaligned = p < MERGE_BELOW_PIXELS, (p * itemsize) % 16 != 0
    if pointwise_flop and CONV_BATCH_MERGE == "auto":
        return short and pointwise_flop >= MERGE_POINTWISE_MIN_FLOP
    return short or unaligned


def conv_form(x_shape: Sequence[int], w_shape: Sequence[int], a: dict, itemsize: int = 4) -> str:
    """How ``ComputeOps`` runs a conv2d: ``1x1`` (one GEMM), ``depthwise`` (one kernel, bias
    included), ``im2col`` (an im2col kernel, then one batched GEMM) or ``im2col merged`` (an
    im2col kernel into ``[C*KH*KW, N*P]``, one GEMM, a copy; ``merges_batch``), for stored
    elements of ``itemsize`` bytes."""
    c, (o, _, kh, kw) = x_shape[1], w_shape
    groups = int(a["groups"])
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = a["strides"], a["pads"], a["dilations"]
    pointwise = (kh, kw, sh, sw, dh, dw, groups) == (1,) * 7 and not any(a["pads"])
    if groups == c == o and not pointwise:
        return "depthwise"
    oh = (x_shape[2] + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (x_shape[3] + pl + pr - dw * (kw - 1) - 1) // sw + 1
    if pointwise and oh * ow == 1:  # [N, C, 1, 1] (squeeze-excitation): never merged
        return "1x1"
    flop = 2.0 * x_shape[0] * oh * ow * c * o if pointwise else 0.0
    if groups == 1 and merges_batch(int(x_shape[0]), oh * ow, itemsize, flop) \
            and not (pointwise and CONV_BATCH_MERGE == "auto-im2col"):
        return "im2col merged"
    return "1x1" if pointwise else "im2col"


def conv_path(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], a: dict,
              itemsize: int) -> str:
    """The executor's path name for a conv2d (``explain``, reports): its ``conv_form`` or cuDNN
    (where ``conv_cudnn``'s policy sends it and the library loads at run time)."""
    form = conv_form(x_shape, w_shape, a, itemsize)
    if form != "depthwise" and cudnn_wanted(x_shape, w_shape, out_shape, a, itemsize):
        return f"conv (cudnn {conv_layout(x_shape, w_shape, out_shape, a, itemsize)})"
    return {"1x1": "conv 1x1 (cublas)", "depthwise": "conv depthwise kernel", "im2col merged":
            "conv (im2col + cublas, batch merged)"}.get(form, "conv (im2col + cublas)")


def conv_launches(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], a: dict,
                  itemsize: int) -> int:
    """Kernels a conv2d launches, bias aside: cuDNN's (with channels-last transposes), the
    im2col forms' (im2col, GEMM, the merged form's copy), or one."""
    path = conv_path(x_shape, w_shape, out_shape, a, itemsize)
    return 3 if path == "conv (cudnn nhwc)" else 3 if "merged" in path else 2 if "im2col" in path else 1


def im2col_gemm(ops: Any, x: Any, w: Any, out: Any, a: dict, merged: bool) -> list[Launch]:
    """Launches of an im2col convolution on ``ops`` (an ``executor_ops.ComputeOps``): im2col into
    the shared scratch, then cuBLAS: ``W @ cols[n]`` per sample (a batched GEMM), or ``merged``:
    one GEMM ``W @ cols`` over all samples into the scratch as ``[O, N, P]`` and a copy into
    ``out``. Arrays bind at the first run, once the shared scratch exists."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    g = int(a["groups"])
    (sh, sw), (pt, pl, _, _), (dh, dw) = a["strides"], a["pads"], a["dilations"]
    _, _, oh, ow = out.shape
    K, P = cg * kh * kw, oh * ow
    total = n * c * kh * kw * P
    isz, kind = (2, np.uint16) if out.dtype == np.uint16 else (4, np.float32)
    col_bytes = -(-total * isz // 256) * 256  # the merged GEMM's output follows, 256-byte aligned
    get = ops.scratch(col_bytes + (out.size * isz if merged else 0))
    view: dict[str, Any] = {}

    def bind() -> None:
        if "c" not in view:
            buf = get()
            view["c"] = buf[:total * isz].view(kind)
            view["y"] = buf[col_bytes:col_bytes + out.size * isz].view(kind)

    def im2col() -> None:
        if "k" not in view:
            bind()
            order, kind_name = "_cnhw" if merged else "", "u16" if isz == 2 else "f32"
            if IM2COL_KERNEL == "tiled":
                fn = tiled_function(ops.cp, f"tdbx_im2col_tiled{order}_{kind_name}")
                grid, block = tiled_launch(n, c, oh, ow, kh, kw)
                args = (x, view["c"]) + tuple(np.int64(v) for v in (n, c, h, wd, oh, ow, kh, kw, sh, sw,
                                                                     pt, pl, dh, dw))
                view["k"] = lambda: fn(grid, block, args)
            else:
                view["k"] = ops.k.launch_rows(f"tdbx_im2col{order}_{kind_name}", total // P, P,
                                              (x, view["c"], total, c, h, wd, oh, ow, kh, kw, sh, sw, pt,
                                               pl, dh, dw))
        view["k"]()

    def gemm() -> None:
        if "f" not in view:
            bind()
            if merged:
                view["f"] = ops._matmul(w.reshape(o, K), view["c"].reshape(K, n * P),
                                        view["y"].reshape(o, n * P))
            else:
                view["f"] = ops._matmul(w.reshape(g, o // g, K), view["c"].reshape(n, g, K, P),
                                        out.reshape(n, g, o // g, P))
        view["f"]()

    def unmerge() -> None:
        if "u" not in view:
            bind()
            view["u"] = strided_copy(ops.cp, view["y"].reshape(o, n, P).transpose(1, 0, 2),
                                     out.reshape(n, o, P))
        view["u"]()

    return [im2col, gemm, unmerge] if merged else [im2col, gemm]
