"""Weights pulled into L2 one unit ahead, on a stream of their own (``StagedExecutor(prefetch=True)``).

The stage harness times each stage warm (its weights in L2 from the copy before), and a plan reads
Inception V3's 95 MB of weights once per run, more than the H200's 50 MB of L2: the staged plan
ran 6 % above its harness stage sum (session 8). Here, while unit ``i`` runs (a stage, or a chunk
of ``PREFETCH_CHUNK`` steps of a plan without stages), a small kernel on a side stream issues
``prefetch.global.L2`` for every 128-byte line of the graph inputs and constants that unit
``i + 1`` reads. A prefetch only warms the cache: the results are the same bytes. The side
stream forks from the main stream at each unit's start and joins it at the next unit's start (the
kernel only issues the hints, so the join costs little), which keeps one capturable graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tunedb.runtime.device import current_stream

PREFETCH_CHUNK = 8  # steps per unit in a plan without stages
PREFETCH_BLOCKS, PREFETCH_THREADS = 8, 256  # a few SMs' worth: the hints, not the traffic, run here
LINE = 128

PREFETCH_SOURCE = r"""
extern "C" __global__ void tunedb_l2_prefetch(const unsigned long long* ptrs,
                                              const unsigned long long* sizes, int n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x * 128ULL;
    const unsigned long long first = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * 128ULL;
    for (int r = 0; r < n; ++r) {
        const char* p = (const char*)ptrs[r];
        for (unsigned long long i = first; i < sizes[r]; i += stride)
            asm volatile("prefetch.global.L2 [%0];" :: "l"(p + i));
    }
}
"""


def prefetch_units(plan: Any, chunk: int = PREFETCH_CHUNK) -> list[list[int]]:
    """The plan's steps by unit: its stages in order, else chunks of ``chunk`` steps."""
    if plan.stages:
        return [[i for g in st for i in g] for st in plan.stages]
    n = len(plan.steps)
    return [list(range(k, min(n, k + chunk))) for k in range(0, n, chunk)]


def unit_weights(plan: Any, units: Sequence[Sequence[int]]) -> list[list[str]]:
    """Per unit, the graph inputs and constants its steps read (first read only: a value an
    earlier unit read is already in L2 or evicted by now), in step order."""
    g = plan.graph
    outside = set(g.inputs) | set(g.constant_map)
    seen: set[str] = set()
    out = []
    for unit in units:
        vals = []
        for k in unit:
            for v in plan.steps[k].inputs:
                if v in outside and v not in seen:
                    seen.add(v)
                    vals.append(v)
        out.append(vals)
    return out


class L2Prefetch:
    """Prefetch launches for ``ranges`` (per unit, (device pointer, bytes) pairs) on ``stream``:
    ``point(i, main)`` at unit ``i``'s start joins the previous prefetch and forks the one of
    unit ``i + 1``; ``end(main)`` joins the last one."""

    def __init__(self, cp: Any, ranges: Sequence[Sequence[tuple[int, int]]], stream: Any) -> None:
        self.cp, self.stream = cp, stream
        self.kernel = cp.RawKernel(PREFETCH_SOURCE, "tunedb_l2_prefetch")
        self.kernel.compile()  # now, not at a first launch inside a capture
        self.tables = [None if not r else (cp.asarray(np.array([p for p, _ in r], dtype=np.uint64)),
                                           cp.asarray(np.array([n for _, n in r], dtype=np.uint64)),
                                           np.int32(len(r)))
                       for r in ranges]
        self.forks = [cp.cuda.Event(disable_timing=True) for _ in ranges]
        self.dones = [cp.cuda.Event(disable_timing=True) for _ in ranges]
        self.bytes = int(sum(n for r in ranges for _, n in r))
        self._pending: Any = None

    def point(self, i: int, main: Any) -> None:
        if self._pending is not None:
            main.wait_event(self._pending)
            self._pending = None
        if i + 1 >= len(self.tables) or self.tables[i + 1] is None:
            return
        self.forks[i].record(main)
        self.stream.wait_event(self.forks[i])
        with current_stream(self.cp, self.stream):
            self.kernel((PREFETCH_BLOCKS,), (PREFETCH_THREADS,), self.tables[i + 1])
        self.dones[i].record(self.stream)
        self._pending = self.dones[i]

    def end(self, main: Any) -> None:
        if self._pending is not None:
            main.wait_event(self._pending)
            self._pending = None


def prefetch_for(executor: Any, stream: Any) -> L2Prefetch:
    """An ``L2Prefetch`` over ``executor``'s plan units and its device arrays of the weights."""
    plan = executor.plan
    units = prefetch_units(plan)
    ranges = [[(int(executor.env[v].data.ptr), int(executor.env[v].nbytes)) for v in vals]
              for vals in unit_weights(plan, units)]
    return L2Prefetch(executor.cp, ranges, stream)
