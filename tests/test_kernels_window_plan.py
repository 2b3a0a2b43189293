"""The planner's windowed fusion (``tunedb.plan.window``): a depthwise convolution or pool takes
in its elementwise neighbours, the kernel count drops, and every merged step's kernel matches the
float64 reference of its cut in the CPU emulator."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.codegen import generate
from tunedb.kernels.schedule import Schedule
from tunedb.plan.cost import Coster
from tunedb.plan.driver import load_graph
from tunedb.plan.fusion import explore
from tunedb.plan.rewrite import rewrite_for_plan
from tunedb.plan.subgraph import GraphIndex
from tunedb.plan.window import kernel_count
from tunedb.runtime.emu import build, mismatches

GEN = Path(__file__).resolve().parents[1] / "data" / "graphs" / "generalization"
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")


def inverted_residual(dtype: str = "float32", n: int = 1, c: int = 16, hw: int = 10):
    """MobileNetV2's block: 1x1 expand, BN, ReLU6, depthwise 3x3, BN, ReLU6, 1x1 project, add."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(f"inverted_residual_{dtype}")
    x = b.input("x", (n, c, hw, hw), dtype)

    def bn(y: str, ch: int) -> str:
        s = b.constant(rng.uniform(0.5, 1.5, (1, ch, 1, 1)).astype(np.float32), dtype="float32")
        t = b.constant(rng.uniform(-0.5, 0.5, (1, ch, 1, 1)).astype(np.float32), dtype="float32")
        if dtype != "float32":
            s, t = b.cast(s, to=dtype), b.cast(t, to=dtype)
        return b.clip(b.add(b.mul(y, s), t), min=0.0, max=6.0)

    e = 4 * c
    h = bn(b.conv2d(x, b.input("w1", (e, c, 1, 1), dtype)), e)
    h = bn(b.conv2d(h, b.input("wd", (e, 1, 3, 3), dtype), pads=(1, 1, 1, 1), groups=e), e)
    y = b.conv2d(h, b.input("w2", (c, e, 1, 1), dtype))
    return b.build([b.add(y, x)])


def _plan(graph, window: bool):
    g = rewrite_for_plan(graph)
    ix = GraphIndex(g)
    part = explore(ix, Coster(ix), window=window)
    return ix, part


def _window_steps(ix, part):
    return [g for g in part.groups if len(g) > 1 and any(ix.nodes[j].op == "conv2d" or
                                                         ix.nodes[j].op.endswith("pool2d") for j in g)]


def _verify(ix, groups, tmp_path) -> list[str]:
    sched = Schedule.from_config({"mapping": "elementwise", "block": 256})
    jobs = [(c, sched, generate(c, sched)) for c in (ix.cut(g).graph for g in groups)]
    lib = build([p.kernels[0].source for _, _, p in jobs], str(tmp_path))
    return mismatches(lib, jobs, seed=11)


@needs_gxx
def test_inverted_residual_fuses_around_the_depthwise_conv(tmp_path):
    g = inverted_residual()
    ix0, before = _plan(g, window=False)
    ix, after = _plan(g, window=True)
    assert after.stats["window_merges"] == 1
    steps = _window_steps(ix, after)
    assert len(steps) == 1
    ops = sorted(ix.nodes[j].op for j in steps[0])
    assert ops.count("conv2d") == 1 and "clip" in ops and "mul" in ops  # BN + ReLU6 both sides
    assert kernel_count(after.costs) == kernel_count(before.costs) - 2
    assert sum(after.costs[k].us for k in range(len(after.costs))) < sum(c.us for c in before.costs)
    assert not _verify(ix, steps, tmp_path)


def test_window_fusion_can_be_turned_off():
    ix, part = _plan(inverted_residual(), window=False)
    assert "window_merges" not in part.stats and not _window_steps(ix, part)


@pytest.mark.slow  # plans the generalization suite's windowed workloads and emulates them
@needs_gxx
def test_generalization_windowed_workloads_plan_and_verify(tmp_path):
    man = json.loads((GEN / "manifest.json").read_text())
    picked = [w for w in man["workloads"] if w["kind"] == "windowed" and "_b1_" in w["name"]
              and w["model"] in ("mobilenet_v2", "resnet50", "efficientnet_b0")]
    assert len(picked) >= 12
    before = after = 0
    groups = []
    for w in picked:
        graph = load_graph(str(GEN / w["file"]))
        ix, part = _plan(graph, window=True)
        before += kernel_count(_plan(graph, window=False)[1].costs)
        after += kernel_count(part.costs)
        if w["model"] == "mobilenet_v2":
            assert kernel_count(part.costs) == 1, w["name"]
        groups.append((ix, _window_steps(ix, part)))
    assert after < before
    # Per model, its smallest merged kernel through the emulator (the large ones take minutes on
    # the host; the code paths are the same, the variants test covers the rest).
    smallest: dict[str, tuple] = {}
    for w, (ix, steps) in zip(picked, groups):
        for st in steps:
            size = ix.types[ix.nodes[max(st)].outputs[0]].numel
            if w["model"] not in smallest or size < smallest[w["model"]][0]:
                smallest[w["model"]] = (size, ix, st)
    assert len(smallest) == 3
    bad = [b for _, ix, st in smallest.values() for b in _verify(ix, [st], tmp_path)]
    assert not bad, bad


def test_an_sfu_bound_prologue_stays_out_but_the_epilogue_fuses():
    # SiLU before a 3x3 depthwise conv would be recomputed at 9 taps: its sigmoid stays a kernel.
    b = GraphBuilder("silu_dw_silu")
    x = b.input("x", (1, 32, 14, 14))
    h = b.mul(x, b.sigmoid(x))
    y = b.conv2d(h, b.input("wd", (32, 1, 3, 3)), pads=(1, 1, 1, 1), groups=32)
    ix, part = _plan(b.build([b.mul(y, b.sigmoid(y))]), window=True)
    steps = _window_steps(ix, part)
    assert len(steps) == 1
    conv = next(j for j in steps[0] if ix.nodes[j].op == "conv2d")
    assert all(j > conv for j in steps[0] if j != conv)  # the SiLU after, not the one before
    assert sorted(ix.nodes[j].op for j in steps[0]) == ["conv2d", "mul", "sigmoid"]


@needs_gxx
def test_a_lone_depthwise_conv_or_pool_is_a_generated_window_kernel(tmp_path):
    # ConvNeXt: a 7x7 depthwise conv feeding a transpose to NHWC. With nothing to fuse it was the
    # runtime's depthwise kernel (runtime loop bounds; 0.03-0.05 of the floor on the H200).
    b = GraphBuilder("convnext_dw7")
    x = b.input("x", (2, 8, 11, 11))
    y = b.conv2d(x, b.input("wd", (8, 1, 7, 7)), b.input("bd", (8,)), pads=(3, 3, 3, 3), groups=8)
    t = b.transpose(y, perm=(0, 2, 3, 1))
    p = b.max_pool2d(b.input("z", (2, 8, 9, 9)), kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
    ix, part = _plan(b.build([t, p]), window=True)
    lone = [(g, c) for g, c in zip(part.groups, part.costs)
            if len(g) == 1 and ix.nodes[g[0]].op in ("conv2d", "max_pool2d")]
    assert sorted(ix.nodes[g[0]].op for g, _ in lone) == ["conv2d", "max_pool2d"]
    assert all(c.kind == "fused" and c.note == "window" for _, c in lone), lone
    assert not _verify(ix, [g for g, _ in lone], tmp_path)
