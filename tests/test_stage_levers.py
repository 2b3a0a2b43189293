"""The levers of the IOS plans on the CPU: operators as DP units, the conv bias in the epilogue,
and the depthwise-convolution kernel (compiled for the host and checked against the reference)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.multibranch import nasnet_a_graph
from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.epilogue import split_conv_bias
from tunedb.plan.stages import ios_search, operator_units, step_dag
from tunedb.runtime.executor_ops import KERNEL_SOURCE
from tunedb.runtime.inputs import make_inputs

# The executor's kernels are grid-stride loops without shared memory: one host "thread" with
# gridDim = blockDim = 1 walks every index, which runs their indexing exactly.
HOST_SHIM = """
#include <cmath>
struct dim3_ { unsigned x, y, z; };
static dim3_ blockIdx{0, 0, 0}, threadIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
#define __global__
#define __restrict__ __restrict
static inline float __int_as_float(int v) { float f; __builtin_memcpy(&f, &v, 4); return f; }
static inline double __longlong_as_double(long long v) { double d; __builtin_memcpy(&d, &v, 8); return d; }
"""


def _branchy_graph():
    b = GraphBuilder("branchy")
    x = b.input("x", (1, 8, 6, 6))
    heads = []
    for k in range(3):
        w, bias = b.input(f"w{k}", (8, 8, 3, 3)), b.input(f"b{k}", (8,))
        y = b.relu(b.conv2d(x, w, bias, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), groups=1))
        heads.append(y)
    return b.build([b.concat(*heads, axis=1)])


def test_bias_rewrite_computes_the_same_and_fuses_into_the_relu():
    g = _branchy_graph()
    g2 = split_conv_bias(g)
    _, ins = make_inputs(g, 3)
    a, b = run_reference(g, ins), run_reference(g2, ins)
    np.testing.assert_allclose(b[g.outputs[0]], a[g.outputs[0]], rtol=1e-12, atol=1e-12)
    assert sum(n.op == "conv2d" and len(n.inputs) == 3 for n in g2.nodes) == 0
    plan = compile_plan(g2, device="generic", cost_model=False, horizontal=False)
    epilogues = [s.ops for s in plan.steps if s.kind == "fused" and "relu" in s.ops]
    assert len(epilogues) == 3 and all("add" in ops for ops in epilogues)
    assert split_conv_bias(g2) is g2  # nothing left to split
    dw = GraphBuilder("dw")
    x = dw.input("x", (1, 4, 5, 5))
    y = dw.conv2d(x, dw.input("w", (4, 1, 3, 3)), dw.input("b", (4,)), strides=(1, 1), pads=(1, 1, 1, 1),
                  dilations=(1, 1), groups=4)
    g_dw = dw.build([dw.relu(y)])
    assert split_conv_bias(g_dw) is g_dw  # the depthwise kernel adds its bias itself


def test_operator_units_join_epilogues_and_r_counts_operators():
    plan = compile_plan(split_conv_bias(_branchy_graph()), device="generic", cost_model=False,
                        horizontal=False)
    steps = plan.steps
    preds, succs = step_dag(steps)
    units = operator_units(steps, preds, succs)
    joined = [u for u in units if len(u) > 1]
    assert joined and all(steps[u[0]].kind == "conv2d" and steps[u[-1]].kind == "fused" for u in joined)

    def cost(groups):  # concurrency pays: a stage takes its longest group plus a little per group
        return max(len(g) for g in groups) + 0.1 * len(groups)

    _, stages, stats = ios_search(steps, cost, r=1, cut_width=0)
    _, flat, flat_stats = ios_search(steps, cost, r=1, cut_width=0, contract=False)
    # every epilogue runs in its producer's stage and group
    where = {i: (si, gi) for si, st in enumerate(stages) for gi, g in enumerate(st) for i in g}
    assert all(where[u[0]] == where[i] for u in joined for i in u)
    assert sorted(where) == list(range(len(steps)))
    # r = 1 counts a conv and its epilogue as one: the three run side by side, each with its ReLU
    assert any(len(st) == 3 and all(len(g) == 2 for g in st) for st in stages)
    assert not any(len(g) == 2 for st in flat for g in st)
    assert stats.candidates < flat_stats.candidates


@pytest.mark.slow
def test_inception_search_over_operators_is_small():
    from tunedb.plan.stages import schedule_plan
    path = Path(__file__).resolve().parents[1] / "data" / "graphs" / "ios" / "inception_v3_b1.onnx"
    plan = compile_plan(split_conv_bias(__import__("tunedb.plan.driver", fromlist=["load_graph"])
                                        .load_graph(path, fill_initializers=False)),
                        device="generic", cost_model=False, horizontal=False)
    _, info = schedule_plan(plan)
    # IOS reports 5,479 candidates for Inception V3 at r = 3, s = 8 over conv-bn-relu operators
    assert 3000 < info["ios_candidates"] < 10000, info


def _host_kernels(tmp_path: Path) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "k.cpp"
    src.write_text(HOST_SHIM + KERNEL_SOURCE)
    lib = tmp_path / "k.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("k,stride,bias", [(3, 1, True), (5, 1, False), (3, 2, True)])
def test_depthwise_kernel_matches_the_reference(tmp_path, k, stride, bias):
    lib = _host_kernels(tmp_path)
    rng = np.random.default_rng(k * 10 + stride)
    n, c, h, w = 2, 5, 7, 9
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    gb = GraphBuilder("dw")
    ins = [gb.input("x", x.shape), gb.input("w", wt.shape)] + ([gb.input("b", b.shape)] if bias else [])
    p = k // 2
    y = gb.conv2d(*ins, strides=(stride, stride), pads=(p, p, p, p), dilations=(1, 1), groups=c)
    g = gb.build([y])
    feeds = {"x": x, "w": wt} | ({"b": b} if bias else {})
    want = run_reference(g, feeds)[y]
    out = np.full(want.shape, np.nan, dtype=np.float32)
    _, _, oh, ow = out.shape
    ptr = ctypes.c_void_p
    ll = ctypes.c_longlong
    lib.tdbx_dwconv2d_f32(ptr(x.ctypes.data), ptr(wt.ctypes.data), ptr((b if bias else wt).ctypes.data),
                          ptr(out.ctypes.data), *[ll(v) for v in (out.size, c, h, w, oh, ow, k, k, stride,
                                                                  stride, p, p, 1, 1, int(bias))])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_nasnet_depthwise_convs_are_single_steps_the_executor_can_take():
    g = nasnet_a_graph(1, channels=8, size=6, cells=1)
    dw = [n for n in g.nodes if n.op == "conv2d" and n.attr("groups") > 1]
    assert dw and all(n.attr("groups") == g.type_of(n.inputs[0]).shape[1] for n in dw)
