"""The measurement protocol on the GPU (DESIGN.md, "Measurement protocol").

Per workload (once): fresh random inputs, the float64 reference (uploaded as float32), output
buffers. Per candidate: compile (NVRTC through ``cupy.RawModule``; CuPy's on-disk kernel cache makes
a module compiled by the parallel pre-compile pool load instantly here), record registers / shared /
local bytes, poison outputs, launch once, compare on the GPU (wrong -> ``incorrect``, never timed),
then time with CUDA events: warm-up, L2 flush (memset of 2x L2) before every sample, >= 10 samples;
plans of workloads moving fewer than ``SHORT_BYTES`` are timed as a CUDA graph of ``batch``
back-to-back launches (sample >= ``TARGET_US``) divided by ``batch``, every candidate of the
workload alike. All kernels of a plan (and its scratch zeroing) are
inside the events. Every CUDA error becomes a status; a sticky one (illegal address) also asks the
worker to restart, so the next candidate gets a clean context.

CuPy is imported lazily (``gpu_init``): this module imports on machines without it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from tunedb.graph.ir import Graph
from tunedb.records import Protocol
from tunedb.runtime.device import clocks, current_stream, device_info, device_uuid, import_cupy
from tunedb.runtime.inputs import (
    BOOL_POISON,
    load_prepared,
    make_inputs,
    poison_value,
    reference_outputs,
    storage_dtype,
    workload_seed,
)
from tunedb.runtime.launch import NVRTC_OPTIONS, kernel_function, launcher
from tunedb.runtime.tolerance import element_bounds, element_errors, tolerance

SHORT_US = 10.0     # without a workload-level decision: plans faster than this are batched
SHORT_BYTES = 32 << 20  # workloads moving fewer bytes (~8 µs at full bandwidth) are batched
TARGET_US = 50.0    # ... so that one sample lasts at least this long
MAX_BATCH = 256
MODULE_CACHE = 512  # compiled modules kept per worker (LRU)


def _one_line(exc: BaseException, limit: int = 1500) -> str:
    text = " ".join(str(exc).split())
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:limit]


# -- worker entry points ------------------------------------------------------------------------
def gpu_init(state: dict) -> dict:
    """Worker start-up: import CuPy, pick a non-default stream, allocate the L2 flush buffer."""
    cp = import_cupy()
    info = device_info()
    stream = cp.cuda.Stream(non_blocking=True)
    stream.use()  # every CuPy op in this process goes to it (CUDA graphs cannot capture stream 0)
    state.update(cp=cp, stream=stream, modules=OrderedDict(), workload=None, info=info,
                 flush=cp.empty(max(2 * info.l2_bytes, 1 << 20), dtype=cp.uint8))
    uuid = device_uuid()
    return {"device": asdict(info), "clocks": clocks(uuid), "uuid": uuid}


def gpu_task(state: dict, context: dict, items: list) -> Iterator[dict]:
    """Worker task: ``context`` = {workload_hash, graph (JSON), protocol, optional prep (the
    manifest of ``inputs.prepare_workload``: inputs and references computed ahead, off the GPU's
    critical path)}; items = wire plans. Every result carries ``phases`` (seconds spent here)."""
    cp = state["cp"]
    wl = state.get("workload")
    setup_s = 0.0
    if wl is None or wl.hash != context.get("workload_hash"):
        t0 = time.perf_counter()
        if wl is not None:
            wl.free()
            state["workload"] = None
        try:
            prep = context.get("prep") or None
            if prep and prep.get("error"):
                raise RuntimeError(str(prep["error"]))
            wl = WorkloadBuffers(cp, Graph.from_json(context["graph"]), context.get("workload_hash", ""),
                                 prep)
            state["workload"] = wl
        except Exception as e:  # noqa: BLE001 - one failure text for every item of this workload
            restart = not context_ok(cp)
            yield {"_heartbeat": True}
            for _ in items:
                yield {"status": "runtime_error", "error": f"workload setup failed: {_one_line(e)}",
                       "_restart": restart}
                if restart:
                    return
            return
        setup_s = time.perf_counter() - t0
    yield {"_heartbeat": True}
    proto = Protocol(**context.get("protocol", {}))
    for item in items:
        res = measure_item(state, wl, item, proto)
        if setup_s:
            res["phases"]["setup_s"] = setup_s
            res["phases"]["setup_local"] = wl.local_setup
            setup_s = 0.0
        yield res
        if res.get("_restart"):
            return


# -- per-workload buffers -----------------------------------------------------------------------
class WorkloadBuffers:
    """Inputs, float32 references and output buffers of one workload on the GPU."""

    def __init__(self, cp: Any, graph: Any, workload_hash: str, prep: dict | None = None) -> None:
        self.cp, self.graph, self.hash = cp, graph, workload_hash
        dev = refs = None
        if prep and prep.get("dir"):
            try:
                dev, refs = load_prepared(prep)
            except (OSError, ValueError, KeyError):
                dev = refs = None  # files gone (e.g. cleaned up): compute them here instead
        self.local_setup = dev is None
        if dev is None or refs is None:
            dev, ref_in = make_inputs(graph, workload_seed(workload_hash))
            refs = reference_outputs(graph, ref_in)  # once per workload, float64 oracle
            del ref_in
        self.inputs = {k: cp.asarray(v) for k, v in dev.items()}
        self.set_checks(refs)
        # A wrong kernel may scribble over its inputs; restore them before every verify launch so
        # one bad candidate cannot fail (or pass) the next ones.
        self.pristine = {k: v.copy() for k, v in self.inputs.items()}
        self.refs = {k: cp.asarray(v) for k, v in refs.items()}
        self.outputs = {}
        for name in graph.outputs:
            t = graph.type_of(name)
            self.outputs[name] = cp.empty(t.shape, dtype=storage_dtype(t.dtype))

    def set_checks(self, refs: dict) -> None:
        """Per output: (dtype, absolute tolerance, rtol), the absolute one in units of the host
        reference's scale (``tunedb.runtime.tolerance``), computed once per workload."""
        self.checks = {}
        for name in self.graph.outputs:
            dtype = self.graph.type_of(name).dtype
            self.checks[name] = (dtype, *tolerance(self.graph, dtype).bounds(refs[name]))

    def free(self) -> None:
        # Keeps device memory flat across thousands of workloads.
        self.inputs = self.pristine = self.refs = self.outputs = {}
        self.cp.get_default_memory_pool().free_all_blocks()

    def poison(self) -> None:
        for name, buf in self.inputs.items():
            self.cp.copyto(buf, self.pristine[name])
        for name, buf in self.outputs.items():
            dtype = self.checks[name][0]
            if dtype == "bool":
                buf.view(self.cp.uint8).fill(BOOL_POISON)
            else:
                buf.fill(poison_value(dtype))

    def verify(self) -> tuple[bool, float, str]:
        """Compare every output with its reference on the GPU: (ok, max abs error, output name)."""
        cp = self.cp
        worst_err, worst_name, ok = 0.0, "", True
        for name, buf in self.outputs.items():
            dtype, atol, rtol = self.checks[name]
            ref = self.refs[name].reshape(buf.shape)
            if dtype == "bfloat16":
                o = (buf.astype(cp.uint32) << 16).view(cp.float32)
            elif dtype == "bool":
                o = buf.view(cp.uint8).astype(cp.float32)
            else:
                o = buf.astype(cp.float32)
            err = element_errors(cp, o, ref)
            tol = element_bounds(cp, ref, atol, rtol)
            nbad = int((err > tol).sum())
            if nbad:  # the error size only matters for the message: no second sync when ok
                e = float(err.max()) if err.size else 0.0
                if ok or e > worst_err:
                    worst_err, worst_name = e, name
                ok = False
        return ok, worst_err, worst_name


# -- per-candidate ------------------------------------------------------------------------------
def context_ok(cp: Any) -> bool:
    """False after a sticky CUDA error (illegal address...): the context must be recreated."""
    try:
        cp.cuda.runtime.deviceSynchronize()
        cp.zeros(1, dtype=cp.float32).sum().item()
        return True
    except Exception:  # noqa: BLE001
        return False


def _is_compile_error(exc: BaseException) -> bool:
    return type(exc).__name__ in ("CompileException", "NVRTCError")


def _clear_cupy_memo() -> None:
    try:
        import cupy._util

        cupy._util.clear_memo()
    except Exception:  # noqa: BLE001 - only a memory optimisation
        pass


def get_function(state: dict, kernel: dict) -> Any:
    """Compile (or fetch from the LRU / CuPy disk cache) and return the kernel's function."""
    mods: OrderedDict = state["modules"]
    key = (kernel["source"], tuple(kernel.get("options") or NVRTC_OPTIONS))
    if key in mods:
        mods.move_to_end(key)
    elif len(mods) >= MODULE_CACHE:
        # CuPy memoizes every module it loads; drop them all now and then so that device and
        # host memory stay flat over tens of thousands of candidates.
        mods.clear()
        _clear_cupy_memo()
    return kernel_function(state["cp"], mods, kernel)


def build_launch(cp: Any, stream: Any, funcs: list, item: dict, buffers: dict) -> Any:
    """A closure that enqueues the whole plan once on ``stream`` (``launch.launcher``)."""
    zero = [buffers[s["name"]] for s in item.get("scratch", []) if s.get("zero")]
    return launcher(funcs, item["kernels"], buffers, zero, stream)  # never the ambient stream


def _graph_runner(cp: Any, stream: Any, launch: Any, batch: int) -> Any:
    """``batch`` launches captured into one CUDA graph (no Python gaps between small kernels);
    ``None`` if capture is unsupported here (the caller then loops in Python)."""
    try:
        stream.begin_capture()
    except Exception:  # noqa: BLE001
        return None
    graph = None
    try:
        # Kernels that go to the current stream must find the capturing one there: otherwise
        # they run now, outside the capture, and the graph replays nothing (a sub-microsecond
        # "time"). The worker's own stream is current again afterwards (see ``current_stream``).
        with current_stream(cp, stream):
            for _ in range(batch):
                launch()
    finally:
        try:
            graph = stream.end_capture()
        except Exception:  # noqa: BLE001
            graph = None
    if graph is None:
        return None
    return lambda: graph.launch(stream)


def _events(state: dict, n: int) -> list[tuple[Any, Any]]:
    """``n`` reusable (start, end) event pairs of this worker (creating events per sample costs)."""
    cp = state["cp"]
    evs = state.setdefault("events", [])
    while len(evs) < n:
        evs.append((cp.cuda.Event(), cp.cuda.Event()))
    return evs[:n]


def timed_samples(state: dict, run: Any, batch: int, n: int, flush: Any) -> list[float]:
    """``n`` samples of ``run`` (us per launch): every sample is enqueued first (flush, start
    event, run, end event), then one host sync; the GPU never waits for the host in between."""
    cp, stream = state["cp"], state["stream"]
    evs = _events(state, n)
    for start, end in evs:
        if flush is not None:
            # Also hides the host's enqueue latency: the GPU is busy flushing meanwhile.
            flush.data.memset_async(0, flush.nbytes, stream)
        start.record(stream)
        run()
        end.record(stream)
    evs[-1][1].synchronize()
    return [cp.cuda.get_elapsed_time(start, end) * 1000.0 / batch for start, end in evs]


def batched_workload(graph: Any) -> bool:
    """Whether every candidate of ``graph`` is timed in CUDA-graph batches. Decided once per
    workload from the bytes it must move: deciding per candidate from a probe split kernels of
    ~10 µs between L2-cold single launches (>= 10 µs) and L2-warm batches (<= 8 µs), so the
    H200 data has almost no medians between 8 and 10 µs and candidates of one workload were
    compared across two protocols."""
    return graph.floor_bytes() < SHORT_BYTES


def batch_size(probe_us: float, proto: Protocol, batched: bool | None) -> int:
    """Launches per timed sample: ``proto.batch`` when set (> 1); else batches when ``batched``
    (a workload-level decision) or, when that is None, when the probe is under ``SHORT_US``."""
    if proto.batch > 1:
        return proto.batch
    if batched is None:
        batched = probe_us < SHORT_US
    return min(MAX_BATCH, max(2, math.ceil(TARGET_US / max(probe_us, 0.2)))) if batched else 1


def time_plan(state: dict, launch: Any, proto: Protocol, batched: bool | None = None
              ) -> tuple[list[float], Protocol]:
    cp, stream = state["cp"], state["stream"]
    flush = state["flush"] if proto.flush_l2 else None
    for _ in range(max(1, proto.warmup)):
        launch()
    run = launch
    probe = min(timed_samples(state, launch, 1, 3, flush))
    # CUDA-graph batches only for short plans: a capture costs ~ms, a long plan needs none.
    batch = batch_size(probe, proto, batched)
    if batch > 1:
        graph_run = _graph_runner(cp, stream, launch, batch)
        if graph_run is not None:
            run = graph_run
        else:
            def run() -> None:
                for _ in range(batch):
                    launch()
        for _ in range(max(1, proto.warmup)):
            run()
    samples = timed_samples(state, run, batch, max(1, proto.samples), flush)
    return samples, Protocol(proto.warmup, len(samples), proto.flush_l2, batch)


def measure_item(state: dict, wl: WorkloadBuffers, item: dict, proto: Protocol) -> dict:
    """One candidate through the protocol; never raises."""
    cp = state["cp"]
    phases: dict = {}
    res: dict = {"status": "ok", "samples_us": [], "error": "", "registers": -1, "shared_bytes": -1,
                 "local_bytes": -1, "protocol": asdict(proto), "phases": phases}
    if item.get("error"):
        res.update(status="compile_error", error=str(item["error"])[:1500])
        return res
    t0 = time.perf_counter()
    try:
        funcs = [get_function(state, k) for k in item["kernels"]]
        res["registers"] = max(int(f.num_regs) for f in funcs)
        res["shared_bytes"] = max(int(f.shared_size_bytes) + int(k.get("shared_bytes", 0) or 0)
                                  for f, k in zip(funcs, item["kernels"]))
        res["local_bytes"] = max(int(f.local_size_bytes) for f in funcs)
    except Exception as e:  # noqa: BLE001
        status = "compile_error" if _is_compile_error(e) else "runtime_error"
        res.update(status=status, error=_one_line(e))
        if status == "runtime_error" and not context_ok(cp):
            res["_restart"] = True
        return res
    finally:
        phases["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        scratch = {s["name"]: cp.empty(max(1, int(s["nbytes"])), dtype=cp.uint8)
                   for s in item.get("scratch", [])}
        buffers = {**wl.inputs, **wl.outputs, **scratch}
        launch = build_launch(cp, state["stream"], funcs, item, buffers)
        wl.poison()
        launch()
        state["stream"].synchronize()
        ok, err, name = wl.verify()
        t1 = time.perf_counter()
        phases["verify_s"] = t1 - t0
        if not ok:
            res.update(status="incorrect", error=f"max abs error {err:.6g} in output {name!r}")
            return res
        samples, used = time_plan(state, launch, proto, batched_workload(wl.graph))
        phases["time_s"] = time.perf_counter() - t1
        bad = [s for s in samples if not math.isfinite(s) or s <= 0]
        if bad:
            res.update(status="runtime_error", error=f"invalid timing samples {bad[:3]}")
            return res
        res.update(samples_us=samples, protocol=asdict(used))
        return res
    except Exception as e:  # noqa: BLE001 - CUDA errors become statuses
        res.update(status="runtime_error", error=_one_line(e), samples_us=[])
        if not context_ok(cp):
            res["_restart"] = True
        return res


# -- parallel pre-compile (process pool) ---------------------------------------------------------
def precompile(kernels: list[dict]) -> dict:
    """Pool task: compile each kernel source with the same options the worker will use, which
    fills CuPy's on-disk kernel cache; returns ``{"ok": True}`` or ``{"ok": False, "error": log}``."""
    try:
        cp = import_cupy()
        for k in kernels:
            cp.RawModule(code=k["source"], options=tuple(k.get("options") or NVRTC_OPTIONS)).compile()
        _clear_cupy_memo()  # the pool process only fills the disk cache; unload what it loaded
        return {"ok": True}
    except Exception as e:  # noqa: BLE001
        if _is_compile_error(e):
            return {"ok": False, "error": _one_line(e)}
        return {"ok": True, "note": _one_line(e)}  # not a compile error: let the worker decide
