"""Models people export: constant folding that never aborts an import, and the zoo of
data/graphs/zoo (written by benchmarks/export_zoo.py: transformers and torchvision models from
their default configs, both PyTorch exporters, fp32 and bf16, weights stripped) importing and
planning on the CPU, with onnxruntime's results on seeded weights where the model is small.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tunedb
from tunedb.graph.onnx_import import OnnxImportError, fill_model, import_onnx
from tunedb.graph.reference import run_reference

ZOO = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo"


def _model(nodes, inits, inputs, outputs, opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "t", inputs, outputs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _token_type_model() -> onnx.ModelProto:
    """BERT's embedding prologue as both exporters write it: the token-type buffer [1, 512]
    sliced to the sequence, expanded to the batch and gathered by position (GatherElements),
    all on constants. ONNX's reference evaluator fails on it ('cannot reshape array of size 1
    into shape (1,128)'), which aborted every BERT import."""
    inits = {"buf": np.zeros((1, 512), np.int64),
             "pos": np.arange(128, dtype=np.int64).reshape(1, 128)[:, ::-1].copy(),
             "shape": np.array([1, 128], np.int64), "st": np.array([0], np.int64),
             "en": np.array([128], np.int64), "ax": np.array([1], np.int64),
             "table": np.arange(2 * 4, dtype=np.float32).reshape(2, 4)}
    inits["buf"][0, 100:] = 1
    nodes = [helper.make_node("Slice", ["buf", "st", "en", "ax"], ["sliced"]),
             helper.make_node("Expand", ["sliced", "shape"], ["expanded"]),
             helper.make_node("GatherElements", ["expanded", "pos"], ["types"], axis=1),
             helper.make_node("Gather", ["table", "types"], ["emb"]),
             helper.make_node("Add", ["x", "emb"], ["y"])]
    return _model(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128, 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128, 4])])


def test_bert_token_type_prologue_folds_with_tunedb_reference():
    model = _token_type_model()
    graph = import_onnx(model)
    assert [n.op for n in graph.nodes] == ["add"]  # the whole prologue became one constant
    x = np.random.default_rng(0).standard_normal((1, 128, 4)).astype(np.float32)
    got = run_reference(graph, {"x": x})["y"]
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=0, atol=1e-6)


def test_unfoldable_constant_node_stays_a_runtime_node(caplog):
    # An index out of range: neither reference folds it, so it is kept as a runtime gather
    # (with a debug note) instead of aborting the import.
    inits = {"data": np.arange(6, dtype=np.float32).reshape(2, 3),
             "idx": np.array([[0, 5]], np.int64)}
    nodes = [helper.make_node("GatherElements", ["data", "idx"], ["g"], axis=1),
             helper.make_node("Add", ["x", "g"], ["y"])]
    model = _model(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    with caplog.at_level(logging.DEBUG, logger="tunedb.graph.onnx_import._convert"):
        graph = import_onnx(model)
    assert [n.op for n in graph.nodes] == ["gather_elements", "add"]
    assert any("not folded, kept as a runtime node" in r.getMessage() for r in caplog.records)


def test_fold_only_op_that_fails_is_one_line_error():
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["c"]),
             helper.make_node("Add", ["x", "c"], ["y"])]
    model = _model(nodes, {"shape": np.array([-2], np.int64)},
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(OnnxImportError, match=r"ConstantOfShape.*constant folding failed") as e:
        import_onnx(model)
    assert "\n" not in str(e.value)


def test_folded_bf16_constants_keep_their_dtype():
    import ml_dtypes

    w = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    nodes = [helper.make_node("Cast", ["w"], ["wb"], to=TensorProto.BFLOAT16),
             helper.make_node("Mul", ["wb", "wb"], ["w2"]),
             helper.make_node("Add", ["x", "w2"], ["y"])]
    model = _model(nodes, {"w": w}, [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 4])])
    graph = import_onnx(model)
    assert [n.op for n in graph.nodes] == ["add"]
    (c,) = (c for _, c in graph.constants)
    assert c.type.dtype == "bfloat16"
    wb = w.astype(ml_dtypes.bfloat16).astype(np.float64)
    want = (wb * wb).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(c.array, np.float32), want)


@pytest.mark.parametrize("const_indices", [True, False])
def test_gather_nd_matches_onnxruntime(const_indices):
    rng = np.random.default_rng(1)
    data = rng.standard_normal((3, 4, 5)).astype(np.float32)
    idx = np.array([[[0, 1], [2, -1]], [[1, 3], [-3, 0]]], np.int64)
    inits = {"idx": idx} if const_indices else {}
    ins = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [3, 4, 5])]
    if not const_indices:
        ins.append(helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 2, 2]))
    model = _model([helper.make_node("GatherND", ["data", "idx"], ["y"])], inits, ins,
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, 5])])
    feeds = {"data": data} if const_indices else {"data": data, "idx": idx}
    got = run_reference(import_onnx(model), feeds)["y"]
    np.testing.assert_array_equal(got.astype(np.float32), _ort(model, feeds)[0])


def test_isnan_isinf_match_onnxruntime():
    x = np.array([0.0, np.nan, np.inf, -np.inf, -1.5], np.float32)
    nodes = [helper.make_node("IsNaN", ["x"], ["a"]), helper.make_node("IsInf", ["x"], ["b"]),
             helper.make_node("IsInf", ["x"], ["c"], detect_negative=0)]
    outs = [helper.make_tensor_value_info(v, TensorProto.BOOL, [5]) for v in "abc"]
    model = _model(nodes, {}, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])], outs)
    got = run_reference(import_onnx(model), {"x": x})
    for v, want in zip("abc", _ort(model, {"x": x})):
        np.testing.assert_array_equal(got[v], want)


# -- the zoo ---------------------------------------------------------------------------------
MANIFEST = json.loads((ZOO / "manifest.json").read_text())
FILES = sorted(m["file"] for m in MANIFEST if "error" not in m)
# The models the issue names; each must have at least one file from each exporter that can
# export it, in fp32 and in a 16-bit float type.
MODELS = ("bert_base", "distilbert", "gpt2", "llama_small", "t5_encoder", "vit", "clip_text",
          "clip_vision", "whisper_encoder", "resnet50", "mobilenet_v3", "efficientnet_b0",
          "convnext_tiny")


def test_manifest_lists_every_file_and_every_model():
    on_disk = {p.name for p in ZOO.glob("*.onnx")}
    assert on_disk == set(FILES)
    for m in MANIFEST:
        assert m["exporter"] in ("torchscript", "dynamo") and m["model"] in MODELS
        assert ("error" in m) != ("bytes" in m), m["file"]
    for model in MODELS:  # all 52: each model by each exporter in fp32 and in 16 bits
        for exporter in ("torchscript", "dynamo"):
            have = {(m["dtype"] == "float32") for m in MANIFEST if m["model"] == model
                    and m["exporter"] == exporter and "error" not in m}
            assert have == {True, False}, f"{model} ({exporter}): needs an fp32 and a 16-bit file"
    # The exporter script's numerics check: every fp32 file, reference vs onnxruntime.
    for m in MANIFEST:
        if "error" not in m and m["dtype"] == "float32":
            assert m["check"]["ref_vs_ort"] < 1e-5, m["file"]
    # Structure only: the weights are stripped, the whole zoo stays small (57 files: 6.3 MB).
    assert sum((ZOO / f).stat().st_size for f in FILES) < 7 * 2**20


def _fast_files() -> list[str]:
    """One file per model for the fast tier, rotating through exporter x dtype so that each of
    the four appears 3-4 times; the other 44 run in the slow tier (0.5-3.5 s each on 2 cores)."""
    combos = [("dynamo", True), ("torchscript", False), ("torchscript", True), ("dynamo", False)]
    out = []
    for i, model in enumerate(MODELS):
        exporter, fp32 = combos[i % 4]
        out.append(next(m["file"] for m in sorted(MANIFEST, key=lambda m: m["dtype"] != "bfloat16")
                        if m["model"] == model and m["exporter"] == exporter and "error" not in m
                        and (m["dtype"] == "float32") == fp32))
    return out


FAST = _fast_files()


@pytest.mark.parametrize("file", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow)
                                  for f in FILES])
def test_zoo_model_imports_and_plans(file):
    entry = next(m for m in MANIFEST if m["file"] == file)
    graph = import_onnx(ZOO / file)  # stripped weights stay graph inputs
    want = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[entry["dtype"]]
    assert graph.type_of(graph.outputs[0]).dtype == want
    plan = tunedb.compile(graph, cost_model=False)
    # fused: fewer steps than nodes (launches may not be: a convolution is 2-3 kernels)
    assert plan.steps and len(plan.steps) < len(graph.nodes)


@pytest.mark.parametrize("file", ["bert_base_dynamo_bf16.onnx", "vit_dynamo_bf16.onnx",
                                  "resnet50_dynamo_bf16.onnx", "convnext_tiny_ts_bf16.onnx"])
def test_bf16_models_have_no_float32_values(file):
    # No hidden upcasts: neither the importer (composites such as softmax and layernorm) nor
    # the planner's kernels put a float32 tensor between bf16 ops of these models.
    graph = import_onnx(ZOO / file)
    assert {t.dtype for _, t in graph.types} <= {"bfloat16", "int64", "bool"}
    plan = tunedb.compile(graph, cost_model=False)
    for step in plan.steps:
        assert "float32" not in {t.dtype for _, t in step.graph.types}, step.ops


@pytest.mark.slow
@pytest.mark.parametrize("file", ["llama_small_dynamo_fp32.onnx", "mobilenet_v3_ts_fp32.onnx"])
def test_zoo_model_matches_onnxruntime(file):
    # The exporter check (benchmarks/export_zoo.py --check, in the manifest) covers every fp32
    # file; these two small ones run here too: seeded weights, the same inputs on both sides.
    model = fill_model(onnx.load(str(ZOO / file)), seed=2)
    graph = import_onnx(model)
    rng = np.random.default_rng(2)
    feeds = {}
    for v in graph.inputs:
        t = graph.type_of(v)
        feeds[v] = (np.ones(t.shape, np.int64) if "mask" in v else
                    rng.integers(0, 1000, t.shape).astype(np.int64) if t.dtype == "int64"
                    else rng.standard_normal(t.shape).astype(np.float32))
    ref = run_reference(graph, feeds)[graph.outputs[0]]
    got = _ort(model, feeds)[0]
    assert np.abs(ref - got).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_bert_exported_on_the_fly_imports_and_plans(dynamo, tmp_path):
    # Where the exporters are installed (not in CI): BERT from transformers, exported now, the
    # way issue 24 found every BERT import failing (at GatherElements / node_gather).
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if dynamo:
        pytest.importorskip("onnxscript")
    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=2)).eval()

    class Hidden(torch.nn.Module):  # a tensor out, inputs by keyword (as benchmarks/export_zoo.py)
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    model = Hidden().eval()  # export restores the mode it found, recursively
    ids = torch.randint(0, 1000, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.int64)
    path = tmp_path / "bert.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          dynamo=dynamo, opset_version=18 if dynamo else 17)
    full = onnx.load(str(path))
    graph = import_onnx(full)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    got = run_reference(graph, feeds)[graph.outputs[0]]
    want = model(ids, mask).detach().numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert tunedb.compile(graph, cost_model=False).steps


# -- torch.compile backend (needs PyTorch, which tunedb does not depend on) ------------------
@pytest.mark.slow
def test_torch_backend_plans_fx_graph_and_matches_eager():
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True) needs it
    from tunedb.frontends.torch_backend import TunedbGraph

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)
            self.ln = torch.nn.LayerNorm(64)

        def forward(self, x):
            return self.ln(torch.nn.functional.gelu(self.fc(x)) + x)

    model = Block().eval()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(TunedbGraph(gm, example_inputs, {"cost_model": False}))
        return graphs[-1]

    x = torch.randn(8, 64)
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    (g,) = graphs
    assert g.plan is not None  # the FX graph went through ONNX into a tunedb plan
    ops = {n.op for n in g.plan.graph.nodes}
    assert {"erf", "rsqrt"} <= ops and ops & {"matmul", "gemm"}
    assert g.fallback == "inputs are not on a CUDA device"  # the CPU: runs eagerly
    torch.testing.assert_close(got, want)
