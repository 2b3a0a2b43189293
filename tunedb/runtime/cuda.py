"""``CudaDevice``: the measuring side of a collection on a real GPU.

One crash-isolated worker process owns the GPU (only one process times, so samples never contend);
a process pool compiles candidate sources in parallel ahead of it (NVRTC through CuPy, which leaves
the cubins in CuPy's on-disk kernel cache, so the worker's own compile is a cache hit). The parent
process never imports CuPy. Candidates go to the worker in per-workload chunks.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict
from typing import Any

from tunedb.records import DeviceInfo, Protocol, Workload
from tunedb.runtime.device import clocks
from tunedb.runtime.inputs import prepare_workload
from tunedb.runtime.measure import precompile
from tunedb.runtime.results import MeasureRequest, MeasureResult
from tunedb.runtime.worker import start_gpu_worker

MEASURE_TASK = "tunedb.runtime.measure:gpu_task"
MEASURE_INIT = "tunedb.runtime.measure:gpu_init"


def _scalar_arg(a: Any) -> dict:
    """A kernel's scalar argument as ``{"type", "value"}`` (ints default to int32, floats to float32)."""
    if isinstance(a, dict):
        return {"type": str(a.get("type", "int32")), "value": a["value"]}
    if isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], str):
        ctype = a[0].replace("_t", "").strip()  # int32_t -> int32
        ctype = {"int": "int32", "float": "float32", "double": "float64", "long long": "int64",
                 "unsigned": "uint32", "size": "uint64"}.get(ctype, ctype)
        return {"type": ctype, "value": a[1]}
    if isinstance(a, bool):
        return {"type": "int32", "value": int(a)}
    if isinstance(a, int):
        return {"type": "int32" if -(2**31) <= a < 2**31 else "int64", "value": a}
    if isinstance(a, float):
        return {"type": "float32", "value": a}
    # NumPy scalars
    dtype = getattr(a, "dtype", None)
    if dtype is not None:
        return {"type": str(dtype), "value": a.item()}
    raise TypeError(f"unsupported kernel argument {a!r}")


_C_SCALARS = {"int": "int32", "int32_t": "int32", "unsigned": "uint32", "unsigned int": "uint32",
              "uint32_t": "uint32", "long long": "int64", "long long int": "int64", "int64_t": "int64",
              "long": "int64", "unsigned long long": "uint64", "uint64_t": "uint64", "size_t": "uint64",
              "float": "float32", "double": "float64", "bool": "bool"}


def param_types(source: str, name: str) -> list[str] | None:
    """C types of the parameters of kernel ``name`` in ``source`` ('*' for pointers), or None.
    Scalars are passed with exactly these widths: an int where the kernel takes a long long
    would hand it garbage upper bits."""
    m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?" + re.escape(name)
                  + r"\s*\(([^)]*)\)", source)
    if m is None:
        return None
    out = []
    for p in m.group(1).split(","):
        p = " ".join(p.replace("__restrict__", " ").replace("const ", " ").split())
        if not p:
            continue
        if "*" in p:
            out.append("*")
            continue
        out.append(_C_SCALARS.get(" ".join(p.split()[:-1]), "?"))
    return out


def _typed(arg: dict, ctype: str) -> dict:
    if ctype in ("*", "?", "bool"):
        return arg
    return {"type": ctype, "value": arg["value"]}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def plan_to_wire(plan: Any) -> dict:
    """A ``tunedb.kernels`` KernelPlan as the JSON the worker runs: kernels (name, source, grid,
    block, shared_bytes, args: buffer names as strings, scalars as {type, value}) and scratch."""
    kernels = []
    for k in _get(plan, "kernels", ()):
        args = [a if isinstance(a, str) else _scalar_arg(a) for a in _get(k, "args", ())]
        types = param_types(str(_get(k, "source")), str(_get(k, "name")))
        if types is not None and len(types) == len(args):
            args = [a if isinstance(a, str) else _typed(a, t) for a, t in zip(args, types)]
        grid, block = _get(k, "grid"), _get(k, "block")
        kernels.append({
            "name": str(_get(k, "name")), "source": str(_get(k, "source")),
            "grid": [int(x) for x in (grid if isinstance(grid, (tuple, list)) else (grid,))],
            "block": [int(x) for x in (block if isinstance(block, (tuple, list)) else (block,))],
            "shared_bytes": int(_get(k, "shared_bytes", 0) or 0), "args": args,
        })
        opts = _get(k, "options")
        if opts:
            kernels[-1]["options"] = [str(o) for o in opts]
    scratch = []
    raw = _get(plan, "scratch", ()) or ()
    items = raw.items() if isinstance(raw, dict) else enumerate(raw)
    for key, s in items:
        if isinstance(s, (int,)):
            scratch.append({"name": str(key), "nbytes": int(s), "zero": True})
            continue
        if isinstance(s, (tuple, list)):
            name, nbytes, *rest = s
            zero = bool(rest[0]) if rest else True
            scratch.append({"name": str(name), "nbytes": int(nbytes), "zero": zero})
            continue
        name = _get(s, "name", key)
        nbytes = _get(s, "nbytes", None)
        if nbytes is None:
            nbytes = _get(s, "bytes", 0)
        zero = _get(s, "zero", None)
        if zero is None:
            zero = _get(s, "zero_init", _get(s, "zeroed", True))
        scratch.append({"name": str(name), "nbytes": int(nbytes), "zero": bool(zero)})
    return {"kernels": kernels, "scratch": scratch}


PREP_AHEAD = 4  # workloads whose inputs/references may be prepared ahead (each up to ~1 GB on disk)


def _caller_workload() -> Workload | None:
    """The workload of the collector's current ``job``, read from ``prefetch``'s caller: the
    collector calls ``prefetch(wires)`` without the workload. A fallback only: callers should
    pass ``prefetch(wires, workload=...)``."""
    try:
        job = sys._getframe(2).f_locals.get("job")
    except (ValueError, AttributeError):
        return None
    w = getattr(job, "workload", None)
    return w if isinstance(w, Workload) else None


class CudaDevice:
    """Measures candidates on the local GPU; see the module docstring.

    Two CPU process pools feed the GPU worker: one compiles candidate sources (CuPy's disk
    cache), one prepares each workload's random inputs and float64 reference a few workloads
    ahead (``inputs.prepare_workload``; handed over as ``.npy`` files in a temporary directory),
    so the GPU never waits for NumPy. ``stats()`` says where the wall time went."""

    kind = "cuda"

    def __init__(self, workers: int | None = None, timeout_s: float = 60.0,
                 protocol: Protocol | None = None, prep_workers: int | None = None) -> None:
        self.protocol = protocol or Protocol()
        self.worker, hello = start_gpu_worker(MEASURE_TASK, MEASURE_INIT, timeout_s)
        self.info = DeviceInfo(**hello["device"])
        self.uuid = str(hello.get("uuid", ""))
        self.clocks_at_start = hello.get("clocks", {})
        cpus = os.cpu_count() or 2
        n_prep = (2 if cpus >= 8 else 1) if prep_workers is None else max(0, prep_workers)
        # The worker and the parent (code generation, DB writes) keep a core each.
        n = max(0, cpus - 3) if workers is None else workers
        import multiprocessing as mp

        self._pool: ProcessPoolExecutor | None = None
        if n > 0:
            self._pool = ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn"))
        self._prep_pool: ProcessPoolExecutor | None = None
        if n_prep > 0:
            self._prep_pool = ProcessPoolExecutor(max_workers=n_prep, mp_context=mp.get_context("spawn"))
        self._futures: dict[str, Future] = {}
        self._tmp = tempfile.mkdtemp(prefix="tunedb-prep-")
        self._preps: dict[str, tuple[Future, str]] = {}  # workload hash -> (future, dir)
        self._manifests: dict[str, dict | None] = {}
        self._current = ""
        self._serial = 0
        self._lock = threading.Lock()  # prefetch runs in the collector's producer thread
        self._stats: dict[str, float] = dict.fromkeys(_STAT_KEYS, 0.0)
        self._stats.update(compile_pool=n, prep_pool=n_prep)

    def clocks(self) -> dict[str, float]:
        return clocks(self.uuid)

    @staticmethod
    def _key(request: MeasureRequest) -> str:
        return "\x00".join(k["source"] for k in request.kernels)

    # -- look-ahead: inputs/references and compiles ---------------------------------------
    def prefetch(self, requests: list[MeasureRequest], workload: Workload | None = None) -> None:
        """Start preparing ``workload`` (inputs + reference) and compiling these plans in the
        pools; called a workload ahead of ``measure``."""
        if workload is None:
            workload = _caller_workload()
        if workload is not None:
            self._submit_prep(workload)
        if self._pool is None:
            return

        # One task per candidate (not per workload): NVRTC takes ~0.1 s a kernel, the pool's IPC
        # well under 1 ms, and the first candidates of a workload are ready soonest this way.
        for r in requests:
            key = self._key(r)
            if r.error or not key or key in self._futures:
                continue
            try:
                self._futures[key] = self._pool.submit(precompile, r.kernels)
            except Exception:  # noqa: BLE001 - a broken pool: the worker compiles instead
                self._pool = None
                return

    def _submit_prep(self, workload: Workload) -> None:
        h = workload.hash
        with self._lock:
            if self._prep_pool is None or h in self._preps:
                return
            if h != self._current and sum(k != self._current for k in self._preps) >= PREP_AHEAD:
                return  # far enough ahead; ``measure`` submits it when its turn comes
            self._serial += 1
            out_dir = os.path.join(self._tmp, f"w{self._serial}-{h[:16]}")
            try:
                fut = self._prep_pool.submit(prepare_workload, _graph_json(workload), h, out_dir)
            except Exception:  # noqa: BLE001 - a broken pool: the worker prepares its inputs itself
                self._prep_pool = None
                return
            self._manifests.pop(h, None)
            self._preps[h] = (fut, out_dir)

    def _manifest(self, workload: Workload) -> dict | None:
        h = workload.hash
        if h != self._current:
            with self._lock:
                old = self._preps.pop(self._current, None)
                self._manifests.pop(self._current, None)
                self._current = h
            if old is not None:  # the previous workload is done (a re-visit prepares it again)
                old[0].cancel()
                shutil.rmtree(old[1], ignore_errors=True)
            self._stats["workloads"] += 1
        if h in self._manifests:
            return self._manifests[h]
        self._submit_prep(workload)
        with self._lock:
            entry = self._preps.get(h)
        if entry is None:
            return None
        t0 = time.perf_counter()
        try:
            man = entry[0].result(timeout=3600)
        except Exception:  # noqa: BLE001 - pool crashed: the worker computes them itself
            man = None
        self._stats["prep_wait_s"] += time.perf_counter() - t0
        if man is not None:
            self._stats["prep_s"] += float(man.get("seconds", 0.0))
        self._manifests[h] = man
        return man

    def _ready(self, request: MeasureRequest, wait: bool) -> MeasureRequest | None:
        """The request with its pool compile error, if any; ``None`` if not compiled yet and
        ``wait`` is false."""
        if request.error:
            return request
        key = self._key(request)
        fut = self._futures.get(key)
        if fut is None:
            return request
        if not wait and not fut.done():
            return None
        del self._futures[key]
        t0 = time.perf_counter()
        try:
            res = fut.result(timeout=600)
        except Exception:  # noqa: BLE001 - pool crashed or hung on this one; the worker will tell
            res = {"ok": True}
        self._stats["compile_wait_s"] += time.perf_counter() - t0
        err = "" if res.get("ok") else str(res.get("error", "compile error"))
        return request.failed(err) if err else request

    # -- measuring ----------------------------------------------------------------------------
    def measure(self, workload: Workload, requests: list[MeasureRequest]
                ) -> Iterator[tuple[int, MeasureResult]]:
        """Yield ``(index, result)`` for every request, in order. Candidates go to the worker as
        soon as they are compiled (in runs of ready ones), not a whole chunk at once."""
        t_in = time.perf_counter()
        context = {"workload_hash": workload.hash, "graph": _graph_json(workload),
                   "protocol": asdict(self.protocol)}
        man = self._manifest(workload)
        if man is not None:
            context["prep"] = man
        pos = 0
        try:
            while pos < len(requests):
                batch = [self._ready(requests[pos], wait=True)]
                pos += 1
                while pos < len(requests):
                    item = self._ready(requests[pos], wait=False)
                    if item is None:
                        break
                    batch.append(item)
                    pos += 1
                base = pos - len(batch)
                for i, wire in self.worker.run(context, [r.to_wire() for r in batch]):
                    res = MeasureResult.from_wire(wire)
                    self._account(res)
                    t_out = time.perf_counter()
                    self._stats["measure_s"] += t_out - t_in
                    t_in = t_out
                    yield base + i, res
                    t_in = time.perf_counter()
                    self._stats["outside_s"] += t_in - t_out
        finally:
            self._stats["measure_s"] += time.perf_counter() - t_in

    def _account(self, res: MeasureResult) -> None:
        st = self._stats
        st["candidates"] += 1
        st[f"status_{res.status}"] = st.get(f"status_{res.status}", 0) + 1
        ph = res.phases
        for src, dst in (("setup_s", "worker_setup_s"), ("compile_s", "worker_compile_s"),
                         ("verify_s", "verify_s"), ("time_s", "timing_s")):
            v = ph.get(src)
            if isinstance(v, (int, float)):
                st[dst] += float(v)
        if ph.get("setup_local"):
            st["setup_local"] += 1

    def stats(self) -> dict:
        """Where the wall time went, in seconds (and counts): ``prep_wait_s`` / ``compile_wait_s``
        (``measure`` waited on the pools), ``worker_setup_s`` (loading a workload onto the GPU),
        ``worker_compile_s`` (module load; a compile on a cache miss), ``verify_s``, ``timing_s``,
        ``other_s`` (IPC, restarts, timeouts), ``outside_s`` (the caller between results: DB
        writes, strategy), ``prep_s`` (CPU seconds the prep pool spent), ``rate_per_s``."""
        counts = ("candidates", "workloads", "setup_local", "compile_pool", "prep_pool")
        st = {k: (int(v) if k in counts or k.startswith("status_") else round(float(v), 3))
              for k, v in self._stats.items()}
        busy = sum(self._stats[k] for k in ("prep_wait_s", "compile_wait_s", "worker_setup_s",
                                              "worker_compile_s", "verify_s", "timing_s"))
        st["other_s"] = round(max(0.0, self._stats["measure_s"] - busy), 3)
        wall = self._stats["measure_s"] + self._stats["outside_s"]
        st["rate_per_s"] = round(self._stats["candidates"] / wall, 2) if wall > 0 else 0.0
        st["restarts"] = self.worker.restarts
        return st

    def close(self) -> None:
        self.worker.close()
        for pool in (self._pool, self._prep_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for f in self._futures.values():
            f.cancel()
        self._pool = self._prep_pool = None
        self._futures, self._preps = {}, {}
        shutil.rmtree(self._tmp, ignore_errors=True)


_STAT_KEYS = ("candidates", "workloads", "measure_s", "outside_s", "prep_wait_s", "prep_s",
              "compile_wait_s", "worker_setup_s", "worker_compile_s", "verify_s", "timing_s",
              "setup_local")


def _graph_json(workload: Workload) -> dict:
    import json

    return json.loads(workload.graph_json)
