"""The ``splitk`` packing backend: few output tiles and a deep ``k`` leave most SMs idle in one
batched GEMM (R = 20 problems of 256x128 are 40 tiles of 128x128 on 132 SMs); cutting every
problem's depth into ``split`` slices gives ``split`` times the tiles, each ``split`` times
shorter.

One ``cublasGemmBatchedEx`` computes every (slice, problem) product into float32 partial sums
(``[split, P, M, N]``; bfloat16 operands, float32 accumulation and output), then one kernel adds
the slices and writes the output in the member dtype (bfloat16 rounded to nearest even). The
operands are the padded stacks of ``padded`` with the depth padded to ``split`` aligned slices.
``splitk_plan`` is the pointer arithmetic, pure Python so it is checked without a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tunedb.kernels.packing import Member, padded_shape, splitk_depth
from tunedb.runtime.blas import CUDA_R_32F, DATA_TYPES, GEMM_DEFAULT, OP_N, OP_T, BlasError, check, library
from tunedb.runtime.device import current_stream

PARTIAL_LIMIT_BYTES = 4 << 30


class WeightOperand:
    """The weight as cuBLAS's ``A`` operand of ``C^T = W^T X^T`` (column-major): ``[.., k, n]``
    row-major read as is (``lda`` = n), or with ``nt`` ``[.., n, k]`` read transposed (``lda`` =
    the depth it is stored with, ``weight_depth``). Shared by the split-K and chunked plans."""

    nt: bool
    N: int

    @property
    def weight_depth(self) -> int:
        raise NotImplementedError

    @property
    def transa(self) -> int:
        return OP_T if self.nt else OP_N

    @property
    def lda(self) -> int:
        return self.weight_depth if self.nt else self.N


@dataclass(frozen=True)
class SplitKPlan(WeightOperand):
    """The batched call in cuBLAS's column-major terms (``C^T = W^T X^T`` per slice): ``A`` the
    weight slice, ``B`` the activation slice, ``C`` the slice's float32 partial; offsets in
    elements from the start of the weight stack, the activation stack and the partials."""

    P: int
    M: int
    N: int
    K: int
    depth: int  # elements per slice
    split: int
    nt: bool  # weight stack [P, N, Kp] (read transposed) rather than [P, Kp, N]
    offsets: tuple[tuple[int, int, int], ...]  # (A = weight, B = activation, C = partial)

    @property
    def padded_k(self) -> int:
        return self.depth * self.split

    @property
    def weight_depth(self) -> int:
        return self.padded_k

    @property
    def ldb(self) -> int:
        return self.padded_k

    @property
    def ldc(self) -> int:
        return self.N

    def weight_shape(self) -> tuple[int, int, int]:
        return (self.P, self.N, self.padded_k) if self.nt else (self.P, self.padded_k, self.N)


def splitk_plan(members: Sequence[Member], split: int) -> SplitKPlan:
    """The (slice, problem) products of ``members`` padded to their largest shape: slice ``j``
    of problem ``p`` reads depth ``[j * depth, (j + 1) * depth)`` and writes partial ``[j, p]``."""
    M, N, K = padded_shape(members)
    P = sum(m.batch for m in members)
    d = splitk_depth(K, split)
    Kp, nt = d * split, members[0].layout == "nt"
    offs = []
    for j in range(split):
        for p in range(P):
            a = p * N * Kp + j * d if nt else p * Kp * N + j * d * N
            offs.append((a, p * M * Kp + j * d, (j * P + p) * M * N))
    return SplitKPlan(P, M, N, K, d, split, nt, tuple(offs))


def stacks(xp: Any, members: Sequence[Member], inputs: Sequence[tuple[Any, Any]], pl: SplitKPlan
           ) -> tuple[Any, Any]:
    """The zero-padded activation stack ``[P, M, Kp]`` and weight stack (``pl.weight_shape()``)
    in ``xp`` (NumPy or CuPy), member after member, each problem of a member in turn."""
    st = inputs[0][0].dtype
    X = xp.zeros((pl.P, pl.M, pl.padded_k), dtype=st)
    W = xp.zeros(pl.weight_shape(), dtype=st)
    p = 0
    for mb, (x, wt) in zip(members, inputs):
        b = mb.batch
        X[p:p + b, :mb.m, :mb.k] = xp.asarray(x)
        if pl.nt:
            W[p:p + b, :mb.n, :mb.k] = xp.asarray(wt)
        else:
            W[p:p + b, :mb.k, :mb.n] = xp.asarray(wt)
        p += b
    return X, W


_SUM_SRC = r"""
extern "C" __global__ void splitk_sum_NAME(const float* __restrict__ part, OUT* __restrict__ out,
                                           long long n, int split) {
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        float acc = 0.0f;
        for (int j = 0; j < split; ++j) acc += part[(long long)j * n + i];
        STORE
    }
}
"""
_STORES = {
    "float32": ("float", "out[i] = acc;"),
    # round to nearest even, as the host's bf16_bits does
    "bfloat16": ("unsigned short", "unsigned int u = *reinterpret_cast<unsigned int*>(&acc);"
                 " out[i] = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);"),
}


def sum_source(dtype: str) -> str:
    """CUDA source of the slice-summing kernel for output ``dtype`` (kernel ``splitk_sum_<dtype>``)."""
    if dtype not in _STORES:
        raise BlasError(f"split-K output {dtype}: expected one of {sorted(_STORES)}")
    out_t, store = _STORES[dtype]
    return _SUM_SRC.replace("NAME", dtype).replace("OUT", out_t).replace("STORE", store)


_KERNELS: dict[str, Any] = {}


def _sum_kernel(cp: Any, dtype: str) -> Any:
    if dtype not in _KERNELS:
        _KERNELS[dtype] = cp.RawKernel(sum_source(dtype), f"splitk_sum_{dtype}")
    return _KERNELS[dtype]


def build_splitk(cp: Any, blas: Any, members: Sequence[Member], inputs: Sequence[tuple[Any, Any]],
                 split: int) -> tuple[Callable[[], None], Any, list[Any]]:
    """A step enqueuing the cluster on ``blas``'s stream (the batched slices, then the sum), the
    output stack ``[P, M, N]`` (member ``i``'s problems follow member ``i - 1``'s, padded) and the
    arrays the step points into. ``inputs``: ``(x, weight)`` per member in storage form."""
    dtype = members[0].dtype
    if dtype not in _STORES:
        raise BlasError(f"split-K on {dtype}: expected one of {sorted(_STORES)}")
    lib = library()
    if not hasattr(lib, "cublasGemmBatchedEx"):
        raise BlasError("this cuBLAS has no cublasGemmBatchedEx")
    pl = splitk_plan(members, split)
    if split * pl.P * pl.M * pl.N * 4 > PARTIAL_LIMIT_BYTES:
        raise BlasError(f"split-K partials of {split * pl.P * pl.M * pl.N * 4 >> 20} MiB")
    X, W = stacks(cp, members, inputs, pl)
    O = cp.zeros((pl.P, pl.M, pl.N), dtype=X.dtype)
    part = cp.zeros((split, pl.P, pl.M, pl.N), dtype=cp.float32)
    isz = X.dtype.itemsize
    table = cp.asarray(np.array([[W.data.ptr + a * isz, X.data.ptr + b * isz, part.data.ptr + c * 4]
                                 for a, b, c in pl.offsets], dtype=np.uint64).T.copy())
    scalars = (ctypes.c_float(1.0), ctypes.c_float(0.0))
    t = DATA_TYPES[dtype]
    args = (blas.handle, pl.transa, OP_N, pl.N, pl.M, pl.depth, ctypes.addressof(scalars[0]),
            table[0].data.ptr, t, pl.lda, table[1].data.ptr, t, pl.ldb,
            ctypes.addressof(scalars[1]), table[2].data.ptr, CUDA_R_32F, pl.ldc, len(pl.offsets),
            blas.compute, GEMM_DEFAULT)
    total = launch_sum(cp, dtype, part, O, split, blas.stream)
    what = f"cublasGemmBatchedEx (split-K {split} x {pl.P} x {pl.M}x{pl.N}x{pl.depth})"

    def step() -> None:
        check(lib.cublasGemmBatchedEx(*args), what)
        total()
    return step, O, [X, W, O, part, table, scalars]


def launch_sum(cp: Any, dtype: str, part: Any, out: Any, split: int, stream: Any) -> Callable[[], None]:
    """A launch adding ``split`` float32 partial stacks (``part``, ``[split, *out.shape]``) into
    ``out`` (``dtype``; bfloat16 as its bits) on ``stream``; compiled now, not in a capture."""
    kernel = _sum_kernel(cp, dtype)
    n = int(out.size)
    if part.size != split * n:
        raise BlasError(f"split-K partials of {part.size} elements for {split} x {n}")
    threads = 256
    blocks = max(1, min(-(-n // threads), 132 * 16))
    if hasattr(kernel, "compile"):  # compile and load now: a first launch inside a capture could not
        kernel.compile()

    def launch() -> None:
        with current_stream(cp, stream):
            kernel((blocks,), (threads,), (part, out, np.int64(n), np.int32(split)))
    return launch
