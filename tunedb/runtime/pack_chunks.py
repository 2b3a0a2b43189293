"""The ``chunks`` packing backend: members of one ``n, k`` and different ``m`` (tenants' sequence
lengths, MoE experts' token counts) as ONE pointer-array batched GEMM over row chunks.

Every problem's rows are cut into chunks of ``rows`` rows (the last one zero-padded in the
member's own buffer); every chunk is one problem of the batched call, pointing at its rows of the
activation and the output and at its member's weight. Padding stays under ``rows`` rows per
problem, where ``padded`` and ``pointer`` pad every problem to the cluster's largest ``m``.
``chunk_plan`` is the pointer arithmetic, pure Python so it is checked without a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tunedb.kernels.packing import Member, padded_shape
from tunedb.runtime.blas import DATA_TYPES, GEMM_DEFAULT, OP_N, OP_T, BlasError, check, library


@dataclass(frozen=True)
class ChunkPlan:
    """The batched call in cuBLAS's column-major terms (``C^T = W^T X^T`` per chunk). Member
    ``i`` has its own buffers: activation ``[batch, mp, K]``, weight ``[batch, K, N]`` (or
    ``[batch, N, K]`` read transposed) and output ``[batch, mp, N]``, ``mp`` its rows padded to a
    multiple of ``rows``. ``chunks``: (member, weight offset, activation offset, output offset)
    per chunk, offsets in elements into that member's buffers."""

    N: int
    K: int
    rows: int
    nt: bool
    padded_m: tuple[int, ...]
    chunks: tuple[tuple[int, int, int, int], ...]

    @property
    def transa(self) -> int:
        return OP_T if self.nt else OP_N

    @property
    def lda(self) -> int:
        return self.K if self.nt else self.N


def chunk_plan(members: Sequence[Member], rows: int) -> ChunkPlan:
    _, N, K = padded_shape(members)
    pm, chunks = [], []
    for i, mb in enumerate(members):
        mp = -(-mb.m // rows) * rows
        pm.append(mp)
        for b in range(mb.batch):
            for c in range(mp // rows):
                chunks.append((i, b * K * N, b * mp * K + c * rows * K, b * mp * N + c * rows * N))
    return ChunkPlan(N, K, rows, members[0].layout == "nt", tuple(pm), tuple(chunks))


def member_buffers(xp: Any, members: Sequence[Member], inputs: Sequence[tuple[Any, Any]],
                   pl: ChunkPlan) -> list[tuple[Any, Any, Any]]:
    """(activation, weight, output) per member in ``xp`` (NumPy or CuPy), zero-padded; members
    with one weight tag get one weight buffer."""
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
        out.append((X, W, xp.zeros((mb.batch, mp, pl.N), dtype=st)))
    return out


def build_chunks(cp: Any, blas: Any, members: Sequence[Member], inputs: Sequence[tuple[Any, Any]],
                 rows: int) -> tuple[Callable[[], None], list[Any], list[Any]]:
    """A step enqueuing the cluster on ``blas``'s stream, each member's output buffer
    ``[batch, mp, N]`` (its result in ``[:, :m, :n]``) and the arrays the step points into."""
    lib = library()
    if not hasattr(lib, "cublasGemmBatchedEx"):
        raise BlasError("this cuBLAS has no cublasGemmBatchedEx")
    pl = chunk_plan(members, rows)
    bufs = member_buffers(cp, members, inputs, pl)
    isz = bufs[0][0].dtype.itemsize
    table = cp.asarray(np.array([[bufs[i][1].data.ptr + a * isz, bufs[i][0].data.ptr + b * isz,
                                  bufs[i][2].data.ptr + c * isz] for i, a, b, c in pl.chunks],
                                dtype=np.uint64).T.copy())
    scalars = (ctypes.c_float(1.0), ctypes.c_float(0.0))
    t = DATA_TYPES[members[0].dtype]
    args = (blas.handle, pl.transa, OP_N, pl.N, rows, pl.K, ctypes.addressof(scalars[0]),
            table[0].data.ptr, t, pl.lda, table[1].data.ptr, t, pl.K,
            ctypes.addressof(scalars[1]), table[2].data.ptr, t, pl.N, len(pl.chunks),
            blas.compute, GEMM_DEFAULT)
    what = f"cublasGemmBatchedEx ({len(pl.chunks)} chunks of {rows}x{pl.N}x{pl.K})"

    def step() -> None:
        check(lib.cublasGemmBatchedEx(*args), what)
    keep = [b for trio in bufs for b in trio] + [table, scalars]
    return step, [o for _, _, o in bufs], keep
