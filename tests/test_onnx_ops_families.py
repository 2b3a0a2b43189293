"""Every default-domain ONNX op of opsets 13-21, by family (issue 21, deliverable 3), checked
against the operator schemas of the installed ``onnx``: the elementwise, reduction,
normalization and data-movement ops import, match onnxruntime on a one-op model
(tests/test_onnx_import.py, tests/test_onnx_ops.py) and plan; the few refused, and every op
outside the families that tunedb does not map, fail with one line naming the op."""

from __future__ import annotations

import onnx.defs
import pytest
from onnx import TensorProto, helper
from test_onnx_cases import CASES, make_model
from test_onnx_ops_cases import OPS_CASES

from tunedb.graph.onnx_import import OnnxImportError, import_onnx
from tunedb.graph.onnx_import._convert import Importer, supported_ops

_F = {
    "elementwise": """Abs Acos Acosh Add And Asin Asinh Atan Atanh BitShift BitwiseAnd BitwiseNot
        BitwiseOr BitwiseXor Cast CastLike Ceil Celu Clip Cos Cosh Div Dropout Elu Equal Erf Exp
        Floor Gelu Greater GreaterOrEqual HardSigmoid HardSwish Identity IsInf IsNaN LeakyRelu Less
        LessOrEqual Log Max Mean Min Mish Mod Mul Neg Not Or PRelu Pow Reciprocal Relu Round Selu
        Shrink Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Sub Sum Tan Tanh ThresholdedRelu Where
        Xor""",
    "reduction": """ArgMax ArgMin CumSum GlobalAveragePool GlobalLpPool GlobalMaxPool
        NegativeLogLikelihoodLoss ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
        ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare SoftmaxCrossEntropyLoss""",
    "normalization": """BatchNormalization GroupNormalization Hardmax InstanceNormalization LRN
        LayerNormalization LogSoftmax LpNormalization MeanVarianceNormalization Softmax""",
    "data_movement": """CenterCropPad Compress Concat Constant ConstantOfShape DepthToSpace
        Expand EyeLike Flatten Gather GatherElements GatherND NonZero OneHot Pad Range Reshape
        Resize ReverseSequence Scatter ScatterElements ScatterND Shape Size Slice SpaceToDepth
        Split Squeeze Tile TopK Transpose Trilu Unique Unsqueeze Upsample""",
    # compute ops (GEMMs, convolutions, windowed pools), recurrent, control flow, sequences,
    # quantization, random, signal and string ops: outside the families of issue 21
    "other": """AffineGrid AveragePool Bernoulli BlackmanWindow Col2Im ConcatFromSequence Conv
        ConvInteger ConvTranspose DFT DeformConv DequantizeLinear Det DynamicQuantizeLinear Einsum
        GRU Gemm GridSample HammingWindow HannWindow If ImageDecoder LSTM Loop LpPool MatMul
        MatMulInteger MaxPool MaxRoiPool MaxUnpool MelWeightMatrix Multinomial NonMaxSuppression
        Optional OptionalGetElement OptionalHasElement QLinearConv QLinearMatMul QuantizeLinear RNN
        RandomNormal RandomNormalLike RandomUniform RandomUniformLike RegexFullMatch RoiAlign STFT
        Scan SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength
        SequenceMap SplitToSequence StringConcat StringNormalizer StringSplit TfIdfVectorizer""",
}
FAMILY = {op: fam for fam, ops in _F.items() for op in ops.split()}

# Family ops tunedb refuses, and why (docs/fusion-generalization.md repeats this list).
REFUSED = {
    "BitShift": "integer bit operations: tunedb has no bitwise primitive",
    "BitwiseAnd": "integer bit operations", "BitwiseNot": "integer bit operations",
    "BitwiseOr": "integer bit operations", "BitwiseXor": "integer bit operations",
    "NonZero": "an output shape that depends on the values (folded when its input is constant)",
    "Unique": "an output shape that depends on the values",
    "TopK": "a sort, not data movement at fixed indices",
    "ReverseSequence": "per-batch lengths as a runtime input",
    "Scatter": "deprecated since opset 11 (exporters write ScatterElements)",
    "Upsample": "deprecated since opset 10 (exporters write Resize)",
}
FAMILIES = ("elementwise", "reduction", "normalization", "data_movement")


def _schema_ops() -> set[str]:
    return {s.name for s in onnx.defs.get_all_schemas_with_history()
            if s.domain in ("", "ai.onnx") and s.since_version <= 21}


def test_the_table_covers_every_op_of_the_schemas():
    ops = _schema_ops()
    assert set(FAMILY) == ops, (sorted(ops - set(FAMILY)), sorted(set(FAMILY) - ops))


def test_every_family_op_imports_or_is_refused_on_purpose():
    sup = set(supported_ops())
    fam = {op for op, f in FAMILY.items() if f in FAMILIES}
    assert set(REFUSED) <= fam and not set(REFUSED) & sup
    assert fam - set(REFUSED) <= sup, sorted(fam - set(REFUSED) - sup)


def test_every_imported_family_op_has_a_case_checked_against_onnxruntime():
    cased = {n.op_type for case in (*CASES, *OPS_CASES) for n in case[1]}
    want = {op for op, f in FAMILY.items() if f in FAMILIES and op not in REFUSED}
    assert want <= cased, sorted(want - cased)


def _refused(op: str) -> str:
    """The importer's error for a one-node model of ``op`` on graph inputs (no folding). The
    checker is skipped: many of these ops need attributes a generic node lacks, and the point
    is what the importer says, which it says before reading any attribute."""
    s = onnx.defs.get_schema(op, 21, "")
    ins = [f"x{i}" for i in range(max(1, s.min_input))]
    outs = [f"y{i}" for i in range(max(1, s.min_output))]
    g = helper.make_graph([helper.make_node(op, ins, outs, name="n0")], "g",
                          [helper.make_tensor_value_info(i, TensorProto.FLOAT, [2, 3]) for i in ins],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2, 3]) for o in outs])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    with pytest.raises(OnnxImportError) as e:
        Importer(model, {}).run()
    return str(e.value)


@pytest.mark.parametrize("op", sorted(op for op in FAMILY if op not in supported_ops()))
def test_every_refused_op_fails_with_one_line_naming_it(op):
    msg = _refused(op)
    assert "\n" not in msg and f"unsupported ONNX op {op!r} (node 'n0')" in msg


def test_a_refused_family_op_in_a_valid_model_names_the_op():
    n = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk")
    g = helper.make_graph([n], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5]),
                                     helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, None]),
                           helper.make_tensor_value_info("i", TensorProto.INT64, [2, None])])
    with pytest.raises(OnnxImportError, match="unsupported ONNX op 'TopK' \\(node 'topk'\\)"):
        import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.slow
def test_every_family_case_plans():
    """The one-op models of the families plan (roofline prices, no GPU): import is not enough."""
    from test_onnx_ops import _unchecked_model
    from test_onnx_ops_cases import UNCHECKED

    from tunedb.plan.driver import compile as plan_compile

    failed = []
    for cid, nodes, inputs, inits, opset, outputs in (*CASES, *OPS_CASES):
        if FAMILY.get(nodes[-1].op_type) not in FAMILIES:
            continue
        model = (_unchecked_model(nodes, inputs, inits, opset) if cid in UNCHECKED
                 else make_model(nodes, inputs, inits, opset, outputs))
        try:
            plan = plan_compile(import_onnx(model), cost_model=False, device=None, pack=False)
            assert plan.steps or not import_onnx(model).nodes
        except Exception as e:  # noqa: BLE001 - collected, all reported at once
            failed.append(f"{cid}: {' '.join(str(e).split())[:160]}")
    assert not failed, failed
