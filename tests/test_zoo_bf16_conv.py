"""bfloat16 convolutions in the executor (the zoo's bf16 CNNs ran them CuPy op by op): im2col on
the 16-bit bits, a bf16 depthwise kernel and a bf16 bias add, checked as host C++ on the CPU,
and whole bf16 convolution plans on the GPU against the float64 reference."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from host_cpp import build_host_lib, call_host
from plan_checks import check_outputs

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.runtime.executor import step_path
from tunedb.runtime.executor_kernels import KERNEL_SOURCE
from tunedb.runtime.inputs import bf16_bits, make_inputs

HOST = """
#include <cmath>
struct dim3_ { unsigned x, y, z; };
static dim3_ blockIdx{0, 0, 0}, threadIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
#define __global__
#define __restrict__ __restrict
static inline float __int_as_float(int v) { float f; __builtin_memcpy(&f, &v, 4); return f; }
static inline double __longlong_as_double(long long v) { double d; __builtin_memcpy(&d, &v, 8); return d; }
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    return build_host_lib(tmp_path_factory.mktemp("bf16k"), HOST + KERNEL_SOURCE)


def _wide(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _rounded(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return bf16_bits(rng.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("k,stride,bias", [(3, 1, True), (5, 2, False)])
def test_bf16_depthwise_kernel_matches_the_reference(lib, k, stride, bias):
    rng = np.random.default_rng(k + stride)
    n, c, h, w = 2, 5, 9, 7
    x, wt, b = _rounded(rng, (n, c, h, w)), _rounded(rng, (c, 1, k, k)), _rounded(rng, (c,))
    gb = GraphBuilder("dw_bf16")
    ins = [gb.input("x", x.shape, "bfloat16"), gb.input("w", wt.shape, "bfloat16")]
    ins += [gb.input("b", b.shape, "bfloat16")] if bias else []
    p = k // 2
    y = gb.conv2d(*ins, strides=(stride, stride), pads=(p, p, p, p), dilations=(1, 1), groups=c)
    g = gb.build([y])
    want = run_reference(g, {"x": _wide(x), "w": _wide(wt)} | ({"b": _wide(b)} if bias else {}))[y]
    out = np.zeros(want.shape, np.uint16)
    oh, ow = out.shape[2:]
    call_host(lib.tdbx_dwconv2d_bf16, x, wt, b, out, out.size, c, h, w, oh, ow, k, k, stride, stride,
          p, p, 1, 1, int(bias))
    # fp32 accumulation, one rounding: within one bf16 step of the float64 result
    np.testing.assert_allclose(_wide(out), want, rtol=2 ** -8, atol=1e-6)


def test_bf16_bias_kernel_rounds_like_the_runtime(lib):
    rng = np.random.default_rng(1)
    y, b = _rounded(rng, (2, 3, 4, 5)), _rounded(rng, (3,))
    want = bf16_bits(_wide(y) + _wide(b).reshape(1, 3, 1, 1))
    call_host(lib.tdbx_bias_nchw_bf16, y, b, y.size, 3, 20)
    assert np.array_equal(y, want)


def test_u16_im2col_moves_the_same_elements_as_f32(lib):
    rng = np.random.default_rng(2)
    n, c, h, w, k = 1, 3, 6, 5, 3
    x = _rounded(rng, (n, c, h, w))
    oh, ow = 3, 3  # stride 2, pad 1
    total = n * c * k * k * oh * ow
    cols16, cols32 = np.full(total, 0xFFFF, np.uint16), np.full(total, np.nan, np.float32)
    args = (total, c, h, w, oh, ow, k, k, 2, 2, 1, 1, 1, 1)
    call_host(lib.tdbx_im2col_u16, x, cols16, *args)
    call_host(lib.tdbx_im2col_f32, _wide(x), cols32, *args)
    assert np.array_equal(_wide(cols16), cols32)  # padding included: +0.0 both ways


def _cnn_bf16():
    b = GraphBuilder("cnn_bf16")
    x = b.input("x", (2, 8, 12, 12), "bfloat16")

    names = iter(range(100))

    def w(shape):
        return b.input(f"w{next(names)}", shape, "bfloat16")

    y = b.relu(b.conv2d(x, w((16, 8, 3, 3)), w((16,)), strides=(2, 2), pads=(1, 1, 1, 1),
                        dilations=(1, 1), groups=1))                                  # im2col + bias
    y = b.conv2d(y, w((16, 1, 3, 3)), w((16,)), strides=(1, 1), pads=(1, 1, 1, 1),
                 dilations=(1, 1), groups=16)                                       # depthwise
    y = b.conv2d(y, w((8, 16, 1, 1)), strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1),
                 groups=1)                                                          # 1x1 GEMM
    y = b.conv2d(y, w((8, 4, 3, 3)), strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1),
                 groups=2)                                                          # grouped
    return b.build([y])


def test_bf16_convolutions_are_planned_onto_the_direct_paths():
    from tunedb.plan import compile

    plan = compile(_cnn_bf16(), device="generic", cost_model=False)
    paths = [step_path(s) for s in plan.steps if s.kind == "conv2d"]
    assert paths and "cupy op by op" not in paths, paths


@pytest.mark.gpu
def test_bf16_cnn_plan_matches_the_reference_on_the_gpu():
    from tunedb.plan import compile
    from tunedb.runtime.executor import PlanExecutor

    plan = compile(_cnn_bf16(), device="cuda")
    ex = PlanExecutor(plan)
    assert "cupy op by op" not in [p for p, s in zip(ex.paths, plan.steps) if s.kind == "conv2d"]
    dev, ref_in = make_inputs(plan.graph, 3)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.graph_capture, ex.capture_error
