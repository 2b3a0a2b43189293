"""Strided-to-contiguous copies that keep the last axis (head transposes, column slices).

``cupy.copyto`` from a permuted view runs a generic element-per-thread kernel with 64-bit index
arithmetic per element: the ``[B, H, S, D] -> [B, S, H, D]`` transpose of attention's output
took ~20 µs at batch 32 on an H200, three times its bytes at full bandwidth. When the source's
last axis has unit stride, each output row segment is a contiguous run of the source, so the
copy moves 16-byte (or 8/4/2/1) chunks with the index arithmetic once per chunk. Shapes and
strides are compile-time constants of the kernel (one NVRTC compile per distinct layout).

When the last axis moves (a 2-D transpose, ``[B, C, H, W] -> [B, H, W, C]``), the source is
contiguous along another output axis instead: ``transpose_source`` copies 64x64 tiles of the plane
of those two axes through shared memory, so that both the reads and the writes of a warp are
contiguous runs (CuPy's copy reads one element per 32-byte sector there), one plane per batch
index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

CHUNK_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
ITEM_TYPES = {8: "unsigned long long", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
TILE = 64            # a 64x64 tile per block and batch index
TILE_ROWS = 8        # a 32x8 block: each thread moves 8 tile rows x 2 halves
MAX_GRID_YZ = 65535
THREADS = 256
MAX_BLOCKS = 1 << 16


def chunk_bytes(inner_bytes: int, *addresses: int) -> int:
    """The widest chunk that divides a row segment and every address (alignment)."""
    for b in (16, 8, 4, 2, 1):
        if inner_bytes % b == 0 and all(a % b == 0 for a in addresses):
            return b
    return 1


def copy_source(shape: Sequence[int], src_strides: Sequence[int], itemsize: int, chunk: int) -> str:
    """CUDA source copying a source of element strides ``src_strides`` into a contiguous output
    of ``shape`` in ``chunk``-byte pieces (the last axis must have unit stride)."""
    per = chunk // itemsize
    dims = [int(d) for d in shape]
    dims[-1] //= per
    strides = [int(s) for s in src_strides[:-1]]  # in elements; the last axis steps by chunks
    n = math.prod(dims)
    T = CHUNK_TYPES[chunk]
    lines = ["  long long r = i, s = 0, q;"]
    lines.append(f"  q = r % {dims[-1]}LL; r /= {dims[-1]}LL; s += q * {per}LL;")
    for d, st in zip(reversed(dims[:-1]), reversed(strides)):
        lines.append(f"  q = r % {d}LL; r /= {d}LL; s += q * {st}LL;")
    body = "\n".join("  " + ln for ln in lines)
    return ('extern "C" __global__ void tdb_strided_copy(const char* __restrict__ src, '
            f"{T}* __restrict__ dst) {{\n"
            f"  for (long long i = (long long)blockIdx.x * {THREADS} + threadIdx.x; i < {n}LL;\n"
            f"       i += (long long)gridDim.x * {THREADS}) {{\n{body}\n"
            f"    dst[i] = *reinterpret_cast<const {T}*>(src + s * {itemsize}LL);\n  }}\n}}\n")


def transpose_source(shape: Sequence[int], src_strides: Sequence[int], itemsize: int, p: int) -> str:
    """CUDA source copying a source of element strides ``src_strides`` (unit stride on output
    axis ``p``, not the last) into a contiguous output of ``shape``: TILExTILE tiles of the plane
    of axes ``p`` and last, one plane per batch index (the other axes) along the grid's z. Every
    load of a tile is issued before the first shared-memory store (unrolled, independent)."""
    dims = [int(d) for d in shape]
    n = len(dims)
    dst_strides = [math.prod(dims[k + 1:]) for k in range(n)]
    batch = [k for k in range(n) if k not in (p, n - 1)]
    nb = math.prod(dims[k] for k in batch)
    lines = ["    long long r = b, s = 0, d = 0, q;"]
    for k in reversed(batch):
        lines.append(f"    q = r % {dims[k]}LL; r /= {dims[k]}LL; s += q * {int(src_strides[k])}LL; "
                     f"d += q * {dst_strides[k]}LL;")
    T, NP, NL, SL, DP = ITEM_TYPES[itemsize], dims[p], dims[-1], int(src_strides[-1]), dst_strides[p]
    R, H = TILE // TILE_ROWS, TILE // 32  # tile rows per thread, 32-wide halves per tile row
    body = "\n".join(lines)
    return ('extern "C" __global__ void __launch_bounds__(256, 4) '
            f"tdb_tiled_transpose(const {T}* __restrict__ src, {T}* __restrict__ dst) {{\n"
            f"  __shared__ {T} tile[{TILE}][{TILE + 1}];\n"
            f"  const long long j0 = (long long)blockIdx.x * {TILE}, i0 = (long long)blockIdx.y * {TILE};\n"
            f"  const int tx = threadIdx.x, ty = threadIdx.y;\n"
            # rows / columns of the tile left for this thread (the tile may overhang the plane)
            f"  const long long jl = {NL}LL - j0 - ty, il = {NP}LL - i0 - tx;\n"
            f"  const long long ils = {NP}LL - i0 - ty, jls = {NL}LL - j0 - tx;\n"
            f"  for (long long b = blockIdx.z; b < {nb}LL; b += gridDim.z) {{\n{body}\n"
            f"    const {T}* sp = src + s + (j0 + ty) * {SL}LL + i0 + tx;\n"
            f"    {T}* dp = dst + d + (i0 + ty) * {DP}LL + j0 + tx;\n"
            f"    {T} v[{R}][{H}] = {{}};\n"
            f"    #pragma unroll\n    for (int k = 0; k < {R}; ++k)\n"
            f"      #pragma unroll\n      for (int h = 0; h < {H}; ++h)\n"
            f"        if (k * {TILE_ROWS} < jl && h * 32 < il) "
            f"v[k][h] = sp[k * {TILE_ROWS * SL}LL + h * 32];\n"
            f"    #pragma unroll\n    for (int k = 0; k < {R}; ++k)\n"
            f"      #pragma unroll\n      for (int h = 0; h < {H}; ++h) "
            f"tile[ty + k * {TILE_ROWS}][tx + h * 32] = v[k][h];\n"
            f"    __syncthreads();\n"
            f"    #pragma unroll\n    for (int k = 0; k < {R}; ++k)\n"
            f"      #pragma unroll\n      for (int h = 0; h < {H}; ++h)\n"
            f"        if (k * {TILE_ROWS} < ils && h * 32 < jls) "
            f"dp[k * {TILE_ROWS * DP}LL + h * 32] = tile[tx + h * 32][ty + k * {TILE_ROWS}];\n"
            f"    __syncthreads();\n  }}\n}}\n")


def _tiled_transpose(cp: Any, src: Any, out: Any) -> Any:
    """The tiled kernel's launch for ``src`` -> ``out``, or None when it does not apply: no
    single output axis but the last has unit source stride, or the plane is too tall for the
    grid."""
    isz = src.dtype.itemsize
    unit = [k for k, st in enumerate(src.strides) if st == isz and src.shape[k] > 1]
    if isz not in ITEM_TYPES or len(unit) != 1 or unit[0] == src.ndim - 1:
        return None
    p = unit[0]
    gy = math.ceil(src.shape[p] / TILE)
    if gy > MAX_GRID_YZ:
        return None
    nb = src.size // (src.shape[p] * src.shape[-1])
    code = transpose_source(src.shape, [s // isz for s in src.strides], isz, p)
    kernel = cp.RawKernel(code, "tdb_tiled_transpose")
    grid = (math.ceil(src.shape[-1] / TILE), gy, max(1, min(nb, MAX_GRID_YZ)))
    args = (src, out)

    def run() -> None:
        kernel(grid, (32, TILE_ROWS, 1), args)

    run.keep = args  # type: ignore[attr-defined]
    return run


def strided_copy(cp: Any, src: Any, out: Any) -> Any:
    """A launch copying ``src`` (any strides) into the C-contiguous ``out``; the chunked kernel
    when the last axis is contiguous and the copy is not a plain one, else ``cupy.copyto``."""
    isz = src.dtype.itemsize
    if (src.ndim < 2 or src.size == 0 or src.flags.c_contiguous or not out.flags.c_contiguous
            or any(s < 0 or s % isz for s in src.strides)):
        return lambda: cp.copyto(out, src)
    if src.strides[-1] != isz:  # the last axis moves
        return _tiled_transpose(cp, src, out) or (lambda: cp.copyto(out, src))
    chunk = chunk_bytes(src.shape[-1] * isz, src.data.ptr, out.data.ptr,
                        *(s for s in src.strides[:-1]))
    if chunk < isz:
        return lambda: cp.copyto(out, src)
    code = copy_source(src.shape, [s // isz for s in src.strides], isz, chunk)
    kernel = cp.RawKernel(code, "tdb_strided_copy")
    n = src.size * isz // chunk
    grid = (min(MAX_BLOCKS, max(1, math.ceil(n / THREADS))), 1, 1)
    args = (src, out)

    def run() -> None:
        kernel(grid, (THREADS, 1, 1), args)

    run.keep = args  # type: ignore[attr-defined]
    return run
