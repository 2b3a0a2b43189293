"""Concat views (``compile(concat_views=True)``): a channel concat at batch 1 puts each input in a
contiguous slice of its output, so each producer writes its slice and the concat is no kernel.
The plans run under the executor's memory layout on the CPU (``_emulate``: planned buffers of NaN
bytes, the executor's own check that every input sits at its slice), against the reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import test_zoo_attention_plan as emulation

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.graph.reference import run_reference
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.record import Plan
from tunedb.runtime.executor_views import concat_slices, is_concat_view
from tunedb.runtime.inputs import make_inputs

GRAPHS = Path(__file__).resolve().parents[1] / "data" / "graphs"


def _fire_modules(batch: int = 1, channels: int = 16, size: int = 13, modules: int = 2) -> Graph:
    """SqueezeNet 1.1's fire modules: squeeze 1x1 + ReLU, then expand 1x1 and 3x3 (+ ReLU each),
    concatenated on the channels; the next module reads the concat."""
    b = GraphBuilder(f"fire_b{batch}")
    rng = np.random.default_rng(3)
    x = b.input("x", (batch, channels, size, size))

    def conv(v: str, cout: int, k: int) -> str:
        cin = b.type_of(v).shape[1]
        w = b.constant((rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32))
        bias = b.constant(rng.standard_normal(cout).astype(np.float32) * 0.1)
        p = k // 2
        return b.relu(b.conv2d(v, w, bias, strides=(1, 1), pads=(p, p, p, p), dilations=(1, 1), groups=1))

    for _ in range(modules):
        s = conv(x, channels // 2, 1)
        x = b.concat(conv(s, channels, 1), conv(s, channels, 3), axis=1)
    return b.build([b.max_pool2d(x, kernel=(3, 3), strides=(2, 2), pads=(0, 0, 0, 0))])


def _check(plan: Plan, tol: float = 1e-4) -> None:
    _, host = make_inputs(plan.graph, 3)
    want, got = run_reference(plan.graph, host), emulation._emulate(plan, host)
    for v in plan.graph.outputs:
        np.testing.assert_allclose(got[v], want[v], rtol=tol, atol=tol)


def _slices_in_place(plan: Plan) -> None:
    """Every input of a concat view is assigned its slice of the concat's bytes."""
    assign = plan.buffers.assignment
    for s in plan.steps:
        if is_concat_view(s):
            buf, base = assign[s.outputs[0]]
            for v, off in concat_slices(s).items():
                assert assign[v] == (buf, base + off), (v, assign[v], buf, base + off)


def test_fire_modules_write_their_slices_and_no_concat_kernel_is_left():
    g = _fire_modules()
    plain = compile_plan(g, device=None)
    plan = compile_plan(g, device=None, concat_views=True)
    assert sum("concat" in s.ops for s in plain.steps if s.kind != "layout_view") == 2
    assert sum(map(is_concat_view, plan.steps)) == 2
    assert all("concat" not in s.ops for s in plan.steps if not is_concat_view(s))
    _slices_in_place(plan)
    _check(plan)


def test_the_emulation_fails_a_plan_without_the_slices():
    """The same steps with the buffers planned as if the concats were copies: the executor's
    check refuses it, and without that check the output is wrong (NaN bytes in the concats)."""
    plan = compile_plan(_fire_modules(), device=None, concat_views=True)
    unmarked = [dataclasses.replace(s, kind="layout", config=()) if is_concat_view(s) else s
                for s in plan.steps]
    broken = Plan(graph_json=plan.graph_json, steps=plan.steps, buffers=plan_buffers(plan.graph, unmarked))
    with pytest.raises(ValueError, match="was not written at byte"):
        _check(broken)
    checked = emulation.check_concat_written
    emulation.check_concat_written = lambda step, env: None
    try:
        with pytest.raises(AssertionError):
            _check(broken)
    finally:
        emulation.check_concat_written = checked


def test_inception_mixed_5b_writes_its_branches_in_place():
    plan = compile_plan(str(GRAPHS / "inception_mixed_5b.onnx"), device=None, concat_views=True)
    views = [s for s in plan.steps if is_concat_view(s)]
    assert len(views) == 1 and len(views[0].inputs) == 4  # the block's output is a graph output
    assert all("concat" not in s.ops for s in plan.steps if not is_concat_view(s))
    _slices_in_place(plan)
    _check(plan)


def test_the_stage_plan_keeps_the_producers_minus_the_concat():
    g = _fire_modules()
    plan = compile_plan(g, device=None, concat_views=True, schedule="ios")
    assert sum(map(is_concat_view, plan.steps)) == 2
    assert all("concat" not in s.ops for s in plan.steps if not is_concat_view(s))
    _slices_in_place(plan)
    _check(plan)


def _concat_of(shape: tuple[int, ...], parts: int, output_part: bool = False) -> Graph:
    b = GraphBuilder("concat_case")
    x = b.input("x", shape)
    ins = [b.mul(b.relu(x) if k else b.exp(x), b.constant(np.float32(k + 1))) for k in range(parts)]
    cat = b.concat(*ins, axis=1)
    return b.build([b.relu(cat)] + ([ins[0]] if output_part else []))


@pytest.mark.parametrize("case", ["batch 2", "graph input", "graph output", "unaligned slice"])
def test_the_copy_stays_where_a_producer_cannot_write_a_slice(case):
    shape = {"batch 2": (2, 4, 3, 3), "unaligned slice": (1, 3, 1, 1)}.get(case, (1, 4, 3, 3))
    g = _direct_input(shape) if case == "graph input" else _concat_of(shape, 3, case == "graph output")
    plan = compile_plan(g, device=None, concat_views=True)
    assert not any(map(is_concat_view, plan.steps))
    assert any("concat" in s.ops for s in plan.steps)
    _check(plan, 1e-5)
    ok = compile_plan(_concat_of((1, 4, 3, 3), 3), device=None, concat_views=True)
    assert sum(map(is_concat_view, ok.steps)) == 1


def _direct_input(shape: tuple[int, ...]) -> Graph:
    b = GraphBuilder("concat_of_an_input")
    x = b.input("x", shape)
    return b.build([b.relu(b.concat(x, b.exp(x), axis=1))])


def test_a_saved_plan_keeps_its_concat_views():
    plan = compile_plan(_fire_modules(), device=None, concat_views=True)
    again = Plan.from_json(plan.dumps())
    assert [s.config_dict for s in again.steps] == [s.config_dict for s in plan.steps]
    assert again.buffers == plan.buffers
    _check(again)


@pytest.mark.parametrize("bias_epilogue", [False, True])
def test_squeezenet_b1_whole_under_the_executors_memory_layout(bias_epilogue):
    """With the bias lever each concat was a copy kernel of its own; now none is left."""
    path = str(GRAPHS / "ios" / "squeezenet1_1_b1.onnx")
    plan = compile_plan(path, device=None, concat_views=True, bias_epilogue=bias_epilogue)
    assert sum(map(is_concat_view, plan.steps)) == 8  # every fire module
    if bias_epilogue:
        plain = compile_plan(path, device=None, bias_epilogue=True)
        assert [s.ops for s in plain.steps if "concat" in s.ops] == [("concat",)] * 8  # copies alone
        assert plan.kernels == plain.kernels - 8
    assert all("concat" not in s.ops for s in plan.steps if not is_concat_view(s))
    _slices_in_place(plan)
    _check(plan)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,bias_epilogue", [("sequential", False), ("ios", True)])
def test_inception_v3_b1_whole_under_the_executors_memory_layout(schedule, bias_epilogue):
    """All 11 Mixed blocks' concats are views; the stage plan's buffers (concurrent steps never
    share bytes) hold them too."""
    plan = compile_plan(str(GRAPHS / "ios" / "inception_v3_b1.onnx"), device=None, concat_views=True,
                        schedule=schedule, bias_epilogue=bias_epilogue)
    assert sum(map(is_concat_view, plan.steps)) == 11
    _slices_in_place(plan)
    _check(plan)
