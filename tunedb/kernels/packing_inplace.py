"""``splitk`` and ``chunks`` clusters over a plan's own buffers: which ones run without a copy,
and the pointer arithmetic of their one pointer-array batched GEMM.

The bench and the collector stack and pad operands (``tunedb.runtime.pack_splitk``,
``pack_chunks``); a plan cannot: its members read and write the plan's fixed buffers, and copies
would be work the database did not time. So inside a plan a cluster runs ``splitk`` only when its
members are one shape and its depth splits into whole aligned slices, and ``chunks`` only when
its members share ``n``, ``k`` and layout and every member's rows are whole chunks (and, with
slices of the depth, the depth splits exactly). Then every (slice, problem or chunk) of the
batched call points into a member's own arrays, with no padding at all; with slices, the float32
partial sums go to scratch and one kernel adds them into each member's output
(``tunedb.runtime.pack_inplace``). Pure Python, checked on NumPy buffers without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tunedb.kernels.packing import SPLITK_DTYPES, Member, splitk_depth

INPLACE_BACKENDS = ("splitk", "chunks")


def inplace_ok(members: Sequence[Member], backend: str, split: int = 1, rows: int = 0) -> bool:
    """Whether a cluster of ``members`` runs ``backend`` (with ``split`` slices of the depth,
    ``rows`` per chunk) on the members' own buffers (module docstring)."""
    if backend not in INPLACE_BACKENDS or not members:
        return False
    first = members[0]
    same = {(m.dtype, m.layout, m.n, m.k) for m in members}
    if len(same) != 1 or sum(m.batch for m in members) < 1:
        return False
    # slice depth and size limits are the candidate generators' (splitk_ok, chunks_ok)
    if split > 1 and (first.dtype not in SPLITK_DTYPES or splitk_depth(first.k, split) * split != first.k):
        return False
    if backend == "splitk":
        return split > 1 and len({m.m for m in members}) == 1 and (len(members) > 1 or first.batch > 1)
    return rows > 0 and all(m.m % rows == 0 for m in members) and sum(
        m.batch * (m.m // rows) for m in members) > 1


@dataclass(frozen=True)
class InplacePlan:
    """One pointer-array batched GEMM in cuBLAS's column-major terms (``C^T = W^T X^T``): ``rows``
    output rows per problem, ``n`` columns, ``depth`` per slice. ``calls``: per (slice, problem)
    the member and element offsets into its weight, its activation and either its output
    (``split`` = 1) or the partial stack ``[split, problems, rows, n]``; ``outs``: per problem
    the member and the element offset of its output block (what the summing kernel writes)."""

    rows: int
    n: int
    k: int
    depth: int
    split: int
    nt: bool
    calls: tuple[tuple[int, int, int, int], ...]
    outs: tuple[tuple[int, int], ...]

    @property
    def problems(self) -> int:
        return len(self.outs)

    @property
    def lda(self) -> int:
        return self.k if self.nt else self.n


def inplace_plan(members: Sequence[Member], backend: str, split: int = 1, rows: int = 0) -> InplacePlan:
    """The batched call of an ``inplace_ok`` cluster. Member ``i``'s arrays: activation
    ``[batch, m, k]``, weight ``[batch, k, n]`` (``nt``: ``[batch, n, k]``, read transposed; a
    2-D weight is batch 1), output ``[batch, m, n]``, all C-contiguous."""
    if not inplace_ok(members, backend, split, rows):
        raise ValueError(f"{backend} (split {split}, rows {rows}) does not run in place on these members")
    first = members[0]
    n, k, nt = first.n, first.k, first.layout == "nt"
    depth = k // split
    height = first.m if backend == "splitk" else rows
    blocks = [(i, b, r0) for i, mb in enumerate(members) for b in range(mb.batch)
              for r0 in range(0, mb.m, height)]
    outs = tuple((i, (b * members[i].m + r0) * n) for i, b, r0 in blocks)
    calls = []
    for j in range(split):
        for q, (i, b, r0) in enumerate(blocks):
            a = b * n * k + (j * depth if nt else j * depth * n)
            x = (b * members[i].m + r0) * k + j * depth
            c = outs[q][1] if split == 1 else (j * len(blocks) + q) * height * n
            calls.append((i, a, x, c))
    return InplacePlan(height, n, k, depth, split, nt, tuple(calls), outs)
