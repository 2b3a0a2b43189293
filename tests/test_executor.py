"""The plan executor on the CPU: imports without CuPy, input checks, how each step would run, the
executor's own CUDA kernels (compiled with nvcc, and as host C++ against the reference), and the
one-line error where there is no GPU."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.runtime.executor import ExecutorError, prepare_inputs, step_path
from tunedb.runtime.executor_ops import KERNEL_SOURCE

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT / "data" / "graphs"


def test_imports_without_cupy():
    code = ("import sys, tunedb.runtime.executor, tunedb.runtime.executor_ops, tunedb.bench.plan, "
            "tunedb.cli.bench, tunedb.cli; assert 'cupy' not in sys.modules, 'cupy imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr


# -- inputs ---------------------------------------------------------------------------------------
def _gather_graph():
    b = GraphBuilder("g")
    x = b.input("x", (4, 6), "bfloat16")
    idx = b.input("idx", (3,), "int64")
    return b.build([b.gather(x, idx, axis=0)])


def test_prepare_inputs_checks_and_converts():
    g = _gather_graph()
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    idx = np.array([0, 3, -4], dtype=np.int64)
    out = prepare_inputs(g, {"x": x, "idx": idx})
    assert out["x"].dtype == np.uint16 and out["x"].shape == (4, 6)
    back = (out["x"].astype(np.uint32) << 16).view(np.float32)
    assert np.allclose(back, x, rtol=8e-3) and not np.array_equal(back, x)  # rounded to bf16
    bits = out["x"]
    assert prepare_inputs(g, {"x": bits, "idx": idx})["x"] is not None  # uint16 bits go as they are
    with pytest.raises(ExecutorError, match="missing input.*'idx'"):
        prepare_inputs(g, {"x": x})
    with pytest.raises(ExecutorError, match="unknown input.*'y'"):
        prepare_inputs(g, {"x": x, "idx": idx, "y": x})
    with pytest.raises(ExecutorError, match=r"input 'x': expected bfloat16\[4,6\], got float32\[6,4\]"):
        prepare_inputs(g, {"x": x.T.copy(), "idx": idx})
    with pytest.raises(ExecutorError, match=r"input 'idx': expected int64\[3\], got int32\[3\]"):
        prepare_inputs(g, {"x": x, "idx": idx.astype(np.int32)})
    with pytest.raises(ExecutorError, match=r"gather index out of range \[-4, 4\)"):
        prepare_inputs(g, {"x": x, "idx": np.array([0, 4, 1])})
    for msg in (str(e) for e in _errors(g, x, idx)):
        assert "\n" not in msg


def _errors(g, x, idx):
    out = []
    for bad in ({"x": x}, {"x": x.astype(np.float64), "idx": idx}, {"x": x, "idx": idx[:2]}):
        try:
            prepare_inputs(g, bad)
        except ExecutorError as e:
            out.append(e)
    assert len(out) == 3
    return out


# -- how each step runs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped_plans():
    from tunedb.plan import compile

    names = ["bert_layer", "gpt2_block", "resnet_piece", "inception_mixed_5b"]
    return {n: compile(str(GRAPHS / f"{n}.onnx"), device="generic") for n in names}


def test_shipped_plans_have_a_direct_implementation_for_every_step(shipped_plans):
    seen = set()
    for name, plan in shipped_plans.items():
        paths = [step_path(s) for s in plan.steps]
        assert "cupy op by op" not in paths, (name, list(zip([s.ops for s in plan.steps], paths)))
        for s, p in zip(plan.steps, paths):
            assert (p == "view") == (s.kind == "layout_view")
            assert (p == "generated") == (s.kind == "fused")
        seen |= set(paths)
    # No layout copy is left in these: the heads' way back to rows is an output view now. Pools
    # are generated too (window kernels, with or without their elementwise neighbours).
    assert {"generated", "cublas", "conv (im2col + cublas)", "conv 1x1 (cublas)", "view"} <= seen
    assert "pool kernel" not in seen
    b = GraphBuilder("embedding")
    table = b.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    g = b.build([b.gather(table, b.input("ids", (5,), "int64"), axis=0)])
    from tunedb.plan import compile

    assert [step_path(s) for s in compile(g, device="generic").steps] == ["layout copy"]


def test_step_path_falls_back_for_ops_without_a_direct_kernel_only():
    from tunedb.plan import compile

    b = GraphBuilder("argmax_bf16_matmul")
    x = b.input("x", (8, 16), "bfloat16")
    w = b.input("w", (16, 4), "bfloat16")
    y = b.matmul(x, w)
    plan = compile(b.build([y, b.argmax(x, axis=1)]), device="generic")
    paths = {s.ops[0]: step_path(s) for s in plan.steps}
    assert paths["matmul"] == "cublas"  # bfloat16 GEMMs: cuBLAS on the stored bits, fp32 accumulation
    assert paths["argmax"] == "cupy op by op"


# -- the executor's CUDA kernels ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernels_compile_for_sm90(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(KERNEL_SOURCE)
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


HOST_PRELUDE = r"""
#include <cmath>
#include <cstring>
#define __global__
#define __restrict__ __restrict
struct tdbx_d3 { long long x; };
static tdbx_d3 blockIdx{0}, threadIdx{0}, blockDim{1}, gridDim{1};  // one thread: the loop does all
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline double __longlong_as_double(long long i) { double f; std::memcpy(&f, &i, 8); return f; }
"""


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """The kernels' own CUDA C compiled as host C++ (a grid-stride loop run by one thread)."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    wrappers = []
    for m in re.finditer(r'extern "C" __global__ void (\w+)\((.*?)\) \{', KERNEL_SOURCE, re.S):
        name, params = m.group(1), [p.strip() for p in m.group(2).split(",")]
        args = [f"*(long long*)a[{i}]" if p.startswith("long long") else f"({p.rsplit(' ', 1)[0]})a[{i}]"
                for i, p in enumerate(params)]
        wrappers.append(f'extern "C" void call_{name}(void** a) {{ {name}({", ".join(args)}); }}')
    text = HOST_PRELUDE + KERNEL_SOURCE.replace("__restrict__", "") + "\n".join(wrappers)
    d = tmp_path_factory.mktemp("hostk")
    so = d / f"k{hashlib.sha256(text.encode()).hexdigest()[:12]}.so"
    (d / "k.cpp").write_text(text)
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(so), str(d / "k.cpp")], check=True,
                   capture_output=True, text=True)
    lib = ctypes.CDLL(str(so))

    def call(name, *args):
        keep, ptrs = [], (ctypes.c_void_p * len(args))()
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                ptrs[i] = a.ctypes.data
            else:
                keep.append(ctypes.c_longlong(int(a)))
                ptrs[i] = ctypes.cast(ctypes.pointer(keep[-1]), ctypes.c_void_p)
        getattr(lib, "call_" + name)(ptrs)

    return call


CONVS = [  # (N, C, H, W), (O, Cg, KH, KW), strides, pads (t, l, b, r), dilations, groups
    ((1, 3, 9, 11), (4, 3, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ((2, 4, 10, 7), (6, 2, 3, 2), (2, 1), (0, 2, 1, 0), (1, 2), 2),
    ((1, 2, 8, 8), (3, 2, 5, 5), (3, 2), (2, 2, 2, 2), (1, 1), 1),
]


@pytest.mark.parametrize("xs,ws,strides,pads,dil,groups", CONVS)
def test_im2col_kernel_gives_the_reference_convolution(host_kernels, xs, ws, strides, pads, dil, groups):
    rng = np.random.default_rng(0)
    b = GraphBuilder("conv")
    x, w = b.input("x", xs), b.input("w", ws)
    g = b.build([b.conv2d(x, w, strides=strides, pads=pads, dilations=dil, groups=groups)])
    xv = rng.standard_normal(xs).astype(np.float32)
    wv = rng.standard_normal(ws).astype(np.float32)
    want = run_reference(g, {"x": xv, "w": wv})[g.outputs[0]]
    n, c, h, wd = xs
    o, cg, kh, kw = ws
    oh, ow = want.shape[2:]
    total = n * c * kh * kw * oh * ow
    cols = np.full(total, np.nan, np.float32)
    host_kernels("tdbx_im2col_f32", xv, cols, total, c, h, wd, oh, ow, kh, kw, *strides, pads[0], pads[1],
                 *dil)
    got = np.matmul(wv.reshape(groups, o // groups, cg * kh * kw).astype(np.float64),
                    cols.reshape(n, groups, cg * kh * kw, oh * ow)).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


POOLS = [  # op, kernel, strides, pads, dilations (max only), ceil_mode, count_include_pad (avg only)
    ("max_pool2d", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False, None),
    ("max_pool2d", (2, 3), (2, 2), (0, 1, 1, 0), (2, 1), True, None),
    ("avg_pool2d", (3, 3), (1, 1), (1, 1, 1, 1), None, False, True),
    ("avg_pool2d", (3, 2), (2, 2), (1, 0, 0, 1), None, True, False),
    ("avg_pool2d", (3, 3), (2, 2), (1, 1, 1, 1), None, True, True),
]


@pytest.mark.parametrize("op,k,s,p,d,ceil,cip", POOLS)
@pytest.mark.parametrize("kind", ["f32", "f64"])
def test_pool_kernel_matches_the_reference(host_kernels, op, k, s, p, d, ceil, cip, kind):
    rng = np.random.default_rng(1)
    b = GraphBuilder("pool")
    x = b.input("x", (2, 3, 9, 8))
    attrs = {"kernel": k, "strides": s, "pads": p, "ceil_mode": ceil}
    attrs.update({"dilations": d} if op == "max_pool2d" else {"count_include_pad": cip})
    g = b.build([b.op(op, x, **attrs)])
    xv = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    want = run_reference(g, {"x": xv})[g.outputs[0]]
    dt = np.float32 if kind == "f32" else np.float64
    y = np.full(want.shape, np.nan, dt)
    mode = 0 if op == "max_pool2d" else (2 if cip else 1)
    dh, dw = d or (1, 1)
    host_kernels(f"tdbx_pool2d_{kind}", xv.astype(dt), y, y.size, 9, 8, *want.shape[2:], *k, *s, *p, dh, dw,
                 mode)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


# -- no GPU ---------------------------------------------------------------------------------------
@pytest.mark.nogpu
def test_plan_run_without_gpu_is_a_one_line_error(shipped_plans):
    from tunedb.runtime import NoGPUError
    from tunedb.runtime.executor import PlanExecutor, execute_plan

    plan = shipped_plans["resnet_piece"]
    x = {"pixels": np.zeros((1, 3, 224, 224), np.float32)}
    for call in (lambda: plan.run(x), lambda: execute_plan(plan, x), lambda: PlanExecutor(plan)):
        with pytest.raises(NoGPUError) as e:
            call()
        assert str(e.value).startswith("no CUDA device") and "\n" not in str(e.value)
    # the reference backend still runs the same plan on the CPU
    out = plan.run({"pixels": np.full((1, 3, 224, 224), 0.5, np.float32)}, backend="reference")
    assert out["logits"].shape == (1, 1000) and np.isfinite(out["logits"]).all()
