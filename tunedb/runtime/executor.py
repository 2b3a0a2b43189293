"""Run a Plan on the GPU: every kernel compiled once, buffers allocated once, one CUDA graph.

    ex = PlanExecutor(plan)            # compile, allocate, run once eagerly, capture, check
    outs = ex.run({"x": x})            # name -> cupy array (bfloat16 widened to float32)
    ex.replay(); ex.synchronize()      # one more run on the inputs already in place (timing)

``PlanExecutor(plan)``:

1. allocates the plan's ``BufferPlan`` once: one arena that the intermediates share by liveness,
   one buffer per graph output; persistent buffers for the graph inputs; constants uploaded once.
   Views (``layout_view`` steps) are reshapes of the same memory, or strided transposes /
   slices / splits that only matmuls read (``tunedb.plan.views``; cuBLAS takes them in place,
   a batch of matrices at uneven strides as a device array of pointers): no kernel. An output
   view (``executor_views``) goes the other way: the matmul writes its result as a strided view
   of the view step's output (attention's heads straight into rows).
2. builds every step: fused steps are generated (``tunedb.kernels.codegen.generate`` with the
   step's schedule) and compiled with NVRTC (``cupy.RawModule``, cached by source); compute and
   layout steps use ``executor_ops`` (cuBLAS GEMMs called through ``tunedb.runtime.blas`` on the
   executor's own cuBLAS handle, so a capture can record them; im2col convolutions, pool
   kernels, copies);
   anything else, or a fused step the generator refuses, runs op by op in CuPy (``fallbacks``
   says which and why).
3. runs the plan once eagerly, then captures the whole plan ONCE as a CUDA graph on its own
   non-default stream (temporaries of the capture come from a private memory pool that lives as
   long as the graph), replays it once and compares with the eager outputs. If capture fails or
   the replay differs, the executor launches eagerly and ``capture_error`` says why.

float32 GEMMs stay float32 (``CUBLAS_COMPUTE_32F``); TF32 only with ``CUPY_TF32=1`` in the
environment, as for CuPy (``tf32`` reports it). CuPy is imported lazily: this module imports on
machines without it.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunedb.graph.ir import FLOAT_DTYPES, Graph
from tunedb.graph.ops import check_node
from tunedb.kernels.codegen import generate
from tunedb.kernels.schedule import Schedule
from tunedb.runtime.blas import Blas
from tunedb.runtime.conv_chain import conv_io
from tunedb.runtime.device import current_stream, import_cupy
from tunedb.runtime.executor_conv import conv_path
from tunedb.runtime.executor_inputs import ExecutorError, bindable, prepare_inputs
from tunedb.runtime.executor_lt import GELU_BIAS, BlasLt, gelu_bias_step, lt_enabled
from tunedb.runtime.executor_ops import (
    ComputeOps,
    Evaluator,
    KernelSet,
    compute_launch,
    device_views,
    layout_launch,
    load,
    storage_dtype,
    to_bf16_bits,
)
from tunedb.runtime.executor_views import (
    check_concat_written,
    input_view,
    is_concat_view,
    is_output_view,
    output_view_steps,
)
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.launch import kernel_function, launcher

ALIGN = 256
# Single ops with a direct implementation, and the stored dtypes it takes.
COMPUTE_DIRECT: dict[str, frozenset[str]] = {
    "matmul": frozenset(("float32", "float16", "bfloat16")),
    "gemm": frozenset(("float32", "float16", "bfloat16")),
    "conv2d": frozenset(("float32", "bfloat16")), "max_pool2d": frozenset(("float32",)),
    "avg_pool2d": frozenset(("float32",)), "global_avg_pool": frozenset(("float32",)),
    "global_max_pool": frozenset(("float32",)),
}
LAYOUT_DIRECT = frozenset(("transpose", "reshape", "squeeze", "unsqueeze", "identity", "expand",
                           "slice", "gather", "concat", "split", "pad"))
OP_BY_OP = "cupy op by op"


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:limit]


# -- CPU side: what runs each step, and the inputs --------------------------------------------------
def step_path(step: Any) -> str:
    """How the executor runs ``step`` (no GPU needed): ``view``, ``generated``, ``cublas``,
    ``conv 1x1 (cublas)``, ``conv (im2col + cublas)`` (``, batch merged)``), ``conv (cudnn
    nchw / nhwc)``, ``conv depthwise kernel``, ``pool kernel`` (global pools too), ``layout
    copy`` (the chunked or tiled copy kernels of ``copykernel``, else CuPy's copy) or ``cupy op
    by op``."""
    if step.kind == "layout_view":
        return "view"
    if step.kind == "fused":
        return "generated" if step.config else OP_BY_OP
    sub = step.graph
    if len(sub.nodes) != 1:
        return OP_BY_OP
    node = sub.nodes[0]
    types = sub.type_map
    dtypes = {types[v].dtype for v in node.inputs} | {types[o].dtype for o in node.outputs}
    if node.op in COMPUTE_DIRECT and dtypes <= COMPUTE_DIRECT[node.op]:
        if node.op == "conv2d":
            a = check_node(node, [types[v] for v in node.inputs])[1]
            x, w, out = (types[v].shape for v in (node.inputs[0], node.inputs[1], node.outputs[0]))
            return conv_path(x, w, out, a, storage_dtype(types[node.inputs[0]].dtype).itemsize)
        return {"matmul": "cublas", "gemm": "cublas"}.get(node.op, "pool kernel")
    if node.op in LAYOUT_DIRECT:
        return "layout copy"
    return OP_BY_OP


def _const_storage(c: Any) -> np.ndarray:
    if c.type.dtype == "bfloat16":
        return np.frombuffer(c.data, dtype="<u2").reshape(c.type.shape).astype(np.uint16)
    return np.ascontiguousarray(c.array, dtype=storage_dtype(c.type.dtype))


# -- the executor ---------------------------------------------------------------------------------
class PlanExecutor:
    """Compiled, allocated and (if it can be) graph-captured plan; see the module docstring.

    Attributes for reports: ``launches`` (kernels per run), ``graph_capture`` (replays one CUDA
    graph), ``capture_error`` (why not), ``fallbacks`` (steps run op by op, and why), ``paths``
    (how each step runs), ``tf32``, ``compile_s`` / ``capture_s``."""

    def __init__(self, plan: Any, *, capture: bool = True, verify_capture: bool = True,
                 sm_count: int | None = None, cublaslt: bool | None = None) -> None:
        """``plan``: a ``tunedb.plan.Plan`` (the planner's layer reads stored JSON with
        ``Plan.from_json``; the runtime below it takes the record, not its text). ``cublaslt``:
        gemm bias vectors as cuBLASLt's epilogue (``executor_lt``; None: ``TUNEDB_CUBLASLT``)."""
        cp = import_cupy()  # NoGPUError first
        if isinstance(plan, (str, bytes, dict)):
            raise TypeError("PlanExecutor takes a Plan; read a stored one with tunedb.plan.Plan.from_json")
        plan.check()
        t0 = time.perf_counter()
        self.plan, self.graph, self.cp = plan, plan.graph, cp
        self.types = self.graph.type_map
        self.tf32 = os.environ.get("CUPY_TF32", "0") not in ("", "0")
        self.sm_count = int(sm_count or cp.cuda.Device().attributes["MultiProcessorCount"])
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.launches = 0
        self.graph_capture = False
        self.capture_error = "" if capture else "capture disabled"
        self.fallbacks: list[str] = []
        self.paths: list[str] = []
        self.unplanned_bytes = 0
        self._owned: set[str] = set()  # values whose memory a step writes (not inputs/constants)
        self._graph: Any = None
        self._graph_pool: Any = None
        self._bound_graphs: list[tuple[Any, Any]] = []
        self._modules: dict[tuple[str, tuple[str, ...]], Any] = {}  # (source, options) -> module
        self._scratch_need = 0
        self._scratch: Any = None
        with current_stream(self.cp, self.stream):
            try:
                # Its own handle on this stream: CuPy's cuBLAS wrappers refuse to run in a capture.
                self.blas = Blas(cp, self.stream, tf32=self.tf32)
            except Exception as e:  # noqa: BLE001 - library / handle errors as one line
                raise ExecutorError(f"cuBLAS unavailable: {_one_line(e)}") from None
            self.kernels = KernelSet(cp, self.sm_count)
            self.lt, self.lt_error = None, ""
            if lt_enabled() if cublaslt is None else cublaslt:
                try:
                    self.lt = BlasLt(cp, self.stream, tf32=self.tf32)
                except Exception as e:  # noqa: BLE001 - without it, gemm biases take two launches
                    self.lt_error = _one_line(e)
            self.ops = ComputeOps(cp, self.kernels, self._scratch_getter, self.blas, self.lt)
            # The op-by-op evaluator allocates its own temporaries (its sizes are not planned).
            self.eval_ops = ComputeOps(cp, self.kernels, lambda nb: (lambda: cp.empty(nb, dtype=cp.uint8)),
                                       self.blas)
            self._allocate()
            self.ops.constant_ptrs = {int(self.env[n].data.ptr) for n, _ in self.graph.constants}
            self.ops.conv_io = conv_io(plan, self.env)  # channels-last between cuDNN convolutions
            try:
                self._output_views = output_view_steps(plan.steps)
            except ValueError as e:
                raise ExecutorError(str(e)) from None
            self._launch_fns: list[Any] = []
            for k, step in enumerate(plan.steps):
                self._build(k, step)
            self._scratch = cp.empty(max(1, self._scratch_need), dtype=cp.uint8)
            self._fill_sample_inputs()
            try:
                self._enqueue()  # compiles CuPy's own kernels, creates the cuBLAS handle: not in capture
                self.stream.synchronize()
            except Exception as e:  # noqa: BLE001 - NVRTC / CUDA errors as one line
                raise ExecutorError(f"first run of plan {self.graph.name or '<unnamed>'} failed: "
                                    f"{_one_line(e)}") from None
        self.compile_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if capture:
            self._capture(verify_capture)
        self.capture_s = time.perf_counter() - t1

    # -- memory ---------------------------------------------------------------------------------
    def _allocate(self) -> None:
        cp, g, bp = self.cp, self.graph, self.plan.buffers
        self.inputs = {v: cp.empty(self.types[v].shape, dtype=storage_dtype(self.types[v].dtype))
                       for v in g.inputs}
        self.env: dict[str, Any] = dict(self.inputs)
        for name, c in g.constants:
            self.env[name] = cp.asarray(_const_storage(c))
        self.buffers = [cp.empty(max(1, int(s)), dtype=cp.uint8) for s in bp.sizes]
        self.assign = {v: (b, off) for v, b, off, _ in bp.assign}

    def _array(self, v: str) -> Any:
        """The device array of value ``v`` a step writes: its planned place, else its own."""
        t = self.types[v]
        if v in self.assign:
            b, off = self.assign[v]
            self._owned.add(v)
            if not 0 <= b < len(self.buffers) or off < 0 or off + t.nbytes > self.plan.buffers.sizes[b]:
                raise ExecutorError(f"buffer plan puts {v!r} ({t}) at buffer {b} offset {off}, "
                                    "outside the planned buffers")
            return self.buffers[b][off:off + t.nbytes].view(storage_dtype(t.dtype)).reshape(t.shape)
        self.unplanned_bytes += t.nbytes
        self._owned.add(v)
        return self.cp.empty(t.shape, dtype=storage_dtype(t.dtype))

    def _scratch_getter(self, nbytes: int) -> Any:
        # Steps run one after another, so they all share one scratch buffer (allocated once every
        # step is built: launches fetch it on first use).
        self._scratch_need = max(self._scratch_need, int(nbytes))
        return lambda: self._scratch

    # -- building the steps ---------------------------------------------------------------------
    def _build(self, k: int, step: Any) -> None:
        path = step_path(step)
        try:
            if path == "view":
                self._views(step)
                self.paths.append(path)
                return
            for v in step.outputs:
                if v not in self.env:
                    self.env[v] = self._output_view(v) if v in self._output_views else self._array(v)
            sub = step.graph
            local = {s: self.env[v] for s, v in zip(sub.inputs, step.inputs)}
            outs = [self.env[v] for v in step.outputs]
            fns, n = None, 0
            if path == "generated":
                try:
                    fns, n = self._fused(sub, local, dict(zip(sub.outputs, outs)), step.config_dict)
                except Exception as e:  # noqa: BLE001 - the generator's refusal is a result
                    path = OP_BY_OP
                    self.fallbacks.append(f"step {k} ({'+'.join(step.ops)}): generated kernel "
                                          f"failed ({_one_line(e, 200)}); ran op by op in CuPy")
            elif path != OP_BY_OP:
                fns, n = self._single(sub, local, dict(zip(sub.outputs, outs)))
            if fns is None and step.config_dict.get("epilogue") == GELU_BIAS:  # else op by op, noted
                fns, n, path = gelu_bias_step(self, sub, {**local, **dict(zip(sub.outputs, outs))}, k, step)
            if fns is None:
                if path == OP_BY_OP and step.kind == "fused" and not step.config:
                    self.fallbacks.append(f"step {k} ({'+'.join(step.ops)}): no schedule; ran op by op")
                ev = Evaluator(self.cp, sub, self.eval_ops)
                fn, n = ev.launch([local[s] for s in sub.inputs], outs)
                fns = [fn]
        except ExecutorError:
            raise
        except Exception as e:  # noqa: BLE001 - one line naming the step
            raise ExecutorError(f"plan step {k} ({step.kind} {'+'.join(step.ops)}): {_one_line(e)}") from None
        self._launch_fns += fns
        self.launches += n
        self.paths.append(path)

    def _output_view(self, v: str) -> Any:
        """``v`` as the strided view of the later output-view step's output (``executor_views``),
        which gets its planned buffer here."""
        step = self.plan.steps[self._output_views[v]]
        owner = step.outputs[0]
        if owner not in self.env:
            self.env[owner] = self._array(owner)
        view = input_view(step, self.env[owner])
        if view.data.mem is not self.env[owner].data.mem or view.data.ptr != self.env[owner].data.ptr:
            raise ExecutorError(f"output view {'+'.join(step.ops)}: {v!r} is not a view of {owner!r}")
        self._owned.add(v)
        return view

    def _views(self, step: Any) -> None:
        if is_output_view(step):  # its input, written by the matmul, already is its output
            if step.outputs[0] not in self.env or step.inputs[0] not in self.env:
                raise ExecutorError(f"output view {'+'.join(step.ops)}: no matmul wrote {step.inputs[0]!r}")
            return
        if is_concat_view(step):  # the producers wrote their slices of its planned output
            self.env[step.outputs[0]] = self._array(step.outputs[0])
            check_concat_written(step, self.env)  # ValueError: _build names the step
            return
        sub = step.graph
        local = {s: self.env[v] for s, v in zip(sub.inputs, step.inputs)}
        for name, c in sub.constants:
            local[name] = self.cp.asarray(_const_storage(c))
        types = sub.type_map
        for node in sub.nodes:
            src = local[node.inputs[0]]
            a = check_node(node, [types[v] for v in node.inputs])[1]
            shapes = [types[o].shape for o in node.outputs]
            for o, view in zip(node.outputs, device_views(node.op, a, src, shapes)):
                if view.data.mem is not src.data.mem:  # CuPy copies what no strides express
                    raise ExecutorError(f"view step {'+'.join(step.ops)}: {node.op} of a "
                                        f"{src.shape} array with strides {src.strides} needs a copy")
                local[o] = view
        for s, v in zip(sub.outputs, step.outputs):
            self.env[v] = local[s]

    def _single(self, sub: Graph, local: dict[str, Any], outs: dict[str, Any]) -> tuple[list[Any], int]:
        cp, node = self.cp, sub.nodes[0]
        types = sub.type_map
        for name, c in sub.constants:
            local[name] = cp.asarray(_const_storage(c))
        a = check_node(node, [types[v] for v in node.inputs])[1]
        ins = [local[v] for v in node.inputs]
        # Outputs nobody reads (a split's unused part) still need somewhere to go.
        res = [outs[o] if o in outs else cp.empty(types[o].shape, dtype=storage_dtype(types[o].dtype))
               for o in node.outputs]
        out_dtype = types[node.outputs[0]].dtype
        if node.op in COMPUTE_DIRECT:
            dtypes = [types[v].dtype for v in node.inputs]
            built = compute_launch(cp, self.ops, node, a, dtypes, ins, res, out_dtype)
            if built is not None:
                return built[0], built[1]
        lay = layout_launch(cp, node, a, ins, res, out_dtype)
        if lay is None:
            raise ExecutorError(f"no direct implementation of {node.op}")
        return lay

    def _fused(self, sub: Graph, local: dict[str, Any], outs: dict[str, Any],
               config: dict) -> tuple[list[Any], int]:
        kp = generate(sub, Schedule.from_config(config), sm_count=self.sm_count)
        named = {**local, **outs}
        written = {a for k in kp.kernels for a in k.args if isinstance(a, str)}
        missing = [o for o in sub.outputs if o not in written]
        if missing:
            raise ExecutorError(f"the generated kernels do not write output {missing[0]!r}")
        offsets, total = {}, 0
        for name, nbytes in kp.scratch:
            offsets[name] = (total, int(nbytes))
            total += -(-max(1, int(nbytes)) // ALIGN) * ALIGN
        get = self._scratch_getter(total)
        zeroed = set(getattr(kp, "zeroed", ()) or ())
        funcs = [kernel_function(self.cp, self._modules, k) for k in kp.kernels]
        ready: dict[str, Any] = {}

        def resolve() -> None:
            # The arena exists once every step is built: bind the scratch slices at first run.
            buf = get()
            scratch = {n: buf[o:o + nb] for n, (o, nb) in offsets.items()}
            try:
                ready["launch"] = launcher(funcs, kp.kernels, {**named, **scratch},
                                           [scratch[n] for n in offsets if n in zeroed])
            except KeyError as e:
                raise ExecutorError(str(e.args[0])) from None

        def run() -> None:  # on the current stream: the executor's, made so by its caller
            if not ready:
                resolve()
            ready["launch"]()

        return [run], len(kp.kernels)

    # -- running --------------------------------------------------------------------------------
    def _fill_sample_inputs(self) -> None:
        """Valid random inputs for the first run and the capture check (``make_inputs``: gather
        indices in range, other integers 0/1 masks, so the eager-vs-replay check is not vacuous
        on all-NaN outputs)."""
        dev, _ = make_inputs(self.graph, 0)
        for v, a in dev.items():
            self.inputs[v].set(np.ascontiguousarray(a, dtype=self.inputs[v].dtype))

    def _enqueue(self) -> None:
        for fn in self._launch_fns:
            fn()

    def _outputs_now(self) -> dict[str, Any]:
        return {v: self.env[v].copy() for v in dict.fromkeys(self.graph.outputs)}

    def _same(self, a: Any, b: Any, dtype: str) -> bool:
        cp = self.cp
        if dtype in FLOAT_DTYPES:
            x, y = load(cp, a, dtype).astype(cp.float32), load(cp, b, dtype).astype(cp.float32)
            return bool(cp.allclose(x, y, rtol=1e-3, atol=1e-5, equal_nan=True))
        return bool(cp.array_equal(a, b))

    def _record(self) -> tuple[Any, Any, BaseException | None]:
        """One ``_enqueue`` captured as a CUDA graph on the executor's stream: (graph, the pool
        its temporaries live in, the error that stopped it)."""
        cp = self.cp
        pool = cp.cuda.MemoryPool()
        graph, err = None, None
        # No garbage collection while capturing: a finalizer that frees device memory or
        # destroys a handle would break the capture.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            # Temporaries made during capture come from this pool, which no one else uses and
            # which lives as long as the graph: the graph's replays own those addresses.
            with current_stream(self.cp, self.stream), cp.cuda.using_allocator(pool.malloc):
                self.stream.begin_capture()
                try:
                    self._enqueue()
                except Exception as e:  # noqa: BLE001
                    err = e
                try:
                    graph = self.stream.end_capture()
                except Exception as e:  # noqa: BLE001
                    err = err or e
        except Exception as e:  # noqa: BLE001 - begin_capture refused
            err = e
        finally:
            if gc_was_on:
                gc.enable()
        return graph, pool, err

    def _capture(self, verify: bool) -> None:
        with current_stream(self.cp, self.stream):
            eager = self._outputs_now() if verify else {}
        graph, pool, err = self._record()
        if err is not None or graph is None:
            why = _one_line(err or RuntimeError("no graph"))
            self.capture_error = f"capture failed, launching eagerly: {why}"
            self.stream.synchronize()
            return
        self._graph, self._graph_pool = graph, pool
        if verify:
            try:
                with current_stream(self.cp, self.stream):
                    for v in eager:
                        if v in self._owned:
                            self.env[v].fill(0)  # a replay that writes nothing must not pass
                    graph.launch(self.stream)
                    got = self._outputs_now()
                self.stream.synchronize()
            except Exception as e:  # noqa: BLE001 - the graph does not replay: launch eagerly
                self._graph = self._graph_pool = None
                self.capture_error = f"graph replay failed, launching eagerly: {_one_line(e)}"
                return
            for v in eager:
                if not self._same(got[v], eager[v], self.types[v].dtype):
                    self._graph = self._graph_pool = None
                    self.capture_error = f"graph replay differs from the eager run on {v!r}; eager launches"
                    with current_stream(self.cp, self.stream):
                        self._enqueue()
                    self.stream.synchronize()
                    return
        self.graph_capture = True

    def replay(self) -> None:
        """Enqueue one run on the inputs already in place (the graph, or every launch eagerly)."""
        if self._graph is not None:
            self._graph.launch(self.stream)
        else:
            with current_stream(self.cp, self.stream):
                self._enqueue()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def bind(self, arrays: Mapping[str, Any]) -> Any:
        """Another CUDA graph of the plan on other memory: it reads graph inputs from, and writes
        graph outputs to, the device arrays in ``arrays`` (each in the value's stored form,
        ``bindable``) instead of the executor's buffers: a caller's tensors bound by pointer,
        with no copy. The caller keeps them alive and orders its own use of them against the
        launches. The steps are rebuilt on them (the same buffers, kernels and constants), run
        once eagerly, captured, and the replay is checked against the plan's own graph on the
        same inputs. Returns the graph: ``launch(stream)``. An output that a view step makes
        (memory of another value) cannot be bound."""
        cp = self.cp
        if self._graph is None:
            raise ExecutorError(f"no CUDA graph to bind into ({self.capture_error})")
        made = {v: step_path(s) for s in self.plan.steps for v in s.outputs}
        for v, a in arrays.items():
            why = bindable(self.graph, v, a.dtype, a.shape, a.strides, a.data.ptr)
            if not why and v not in self.graph.inputs and made.get(v, "view") == "view":
                why = f"output {v!r} is not written by a kernel of its own (a view or an input)"
            if why:
                raise ExecutorError(why)
        saved = (self.env, self._launch_fns, self.launches, self.paths, self.fallbacks)
        self.env = {**self.env, **arrays}
        self._launch_fns, self.launches, self.paths, self.fallbacks = [], 0, [], []
        try:
            with current_stream(cp, self.stream):
                for k, step in enumerate(self.plan.steps):
                    self._build(k, step)
                self._enqueue()  # first use of each rebuilt launch outside the capture
            graph, pool, err = self._record()
        finally:
            self.env, self._launch_fns, self.launches, self.paths, self.fallbacks = saved
        if err is not None or graph is None:
            raise ExecutorError(f"bound capture failed: {_one_line(err or RuntimeError('no graph'))}")
        outs = list(dict.fromkeys(self.graph.outputs))
        with current_stream(cp, self.stream):
            for v, a in arrays.items():
                if v in self.inputs:
                    cp.copyto(self.inputs[v], a)
            self._graph.launch(self.stream)
            want = self._outputs_now()
            for v in outs:
                if v in arrays or v in self._owned:
                    arrays.get(v, self.env[v]).fill(0)  # a replay that writes nothing must not pass
            graph.launch(self.stream)
            got = {v: arrays.get(v, self.env[v]).copy() for v in outs}
        self.stream.synchronize()
        for v in outs:
            if not self._same(got[v], want[v], self.types[v].dtype):
                raise ExecutorError(f"graph bound to other memory differs on {v!r}")
        self._bound_graphs.append((graph, pool))  # its temporaries live as long as it
        return graph

    def set_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Check ``inputs`` and copy them into the persistent input buffers (on the stream)."""
        cp = self.cp
        arrays = prepare_inputs(self.graph, inputs)
        self.stream.wait_event(cp.cuda.get_current_stream().record())  # device inputs made there
        with current_stream(self.cp, self.stream):
            for v, a in arrays.items():
                buf = self.inputs[v]
                if isinstance(a, np.ndarray):
                    buf.set(a, stream=self.stream)
                    continue
                a = cp.asarray(a)
                if self.types[v].dtype == "bfloat16" and a.dtype == cp.float32:
                    cp.copyto(buf, to_bf16_bits(cp, a))
                elif str(a.dtype) == "bfloat16":
                    cp.copyto(buf, a.view(cp.uint16))
                else:
                    cp.copyto(buf, a)

    def outputs(self, copy: bool = True) -> dict[str, Any]:
        """The graph outputs after the last run (bfloat16 widened to float32). ``copy=False``
        gives views of the executor's buffers, which the next run overwrites."""
        cp = self.cp
        out = {}
        with current_stream(self.cp, self.stream):
            for v in dict.fromkeys(self.graph.outputs):
                a, dtype = self.env[v], self.types[v].dtype
                if dtype in ("bfloat16",):
                    out[v] = load(cp, a, dtype)
                else:
                    out[v] = a.copy() if copy else a
        cp.cuda.get_current_stream().wait_event(self.stream.record())
        return out

    def run(self, inputs: Mapping[str, Any], copy: bool = True) -> dict[str, Any]:
        """Copy ``inputs`` in, run the plan, return the outputs (cupy arrays, ordered after the
        run on the caller's current stream)."""
        self.set_inputs(inputs)
        self.replay()
        return self.outputs(copy)

    def summary(self) -> dict[str, Any]:
        return {"steps": len(self.plan.steps), "plan_kernels": self.plan.kernels, "launches": self.launches,
                "graph_capture": self.graph_capture, "capture_error": self.capture_error,
                "fallbacks": list(self.fallbacks), "paths": list(self.paths), "tf32": self.tf32,
                "arena_bytes": self.plan.buffers.arena_bytes, "unplanned_bytes": self.unplanned_bytes,
                "scratch_bytes": self._scratch_need, "cublas_version": self.blas.version,
                "cublaslt": self.lt is not None, "cublaslt_error": self.lt_error,
                "compile_s": round(self.compile_s, 4),
                "capture_s": round(self.capture_s, 4)}


# -- Plan.run(backend="cuda") ---------------------------------------------------------------------
_CACHE: dict[int, tuple[Any, PlanExecutor]] = {}
_CACHE_SIZE = 4


def executor_for(plan: Any, kind: type[PlanExecutor] = PlanExecutor) -> PlanExecutor:
    """A cached executor of ``plan`` (by identity; a few kept, so repeated ``Plan.run`` calls
    neither recompile nor reallocate); ``kind``: the executor class (staged, packed)."""
    hit = _CACHE.get(id(plan))
    if hit is not None and hit[0]() is plan and type(hit[1]) is kind:
        return hit[1]
    ex = kind(plan)
    while len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    try:
        ref = weakref.ref(plan)
    except TypeError:  # not weak-referenceable: not cached
        return ex
    _CACHE[id(plan)] = (ref, ex)
    return ex


def execute_plan(plan: Any, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Run ``plan`` on ``inputs`` on the GPU; NumPy outputs (bfloat16 widened to float32)."""
    cp = import_cupy()
    outs = executor_for(plan).run(inputs)
    return {k: cp.asnumpy(v) for k, v in outs.items()}

