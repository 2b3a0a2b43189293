"""One-op ONNX models for the op families added for issue 21 (tests/test_onnx_ops.py runs
them against onnxruntime; no tests here). Same layout as ``test_onnx_cases.CASES``:
(id, nodes, inputs, initializers, opset, outputs).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto
from test_onnx_cases import boo, f32, i64, ints, node

rng = np.random.default_rng(2121)


def u(*shape: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


def _cases() -> list[tuple]:
    c: list[tuple] = []

    def add(id_: str, nodes, inputs, inits=None, opset=17, outputs=None):
        c.append((id_, nodes if isinstance(nodes, list) else [nodes], inputs, inits or {}, opset,
                  outputs))

    wide = {"x": (f32(4, 9) * 3.0).astype(np.float32)}
    for op in ("Tan", "Sinh", "Cosh", "Asinh", "Atan", "Softplus", "Softsign", "Mish", "Elu",
               "Selu", "Celu", "ThresholdedRelu", "Shrink"):
        add(op, node(op, ["x"]), wide, opset=18 if op == "Mish" else 17)
    add("Tan-small", node("Tan", ["x"]), {"x": u(4, 9)})
    add("Atan-all-ranges", node("Atan", ["x"]),
        {"x": np.array([[-1e6, -3.0, -1.0, -0.5, -0.27, -0.26, 0.0, 0.1, 0.2679, 0.5, 1.0, 1.0001,
                         7.0, np.inf, -np.inf]], np.float32)})
    add("Asin", node("Asin", ["x"]), {"x": np.append(u(20), [-1.0, 1.0, 0.0]).astype(np.float32)})
    add("Acos", node("Acos", ["x"]), {"x": np.append(u(20), [-1.0, 1.0, 0.0, 0.9999]).astype(np.float32)})
    add("Acosh", node("Acosh", ["x"]), {"x": u(4, 9, lo=1.0, hi=20.0)})
    add("Atanh", node("Atanh", ["x"]), {"x": u(4, 9, lo=-0.99, hi=0.99)})
    add("Round", node("Round", ["x"]),
        {"x": np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4, 2.6, -2.6, 3.0, 8388609.0, 0.49999997],
                       np.float32)})
    add("Softplus-extreme", node("Softplus", ["x"]), {"x": np.array([-200.0, -20.0, 0.0, 20.0, 200.0],
                                                                    np.float32)})
    add("Elu-alpha", node("Elu", ["x"], alpha=0.3), wide)
    add("Selu-attrs", node("Selu", ["x"], alpha=1.5, gamma=1.2), wide)
    add("Celu-alpha", node("Celu", ["x"], alpha=2.0), wide)
    add("ThresholdedRelu-alpha", node("ThresholdedRelu", ["x"], alpha=0.5), wide)
    add("Shrink-attrs", node("Shrink", ["x"], lambd=1.0, bias=0.25), wide)
    add("PRelu-channel", node("PRelu", ["x", "s"]), {"x": f32(2, 3, 4, 5)}, {"s": f32(3, 1, 1)})
    add("PRelu-computed", node("PRelu", ["x", "s"]), {"x": f32(3, 4), "s": f32(4)})
    add("Xor", node("Xor", ["a", "b"]), {"a": boo(3, 4), "b": boo(4)})
    add("Hardmax", node("Hardmax", ["x"]), {"x": f32(3, 4, 5)}, opset=13)
    add("Hardmax-axis1-ties", node("Hardmax", ["x"], axis=1),
        {"x": np.array([[[1.0, 2.0], [1.0, 2.0], [0.0, 5.0]]], np.float32)}, opset=13)
    x345 = {"x": f32(3, 4, 5)}
    pos = {"x": f32(3, 4, 5, lo=0.1)}
    for op in ("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp"):
        add(f"{op}-17-attr", node(op, ["x"], axes=[1]), x345, opset=17)
        add(f"{op}-18-input", node(op, ["x", "ax"], keepdims=0), x345, {"ax": ints(0, -1)}, opset=18)
        add(f"{op}-all", node(op, ["x"], keepdims=0), x345, opset=18)
    add("ReduceLogSum-17-attr", node("ReduceLogSum", ["x"], axes=[2]), pos, opset=17)
    add("ReduceLogSum-18-input", node("ReduceLogSum", ["x", "ax"], keepdims=0), pos, {"ax": ints(1)},
        opset=18)
    add("ReduceLogSumExp-large", node("ReduceLogSumExp", ["x"], axes=[1]), {"x": f32(3, 50) * 40.0})
    add("ReduceL1-int", node("ReduceL1", ["x"], axes=[1]), {"x": i64(3, 4)})
    img = {"x": f32(2, 6, 5, 7)}
    add("InstanceNormalization", node("InstanceNormalization", ["x", "s", "b"], epsilon=1e-3), img,
        {"s": f32(6), "b": f32(6)})
    add("InstanceNormalization-1d", node("InstanceNormalization", ["x", "s", "b"]), {"x": f32(2, 3, 11)},
        {"s": f32(3), "b": f32(3)})
    add("GroupNormalization-18", node("GroupNormalization", ["x", "s", "b"], num_groups=3, epsilon=1e-4),
        img, {"s": f32(3), "b": f32(3)}, opset=18)
    add("GroupNormalization-21", node("GroupNormalization", ["x", "s", "b"], num_groups=2), img,
        {"s": f32(6), "b": f32(6)}, opset=21)
    add("GroupNormalization-21-computed-affine", node("GroupNormalization", ["x", "s", "b"], num_groups=3),
        {"x": f32(2, 6, 9), "s": f32(6), "b": f32(6)}, opset=21)
    add("LpNormalization", node("LpNormalization", ["x"]), x345)
    add("LpNormalization-p1-axis0", node("LpNormalization", ["x"], axis=0, p=1), x345)
    add("MeanVarianceNormalization", node("MeanVarianceNormalization", ["x"]), img)
    add("MeanVarianceNormalization-axes", node("MeanVarianceNormalization", ["x"], axes=[1]), x345)
    add("LRN", node("LRN", ["x"], size=3, alpha=1e-2, beta=0.6, bias=2.0), img)
    add("Tile", node("Tile", ["x", "r"]), {"x": f32(2, 3)}, {"r": ints(2, 3)})
    add("Tile-ones", node("Tile", ["x", "r"]), {"x": f32(2, 3)}, {"r": ints(1, 1)})
    add("Tile-int-3d", node("Tile", ["x", "r"]), {"x": i64(2, 1, 3)}, {"r": ints(1, 4, 2)})
    add("DepthToSpace-DCR", node("DepthToSpace", ["x"], blocksize=2), {"x": f32(2, 8, 3, 4)})
    add("DepthToSpace-CRD", node("DepthToSpace", ["x"], blocksize=2, mode="CRD"), {"x": f32(2, 8, 3, 4)})
    add("SpaceToDepth", node("SpaceToDepth", ["x"], blocksize=2), {"x": f32(2, 3, 4, 6)})
    add("Compress-axis", node("Compress", ["x", "c"], axis=1), x345,
        {"c": np.array([True, False, True], bool)})
    add("Compress-flat", node("Compress", ["x", "c"]), {"x": f32(2, 3)},
        {"c": np.array([0, 1, 1, 0, 1], bool)})
    add("EyeLike", [node("EyeLike", ["x"], ["e"], k=1), node("Add", ["x", "e"])], {"x": f32(3, 4)})
    add("EyeLike-int", [node("EyeLike", ["x"], ["e"], dtype=TensorProto.INT64),
                        node("Mul", ["x", "e"])], {"x": i64(4, 4)})
    add("OneHot", node("OneHot", ["i", "d", "v"]), {"i": i64(2, 3, lo=-5, hi=5)},
        {"d": np.int64(5), "v": np.array([0.0, 1.0], np.float32)})
    add("OneHot-axis0-float-idx", node("OneHot", ["i", "d", "v"], axis=0),
        {"i": np.array([[0.0, 2.0], [3.0, -1.0]], np.float32)},
        {"d": np.float32(4.0), "v": np.array([-1.5, 7.0], np.float32)})
    add("ScatterND-rows", node("ScatterND", ["x", "i", "u"]), {"x": f32(6, 4), "u": f32(2, 4)},
        {"i": ints(4, -1).reshape(2, 1)})
    add("ScatterND-kv-cache", node("ScatterND", ["x", "i", "u"]), {"x": f32(2, 5, 3), "u": f32(2, 3)},
        {"i": ints(0, 2, 1, 2).reshape(2, 2)})
    add("ScatterND-all", node("ScatterND", ["x", "i", "u"]), {"x": f32(3, 2), "u": f32(3, 2)},
        {"i": ints(2, 0, 1).reshape(3, 1)})
    add("ScatterElements", node("ScatterElements", ["x", "i", "u"], axis=1), {"x": f32(3, 5),
                                                                            "u": f32(3, 2)},
        {"i": ints(1, 3, 0, -1, 4, 2).reshape(3, 2)})
    add("ScatterElements-computed-one-per-row", node("ScatterElements", ["x", "i", "u"], axis=1),
        {"x": f32(4, 7), "i": i64(4, 1, lo=-7, hi=7), "u": f32(4, 1)})
    add("ScatterElements-computed-two-columns", node("ScatterElements", ["x", "i", "u"], axis=0),
        {"x": f32(5, 3), "i": np.array([[0, 4, 2], [3, 1, 2]], np.int64), "u": f32(2, 3)})
    logits = {"x": f32(6, 5), "t": np.array([0, 4, 2, 2, 1, 3], np.int64)}
    for red in ("none", "sum", "mean"):
        add(f"SoftmaxCrossEntropyLoss-{red}", node("SoftmaxCrossEntropyLoss", ["x", "t"], reduction=red),
            logits, opset=13)
    add("SoftmaxCrossEntropyLoss-weight-ignore-logprob",
        node("SoftmaxCrossEntropyLoss", ["x", "t", "w"], ["y", "lp"], ignore_index=2),
        logits, {"w": f32(5, lo=0.5)}, opset=13, outputs=["y", "lp"])
    add("SoftmaxCrossEntropyLoss-3d", node("SoftmaxCrossEntropyLoss", ["x", "t"], reduction="none"),
        {"x": f32(2, 5, 3), "t": i64(2, 3, lo=0, hi=5)}, opset=13)
    add("NegativeLogLikelihoodLoss-ignore", node("NegativeLogLikelihoodLoss", ["x", "t"], ignore_index=1),
        logits, opset=13)
    add("NegativeLogLikelihoodLoss-weight-sum", node("NegativeLogLikelihoodLoss", ["x", "t", "w"],
                                                     reduction="sum"), logits, {"w": f32(5)}, opset=13)
    for ex in (0, 1):
        for rv in (0, 1):
            add(f"CumSum-ex{ex}-rev{rv}", node("CumSum", ["x", "ax"], exclusive=ex, reverse=rv),
                {"x": f32(3, 13, 2)}, {"ax": np.int64(1)}, opset=14)
    add("CumSum-int-last-axis", node("CumSum", ["x", "ax"]), {"x": i64(2, 9)}, {"ax": np.int32(-1)},
        opset=14)
    add("CumSum-length-1", node("CumSum", ["x", "ax"], exclusive=1), {"x": f32(4, 1)},
        {"ax": np.int64(1)}, opset=14)
    nchw = {"x": f32(1, 2, 3, 4)}
    for ctm in ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"):
        add(f"Resize-nearest-{ctm}", node("Resize", ["x", "", "s"], coordinate_transformation_mode=ctm,
                                          nearest_mode="floor" if ctm == "asymmetric" else
                                          "round_prefer_floor"),
            nchw, {"s": np.array([1, 1, 2, 1.5], np.float32)}, opset=13)
        add(f"Resize-linear-{ctm}", node("Resize", ["x", "", "s"], mode="linear",
                                         coordinate_transformation_mode=ctm),
            nchw, {"s": np.array([1, 1, 2, 2.5], np.float32)}, opset=13)
    add("Resize-nearest-sizes-down", node("Resize", ["x", "", "", "sz"], nearest_mode="round_prefer_ceil"),
        {"x": f32(1, 2, 7, 9)}, {"sz": ints(1, 2, 3, 4)}, opset=13)
    add("Resize-linear-sizes-down", node("Resize", ["x", "", "", "sz"], mode="linear"),
        {"x": f32(1, 2, 7, 9)}, {"sz": ints(1, 2, 3, 5)}, opset=13)
    add("Resize-18-axes", node("Resize", ["x", "", "s"], axes=[2, 3], mode="linear"), nchw,
        {"s": np.array([2.0, 2.0], np.float32)}, opset=18)
    add("Resize-19-half_pixel_symmetric", node("Resize", ["x", "", "s"], mode="linear",
                                               coordinate_transformation_mode="half_pixel_symmetric"),
        nchw, {"s": np.array([1, 1, 1.7, 2.0], np.float32)}, opset=19)
    add("Resize-18-not_larger", node("Resize", ["x", "", "", "sz"], axes=[2, 3],
                                     keep_aspect_ratio_policy="not_larger"),
        nchw, {"sz": ints(6, 6)}, opset=18)
    # Pad's other modes: constant-index gathers (negative pads crop)
    for mode, opset in (("reflect", 13), ("edge", 13), ("wrap", 19)):
        add(f"Pad-{mode}", node("Pad", ["x", "p"], mode=mode), {"x": f32(2, 3, 5, 6)},
            {"p": ints(0, 0, 2, 1, 0, 0, 1, 3)}, opset=opset)
    add("Pad-edge-crop", node("Pad", ["x", "p"], mode="edge"), {"x": f32(3, 7)}, {"p": ints(-1, 2, 1, -3)})
    add("Pad-reflect-18-axes", node("Pad", ["x", "p", "", "ax"], mode="reflect"), {"x": f32(2, 4, 5)},
        {"p": ints(3, 2, 2, 1), "ax": ints(-1, 1)}, opset=18)
    add("CenterCropPad", node("CenterCropPad", ["x", "s"]), {"x": f32(3, 8, 5)}, {"s": ints(2, 5, 8)},
        opset=18)
    add("CenterCropPad-axes", node("CenterCropPad", ["x", "s"], axes=[-2, -1]), {"x": f32(2, 7, 6)},
        {"s": ints(4, 9)}, opset=18)
    for p in (1, 2, 3):
        add(f"GlobalLpPool-p{p}", node("GlobalLpPool", ["x"], p=p), {"x": f32(2, 3, 4, 5)})
    add("GlobalLpPool-1d", node("GlobalLpPool", ["x"]), {"x": f32(2, 3, 7)})
    return c


OPS_CASES = _cases()
# Cases the ONNX checker refuses though onnxruntime runs them: the opset-18 GroupNormalization
# (deprecated by opset 21) and MeanVarianceNormalization (its function body fails strict
# shape inference in onnx 1.23).
UNCHECKED = frozenset(("GroupNormalization-18", "MeanVarianceNormalization",
                       "MeanVarianceNormalization-axes"))
