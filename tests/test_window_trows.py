"""Rows of a transposed input (``gen_trows``): ConvNeXt's channels-last LayerNorm of an NCHW
tensor as one kernel (a tile of positions staged in shared memory, a warp a row), run in the
CPU emulator against the float64 reference; a kernel reading the wrong channel fails."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.kernels.analysis import UnsupportedFusion, analyze
from tunedb.kernels.codegen import KernelPlan, KernelSpec, generate
from tunedb.kernels.gen_trows import is_trows, match_trows, tile_rows, trows_kernel
from tunedb.kernels.gen_window import WINDOW_CONFIG
from tunedb.kernels.schedule import Schedule
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.driver import load_graph
from tunedb.records import sha256_hex
from tunedb.runtime.emu import build, mismatches

WINDOW = Schedule.from_config(WINDOW_CONFIG)
GEN = Path(__file__).resolve().parents[1] / "data" / "graphs" / "generalization"


def channels_last_norm(c: int = 40, dtype: str = "float32", h: int = 5, w: int = 7, affine: str = "input"):
    """transpose(x, (0, 2, 3, 1)), then LayerNorm over C as ConvNeXt exports it."""
    b = GraphBuilder(f"cl_norm_{c}_{dtype}_{affine}")
    x = b.input("x", (2, c, h, w), dtype)
    t = b.op("transpose", x, perm=(0, 2, 3, 1))
    mu = b.reduce_mean(t, axes=(3,), keepdims=True)
    d = b.sub(t, mu)
    var = b.reduce_mean(b.mul(d, d), axes=(3,), keepdims=True)
    eps = b.constant(np.array(1e-6, dtype=np.float32), dtype=dtype)
    y = b.mul(d, b.rsqrt(b.add(var, eps)))
    if affine == "input":
        y = b.add(b.mul(y, b.input("gamma", (c,), dtype)), b.input("beta", (c,), dtype))
    else:  # constants, as a whole model has them
        rng = np.random.default_rng(1)
        gamma = b.constant(rng.uniform(0.5, 1.5, c).astype(np.float32), dtype="float32")
        y = b.mul(y, b.cast(gamma, to=dtype) if dtype != "float32" else gamma)
    return b.build([y])


def _plan(g):
    k = trows_kernel(g)
    return KernelPlan((KernelSpec(k.name, k.source, k.grid, k.block, k.shared_bytes, k.args),), (),
                      sha256_hex(k.source), k.R, k.C, "trows")


def test_the_pattern_and_its_limits():
    g = channels_last_norm()
    m = match_trows(g)
    assert m.shape == (2, 40, 5, 7) and is_trows(g)
    with pytest.raises(UnsupportedFusion, match="transposed input"):
        analyze(g)  # what the row generators say about it
    assert (tile_rows(96), tile_rows(384), tile_rows(768)) == (32, 16, 8)
    assert trows_kernel(channels_last_norm(96)).shared_bytes == 96 * 33 * 4
    b = GraphBuilder("no_reduction")  # a transpose alone is the transpose_tiled generator's
    y = b.relu(b.op("transpose", b.input("x", (2, 4, 3, 3)), perm=(0, 2, 3, 1)))
    assert not is_trows(b.build([y]))
    b = GraphBuilder("other_perm")
    t = b.op("transpose", b.input("x", (2, 4, 3, 3)), perm=(0, 3, 2, 1))
    assert not is_trows(b.build([b.reduce_sum(t, axes=(3,), keepdims=True)]))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_channels_last_norms_match_the_float64_reference_and_a_wrong_channel_fails(tmp_path):
    # 40 channels: the last lane's second value is past C; 35 positions: a tile ends half full;
    # 400 channels: tiles of 16 positions; fp16 with constant weights
    graphs = [channels_last_norm(), channels_last_norm(96, "bfloat16"), channels_last_norm(400, h=3, w=3),
              channels_last_norm(64, "float16", affine="const")]
    jobs = [(g, WINDOW, _plan(g)) for g in graphs]
    assert "l < 16 && hw0 + l < 9" in jobs[2][2].kernels[0].source
    g, _, good = jobs[0]
    k = good.kernels[0]
    old = "tiles[c * 33 + l]"
    assert old in k.source
    bad = k.source.replace(old, "tiles[(c ^ 1) * 33 + l]").replace(k.name, "mutant")
    mutant = replace(good, kernels=(replace(k, name="mutant", source=bad),))
    lib = build([p.kernels[0].source for _, _, p in jobs] + [bad], str(tmp_path))
    assert not mismatches(lib, jobs, seed=4)
    assert len(mismatches(lib, [(g, WINDOW, mutant)], seed=4)) == 1


def test_codegen_hands_what_the_row_generators_refuse_to_it():
    g = channels_last_norm(96)
    plan = generate(g, WINDOW)
    assert plan.pattern == "trows" and plan.kernels[0].shared_bytes == 96 * 33 * 4


@pytest.mark.slow  # plans a ConvNeXt block and emulates its two kernels: ~10 s
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_the_planner_takes_convnexts_transpose_into_its_norm(tmp_path):
    # the 7x7 conv, then transpose + LayerNorm as one kernel: 2 steps, were 3 with a copy
    graph = load_graph(GEN / "windowed_convnext_tiny_b1_e076db42.onnx")
    plan = compile_plan(graph)
    assert [st.kind for st in plan.steps] == ["fused", "fused"]
    assert plan.steps[1].ops[0] == "transpose"
    jobs = []
    for st in plan.steps:
        sub = Graph.from_json(json.loads(st.subgraph))
        jobs.append((sub, WINDOW, generate(sub, Schedule.from_config(st.config_dict))))
    assert [p.pattern for _, _, p in jobs] == ["window", "trows"]
    lib = build([p.kernels[0].source for _, _, p in jobs], str(tmp_path))
    assert not mismatches(lib, jobs, seed=6)


def convnext_residual_norm(c: int = 40, h: int = 5, w: int = 7, dtype: str = "float32") -> Graph:
    """ConvNeXt between blocks as exported: the block's NHWC output plus a bias, back to NCHW,
    the layer scale ([C, 1, 1]) and the residual (NCHW), then to NHWC for the next block's
    LayerNorm, whose result goes back to NCHW: three transposes, two layouts, one kernel."""
    b = GraphBuilder(f"convnext_residual_norm_{c}_{h}x{w}_{dtype}")
    y = b.add(b.input("bias", (c,), dtype), b.input("y", (2, h, w, c), dtype))
    t = b.mul(b.input("scale", (c, 1, 1), dtype), b.op("transpose", y, perm=(0, 3, 1, 2)))
    res = b.add(t, b.input("x", (2, c, h, w), dtype))
    u = b.op("transpose", res, perm=(0, 2, 3, 1))
    d = b.sub(u, b.reduce_mean(u, axes=(3,), keepdims=True))
    var = b.reduce_mean(b.mul(d, d), axes=(3,), keepdims=True)
    eps = b.constant(np.array(1e-6, dtype=np.float32), dtype=dtype)
    nrm = b.add(b.mul(b.mul(d, b.rsqrt(b.add(var, eps))), b.input("gamma", (c,), dtype)),
                b.input("beta", (c,), dtype))
    return b.build([res, b.op("transpose", nrm, perm=(0, 3, 1, 2))])


def test_two_layouts_match_and_their_limits():
    g = convnext_residual_norm()
    m = match_trows(g)
    assert m.shape == (2, 40, 5, 7) and [m.layouts[v] for v in g.outputs] == ["nchw", "nchw"]
    k = trows_kernel(g)  # the residual input and both outputs staged: 3 tiles of 32 positions
    assert k.shared_bytes == 3 * 40 * 33 * 4
    b = GraphBuilder("per_channel_along_w")  # [C] meets an NCHW value: it broadcasts along W
    x = b.input("x", (2, 7, 5, 7))
    t = b.op("transpose", b.mul(x, b.input("s", (7,))), perm=(0, 2, 3, 1))
    with pytest.raises(UnsupportedFusion, match="broadcast along C"):
        match_trows(b.build([b.reduce_sum(t, axes=(3,), keepdims=True)]))
    b = GraphBuilder("square")  # C = H = W: the layouts cannot be told apart by their shapes
    t = b.op("transpose", b.input("x", (2, 4, 4, 4)), perm=(0, 2, 3, 1))
    assert not is_trows(b.build([b.reduce_sum(t, axes=(3,), keepdims=True)]))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_two_layouts_match_the_float64_reference_and_a_wrong_channel_fails(tmp_path):
    # 40 channels, 35 positions (a tile ends half full); 400 channels: tiles of 8 positions (3
    # tiles); bf16
    graphs = [convnext_residual_norm(), convnext_residual_norm(400, 3, 3),
              convnext_residual_norm(96, 4, 5, "bfloat16")]
    jobs = [(g, WINDOW, _plan(g)) for g in graphs]
    g, _, good = jobs[0]
    k = good.kernels[0]
    old = f"tiles[{2 * 40 * 33} + c * 33 + l] = "  # the second output's tile, as it is filled
    assert old in k.source
    bad = k.source.replace(old, f"tiles[{2 * 40 * 33} + (c ^ 1) * 33 + l] = ").replace(k.name, "mutant")
    mutant = replace(good, kernels=(replace(k, name="mutant", source=bad),))
    lib = build([p.kernels[0].source for _, _, p in jobs] + [bad], str(tmp_path))
    assert not mismatches(lib, jobs, seed=3)
    assert len(mismatches(lib, [(g, WINDOW, mutant)], seed=3)) == 1


def test_the_planner_takes_convnexts_residual_and_norm_as_one_kernel():
    # norm_convnext_tiny: bias, layer scale, residual, LayerNorm between two transposes: was a
    # row kernel reading the residual 3 KB a lane apart, then a transpose copy
    plan = compile_plan(load_graph(GEN / "norm_convnext_tiny_b16_3e7d035b.onnx"))
    (step,) = plan.steps
    sub = Graph.from_json(json.loads(step.subgraph))
    assert step.ops.count("transpose") == 3 and generate(sub, WINDOW).pattern == "trows"
