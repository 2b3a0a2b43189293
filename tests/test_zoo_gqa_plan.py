"""Grouped-query attention (Llama) plans without the key/value repeat copies
(tunedb/plan/rewrite_gqa.py): same values, no expand, fewer kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from plan_checks import check_outputs

import tunedb
from tunedb.graph.ir import Graph, Node, TensorType
from tunedb.graph.onnx_import import import_onnx
from tunedb.graph.ops import infer_graph
from tunedb.graph.reference import run_reference
from tunedb.plan.rewrite import fold_matmul_scales, rewrite_for_plan
from tunedb.plan.rewrite_gqa import fold_grouped_kv
from tunedb.runtime.inputs import make_inputs

ZOO = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo"
B, H, KV, S, D = 1, 8, 4, 16, 8


def _gqa_block(unsqueeze_axis: int = 2) -> Graph:
    """softmax-free attention with keys and values repeated per group as the dynamo exporter
    writes ``repeat_kv``: unsqueeze, expand, reshape (keys: through a 3-D transpose)."""
    g = H // KV
    rep = (B, KV, g, S, D) if unsqueeze_axis == 2 else (B, g, KV, S, D)
    nodes = [
        Node("unsqueeze", ("k",), ("ku",), {"axes": (unsqueeze_axis,)}),
        Node("expand", ("ku",), ("ke",), {"shape": rep}),
        Node("reshape", ("ke",), ("k3",), {"shape": (B * H, S, D)}),
        Node("transpose", ("k3",), ("kt3",), {"perm": (0, 2, 1)}),
        Node("reshape", ("kt3",), ("kt",), {"shape": (B, H, D, S)}),
        Node("matmul", ("q", "kt"), ("s",)),
        Node("exp", ("s",), ("p",)),
        Node("unsqueeze", ("v",), ("vu",), {"axes": (unsqueeze_axis,)}),
        Node("expand", ("vu",), ("ve",), {"shape": rep}),
        Node("reshape", ("ve",), ("vr",), {"shape": (B, H, S, D)}),
        Node("matmul", ("p", "vr"), ("y",)),
    ]
    types = {"q": TensorType((B, H, S, D), "float32"), "k": TensorType((B, KV, S, D), "float32"),
             "v": TensorType((B, KV, S, D), "float32")}
    return infer_graph(Graph(("q", "k", "v"), ("y",), tuple(nodes), types))


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((B, H, S, D)).astype(np.float32) * 0.3,
            "k": rng.standard_normal((B, KV, S, D)).astype(np.float32),
            "v": rng.standard_normal((B, KV, S, D)).astype(np.float32)}


def test_repeated_heads_become_grouped_matmuls_with_the_same_values():
    graph = _gqa_block()
    out = fold_grouped_kv(graph)
    ops = [n.op for n in out.nodes]
    assert "expand" not in ops and ops.count("matmul") == 2
    feeds = _feeds()
    want = run_reference(graph, feeds)["y"]
    np.testing.assert_allclose(run_reference(out, feeds)["y"], want, rtol=1e-12, atol=0)
    # The plan: two GEMMs and the exp, no copy kernel for the repeats (the keys' transpose
    # is a view).
    plan = tunedb.compile(out, cost_model=False, fill_initializers=False)
    assert plan.kernels == 3
    assert not [s for s in plan.steps if s.kind == "layout"], [s.ops for s in plan.steps]


def test_another_head_order_is_left_alone():
    # unsqueeze at axis 1 repeats the whole set of heads (head h reads h % KV), not groups:
    # not the layout the rewrite assumes, so the graph stays as it is.
    graph = _gqa_block(unsqueeze_axis=1)
    assert fold_grouped_kv(graph) is graph


@pytest.mark.slow  # imports and plans the 4-layer Llama twice (~10 s on 2 cores)
def test_llama_small_loses_its_repeat_copies():
    graph = fold_matmul_scales(import_onnx(ZOO / "llama_small_dynamo_fp32.onnx"))
    assert [n.op for n in graph.nodes].count("expand") == 8  # two repeats a layer
    grouped = fold_grouped_kv(graph)
    assert "expand" not in [n.op for n in grouped.nodes]
    plan = tunedb.compile(grouped, cost_model=False)
    layouts = [s.ops for s in plan.steps if s.kind == "layout"]
    assert len(layouts) == 6 and not any("expand" in ops for ops in layouts), layouts
    # Not part of rewrite_for_plan (the module's docstring says why): the graph stays as is.
    assert "expand" in [n.op for n in rewrite_for_plan(graph).nodes]


@pytest.mark.gpu
@pytest.mark.parametrize("file", ["llama_small_dynamo_fp32.onnx", "llama_small_dynamo_bf16.onnx"])
def test_llama_grouped_plan_matches_the_reference_on_the_gpu(file):
    # The grouped GEMMs, the value transpose as a strided view and the heads-back copy, run by
    # the executor (cuBLAS) against the float64 reference, on fan-in-scaled weights.
    from tunedb.bench.plan import weighted_model
    from tunedb.runtime.executor import PlanExecutor

    graph = fold_grouped_kv(fold_matmul_scales(import_onnx(weighted_model(ZOO / file))))
    plan = tunedb.compile(graph, device="cuda")
    assert "expand" not in {op for s in plan.steps for op in s.ops}
    ex = PlanExecutor(plan)
    dev, ref_in = make_inputs(plan.graph, 3)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
