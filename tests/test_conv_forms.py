"""Which form the executor gives a convolution (``executor_conv.conv_form``) and the batch-merged
im2col form itself: its row order checked as host C++ on the CPU, its launch count against the
planner's, and whole plans of both forms against the float64 reference on the GPU."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from host_cpp import build_host_lib, call_host

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ops import check_node
from tunedb.graph.reference import run_reference
from tunedb.runtime import executor_conv
from tunedb.runtime.executor_conv import conv_form, merges_batch
from tunedb.runtime.executor_kernels import KERNEL_SOURCE
from tunedb.runtime.executor_ops import compute_launches


def _attrs(k: int, stride: int = 1, groups: int = 1) -> dict:
    p = k // 2
    return {"strides": (stride, stride), "pads": (p,) * 4, "dilations": (1, 1), "groups": groups}


@pytest.fixture(autouse=True)
def im2col_not_cudnn(monkeypatch):
    """These tests are about the im2col forms: no convolution goes to cuDNN unless a test says so."""
    from tunedb.runtime import conv_chain, conv_cudnn

    monkeypatch.setattr(conv_cudnn, "CONV_CUDNN", "off")
    monkeypatch.setattr(conv_chain, "CHAIN", "off")


@pytest.fixture
def policy():
    """Set ``CONV_BATCH_MERGE`` for one test, and put "auto" back after it."""
    def set_(value: str) -> None:
        executor_conv.CONV_BATCH_MERGE = value
    yield set_
    executor_conv.CONV_BATCH_MERGE = "auto"


# -- the choice -----------------------------------------------------------------------------------
@pytest.mark.parametrize("x,w,a,itemsize,want", [
    # ResNet-50 at batch 8, bfloat16: 56x56 and 28x28 rows are 16-byte aligned, 14x14 (392 bytes)
    # and 7x7 are not: their im2col convolutions run one GEMM over the batch; a 1x1 one merges
    # only at 7x7 (short rows), as merging costs it an input transpose
    ((8, 64, 56, 56), (256, 64, 1, 1), _attrs(1), 2, "1x1"),
    ((8, 128, 28, 28), (128, 128, 3, 3), _attrs(3), 2, "im2col"),
    ((8, 256, 14, 14), (1024, 256, 1, 1), _attrs(1), 2, "1x1"),
    ((8, 512, 7, 7), (2048, 512, 1, 1), _attrs(1), 2, "im2col merged"),
    ((8, 96, 7, 7), (576, 96, 1, 1), _attrs(1), 2, "1x1"),  # MobileNetV3: a small GEMM
    ((8, 256, 28, 28), (256, 256, 3, 3), _attrs(3, 2), 2, "im2col merged"),  # -> 14x14
    ((8, 1024, 14, 14), (2048, 1024, 1, 1), _attrs(1, 2), 2, "im2col merged"),  # strided 1x1 -> 7x7
    ((8, 512, 7, 7), (512, 512, 3, 3), _attrs(3), 2, "im2col merged"),
    # float32 (SIMT GEMMs) keeps the per-sample form: 14x14 rows are aligned (784 bytes), and
    # merging the short 7x7 ones is not measured
    ((8, 256, 14, 14), (1024, 256, 1, 1), _attrs(1), 4, "1x1"),
    ((8, 512, 7, 7), (2048, 512, 1, 1), _attrs(1), 4, "1x1"),
    # one sample: nothing to merge
    ((1, 256, 14, 14), (1024, 256, 1, 1), _attrs(1), 2, "1x1"),
    ((1, 512, 7, 7), (512, 512, 3, 3), _attrs(3), 2, "im2col"),
    # a 1x1 convolution on [N, C, 1, 1] (squeeze-excitation) stays per sample, never merged
    ((8, 480, 1, 1), (20, 480, 1, 1), _attrs(1), 2, "1x1"),
    # grouped and depthwise convolutions keep their forms
    ((8, 64, 7, 7), (64, 32, 3, 3), _attrs(3, groups=2), 2, "im2col"),
    ((8, 64, 7, 7), (64, 1, 3, 3), _attrs(3, groups=64), 2, "depthwise"),
])
def test_conv_form_merges_the_batch_of_unaligned_or_short_gemms(x, w, a, itemsize, want):
    assert conv_form(x, w, a, itemsize) == want


def test_the_policy_forces_either_form(policy):
    x, w, a = (8, 64, 56, 56), (64, 64, 3, 3), _attrs(3)
    assert conv_form(x, w, a, 2) == "im2col"
    policy("always")
    assert conv_form(x, w, a, 2) == "im2col merged" and conv_form((1, 64, 56, 56), w, a, 2) == "im2col"
    policy("auto-unaligned")  # 1x1 convolutions merge on unaligned rows too
    assert conv_form((8, 256, 14, 14), (1024, 256, 1, 1), _attrs(1), 2) == "im2col merged"
    policy("auto-im2col")  # 1x1 convolutions keep their per-sample GEMM
    assert conv_form((8, 512, 7, 7), (2048, 512, 1, 1), _attrs(1), 2) == "1x1"
    assert conv_form((8, 256, 14, 14), (256, 256, 3, 3), _attrs(3), 2) == "im2col merged"
    policy("never")
    assert not merges_batch(8, 49, 2) and conv_form((8, 512, 7, 7), (512, 512, 3, 3), a, 2) == "im2col"


def _numpy_ops():
    from test_executor_launches import _ops

    return _ops(lt=False)


@pytest.mark.parametrize("k,bias", [(1, False), (3, True)])
def test_merged_form_counts_its_copy_kernel(policy, k, bias):
    policy("always")
    b = GraphBuilder("conv")
    x = b.input("x", (4, 16, 7, 7), "bfloat16")
    ins = [x, b.input("w", (32, 16, k, k), "bfloat16")] + ([b.input("b", (32,), "bfloat16")] if bias else [])
    g = b.build([b.conv2d(*ins, strides=(1, 1), pads=(k // 2,) * 4, dilations=(1, 1), groups=1)])
    node, types = g.nodes[0], g.type_map
    a = check_node(node, [types[v] for v in node.inputs])[1]
    arrays = [np.zeros(types[v].shape, np.uint16) for v in (*node.inputs, *node.outputs)]
    launches, kernels, path = _numpy_ops().build(node, a, arrays[:-1], arrays[-1:])
    assert path == "im2col + cublas, batch merged"
    # im2col, one GEMM, the [O, N, P] -> [N, O, P] copy, and the bias kernel
    assert len(launches) == kernels == compute_launches(node, types) == 3 + bias


@pytest.mark.parametrize("cudnn,layout,k,want", [
    ("auto", "nchw", 3, ("conv (cudnn nchw)", 1)), ("always", "nhwc", 1, ("conv (cudnn nhwc)", 3)),
    ("auto", "auto", 1, ("conv (cudnn nchw)", 1)), ("off", "nhwc", 3, ("conv (im2col + cublas)", 2))])
def test_explain_names_and_counts_the_cudnn_convolutions(monkeypatch, cudnn, layout, k, want):
    from types import SimpleNamespace

    from tunedb.runtime import conv_cudnn
    from tunedb.runtime.executor import step_path

    monkeypatch.setattr(conv_cudnn, "CONV_CUDNN", cudnn)
    monkeypatch.setattr(conv_cudnn, "LAYOUT", layout)
    b = GraphBuilder("conv")
    ins = [b.input("x", (8, 64, 56, 56), "bfloat16"), b.input("w", (64, 64, k, k), "bfloat16")]
    g = b.build([b.conv2d(*ins, strides=(1, 1), pads=(k // 2,) * 4, dilations=(1, 1), groups=1)])
    step = SimpleNamespace(kind="conv2d", graph=g)
    assert (step_path(step), compute_launches(g.nodes[0], g.type_map)) == want


# -- the kernel, as host C++ ----------------------------------------------------------------------
HOST = """
#include <cmath>
#include <cstring>
#define __global__
#define __restrict__ __restrict
struct tdbx_d3 { long long x; };
static tdbx_d3 blockIdx{0}, threadIdx{0}, blockDim{1}, gridDim{1};  // one thread does every row
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline double __longlong_as_double(long long i) { double f; std::memcpy(&f, &i, 8); return f; }
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory) -> ctypes.CDLL:
    return build_host_lib(tmp_path_factory.mktemp("convk"), HOST + KERNEL_SOURCE)


@pytest.mark.parametrize("xs,ws,stride,pad,dil", [
    ((3, 4, 9, 7), (5, 4, 3, 3), 2, 1, 1),
    ((2, 6, 7, 7), (8, 6, 1, 1), 1, 0, 1),
    ((4, 2, 8, 6), (3, 2, 3, 2), 1, 2, 2),
])
def test_merged_im2col_then_one_gemm_gives_the_reference_convolution(host_lib, xs, ws, stride, pad, dil):
    rng = np.random.default_rng(sum(xs))
    b = GraphBuilder("conv")
    x, w = b.input("x", xs), b.input("w", ws)
    g = b.build([b.conv2d(x, w, strides=(stride, stride), pads=(pad,) * 4, dilations=(dil, dil), groups=1)])
    xv, wv = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    want = run_reference(g, {"x": xv, "w": wv})[g.outputs[0]]
    n, c, h, wd = xs
    o, _, kh, kw = ws
    oh, ow = want.shape[2:]
    total = n * c * kh * kw * oh * ow
    cols = np.full(total, np.nan, np.float32)
    args = (total, c, h, wd, oh, ow, kh, kw, stride, stride, pad, pad, dil, dil)
    call_host(host_lib.tdbx_im2col_cnhw_f32, xv, cols, *args)
    y = wv.reshape(o, -1).astype(np.float64) @ cols.reshape(c * kh * kw, n * oh * ow)  # [O, N*P]
    got = y.reshape(o, n, oh, ow).transpose(1, 0, 2, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the 16-bit kernel moves the same elements
    bits = (xv.view(np.uint32) >> 16).astype(np.uint16)
    cols16 = np.full(total, 0xFFFF, np.uint16)
    call_host(host_lib.tdbx_im2col_cnhw_u16, bits, cols16, *args)
    assert np.array_equal(cols16, (cols.view(np.uint32) >> 16).astype(np.uint16))


TILED_HOST = """
#include <cstring>
#define __global__
#define __restrict__ __restrict
struct tdbx_d3 { unsigned x, y, z; };
static tdbx_d3 blockIdx{0, 0, 0}, threadIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
"""
# One thread per block runs every (ow, oh); the wrapper walks the grid (kernel positions x
# channels x samples, blockDim.z = 1).
TILED_GRID = """
extern "C" void grid_%(name)s(const %(t)s* x, %(t)s* cols, long long N, long long C, long long H,
    long long W, long long OH, long long OW, long long KH, long long KW, long long SH, long long SW,
    long long PT, long long PL, long long DH, long long DW) {
  gridDim = {(unsigned)(KH * KW), (unsigned)C, (unsigned)N};
  for (unsigned bx = 0; bx < gridDim.x; ++bx) for (unsigned by = 0; by < gridDim.y; ++by)
    for (unsigned bz = 0; bz < gridDim.z; ++bz) {
      blockIdx = {bx, by, bz};
      %(name)s(x, cols, N, C, H, W, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW);
    }
}
"""


@pytest.fixture(scope="module")
def tiled_lib(tmp_path_factory) -> ctypes.CDLL:
    from tunedb.runtime.executor_kernels import IM2COL_TILED_SOURCE

    grids = "".join(TILED_GRID % {"name": f"tdbx_im2col_tiled{o}_{n}", "t": t}
                    for o in ("", "_cnhw") for n, t in (("f32", "float"), ("u16", "unsigned short")))
    return build_host_lib(tmp_path_factory.mktemp("tiledk"), TILED_HOST + IM2COL_TILED_SOURCE + grids)


@pytest.mark.parametrize("order", ["", "_cnhw"])
@pytest.mark.parametrize("xs,ws,stride,pad,dil", [
    ((3, 4, 9, 7), (5, 4, 3, 3), 2, 1, 1), ((2, 6, 7, 7), (8, 6, 1, 1), 1, 0, 1),
    ((4, 2, 8, 6), (3, 2, 3, 2), 1, 2, 2),
])
def test_tiled_im2col_writes_the_rows_kernels_columns(host_lib, tiled_lib, order, xs, ws, stride, pad, dil):
    rng = np.random.default_rng(sum(xs) + len(order))
    n, c, h, wd = xs
    _, _, kh, kw = ws
    oh = (h + 2 * pad - dil * (kh - 1) - 1) // stride + 1
    ow = (wd + 2 * pad - dil * (kw - 1) - 1) // stride + 1
    total = n * c * kh * kw * oh * ow
    geometry = (h, wd, oh, ow, kh, kw, stride, stride, pad, pad, dil, dil)
    for kind, dt in (("f32", np.float32), ("u16", np.uint16)):
        xv = rng.standard_normal(xs).astype(np.float32)
        xv = xv if dt == np.float32 else (xv.view(np.uint32) >> 16).astype(np.uint16)
        want, got = np.zeros(total, dt), np.full(total, 7, dt)
        call_host(getattr(host_lib, f"tdbx_im2col{order}_{kind}"), xv, want, total, c, *geometry)
        call_host(getattr(tiled_lib, f"grid_tdbx_im2col_tiled{order}_{kind}"), xv, got, n, c, *geometry)
        assert np.array_equal(got, want)


def test_tiled_launch_shapes_fit_the_grid_limits():
    from tunedb.runtime.executor_conv import tiled_launch

    assert tiled_launch(8, 64, 56, 56, 3, 3) == ((9, 64, 8), (56, 4, 1))
    assert tiled_launch(8, 512, 7, 7, 3, 3) == ((9, 103, 8), (7, 7, 5))
    grid, block = tiled_launch(70000, 4096, 1, 1, 1, 1)  # z <= 64 per block, samples grid-strided
    assert block == (1, 1, 64) and grid == (1, 64, 65535)


class _HostModule:
    """``get_function`` of the host-compiled kernels, called like a CuPy kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def get_function(self, name: str):
        return lambda grid, block, args: call_host(getattr(self.lib, name), *args)


class _NumpyBlas:
    def gemm(self, x, y, out, **kwargs):
        return lambda: np.copyto(out, np.matmul(x.view(np.float32), y.view(np.float32)))


@pytest.mark.parametrize("form,k,stride,hw,kernel", [
    ("always", 3, 2, 9, "rows"), ("always", 1, 1, 9, "rows"), ("never", 3, 2, 9, "rows"),
    ("auto", 1, 1, 1, "rows"), ("always", 3, 2, 9, "tiled"), ("never", 3, 1, 9, "tiled")])
def test_im2col_form_launches_give_the_reference_on_the_cpu(host_lib, tiled_lib, monkeypatch, policy, form, k,
                                                            stride, hw, kernel):
    """The im2col forms' own launches (scratch views, GEMM shapes, the merged form's
    [O, N, P] -> [N, O, P] copy) with the host-compiled im2col kernels and NumPy standing in for
    cuBLAS and the copy kernel."""
    from tunedb.runtime.executor_ops import ComputeOps, KernelSet

    monkeypatch.setattr(executor_conv, "strided_copy", lambda cp, src, out: lambda: np.copyto(out, src))
    monkeypatch.setattr(executor_conv, "IM2COL_KERNEL", kernel)
    monkeypatch.setattr(executor_conv, "tiled_function", lambda cp, name: (
        lambda grid, block, args: call_host(getattr(tiled_lib, "grid_" + name), *args)))
    policy(form)
    rng = np.random.default_rng(k)
    b = GraphBuilder("conv")
    x, w = b.input("x", (3, 5, hw, hw)), b.input("w", (7, 5, k, k))
    g = b.build([b.conv2d(x, w, strides=(stride, stride), pads=(k // 2,) * 4, dilations=(1, 1), groups=1)])
    xv = rng.standard_normal((3, 5, hw, hw)).astype(np.float32)
    wv = rng.standard_normal((7, 5, k, k)).astype(np.float32)
    want = run_reference(g, {"x": xv, "w": wv})[g.outputs[0]]
    kernels = KernelSet.__new__(KernelSet)
    kernels.cp, kernels.max_blocks, kernels.module = np, 32, _HostModule(host_lib)
    buf = {}

    def scratch(nbytes):
        buf["b"] = np.full(nbytes, 0xFF, np.uint8)  # NaN everywhere the launches do not write
        return lambda: buf["b"]
    node = g.nodes[0]
    a = check_node(node, [g.type_of(v) for v in node.inputs])[1]
    out = np.full(want.shape, np.nan, np.float32)
    launches, kernels_n, path = ComputeOps(np, kernels, scratch, _NumpyBlas()).build(node, a, [xv, wv], [out])
    want_path = {"always": ("im2col + cublas, batch merged", 3), "never": ("im2col + cublas", 2),
                 "auto": ("cublas (1x1 conv as GEMM)", 1)}[form]  # auto: [N, C, 1, 1], per sample
    assert (path, kernels_n) == want_path
    for f in launches:
        f()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_a_conv_sent_to_cudnn_takes_im2col_where_cudnn_does_not_load(host_lib, tiled_lib, monkeypatch):
    """CONV_CUDNN on and no library here: the executor's builder notes why and runs the
    convolution as im2col + GEMM (host kernels, NumPy for cuBLAS), with the reference result."""
    from tunedb.runtime import conv_cudnn
    from tunedb.runtime.executor_ops import ComputeOps, KernelSet

    monkeypatch.setattr(conv_cudnn, "CONV_CUDNN", "always")
    monkeypatch.setattr(conv_cudnn, "_LIB", [])
    monkeypatch.setattr(conv_cudnn, "_candidates", lambda: ["/nonexistent/libcudnn.so.9"])
    monkeypatch.setattr(executor_conv, "IM2COL_KERNEL", "tiled")
    monkeypatch.setattr(executor_conv, "tiled_function", lambda cp, name: (
        lambda grid, block, args: call_host(getattr(tiled_lib, "grid_" + name), *args)))
    b = GraphBuilder("conv")
    x, w = b.input("x", (2, 5, 9, 9)), b.input("w", (7, 5, 3, 3))
    g = b.build([b.conv2d(x, w, strides=(1, 1), pads=(1,) * 4, dilations=(1, 1), groups=1)])
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((2, 5, 9, 9)).astype(np.float32)
    wv = rng.standard_normal((7, 5, 3, 3)).astype(np.float32)
    node = g.nodes[0]
    a = check_node(node, [g.type_of(v) for v in node.inputs])[1]
    assert conv_cudnn.cudnn_wanted(xv.shape, wv.shape, (2, 7, 9, 9), a, 4)
    kernels = KernelSet.__new__(KernelSet)
    kernels.cp, kernels.max_blocks, kernels.module = np, 32, _HostModule(host_lib)
    buf = {}

    def scratch(nbytes):
        buf["b"] = np.full(nbytes, 0xFF, np.uint8)
        return lambda: buf["b"]
    blas = _NumpyBlas()
    blas.stream = None  # cuDNN's handle would bind to it
    ops = ComputeOps(np, kernels, scratch, blas)
    out = np.full((2, 7, 9, 9), np.nan, np.float32)
    launches, n, path = ops.build(node, a, [xv, wv], [out])
    assert (path, n) == ("im2col + cublas", 2) and ops.dnn is None and "cannot load cuDNN" in ops.dnn_error
    for f in launches:
        f()
    np.testing.assert_allclose(out, run_reference(g, {"x": xv, "w": wv})[g.outputs[0]], rtol=1e-4, atol=1e-4)


def test_always_asks_cudnn_for_a_pointwise_conv_too(monkeypatch):
    """``always`` sends 1x1 convolutions to cuDNN as well (the GEMM form where it does not load)."""
    from tunedb.runtime import conv_cudnn
    from tunedb.runtime.executor_ops import ComputeOps

    monkeypatch.setattr(conv_cudnn, "CONV_CUDNN", "always")
    monkeypatch.setattr(conv_cudnn, "_LIB", [])
    monkeypatch.setattr(conv_cudnn, "_candidates", lambda: ["/nonexistent/libcudnn.so.9"])
    b = GraphBuilder("conv")
    x, w = b.input("x", (2, 6, 4, 4)), b.input("w", (5, 6, 1, 1))
    g = b.build([b.conv2d(x, w, strides=(1, 1), pads=(0,) * 4, dilations=(1, 1), groups=1)])
    rng = np.random.default_rng(4)
    xv = rng.standard_normal((2, 6, 4, 4)).astype(np.float32)
    wv = rng.standard_normal((5, 6, 1, 1)).astype(np.float32)
    node = g.nodes[0]
    a = check_node(node, [g.type_of(v) for v in node.inputs])[1]
    blas = _NumpyBlas()
    blas.stream = None
    ops = ComputeOps(np, None, lambda nbytes: None, blas)
    out = np.full((2, 5, 4, 4), np.nan, np.float32)
    launches, n, path = ops.build(node, a, [xv, wv], [out])
    assert (path, n) == ("cublas (1x1 conv as GEMM)", 1) and "cannot load cuDNN" in ops.dnn_error
    for f in launches:
        f()
    np.testing.assert_allclose(out, run_reference(g, {"x": xv, "w": wv})[g.outputs[0]], rtol=1e-4, atol=1e-4)


# -- the GPU --------------------------------------------------------------------------------------
def _cnn(dtype: str, batch: int):
    b = GraphBuilder(f"cnn_{dtype}")
    y = b.input("x", (batch, 16, 14, 14), dtype)
    names = iter(range(100))

    def w(shape):
        return b.input(f"w{next(names)}", shape, dtype)

    y = b.relu(b.conv2d(y, w((32, 16, 3, 3)), w((32,)), strides=(1, 1), pads=(1, 1, 1, 1),
                        dilations=(1, 1), groups=1))                                  # 14x14
    y = b.conv2d(y, w((48, 32, 1, 1)), strides=(1, 1), pads=(0,) * 4, dilations=(1, 1), groups=1)
    y = b.conv2d(y, w((24, 48, 3, 3)), strides=(2, 2), pads=(1,) * 4, dilations=(1, 1), groups=1)  # 7x7
    return b.build([y])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("form", ["never", "always"])
def test_both_forms_match_the_reference_on_the_gpu(policy, dtype, form):
    from plan_checks import check_outputs

    from tunedb.plan import compile
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs

    policy(form)
    plan = compile(_cnn(dtype, 3), device="cuda")
    ex = PlanExecutor(plan)
    merged = sum("batch merged" in p for p in ex.paths)
    assert merged == (3 if form == "always" else 0), ex.paths
    dev, ref_in = make_inputs(plan.graph, 5)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.graph_capture, ex.capture_error


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_tiled_im2col_compiles_for_sm90(tmp_path):
    from tunedb.runtime.executor_kernels import IM2COL_TILED_SOURCE

    src = tmp_path / "k.cu"
    src.write_text(IM2COL_TILED_SOURCE)
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


class _RecordingBlas(_NumpyBlas):
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, tuple, tuple]] = []

    def gemm(self, x, y, out, **kwargs):
        self.calls.append((x.shape, y.shape, out.shape))
        return super().gemm(x, y, out, **kwargs)


def test_squeeze_excitation_convs_run_per_sample_not_as_one_gemm():
    """A 1x1 conv on [N, C, 1, 1] runs as W @ x[n] batched over the samples: one GEMM
    x[N, C] @ W^T (2b87edc) took MobileNetV3 fp32 b8's 16 of them from 45.5 to 341.5 µs
    (672 -> 168: 3.7 -> 54 µs), EfficientNet's 32 from 75 to 106 µs in bf16, and won only
    4.8 µs in MobileNetV3 bf16 (H200, same call, data/bench/conv_steps_b8_h200.json)."""
    from tunedb.runtime.executor_ops import ComputeOps

    b = GraphBuilder("se")
    x, w = b.input("x", (8, 24, 1, 1)), b.input("w", (6, 24, 1, 1))
    g = b.build([b.conv2d(x, w, strides=(1, 1), pads=(0,) * 4, dilations=(1, 1), groups=1)])
    node = g.nodes[0]
    a = check_node(node, [g.type_of(v) for v in node.inputs])[1]
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((8, 24, 1, 1)).astype(np.float32)
    wv = rng.standard_normal((6, 24, 1, 1)).astype(np.float32)
    want = run_reference(g, {"x": xv, "w": wv})[g.outputs[0]]
    out = np.full(want.shape, np.nan, np.float32)
    blas = _RecordingBlas()
    launches, n, path = ComputeOps(np, None, lambda nb: None, blas).build(node, a, [xv, wv], [out])
    assert (n, path) == (1, "cublas (1x1 conv as GEMM)")
    assert blas.calls == [((6, 24), (8, 24, 1), (8, 6, 1))]  # the weight broadcast over samples
    for f in launches:
        f()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
