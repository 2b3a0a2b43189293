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
eager graph's within the dtype's tolerance before the plan is used. Calls reach the plan
through ``torch_handoff.Handoff``: the compiling call's tensors are read by pointer, outputs
land in output slots handed out as they are while the caller holds no earlier one, and
anything else is copied in or out. Anything it cannot take
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

from tunedb.frontends.torch_handoff import Handoff
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
        self.runs: Handoff | None = None  # how calls reach the plan (torch_handoff)
        self.optimize_error = ""  # why the optimizer's graph was not planned (the export's was)
        placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        tensors = all(isinstance(t, torch.Tensor) for t in example_inputs)
        if not tensors or len(placeholders) != len(example_inputs):
            self.fallback = "graph inputs that are not tensors (symbolic sizes or Python values)"
            return
        def plan(model: Any) -> Any:
            return compile_plan(model, cost_model=options.get("cost_model"),
                                db=options.get("db"), fill_initializers=False,
                                gemm_epilogue=bool(options.get("gemm_epilogue", False)),
                                gelu_epilogue=bool(options.get("gelu_epilogue", False)))

        try:
            raw = self._export(example_inputs, placeholders)
            try:
                self.plan = plan(_optimize(type(raw).FromString(raw.SerializeToString())))
            except Exception as e:  # noqa: BLE001 - the optimizer's graph may not import (below)
                # On the H200's onnxscript the folded bf16 ResNet-50 kept a float32 conv weight
                # (call 3, e5983d8); the graph as exported still plans.
                self.optimize_error = _one_line(e)
                self.plan = plan(raw)
        except Exception as e:  # noqa: BLE001 - any failure means: run this graph eagerly
            self.fallback = f"not planned: {_one_line(e)}"
            return
        if not all(t.is_cuda for t in example_inputs):
            self.fallback = "inputs are not on a CUDA device"
            return
        try:
            self.executor = PlanExecutor(self.plan, cublaslt=options.get("cublaslt"))
            self.runs = Handoff(self.executor, self._names, options.get("handoff", "stream"))
            self._verify(example_inputs)  # inputs copied in, outputs copied out
        except Exception as e:  # noqa: BLE001
            self.executor = self.runs = None
            self.fallback = f"not run: {_one_line(e)}"
            return
        user = [example_inputs[i] for i in self.user_inputs]
        self.runs.bind(user, slots=int(options.get("output_slots", 2)),
                       inputs=bool(options.get("bind_inputs", True)))
        if self.runs.inputs_bound or self.runs.slots:
            try:
                self._verify(example_inputs)  # the bound graphs against eager too
            except Exception as e:  # noqa: BLE001 - back to copying both ways
                self.runs = Handoff(self.executor, self._names, self.runs.mode)
                self.runs.errors.append(f"bound graphs: {_one_line(e)}")

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
        return onnx.load_from_string(buf.getvalue())

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

    def _run(self, args: Sequence[Any]) -> list[Any]:
        return self.runs.run([args[i] for i in self.user_inputs])

    def __call__(self, *args: Any) -> Any:
        if self.executor is None:
            return self.gm.forward(*args)
        return tuple(self._run(args))


def tunedb_backend(gm: Any, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile`` backend: ``torch.compile(model, backend=tunedb_backend)``. Options
    (through ``functools.partial``): ``cost_model``, ``db``, ``gemm_epilogue`` and
    ``gelu_epilogue`` as for ``tunedb.compile``; ``cublaslt`` as for ``PlanExecutor`` (None:
    ``TUNEDB_CUBLASLT``); ``handoff`` ("stream" or "caller"), ``bind_inputs`` (default True)
    and ``output_slots`` (default 2) as for ``torch_handoff.Handoff``."""
    g = TunedbGraph(gm, example_inputs, options)
    if g.executor is None:
        warnings.warn(f"tunedb backend: graph runs eagerly ({g.fallback})", stacklevel=2)
    return g
