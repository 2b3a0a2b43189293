"""The ONNX op families of opsets 13-21 (issue 21): every op added for them imports, runs in
the float64 reference and matches onnxruntime on a one-op model; composites decompose into
primitives the fusion planner can take; ops outside the families fail with one line naming
the op."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from test_onnx_cases import f32, make_model, node
from test_onnx_ops_cases import OPS_CASES, UNCHECKED

from tunedb.graph.onnx_import import OnnxImportError, import_onnx
from tunedb.graph.reference import run_reference
from tunedb.plan.subgraph import FUSABLE_OPS

# Ops that the new handlers may emit besides fusable ones (data movement, planned by itself).
_DATA_MOVEMENT = {"gather", "slice", "pad", "argmax"}


def _unchecked_model(nodes, inputs, inits, opset):
    """Like ``make_model`` without the checker and shape inference."""
    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in inputs.items()]
    out = helper.make_tensor_value_info(nodes[-1].output[0], vis[0].type.tensor_type.elem_type,
                                        list(next(iter(inputs.values())).shape))  # a shape-keeping op
    g = helper.make_graph(nodes, "case", vis, [out],
                          initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("cid,nodes,inputs,inits,opset,outputs", OPS_CASES, ids=[c[0] for c in OPS_CASES])
def test_op_matches_onnxruntime(cid, nodes, inputs, inits, opset, outputs):
    model = (_unchecked_model(nodes, inputs, inits, opset) if cid in UNCHECKED
             else make_model(nodes, inputs, inits, opset, outputs))
    want = _ort(model, inputs)
    graph = import_onnx(model)
    got = run_reference(graph, inputs)
    for name, w in zip(graph.outputs, want):
        g = got[name]
        assert g.shape == w.shape, (g.shape, w.shape)
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w)
            continue
        w = w.astype(np.float64)
        assert np.array_equal(np.isnan(g), np.isnan(w))
        scale = max(1.0, float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * scale)
    # Everything is a primitive the planner fuses, or data movement it plans as its own step.
    assert {n.op for n in graph.nodes} <= FUSABLE_OPS | _DATA_MOVEMENT


def test_atan_is_float32_accurate_over_the_reals():
    # The graph's constants (pi/2, the series) are float32, like its input: float32 accuracy.
    x = np.concatenate([np.linspace(-50, 50, 20001), np.geomspace(1e-8, 1e8, 2001)]).astype(np.float32)
    model = make_model([node("Atan", ["x"])], {"x": x})
    got = run_reference(import_onnx(model), {"x": x})["y"]
    np.testing.assert_allclose(got, np.arctan(x.astype(np.float64)), rtol=3e-7, atol=1e-12)


def test_round_is_half_to_even_on_every_half():
    x = (np.arange(-40, 41) / 2).astype(np.float32)
    got = run_reference(import_onnx(make_model([node("Round", ["x"])], {"x": x})), {"x": x})["y"]
    np.testing.assert_array_equal(got, np.round(x.astype(np.float64)))


def test_group_norm_is_one_fusable_region():
    """GroupNormalization (opset 21) leaves no op the fusion planner must run alone."""
    model = make_model([node("GroupNormalization", ["x", "s", "b"], num_groups=4)],
                       {"x": f32(2, 8, 3, 3), "s": f32(8), "b": f32(8)}, opset=21)
    ops = {n.op for n in import_onnx(model).nodes}
    assert ops <= FUSABLE_OPS and {"reduce_mean", "reshape"} <= ops


@pytest.mark.parametrize("op,attrs,why", [
    ("BitShift", {"direction": "LEFT"}, "BitShift"),
    ("BitwiseAnd", {}, "BitwiseAnd"),
])
def test_ops_outside_the_families_name_the_op(op, attrs, why):
    ins = ["x", "y"]
    inits = {"y": np.ones((2, 3), np.int64)}
    vis = [helper.make_tensor_value_info("x", 7, [2, 3])]
    g = helper.make_graph([helper.make_node(op, ins, ["z"], **attrs)], "g", vis,
                          [helper.make_tensor_value_info("z", 7, [2, 3])],
                          initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(OnnxImportError) as e:
        import_onnx(model)
    msg = str(e.value)
    assert "\n" not in msg and f"unsupported ONNX op {why!r}" in msg


@pytest.mark.parametrize("nodes,inputs,inits,opset,needle", [
    ([node("Resize", ["x", "", "s"], mode="cubic")], {"x": f32(1, 1, 3, 3)},
     {"s": np.array([1, 1, 2, 2], np.float32)}, 13, "mode 'cubic'"),
    ([node("ScatterND", ["x", "i", "u"], reduction="add")], {"x": f32(3, 2), "u": f32(1, 2)},
     {"i": np.array([[1]], np.int64)}, 16, "reduction='add'"),
    ([node("ScatterND", ["x", "i", "u"])], {"x": f32(3, 2), "i": np.array([[1]], np.int64),
                                             "u": f32(1, 2)}, {}, 16, "must be a constant"),
    ([node("LpNormalization", ["x"], p=3)], {"x": f32(3, 2)}, {}, 17, "p=3"),
])
def test_unsupported_variants_fail_with_one_line(nodes, inputs, inits, opset, needle):
    model = make_model(nodes, inputs, inits, opset)
    with pytest.raises(OnnxImportError) as e:
        import_onnx(model)
    assert needle in str(e.value) and "\n" not in str(e.value)


_EXPORTED = Path(__file__).resolve().parents[1] / "data" / "graphs" / "onnx_ops"
# Ops the exporters emit that tunedb still refuses, each with its one-line error.
_REFUSED: dict[str, str] = {}


def _exported_entries() -> list[dict]:
    return [e for e in json.loads((_EXPORTED / "manifest.json").read_text()) if "error" not in e]


@pytest.mark.parametrize("entry", _exported_entries(), ids=lambda e: e["file"])
def test_what_the_exporters_emit_imports_and_matches_onnxruntime(entry):
    """Tiny torch modules exported by both torch exporters (benchmarks/export_onnx_op_models.py):
    the ops they really write for these layers import and compute what onnxruntime does."""
    path = _EXPORTED / entry["file"]
    if entry["case"] in _REFUSED:
        with pytest.raises(OnnxImportError, match=f"unsupported ONNX op '{_REFUSED[entry['case']]}'"):
            import_onnx(path)
        return
    graph = import_onnx(path)
    rng = np.random.default_rng(0)
    scale = 0.5 if entry["case"] == "inverse_trig" else 1.0  # inside asin's and atanh's domain
    feeds = {v: rng.integers(0, 7, graph.type_of(v).shape).astype(np.int64)
             if graph.type_of(v).dtype == "int64" else
             (rng.standard_normal(graph.type_of(v).shape) * scale).astype(np.float32)
             for v in graph.inputs}
    want = _ort_path(path, feeds)
    got = run_reference(graph, feeds)
    for name, w in zip(graph.outputs, want):
        w = w.astype(np.float64)
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max())))


def _ort_path(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_the_exported_op_models_cover_the_families():
    ops = {op for e in _exported_entries() for op in e["ops"]}
    assert {"ReduceLogSumExp", "ReduceL2", "ReduceL1", "InstanceNormalization", "Resize",
            "DepthToSpace", "Tile", "OneHot", "ScatterND", "ScatterElements", "PRelu", "Mish",
            "SoftmaxCrossEntropyLoss"} <= ops
