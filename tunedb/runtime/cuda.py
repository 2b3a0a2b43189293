"""``CudaDevice``: the measuring side of a collection on a real GPU.

One crash-isolated worker process owns the GPU (only one process times, so samples never contend);
a process pool compiles candidate sources in parallel ahead of it (NVRTC through CuPy, which leaves
the cubins in CuPy's on-disk kernel cache, so the worker's own compile is a cache hit). The parent
process never imports CuPy. Candidates go to the worker in per-workload chunks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict
from typing import Any

from tunedb.records import DeviceInfo, Protocol, Workload
from tunedb.runtime.device import CUPY_MISSING, NoGPUError, clocks
from tunedb.runtime.worker import Worker, WorkerError

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


class CudaDevice:
    """Measures candidates on the local GPU; see the module docstring."""

    kind = "cuda"

    def __init__(self, workers: int | None = None, timeout_s: float = 60.0,
                 protocol: Protocol | None = None) -> None:
        import importlib.util

        if importlib.util.find_spec("cupy") is None:  # fail fast, before spawning anything
            raise NoGPUError(CUPY_MISSING)
        self.protocol = protocol or Protocol()
        self.worker = Worker(MEASURE_TASK, MEASURE_INIT, timeout_s=timeout_s)
        try:
            hello = self.worker.start()
        except WorkerError as e:
            msg = str(e)
            if "no CUDA device" in msg:
                raise NoGPUError(msg[msg.index("no CUDA device"):]) from None
            raise
        self.info = DeviceInfo(**hello["device"])
        self.uuid = str(hello.get("uuid", ""))
        self.clocks_at_start = hello.get("clocks", {})
        n = (os.cpu_count() or 2) - 2 if workers is None else workers
        self._pool: ProcessPoolExecutor | None = None
        if n > 0:
            import multiprocessing as mp

            self._pool = ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn"))
        self._futures: dict[str, Future] = {}

    def clocks(self) -> dict[str, float]:
        return clocks(self.uuid)

    @staticmethod
    def _key(wire: dict) -> str:
        return "\x00".join(k["source"] for k in wire.get("kernels", ()))

    def prefetch(self, wires: list[dict]) -> None:
        """Start compiling these plans in the pool (called a workload ahead of ``measure``)."""
        if self._pool is None:
            return
        from tunedb.runtime.measure import precompile

        for w in wires:
            key = self._key(w)
            if w.get("error") or not key or key in self._futures:
                continue
            try:
                self._futures[key] = self._pool.submit(precompile, w["kernels"])
            except Exception:  # noqa: BLE001 - a broken pool: the worker compiles instead
                self._pool = None
                return

    def _compile_error(self, wire: dict) -> str:
        fut = self._futures.pop(self._key(wire), None)
        if fut is None:
            return ""
        try:
            res = fut.result(timeout=600)
        except Exception:  # noqa: BLE001 - pool crashed or hung on this one; the worker will tell
            return ""
        return "" if res.get("ok") else str(res.get("error", "compile error"))

    def measure(self, workload: Workload, wires: list[dict]) -> Iterator[tuple[int, dict | None]]:
        """Yield ``(index, result dict)`` for every wire plan, in order."""
        items = []
        for w in wires:
            err = w.get("error") or self._compile_error(w)
            items.append({**w, "error": err} if err else w)
        context = {"workload_hash": workload.hash, "graph": _graph_json(workload),
                   "protocol": asdict(self.protocol)}
        yield from self.worker.run(context, items)

    def close(self) -> None:
        self.worker.close()
        if self._pool is not None:
            for f in self._futures.values():
                f.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _graph_json(workload: Workload) -> dict:
    import json

    return json.loads(workload.graph_json)
