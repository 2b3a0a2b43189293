"""The compiler driver: ``compile(model) -> Plan``.

Import the model (ONNX path / ModelProto, a Graph, or a graph JSON file), partition it into
steps with the fusion explorer (exact DB hits first, the cost model next, the roofline last),
pick each fused kernel's schedule (optionally measuring the top few on the GPU and recording
the results in the database: ``tunedb.plan.measure``), assign the intermediate buffers and
return the frozen Plan. Planning needs no GPU unless ``measure_top``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tunedb.costmodel.errors import CostModelError
from tunedb.costmodel.features import DeviceFacts
from tunedb.costmodel.packing import load_predictor
from tunedb.graph.ir import Graph, GraphError
from tunedb.graph.ops import infer_graph
from tunedb.kernels.split_reduce import split_reductions
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.cost import Coster, GroupCost, stitch_of
from tunedb.plan.epilogue import split_conv_bias
from tunedb.plan.fusion import explore
from tunedb.plan.gelu_epilogue import fold_gelu_epilogues
from tunedb.plan.measure import Recorder, measure_steps
from tunedb.plan.merge_choice import compile_merged
from tunedb.plan.packing import PackMeasurer, pack_plan_steps, runnable_packs, store_times
from tunedb.plan.record import KernelStep, Plan, PlanError, source_of
from tunedb.plan.rewrite import fold_matmul_bias, rewrite_for_plan
from tunedb.plan.stage_refine import compile_staged
from tunedb.plan.subgraph import GraphIndex
from tunedb.records import DeviceInfo, canonical_json
from tunedb.runtime import open_device
from tunedb.runtime.device import NoGPUError, device_info
from tunedb.runtime.executor_ops import gemm_bias_epilogue
from tunedb.runtime.executor_views import CONCAT_VIEW, OUTPUT_VIEW, check_concat_view, check_output_view
from tunedb.runtime.pack_device import PackingDevice
from tunedb.store import BUSY_WAIT_S, TuningStore


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
def _store(db: Any, write: bool = False) -> Iterator[Any]:
    """``db`` as an open TuningStore: a store object as it is; a path opened read-only, or
    read-write (created if missing) when ``write``; closed afterwards."""
    if db is None or hasattr(db, "top_k"):
        yield db
        return

    # A collector holds the file only while it commits: wait for that rather than fail.
    store = TuningStore.open(db, read_only=not write, wait_s=BUSY_WAIT_S)
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
        try:
            return device_info()
        except NoGPUError:
            # boards of one model measure alike: any of them stands for "this GPU" when absent
            models = {(d.name, d.compute_capability, d.sm_count) for d in devices}
            return devices[0] if len(models) == 1 else None
    for d in devices:
        if device in (d.id, d.name):
            return d
    known = ", ".join(f"{d.id} ({d.name})" for d in devices) or "none"
    raise PlanError(f"unknown device {device!r}; devices in the database: {known}")


def load_cost_model(cost_model: Any, device: DeviceInfo | None) -> Any:
    """A cost model object as it is, or one loaded from a model directory (``model.ubj`` +
    ``card.json``) or a registry root (``<root>/<device>/fusion``). ``None``: the registry's
    model for the device's GPU model when there is one (``default_models_root``), else no model
    (roofline prices); ``False``: no model."""
    if cost_model is False:
        return None
    if cost_model is not None and not isinstance(cost_model, (str, os.PathLike)):
        return cost_model
    from tunedb.costmodel.registry import CARD_FILE, default_models_root, find_model, load_model, model_dir

    name = device.name if device is not None else DeviceFacts().name
    if cost_model is None:
        root = default_models_root()
        registered = model_dir(root, name, "fusion") if root is not None else None
        if registered is None or not (registered / CARD_FILE).is_file():
            return None
        try:
            return load_model(registered)
        except CostModelError as e:  # a stale default is not the caller's error: plan without it
            warnings.warn(f"default cost model not used: {e}", stacklevel=3)
            return None
    path = Path(cost_model)
    if (path / CARD_FILE).is_file() or path.name == CARD_FILE:
        return load_model(path)
    return find_model(path, name, "fusion")


def _make_step(index: GraphIndex, coster: Coster, nodes: tuple[int, ...], cost: GroupCost) -> KernelStep:
    sub = index.cut(nodes)
    output_view = cost.kind == "layout_view" and any(j in index.output_view for j in nodes)
    if output_view:  # the matmul before it writes straight into this step's output
        cost = GroupCost("layout_view", 0.0, "none", launches=0, config={"view": OUTPUT_VIEW})
    concat_view = cost.kind == "layout_view" and any(j in index.concat_view for j in nodes)
    if concat_view:  # its producers write their slices of this step's output
        cost = GroupCost("layout_view", 0.0, "none", launches=0, config={"view": CONCAT_VIEW})
    step = KernelStep(
        kind=cost.kind, inputs=sub.inputs, outputs=sub.outputs, nodes=nodes,
        ops=tuple(index.nodes[j].op for j in nodes), subgraph=canonical_json(sub.graph.to_json()),
        workload_hash=coster.workload_hash(nodes), config=cost.config or {},
        stitch=stitch_of(cost.config) if cost.kind == "fused" else (), predicted_us=cost.us,
        cost_source=cost.source, launches=cost.launches, note=cost.note)
    if cost.kind == "gemm" and gemm_bias_epilogue(index.nodes[nodes[0]], index.types):
        step = dataclasses.replace(step, config={**step.config_dict, "epilogue": "bias"})
    if output_view or concat_view:
        try:  # the executor undoes a transpose-then-reshapes chain, or takes one concat, only
            check_output_view(step) if output_view else check_concat_view(step)
        except ValueError as e:  # grouped otherwise: a copy kernel, as before output views
            us = sub.graph.floor_bytes() / coster.device.bandwidth_bytes_per_s * 1e6
            return dataclasses.replace(step, kind="layout", config=(), predicted_us=us,
                                       cost_source="roofline", launches=1, note=f"copied: {e}")
    return step


def compile(model: Any, *, db: Any = None, cost_model: Any = None, device: Any = "cuda",
            measure_top: int = 0, beam: int = 4, horizontal: bool = True,
            bindings: dict[str, int] | None = None, fill_initializers: bool = True,
            measure_device: str = "cuda", schedule: str = "sequential", pack: bool | str = "auto",
            pack_model: Any = None, bias_epilogue: bool = False, gemm_epilogue: bool = False,
            concat_views: bool = False, gelu_epilogue: bool = False,
            merge: bool | str | None = None) -> Plan:
    """Plan ``model`` (ONNX path / ModelProto, Graph, or graph JSON path) for ``device``.

    ``db``: a TuningStore or a database path for exact hits; ``cost_model``: a CostModel or a
    model directory / registry root, ``None`` for the model registered for the device's GPU
    (``$TUNEDB_MODELS``, else ``models/`` of the source tree; roofline prices when there is
    none), ``False`` for roofline prices; ``measure_top``: measure that many of each fused kernel's
    best-ranked schedules on ``measure_device`` (``"cuda"``: the local GPU, or
    ``"replay:PATH"``: stored measurements); ``beam``: states kept per node by the fusion
    search; ``horizontal``: pack small independent kernels.

    Measurements are stored: with ``measure_top`` > 0 a database path is opened read-write
    (created if missing) and every result, ok or failed, is recorded there with its provenance
    (a Run of collector ``plan``), like a collection, so that the next ``compile`` on that
    database gets exact hits (cost source ``db``) for those kernels; candidates it already holds
    are not measured again. A writable TuningStore object is written to the same way; a
    read-only one (or ``db=None``) is only read, and nothing is written.
    ``plan.search`` counts ``measured`` (device results) and ``stored`` (rows written).

    ``schedule``: ``"sequential"`` (one stream), ``"ios"`` (IOS stages over the steps: groups of
    a stage run concurrently on their own streams; ``tunedb.plan.stages``) or ``"auto"`` (the
    stages only where they pay: on stored stage times when the database holds both plans', else
    predicted with a 10 % margin). With ``measure_top`` the stages are refined by measuring
    them on ``measure_device`` and stored (``tunedb.plan.stage_refine.refine_plan``).

    ``pack``: launch independent GEMM/conv steps together (``tunedb.plan.packing``) where an
    exact database hit or the packing model (``pack_model``: a saved model folder or a predictor;
    ``None``: the registry's for the device) says it beats them one after another by 5 %;
    ``"auto"`` packs only with such evidence, ``True`` fails without a model or database,
    ``False`` never packs. Sequential schedules only. With ``measure_top``, the ``measure_top``
    pack candidates the model ranks first for each ready set, and serial, are measured too (on
    cuda or a replay, not the emulator), stored like the kernels, and the measured best decides
    (pack source ``measured``); ``plan.search`` counts ``pack_measured`` and ``pack_stored``.

    ``bias_epilogue``: a convolution's bias is added in the fused kernel after it, not in a
    kernel of its own (``tunedb.plan.epilogue``).

    ``gemm_epilogue``: a matmul's bias add that would be a kernel of its own becomes the bias of a
    ``gemm`` step (``tunedb.plan.rewrite.fold_matmul_bias``; the step's config says
    ``epilogue: bias``). The executor runs it as one cuBLASLt call with the bias epilogue where
    that is switched on (``TUNEDB_CUBLASLT=1``), else as a copy of the bias and cuBLAS with
    beta = 1.

    ``gelu_epilogue``: a GEMM, its bias and its GELU are one ``gemm`` step (config ``epilogue:
    gelu_bias``) that the executor runs as cuBLASLt's GELU_BIAS epilogue (the tanh GELU) where
    cuBLASLt is on; bfloat16 only, where the tanh form is far inside the tolerance
    (``tunedb.plan.gelu_epilogue``).

    ``concat_views``: a concat whose inputs are contiguous slices of its output (channels at
    batch 1) is no kernel: its producers write their slices (``tunedb.plan.views``). It is not
    fused either, so elementwise ops before it run in their branches' steps.

    ``merge``: sibling convolutions of one input with constant weights become one convolution
    (IOS's merge strategy, ``tunedb.plan.merge``): all that can (``True``), those of one kernel
    size (``"exact"``) or where the predicted plans say it pays (``"auto"``,
    ``tunedb.plan.merge_choice``). ``None``: ``"auto"`` with ``schedule="auto"`` (one setting
    that takes the merges where they pay and stages where they pay), else off."""
    if merge is None:  # SqueezeNet b1 gains 1.19x only merged; at b16 "auto" keeps no merge
        merge = "auto" if schedule == "auto" else False
    if merge:
        rest = dict(db=db, cost_model=cost_model, device=device, measure_top=measure_top, beam=beam,
                    horizontal=horizontal, measure_device=measure_device, schedule=schedule, pack=pack,
                    pack_model=pack_model, bias_epilogue=bias_epilogue, gemm_epilogue=gemm_epilogue,
                    concat_views=concat_views, gelu_epilogue=gelu_epilogue, merge=False)
        graph = load_graph(model, bindings, fill_initializers)
        return compile_merged(functools.partial(compile, **rest), graph, merge, measure_top)
    if bias_epilogue:
        model = split_conv_bias(load_graph(model, bindings, fill_initializers))
    if gemm_epilogue:
        model = fold_matmul_bias(rewrite_for_plan(load_graph(model, bindings, fill_initializers)))
    if pack is True and schedule != "sequential":
        raise PlanError("pack=True needs schedule='sequential' (IOS stages and packs do not mix)")
    if schedule != "sequential":
        # auto's sequential candidate is the plan schedule="sequential" gives: packs and all
        return compile_staged(functools.partial(compile, concat_views=concat_views, pack_model=pack_model,
                                                gelu_epilogue=gelu_epilogue),
                              load_graph(model, bindings, fill_initializers), schedule, pack=pack,
                              db=db, cost_model=cost_model, device=device, measure_top=measure_top,
                              beam=beam, horizontal=horizontal, measure_device=measure_device)
    t0 = time.perf_counter()
    if measure_top < 0:
        raise PlanError(f"measure_top must be >= 0, got {measure_top}")
    with ExitStack() as stack:
        gpu = None
        if measure_top > 0:
            gpu = open_device(measure_device)  # NoGPUError here, before any planning work
            stack.callback(gpu.close)
        # reductions over non-adjacent axes (batch-norm statistics) as chains the generator runs
        graph = split_reductions(rewrite_for_plan(load_graph(model, bindings, fill_initializers)))
        store = stack.enter_context(_store(db, write=measure_top > 0))
        info = gpu.info if gpu is not None else resolve_device(device, store)
        facts = DeviceFacts.from_device_info(info) if info is not None else DeviceFacts()
        model_obj = load_cost_model(cost_model, info)
        index = GraphIndex(graph, concat_views=concat_views)
        ids = None if info is None else store.same_model_ids(info) if store is not None else [info.id]
        coster = Coster(index, store=store, device_id=ids,
                        model=model_obj, device=facts)
        part = explore(index, coster, beam=beam, launch_us=facts.launch_us, horizontal=horizontal)
        steps = [_make_step(index, coster, g, c) for g, c in zip(part.groups, part.costs)]
        counts: dict[str, int] = {}
        if gpu is not None:
            recorder = None
            if store is not None and not store.read_only:
                config = {"graph": graph.name, "measure_top": measure_top, "beam": beam,
                          "cost_model": type(model_obj).__name__ if model_obj is not None else ""}
                recorder = Recorder(store, gpu, config)
            try:
                steps, counts["measured"] = measure_steps(steps, part.costs, measure_top, gpu, recorder)
            finally:
                # Whatever was measured is kept, even when measuring stopped half-way.
                counts["stored"] = recorder.flush() if recorder is not None else 0
        if gelu_epilogue:  # after measuring: measure_steps pairs the steps with part.costs
            steps = fold_gelu_epilogues(index, steps, coster.workload_hash)
        packs: list[Any] = []
        if pack:
            predictor = _pack_predictor(pack_model, info)
            if pack is True and predictor is None and store is None:
                raise PlanError("pack=True needs a packing model or a database")
            times = store_times(store, ids) if store is not None and ids else None
            if predictor is not None or times is not None:
                measure = None if gpu is None else _pack_measurer(
                    stack, gpu, measure_device, store, {"graph": graph.name, "pack_measure_top": measure_top})
                try:
                    steps, packs = pack_plan_steps(graph, steps, model=predictor, times=times,
                                                   measure=measure, top=measure_top)
                finally:
                    if measure is not None:
                        counts["pack_measured"] = measure.requested
                        counts["pack_stored"] = measure.recorder.flush() if measure.recorder else 0
    buffers = plan_buffers(graph, steps)
    packs = runnable_packs(graph, steps, buffers, packs)
    search = {**part.stats, **counts, "plan_s": round(time.perf_counter() - t0, 4),
              "cost_model": type(model_obj).__name__ if model_obj is not None else "",
              "db": bool(store is not None)}
    device_text = f"{info.name} ({info.id})" if info is not None else ""
    return Plan(graph_json=canonical_json(graph.to_json()), steps=tuple(steps), buffers=buffers,
                device=device_text, launch_us=facts.launch_us, search=search,
                source=source_of(model, bindings, fill_initializers), packs=tuple(packs))


def _pack_measurer(stack: ExitStack, gpu: Any, spec: str, store: Any, config: dict[str, Any]
                   ) -> PackMeasurer | None:
    """What measures pack candidates (cuBLAS calls) for ``measure_top``: a ``PackingDevice`` next
    to the CUDA device, the replay device itself; None on the emulator (it has no cuBLAS)."""
    if getattr(gpu, "kind", "") == "replay":
        dev = gpu
    elif spec in ("cuda", "gpu"):
        dev = PackingDevice(protocol=gpu.protocol)
        stack.callback(dev.close)
    else:
        return None
    recorder = Recorder(store, dev, config) if store is not None and not store.read_only else None
    return PackMeasurer(dev, recorder)


def _pack_predictor(pack_model: Any, info: DeviceInfo | None) -> Any:
    """A packing predictor: ``pack_model`` as it is when callable, loaded when a path, else the
    registry's packing model for the device's GPU model when there is one."""
    from tunedb.costmodel.registry import CARD_FILE, default_models_root, model_dir

    if callable(pack_model):
        return pack_model
    if pack_model is not None:
        return load_predictor(Path(pack_model))
    root = default_models_root()
    name = info.name if info is not None else DeviceFacts().name
    folder = model_dir(root, name, "packing") if root is not None else None
    return load_predictor(folder) if folder is not None and (folder / CARD_FILE).is_file() else None
