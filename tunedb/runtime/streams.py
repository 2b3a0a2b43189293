"""Several streams forked from and joined back into one stream, inside one CUDA graph.

``StreamPool`` holds ``n`` non-blocking CuPy streams, each with its own cuBLAS handle and
workspace (``tunedb.runtime.blas.Blas``), all made on first use. ``capture_forked`` records on a
main stream: an event that every branch stream waits on (the fork), each branch's work on its own
stream, then one event per branch that the main stream waits on (the join). Under stream capture
this is how CUDA builds a graph with parallel branches; without capture the same calls run the
branches concurrently, which is how a caller checks the results before timing the graph.

Two cuBLAS calls on one handle from two streams would share one workspace, so each branch uses
its own handle (``pool.blas(i)``), never the caller's. CuPy is imported lazily.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tunedb.runtime.blas import Blas
from tunedb.runtime.device import current_stream
from tunedb.runtime.graph_priority import priority_stream


def _cupy() -> Any:
    import cupy

    return cupy


class StreamPool:
    """``n`` non-blocking streams and one cuBLAS handle per stream, created on first use.

    Keep the pool alive while any graph captured with it replays: the graphs use its handles'
    workspaces and temporaries from ``memory_pool``."""

    def __init__(self, n: int, *, tf32: bool = False, cp: Any = None,
                 priorities: dict[int, int] | None = None) -> None:
        if n < 1:
            raise ValueError(f"a stream pool needs at least one stream, got {n}")
        self.n, self.tf32 = int(n), tf32
        self.priorities = dict(priorities or {})  # stream index -> CUDA priority (lower: sooner)
        self.cp = cp if cp is not None else _cupy()
        self._streams: list[Any] = [None] * self.n
        self._blas: list[Blas | None] = [None] * self.n
        self._pool: Any = None

    def _index(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"stream {i} of a pool of {self.n}")
        return i

    def stream(self, i: int) -> Any:
        """The ``i``-th stream (non-blocking: no implicit sync with the legacy null stream)."""
        i = self._index(i)
        if self._streams[i] is None:
            p = self.priorities.get(i)
            self._streams[i] = (self.cp.cuda.Stream(non_blocking=True) if p is None
                                else priority_stream(self.cp, p))
        return self._streams[i]

    def blas(self, i: int) -> Blas:
        """The cuBLAS handle bound to ``stream(i)`` with its own workspace."""
        i = self._index(i)
        b = self._blas[i]
        if b is None:
            b = self._blas[i] = Blas(self.cp, self.stream(i), tf32=self.tf32)
        return b

    @property
    def memory_pool(self) -> Any:
        """Private allocator for temporaries made while capturing; lives as long as the pool."""
        if self._pool is None:
            self._pool = self.cp.cuda.MemoryPool()
        return self._pool

    def close(self) -> None:
        """Give back the handles (and drop the streams); graphs captured with the pool stop being
        valid."""
        for b in self._blas:
            if b is not None:
                b.close()
        self._blas = [None] * self.n
        self._streams = [None] * self.n
        self._pool = None


def record_forked(main_stream: Any, branches: Sequence[Callable[[int], None]], pool: StreamPool) -> None:
    """Enqueue fork -> branches -> join with ``main_stream`` as the trunk (no capture here).
    Branch ``i`` runs ``branches[i](i)`` with ``pool.stream(i)`` current."""
    if len(branches) > pool.n:
        raise ValueError(f"{len(branches)} branches for a pool of {pool.n} streams")
    cp = pool.cp
    fork = cp.cuda.Event(disable_timing=True)
    fork.record(main_stream)
    joins = []
    for i, branch in enumerate(branches):
        s = pool.stream(i)
        s.wait_event(fork)
        with current_stream(cp, s):
            branch(i)
        done = cp.cuda.Event(disable_timing=True)
        done.record(s)
        joins.append(done)
    for done in joins:
        main_stream.wait_event(done)


@contextmanager
def gc_paused() -> Iterator[None]:
    # A finalizer that frees device memory or destroys a cuBLAS handle would break a capture.
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def capture_forked(main_stream: Any, branches: Sequence[Callable[[int], None]], pool: StreamPool,
                   *, capture: bool = True) -> Any:
    """A ``cupy.cuda.graph.Graph`` of fork -> ``branches`` on the pool's streams -> join, captured
    on ``main_stream`` (which must not be the null stream). With ``capture=False`` the same work
    is enqueued eagerly and ``None`` is returned (for checking results before timing).

    Create every handle before capturing (``pool.blas(i)`` for the branches that call cuBLAS):
    making one allocates, which a capture does not allow; this function does so for all
    branches' streams."""
    cp = pool.cp
    for i in range(len(branches)):
        pool.blas(i)  # handles and workspaces exist before any capture
    if not capture:
        with current_stream(cp, main_stream):
            record_forked(main_stream, branches, pool)
        return None
    if not main_stream.ptr:
        raise ValueError("capture_forked needs a non-default main stream")
    graph, err = None, None
    with gc_paused(), current_stream(cp, main_stream), cp.cuda.using_allocator(pool.memory_pool.malloc):
        main_stream.begin_capture()
        try:
            record_forked(main_stream, branches, pool)
        except Exception as e:  # noqa: BLE001 - end the capture before reporting
            err = e
        try:
            graph = main_stream.end_capture()
        except Exception as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        raise err
    return graph
