"""A resample (``gather`` along H and/or W at integer indices, a nearest upsample as exported)
as a window kernel: the elementwise work before it run on its tap, after it on the output; run
in the CPU emulator against the float64 reference, and a kernel reading a wrong index fails."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.kernels.analysis import UnsupportedFusion
from tunedb.kernels.codegen import generate
from tunedb.kernels.gen_window import (
    WINDOW_CONFIG,
    has_window_op,
    is_window_node,
    match_window,
    window_kernel,
)
from tunedb.kernels.schedule import Schedule
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.driver import load_graph
from tunedb.runtime.emu import build, mismatches

WINDOW = Schedule.from_config(WINDOW_CONFIG)
GEN = Path(__file__).resolve().parents[1] / "data" / "graphs" / "generalization"


def upsample(dtype: str = "float32", idx_dtype: str = "int64", axes: tuple[int, ...] = (2, 3),
             const_idx: bool = False, epilogue: bool = True):
    """UNet's residual add, then a nearest x2 upsample as two gathers (indices a graph input,
    as the suite exports them, or constants as the model has them)."""
    b = GraphBuilder(f"up_{dtype}_{idx_dtype}_{''.join(map(str, axes))}{'_c' if const_idx else ''}")
    n, c, h, w = 2, 3, 5, 4
    y = b.add(b.input("a", (n, c, h, w), dtype), b.input("b", (n, c, h, w), dtype))
    for ax in axes:
        size = (h, w)[ax - 2]
        if const_idx:  # i // 2 with a negative start: -size counts from the end (row 0)
            vals = np.arange(2 * size, dtype=idx_dtype) // 2
            vals[0] = -size
            idx = b.constant(vals, name=f"i{ax}")
        else:
            idx = b.input(f"i{ax}", (2 * size,), idx_dtype)
        y = b.op("gather", y, idx, axis=ax if ax == 2 else -1)
    return b.build([b.relu(y) if epilogue else y])


def test_a_resample_is_a_window_with_its_add_as_the_prologue():
    g = upsample()
    m = match_window(g)
    assert m.node.op == "gather" and [n.op for n in m.chain] == ["gather"]
    assert [n.op for n in m.prologue] == ["add"] and [n.op for n in m.epilogue] == ["relu"]
    assert m.in_shape == (2, 3, 5, 4) and m.out_shape == (2, 3, 10, 8) and has_window_op(g)
    src = window_kernel(g).source
    assert "float acc[1];" in src and "i2 = min(max(i2 < 0 ? i2 + 5 : i2, 0), 4);" in src
    with pytest.raises(UnsupportedFusion, match="no plane layout"):
        window_kernel(g, layout="plane")


def test_gathers_the_row_generators_take_are_no_resample():
    b = GraphBuilder("rolled")  # a rotation (c + s) % n of an input: an index map elsewhere
    x = b.input("x", (2, 3, 5, 4))
    y = b.op("gather", x, b.constant(np.array([1, 2, 3, 0], dtype="int64"), name="r"), axis=3)
    g = b.build([y])
    assert not is_window_node(g, g.nodes[0]) and not has_window_op(g)
    b = GraphBuilder("channels")  # along C: no spatial resample
    y = b.op("gather", b.input("x", (2, 3, 5, 4)), b.input("i", (6,), "int64"), axis=1)
    g = b.build([y])
    assert not is_window_node(g, g.nodes[0])
    b = GraphBuilder("twice_h")  # two gathers along the same axis
    y = b.op("gather", b.input("x", (2, 3, 5, 4)), b.input("i", (5,), "int64"), axis=2)
    y = b.op("gather", y, b.input("j", (5,), "int64"), axis=2)
    with pytest.raises(UnsupportedFusion, match="one along each axis"):
        match_window(b.build([y]))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_resample_kernels_match_the_float64_reference_and_a_wrong_index_fails(tmp_path):
    graphs = [upsample(), upsample("float16", "int32", (3,)), upsample("bfloat16", axes=(2,)),
              upsample(const_idx=True), upsample("float16", axes=(3, 2), const_idx=True, epilogue=False)]
    jobs = [(g, WINDOW, generate(g, WINDOW)) for g in graphs]
    assert all(p.pattern == "window" for _, _, p in jobs)
    g, _, good = jobs[0]
    k = good.kernels[0]
    assert "[oh];" in k.source
    bad = k.source.replace("[oh];", "[ow0];").replace(k.name, "mutant")  # H's index at W's position
    mutant = replace(good, kernels=(replace(k, name="mutant", source=bad),))
    lib = build([p.kernels[0].source for _, _, p in jobs] + [bad], str(tmp_path))
    assert not mismatches(lib, jobs, seed=3)
    assert len(mismatches(lib, [(g, WINDOW, mutant)], seed=3)) == 1


@pytest.mark.slow  # plans two graphs, emulates 650k outputs: ~10-30 s
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_the_planner_takes_an_upsample_and_its_add_as_one_kernel(tmp_path):
    # the suite's UNet upsample (indices a graph input): add, gather, gather were 3 steps, the
    # gathers the runtime's copies; the model's own (constant indices i // 2) plans the same
    suite = load_graph(GEN / "data_movement_unet_640x16_b1_e9daf03d.onnx")
    jobs = []
    for g in (suite, upsample(const_idx=True)):
        (st,) = compile_plan(g).steps
        assert st.kind == "fused" and sorted(st.ops)[:2] == ["add", "gather"] and st.launches == 1
        sub = Graph.from_json(json.loads(st.subgraph))
        jobs.append((sub, WINDOW, generate(sub, Schedule.from_config(st.config_dict))))
    lib = build([p.kernels[0].source for _, _, p in jobs], str(tmp_path))
    assert not mismatches(lib, jobs, seed=5)
