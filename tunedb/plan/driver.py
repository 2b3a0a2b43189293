"""The compiler driver: ``compile(model) -> Plan``.

Import the model (ONNX path / ModelProto, a Graph, or a graph JSON file), partition it into
steps with the fusion explorer (exact DB hits first, the cost model next, the roofline last),
pick each fused kernel's schedule (optionally measuring the top few on the GPU), assign the
intermediate buffers and return the frozen Plan. Planning needs no GPU unless ``measure_top``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from tunedb.costmodel.features import DeviceFacts
from tunedb.graph.ir import Graph, GraphError
from tunedb.graph.ops import infer_graph
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.cost import Coster, GroupCost, stitch_of
from tunedb.plan.fusion import explore
from tunedb.plan.record import KernelStep, Plan, PlanError
from tunedb.plan.subgraph import GraphIndex
from tunedb.records import DeviceInfo, canonical_json


def load_graph(model: Any, bindings: dict[str, int] | None = None, fill_initializers: bool = True) -> Graph:
    """A Graph from a Graph, an ONNX ModelProto or path, or a graph JSON file (``.json``)."""
    if isinstance(model, Graph):
        return infer_graph(model)
    if isinstance(model, (str, os.PathLike)) and str(model).endswith(".json"):
        try:
            return infer_graph(Graph.from_json(json.loads(Path(model).read_text())))
        except OSError as e:
            raise GraphError(f"cannot read graph JSON {model}: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise GraphError(f"{model} is not a tunedb graph JSON: {type(e).__name__} {e}") from None
    from tunedb.graph.onnx_import import import_onnx

    return import_onnx(model, bindings, fill_initializers=fill_initializers)


@contextmanager
def _store(db: Any) -> Iterator[Any]:
    """``db`` as an open TuningStore (opened read-only from a path, closed afterwards)."""
    if db is None or hasattr(db, "top_k"):
        yield db
        return
    from tunedb.store import TuningStore

    store = TuningStore.open(db, read_only=True)
    try:
        yield store
    finally:
        store.close()


def resolve_device(device: Any, store: Any) -> DeviceInfo | None:
    """The device the plan is for: a DeviceInfo; ``"cuda"`` = this machine's GPU, else the
    database's only device, else none (generic H200 facts, no DB hits); or a device id or
    name from the database; ``None``/``"generic"`` = none."""
    if isinstance(device, DeviceInfo):
        return device
    if device is None or device in ("", "generic", "none"):
        return None
    devices = store.devices() if store is not None else []
    if device in ("cuda", "gpu"):
        from tunedb.runtime.device import NoGPUError, device_info

        try:
            return device_info()
        except NoGPUError:
            return devices[0] if len(devices) == 1 else None
    for d in devices:
        if device in (d.id, d.name):
            return d
    known = ", ".join(f"{d.id} ({d.name})" for d in devices) or "none"
    raise PlanError(f"unknown device {device!r}; devices in the database: {known}")


def load_cost_model(cost_model: Any, device: DeviceInfo | None) -> Any:
    """A cost model object as it is, or one loaded from a model directory (``model.ubj`` +
    ``card.json``) or a registry root (``<root>/<device>/fusion``)."""
    if cost_model is None or not isinstance(cost_model, (str, os.PathLike)):
        return cost_model
    from tunedb.costmodel.registry import CARD_FILE, find_model, load_model

    path = Path(cost_model)
    if (path / CARD_FILE).is_file() or path.name == CARD_FILE:
        return load_model(path)
    return find_model(path, device.name if device is not None else DeviceFacts().name, "fusion")


def _make_step(index: GraphIndex, coster: Coster, nodes: tuple[int, ...], cost: GroupCost) -> KernelStep:
    sub = index.cut(nodes)
    return KernelStep(
        kind=cost.kind, inputs=sub.inputs, outputs=sub.outputs, nodes=nodes,
        ops=tuple(index.nodes[j].op for j in nodes), subgraph=canonical_json(sub.graph.to_json()),
        workload_hash=coster.workload_hash(nodes), config=cost.config or {},
        stitch=stitch_of(cost.config) if cost.kind == "fused" else (), predicted_us=cost.us,
        cost_source=cost.source, launches=cost.launches, note=cost.note)


def _measure(steps: list[KernelStep], costs: list[GroupCost], top: int, gpu: Any) -> list[KernelStep]:
    """Measure the ``top`` best-ranked schedules of every fused step on the GPU; keep the
    fastest correct one (``measured_us``)."""
    from tunedb.kernels.codegen import generate
    from tunedb.kernels.schedule import Schedule
    from tunedb.records import Candidate, Workload
    from tunedb.runtime.cuda import plan_to_wire

    out = []
    for step, cost in zip(steps, costs):
        configs = [cfg for _, cfg in cost.ranked[:top]]
        if step.kind != "fused" or not configs:
            out.append(step)
            continue
        wl = Workload.from_graph(step.graph, "plan", step.workload_hash[:12])
        wires = []
        for cfg in configs:
            try:
                wire = plan_to_wire(generate(step.graph, Schedule.from_config(cfg), gpu.info.sm_count))
            except ValueError as e:  # UnsupportedFusion is a ValueError too
                wire = {"kernels": [], "scratch": [], "error": str(e)}
            # A replay device answers by candidate hash.
            wires.append({**wire, "candidate_hash": Candidate(wl.hash, "fusion", cfg).hash})
        best: tuple[float, dict] | None = None
        for i, res in gpu.measure(wl, wires):
            res = res or {}  # None: a replay device has no data for this candidate
            samples = sorted(res.get("samples_us") or [])
            if res.get("status") == "ok" and samples:
                med = samples[len(samples) // 2]
                if best is None or med < best[0]:
                    best = (med, configs[i])
        if best is None:
            note = (step.note + "; " if step.note else "") + "no measured schedule ran"
            out.append(replace(step, note=note))
            continue
        out.append(replace(step, config=best[1], stitch=stitch_of(best[1]), measured_us=best[0]))
    return out


def compile(model: Any, *, db: Any = None, cost_model: Any = None, device: Any = "cuda",
            measure_top: int = 0, beam: int = 4, horizontal: bool = True,
            bindings: dict[str, int] | None = None, fill_initializers: bool = True,
            measure_device: str = "cuda") -> Plan:
    """Plan ``model`` (ONNX path / ModelProto, Graph, or graph JSON path) for ``device``.

    ``db``: a TuningStore or a database path (opened read-only) for exact hits; ``cost_model``:
    a CostModel or a model directory / registry root; ``measure_top``: measure that many of
    each fused kernel's best-ranked schedules on ``measure_device`` (``"cuda"``: the local GPU,
    or ``"replay:PATH"``: stored measurements); ``beam``: states kept per node by the fusion
    search; ``horizontal``: pack small independent kernels."""
    t0 = time.perf_counter()
    if measure_top < 0:
        raise PlanError(f"measure_top must be >= 0, got {measure_top}")
    gpu_ctx: Any = nullcontext(None)
    if measure_top > 0:
        from tunedb.runtime import open_device

        gpu_ctx = open_device(measure_device)  # NoGPUError here, before any planning work
    graph = load_graph(model, bindings, fill_initializers)
    with _store(db) as store, (gpu_ctx if measure_top == 0 else _closing(gpu_ctx)) as gpu:
        info = gpu.info if gpu is not None else resolve_device(device, store)
        facts = DeviceFacts.from_device_info(info) if info is not None else DeviceFacts()
        model_obj = load_cost_model(cost_model, info)
        index = GraphIndex(graph)
        coster = Coster(index, store=store, device_id=info.id if info is not None else None,
                        model=model_obj, device=facts)
        part = explore(index, coster, beam=beam, launch_us=facts.launch_us, horizontal=horizontal)
        steps = [_make_step(index, coster, g, c) for g, c in zip(part.groups, part.costs)]
        if gpu is not None:
            steps = _measure(steps, part.costs, measure_top, gpu)
    buffers = plan_buffers(graph, steps)
    search = {**part.stats, "plan_s": round(time.perf_counter() - t0, 4),
              "cost_model": type(model_obj).__name__ if model_obj is not None else "",
              "db": bool(store is not None)}
    device_text = f"{info.name} ({info.id})" if info is not None else ""
    return Plan(graph_json=canonical_json(graph.to_json()), steps=tuple(steps), buffers=buffers,
                device=device_text, launch_us=facts.launch_us, search=search)


@contextmanager
def _closing(dev: Any) -> Iterator[Any]:
    try:
        yield dev
    finally:
        dev.close()
