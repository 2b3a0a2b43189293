"""Plans with superkernel packs on the GPU: a pack's members launched together in the plan's graph.

``PackExecutor(plan)`` is a ``PlanExecutor`` that runs each pack of ``plan.packs`` (consecutive
GEMM/conv steps; ``tunedb.plan.packing.PlanPack``) by its clusters, one after another: a
``serial`` cluster's members on the executor's stream in order; a ``streams`` cluster's members
spread (longest predicted first) over ``k`` streams of a ``StreamPool``, forked from and joined
back into the executor's stream, so that the captured plan is one CUDA graph with parallel
branches; a ``grouped`` cluster as one ``cublasGemmGroupedBatchedEx`` over the members' own
arrays (plain GEMMs only: pointers into the plan's fixed buffers); a ``splitk`` or ``chunks``
cluster as one pointer-array batched GEMM over the members' own arrays (``pack_inplace``: equal
shapes, whole slices and chunks, no padding). Each branch stream has its
own cuBLAS handle, workspace and scratch buffer (im2col convolutions never share memory).
Members read and write the plan's own buffers: no copies; serial and streams clusters run the
unpacked plan's kernels, only side by side.

``pack_layout(plan)`` is the CPU part (which stream each member runs on, where each pack
launches); the runtime reads the plan's packs by their attributes and does not import the
planner.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunedb.graph.ops import canonical_attrs
from tunedb.kernels.packing import Member
from tunedb.kernels.packing_inplace import inplace_ok, inplace_plan
from tunedb.runtime.blas import DATA_TYPES, OP_N, OP_T, check, library
from tunedb.runtime.device import import_cupy
from tunedb.runtime.executor import ExecutorError, executor_for
from tunedb.runtime.lanes import LaneExecutor
from tunedb.runtime.pack_inplace import build_inplace
from tunedb.runtime.streams import record_forked

RUNNABLE = ("serial", "streams", "grouped", "splitk", "chunks")


def _lpt(members: list[int], cost: Mapping[int, float], k: int) -> list[list[int]]:
    """Longest first onto the least loaded of ``k`` branches; each branch in plan order."""
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k
    for i in sorted(members, key=lambda i: (-cost[i], i)):
        j = load.index(min(load))
        bins[j].append(i)
        load[j] += cost[i]
    return [sorted(b) for b in bins if b]


def pack_layout(plan: Any) -> tuple[dict[int, int], dict[int, int], list[list[tuple[str, list[list[int]]]]]]:
    """``lane`` (pack member step -> 0 for the executor's stream, ``i + 1`` for pool stream ``i``),
    ``last`` (the last step of each pack -> pack index: the pack launches when it is built) and
    per pack its clusters in order as ``(backend, branches of step indices)``."""
    lane: dict[int, int] = {}
    last: dict[int, int] = {}
    layout = []
    for p, pack in enumerate(plan.packs):
        cost = {i: max(float(plan.steps[i].predicted_us), 1e-3) for i in pack.steps}
        segs = []
        for cl in pack.clusters:
            if cl.backend not in RUNNABLE:
                raise ExecutorError(f"pack {p}: backend {cl.backend!r} does not run inside a plan")
            members = sorted(cl.members)
            forked = cl.backend == "streams"
            branches = _lpt(members, cost, max(1, cl.streams)) if forked else [members]
            for b, part in enumerate(branches):
                for i in part:
                    lane[i] = b + 1 if forked else 0
            segs.append((cl.backend, branches))
        last[max(pack.steps)] = p
        layout.append(segs)
    return lane, last, layout


def _gemm_problem(graph: Any, step: Any, env: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """``(x, weight, out, m, n, k, batch, weight_transposed, dtype)`` of a step that is one plain
    GEMM (matmul with a 2-D weight or an equal batch; gemm without C, trans_a or alpha) over
    C-contiguous arrays, else None."""
    node = graph.nodes[step.nodes[0]]
    types = graph.type_map
    dtype = types[node.outputs[0]].dtype
    if dtype not in DATA_TYPES or node.op not in ("matmul", "gemm") or len(node.inputs) != 2:
        return None
    x, wt, out = env[node.inputs[0]], env[node.inputs[1]], env[node.outputs[0]]
    if not all(a.flags.c_contiguous and a.dtype == x.dtype for a in (x, wt, out)):
        return None
    xs, ws = types[node.inputs[0]].shape, types[node.inputs[1]].shape
    if node.op == "gemm":
        attrs = canonical_attrs(node, [types[v] for v in node.inputs])
        if attrs["trans_a"] or attrs["alpha"] != 1.0:
            return None
        nt = bool(attrs["trans_b"])
        return x, wt, out, xs[0], ws[0] if nt else ws[1], xs[1], 1, nt, dtype
    if len(xs) < 2 or len(ws) < 2:
        return None
    if len(ws) == 2:
        return x, wt, out, math.prod(xs[:-1]), ws[1], ws[0], 1, False, dtype
    if xs[:-2] != ws[:-2]:
        return None
    return x, wt, out, xs[-2], ws[-1], xs[-1], math.prod(xs[:-2]), False, dtype


class PackExecutor(LaneExecutor):
    """See the module docstring. ``packs`` (packs launched) and ``pack_streams`` (streams in use
    at most) are added to ``summary()``."""

    def __init__(self, plan: Any, *, capture: bool = True, verify_capture: bool = True,
                 sm_count: int | None = None) -> None:
        if getattr(plan, "stages", ()):
            raise ExecutorError("a plan with IOS stages runs with tunedb.runtime.stage_exec")
        self._pk_lane, self._pk_last, self._pk_layout = pack_layout(plan)
        width = max(self._pk_lane.values(), default=0)
        self._init_lanes(width)
        self._pk_fns: dict[int, list[Any]] = {}
        self._pk_grouped: dict[tuple[int, int], Any] = {}
        self._pk_params = {(p, c): (cl.backend, cl.split, cl.rows) for p, pack in enumerate(plan.packs)
                           for c, cl in enumerate(pack.clusters)}
        self._pk_keep: list[Any] = []
        super().__init__(plan, capture=capture, verify_capture=verify_capture, sm_count=sm_count)

    # -- building: members with the cuBLAS handle and scratch of their lane -----------------------
    def _build(self, k: int, step: Any) -> None:
        if k not in self._pk_lane:
            super()._build(k, step)
            return
        self._pk_fns[k] = self._build_on_lane(self._pk_lane[k], k, step, take=True)
        if k in self._pk_last:  # every member is built: the pack launches here, in plan order
            p = self._pk_last[k]
            self._launch_fns.append(lambda p=p: self._enqueue_pack(p))

    # -- launching -------------------------------------------------------------------------------
    def _run_steps(self, steps: list[int]) -> None:
        for k in steps:
            for fn in self._pk_fns[k]:
                fn()

    def _enqueue_pack(self, p: int) -> None:
        """The pack's clusters in order on the current (the executor's) stream; a streams
        cluster forks its branches onto the pool's streams and joins them back; a grouped
        cluster is one cuBLAS grouped call over the members' own buffers."""
        for c, (backend, branches) in enumerate(self._pk_layout[p]):
            if backend in ("grouped", "splitk", "chunks"):
                self._grouped(p, c, branches[0])()
            elif backend == "serial":
                self._run_steps(branches[0])
            else:
                record_forked(self.stream, [lambda i, part=part: self._run_steps(part) for part in branches],
                              self._lane_pool)

    def _grouped(self, p: int, c: int, steps: list[int]) -> Any:
        """The launch of a grouped cluster, made on first use (the first, eager run): one
        ``cublasGemmGroupedBatchedEx`` reading and writing the plan's arrays in place, members
        of one shape in one group (``splitk``/``chunks``: one pointer-array batched GEMM, made
        the same way). Members that are not plain row-major GEMMs over contiguous arrays, or
        whose shapes do not split in place, run one after another instead (a fallback, reported)."""
        key = (p, c)
        fn = self._pk_grouped.get(key)
        if fn is None:
            problems = [_gemm_problem(self.graph, self.plan.steps[k], self.env) for k in steps]
            backend, split, rows = self._pk_params[key]
            members = [None if x is None else Member(x[3], x[4], x[5], x[6], x[8], "nt" if x[7] else "nn")
                       for x in problems]
            if any(x is None for x in members) or (backend != "grouped" and not inplace_ok(
                    members, backend, split, rows)) or (
                    backend == "grouped" and not hasattr(library(), "cublasGemmGroupedBatchedEx")):
                self.fallbacks.append(f"pack {p}: {backend} cluster ran one member after another "
                                      "(an operand is not a contiguous row-major GEMM operand, the "
                                      "shapes do not split in place, or this cuBLAS has no grouped GEMM)")
                fn = lambda: self._run_steps(steps)  # noqa: E731
            elif backend != "grouped":
                fn, keep = build_inplace(self.cp, self.blas, inplace_plan(members, backend, split, rows),
                                         [x[:3] for x in problems], problems[0][8])
                self._pk_keep.append(keep)
            else:
                fn = self._grouped_call(problems)
            self._pk_grouped[key] = fn
        return fn

    def _grouped_call(self, problems: list[tuple[Any, ...]]) -> Any:
        # cuBLAS is column-major: out^T = w^T x^T, so A is the weight, B the input (as pack.py).
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        for x, wt, out, m, n, k, batch, nt, _ in problems:
            isz = x.dtype.itemsize
            gkey = (OP_T if nt else OP_N, n, m, k, k if nt else n)
            groups.setdefault(gkey, []).extend(
                (wt.data.ptr + b * n * k * isz, x.data.ptr + b * m * k * isz, out.data.ptr + b * m * n * isz)
                for b in range(batch))
        keys = sorted(groups)
        G = len(keys)
        ints = ctypes.c_int * G
        ta, tb = ints(*(g[0] for g in keys)), ints(*([OP_N] * G))
        m_, n_, k_ = ints(*(g[1] for g in keys)), ints(*(g[2] for g in keys)), ints(*(g[3] for g in keys))
        lda, ldb, ldc = ints(*(g[4] for g in keys)), ints(*(g[3] for g in keys)), ints(*(g[1] for g in keys))
        sizes = ints(*(len(groups[g]) for g in keys))
        alpha, beta = (ctypes.c_float * G)(*([1.0] * G)), (ctypes.c_float * G)(*([0.0] * G))
        ptrs = [q for g in keys for q in groups[g]]
        table = self.cp.asarray(np.array(ptrs, dtype=np.uint64).T.copy())
        t = DATA_TYPES[problems[0][-1]]
        lib, blas = library(), self.blas
        args = (blas.handle, ta, tb, m_, n_, k_, alpha, table[0].data.ptr, t, lda, table[1].data.ptr, t,
                ldb, beta, table[2].data.ptr, t, ldc, G, sizes, blas.compute)
        self._pk_keep.append((table, args))
        what = f"cublasGemmGroupedBatchedEx ({len(ptrs)} problems, {G} groups)"
        return lambda: check(lib.cublasGemmGroupedBatchedEx(*args), what)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["packs"] = len(self._pk_layout)
        out["pack_streams"] = max(self._pk_lane.values(), default=0)
        return out


# -- Plan.run(backend="cuda") for plans with packs -----------------------------------------------
def execute_plan(plan: Any, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Run a plan with packs on ``inputs`` on the GPU; NumPy outputs (executors cached by plan
    identity through ``executor.executor_for``)."""
    cp = import_cupy()
    return {k: cp.asnumpy(v) for k, v in executor_for(plan, PackExecutor).run(inputs).items()}
