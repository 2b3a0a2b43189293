"""``PackingDevice``: the collection engine's device for packing candidates.

The same protocol as ``CudaDevice`` (``info``, ``protocol``, ``clocks``, ``prefetch``, ``measure``,
``stats``, ``close``), over the same crash-isolated ``Worker`` process: a candidate that kills or
hangs the process becomes a ``runtime_error`` / ``timeout`` row and the worker restarts. In the
worker, a workload's inputs (uniform in [-1, 1), quantised to the member dtype) and float64
reference are made once; each request's candidate is then built, checked eagerly and as a
replayed CUDA graph, and timed (``tunedb.runtime.pack.measure_candidate``): ``protocol.samples``
event-timed loops of ``protocol.batch`` graph replays after ``protocol.warmup``, L2 not flushed.
A candidate that fails to build or capture (unsupported dtype, alignment, out of memory) is a
``runtime_error`` row with its one-line message; a wrong result an ``incorrect`` row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from tunedb.kernels.packing import Candidate, PackingWorkload
from tunedb.records import DeviceInfo, Protocol, Workload
from tunedb.runtime.blas import library
from tunedb.runtime.device import clocks, device_info, device_uuid, import_cupy
from tunedb.runtime.pack import make_inputs, measure_candidate, reference
from tunedb.runtime.results import MeasureRequest, MeasureResult
from tunedb.runtime.streams import StreamPool
from tunedb.runtime.worker import failure, start_gpu_worker

TASK = "tunedb.runtime.pack_device:measure_task"
INIT = "tunedb.runtime.pack_device:init_task"
PROTOCOL = Protocol(warmup=3, samples=10, flush_l2=False, batch=10)
STREAMS = 16  # the most streams a candidate forks (``candidates`` offers 2..16)


def init_task(state: dict) -> dict:
    cp = import_cupy()
    library()  # before anything else loads its own cuBLAS
    state.update(cp=cp, pool=StreamPool(STREAMS), key="", inputs=None, refs=None)
    uuid = device_uuid()
    return {"device": asdict(device_info()), "clocks": clocks(uuid), "uuid": uuid}


def result_of(row: dict[str, Any]) -> dict:
    """A ``measure_candidate`` row as the worker's result (the ``MeasureResult`` wire form)."""
    status = {"ok": "ok", "incorrect": "incorrect"}.get(row.get("status", ""), "runtime_error")
    if status == "ok":
        return MeasureResult("ok", tuple(row["samples_us"])).to_wire()
    err = row.get("message") or f"worst error {row.get('error')} x its bound"
    return failure(status, err)


def measure_task(state: dict, context: dict, items: list) -> Iterator[dict]:
    """``context``: {workload (the packing record's JSON), protocol}; items: wire requests
    holding ``candidate`` (a packing candidate's JSON)."""
    cp = state["cp"]
    w = PackingWorkload.from_json(context["workload"])
    proto = Protocol(**context.get("protocol", asdict(PROTOCOL)))
    if state["key"] != w.hash:
        state.update(key="", inputs=None, refs=None)
        cp.get_default_memory_pool().free_all_blocks()
        inputs = [(cp.asarray(x), cp.asarray(wt)) for x, wt in make_inputs(w, seed=0)]
        state.update(key=w.hash, inputs=inputs, refs=reference(w, inputs))
        yield {"_heartbeat": True}  # setup done: candidates get the per-candidate timeout
    for item in items:
        if item.get("error"):
            yield failure("compile_error", str(item["error"]))
            continue
        row = measure_candidate(cp, w, Candidate.from_json(item["candidate"]), state["inputs"],
                                state["refs"], state["pool"], reps=proto.batch, samples=proto.samples,
                                log=lambda _line: None)
        res = result_of(row)
        if row.get("status") == "error":
            try:  # a sticky CUDA error poisons the context: start a fresh process
                cp.cuda.runtime.deviceSynchronize()
            except Exception:  # noqa: BLE001
                res["_restart"] = True
        yield res


class PackingDevice:
    """Measures packing candidates on the local GPU (see the module docstring)."""

    kind = "cuda"

    def __init__(self, timeout_s: float = 60.0, protocol: Protocol | None = None) -> None:
        self.protocol = protocol or PROTOCOL
        self.worker, hello = start_gpu_worker(TASK, INIT, timeout_s)
        self.info = DeviceInfo(**hello["device"])
        self.uuid = str(hello.get("uuid", ""))
        self._counts: dict[str, int] = {}

    def clocks(self) -> dict[str, float]:
        return clocks(self.uuid)

    def prefetch(self, requests: list[MeasureRequest], workload: Workload | None = None) -> None:
        return None  # nothing to compile: cuBLAS calls are built in the worker

    def measure(self, workload: Workload, requests: list[MeasureRequest]
                ) -> Iterator[tuple[int, MeasureResult]]:
        import json

        context = {"workload": json.loads(workload.graph_json), "protocol": asdict(self.protocol)}
        for i, wire in self.worker.run(context, [r.to_wire() for r in requests]):
            res = MeasureResult.from_wire(wire)
            self._counts[res.status] = self._counts.get(res.status, 0) + 1
            yield i, res

    def stats(self) -> dict:
        return {**{f"status_{k}": v for k, v in sorted(self._counts.items())},
                "restarts": self.worker.restarts}

    def close(self) -> None:
        self.worker.close()
