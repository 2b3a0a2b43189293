"""The tolerance's exp term (tunedb/runtime/tolerance.py): exp turns an absolute rounding error
of its argument into a relative error of its result, so a softmax over unscaled logits (T5's
attention: logits of magnitude 25-35) errs by eps times the logits' magnitude in any float32
implementation. onnxruntime is the float32 implementation here; the float64 reference the truth."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tunedb.graph.onnx_import import import_onnx
from tunedb.graph.reference import run_reference
from tunedb.runtime.tolerance import (
    TOLERANCES,
    error_ratio,
    exp_argument_span,
    exp_arguments,
    reference_and_exp_span,
    tolerance,
)

ZOO = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo"
SEQ, DIM, LAYERS = 64, 32, 2


def _attention_stack(logit_scale: float) -> onnx.ModelProto:
    """LAYERS of unscaled single-head attention with a residual and an RMS norm (T5's shape):
    x += softmax((x Wq)(x Wk)^T) (x Wv); x = x / rms(x). ``logit_scale`` sets the logits' span."""
    rng = np.random.default_rng(0)
    inits, nodes, x = {}, [], "x"
    for i in range(LAYERS):
        for w in "qkv":
            scale = (logit_scale if w != "v" else 1.0) / np.sqrt(DIM)
            inits[f"w{w}{i}"] = (rng.standard_normal((DIM, DIM)) * scale).astype(np.float32)
        nodes += [helper.make_node("MatMul", [x, f"w{w}{i}"], [f"{w}{i}"]) for w in "qkv"]
        nodes += [helper.make_node("Transpose", [f"k{i}"], [f"kt{i}"], perm=[1, 0]),
                  helper.make_node("MatMul", [f"q{i}", f"kt{i}"], [f"s{i}"]),
                  helper.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1),
                  helper.make_node("MatMul", [f"p{i}", f"v{i}"], [f"a{i}"]),
                  helper.make_node("Add", [x, f"a{i}"], [f"r{i}"]),
                  helper.make_node("Mul", [f"r{i}", f"r{i}"], [f"sq{i}"]),
                  helper.make_node("ReduceMean", [f"sq{i}"], [f"ms{i}"], axes=[-1]),
                  helper.make_node("Sqrt", [f"ms{i}"], [f"rms{i}"]),
                  helper.make_node("Div", [f"r{i}", f"rms{i}"], [f"x{i}"])]
        x = f"x{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SEQ, DIM])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SEQ, DIM])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0].astype(np.float64)


def test_span_sums_twice_each_softmax_row_max():
    graph = import_onnx(_attention_stack(2.0))
    args = exp_arguments(graph)
    assert len(args) == LAYERS  # the importer's softmax: exp(x - max(x)), one per layer
    (arg, (m, m2)), (arg2, _) = args
    assert m == m2  # only the row max is kept: |x| + |max| = 2 |max| where exp matters
    lowest = float(np.finfo(np.float32).min)  # a mask's fill: row 2 is fully masked
    values = {m: np.array([[10.0], [-3.0], [lowest]]), arg2: np.zeros(3)}  # arg2's max missing
    assert exp_argument_span(values, args) == 20.0  # the masked row left out


def test_span_of_other_exps_follows_where_the_argument_matters():
    args = (("a", ("x", "y")), ("e", ("e",)))
    values = {"a": np.array([-1.0, 0.0, -30.0, -np.inf]), "x": np.array([9.0, 10.0, -20.0, 1.0]),
              "y": np.array([10.0]), "e": np.array([[3.0, -25.0], [np.nan, 1.0]])}
    # a: |x| + |y| where a > -20: 20 (-30 and -inf left out); e: its own largest |e|, 25
    assert exp_argument_span(values, args) == 20.0 + 25.0
    graph = import_onnx(_attention_stack(2.0))
    assert tolerance(graph, "float32", 100.0).atol == pytest.approx(
        tolerance(graph, "float32").atol + 100.0 * TOLERANCES["float32"][2])


def test_sixteen_bit_outputs_get_no_exp_term():
    # bf16's epsilon times BERT-base's span (76.5) would pass anything within the output's RMS
    graph = import_onnx(_attention_stack(2.0))
    for dtype in ("bfloat16", "float16"):
        assert tolerance(graph, dtype, 76.5) == tolerance(graph, dtype)
    assert tolerance(graph, "float32", 76.5).atol > tolerance(graph, "float32").atol


def test_unscaled_softmax_passes_with_the_exp_term_and_a_wrong_result_still_fails():
    model = _attention_stack(logit_scale=2.0)
    graph = import_onnx(model)
    x = np.random.default_rng(1).standard_normal((SEQ, DIM)).astype(np.float32)
    refs, span = reference_and_exp_span(graph, {"x": x})
    ref = refs[graph.outputs[0]]
    np.testing.assert_array_equal(ref, run_reference(graph, {"x": x})[graph.outputs[0]])
    assert 250 < span < 500  # two layers, logits near their row's max of magnitude ~90
    got = _ort(model, {"x": x})  # float32 throughout, a correct implementation
    plain, _ = error_ratio(got, ref, tolerance(graph, "float32"))
    with_term, _ = error_ratio(got, ref, tolerance(graph, "float32", span))
    assert plain > 1.5, plain  # the plain table fails onnxruntime here (3.0), as it did on T5
    assert with_term <= 1.0, with_term  # 0.64
    # Wrong results still fail with the term: two tokens swapped, one element off by 1 %.
    swapped = got.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert error_ratio(swapped, ref, tolerance(graph, "float32", span))[0] > 10
    nudged = got.copy()
    nudged[5, 7] *= 1.01
    assert error_ratio(nudged, ref, tolerance(graph, "float32", span))[0] > 1


def test_scaled_softmax_keeps_a_small_term():
    # Logits scaled by 1/sqrt(d), as BERT's: the term stays below the table's own atol.
    graph = import_onnx(_attention_stack(logit_scale=0.5))
    x = np.random.default_rng(1).standard_normal((SEQ, DIM)).astype(np.float32)
    _, span = reference_and_exp_span(graph, {"x": x})
    assert 0 < span * TOLERANCES["float32"][2] < TOLERANCES["float32"][0]


@pytest.mark.slow
def test_t5_encoder_onnxruntime_passes_with_the_exp_term():  # ~15-30 s: T5-small's reference
    from tunedb.bench.plan import INPUT_SEED, weighted_model
    from tunedb.runtime.inputs import make_inputs

    model = weighted_model(ZOO / "t5_encoder_dynamo_fp32.onnx")
    graph = import_onnx(model)
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    refs, span = reference_and_exp_span(graph, ref_in)
    ref = refs[graph.outputs[0]]
    assert 350 < span < 550  # 6 layers, |logit| + |row max| up to 60-90 each: 447
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, {n: dev[n] for n in names})[0].astype(np.float64)
    assert error_ratio(got, ref, tolerance(graph, "float32"))[0] > 2  # 3.3 on this seed
    assert error_ratio(got, ref, tolerance(graph, "float32", span))[0] < 1  # 0.75
