"""Packing backends on the GPU: a ``PackedRun`` launches one candidate of a packing workload.

Every candidate replays as ONE CUDA graph on its own main stream: clusters one after another,
each by its backend (``tunedb.kernels.packing``): ``serial`` GEMMs on the main stream's cuBLAS
handle; ``streams`` forked onto a ``StreamPool`` and joined back; ``padded`` one strided-batched
GEMM over zero-padded stacks; ``pointer`` one ``cublasGemmBatchedEx`` over per-problem buffers
padded to the cluster's shape; ``grouped`` one ``cublasGemmGroupedBatchedEx`` (equal shapes form
a group; no padding). Operands are placed as the backend needs them before timing (the stack of
a padded cluster is where its producers would write), so layout copies are not in the time.

Inputs come from ``make_inputs`` (NumPy, quantised to the member dtype first, so the float64
reference sees exactly the values the GPU does); ``check`` compares a run with that reference.
CuPy is passed in by the caller; this module imports without it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunedb.kernels.packing import (
    Candidate,
    Member,
    PackingWorkload,
    candidate_waste,
    candidates,
    chunk_candidates,
    padded_shape,
    splitk_candidates,
)
from tunedb.runtime.blas import DATA_TYPES, GEMM_DEFAULT, OP_N, OP_T, Blas, BlasError, check, library
from tunedb.runtime.device import current_stream
from tunedb.runtime.pack_chunks import build_chunks, chunk_plan, member_outputs
from tunedb.runtime.pack_splitk import build_splitk
from tunedb.runtime.streams import StreamPool, gc_paused, record_forked
from tunedb.runtime.tolerance import dtype_tolerance, element_bounds, element_errors


# -- host data -------------------------------------------------------------------------------------
def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` in the bits the GPU stores for ``dtype`` (bfloat16 as uint16)."""
    if dtype == "bfloat16":
        return bf16_bits(a)
    return a.astype(np.float16 if dtype == "float16" else np.float32)


def values(s: Any, dtype: str) -> Any:
    """Stored bits as float64 (NumPy or CuPy arrays alike)."""
    if dtype == "bfloat16":
        return (s.astype("uint32") << 16).view("float32").astype("float64")
    return s.astype("float64")


def make_inputs(w: PackingWorkload, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per member ``(x, weight)`` in storage form: ``x`` ``[batch, m, k]``, weight ``[batch, k, n]``
    (layout nn) or ``[batch, n, k]`` (nt); members with one weight tag get the same array."""
    rng = np.random.default_rng(seed)
    shared: dict[str, np.ndarray] = {}
    out = []
    for mb in w.members:
        x = storage(rng.uniform(-1, 1, (mb.batch, mb.m, mb.k)).astype(np.float32), mb.dtype)
        wshape = (mb.batch, mb.k, mb.n) if mb.layout == "nn" else (mb.batch, mb.n, mb.k)
        wt = shared.get(mb.weight) if mb.weight else None
        if wt is None:
            wt = storage(rng.uniform(-1, 1, wshape).astype(np.float32), mb.dtype)
            if mb.weight:
                shared[mb.weight] = wt
        out.append((x, wt))
    return out


def reference(w: PackingWorkload, inputs: Sequence[tuple[Any, Any]]) -> list[Any]:
    """float64 ``x @ w`` per member, ``[batch, m, n]``, on the inputs' side (NumPy or CuPy: a
    float64 GEMM on the GPU is exact enough and much faster for big suites)."""
    refs = []
    for mb, (x, wt) in zip(w.members, inputs):
        wv = values(wt, mb.dtype)
        refs.append(values(x, mb.dtype) @ (wv if mb.layout == "nn" else wv.transpose(0, 2, 1)))
    return refs


def member_tolerance(mb: Member) -> Any:
    """The shared table's tolerance for one member (``tunedb.runtime.tolerance``): its dtype,
    widened for the ``k`` terms each output element accumulates."""
    return dtype_tolerance(mb.dtype, terms=mb.k)


def worst_error(w: PackingWorkload, got: Sequence[Any], refs: Sequence[Any]) -> float:
    """Worst member error over its bound (<= 1 passes; the rule of ``tunedb.runtime.tolerance``:
    ``|out - ref| <= atol * RMS(ref) + rtol * |ref|``); ``got`` and ``refs`` both NumPy or both
    CuPy float64 arrays. On the GPU one synchronisation for all members, not two per member."""
    if not got:
        return 0.0
    xp = np if isinstance(refs[0], np.ndarray) else __import__("cupy")
    ratios = []
    for mb, g, r in zip(w.members, got, refs):
        tol = member_tolerance(mb)
        finite = xp.where(xp.isfinite(r), r, 0.0)
        scale = xp.sqrt(xp.mean(finite * finite))
        scale = xp.where(scale > 0, scale, 1.0)
        err = element_errors(xp, g, r)
        bound = element_bounds(xp, r, tol.atol * scale, tol.rtol)
        ratios.append(xp.max(xp.where(err == 0.0, 0.0, err / bound)))
    worst = float(xp.max(xp.stack(ratios)))
    return worst if np.isfinite(worst) else float("inf")


# -- the run ---------------------------------------------------------------------------------------
def _lpt(members: Sequence[int], cost: Callable[[int], float], k: int) -> list[list[int]]:
    """Longest processing time first: members over ``k`` branches, balancing ``cost``."""
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k
    for i in sorted(members, key=lambda i: (-cost(i), i)):
        j = load.index(min(load))
        bins[j].append(i)
        load[j] += cost(i)
    return [b for b in bins if b]


class PackedRun:
    """Device buffers and launches of one candidate; ``run()`` enqueues it on ``main`` eagerly,
    ``capture()`` records it as one graph, ``outputs()`` reads every member back as float64."""

    def __init__(self, cp: Any, w: PackingWorkload, cand: Candidate,
                 inputs: Sequence[tuple[np.ndarray, np.ndarray]], pool: StreamPool) -> None:
        self.cp, self.w, self.cand, self.pool = cp, w, cand, pool
        self.main = cp.cuda.Stream(non_blocking=True)
        self.blas = Blas(cp, self.main, tf32=pool.tf32)
        self.keep: list[Any] = []
        self.outs: list[Any] = []
        self.readers: dict[int, Callable[[], np.ndarray]] = {}
        self.steps: list[Callable[[], None]] = []
        self.graph: Any = None
        self.launches = 0
        self._bb = self.blas
        with current_stream(cp, self.main):
            if cand.concurrent > 1:
                self._build_concurrent(inputs)
            else:
                for cl in cand.clusters:
                    self.steps.append(self._build(cl, inputs, self.blas))
            self.main.synchronize()
        self.dtype = w.members[0].dtype

    def _build(self, cl: Any, inputs: Any, blas: Blas) -> Callable[[], None]:
        self._bb = blas  # the handle (and so the stream) this cluster's calls go to
        if cl.backend == "splitk":
            return self._build_splitk(list(cl.members), inputs, cl.split)
        if cl.backend == "chunks":
            return self._build_chunks(list(cl.members), inputs, cl.rows, cl.split)
        return getattr(self, f"_build_{cl.backend}")(list(cl.members), inputs, cl.streams)

    def _build_chunks(self, members: list[int], inputs: Any, rows: int, split: int
                      ) -> Callable[[], None]:
        ms = [self.w.members[i] for i in members]
        step, O, keep = build_chunks(self.cp, self._bb, ms, [inputs[i] for i in members], rows, split)
        pl = chunk_plan(ms, rows, split)
        for i, view in zip(members, member_outputs(O, ms, pl)):
            self.readers[i] = lambda view=view: view
        self.keep += keep
        self.outs.append(O)
        self.launches += 2 if split > 1 else 1
        return step

    def _build_splitk(self, members: list[int], inputs: Any, split: int) -> Callable[[], None]:
        ms = [self.w.members[i] for i in members]
        step, O, keep = build_splitk(self.cp, self._bb, ms, [inputs[i] for i in members], split)
        p = 0
        for i, mb in zip(members, ms):
            self.readers[i] = lambda p=p, mb=mb: O[p:p + mb.batch, :mb.m, :mb.n]
            p += mb.batch
        self.keep += keep
        self.outs.append(O)
        self.launches += 2
        return step

    def _build_concurrent(self, inputs: Any) -> None:
        """Clusters spread over ``concurrent`` forked streams (largest first), joined at the end."""
        clusters = self.cand.clusters
        if any(c.backend == "streams" for c in clusters):
            raise ValueError("a streams cluster inside concurrent clusters")
        flops = [sum(self.w.members[i].flops for i in c.members) for c in clusters]
        parts = _lpt(range(len(clusters)), lambda j: float(flops[j]), self.cand.concurrent)
        branches = [[self._build(clusters[j], inputs, self.pool.blas(b)) for j in part]
                    for b, part in enumerate(parts)]

        def step() -> None:
            record_forked(self.main, [lambda b, st=st: [s() for s in st] for st in branches], self.pool)
        self.steps.append(step)

    # Each builder returns one step enqueuing its cluster on ``self._bb``'s stream.
    def _own(self, i: int, inputs: Sequence[tuple[np.ndarray, np.ndarray]],
             shared: dict[str, Any]) -> tuple[Any, Any, Any]:
        cp, mb = self.cp, self.w.members[i]
        x = cp.asarray(inputs[i][0])
        if mb.weight and mb.weight in shared:
            wt = shared[mb.weight]
        else:
            wt = cp.asarray(inputs[i][1])
            if mb.weight:
                shared[mb.weight] = wt
        out = cp.zeros((mb.batch, mb.m, mb.n), dtype=x.dtype)
        self.readers[i] = lambda o=out: o
        self.keep += [x, wt, out]
        self.outs.append(out)
        return x, (wt if mb.layout == "nn" else wt.swapaxes(-1, -2)), out

    def _build_serial(self, members: list[int], inputs: Any, _k: int, blas: Blas | None = None,
                      shared: dict | None = None) -> Callable[[], None]:
        blas = blas or self._bb
        shared = {} if shared is None else shared
        runs = []
        for i in members:
            x, wv, out = self._own(i, inputs, shared)
            runs.append(blas.gemm(x, wv, out, dtype=self.w.members[i].dtype))
        self.launches += len(runs)

        def step() -> None:
            for r in runs:
                r()
        return step

    def _build_streams(self, members: list[int], inputs: Any, k: int) -> Callable[[], None]:
        shared: dict = {}
        parts = _lpt(members, lambda i: float(self.w.members[i].flops), k)
        branches = [self._build_serial(p, inputs, 1, self.pool.blas(j), shared)
                    for j, p in enumerate(parts)]

        def step() -> None:
            record_forked(self.main, [lambda j, b=b: b() for b in branches], self.pool)
        return step

    def _build_padded_t(self, members: list[int], inputs: Any, k: int) -> Callable[[], None]:
        return self._build_padded(members, inputs, k, flip=True)

    def _build_padded(self, members: list[int], inputs: Any, _k: int, flip: bool = False
                      ) -> Callable[[], None]:
        """``flip``: the weight stack in the other layout than the members' (``padded_t``)."""
        cp = self.cp
        ms = [self.w.members[i] for i in members]
        M, N, K = padded_shape(ms)
        P = sum(m.batch for m in ms)
        st = inputs[members[0]][0].dtype
        given_nt = ms[0].layout == "nt"
        nt = given_nt != flip
        X = cp.zeros((P, M, K), dtype=st)
        W = cp.zeros((P, N, K) if nt else (P, K, N), dtype=st)
        O = cp.zeros((P, M, N), dtype=st)
        p = 0
        for i, mb in zip(members, ms):
            x, wt = inputs[i]
            b = mb.batch
            X[p:p + b, :mb.m, :mb.k] = cp.asarray(x)
            wv = cp.asarray(wt)
            if flip:
                wv = wv.swapaxes(-1, -2)
            if nt:
                W[p:p + b, :mb.n, :mb.k] = wv
            else:
                W[p:p + b, :mb.k, :mb.n] = wv
            self.readers[i] = lambda p=p, mb=mb: O[p:p + mb.batch, :mb.m, :mb.n]
            p += b
        self.keep += [X, W, O]
        self.outs.append(O)
        self.launches += 1
        return self._bb.gemm(X, W.swapaxes(-1, -2) if nt else W, O, dtype=ms[0].dtype)

    def _build_concat(self, members: list[int], inputs: Any, _k: int) -> Callable[[], None]:
        cp = self.cp
        ms = [self.w.members[i] for i in members]
        nt = ms[0].layout == "nt"
        K, SM, SN = ms[0].k, sum(m.m for m in ms), sum(m.n for m in ms)
        st = inputs[members[0]][0].dtype
        X = cp.empty((SM, K), dtype=st)
        W = cp.empty((SN, K) if nt else (K, SN), dtype=st)
        O = cp.zeros((SM, SN), dtype=st)
        r = c = 0
        for i, mb in zip(members, ms):
            x, wt = inputs[i]
            X[r:r + mb.m] = cp.asarray(x)[0]
            if nt:
                W[c:c + mb.n] = cp.asarray(wt)[0]
            else:
                W[:, c:c + mb.n] = cp.asarray(wt)[0]
            self.readers[i] = lambda r=r, c=c, mb=mb: O[r:r + mb.m, c:c + mb.n][None]
            r, c = r + mb.m, c + mb.n
        self.keep += [X, W, O]
        self.outs.append(O)
        self.launches += 1
        return self._bb.gemm(X, W.T if nt else W, O, dtype=ms[0].dtype)

    def _problem_ptrs(self, i: int, x: Any, wt: Any, out: Any, b: int) -> tuple[int, int, int]:
        isz = x.dtype.itemsize
        return (wt.data.ptr + b * wt.shape[-1] * wt.shape[-2] * isz,
                x.data.ptr + b * x.shape[-1] * x.shape[-2] * isz,
                out.data.ptr + b * out.shape[-1] * out.shape[-2] * isz)

    def _build_pointer(self, members: list[int], inputs: Any, _k: int) -> Callable[[], None]:
        cp = self.cp
        ms = [self.w.members[i] for i in members]
        M, N, K = padded_shape(ms)
        nt = ms[0].layout == "nt"
        st = inputs[members[0]][0].dtype
        shared: dict[str, Any] = {}
        ptrs = []
        for i, mb in zip(members, ms):
            x, wt = inputs[i]
            X = cp.zeros((mb.batch, M, K), dtype=st)
            X[:, :mb.m, :mb.k] = cp.asarray(x)
            if mb.weight and mb.weight in shared:
                W = shared[mb.weight]
            else:
                W = cp.zeros((mb.batch, N, K) if nt else (mb.batch, K, N), dtype=st)
                if nt:
                    W[:, :mb.n, :mb.k] = cp.asarray(wt)
                else:
                    W[:, :mb.k, :mb.n] = cp.asarray(wt)
                if mb.weight:
                    shared[mb.weight] = W
            O = cp.zeros((mb.batch, M, N), dtype=st)
            self.keep += [X, W, O]
            self.outs.append(O)
            self.readers[i] = lambda O=O, mb=mb: O[:, :mb.m, :mb.n]
            ptrs += [self._problem_ptrs(i, X, W, O, b) for b in range(mb.batch)]
        table = cp.asarray(np.array(ptrs, dtype=np.uint64).T.copy())
        self.keep.append(table)
        lib, t = library(), DATA_TYPES[ms[0].dtype]
        scalars = (ctypes.c_float(1.0), ctypes.c_float(0.0))
        self.keep.append(scalars)
        args = (self._bb.handle, OP_T if nt else OP_N, OP_N, N, M, K, ctypes.addressof(scalars[0]),
                table[0].data.ptr, t, K if nt else N, table[1].data.ptr, t, K,
                ctypes.addressof(scalars[1]), table[2].data.ptr, t, N, len(ptrs), self._bb.compute,
                GEMM_DEFAULT)
        if not hasattr(lib, "cublasGemmBatchedEx"):
            raise BlasError("this cuBLAS has no cublasGemmBatchedEx")
        self.launches += 1
        what = f"cublasGemmBatchedEx ({len(ptrs)} x {M}x{N}x{K})"
        return lambda: check(lib.cublasGemmBatchedEx(*args), what)

    def _build_grouped(self, members: list[int], inputs: Any, _k: int) -> Callable[[], None]:
        lib = library()
        if not hasattr(lib, "cublasGemmGroupedBatchedEx"):
            raise BlasError("this cuBLAS has no cublasGemmGroupedBatchedEx (CUDA >= 12.5)")
        shared: dict[str, Any] = {}
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        for i in members:
            mb: Member = self.w.members[i]
            x, wt, out = self._own(i, inputs, shared)
            wt = wt.swapaxes(-1, -2) if mb.layout == "nt" else wt  # back to the stored array
            key = (OP_T if mb.layout == "nt" else OP_N, mb.n, mb.m, mb.k,
                   mb.k if mb.layout == "nt" else mb.n)
            groups.setdefault(key, []).extend(self._problem_ptrs(i, x, wt, out, b)
                                               for b in range(mb.batch))
        keys = sorted(groups)
        G = len(keys)
        ints = ctypes.c_int * G
        ta, tb = ints(*(k[0] for k in keys)), ints(*([OP_N] * G))
        m_, n_, k_ = ints(*(k[1] for k in keys)), ints(*(k[2] for k in keys)), ints(*(k[3] for k in keys))
        lda, ldb, ldc = ints(*(k[4] for k in keys)), ints(*(k[3] for k in keys)), ints(*(k[1] for k in keys))
        sizes = ints(*(len(groups[k]) for k in keys))
        alpha, beta = (ctypes.c_float * G)(*([1.0] * G)), (ctypes.c_float * G)(*([0.0] * G))
        ptrs = [p for k in keys for p in groups[k]]
        table = self.cp.asarray(np.array(ptrs, dtype=np.uint64).T.copy())
        self.keep += [table, ta, tb, m_, n_, k_, lda, ldb, ldc, sizes, alpha, beta]
        t = DATA_TYPES[self.w.members[members[0]].dtype]
        compute = self._bb.compute
        args = (self._bb.handle, ta, tb, m_, n_, k_, alpha, table[0].data.ptr, t, lda,
                table[1].data.ptr, t, ldb, beta, table[2].data.ptr, t, ldc, G, sizes, compute)
        self.launches += 1
        return lambda: check(lib.cublasGemmGroupedBatchedEx(*args),
                             f"cublasGemmGroupedBatchedEx ({len(ptrs)} problems, {G} groups)")

    # -- running -----------------------------------------------------------------------------------
    def run(self) -> None:
        """Enqueue every cluster on the main stream (eagerly)."""
        with current_stream(self.cp, self.main):
            for s in self.steps:
                s()

    def capture(self) -> Any:
        """The whole candidate as one CUDA graph (kept as ``self.graph``)."""
        cp = self.cp
        graph, err = None, None
        alloc = self.pool.memory_pool.malloc
        with gc_paused(), current_stream(cp, self.main), cp.cuda.using_allocator(alloc):
            self.main.begin_capture()
            try:
                for s in self.steps:
                    s()
            except Exception as e:  # noqa: BLE001 - end the capture, then report
                err = e
            try:
                graph = self.main.end_capture()
            except Exception as e:  # noqa: BLE001
                err = err or e
        if err is not None:
            raise err
        self.graph = graph
        return graph

    def replay(self) -> None:
        self.graph.launch(self.main)

    def clear_outputs(self) -> None:
        """Zero every output (a replay that writes nothing must then fail the check)."""
        with current_stream(self.cp, self.main):
            for o in self.outs:
                o.fill(0)
        self.main.synchronize()

    def outputs(self, on_device: bool = False) -> list[Any]:
        """Every member's output as float64: NumPy arrays, or CuPy arrays with ``on_device``."""
        self.main.synchronize()
        out = []
        for i, mb in enumerate(self.w.members):
            o = self.readers[i]()
            out.append(values(o if on_device else self.cp.asnumpy(o), mb.dtype))
        return out


def time_stream(cp: Any, launch: Callable[[], None], stream: Any, *, reps: int = 20,
                samples: int = 15, warmup: int = 3) -> list[float]:
    """Microseconds per ``launch()`` on ``stream``: ``samples`` event-timed loops of ``reps``."""
    with current_stream(cp, stream):
        for _ in range(warmup):
            launch()
        stream.synchronize()
        out = []
        for _ in range(samples):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            for _ in range(reps):
                launch()
            b.record(stream)
            b.synchronize()
            out.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / reps)
    return out


# -- measuring ---------------------------------------------------------------------------------------
def sample_stats(ts: Sequence[float]) -> dict[str, Any]:
    q = np.quantile(np.asarray(ts), [0.2, 0.5, 0.8])
    return {"p20_us": float(q[0]), "median_us": float(q[1]), "p80_us": float(q[2]),
            "samples_us": [round(float(t), 3) for t in ts]}


def measure_row(system: str, variant: str, verify: Callable[[], float], launch: Callable[[], None],
                timer: Callable[[Callable[[], None]], list[float]], *,
                log: Callable[[str], None] = print, **extra: Any) -> dict[str, Any]:
    """Check first (``verify`` returns the worst error over its tolerance), time only if it
    passed; a failure of any step is the row's status and one-line message."""
    row: dict[str, Any] = {"system": system, "variant": variant, **extra}
    try:
        err = verify()
        row["error"] = err
        if not err <= 1.0:
            row["status"] = "incorrect"
        else:
            row.update(sample_stats(timer(launch)), status="ok")
    except Exception as e:  # noqa: BLE001 - one failed variant is a row, not a failed run
        row.update(status="error", message=f"{type(e).__name__}: {e}".splitlines()[0][:300])
    log(f"  {system:7s} {variant:28s} {row.get('median_us', float('nan')):10.1f} us  {row['status']}")
    return row


def measure_candidate(cp: Any, w: PackingWorkload, cand: Candidate, inputs: Sequence[tuple[Any, Any]],
                      refs: Sequence[Any], pool: StreamPool, *, reps: int, samples: int,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """One candidate of ``w``: built, run eagerly and checked, captured, replayed and checked
    again (outputs zeroed in between), then timed as graph replays. ``inputs``/``refs``: device
    arrays from ``make_inputs`` / ``reference``. A failure is the row's status and message."""
    held: dict[str, PackedRun] = {}

    def verify() -> float:
        run = held["run"] = PackedRun(cp, w, cand, inputs, pool)
        run.run()
        e1 = worst_error(w, run.outputs(on_device=True), refs)
        run.clear_outputs()
        run.capture()
        run.replay()
        return max(e1, worst_error(w, run.outputs(on_device=True), refs))

    row = measure_row("tunedb", cand.name, verify, lambda: held["run"].replay(),
                      lambda f: time_stream(cp, f, held["run"].main, reps=reps, samples=samples),
                      log=log, waste=candidate_waste(w, cand), candidate=cand.to_json())
    if "run" in held:
        row["launches"] = held["run"].launches
    held.clear()
    return row


def measure_candidates(cp: Any, w: PackingWorkload, inputs: Sequence[tuple[Any, Any]], refs: Sequence[Any],
                       pool: StreamPool, *, reps: int, samples: int,
                       log: Callable[[str], None] = print, extra: bool = False
                       ) -> list[dict[str, Any]]:
    """``measure_candidate`` for every candidate of ``w`` (and, with ``extra``, its split-K and
    chunked ones, which the cost model has no features for)."""
    cands = candidates(w) + (splitk_candidates(w) + chunk_candidates(w) if extra else [])
    return [measure_candidate(cp, w, cand, inputs, refs, pool, reps=reps, samples=samples, log=log)
            for cand in cands]
