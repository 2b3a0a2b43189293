"""The ``torch.compile`` backend hands tunedb the graph its ONNX path gets: same plan, same values.

CPU only: the backend plans on the CPU and then runs CPU tensors eagerly, so these tests compare
plans and the planned graph's float64 reference against eager. Skipped where PyTorch or
onnxscript is missing (tunedb does not depend on them; CI has neither).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True) needs it

ROOT = Path(__file__).resolve().parents[1]


def _through_backend(model: Any, args: tuple) -> tuple[list[Any], Any]:
    from tunedb.frontends.torch_backend import TunedbGraph

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(TunedbGraph(gm, example_inputs, {"cost_model": False}))
        return graphs[-1]

    with torch.no_grad():
        got = torch.compile(model, backend=backend)(*args)
    return graphs, got


def _shape(plan: Any) -> tuple:
    """What the comparison holds equal: kernels, their kinds, and the planned graph's ops."""
    return plan.kernels, plan.totals()["by_kind"], Counter(n.op for n in plan.graph.nodes)


class ConvBnRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


@pytest.mark.slow
def test_backend_folds_batch_norm_as_the_onnx_export_does(tmp_path):
    torch.manual_seed(0)
    model = ConvBnRelu().eval()
    with torch.no_grad():  # non-trivial running statistics, so that a lost fold shows
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-1, 1)
    x = torch.randn(1, 8, 12, 12)
    (g,), got = _through_backend(model, (x,))
    assert g.plan is not None, g.fallback
    ops = Counter(n.op for n in g.plan.graph.nodes)
    assert not ops["rsqrt"] and not ops["unsqueeze"]  # no batch norm left as arithmetic
    with torch.no_grad():
        program = torch.onnx.export(model, (x,), dynamo=True, opset_version=18, verbose=False)
    program.save(str(tmp_path / "m.onnx"))
    onnx_plan = compile_plan(onnx.load(str(tmp_path / "m.onnx")), cost_model=False)
    assert _shape(g.plan) == _shape(onnx_plan)
    # The folded graph computes what eager does (float64 reference of the planned graph).
    (name,) = g.plan.graph.inputs
    ref = run_reference(g.plan.graph, {name: x.numpy()})[g.plan.graph.outputs[0]]
    with torch.no_grad():
        want = model(x)
    assert np.abs(ref - want.numpy()).max() <= 1e-5 * float(want.abs().max())
    assert g.fallback == "inputs are not on a CUDA device"  # the CPU: runs eagerly
    torch.testing.assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "bert_base"])
def test_backend_plans_the_zoo_model_as_the_onnx_path(name):
    """The backend's plan of the whole model equals the plan of the zoo's exported file
    (``data/graphs/zoo``, what the zoo benchmark times): same kernels, kinds and graph ops."""
    pytest.importorskip("torchvision" if name == "resnet50" else "transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from export_zoo import MODELS, _FirstOutput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    torch.manual_seed(0)
    model, args, names, _ = MODELS[name]()
    model = _FirstOutput(model, names if "input_ids" in names else None).eval()
    (g,), _ = _through_backend(model, args)
    assert g.plan is not None, g.fallback
    onnx_plan = compile_plan(onnx.load(str(ROOT / f"data/graphs/zoo/{name}_dynamo_fp32.onnx")),
                             cost_model=False)
    assert _shape(g.plan) == _shape(onnx_plan)


class Ffn(torch.nn.Module):
    """A transformer FFN: what the GELU epilogue merges (bias + erf GELU after the first GEMM)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"gemm_epilogue": True, "gelu_epilogue": True, "cublaslt": True}])
def test_backend_matches_eager_on_the_default_and_a_side_stream(options):
    """Called on the default stream, then on a side stream (the plan's stream waits for the
    caller's and the caller's for it): each call's output equals eager within bf16's tolerance,
    on fresh inputs too, with the GELU epilogue merged where asked for."""
    import functools

    from tunedb.frontends.torch_backend import TOLERANCE, TunedbGraph, tunedb_backend

    torch.manual_seed(0)
    model = Ffn().eval().to(torch.bfloat16).cuda()
    graphs: list[TunedbGraph] = []

    def backend(gm, example_inputs):
        graphs.append(functools.partial(tunedb_backend, **options)(gm, example_inputs))
        return graphs[-1]

    fast = torch.compile(model, backend=backend)
    atol, rtol = TOLERANCE["bfloat16"]
    side = torch.cuda.Stream()
    with torch.no_grad():
        for i, stream in enumerate([torch.cuda.current_stream(), side, side]):
            x = torch.randn(1, 16, 64, device="cuda", dtype=torch.bfloat16) * (i + 1)
            with torch.cuda.stream(stream):
                got = fast(x).float()
                want = model(x).float()
            stream.synchronize()
            scale = float(want.abs().max())
            torch.testing.assert_close(got, want, atol=atol * scale, rtol=rtol)
    (g,) = graphs
    assert g.executor is not None and g.executor.graph_capture, g.fallback
    merged = [s for s in g.plan.steps if s.config_dict.get("epilogue") == "gelu_bias"]
    assert len(merged) == (1 if options else 0)
    assert ("cublasLt gelu epilogue" in g.executor.paths) == bool(options), g.executor.fallbacks


@pytest.mark.gpu
@pytest.mark.parametrize("handoff", ["stream", "plan", "caller"])
def test_backend_binds_inputs_and_output_slots_and_copies_otherwise(handoff):
    """The example input is bound by pointer: calls with that tensor (rewritten in place between
    calls) copy nothing in, calls with another tensor copy it in. Outputs come in one of two
    slots while a slot is free, and as copies once the caller holds both. Every output, kept
    ones included, equals eager, on the default and a side stream, for every hand-off mode."""
    from tunedb.frontends.torch_backend import TOLERANCE, TunedbGraph

    torch.manual_seed(0)
    model = Ffn().eval().to(torch.bfloat16).cuda()
    graphs: list[TunedbGraph] = []

    def backend(gm, example_inputs):
        graphs.append(TunedbGraph(gm, example_inputs, {"handoff": handoff}))
        return graphs[-1]

    x = torch.randn(1, 16, 64, device="cuda", dtype=torch.bfloat16)
    fast = torch.compile(model, backend=backend)
    atol, rtol = TOLERANCE["bfloat16"]
    side = torch.cuda.Stream()
    kept = []
    with torch.no_grad():
        fast(x)
        (g,) = graphs
        runs = g.runs
        assert runs is not None and runs.inputs_bound and runs.slots == 2, (g.fallback, runs and runs.errors)
        before = dict(runs.calls)
        other = torch.randn_like(x)
        for i, (arg, stream) in enumerate([(x, None), (other, None), (x, side), (other, side), (x, None),
                                           (other, None)]):
            with torch.cuda.stream(stream or torch.cuda.current_stream()):
                arg.mul_(1.5)  # new values in the same memory, written on the calling stream
                got = fast(arg)
                want = model(arg).float()
                if i < 3:
                    kept.append((got, want))  # held: calls 0 and 1 take both slots, then copies
            torch.cuda.synchronize()
            scale = float(want.abs().max())
            torch.testing.assert_close(got.float(), want, atol=atol * scale, rtol=rtol, msg=f"call {i}")
    for got, want in kept:  # later calls did not overwrite what the caller kept
        scale = float(want.abs().max())
        torch.testing.assert_close(got.float(), want, atol=atol * scale, rtol=rtol)
    calls = {k: runs.calls.get(k, 0) - before.get(k, 0) for k in runs.calls}
    # (inputs bound, output in a slot): slots until the kept outputs hold both, copies after
    assert calls == {(True, True): 1, (False, True): 1, (True, False): 2, (False, False): 2}, calls
