"""ONNX import: every supported op against onnxruntime (CPU), constant folding, error messages,
stripping/filling initializers.

Each op case is a tiny one-op model built with onnx.helper; onnxruntime runs it and so does
``import_onnx`` + ``run_reference`` (the float64 oracle), on the same seeded inputs (never all
zeros). Floats compare with rtol 1e-5 (float16/bfloat16 looser), ints and bools exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_onnx_cases import CASES, f32, ints, make_model, node

from tunedb.graph.ir import GraphError
from tunedb.graph.onnx_import import (
    STRIPPED_KEY,
    OnnxImportError,
    fill_model,
    import_onnx,
    strip_model,
    stripped_names,
    stripped_values,
    supported_ops,
)
from tunedb.graph.reference import run_reference


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_matches(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape
    if want.dtype.kind in "biu":
        assert got.dtype.kind == want.dtype.kind
        np.testing.assert_array_equal(got, want)
    else:
        if want.dtype == np.float16:
            rtol = max(rtol, 1e-3)
        want = want.astype(np.float64)
        atol = rtol * max(1.0, float(np.max(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


_ONNX_DTYPE = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
               np.dtype(np.int64): "int64", np.dtype(np.int32): "int32", np.dtype(np.bool_): "bool"}


@pytest.mark.parametrize("cid,nodes,inputs,inits,opset,outputs", CASES, ids=[c[0] for c in CASES])
def test_op_matches_onnxruntime(cid, nodes, inputs, inits, opset, outputs):
    model = make_model(nodes, inputs, inits, opset, outputs)
    want = run_ort(model, inputs)
    graph = import_onnx(model)
    assert graph.inputs == tuple(inputs)
    assert graph.outputs == tuple(o.name for o in model.graph.output)
    got = run_reference(graph, inputs)
    rtol = 1e-2 if "bfloat16" in cid else 1e-5
    for name, w in zip(graph.outputs, want):
        assert graph.type_of(name).dtype == _ONNX_DTYPE[w.dtype]
        assert_matches(got[name], w, rtol)


def test_every_supported_op_has_a_case():
    from test_onnx_ops_cases import OPS_CASES  # the families added for issue 21

    covered = {n.op_type for c in CASES + OPS_CASES for n in c[1]}
    assert set(supported_ops()) - covered == set()


def test_shape_arithmetic_folds_away():
    cid, nodes, inputs, inits, opset, outputs = next(c for c in CASES
                                                     if c[0] == "Shape-Gather-Concat-Reshape")
    graph = import_onnx(make_model(nodes, inputs, inits, opset, outputs))
    assert [n.op for n in graph.nodes] == ["reshape"]
    assert graph.type_of(graph.outputs[0]).shape == (3, 20)
    assert graph.constants == ()


def test_bfloat16_inputs_and_initializers():
    # onnxruntime cannot add bfloat16 on CPU: the oracle here is NumPy on the rounded values.
    w = f32(4).astype(ml_dtypes.bfloat16)
    x = f32(3, 4).astype(ml_dtypes.bfloat16)
    graph = import_onnx(make_model([node("Add", ["x", "w"])], {"x": x}, {"w": w}))
    assert {t.dtype for _, t in graph.types} == {"bfloat16"}
    (_, const), = graph.constants
    assert const.type.dtype == "bfloat16"
    np.testing.assert_array_equal(const.array, w.astype(np.float32))
    got = run_reference(graph, {"x": x.astype(np.float32)})["y"]
    np.testing.assert_allclose(got, x.astype(np.float64) + w.astype(np.float64), rtol=1e-12)


def test_float16_graph_keeps_float16():
    cid, nodes, inputs, inits, opset, outputs = next(c for c in CASES if c[0] == "float16-Add-Sqrt")
    graph = import_onnx(make_model(nodes, inputs, inits, opset, outputs))
    assert {t.dtype for _, t in graph.types} == {"float16"}


def test_unsupported_op_on_constants_folds():
    # NonZero has no tunedb op, but on constants it is shape arithmetic and folds away.
    model = make_model([node("NonZero", ["m"], ["nz"]), node("Shape", ["nz"], ["s"]),
                        node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT), node("Mul", ["x", "sf"])],
                       {"x": f32(2)}, {"m": np.array([1, 0, 3, 4, 0], np.int64)})
    graph = import_onnx(model)
    assert [n.op for n in graph.nodes] == ["mul"]
    x = f32(2)
    assert_matches(run_reference(graph, {"x": x})["y"], run_ort(model, {"x": x})[0])


def test_output_that_is_an_input_or_constant_gets_a_node():
    model = make_model([node("Identity", ["x"], ["y"]), node("Constant", [], ["z"], value_float=2.0)],
                       {"x": f32(2)}, outputs=["y", "z"])
    graph = import_onnx(model)
    assert graph.outputs == ("y", "z")
    got = run_reference(graph, {"x": np.array([1.0, 2.0], np.float32)})
    assert got["y"].tolist() == [1.0, 2.0] and got["z"].tolist() == 2.0


def test_initializers_listed_as_inputs_are_constants():
    model = make_model([node("Add", ["x", "w"])], {"x": f32(3)}, {"w": f32(3)})
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [3]))
    graph = import_onnx(model)
    assert graph.inputs == ("x",) and len(graph.constants) == 1


# -- errors: one line each, naming the problem ---------------------------------------------------

def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and isinstance(excinfo.value, GraphError)
    return msg


def test_unsupported_op_names_op_and_node():
    nms = helper.make_node("NonMaxSuppression", ["b", "s"], ["y"], name="nms_3")
    model = make_model([nms], {"b": f32(1, 4, 4), "s": f32(1, 1, 4)})
    with pytest.raises(OnnxImportError) as e:
        import_onnx(model)
    msg = _one_line_error(e)
    assert "unsupported ONNX op 'NonMaxSuppression' (node 'nms_3')" in msg
    assert "tunedb supports" in msg and len(msg) < 300


def test_op_of_another_domain_is_unsupported():
    n = helper.make_node("FusedGemm", ["a", "b"], ["y"], domain="com.microsoft", name="fg")
    g = helper.make_graph([n], "g", [helper.make_tensor_value_info(v, TensorProto.FLOAT, [2, 2])
                                     for v in "ab"], [helper.make_tensor_value_info("y", 1, [2, 2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(OnnxImportError, match="'FusedGemm' in domain 'com.microsoft'"):
        import_onnx(model)


def _symbolic_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, ["batch", 4])
    g = helper.make_graph([node("Relu", ["input_ids"])], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_symbolic_dim_needs_a_binding():
    with pytest.raises(OnnxImportError) as e:
        import_onnx(_symbolic_model())
    assert _one_line_error(e) == ("input 'input_ids' has symbolic dim 'batch'; give its size with "
                                  "--bind batch=INT (Python: bindings={'batch': INT})")


@pytest.mark.parametrize("opset", [10, 24])
def test_opsets_outside_the_documented_range_are_refused(opset):
    model = _symbolic_model()
    model.opset_import[0].version = opset
    with pytest.raises(OnnxImportError) as e:
        import_onnx(model, bindings={"batch": 1})
    assert _one_line_error(e) == f"model uses ONNX opset {opset}; tunedb imports opsets 11-23 " \
                                 "(re-export it with one of those)"


def test_symbolic_dim_with_binding_imports():
    graph = import_onnx(_symbolic_model(), bindings={"batch": 3})
    assert graph.type_of("input_ids").shape == (3, 4)
    x = f32(3, 4)
    want = run_ort(_symbolic_model(), {"input_ids": x})[0]
    assert_matches(run_reference(graph, {"input_ids": x})["y"], want)


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3"])
def test_binding_must_be_a_positive_int(bad):
    with pytest.raises(OnnxImportError, match=r"binding 'batch'=.* must be a positive int"):
        import_onnx(_symbolic_model(), bindings={"batch": bad})


def test_unknown_dim_is_an_error():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])
    g = helper.make_graph([node("Relu", ["x"])], "g", [x], [helper.make_tensor_value_info("y", 1, [None, 4])])
    with pytest.raises(OnnxImportError, match="input 'x' has an unknown dim at axis 0"):
        import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_missing_file(tmp_path):
    with pytest.raises(OnnxImportError) as e:
        import_onnx(tmp_path / "nope.onnx")
    assert "not found" in _one_line_error(e)


def test_file_that_is_not_protobuf(tmp_path):
    p = tmp_path / "garbage.onnx"
    p.write_bytes(b"\xff\xfe this is not an ONNX model \x00\x01" * 10)
    with pytest.raises(OnnxImportError) as e:
        import_onnx(p)
    assert str(p) in _one_line_error(e)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    with pytest.raises(OnnxImportError, match="holds no ONNX graph"):
        import_onnx(p)


def test_truncated_file(tmp_path):
    model = make_model([node("MatMul", ["a", "w"])], {"a": f32(2, 64)}, {"w": f32(64, 64)})
    data = model.SerializeToString()
    p = tmp_path / "cut.onnx"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxImportError) as e:
        import_onnx(p)
    assert str(p) in _one_line_error(e)


def test_model_failing_the_checker(tmp_path):
    g = helper.make_graph([node("Add", ["x", "ghost"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    p = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    with pytest.raises(OnnxImportError) as e:
        import_onnx(p)
    msg = _one_line_error(e)
    assert "fails the ONNX checker" in msg and "ghost" in msg


def test_unsupported_input_dtype():
    model = make_model([node("Relu", ["x"])], {"x": np.ones((2, 2), np.float64)})
    with pytest.raises(OnnxImportError) as e:
        import_onnx(model)
    assert "input 'x' has unsupported dtype DOUBLE" in _one_line_error(e)


def test_unsupported_cast_target():
    model = make_model([node("Cast", ["x"], to=TensorProto.UINT8)], {"x": f32(2)})
    with pytest.raises(OnnxImportError, match=r"\(Cast\): target has unsupported dtype UINT8"):
        import_onnx(model)


def test_shape_mismatch_names_op_and_shapes():
    a = helper.make_node("Add", ["a", "b"], ["y"], name="add_7")
    g = helper.make_graph([a], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
                                     helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])])
    with pytest.raises(OnnxImportError) as e:
        import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    msg = _one_line_error(e)
    assert "ONNX node 'add_7' (Add)" in msg and "[2,3]" in msg and "[4,5]" in msg


def test_computed_reshape_target_is_an_error():
    model = make_model([node("Reshape", ["x", "s"])], {"x": f32(2, 3), "s": ints(3, 2)})
    with pytest.raises(OnnxImportError, match="input 'shape' must be a constant"):
        import_onnx(model)


def test_pad_reflect_longer_than_the_axis_is_an_error():
    # Reflect padding itself imports (tests/test_onnx_ops_cases.py); onnxruntime refuses this too.
    model = make_model([node("Pad", ["x", "p"], mode="reflect")], {"x": f32(3, 4)},
                       {"p": ints(0, 4, 0, 1)})
    with pytest.raises(OnnxImportError, match="Pad mode 'reflect' needs pads shorter than the axis"):
        import_onnx(model)


def test_maxpool_indices_output_is_an_error():
    model = make_model([node("MaxPool", ["x"], ["y", "idx"], kernel_shape=[2, 2])], {"x": f32(1, 1, 4, 4)},
                       outputs=["y", "idx"])
    with pytest.raises(OnnxImportError, match="Indices"):
        import_onnx(model)


# -- stripping and filling initializers ----------------------------------------------------------

def _weighted_model() -> onnx.ModelProto:
    return make_model([node("MatMul", ["x", "w"], ["h"]), node("Add", ["h", "b"])],
                      {"x": f32(2, 32)}, {"w": f32(32, 16), "b": f32(16)})


def test_strip_keeps_small_initializers_and_lists_large_ones():
    stripped = strip_model(_weighted_model())
    assert stripped_names(stripped) == ["w"]
    assert [i.name for i in stripped.graph.initializer] == ["b"]
    assert {p.key for p in stripped.metadata_props} == {STRIPPED_KEY}
    onnx.checker.check_model(stripped)
    graph = import_onnx(stripped)
    assert graph.inputs == ("x", "w") and graph.type_of("w").shape == (32, 16)


def test_fill_is_seeded_and_matches_onnxruntime():
    stripped = strip_model(_weighted_model())
    filled = fill_model(stripped, seed=7)
    assert stripped_names(filled) == [] and [i.name for i in filled.graph.input] == ["x"]
    w = numpy_helper.to_array(next(i for i in filled.graph.initializer if i.name == "w"))
    np.testing.assert_array_equal(w, stripped_values("w", (32, 16), "float32", seed=7))
    assert 0.01 < float(np.std(w)) < 0.03
    assert not np.array_equal(w, stripped_values("w", (32, 16), "float32", seed=8))
    graph = import_onnx(stripped, fill_initializers=True, seed=7)
    assert graph.inputs == ("x",)
    x = f32(2, 32)
    assert_matches(run_reference(graph, {"x": x})["y"], run_ort(filled, {"x": x})[0])


def test_stripped_values_rules():
    bf = stripped_values("a.weight", (64,), "bfloat16", seed=0)
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.astype(np.float32),
                                  stripped_values("a.weight", (64,), "float32", 0).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32))
    assert (stripped_values("bn.running_var", (300,), "float32") >= 1.0).all()
    with pytest.raises(OnnxImportError, match="non-float dtype int64"):
        stripped_values("ids", (4,), "int64")
