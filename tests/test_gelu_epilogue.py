"""``compile(gelu_epilogue=True)``: a GEMM, its bias and its GELU as one cuBLASLt GELU_BIAS step
(``tunedb.plan.gelu_epilogue``), for bfloat16 plans only; the CPU tests check the pattern, the
bound that decides the dtypes and the plans, the GPU tests run them verified against the erf
reference with and without cuBLASLt."""

from __future__ import annotations

import math

import numpy as np
import pytest
from plan_checks import check_outputs

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.plan.gelu_epilogue import GELU_EPILOGUE_DTYPES
from tunedb.plan.record import Plan
from tunedb.runtime.executor_lt import GELU_BIAS, GELU_TANH_MAX_ABS_ERR, bias_gelu_parts

FORMS = ("erf_div", "erf_mul", "gelu_op")


def _ffn(dtype: str, form: str = "erf_div", layers: int = 1, half: float = 0.5,
         bias_rows: int = 0, expose_h: bool = False) -> Graph:
    """``layers`` FFN blocks ``GELU(x @ W1 + b1) @ W2`` on x [1, 16, 32]; the GELU as the dynamo
    exporter writes it (``erf_div``: h * (0.5 * (erf(h / sqrt2) + 1))), as TorchScript's does
    (``erf_mul``: (h * 0.5) * (1 + erf(h * 1/sqrt2))), or one ``gelu`` node. ``half``, ``bias_rows``
    and ``expose_h`` make graphs the pass must leave alone."""
    rng = np.random.default_rng(3)
    b = GraphBuilder(f"ffn_{form}_{dtype}")
    x = b.input("x", (1, 16, 32), dtype)
    for _ in range(layers):
        w1 = b.constant((rng.standard_normal((32, 64)) / math.sqrt(32)).astype(np.float32), dtype=dtype)
        b1 = b.constant(rng.standard_normal((bias_rows, 64) if bias_rows else (64,)).astype(np.float32),
                        dtype=dtype)
        h = b.add(b.matmul(x, w1), b1)
        if form == "gelu_op":
            y = b.gelu(h)
        elif form == "erf_div":
            e = b.erf(b.div(h, b.scalar(2 ** 0.5, h)))
            y = b.mul(h, b.mul(b.add(e, b.scalar(1.0, h)), b.scalar(half, h)))
        else:
            e = b.erf(b.mul(h, b.scalar(2 ** -0.5, h)))
            y = b.mul(b.mul(h, b.scalar(half, h)), b.add(b.scalar(1.0, h), e))
        w2 = b.constant((rng.standard_normal((64, 32)) / math.sqrt(64)).astype(np.float32), dtype=dtype)
        x = b.matmul(y, w2)
    return b.build([x, h] if expose_h else [x])


def _gelu_part(g: Graph) -> Graph:
    """The first FFN's matmul, bias add and GELU: the group the pass merges."""
    from tunedb.plan.subgraph import GraphIndex

    second = [i for i, n in enumerate(g.nodes) if n.op == "matmul"][1]
    return GraphIndex(g).cut(range(second)).graph


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_exported_gelu_forms_are_recognised(form, dtype):
    g = _gelu_part(_ffn(dtype, form))
    parts = bias_gelu_parts(g)
    assert parts is not None
    assert (parts.x, parts.out, parts.trans_b) == (g.inputs[0], g.outputs[0], False)
    assert g.type_of(parts.w).shape == (32, 64) and g.type_of(parts.bias).shape == (64,)


@pytest.mark.parametrize("kw", [{"half": 0.6}, {"bias_rows": 16}, {"expose_h": True}])
def test_other_arithmetic_is_not_taken_for_a_gelu(kw):
    """A wrong constant, a bias that is not a vector, the pre-activation read elsewhere."""
    g = _ffn("bfloat16", **kw)
    if kw.get("expose_h"):  # the cut then has the bias add's output as a second output
        from tunedb.plan.subgraph import GraphIndex

        second = [i for i, n in enumerate(g.nodes) if n.op == "matmul"][1]
        part = GraphIndex(g).cut(range(second)).graph
        assert len(part.outputs) == 2
    else:
        part = _gelu_part(g)
    assert bias_gelu_parts(part) is None


def test_the_tanh_error_bound_is_the_max_and_admits_bfloat16_only():
    """GELU_TANH_MAX_ABS_ERR is the largest |erf GELU - tanh GELU| (a fine grid over [-10, 10];
    beyond, both are x or 0 to far below it), and it is within a tenth of bfloat16's atol only."""
    x = np.linspace(-10, 10, 400_001)
    erf = np.vectorize(math.erf)(x / math.sqrt(2))
    tanh = np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))
    err = np.abs(0.5 * x * (1 + erf) - 0.5 * x * (1 + tanh))
    assert err.max() == pytest.approx(GELU_TANH_MAX_ABS_ERR, rel=2e-3)
    assert abs(x[err.argmax()]) == pytest.approx(2.70, abs=0.01)
    assert GELU_EPILOGUE_DTYPES == frozenset({"bfloat16"})


def _plan(dtype: str, form: str = "erf_div", gelu: bool = True, layers: int = 2) -> Plan:
    from tunedb.plan import compile

    return compile(_ffn(dtype, form, layers=layers), device=None, cost_model=False, gelu_epilogue=gelu)


@pytest.mark.parametrize("form", FORMS)
def test_bfloat16_plans_merge_each_ffn_up_into_one_gelu_bias_step(form):
    plain, merged = _plan("bfloat16", form, gelu=False), _plan("bfloat16", form)
    steps = [s for s in merged.steps if s.config_dict.get("epilogue") == GELU_BIAS]
    assert len(steps) == 2 and merged.kernels == plain.kernels - 2
    for s in steps:
        assert s.kind == "gemm" and s.launches == 1 and s.config_dict["gelu"] == "tanh"
        assert s.ops[0] == "matmul" and bias_gelu_parts(s.graph) is not None
    merged.check()  # each step the cut of its nodes, every node once, in order
    again = Plan.from_json(merged.to_json())
    assert [s.config_dict for s in again.steps] == [s.config_dict for s in merged.steps]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_other_dtypes_keep_the_erf_gelu_kernel(dtype):
    """The tanh form's error is not far inside float32's or float16's tolerance."""
    plan = _plan(dtype)
    assert not [s for s in plan.steps if s.config_dict.get("epilogue") == GELU_BIAS]
    assert plan.kernels == _plan(dtype, gelu=False).kernels


@pytest.mark.gpu
@pytest.mark.parametrize("cublaslt", [True, False])
def test_gelu_bias_steps_run_verified_against_the_erf_reference(cublaslt):
    """One cuBLASLt launch per merged step (within the bf16 tolerance of the erf reference);
    without cuBLASLt the step runs op by op, noted as a fallback, and still verifies."""
    from tunedb.plan import compile
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs

    plan = compile(_ffn("bfloat16", layers=2), device="cuda", gelu_epilogue=True)
    ex = PlanExecutor(plan, cublaslt=cublaslt)
    assert (ex.lt is not None) == cublaslt, ex.lt_error
    dev, ref_in = make_inputs(plan.graph, 0)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.paths.count("cublasLt gelu epilogue") == (2 if cublaslt else 0)
    assert len([f for f in ex.fallbacks if "GELU_BIAS" in f]) == (0 if cublaslt else 2)
    if cublaslt:
        assert ex.launches == plan.kernels and ex.graph_capture, ex.capture_error
