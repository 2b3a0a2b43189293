"""Channels-last between cuDNN convolutions (``tunedb.runtime.conv_chain``): which values of a
plan may stay NHWC in memory, on hand-made step lists and on ResNet-50's and EfficientNet's
plans."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.runtime import conv_chain, conv_cudnn

SHAPE = (2, 8, 6, 6)


def _sub(op: str, n_in: int, shapes: list | None = None):
    b = GraphBuilder(op)
    xs = [b.input(f"i{k}", (shapes or [SHAPE] * n_in)[k], "bfloat16") for k in range(n_in)]
    return b.build([getattr(b, op)(*xs)])


def _step(kind: str, ins: tuple, outs: tuple, sub=None):
    if sub is None:  # a conv step: only its kind and values matter here
        b = GraphBuilder("conv")
        x, w = b.input("x", SHAPE, "bfloat16"), b.input("w", (8, 8, 3, 3), "bfloat16")
        sub = b.build([b.conv2d(x, w, strides=(1, 1), pads=(1,) * 4, dilations=(1, 1), groups=1)])
    return SimpleNamespace(kind=kind, inputs=ins, outputs=outs, graph=sub)


def _plan(steps, outputs):
    return SimpleNamespace(steps=steps, graph=SimpleNamespace(outputs=outputs))


def test_a_residual_block_keeps_nhwc_between_its_convs_and_not_into_a_reduction():
    steps = [
        _step("conv2d", ("x", "w0"), ("c0",)),                           # 0: input from outside
        _step("fused", ("c0",), ("r0",), _sub("relu", 1)),               # 1
        _step("conv2d", ("r0", "w1"), ("c1",)),                          # 2
        _step("fused", ("c1", "r0"), ("s",), _sub("add", 2)),            # 3: residual add
        _step("conv2d", ("s", "w2"), ("c2",)),                           # 4
        _step("fused", ("c2",), ("m",), _sub("reduce_mean", 1)),         # 5: not layout-free
    ]
    keep = conv_chain.nhwc_values(_plan(steps, ("m",)), lambda s: s.kind == "conv2d")
    assert keep == {"c0", "r0", "c1", "s"}  # c2 feeds the reduction: its conv transposes out


def test_graph_outputs_broadcasts_and_second_operands_stay_nchw():
    steps = [
        _step("conv2d", ("x", "w0"), ("c0",)),
        _step("fused", ("c0",), ("r0",), _sub("relu", 1)),               # r0 is a graph output
        _step("conv2d", ("x", "w1"), ("c1",)),
        _step("fused", ("c1", "v"), ("b",), _sub("mul", 2, [SHAPE, (1, 8, 1, 1)])),  # broadcast
        _step("conv2d", ("x", "w2"), ("c2",)),
        _step("conv2d", ("x", "c2"), ("c3",)),                           # c2 read as a weight
        _step("conv2d", ("x", "w4"), ("c4",)),
        _step("fused", ("c4",), ("r4",), _sub("relu", 1)),
        _step("conv2d", ("r4", "w5"), ("c5",)),
    ]
    keep = conv_chain.nhwc_values(_plan(steps, ("r0", "b", "c3", "c5")), lambda s: s.kind == "conv2d")
    assert keep == {"c4", "r4"}  # the ReLU writing the output r0 writes NCHW, so c0 is NCHW too
    assert not conv_chain.layout_free(steps[3]) and conv_chain.layout_free(steps[1])


def test_a_free_step_with_one_nchw_operand_and_a_biased_conv_stay_nchw():
    steps = [
        _step("conv2d", ("x", "w0"), ("c0",)),
        _step("fused", ("c0", "x"), ("s",), _sub("add", 2)),             # x: a graph input, NCHW
        _step("conv2d", ("s", "w1", "b1"), ("c1",)),                     # its bias kernel is NCHW
        _step("fused", ("c1",), ("r1",), _sub("relu", 1)),
        _step("conv2d", ("r1", "w2"), ("c2",)),
    ]
    assert conv_chain.nhwc_values(_plan(steps, ("c2",)), lambda s: s.kind == "conv2d") == set()


@pytest.fixture
def channels_last():
    before = (conv_cudnn.CONV_CUDNN, conv_cudnn.LAYOUT, conv_chain.CHAIN)
    conv_cudnn.CONV_CUDNN, conv_cudnn.LAYOUT, conv_chain.CHAIN = "always", "nhwc", "on"
    yield
    conv_cudnn.CONV_CUDNN, conv_cudnn.LAYOUT, conv_chain.CHAIN = before


@pytest.mark.slow
@pytest.mark.parametrize("model,convs,transposes", [("resnet50", 53, 10), ("efficientnet_b0", 65, 66)])
def test_zoo_plans_keep_most_conv_activations_channels_last(channels_last, model, convs, transposes):
    from tunedb.bench.plan import collect_entries, load_entry
    from tunedb.plan.driver import compile as compile_plan

    zoo = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo_b8"
    path = zoo / f"{model}_dynamo_bf16_b8.onnx"
    plan = compile_plan(load_entry(collect_entries([path])[0])[0], device="generic")
    keep = conv_chain.nhwc_values(plan)
    cl = [s for s in plan.steps if conv_chain.channels_last_conv(s)]
    assert len(cl) == convs  # every conv but the depthwise ones
    # ResNet-50: only the last stage's block outputs (read by the pooled head) and the stem
    # (read by the max pool) stay NCHW; EfficientNet's squeeze-excitation scales broadcast
    assert sum((s.inputs[0] not in keep) + (s.outputs[0] not in keep) for s in cl) == transposes
    assert not keep & set(plan.graph.outputs)


def test_no_chain_when_off_or_without_cudnn(monkeypatch):
    plan = _plan([_step("conv2d", ("x", "w0"), ("c0",))], ())
    monkeypatch.setattr(conv_chain, "CHAIN", "off")
    assert conv_chain.conv_io(plan, {}) == {}
    monkeypatch.setattr(conv_chain, "CHAIN", "on")
    monkeypatch.setattr(conv_cudnn, "_LIB", [])
    monkeypatch.setattr(conv_cudnn, "_candidates", lambda: ["/nonexistent/libcudnn.so.9"])
    assert conv_chain.conv_io(plan, {}) == {}
