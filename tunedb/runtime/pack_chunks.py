"""The ``chunks`` packing backend: members of one ``n, k`` and different ``m`` (tenants' sequence
lengths, MoE experts' token counts, LoRA adapters' tokens) as ONE pointer-array batched GEMM over
row chunks.

Every problem's rows are cut into chunks of ``rows`` rows (the last one zero-padded in the
member's own buffer); every chunk is one problem of the batched call, pointing at its rows of the
activation and the output and at its member's weight. Padding stays under ``rows`` rows per
problem, where ``padded`` and ``pointer`` pad every problem to the cluster's largest ``m``. With
``split`` > 1 every chunk's depth is also cut into ``split`` slices (as ``splitk`` does) into
float32 partial sums that one kernel adds up: few chunks with a deep ``k`` (LoRA shrink GEMMs)
then fill the GPU. ``chunk_plan`` is the pointer arithmetic, pure Python so it is checked
without a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tunedb.kernels.packing import Member, padded_shape, splitk_depth
from tunedb.runtime.blas import CUDA_R_32F, DATA_TYPES, GEMM_DEFAULT, OP_N, BlasError, check, library
from tunedb.runtime.pack_splitk import PARTIAL_LIMIT_BYTES, WeightOperand, launch_sum


@dataclass(frozen=True)
class ChunkPlan(WeightOperand):
    """The batched call in cuBLAS's column-major terms (``C^T = W^T X^T`` per chunk and slice).
    Member ``i`` has its own activation ``[batch, mp, Kp]`` and weight ``[batch, Kp, N]`` (or
    ``[batch, N, Kp]`` read transposed), ``mp`` its rows padded to a multiple of ``rows``, ``Kp``
    the depth padded to ``split`` slices; the outputs of all members are one stack of
    ``total_rows`` rows of ``N`` (member ``i``'s problems from row ``row0[i]``), and with
    ``split`` > 1 the partials are ``split`` such stacks in float32. ``chunks``: (member, weight
    offset, activation offset, output offset) per chunk and slice, in elements into the member's
    buffers and the (partial) output stack."""

    N: int
    K: int  # padded depth
    depth: int  # per slice
    split: int
    rows: int
    nt: bool
    padded_m: tuple[int, ...]
    row0: tuple[int, ...]
    total_rows: int
    chunks: tuple[tuple[int, int, int, int], ...]

    @property
    def weight_depth(self) -> int:
        return self.K


def chunk_plan(members: Sequence[Member], rows: int, split: int = 1) -> ChunkPlan:
    _, N, K = padded_shape(members)
    d = splitk_depth(K, split) if split > 1 else K
    Kp, nt = d * split, members[0].layout == "nt"
    pm, row0, r = [], [], 0
    for mb in members:
        pm.append(-(-mb.m // rows) * rows)
        row0.append(r)
        r += mb.batch * pm[-1]
    chunks = []
    for j in range(split):
        for i, mb in enumerate(members):
            for b in range(mb.batch):
                for c in range(pm[i] // rows):
                    a = b * N * Kp + j * d if nt else b * Kp * N + j * d * N
                    x = (b * pm[i] + c * rows) * Kp + j * d
                    o = (j * r + row0[i] + b * pm[i] + c * rows) * N
                    chunks.append((i, a, x, o))
    return ChunkPlan(N, Kp, d, split, rows, nt, tuple(pm), tuple(row0), r, tuple(chunks))


def member_buffers(xp: Any, members: Sequence[Member], inputs: Sequence[tuple[Any, Any]],
                   pl: ChunkPlan) -> list[tuple[Any, Any]]:
    """(activation, weight) per member in ``xp`` (NumPy or CuPy), zero-padded; members with one
    weight tag get one weight buffer."""
    st = inputs[0][0].dtype
    shared: dict[str, Any] = {}
    out = []
    for mb, mp, (x, wt) in zip(members, pl.padded_m, inputs):
        X = xp.zeros((mb.batch, mp, pl.K), dtype=st)
        X[:, :mb.m, :mb.k] = xp.asarray(x)
        W = shared.get(mb.weight) if mb.weight else None
        if W is None:
            W = xp.zeros((mb.batch, pl.N, pl.K) if pl.nt else (mb.batch, pl.K, pl.N), dtype=st)
            if pl.nt:
                W[:, :mb.n, :mb.k] = xp.asarray(wt)
            else:
                W[:, :mb.k, :mb.n] = xp.asarray(wt)
            if mb.weight:
                shared[mb.weight] = W
        out.append((X, W))
    return out


def member_outputs(O: Any, members: Sequence[Member], pl: ChunkPlan) -> list[Any]:
    """Each member's ``[batch, m, n]`` view of the output stack ``O`` (``[total_rows, N]``)."""
    return [O[r0:r0 + mb.batch * mp].reshape(mb.batch, mp, pl.N)[:, :mb.m, :mb.n]
            for mb, mp, r0 in zip(members, pl.padded_m, pl.row0)]


def build_chunks(cp: Any, blas: Any, members: Sequence[Member], inputs: Sequence[tuple[Any, Any]],
                 rows: int, split: int = 1) -> tuple[Callable[[], None], Any, list[Any]]:
    """A step enqueuing the cluster on ``blas``'s stream, the output stack ``[total_rows, N]``
    (``member_outputs`` reads it) and the arrays the step points into."""
    lib = library()
    if not hasattr(lib, "cublasGemmBatchedEx"):
        raise BlasError("this cuBLAS has no cublasGemmBatchedEx")
    dtype = members[0].dtype
    pl = chunk_plan(members, rows, split)
    bufs = member_buffers(cp, members, inputs, pl)
    O = cp.zeros((pl.total_rows, pl.N), dtype=bufs[0][0].dtype)
    if split > 1:
        if split * pl.total_rows * pl.N * 4 > PARTIAL_LIMIT_BYTES:
            raise BlasError(f"chunk partials of {split * pl.total_rows * pl.N * 4 >> 20} MiB")
        C, ctype, csz = cp.zeros((split, pl.total_rows, pl.N), dtype=cp.float32), CUDA_R_32F, 4
    else:
        C, ctype, csz = O, DATA_TYPES[dtype], O.dtype.itemsize
    isz = bufs[0][0].dtype.itemsize
    table = cp.asarray(np.array([[bufs[i][1].data.ptr + a * isz, bufs[i][0].data.ptr + x * isz,
                                  C.data.ptr + o * csz] for i, a, x, o in pl.chunks],
                                dtype=np.uint64).T.copy())
    scalars = (ctypes.c_float(1.0), ctypes.c_float(0.0))
    t = DATA_TYPES[dtype]
    args = (blas.handle, pl.transa, OP_N, pl.N, rows, pl.depth, ctypes.addressof(scalars[0]),
            table[0].data.ptr, t, pl.lda, table[1].data.ptr, t, pl.K,
            ctypes.addressof(scalars[1]), table[2].data.ptr, ctype, pl.N, len(pl.chunks),
            blas.compute, GEMM_DEFAULT)
    what = f"cublasGemmBatchedEx ({len(pl.chunks)} chunks of {rows}x{pl.N}x{pl.depth})"
    total = launch_sum(cp, dtype, C, O, split, blas.stream) if split > 1 else None

    def step() -> None:
        check(lib.cublasGemmBatchedEx(*args), what)
        if total is not None:
            total()
    keep = [b for pair in bufs for b in pair] + [O, C, table, scalars]
    return step, O, keep
