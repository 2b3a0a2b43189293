"""Float64 reference interpreter: per-op values against NumPy, naive loops and onnxruntime."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunedb.graph import GraphBuilder, GraphError, run_reference
from tunedb.graph.ir import Graph
from tunedb.graph.reference import erf_series

RNG = np.random.default_rng(1234)


def single(op: str, shapes: list[tuple], dtypes: list[str] | None = None, **attrs):
    b = GraphBuilder(op)
    dtypes = dtypes or ["float32"] * len(shapes)
    xs = [b.input(f"x{i}", s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    out = b.op(op, *xs, **attrs)
    return b.build(list(out) if isinstance(out, tuple) else [out])


def run1(op: str, *arrays: np.ndarray, dtypes: list[str] | None = None, **attrs) -> np.ndarray:
    g = single(op, [a.shape for a in arrays], dtypes, **attrs)
    outs = run_reference(g, {f"x{i}": a for i, a in enumerate(arrays)})
    return list(outs.values())[0] if len(outs) == 1 else list(outs.values())


def test_input_checks() -> None:
    g = single("exp", [(4, 8)])
    with pytest.raises(GraphError, match=r"^input 'x0': expected float32\[4,8\], got float32\[4,9\]$"):
        run_reference(g, {"x0": np.zeros((4, 9), np.float32)})
    with pytest.raises(GraphError, match=r"input 'x0': expected float32\[4,8\], got int64\[4,8\]"):
        run_reference(g, {"x0": np.zeros((4, 8), np.int64)})
    with pytest.raises(GraphError, match="missing input.*'x0'.*unknown input.*'y'"):
        run_reference(g, {"y": np.zeros((4, 8))})
    out = run_reference(g, {"x0": np.zeros((4, 8), np.float16)})  # any float array for a float input
    assert out[g.outputs[0]].dtype == np.float64


@pytest.mark.parametrize("op,fn", [
    ("neg", np.negative), ("abs", np.abs), ("exp", np.exp), ("sin", np.sin), ("cos", np.cos),
    ("tanh", np.tanh), ("floor", np.floor), ("ceil", np.ceil), ("sign", np.sign),
    ("relu", lambda x: np.maximum(x, 0)), ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
    ("erf", np.vectorize(math.erf)), ("identity", lambda x: x),
])
def test_unary_values(op: str, fn) -> None:
    x = RNG.normal(size=(5, 7)) * 3
    np.testing.assert_allclose(run1(op, x), fn(x), rtol=1e-13, atol=1e-15)


def test_positive_domain_unary_values() -> None:
    x = RNG.uniform(0.1, 10, size=50)
    np.testing.assert_allclose(run1("log", x), np.log(x), rtol=1e-15)
    np.testing.assert_allclose(run1("sqrt", x), np.sqrt(x), rtol=1e-15)
    np.testing.assert_allclose(run1("rsqrt", x), 1 / np.sqrt(x), rtol=1e-15)
    np.testing.assert_allclose(run1("reciprocal", x), 1 / x, rtol=1e-15)


def test_gelu_clip_leaky_relu_and_extreme_sigmoid() -> None:
    x = np.linspace(-10, 10, 401)
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(run1("gelu", x), 0.5 * x * (1 + erf(x / math.sqrt(2))), rtol=1e-12, atol=1e-15)
    tanh_form = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(run1("gelu", x, approximate="tanh"), tanh_form, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(run1("clip", x, min=-1.5, max=2), np.clip(x, -1.5, 2))
    np.testing.assert_array_equal(run1("leaky_relu", x, alpha=0.2), np.where(x > 0, x, 0.2 * x))
    s = run1("sigmoid", np.array([-800.0, 0.0, 800.0]))
    np.testing.assert_array_equal(s, [0.0, 0.5, 1.0])


def test_erf_series_without_scipy() -> None:
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, 1e-300, -1e-10, 3.0, -3.0, 30.0, np.inf]])
    want = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf_series(x), want, rtol=2e-15, atol=1e-300)
    assert np.isnan(erf_series(np.array([np.nan])))[0]


def test_integer_and_bool_semantics() -> None:
    a = np.array([7, -7, 7, -7, 5, 0], np.int64)
    b = np.array([2, 2, -2, -2, 0, 3], np.int64)
    i64 = ["int64", "int64"]
    div = run1("div", a, b, dtypes=i64)
    assert div.dtype == np.int64 and div.tolist() == [3, -3, -3, 3, 0, 0]  # truncates toward zero
    assert run1("mod", a, b, dtypes=i64).tolist() == [1, 1, -1, -1, 0, 0]  # sign of the divisor
    np.testing.assert_allclose(run1("mod", a * 1.0, b * 1.0)[:4], [1, 1, -1, -1])
    assert run1("relu", a, dtypes=["int64"]).tolist() == [7, 0, 7, 0, 5, 0]
    assert run1("clip", a, dtypes=["int64"], min=-2.5, max=4.5).tolist() == [4, -2, 4, -2, 4, 0]
    x = np.array([-2.7, -0.5, 0.0, 2.9, 3e9])
    assert run1("cast", x, to="int64").tolist() == [-2, 0, 0, 2, 3000000000]
    assert run1("cast", x, to="int32")[-1] == np.int64(3000000000).astype(np.int32)  # wraps like C
    assert run1("cast", x, to="bool").tolist() == [True, True, False, True, True]
    assert run1("cast", np.array([True, False]), dtypes=["bool"], to="float16").tolist() == [1.0, 0.0]
    p, q = np.array([True, True, False]), np.array([True, False, False])
    assert run1("and", p, q, dtypes=["bool"] * 2).tolist() == [True, False, False]
    assert run1("or", p, q, dtypes=["bool"] * 2).tolist() == [True, True, False]
    assert run1("not", p, dtypes=["bool"]).tolist() == [False, False, True]
    assert run1("lt", a, b, dtypes=i64).dtype == np.bool_


def test_binary_broadcast_where_and_reductions() -> None:
    x, y = RNG.normal(size=(4, 1, 3)), RNG.normal(size=(5, 1))
    for op, fn in [("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("div", np.divide),
                   ("max", np.maximum), ("min", np.minimum), ("ge", np.greater_equal)]:
        np.testing.assert_array_equal(run1(op, x, y), fn(x, y))
    np.testing.assert_allclose(run1("pow", np.abs(x), y), np.abs(x) ** y, rtol=1e-15)
    c = RNG.normal(size=(5, 3)) > 0
    np.testing.assert_array_equal(run1("where", c, x, y, dtypes=["bool", "float32", "float32"]),
                                  np.where(c, x, y))
    z = RNG.normal(size=(3, 4, 5))
    for op, fn in [("reduce_sum", np.sum), ("reduce_mean", np.mean), ("reduce_max", np.max),
                   ("reduce_min", np.min), ("reduce_prod", np.prod)]:
        got = run1(op, z, axes=(0, -1), keepdims=True)
        np.testing.assert_allclose(got, fn(z, axis=(0, 2), keepdims=True))
        np.testing.assert_allclose(run1(op, z), fn(z))
    np.testing.assert_array_equal(run1("argmax", z, axis=1, keepdims=True), np.argmax(z, 1)[:, None, :])
    np.testing.assert_allclose(run1("global_avg_pool", z), z.mean(-1, keepdims=True))
    np.testing.assert_array_equal(run1("global_max_pool", z), z.max(-1, keepdims=True))


def test_layout_ops() -> None:
    x = RNG.normal(size=(3, 4, 5))
    np.testing.assert_array_equal(run1("transpose", x, perm=(1, 2, 0)), x.transpose(1, 2, 0))
    np.testing.assert_array_equal(run1("reshape", x, shape=(-1, 5)), x.reshape(12, 5))
    np.testing.assert_array_equal(run1("unsqueeze", x, axes=(0, -1)), x[None, ..., None])
    np.testing.assert_array_equal(run1("squeeze", x[:, :1], axes=(1,)), x[:, 0])
    np.testing.assert_array_equal(run1("expand", x[:, :1], shape=(2, 1, 1, 1)),
                                  np.broadcast_to(x[:, :1], (2, 3, 1, 5)))
    np.testing.assert_array_equal(run1("slice", x, starts=(-1, 0), ends=(-1000, 5), axes=(0, 2),
                                       steps=(-1, 2)), x[::-1, :, 0:5:2])
    np.testing.assert_array_equal(run1("slice", x, starts=(3,), ends=(0,), axes=(1,), steps=(-2,)),
                                  x[:, 3:0:-2])
    a, b_ = run1("split", x, axis=1, sizes=(1, 3))
    np.testing.assert_array_equal(a, x[:, :1])
    np.testing.assert_array_equal(b_, x[:, 1:])
    g = single("concat", [(3, 4, 5), (3, 2, 5)], axis=1)
    y = RNG.normal(size=(3, 2, 5))
    np.testing.assert_array_equal(run_reference(g, {"x0": x, "x1": y})[g.outputs[0]],
                                  np.concatenate([x, y], 1))
    np.testing.assert_array_equal(run1("pad", x, pads=(1, 0, -2, 0, 2, 1), value=-3.5),
                                  np.pad(x[:, :, 2:], ((1, 0), (0, 2), (0, 1)), constant_values=-3.5))
    idx = np.array([[2, -1], [0, 1]])
    np.testing.assert_array_equal(run1("gather", x, idx, dtypes=["float32", "int64"], axis=1),
                                  np.take(x, idx, axis=1))
    ie = RNG.integers(0, 4, size=(2, 3, 5))
    np.testing.assert_array_equal(run1("gather_elements", x, ie, dtypes=["float32", "int64"], axis=1),
                                  np.take_along_axis(x[:2], ie, axis=1))
    with pytest.raises(GraphError, match="out of range"):
        run1("gather_elements", x, ie + 10, dtypes=["float32", "int64"], axis=1)


def test_matmul_and_gemm() -> None:
    a, b = RNG.normal(size=(2, 1, 3, 4)), RNG.normal(size=(5, 4, 6))
    np.testing.assert_allclose(run1("matmul", a, b), a @ b, rtol=1e-14)
    v = RNG.normal(size=4)
    np.testing.assert_allclose(run1("matmul", v, b), v @ b, rtol=1e-14)
    A, B, C = RNG.normal(size=(4, 3)), RNG.normal(size=(5, 4)), RNG.normal(size=(1, 5))
    got = run1("gemm", A, B, C, alpha=0.5, beta=2.0, trans_a=True, trans_b=True)
    np.testing.assert_allclose(got, 0.5 * A.T @ B.T + 2.0 * C, rtol=1e-14)


def naive_conv(x, w, bias, strides, pads, dil, groups):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (h + pads[0] + pads[2] - dil[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (wd + pads[1] + pads[3] - dil[1] * (kw - 1) - 1) // strides[1] + 1
    y = np.zeros((n, o, oh, ow))
    og = o // groups
    for b in range(n):
        for oc in range(o):
            g = oc // og
            for i in range(oh):
                for j in range(ow):
                    s = 0.0
                    for ic in range(cg):
                        for p in range(kh):
                            for q in range(kw):
                                s += w[oc, ic, p, q] * xp[b, g * cg + ic, i * strides[0] + p * dil[0],
                                                          j * strides[1] + q * dil[1]]
                    y[b, oc, i, j] = s + (bias[oc] if bias is not None else 0.0)
    return y


@pytest.mark.parametrize("groups,strides,pads,dil,bias", [
    (1, (1, 1), (0, 0, 0, 0), (1, 1), False), (2, (2, 1), (1, 0, 2, 1), (1, 2), True),
    (4, (1, 2), (1, 1, 1, 1), (2, 1), True),
])
def test_conv2d_matches_naive_loop(groups, strides, pads, dil, bias) -> None:
    x, w = RNG.normal(size=(2, 4, 7, 6)), RNG.normal(size=(4, 4 // groups, 3, 2))
    bv = RNG.normal(size=4) if bias else None
    args = (x, w, bv) if bias else (x, w)
    got = run1("conv2d", *args, strides=strides, pads=pads, dilations=dil, groups=groups)
    np.testing.assert_allclose(got, naive_conv(x, w, bv, strides, pads, dil, groups), rtol=1e-12, atol=1e-12)


def test_conv2d_resnet_sized_layer_runs() -> None:
    b = GraphBuilder()
    x, w = b.input("x", (1, 64, 56, 56)), b.input("w", (64, 64, 3, 3))
    g = b.build([b.conv2d(x, w, pads=(1, 1, 1, 1))])
    xv, wv = RNG.normal(size=(1, 64, 56, 56)), RNG.normal(size=(64, 64, 3, 3))
    (y,) = run_reference(g, {"x": xv, "w": wv}).values()
    assert y.shape == (1, 64, 56, 56)
    # one output pixel by hand
    np.testing.assert_allclose(y[0, 5, 10, 20], np.sum(xv[0, :, 9:12, 19:22] * wv[5]), rtol=1e-12)


def naive_pool(x, op, k, s, pads, dil, ceil, include_pad):
    n, c, h, w = x.shape
    from tunedb.graph.ops import conv_out_dim

    oh = conv_out_dim(h, k[0], s[0], pads[0], pads[2], dil[0], ceil)
    ow = conv_out_dim(w, k[1], s[1], pads[1], pads[3], dil[1], ceil)
    y = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            vals, count = [], 0
            for p in range(k[0]):
                for q in range(k[1]):
                    r, t = i * s[0] - pads[0] + p * dil[0], j * s[1] - pads[1] + q * dil[1]
                    if 0 <= r < h and 0 <= t < w:
                        vals.append(x[:, :, r, t])
                        count += 1
                    elif -pads[0] <= r < h + pads[2] and -pads[1] <= t < w + pads[3]:
                        count += include_pad
            stack = np.stack(vals)
            y[:, :, i, j] = stack.max(0) if op == "max" else stack.sum(0) / count
    return y


@pytest.mark.parametrize("k,s,pads,dil,ceil", [
    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False), ((3, 3), (2, 2), (0, 0, 0, 0), (1, 1), True),
    ((2, 3), (2, 1), (1, 0, 0, 2), (1, 1), True), ((2, 2), (3, 3), (1, 1, 1, 1), (2, 1), True),
])
def test_pools_match_naive_loop(k, s, pads, dil, ceil) -> None:
    x = RNG.normal(size=(2, 3, 8, 7))
    got = run1("max_pool2d", x, kernel=k, strides=s, pads=pads, dilations=dil, ceil_mode=ceil)
    np.testing.assert_array_equal(got, naive_pool(x, "max", k, s, pads, dil, ceil, False))
    for inc in (False, True):
        got = run1("avg_pool2d", x, kernel=k, strides=s, pads=pads, ceil_mode=ceil, count_include_pad=inc)
        np.testing.assert_allclose(got, naive_pool(x, "avg", k, s, pads, (1, 1), ceil, inc), rtol=1e-13)


def _onnx_run(node_type: str, inputs: list[np.ndarray], **attrs) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    names = [f"i{k}" for k in range(len(inputs))]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT if a.dtype == np.float32 else TensorProto.INT64,
                                        a.shape) for n, a in zip(names, inputs)]
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, None)
    node = helper.make_node(node_type, names, ["o"], **attrs)
    model = helper.make_model(helper.make_graph([node], "g", vi, [out]),
                              opset_imports=[helper.make_opsetid("", 19)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, inputs)))[0]


@pytest.mark.parametrize("ceil,include_pad,pads", [(1, 0, (1, 1, 1, 1)), (1, 1, (1, 0, 1, 0)),
                                                   (0, 1, (1, 1, 1, 1)), (1, 0, (0, 0, 0, 0))])
def test_pools_agree_with_onnxruntime(ceil: int, include_pad: int, pads) -> None:
    x = RNG.normal(size=(1, 2, 9, 10)).astype(np.float32)
    kw = dict(kernel_shape=[3, 3], strides=[2, 2], pads=list(pads), ceil_mode=ceil)
    want = _onnx_run("MaxPool", [x], **kw)
    got = run1("max_pool2d", x, kernel=(3, 3), strides=(2, 2), pads=pads, ceil_mode=bool(ceil))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    want = _onnx_run("AveragePool", [x], count_include_pad=include_pad, **kw)
    got = run1("avg_pool2d", x, kernel=(3, 3), strides=(2, 2), pads=pads, ceil_mode=bool(ceil),
               count_include_pad=bool(include_pad))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_conv_slice_gather_elements_agree_with_onnxruntime() -> None:
    x, w = RNG.normal(size=(1, 4, 9, 8)).astype(np.float32), RNG.normal(size=(6, 2, 3, 3)).astype(np.float32)
    want = _onnx_run("Conv", [x, w], group=2, strides=[2, 1], pads=[1, 0, 2, 1], dilations=[1, 2])
    got = run1("conv2d", x, w, groups=2, strides=(2, 1), pads=(1, 0, 2, 1), dilations=(1, 2))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    ort_slice = [np.array(v, np.int64) for v in ([-2, 7], [-100, 1], [2, 3], [-1, -3])]
    want = _onnx_run("Slice", [x] + ort_slice)
    got = run1("slice", x, starts=(-2, 7), ends=(-100, 1), axes=(2, 3), steps=(-1, -3))
    np.testing.assert_array_equal(got, want)
    idx = RNG.integers(-4, 4, size=(1, 3, 9, 8))
    want = _onnx_run("GatherElements", [x, idx], axis=1)
    got = run1("gather_elements", x, idx, dtypes=["float32", "int64"], axis=1)
    np.testing.assert_array_equal(got, want)


def test_constants_and_bfloat16() -> None:
    b = GraphBuilder()
    x = b.input("x", (3,), "bfloat16")
    c = b.constant(np.array([1.0, 1 / 3, 3.0], np.float32), dtype="bfloat16")
    g: Graph = b.build([b.mul(x, c)])
    (y,) = run_reference(g, {"x": np.ones(3, np.float32)}).values()
    assert y[1] == 0.333984375  # 1/3 rounded to bfloat16, then computed in float64


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(shape), st.none() | st.sets(st.integers(0, len(shape) - 1)),
                            st.booleans(), st.sampled_from(sorted(REDUCE_FNS)))))
@settings(max_examples=60, deadline=None)
def test_reduction_values_match_numpy(case: tuple) -> None:
    shape, axes, keepdims, op = case
    x = np.random.default_rng(len(shape)).normal(size=shape)
    ax = None if axes is None else tuple(sorted(axes))
    got = run1(op, x, axes=ax, keepdims=keepdims)
    np.testing.assert_allclose(got, REDUCE_FNS[op](x, axis=ax, keepdims=keepdims), rtol=1e-13)


@given(st.lists(st.integers(1, 3), max_size=3), st.lists(st.integers(1, 3), max_size=3),
       st.sampled_from(["add", "mul", "max", "gt"]))
@settings(max_examples=60, deadline=None)
def test_broadcast_values_match_numpy(a: list[int], b: list[int], op: str) -> None:
    try:
        np.broadcast_shapes(tuple(a), tuple(b))
    except ValueError:
        return
    x, y = RNG.normal(size=a), RNG.normal(size=b)
    fn = {"add": np.add, "mul": np.multiply, "max": np.maximum, "gt": np.greater}[op]
    np.testing.assert_array_equal(run1(op, np.asarray(x), np.asarray(y)), fn(x, y))


REDUCE_FNS = {"reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_max": np.max,
              "reduce_min": np.min, "reduce_prod": np.prod}
