"""A ``torch.compile`` backend backed by tunedb's plans.

    import torch
    from tunedb.frontends.torch_backend import tunedb_backend

    fast = torch.compile(model.eval().cuda(), backend=tunedb_backend)
    y = fast(x)

TorchDynamo hands the backend each captured FX graph with example inputs. The backend exports
that graph to ONNX with PyTorch's own exporter (``torch.onnx.export(..., dynamo=True)``), bakes
the lifted parameters and buffers in as initializers (weights are frozen at compile time:
inference only), plans it with ``tunedb.compile`` and runs the plan with ``PlanExecutor`` on
the inputs' CUDA device. The plan's outputs on the example inputs are checked against the
eager graph's within the dtype's tolerance before the plan is used. Anything it cannot take
(an export or import failure, CPU tensors, no GPU, a mismatch) makes that graph run eagerly,
with a one-line warning naming why; the graph break's other pieces are unaffected.

Not imported by ``import tunedb`` (it imports torch).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunedb.plan.driver import compile as compile_plan
from tunedb.runtime.executor import PlanExecutor

TOLERANCE = {"float32": (1e-4, 1e-3), "float16": (1e-2, 2e-2), "bfloat16": (2e-2, 5e-2)}


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


def _is_weight(name: str) -> bool:
    # Dynamo lifts module parameters and buffers into placeholders named after their path.
    return "_parameters_" in name or "_buffers_" in name


def _optimize(model: Any) -> Any:
    """The exporter's own optimizer, run again now that the weights are initializers: at export
    time they were graph inputs, so batch norms stayed unfolded (ResNet-50: 53 of them kept as
    per-element arithmetic) where ``torch.onnx.export`` of the module folds them into the convs.
    With it the backend hands tunedb the same graph as the module's ONNX export."""
    from onnxscript import optimizer

    return optimizer.optimize(model)


def _torch_view(a: Any, dtype: str) -> Any:
    """A torch tensor on a CuPy array's memory (bfloat16 is stored as uint16 bits; int16 crosses
    DLPack everywhere)."""
    import cupy as cp
    import torch

    if dtype == "bfloat16":
        return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def _cupy_view(t: Any) -> Any:
    """A CuPy array on a torch CUDA tensor's memory, in the executor's stored form (bfloat16 as
    uint16 bits), by ``__cuda_array_interface__`` (it holds the tensor)."""
    import cupy as cp
    import torch

    if t.dtype == torch.bfloat16:
        return cp.asarray(t.view(torch.int16)).view(cp.uint16)
    return cp.asarray(t)


def same_memory(held: Sequence[Any], given: Sequence[Any], ptrs: Sequence[int]) -> bool:
    """Whether each given tensor is the held one's memory as it was bound (``ptrs``, its address
    then): same address, shape, strides and dtype, so a graph that reads ``held`` by pointer
    reads ``given``. The held tensors stay alive, so their addresses cannot be reused."""
    for h, g, p in zip(held, given, ptrs, strict=True):
        if g.data_ptr() != p or g.shape != h.shape or g.stride() != h.stride() or g.dtype != h.dtype:
            return False
    return True


class TunedbGraph:
    """One captured FX graph as a tunedb plan; calling it runs the plan (or eager, see
    ``fallback``). ``plan`` is None when the graph could not be planned."""

    def __init__(self, gm: Any, example_inputs: Sequence[Any], options: dict[str, Any]) -> None:
        import torch

        self.gm = gm
        self.plan = None
        self.executor = None
        self.fallback = ""
        self.user_inputs: list[int] = []
        self._names: list[str] = []
        # How a call hands over to the plan: "stream" (the plan's own stream, two waits) or
        # "caller" (the CUDA graph launched on the caller's stream).
        self.handoff = options.get("handoff", "stream")
        self._bound_graph: Any = None
        self.bound_error = ""
        self.calls_bound = self.calls_copied = 0
        placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        tensors = all(isinstance(t, torch.Tensor) for t in example_inputs)
        if not tensors or len(placeholders) != len(example_inputs):
            self.fallback = "graph inputs that are not tensors (symbolic sizes or Python values)"
            return
        try:
            model = self._export(example_inputs, placeholders)
            self.plan = compile_plan(model, cost_model=options.get("cost_model"),
                                     db=options.get("db"), fill_initializers=False,
                                     gemm_epilogue=bool(options.get("gemm_epilogue", False)),
                                     gelu_epilogue=bool(options.get("gelu_epilogue", False)))
        except Exception as e:  # noqa: BLE001 - any failure means: run this graph eagerly
            self.fallback = f"not planned: {_one_line(e)}"
            return
        if not all(t.is_cuda for t in example_inputs):
            self.fallback = "inputs are not on a CUDA device"
            return
        try:
            self.executor = PlanExecutor(self.plan, cublaslt=options.get("cublaslt"))
            self._verify(example_inputs)
        except Exception as e:  # noqa: BLE001
            self.executor = None
            self.fallback = f"not run: {_one_line(e)}"
            return
        if not options.get("bind_inputs", True):
            self.bound_error = "bind_inputs=False"
            return
        try:
            self._bind_pointers(example_inputs)
            self._verify(example_inputs)  # the bound path against eager too
        except Exception as e:  # noqa: BLE001 - the copied path stays
            self._bound_graph = None
            self.bound_error = _one_line(e)

    def _export(self, example_inputs: Sequence[Any], placeholders: list[str]) -> Any:
        """The FX graph as an ONNX model whose weights are initializers, inputs the rest."""
        import onnx
        import torch
        from onnx import numpy_helper

        self.gm.eval()  # dynamo's GraphModule starts in training mode; the graph is fixed
        with torch.no_grad():
            program = torch.onnx.export(self.gm, tuple(example_inputs), dynamo=True,
                                        opset_version=18, verbose=False)
        model = program.model_proto
        onnx_inputs = list(model.graph.input)
        if len(onnx_inputs) != len(example_inputs):
            raise ValueError(f"exported graph has {len(onnx_inputs)} inputs for "
                             f"{len(example_inputs)} FX placeholders")
        keep = []
        for i, (vi, t, name) in enumerate(zip(onnx_inputs, example_inputs, placeholders)):
            if not _is_weight(name):
                keep.append(vi)
                self.user_inputs.append(i)
                self._names.append(vi.name)
                continue
            a = t.detach().cpu()
            if a.dtype == torch.bfloat16:
                import ml_dtypes

                arr = a.float().numpy().astype(ml_dtypes.bfloat16)
            else:
                arr = a.numpy()
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(arr), vi.name))
        del model.graph.input[:]
        model.graph.input.extend(keep)
        buf = io.BytesIO()  # a round trip drops the exporter's in-memory external data links
        onnx.save(model, buf)
        return _optimize(onnx.load_from_string(buf.getvalue()))

    def _verify(self, example_inputs: Sequence[Any]) -> None:
        import torch

        with torch.no_grad():
            want = self.gm(*example_inputs)
        got = self._run(example_inputs)
        want = [want] if isinstance(want, torch.Tensor) else list(want)
        for w, g in zip(want, got):
            atol, rtol = TOLERANCE.get(str(w.dtype).removeprefix("torch."), (1e-4, 1e-3))
            scale = float(w.float().abs().max()) or 1.0
            if not torch.allclose(g.float(), w.float(), atol=atol * scale, rtol=rtol):
                err = float((g.float() - w.float()).abs().max())
                raise ValueError(f"plan output differs from eager: max abs error {err:.3g} "
                                 f"(output scale {scale:.3g})")

    def _bind(self) -> None:
        """Torch views of the executor's input and output buffers, made once: a copied call then
        costs one torch copy per input and per output and two stream waits, with no CuPy
        wrapping, no per-call input checks and no widening of bf16 outputs (the bits are viewed
        as torch.bfloat16)."""
        import torch

        ex = self.executor
        self._in_views = [_torch_view(ex.inputs[n], ex.graph.type_of(n).dtype) for n in self._names]
        self._out_views = [_torch_view(ex.env[v], ex.graph.type_of(v).dtype) for v in ex.graph.outputs]
        self._torch_stream = torch.cuda.ExternalStream(ex.stream.ptr)
        self._cupy_streams: dict[int, Any] = {}  # caller's stream -> the same stream, for CuPy
        self._last_caller: Any = None  # the stream the last call came from

    def _bind_pointers(self, example_inputs: Sequence[Any]) -> None:
        """The plan captured a second time reading the example inputs by pointer (``bindable``:
        stored dtype, shape, C-contiguous, aligned; the executor checks its replay against the
        copied path): a later call with those same tensors (same addresses, held alive here)
        runs with no input copy. Any other call copies, as before. ``bound_error`` says why not."""
        import torch

        torch.cuda.synchronize()  # the example inputs are complete before the eager bound run
        arrays = {}
        for name, i in zip(self._names, self.user_inputs):
            t = example_inputs[i].detach()
            arrays[name] = _cupy_view(t)
        self._bound_graph = self.executor.bind_inputs(arrays)
        self._bound_tensors = [example_inputs[i] for i in self.user_inputs]  # keeps the addresses ours
        self._bound_ptrs = [t.data_ptr() for t in self._bound_tensors]

    def _is_bound(self, args: Sequence[Any]) -> bool:
        return self._bound_graph is not None and same_memory(
            self._bound_tensors, [args[i] for i in self.user_inputs], self._bound_ptrs)

    def _run(self, args: Sequence[Any]) -> list[Any]:
        import torch

        if not hasattr(self, "_in_views"):
            self._bind()
        bound = self._is_bound(args)
        caller = torch.cuda.current_stream()
        if self._last_caller is not None and self._last_caller != caller:
            # The last run is ordered before its caller's stream only: a call from another stream
            # waits for it before writing the input buffers or replaying over its outputs.
            caller.wait_stream(self._last_caller)
        self._last_caller = caller
        if bound:
            self.calls_bound += 1
        else:
            self.calls_copied += 1
            for buf, i in zip(self._in_views, self.user_inputs):
                t = args[i]
                if t.shape != buf.shape:  # copy_ would broadcast
                    raise ValueError(f"input {i}: expected shape {tuple(buf.shape)}, got {tuple(t.shape)}")
                buf.copy_(t)  # on torch's current stream; casts as the executor would (int64 ids)
        ex = self.executor
        graph = self._bound_graph if bound else ex._graph
        if self.handoff == "caller" and graph is not None:
            # The graph on the caller's stream: no waits, the copy-out right behind it.
            ptr = caller.cuda_stream
            if ptr not in self._cupy_streams:
                import cupy as cp

                self._cupy_streams[ptr] = cp.cuda.ExternalStream(ptr)
            graph.launch(self._cupy_streams[ptr])
        else:
            self._torch_stream.wait_stream(caller)  # the plan's stream waits for the inputs
            if bound:
                graph.launch(ex.stream)
            else:
                ex.replay()
            caller.wait_stream(self._torch_stream)  # and the caller's for the plan
        # Copies, not views: the next call overwrites the plan's buffers.
        return [y.clone(memory_format=torch.contiguous_format) for y in self._out_views]

    def __call__(self, *args: Any) -> Any:
        if self.executor is None:
            return self.gm.forward(*args)
        return tuple(self._run(args))


def tunedb_backend(gm: Any, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile`` backend: ``torch.compile(model, backend=tunedb_backend)``. Options
    (through ``functools.partial``): ``cost_model``, ``db``, ``gemm_epilogue`` and
    ``gelu_epilogue`` as for ``tunedb.compile``; ``cublaslt`` as for ``PlanExecutor`` (None:
    ``TUNEDB_CUBLASLT``)."""
    g = TunedbGraph(gm, example_inputs, options)
    if g.executor is None:
        warnings.warn(f"tunedb backend: graph runs eagerly ({g.fallback})", stacklevel=2)
    return g
