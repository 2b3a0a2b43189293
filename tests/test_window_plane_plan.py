"""The planner with ``plan.window.MERGE_PLANE_MEANS``: EfficientNet's SiLU -> depthwise conv ->
SiLU -> squeeze-excitation mean becomes one plane window kernel (the SiLU before the conv too:
the plane kernel runs it once an element), matching the float64 reference in the emulator."""

from __future__ import annotations

import pytest
from test_kernels_window_plan import needs_gxx

import tunedb.plan.window as plan_window
from tunedb.costmodel.features import DeviceFacts
from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.codegen import generate
from tunedb.kernels.schedule import Schedule
from tunedb.plan.cost import Coster
from tunedb.plan.fusion import explore
from tunedb.plan.rewrite import rewrite_for_plan
from tunedb.plan.subgraph import GraphIndex
from tunedb.plan.window import kernel_count
from tunedb.runtime.emu import build, mismatches


def _plan(graph, window: bool = True):
    # a 2-SM device: the small test graphs' planes make a wave of blocks, as batch 16 does
    g = rewrite_for_plan(graph)
    ix = GraphIndex(g)
    return ix, explore(ix, Coster(ix, device=DeviceFacts(sm_count=2)), window=window)


def se_stage(stride: int = 2, hw: int = 9):
    b = GraphBuilder("silu_dw_silu_se")
    x = b.input("x", (2, 16, hw, hw))
    h = b.mul(x, b.sigmoid(x))
    y = b.conv2d(h, b.input("wd", (16, 1, 3, 3)), b.input("bd", (16,)), strides=(stride, stride),
                 pads=(1, 1, 1, 1), groups=16)
    y = b.mul(y, b.sigmoid(y))
    return b.build([y, b.global_avg_pool(y)])


@pytest.mark.parametrize("merge", [False, True])
def test_the_squeeze_excitation_mean_merges_only_when_switched_on(monkeypatch, merge):
    monkeypatch.setattr(plan_window, "MERGE_PLANE_MEANS", merge)
    ix, part = _plan(se_stage(), window=True)
    # without the plane, a strip kernel takes the SiLU before a stride-2 conv (2.25 taps an
    # input element) and leaves the mean apart; before a stride-1 conv (9 taps) it stays apart
    assert kernel_count(part.costs) == (1 if merge else 2)
    ix, part = _plan(se_stage(1), window=True)
    assert kernel_count(part.costs) == (1 if merge else 3)


@pytest.mark.parametrize("stride", [1, 2])
def test_a_plane_too_large_keeps_the_mean_apart_and_merges_the_epilogue(stride):
    # 72x72 fp32 (20 KB) > PLANE_MAX_BYTES: the conv with its SiLU, the mean apart, and the
    # SiLU before the conv too where the stride makes its SFU work a quarter (costly_prologue)
    ix, part = _plan(se_stage(stride, hw=72), window=True)
    ops = sorted(tuple(sorted(ix.nodes[j].op for j in g)) for g in part.groups)
    if stride == 1:
        assert ops == [("conv2d", "mul", "sigmoid"), ("global_avg_pool",), ("mul", "sigmoid")]
    else:
        assert ops == [("conv2d", "mul", "mul", "sigmoid", "sigmoid"), ("global_avg_pool",)]


@needs_gxx
def test_the_merged_plane_kernel_matches_the_reference(monkeypatch, tmp_path):
    monkeypatch.setattr(plan_window, "MERGE_PLANE_MEANS", True)
    window = Schedule.from_config({"mapping": "elementwise", "block": 256})
    jobs = []
    for stride in (1, 2):
        ix, part = _plan(se_stage(stride), window=True)
        (group,) = part.groups
        sub = ix.cut(group).graph
        jobs.append((sub, window, generate(sub, window, sm_count=2)))
    # 8 planes of 9x9 a block (a warp a plane: 25 outputs, or 27 strips of 4), a partial a warp
    assert all(p.kernels[0].shared_bytes == 8 * 9 * 9 * 4 + 4 * 8 for _, _, p in jobs)
    lib = build([p.kernels[0].source for _, _, p in jobs], str(tmp_path))
    assert not mismatches(lib, jobs, seed=11)


@needs_gxx
def test_a_strided_strip_kernel_with_the_silu_before_it_matches_the_reference(tmp_path):
    window = Schedule.from_config({"mapping": "elementwise", "block": 256})
    ix, part = _plan(se_stage(2, hw=72), window=True)
    (group,) = [g for g in part.groups if len(g) == 5]
    sub = ix.cut(group).graph
    plan = generate(sub, window, sm_count=2)
    src = plan.kernels[0].source
    assert plan.kernels[0].shared_bytes == 0 and "tdb_sigmoid(" in src and "float acc[2];" in src  # sfu: 2
    lib = build([src], str(tmp_path))
    assert not mismatches(lib, [(sub, window, plan)], seed=12)
