"""``splitk`` and ``chunks`` clusters of a plan's pack, launched on the plan's own buffers.

``build_inplace`` turns an ``InplacePlan`` (``tunedb.kernels.packing_inplace``: which clusters
qualify, and every problem's offsets) and each member's device arrays into one
``cublasGemmBatchedEx`` over pointer tables into those arrays; with slices of the depth, its
float32 partial sums go to a scratch stack and ``sum_into_source``'s kernel adds the slices of
each problem into that problem's block of its member's output (bfloat16 rounded to nearest even,
as ``pack_splitk``'s). Nothing is copied: the plan's buffers are read and written in place.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunedb.kernels.packing_inplace import InplacePlan
from tunedb.runtime.blas import CUDA_R_32F, DATA_TYPES, GEMM_DEFAULT, OP_N, OP_T, BlasError, check, library
from tunedb.runtime.device import current_stream
from tunedb.runtime.pack_splitk import _STORES, PARTIAL_LIMIT_BYTES

_SRC = r"""
extern "C" __global__ void sum_into_NAME(const float* __restrict__ part,
                                         const unsigned long long* __restrict__ outs,
                                         long long per, int problems, int split) {
    long long n = per * problems;
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        float acc = 0.0f;
        for (int j = 0; j < split; ++j) acc += part[(long long)j * n + i];
        OUT* out = reinterpret_cast<OUT*>(outs[i / per]) + (i % per);
        STORE
    }
}
"""


def sum_into_source(dtype: str) -> str:
    """CUDA source of the kernel adding ``split`` partial stacks ``[split, problems, per]`` into
    each problem's output block (pointer ``outs[q]``), in ``dtype`` (kernel ``sum_into_<dtype>``)."""
    if dtype not in _STORES:
        raise BlasError(f"split-K output {dtype}: expected one of {sorted(_STORES)}")
    out_t, store = _STORES[dtype]
    return _SRC.replace("NAME", dtype).replace("OUT", out_t).replace("STORE", store.replace("out[i]", "*out"))


_KERNELS: dict[str, Any] = {}


def build_inplace(cp: Any, blas: Any, pl: InplacePlan, arrays: Sequence[tuple[Any, Any, Any]], dtype: str
                  ) -> tuple[Callable[[], None], list[Any]]:
    """A launch of the cluster on ``blas``'s stream and what it points into. ``arrays``: per
    member ``(activation, weight, output)``, C-contiguous device arrays of ``dtype``."""
    lib = library()
    if not hasattr(lib, "cublasGemmBatchedEx"):
        raise BlasError("this cuBLAS has no cublasGemmBatchedEx")
    isz = arrays[0][0].dtype.itemsize
    keep: list[Any] = []
    if pl.split > 1:
        size = pl.split * pl.problems * pl.rows * pl.n * 4
        if size > PARTIAL_LIMIT_BYTES:
            raise BlasError(f"split-K partials of {size >> 20} MiB")
        part = cp.zeros((pl.split, pl.problems, pl.rows, pl.n), dtype=cp.float32)
        cbase, csz, ctype = [part.data.ptr] * len(arrays), 4, CUDA_R_32F
        keep.append(part)
    else:
        cbase, csz, ctype = [a[2].data.ptr for a in arrays], isz, DATA_TYPES[dtype]
    table = cp.asarray(np.array([[arrays[i][1].data.ptr + a * isz, arrays[i][0].data.ptr + x * isz,
                                  cbase[i] + c * csz] for i, a, x, c in pl.calls], dtype=np.uint64).T.copy())
    scalars = (ctypes.c_float(1.0), ctypes.c_float(0.0))
    t = DATA_TYPES[dtype]
    args = (blas.handle, OP_T if pl.nt else OP_N, OP_N, pl.n, pl.rows, pl.depth,
            ctypes.addressof(scalars[0]), table[0].data.ptr, t, pl.lda, table[1].data.ptr, t, pl.k,
            ctypes.addressof(scalars[1]), table[2].data.ptr, ctype, pl.n, len(pl.calls),
            blas.compute, GEMM_DEFAULT)
    keep += [table, scalars, args]
    what = f"cublasGemmBatchedEx ({len(pl.calls)} in-place problems of {pl.rows}x{pl.n}x{pl.depth})"
    total = _sum_launch(cp, pl, arrays, dtype, keep[0], blas.stream, keep) if pl.split > 1 else None

    def launch() -> None:
        check(lib.cublasGemmBatchedEx(*args), what)
        if total is not None:
            total()
    return launch, keep


def _sum_launch(cp: Any, pl: InplacePlan, arrays: Sequence[tuple[Any, Any, Any]], dtype: str, part: Any,
                stream: Any, keep: list[Any]) -> Callable[[], None]:
    if dtype not in _KERNELS:
        _KERNELS[dtype] = cp.RawKernel(sum_into_source(dtype), f"sum_into_{dtype}")
    kernel = _KERNELS[dtype]
    if hasattr(kernel, "compile"):  # compile and load now: a first launch inside a capture could not
        kernel.compile()
    isz = arrays[0][0].dtype.itemsize
    outs = cp.asarray(np.array([arrays[i][2].data.ptr + o * isz for i, o in pl.outs], dtype=np.uint64))
    keep.append(outs)
    per = pl.rows * pl.n
    threads = 256
    blocks = max(1, min(-(-per * pl.problems // threads), 132 * 16))

    def launch() -> None:
        with current_stream(cp, stream):
            kernel((blocks,), (threads,), (part, outs, np.int64(per), np.int32(pl.problems),
                                          np.int32(pl.split)))
    return launch
