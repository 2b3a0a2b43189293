"""The shipped ONNX graphs (data/graphs, exported from PyTorch by benchmarks/export_graphs.py,
each model by both of PyTorch's exporters) import whole and agree with onnxruntime on the same
seeded weights.

The files hold no large weights (see ``strip_model``); ``fill_model`` embeds the values that
``import_onnx(..., fill_initializers=True)`` uses, so both sides run the same model.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tunedb.graph.hashing import graph_hash
from tunedb.graph.onnx_import import fill_model, import_onnx, stripped_names
from tunedb.graph.reference import example_feeds, run_reference

GRAPHS = Path(__file__).resolve().parent.parent / "data" / "graphs"

# name -> (inputs with their types, outputs with their types, tunedb ops the graph must contain)
EXPECTED = {
    "bert_layer": ({"hidden_states": "float32[1,128,768]", "attention_mask": "int64[1,128]"},
                   {"output": "float32[1,128,768]"},
                   {"matmul", "erf", "exp", "reduce_max", "rsqrt", "transpose", "cast"}),
    "gpt2_block": ({"hidden_states": "float32[1,128,768]"}, {"output": "float32[1,128,768]"},
                   {"matmul", "tanh", "where", "split", "exp", "rsqrt"}),
    "resnet_piece": ({"pixels": "float32[1,3,224,224]"}, {"logits": "float32[1,1000]"},
                     {"conv2d", "relu", "max_pool2d", "gemm", "add"}),
    "inception_mixed_5b": ({"x": "float32[1,192,35,35]"}, {"mixed_5b": "float32[1,256,35,35]"},
                           {"conv2d", "relu", "avg_pool2d", "concat"}),
}


# The TorchScript exporter's files (opset 17) and the torch.export-based one's (opset 18).
FILES = {f"{name}{suffix}": (name, opset) for name in EXPECTED
         for suffix, opset in (("", 17), ("_dynamo", 18))}


def _path(name: str) -> Path:
    return GRAPHS / f"{name}.onnx"


def test_every_shipped_graph_is_tested():
    assert {p.stem for p in GRAPHS.glob("*.onnx")} == set(FILES)


@pytest.mark.parametrize("name", sorted(FILES))
def test_shipped_file_is_small_and_stripped(name):
    path = _path(name)
    assert path.stat().st_size < 200 * 1024
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert [o.version for o in model.opset_import if o.domain == ""] == [FILES[name][1]]
    assert len(stripped_names(model)) >= 4
    assert all(len(i.raw_data) <= 1024 or i.data_type not in (1, 10, 16) for i in model.graph.initializer)


@pytest.mark.parametrize("name", sorted(FILES))
def test_imports_whole(name):
    inputs, outputs, ops = EXPECTED[FILES[name][0]]
    model = onnx.load(str(_path(name)))
    stripped = stripped_names(model)
    bare = import_onnx(_path(name))  # stripped weights stay graph inputs
    assert bare.inputs == tuple(inputs) + tuple(stripped)
    graph = import_onnx(_path(name), fill_initializers=True)
    assert {v: str(graph.type_of(v)) for v in graph.inputs} == inputs
    assert {v: str(graph.type_of(v)) for v in graph.outputs} == outputs
    assert ops <= {n.op for n in graph.nodes}
    # Every stripped weight came back as a constant; the shape arithmetic folded away.
    assert {n.op for n in graph.nodes}.isdisjoint({"identity"})
    assert len(graph.constants) >= len(stripped)
    assert graph_hash(graph) == graph_hash(import_onnx(_path(name), fill_initializers=True))
    assert graph_hash(graph) != graph_hash(import_onnx(_path(name), fill_initializers=True, seed=1))


@pytest.mark.parametrize("name", sorted(FILES))
def test_matches_onnxruntime_on_filled_weights(name):
    graph = import_onnx(_path(name), fill_initializers=True, seed=3)
    feeds = example_feeds(graph)
    filled = fill_model(onnx.load(str(_path(name))), seed=3)
    sess = ort.InferenceSession(filled.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = run_reference(graph, feeds)
    for out, w in zip(graph.outputs, want):
        scale = float(np.max(np.abs(w)))
        assert scale > 1e-3  # the seeded weights keep a signal to compare
        np.testing.assert_allclose(got[out], w, rtol=1e-4, atol=1e-5 * scale)


def test_bert_attention_mask_matters():
    graph = import_onnx(_path("bert_layer"), fill_initializers=True)
    feeds = example_feeds(graph)
    full = dict(feeds, attention_mask=np.ones((1, 128), np.int64))
    a = run_reference(graph, feeds)["output"]
    b = run_reference(graph, full)["output"]
    assert np.max(np.abs(a - b)) > 1e-4


def test_gpt2_block_is_causal():
    graph = import_onnx(_path("gpt2_block"), fill_initializers=True)
    feeds = example_feeds(graph)
    x2 = feeds["hidden_states"].copy()
    x2[:, 100:] += 1.0  # changing later tokens must not change earlier outputs
    a = run_reference(graph, feeds)["output"]
    b = run_reference(graph, {"hidden_states": x2})["output"]
    np.testing.assert_allclose(a[:, :100], b[:, :100], rtol=1e-12, atol=1e-12)
    assert np.max(np.abs(a[:, 100:] - b[:, 100:])) > 1e-3


def test_graph_op_counts_are_plausible():
    """A BERT layer has 6 weight matmuls + 2 attention matmuls; Mixed_5b has 7 convs."""
    bert = Counter(n.op for n in import_onnx(_path("bert_layer"), fill_initializers=True).nodes)
    assert bert["matmul"] == 8 and bert["erf"] == 1
    incep = Counter(n.op for n in import_onnx(_path("inception_mixed_5b"), fill_initializers=True).nodes)
    assert incep["conv2d"] == 7 and incep["avg_pool2d"] == 1
