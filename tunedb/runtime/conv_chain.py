"""Channels-last between cuDNN convolutions: which values of a plan stay NHWC in their buffers.

A convolution that ``conv_cudnn`` runs channels-last transposes its input to NHWC and its output
back to NCHW. Between two such convolutions often only layout-free steps run: elementwise kernels
whose operands all have the output's shape (ResNet's ReLUs and residual adds), which give the
same result on any memory order that all their operands share. So a value may stay NHWC in its
planned buffer (same size) when its producer is such a convolution or such a step whose full-size
operands are all NHWC, and every consumer is a channels-last convolution reading it as its input
or such a step; the transposes between them go. Graph outputs and values read by anything else
(pools, reductions, views) stay NCHW. ``CHAIN``: "on" (every convolution cuDNN takes runs
channels-last, kept between them where it can be), "auto" (the default: so where at most one
in ``MAX_TRANSPOSES_PER_CONV`` of those convolutions' inputs and outputs still needs a
transpose, else all NCHW), "off"; ``$TUNEDB_CUDNN_CHAIN`` sets it. H200, bf16 b8, in-plan:
ResNet-50 (10 transposes for 53 convs) 914 -> 635 µs; EfficientNet-B0 (66 for 65: its
squeeze-excitation scales and depthwise steps break every block) 650 -> 752, so NCHW there.
Nothing here imports CuPy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from tunedb.graph.ops import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY, check_node
from tunedb.runtime.conv_cudnn import CudnnError, conv_layout, cudnn_wanted, library

CHAIN = os.environ.get("TUNEDB_CUDNN_CHAIN", "auto")
MAX_TRANSPOSES_PER_CONV = 0.25
ELEMENTWISE = ELEMENTWISE_UNARY | ELEMENTWISE_BINARY


def layout_free(step: Any) -> bool:
    """A generated or op-by-op step of elementwise ops on 4-D values whose operands are all of
    the output's shape or single elements (no broadcast along an axis)."""
    if step.kind != "fused" or not step.graph.nodes:
        return False
    g = step.graph
    shape = tuple(g.type_of(g.outputs[0]).shape)
    if len(shape) != 4 or any(n.op not in ELEMENTWISE for n in g.nodes):
        return False
    values = {v for n in g.nodes for v in (*n.inputs, *n.outputs) if v}
    return all(tuple(g.type_of(v).shape) == shape or math.prod(g.type_of(v).shape) == 1 for v in values)


def channels_last_conv(step: Any, layout: bool = True) -> bool:
    """Whether ``conv_cudnn``'s policy sends this conv2d step to cuDNN (and, with ``layout``,
    runs it channels-last on its own)."""
    if step.kind != "conv2d" or len(step.graph.nodes) != 1:
        return False
    node, g = step.graph.nodes[0], step.graph
    types = [g.type_of(v) for v in node.inputs]
    a = check_node(node, types)[1]
    x, w, out = types[0].shape, types[1].shape, g.type_of(node.outputs[0]).shape
    # float16 convs run through the op-by-op evaluator (in float32), never on these arrays
    isz = {"bfloat16": 2, "float32": 4}.get(types[0].dtype)
    return isz is not None and int(a["groups"]) != x[1] and cudnn_wanted(x, w, out, a, isz) \
        and (not layout or conv_layout(x, w, out, a, isz) == "nhwc")


def nhwc_values(plan: Any, is_conv: Callable[[Any], bool] = channels_last_conv) -> set[str]:
    """The plan's values that stay NHWC in memory (see the module docstring)."""
    steps = plan.steps
    kind = {k: "conv" if is_conv(s) else "free" if layout_free(s) else "other" for k, s in enumerate(steps)}
    producer = {v: k for k, s in enumerate(steps) for v in s.outputs}
    consumers: dict[str, list[tuple[int, int]]] = {}
    for k, s in enumerate(steps):
        for pos, v in enumerate(s.inputs):
            consumers.setdefault(v, []).append((k, pos))
    full = {k: [v for v, sv in zip(s.inputs, s.graph.inputs) if math.prod(s.graph.type_of(sv).shape) > 1]
            for k, s in enumerate(steps) if kind[k] == "free"}
    keep = {v for k, s in enumerate(steps) if kind[k] != "other" for v in s.outputs} - set(plan.graph.outputs)
    changed = True
    while changed:
        changed = False
        for v in sorted(keep):
            k = producer[v]  # a conv's bias is added by an NCHW kernel after it
            ok = len(steps[k].inputs) < 3 if kind[k] == "conv" else all(i in keep for i in full[k])
            for j, pos in consumers.get(v, []):
                if kind[j] == "conv":
                    ok = ok and pos == 0
                elif kind[j] == "free":
                    ok = ok and all(o in keep for o in steps[j].outputs) and all(i in keep for i in full[j])
                else:
                    ok = False
            if not ok:
                keep.discard(v)
                changed = True
    return keep


def conv_io(plan: Any, env: Mapping[str, Any]) -> dict[int, tuple[bool, bool]]:
    """Per channels-last conv step, keyed by its weight's device address (``env``: the
    executor's arrays; constants are there before any step is built): whether its input is
    already NHWC and whether its output stays NHWC; the convolutions listed run channels-last.
    Empty (all NCHW) when ``CHAIN`` is off, or "auto" finds too many transposes left, or cuDNN
    does not load; a weight two conv steps share gets no chain (both flags false)."""
    if CHAIN == "off":
        return {}
    try:
        library()
    except CudnnError:  # no cuDNN here: every convolution runs NCHW
        return {}
    def is_conv(s: Any) -> bool:
        return channels_last_conv(s, layout=False)
    keep = nhwc_values(plan, is_conv)
    convs = [s for s in plan.steps if is_conv(s)]
    left = sum((s.inputs[0] not in keep) + (s.outputs[0] not in keep) for s in convs)
    if not convs or CHAIN == "auto" and left > MAX_TRANSPOSES_PER_CONV * len(convs):
        return {}
    io: dict[int, tuple[bool, bool]] = {}
    seen: set[int] = set()
    for s in convs:
        if s.inputs[1] not in env:
            continue
        ptr = int(env[s.inputs[1]].data.ptr)
        io[ptr] = (False, False) if ptr in seen else (s.inputs[0] in keep, s.outputs[0] in keep)
        seen.add(ptr)
    return io
