"""A bf16 graph whose folded batch norm left float32 constants on its conv imports as the
well-typed graph (what the torch backend met with the H200's onnxscript, issue 24).

No PyTorch needed: the models are written with ``onnx.helper``.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tunedb.graph.hashing import graph_hash
from tunedb.graph.onnx_import import OnnxImportError, import_onnx
from tunedb.graph.reference import run_reference

BF16 = ml_dtypes.bfloat16


def _conv_model(weight_dtype: type, second_input: bool = False) -> onnx.ModelProto:
    """bf16 x -> Conv(W, B) -> Add(shift) -> Relu, the constants stored as ``weight_dtype``;
    with ``second_input`` the shift is a float32 graph input instead (a computed mismatch)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    shift = rng.standard_normal((1, 4, 1, 1)).astype(np.float32)
    inits = [numpy_helper.from_array(w.astype(weight_dtype), "W"),
             numpy_helper.from_array(b.astype(weight_dtype), "B")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 3, 8, 8])]
    if second_input:
        inputs.append(helper.make_tensor_value_info("shift", TensorProto.FLOAT, [1, 4, 1, 1]))
    else:
        inits.append(numpy_helper.from_array(shift.astype(weight_dtype), "shift"))
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Add", ["y", "shift"], ["z"], name="add"),
             helper.make_node("Relu", ["z"], ["out"], name="relu")]
    graph = helper.make_graph(nodes, "conv_bn_folded", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.BFLOAT16, [1, 4, 8, 8])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_float32_constants_on_a_bf16_conv_import_as_the_bf16_graph(caplog):
    """The float32 weight, bias and shift are rounded to bf16 at import, each with a debug note;
    the graph is the one whose constants were bf16 to begin with (same hash: no cast nodes) and
    computes the same."""
    with caplog.at_level(logging.DEBUG, logger="tunedb.graph.onnx_import._convert"):
        mixed = import_onnx(_conv_model(np.float32), fill_initializers=False)
    typed = import_onnx(_conv_model(BF16), fill_initializers=False)
    notes = [m for m in (r.getMessage() for r in caplog.records)
             if "cast from float32 to bfloat16 at import" in m]
    assert len(notes) == 3, notes  # W, B and shift
    assert "cast" not in {n.op for n in mixed.nodes}
    assert graph_hash(mixed) == graph_hash(typed)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(BF16).astype(np.float32)
    got = run_reference(mixed, {"x": x})[mixed.outputs[0]]
    want = run_reference(typed, {"x": x})[typed.outputs[0]]
    np.testing.assert_array_equal(got, want)


def test_computed_inputs_of_two_float_dtypes_still_fail():
    """Only constants are converted: a float32 graph input added to a bf16 value is refused."""
    with pytest.raises(OnnxImportError, match="dtype mismatch"):
        import_onnx(_conv_model(BF16, second_input=True), fill_initializers=False)
