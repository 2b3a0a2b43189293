"""Tiny one-op ONNX models for tests/test_onnx_import.py (no tests here).

A case is (id, nodes, inputs, initializers, opset, outputs): ``inputs``/``initializers`` map
names to arrays; the model's output is the first output of the last node unless ``outputs``
lists several. Inputs are fixed, seeded and never all zeros. ``make_model`` builds a checked
model whose output types come from ONNX shape inference.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(1234)
INT64_MAX = np.iinfo(np.int64).max


def f32(*shape: int, lo: float | None = None) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    return np.abs(x) + lo if lo is not None else x


def i64(*shape: int, lo: int = -5, hi: int = 6) -> np.ndarray:
    return rng.integers(lo, hi, size=shape).astype(np.int64)


def boo(*shape: int) -> np.ndarray:
    return rng.random(shape) < 0.5


def ints(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def node(op: str, ins: list[str], outs: list[str] | None = None, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs or ["y"], **attrs)


def make_model(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray],
               inits: dict[str, np.ndarray] | None = None, opset: int = 17,
               outputs: list[str] | None = None) -> onnx.ModelProto:
    """A checked model; output types come from ONNX shape inference."""
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in inputs.items()]
    outs = outputs or [nodes[-1].output[0]]
    g = helper.make_graph(nodes, "case", vis, [helper.make_empty_tensor_value_info(o) for o in outs],
                          initializer=[numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10  # what onnxruntime and the checker both accept for opsets up to 23
    standard = all(onnx.defs.has(n.op_type) for n in nodes)
    m = onnx.shape_inference.infer_shapes(m, strict_mode=standard)
    for o in m.graph.output:
        t = o.type.tensor_type
        if not t.HasField("shape"):  # ops without an ONNX schema: the first input's rank
            t.shape.CopyFrom(vis[0].type.tensor_type.shape)
        for d in t.shape.dim:  # onnxruntime's shapes are the truth (ceil-mode pools differ)
            d.Clear()
        if not t.elem_type:  # ops without an ONNX schema: the first input's type
            t.elem_type = vis[0].type.tensor_type.elem_type
    if standard:
        onnx.checker.check_model(m)
    return m


def _cases() -> list[tuple]:
    c: list[tuple] = []

    def add(id_: str, nodes, inputs, inits=None, opset=17, outputs=None):
        c.append((id_, nodes if isinstance(nodes, list) else [nodes], inputs, inits or {}, opset,
                  outputs))

    x34 = {"x": f32(3, 4)}
    pos = {"x": f32(3, 4, lo=0.1)}
    for op in ("Neg", "Abs", "Exp", "Sin", "Cos", "Tanh", "Sigmoid", "Relu", "Erf", "Floor", "Ceil",
               "Sign"):
        add(op, node(op, ["x"]), {"x": f32(3, 4) * 2})
    for op in ("Log", "Sqrt", "Reciprocal"):
        add(op, node(op, ["x"]), pos)
    add("Neg-int", node("Neg", ["x"]), {"x": i64(3, 4)})
    add("Abs-int", node("Abs", ["x"]), {"x": i64(3, 4)})
    add("Not", node("Not", ["x"]), {"x": boo(3, 4)})
    add("LeakyRelu", node("LeakyRelu", ["x"], alpha=0.2), x34)
    add("Gelu-erf", node("Gelu", ["x"]), x34, opset=20)
    add("Gelu-tanh", node("Gelu", ["x"], approximate="tanh"), x34, opset=20)
    ab = {"a": f32(3, 4), "b": f32(3, 4)}
    for op in ("Add", "Sub", "Mul", "Div"):
        add(op, node(op, ["a", "b"]), ab)
    add("Add-broadcast", node("Add", ["a", "b"]), {"a": f32(2, 3, 4), "b": f32(4)})
    add("Mul-int", node("Mul", ["a", "b"]), {"a": i64(3, 4), "b": i64(4)})
    add("Div-int-trunc", node("Div", ["a", "b"]), {"a": i64(3, 4, lo=-20, hi=20),
                                                   "b": i64(3, 4, lo=1, hi=7) * np.where(boo(3, 4), 1, -1)})
    add("Pow", node("Pow", ["a", "b"]), {"a": f32(3, 4, lo=0.5), "b": f32(3, 4)})
    add("Pow-int-exponent", node("Pow", ["a", "e"]), {"a": f32(3, 4)}, {"e": ints(3)})
    add("Max", node("Max", ["a", "b", "c"]), {**ab, "c": f32(4)})
    add("Min", node("Min", ["a", "b"]), ab)
    add("Max-int", node("Max", ["a", "b"]), {"a": i64(3, 4), "b": i64(3, 4)})
    add("Sum", node("Sum", ["a", "b", "c"]), {**ab, "c": f32(3, 1)})
    add("Mean", node("Mean", ["a", "b"]), ab)
    add("Mod-int", node("Mod", ["a", "b"]), {"a": i64(3, 4, lo=-20, hi=20),
                                             "b": i64(3, 4, lo=1, hi=7) * np.where(boo(3, 4), 1, -1)})
    add("Mod-fmod-float", node("Mod", ["a", "b"], fmod=1), {"a": f32(3, 4) * 5, "b": f32(3, 4)})
    add("Mod-fmod-int", node("Mod", ["a", "b"], fmod=1), {"a": i64(3, 4, lo=-20, hi=20),
                                                          "b": i64(3, 4, lo=1, hi=7) * -1})
    for op in ("Less", "LessOrEqual", "Greater", "GreaterOrEqual"):
        add(op, node(op, ["a", "b"]), {"a": f32(3, 4), "b": np.round(f32(3, 4))})
    add("Equal-int", node("Equal", ["a", "b"]), {"a": i64(3, 4, lo=0, hi=3), "b": i64(4, lo=0, hi=3)})
    add("Equal-bool", node("Equal", ["a", "b"]), {"a": boo(3, 4), "b": boo(3, 4)})
    add("And", node("And", ["a", "b"]), {"a": boo(3, 4), "b": boo(3, 4)})
    add("Or", node("Or", ["a", "b"]), {"a": boo(3, 4), "b": boo(4)})
    add("Where", node("Where", ["c", "a", "b"]), {"c": boo(3, 4), "a": f32(3, 4), "b": f32(1, 4)})
    add("Clip-11-inputs", node("Clip", ["x", "lo", "hi"]), x34,
        {"lo": np.float32(-0.5), "hi": np.float32(0.7)}, opset=11)
    add("Clip-13-max-only", node("Clip", ["x", "", "hi"]), x34, {"hi": np.float32(0.3)}, opset=13)
    add("Clip-computed-min", node("Clip", ["x", "lo"]), {"x": f32(3, 4), "lo": f32()})
    add("Clip-int", node("Clip", ["x", "lo", "hi"]), {"x": i64(3, 4)},
        {"lo": np.int64(-2), "hi": np.int64(3)})
    add("Cast-float-int32", node("Cast", ["x"], to=TensorProto.INT32), {"x": f32(3, 4) * 4})
    add("Cast-int-float", node("Cast", ["x"], to=TensorProto.FLOAT), {"x": i64(3, 4)})
    add("Cast-float-bool", node("Cast", ["x"], to=TensorProto.BOOL), {"x": np.round(f32(3, 4))})
    add("Cast-float-float16", node("Cast", ["x"], to=TensorProto.FLOAT16), x34)
    add("CastLike", node("CastLike", ["x", "t"]), {"x": i64(3, 4)}, {"t": np.zeros(1, np.float32)})
    add("Identity", [node("Identity", ["x"], ["t"]), node("Neg", ["t"])], x34)
    add("Dropout", node("Dropout", ["x", "r"]), x34, {"r": np.float32(0.3)})
    add("Dropout-mask", node("Dropout", ["x"], ["y", "mask"]), x34, outputs=["y", "mask"])
    x345 = {"x": f32(3, 4, 5)}
    add("ReduceSum-11-attr", node("ReduceSum", ["x"], axes=[1]), x345, opset=11)
    add("ReduceSum-13-input", node("ReduceSum", ["x", "ax"], keepdims=0), x345, {"ax": ints(0, -1)},
        opset=13)
    add("ReduceSum-all", node("ReduceSum", ["x"], keepdims=0), x345, opset=13)
    add("ReduceSum-noop", node("ReduceSum", ["x"], noop_with_empty_axes=1), x345, opset=13)
    add("ReduceSum-int", node("ReduceSum", ["x", "ax"]), {"x": i64(3, 4)}, {"ax": ints(1)})
    add("ReduceMean-17-attr", node("ReduceMean", ["x"], axes=[-1]), x345, opset=17)
    add("ReduceMean-18-input", node("ReduceMean", ["x", "ax"], keepdims=0), x345, {"ax": ints(1, 2)},
        opset=18)
    add("ReduceMax", node("ReduceMax", ["x"], axes=[0, 2], keepdims=0), x345)
    add("ReduceMin", node("ReduceMin", ["x", "ax"]), x345, {"ax": ints(1)}, opset=18)
    add("ReduceProd", node("ReduceProd", ["x"], axes=[2]), {"x": f32(3, 4, 5, lo=0.5)})
    add("ArgMax", node("ArgMax", ["x"], axis=1, keepdims=0), x345)
    add("ArgMax-keepdims", node("ArgMax", ["x"], axis=-1), x345)
    add("ArgMin", node("ArgMin", ["x"], axis=0), x345)
    add("Transpose", node("Transpose", ["x"], perm=[1, 2, 0]), x345)
    add("Transpose-default", node("Transpose", ["x"]), x345)
    add("Reshape", node("Reshape", ["x", "s"]), x345, {"s": ints(0, -1, 2)})
    add("Reshape-allowzero", node("Reshape", ["x", "s"], allowzero=1), x345, {"s": ints(5, 12)},
        opset=14)
    add("Flatten", node("Flatten", ["x"], axis=2), {"x": f32(2, 3, 4, 5)})
    add("Flatten-0", node("Flatten", ["x"], axis=0), x345)
    x1 = {"x": f32(3, 1, 4, 1)}
    add("Squeeze-11-attr", node("Squeeze", ["x"], axes=[1]), x1, opset=11)
    add("Squeeze-13-input", node("Squeeze", ["x", "ax"]), x1, {"ax": ints(-1, 1)}, opset=13)
    add("Squeeze-all", node("Squeeze", ["x"]), x1, opset=13)
    add("Unsqueeze-11-attr", node("Unsqueeze", ["x"], axes=[0, 3]), x34, opset=11)
    add("Unsqueeze-13-input", node("Unsqueeze", ["x", "ax"]), x34, {"ax": ints(-1, 1)}, opset=13)
    add("Expand", node("Expand", ["x", "s"]), {"x": f32(3, 1)}, {"s": ints(2, 1, 4)})
    add("Expand-int", node("Expand", ["x", "s"]), {"x": i64(1, 4)}, {"s": ints(3, 4)})
    add("Slice", node("Slice", ["x", "s", "e"]), x345, {"s": ints(1, 0), "e": ints(3, 4)})
    add("Slice-axes-steps", node("Slice", ["x", "s", "e", "a", "st"]), x345,
        {"s": ints(0, -1), "e": ints(INT64_MAX, 0), "a": ints(2, 1), "st": ints(2, -1)})
    add("Slice-reverse-all", node("Slice", ["x", "s", "e", "a", "st"]), x345,
        {"s": ints(-1), "e": ints(-INT64_MAX), "a": ints(0), "st": ints(-1)})
    add("Concat", node("Concat", ["a", "b", "c"], axis=1), {"a": f32(2, 1), "b": f32(2, 3), "c": f32(2, 2)})
    add("Concat-int", node("Concat", ["a", "b"], axis=-1), {"a": i64(2, 1), "b": i64(2, 3)})
    add("Split-11-attr", node("Split", ["x"], ["y", "z"], axis=1, split=[1, 3]), x34, opset=11,
        outputs=["y", "z"])
    add("Split-13-input", node("Split", ["x", "sp"], ["y", "z", "w"], axis=2), x345,
        {"sp": ints(2, 2, 1)}, opset=13, outputs=["y", "z", "w"])
    add("Split-13-equal", node("Split", ["x"], ["y", "z"], axis=0), {"x": f32(4, 3)}, opset=13,
        outputs=["y", "z"])
    add("Split-18-num_outputs", node("Split", ["x"], ["y", "z", "w"], axis=2, num_outputs=3), x345,
        opset=18, outputs=["y", "z", "w"])
    add("Pad-11", node("Pad", ["x", "p", "v"]), x34, {"p": ints(1, 0, 0, 2), "v": np.float32(1.5)},
        opset=11)
    add("Pad-negative", node("Pad", ["x", "p"]), x34, {"p": ints(-1, 1, 0, -2)}, opset=13)
    add("Pad-18-axes", node("Pad", ["x", "p", "", "a"]), x345, {"p": ints(1, 2, 0, 1), "a": ints(0, 2)},
        opset=18)
    add("Pad-int", node("Pad", ["x", "p"]), {"x": i64(2, 3)}, {"p": ints(0, 1, 1, 0)})
    add("Gather-const", node("Gather", ["x", "i"], axis=1), x345, {"i": ints(3, 0, -1)})
    add("Gather-scalar", node("Gather", ["x", "i"], axis=0), x345, {"i": np.int64(2)})
    add("Gather-computed", node("Gather", ["x", "i"]), {"x": f32(5, 3), "i": i64(2, 3, lo=0, hi=5)})
    add("GatherElements", node("GatherElements", ["x", "i"], axis=1),
        {"x": f32(3, 4), "i": i64(3, 6, lo=-4, hi=4)})
    add("GatherND", node("GatherND", ["x", "i"]), {"x": f32(3, 4, 5), "i": i64(2, 3, 2, lo=-3, hi=3)})
    add("GatherND-const", node("GatherND", ["x", "i"]), x345, {"i": ints(0, -1, 2, 1).reshape(2, 2)})
    special = {"x": np.array([[0.5, np.nan, np.inf], [-np.inf, -2.0, np.nan]], np.float32)}
    add("IsNaN", node("IsNaN", ["x"]), special)
    add("IsInf", node("IsInf", ["x"]), special)
    add("IsInf-positive", node("IsInf", ["x"], detect_negative=0), special)
    wide = {"x": (f32(3, 8) * 4.0).astype(np.float32)}  # past both knees
    add("HardSigmoid", node("HardSigmoid", ["x"], alpha=0.3, beta=0.4), wide)
    add("HardSwish", node("HardSwish", ["x"]), wide)
    # Cast to DOUBLE then IsInf, as the TorchScript exporter writes fp16 T5 (float32 inside).
    add("Cast-double-IsInf", [node("Cast", ["x"], ["d"], to=TensorProto.DOUBLE),
                              node("IsInf", ["d"])], {"x": special["x"].astype(np.float16)})
    add("MatMul", node("MatMul", ["a", "b"]), {"a": f32(3, 8), "b": f32(8, 5)})
    add("MatMul-batched", node("MatMul", ["a", "b"]), {"a": f32(2, 1, 3, 8), "b": f32(4, 8, 5)})
    add("MatMul-vector", node("MatMul", ["a", "b"]), {"a": f32(2, 3, 8), "b": f32(8)})
    add("MatMul-int", node("MatMul", ["a", "b"]), {"a": i64(3, 4), "b": i64(4, 2)})
    add("Gemm", node("Gemm", ["a", "b", "c"], alpha=0.5, beta=2.0, transB=1),
        {"a": f32(3, 6), "b": f32(5, 6)}, {"c": f32(5)})
    add("Gemm-transA-noC", node("Gemm", ["a", "b"], transA=1), {"a": f32(6, 3), "b": f32(6, 5)})
    img = {"x": f32(2, 4, 9, 8)}
    add("Conv", node("Conv", ["x", "w", "b"], pads=[1, 0, 2, 1], strides=[2, 1]), img,
        {"w": f32(6, 4, 3, 3), "b": f32(6)})
    add("Conv-groups-dilations", node("Conv", ["x", "w"], group=2, dilations=[2, 1], pads=[2, 1, 2, 1]),
        img, {"w": f32(6, 2, 3, 3)})
    add("Conv-same-upper", node("Conv", ["x", "w"], auto_pad="SAME_UPPER", strides=[2, 2]), img,
        {"w": f32(3, 4, 4, 4)})
    add("Conv-1d", node("Conv", ["x", "w", "b"], pads=[1, 1], strides=[2]), {"x": f32(2, 3, 11)},
        {"w": f32(5, 3, 3), "b": f32(5)})
    add("MaxPool", node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), img)
    add("MaxPool-ceil-dilated", node("MaxPool", ["x"], kernel_shape=[2, 3], strides=[2, 2],
                                     dilations=[2, 1], ceil_mode=1), img)
    add("MaxPool-1d", node("MaxPool", ["x"], kernel_shape=[3], strides=[2]), {"x": f32(2, 3, 11)})
    add("AveragePool", node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        img)
    add("AveragePool-include-pad-ceil", node("AveragePool", ["x"], kernel_shape=[3, 2], strides=[2, 2],
                                             pads=[1, 0, 1, 1], count_include_pad=1, ceil_mode=1), img)
    add("GlobalAveragePool", node("GlobalAveragePool", ["x"]), img)
    add("GlobalMaxPool", node("GlobalMaxPool", ["x"]), img)
    add("GlobalAveragePool-3d", node("GlobalAveragePool", ["x"]), {"x": f32(2, 3, 7)})
    add("Softmax-13", node("Softmax", ["x"], axis=1), x345, opset=13)
    add("Softmax-11-coerced", node("Softmax", ["x"], axis=1), x345, opset=11)
    add("LogSoftmax", node("LogSoftmax", ["x"]), x345)
    add("LogSoftmax-11-coerced", node("LogSoftmax", ["x"]), x345, opset=11)
    add("LayerNormalization", node("LayerNormalization", ["x", "s", "b"], epsilon=1e-3), x345,
        {"s": f32(5), "b": f32(5)})
    add("LayerNormalization-axis1", node("LayerNormalization", ["x", "s"], axis=1), x345,
        {"s": f32(4, 5)})
    add("BatchNormalization", node("BatchNormalization", ["x", "s", "b", "m", "v"], epsilon=1e-3),
        img, {"s": f32(4), "b": f32(4), "m": f32(4), "v": f32(4, lo=0.5)})
    add("SimplifiedLayerNormalization", node("SimplifiedLayerNormalization", ["x", "s"], epsilon=1e-5),
        x345, {"s": f32(5)})
    add("RMSNormalization", node("RMSNormalization", ["x", "s"], axis=1), x345, {"s": f32(4, 5)},
        opset=23)
    add("Constant", [node("Constant", [], ["c"], value=numpy_helper.from_array(f32(4), "c")),
                     node("Add", ["x", "c"])], x34)
    add("Constant-value_ints", [node("Constant", [], ["s"], value_ints=[4, 3]),
                                node("Reshape", ["x", "s"])], x34)
    add("ConstantOfShape", [node("Shape", ["x"], ["s"]),
                            node("ConstantOfShape", ["s"], ["c"],
                                 value=numpy_helper.from_array(np.array([2.5], np.float32))),
                            node("Mul", ["x", "c"])], x34)
    add("Shape-Gather-Concat-Reshape", [
        node("Shape", ["x"], ["s"]), node("Gather", ["s", "i0"], ["d0"], axis=0),
        node("Unsqueeze", ["d0", "ax"], ["d0u"]), node("Concat", ["d0u", "m1"], ["t"], axis=0),
        node("Reshape", ["x", "t"])], x345, {"i0": np.int64(0), "ax": ints(0), "m1": ints(-1)})
    add("Shape-start-end", [node("Shape", ["x"], ["s"], start=1, end=-1), node("Expand", ["y0", "s"])],
        {"x": f32(2, 3, 4, 5), "y0": f32(1, 1)}, opset=15)
    add("Size", [node("Size", ["x"], ["n"]), node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
                 node("Div", ["x", "nf"])], x34)
    add("Range", [node("Range", ["s", "l", "d"], ["r"]), node("Add", ["x", "r"])], x34,
        {"s": np.float32(1.0), "l": np.float32(3.0), "d": np.float32(0.5)})
    add("Where-Equal-on-constants", [node("Equal", ["t", "m1"], ["e"]),
                                     node("Where", ["e", "o", "t"], ["t2"]), node("Expand", ["x", "t2"])],
        {"x": f32(3, 1)}, {"t": ints(-1, 4), "m1": ints(-1), "o": ints(1, 1)})
    add("Trilu-upper", node("Trilu", ["x", "k"]), {"x": f32(2, 4, 5)}, {"k": np.int64(1)}, opset=14)
    add("Trilu-lower", node("Trilu", ["x"], upper=0), {"x": f32(2, 4, 5)}, opset=14)
    add("float16-Add-Sqrt", [node("Add", ["a", "b"], ["s"]), node("Sqrt", ["s"])],
        {"a": f32(3, 4, lo=0.1).astype(np.float16), "b": f32(3, 4, lo=0.1).astype(np.float16)})
    # onnxruntime has no bfloat16 arithmetic on CPU: round through bfloat16 and add in float32.
    add("bfloat16-Cast-Add", [node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
                              node("Cast", ["xb"], ["xf"], to=TensorProto.FLOAT),
                              node("Cast", ["cb"], ["cf"], to=TensorProto.FLOAT),
                              node("Add", ["xf", "cf"])], x34,
        {"cb": f32(4).astype(ml_dtypes.bfloat16)})
    return c


CASES = _cases()
