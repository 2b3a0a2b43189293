"""Fused memory-bound kernels as self-contained CUDA C: ``generate(graph, schedule) -> KernelPlan``.

A plan is one or two kernels (two when partial reductions go through global memory). Sources
need no headers (fp16/bf16 are ``unsigned short`` converted with inline PTX) and are specialised
to the workload's shapes. Launching a plan with CuPy::

    import cupy as cp, numpy as np
    plan = generate(graph, schedule, sm_count=dev_sm_count)
    bufs = {}                                  # name -> contiguous device array
    for v in graph.inputs + graph.outputs:     # dtype per graph type; bfloat16 as uint16 bits,
        bufs[v] = ...                          # float16 as float16 (or uint16), bool as uint8/bool
    for name, nbytes in plan.scratch:          # scratch never needs zeroing, except the names
        bufs[name] = cp.empty(nbytes, cp.uint8)  # listed in plan.zeroed (memset 0 before a launch)
    for k in plan.kernels:
        fn = cp.RawModule(code=k.source, options=("-std=c++17",)).get_function(k.name)
        if k.shared_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = k.shared_bytes
        args = [bufs[a] if isinstance(a, str) else a for a in k.args]  # scalars: np.int64
        fn(k.grid, k.block, tuple(args), shared_mem=k.shared_bytes)

``k.args`` is: graph inputs in ``graph.inputs`` order, graph outputs in ``graph.outputs`` order,
scratch buffer names, then the scalars R and C as ``numpy.int64`` values (the kernels are
specialised to the shapes and take them for uniformity; pass them with exactly that width).
``split_row`` kernels carry ``__cluster_dims__`` (thread-block clusters, sm_90): a plain launch
works, the grid is a multiple of the cluster size. Kernels of one plan
run in order on one stream. Every output element is written by every plan, so outputs may be
poisoned (NaN) beforehand to catch unwritten elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tunedb.graph.ir import Graph
from tunedb.kernels.analysis import Analysis, UnsupportedFusion, analyze
from tunedb.kernels.frame import PH, Frame, KText
from tunedb.kernels.gen_colcluster import gen_col_cluster
from tunedb.kernels.gen_cols import gen_col_tiled
from tunedb.kernels.gen_rows import gen_rows
from tunedb.kernels.gen_simple import gen_elementwise, gen_transpose
from tunedb.kernels.gen_trows import is_trows, trows_kernel
from tunedb.kernels.gen_window import has_window_op, window_kernel
from tunedb.kernels.prelude import EVICT_LAST, PRELUDE, STREAM
from tunedb.kernels.schedule import Schedule, check
from tunedb.records import sha256_hex


@dataclass(frozen=True)
class KernelSpec:
    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[Any, ...]   # buffer names (str), then the scalars R and C as numpy.int64


@dataclass(frozen=True)
class KernelPlan:
    kernels: tuple[KernelSpec, ...]
    scratch: tuple[tuple[str, int], ...]
    source_hash: str
    R: int
    C: int
    pattern: str
    zeroed: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"kernels": [{"name": k.name, "grid": list(k.grid), "block": list(k.block),
                             "shared_bytes": k.shared_bytes,
                             "args": [a if isinstance(a, str) else int(a) for a in k.args],
                             "source": k.source} for k in self.kernels],
                "scratch": [list(s) for s in self.scratch], "source_hash": self.source_hash,
                "R": self.R, "C": self.C, "pattern": self.pattern, "zeroed": list(self.zeroed)}


def _texts(f: Frame) -> tuple[list[KText], list[tuple[str, int]]]:
    m = f.s.mapping
    if m == "elementwise":
        return gen_elementwise(f), []
    if m == "transpose_tiled":
        return gen_transpose(f), []
    if m == "col_tiled":
        return gen_col_tiled(f)
    if m == "col_cluster":
        return gen_col_cluster(f)
    return gen_rows(f)


def _window_plan(graph: Graph, schedule: Schedule, sm_count: int, trows: bool = False) -> KernelPlan:
    """A depthwise convolution or pool with its elementwise neighbours (``gen_window``), or
    rows of a transposed input (``gen_trows``)."""
    w = (trows_kernel(graph, sm_count, schedule.block) if trows else
         window_kernel(graph, sm_count, schedule.block, fast=schedule.fast_math))
    k = KernelSpec(w.name, w.source, w.grid, w.block, w.shared_bytes, w.args)
    return KernelPlan((k,), (), sha256_hex(w.source), w.R, w.C, "trows" if trows else "window")


def generate(graph: Graph | Analysis, schedule: Schedule, sm_count: int = 132) -> KernelPlan:
    """CUDA source and launch shapes for ``graph`` under ``schedule``. Raises
    ``UnsupportedFusion`` for subgraphs outside the generator and ``ValueError`` for a schedule
    that cannot run this graph (the reason ``schedule_space`` would prune it for)."""
    if isinstance(graph, Graph) and has_window_op(graph):
        return _window_plan(graph, schedule, sm_count)
    try:
        a = graph if isinstance(graph, Analysis) else analyze(graph)
    except UnsupportedFusion:
        if isinstance(graph, Graph) and is_trows(graph):  # a reduction of a transposed input
            return _window_plan(graph, schedule, sm_count, trows=True)
        raise
    why = check(a, schedule)
    if why:
        raise ValueError(f"schedule {schedule.label()} cannot run {a.graph.name or 'graph'}: {why}")
    f = Frame(a, schedule, sm_count)
    texts, scratch = _texts(f)
    head = "\n".join([PRELUDE] + ([STREAM] if schedule.stream else [])
                      + ([EVICT_LAST] if schedule.evict_last else []) + f.const_decls)
    raw = head + "\n" + "\n".join(t.body for t in texts)
    prefix = "tdb_" + sha256_hex(raw)[:16]
    g = a.graph
    outs: list[str] = []
    for v in g.outputs:
        for p, _ in f.out_params[a.resolve(v)]:
            if p not in outs:
                outs.append(p)
    out_names = {f"out{j}": v for j, v in enumerate(g.outputs)}
    kernels = []
    for j, t in enumerate(texts):
        name = f"{prefix}_k{j}"
        src = (head + "\n" + t.body).replace("@K@", name).replace(PH, prefix)
        args = (tuple(g.inputs) + tuple(out_names[p] for p in outs) + tuple(t.scratch)
                + (np.int64(a.R), np.int64(a.C)))
        kernels.append(KernelSpec(name, src, tuple(t.grid), tuple(t.block), int(t.smem), args))
    return KernelPlan(tuple(kernels), tuple(scratch), sha256_hex("\0".join(k.source for k in kernels)),
                      a.R, a.C, a.pattern)
