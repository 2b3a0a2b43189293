"""Executors whose steps run on several streams (``stage_exec``, ``pack_exec``).

Lane ``g > 0`` is stream ``g - 1`` of a ``StreamPool``, with that stream's cuBLAS handle and
workspace and a scratch buffer of its own, so that steps running side by side never share
memory (im2col convolutions, concurrent GEMMs); lane 0 is the executor's own stream and ops.
"""

from __future__ import annotations

import os
from typing import Any

from tunedb.runtime.executor import PlanExecutor
from tunedb.runtime.executor_ops import ComputeOps
from tunedb.runtime.streams import StreamPool


class LaneExecutor(PlanExecutor):
    """A ``PlanExecutor`` that builds steps on lanes; subclasses call ``_init_lanes`` before
    ``PlanExecutor.__init__`` (which builds the steps)."""

    def _init_lanes(self, streams: int, priorities: dict[int, int] | None = None) -> None:
        """``priorities``: lane -> CUDA stream priority (lanes > 0 only)."""
        self._lane_pool = StreamPool(max(1, streams), tf32=os.environ.get("CUPY_TF32", "0") not in ("", "0"),
                                     priorities={g - 1: p for g, p in (priorities or {}).items() if g > 0})
        self._lane_ops: dict[int, tuple[ComputeOps, ComputeOps]] = {}
        self._lane_cur = 0
        self._lane_need: dict[int, int] = {}
        self._lane_scratch: dict[int, Any] = {}

    def _ops_for(self, g: int) -> tuple[ComputeOps, ComputeOps]:
        ops = self._lane_ops.get(g)
        if ops is None:
            cp, blas = self.cp, self._lane_pool.blas(g - 1)
            ops = self._lane_ops[g] = (
                ComputeOps(cp, self.kernels, self._scratch_getter, blas),
                ComputeOps(cp, self.kernels, lambda nb: (lambda: cp.empty(nb, dtype=cp.uint8)), blas))
        return ops

    def _build_on_lane(self, g: int, k: int, step: Any, *, take: bool = False) -> list[Any]:
        """Build step ``k`` with lane ``g``'s ops and scratch; the launches it added (``take``:
        removed from the plan's launch list, for the caller to launch itself)."""
        saved = self.ops, self.eval_ops
        self._lane_cur = g
        if g:
            self.ops, self.eval_ops = self._ops_for(g)
        start = len(self._launch_fns)
        try:
            super()._build(k, step)
        finally:
            self.ops, self.eval_ops = saved
            self._lane_cur = 0
        fns = self._launch_fns[start:]
        if take:
            del self._launch_fns[start:]
        return fns

    def _scratch_getter(self, nbytes: int) -> Any:
        g = self._lane_cur
        if g == 0:
            return super()._scratch_getter(nbytes)
        self._lane_need[g] = max(self._lane_need.get(g, 0), int(nbytes))
        return lambda: self._scratch_of(g)

    def _scratch_of(self, g: int) -> Any:
        buf = self._lane_scratch.get(g)
        if buf is None:
            buf = self._lane_scratch[g] = self.cp.empty(max(1, self._lane_need[g]), dtype=self.cp.uint8)
        return buf

    def close_streams(self) -> None:
        """Give back the pool's cuBLAS handles (the executor's graph stops being valid)."""
        self._graph = None
        self._lane_pool.close()
