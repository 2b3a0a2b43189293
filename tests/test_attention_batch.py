"""Attention rewrites at serving batch (batch > 1).

The exporters transpose the keys through ``[B, H, S, D] -> [B*H, S, D] -> [B*H, D, S] ->
[B, H, D, S]``. At batch 1 the merge of B and H is free; at batch 8 it is not (the head view
steps by ``D`` per head and ``S*H*D`` per sample, no one stride), so the key transpose was a copy
kernel and, its split no longer a view, the merged Q/K/V GEMM was rejected: BERT-base planned
172 kernels at batch 8 against 136 at batch 1. ``fold_batch_reshapes`` turns the chain into one
4-d transpose, a view; the GEMMs then read heads at two batch levels (sample, head), which
``plan_matmul`` gives as one strided-batched call per sample and ``pointer_batch`` as one
``cublasGemmBatchedEx`` over all of them. Verified here with the executor's memory emulated on
the CPU (``test_zoo_attention_plan._emulate``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import test_zoo_attention_plan as emu
from test_zoo_attention_plan import _emulate

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.graph.ops import infer_graph
from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.driver import load_graph
from tunedb.plan.gemm_forms import _form, gemm_forms
from tunedb.plan.rewrite import _readers, fold_batch_reshapes, fold_matmul_scales, rewrite_for_plan
from tunedb.plan.views import strided_view_nodes
from tunedb.runtime.blas import pointer_batch
from tunedb.runtime.inputs import make_inputs

B, S, H, D = 3, 16, 4, 8
ROOT = Path(__file__).resolve().parents[1] / "data" / "graphs"


def _attention_b(batch: int = B, dtype: str = "float32") -> Graph:
    """Attention as the dynamo exporter writes it at batch > 1 (keys through ``[B*H, S, D]``)."""
    b = GraphBuilder("sdpa_batched")
    x = b.input("x", (batch, S, H * D), dtype)
    scale = b.constant(np.array(D ** -0.25, np.float32), dtype=dtype)

    def heads(seed: int) -> str:
        rng = np.random.default_rng(seed)
        w = emu._projection(b, rng, dtype)
        bias = b.constant(rng.standard_normal(H * D).astype(np.float32), dtype=dtype)
        return b.transpose(b.reshape(b.add(b.matmul(x, w), bias), shape=(batch, S, H, D)), perm=(0, 2, 1, 3))

    q, k, v = heads(1), heads(2), heads(3)
    kt = b.reshape(b.transpose(b.reshape(k, shape=(batch * H, S, D)), perm=(0, 2, 1)),
                   shape=(batch, H, D, S))
    p = b.softmax(b.matmul(b.mul(q, scale), b.mul(kt, scale)))
    back = b.reshape(b.transpose(b.matmul(p, v), perm=(0, 2, 1, 3)), shape=(batch, S, H * D))
    wo = emu._projection(b, np.random.default_rng(7), dtype)
    return b.build([b.add(b.matmul(back, wo), x)])


def _x(batch: int = B) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((batch, S, H * D)).astype(np.float32)}


def _layout_copies(plan) -> list:
    return [s.ops for s in plan.steps if s.kind == "layout"]


def _emulate_counting(plan, inputs) -> tuple[dict[str, np.ndarray], list[str]]:
    """``_emulate`` with every GEMM that ``pointer_batch`` merges run as the one
    cublasGemmBatchedEx would: one matrix per entry of its pointer array. Also the form of each
    matmul (as ``gemm_forms`` names them), in step order."""
    seen: list[str] = []
    real = emu.plan_matmul

    def as_executed(*geom):
        calls = real(*geom)
        seen.append(_form(calls))
        merged = pointer_batch(calls) if calls else None
        if merged is None:
            return calls
        c, offs = merged
        return [dataclasses.replace(c, a_off=a, b_off=b, c_off=o, stride_a=0, stride_b=0,
                                    stride_c=0, batch=1) for a, b, o in offs]

    emu.plan_matmul = as_executed
    try:
        return _emulate(plan, inputs), seen
    finally:
        emu.plan_matmul = real


def _check_forms(plan, inputs, want, tol: float = 1e-5) -> dict[str, np.ndarray]:
    got, seen = _emulate_counting(plan, inputs)
    forms = gemm_forms(plan)
    assert [forms[k] for k in sorted(forms)] == seen  # the planner's layouts are the executor's
    assert not any(f.startswith(("loop", "staged")) for f in seen), seen  # one launch per matmul
    for o in plan.graph.outputs:
        np.testing.assert_allclose(got[o], want[o], rtol=tol, atol=tol)
    return got


def test_the_batch_reshape_chain_becomes_one_transpose_and_keeps_the_values():
    g = fold_matmul_scales(_attention_b())
    h = fold_batch_reshapes(g)
    assert sum(n.op == "reshape" for n in h.nodes) == sum(n.op == "reshape" for n in g.nodes) - 2
    kt = [n for n in h.nodes if n.op == "transpose" and n.attr("perm") == (0, 1, 3, 2)]
    assert len(kt) == 1  # [B, H, S, D] -> [B, H, D, S] in one step
    want, got = run_reference(g, _x()), run_reference(h, _x())
    for o in g.outputs:
        np.testing.assert_array_equal(got[o], want[o])
    # the reason: before the fold, the keys' transpose is no view (B and H do not merge)
    before = strided_view_nodes(g.nodes, g.type_map, _readers(g.nodes), set(g.outputs))
    after = strided_view_nodes(h.nodes, h.type_map, _readers(h.nodes), set(h.outputs))
    assert len(after) == len(before) + 1


def test_at_batch_3_the_qkv_merge_holds_and_no_copy_is_left():
    g = _attention_b()
    ops = [n.op for n in rewrite_for_plan(g).nodes]
    assert ops.count("split") == 1 and ops.count("matmul") == 4
    plan = compile_plan(g, device=None)
    assert _layout_copies(plan) == []
    one = compile_plan(_attention_b(1), device=None)
    assert plan.kernels == one.kernels
    _check_forms(plan, _x(), run_reference(g, _x()), tol=1e-4)  # unscaled random weights
    # QK^T and PV read heads at two batch levels (sample, head): one pointer-batched launch each
    assert sorted(gemm_forms(plan).values()) == ["gemm", "gemm", f"pointer×{B * H}", f"pointer×{B * H}"]
    assert f"cublas pointer×{B * H}" in plan.explain()
    assert sorted(gemm_forms(one).values()) == ["gemm", "gemm", f"strided×{H}", f"strided×{H}"]


def test_a_reshape_that_does_not_split_back_is_left_alone():
    b = GraphBuilder("no_split_back")
    x = b.input("x", (2, 3, 4, 5), "float32")
    y = b.reshape(b.transpose(b.reshape(x, shape=(6, 4, 5)), perm=(0, 2, 1)), shape=(3, 2, 5, 4))
    g = b.build([y])
    assert fold_batch_reshapes(g) is g
    b = GraphBuilder("moves_the_merged_axis")
    x = b.input("x", (2, 3, 4, 5), "float32")
    y = b.reshape(b.transpose(b.reshape(x, shape=(6, 4, 5)), perm=(1, 0, 2)), shape=(4, 6, 5))
    g = b.build([y])
    assert fold_batch_reshapes(g) is g
    b = GraphBuilder("reshape_to_a_scalar")  # ReduceLogSumExp over all axes: reshape(max, ())
    x = b.input("x", (1, 1, 1), "float32")
    g = b.build([b.reshape(b.transpose(x, perm=(0, 2, 1)), shape=())])
    assert fold_batch_reshapes(g) is g


def _first_layers(graph: Graph, layers: int) -> Graph:
    """The graph up to the bias add of its ``6 * layers``-th weight GEMM (BERT: Q, K, V, out,
    FFN up, FFN down per layer), dead nodes and unused inputs dropped."""
    consts = graph.constant_map
    weight = [i for i, n in enumerate(graph.nodes)
              if n.op in ("matmul", "gemm") and n.inputs[1] in consts]
    end = next(i for i in range(weight[6 * layers - 1] + 1, len(graph.nodes)) if graph.nodes[i].op == "add")
    out = graph.nodes[end].outputs[0]
    need, keep = {out}, []
    for n in reversed(graph.nodes[:end + 1]):
        if need & set(n.outputs):
            keep.append(n)
            need |= set(n.inputs)
    keep.reverse()
    used = {v for n in keep for v in n.inputs}
    defined = {o for n in keep for o in n.outputs} | used
    return infer_graph(Graph(tuple(v for v in graph.inputs if v in used), (out,), tuple(keep),
                             tuple((v, t) for v, t in graph.types if v in defined),
                             tuple((v, c) for v, c in graph.constants if v in used), graph.name))


def _check_bert_b8(graph: Graph):
    plan = compile_plan(graph, device=None)
    assert _layout_copies(plan) == [("gather",)] * 2  # embeddings, mask
    _, host = make_inputs(plan.graph, 5)
    _check_forms(plan, host, run_reference(plan.graph, host))
    return plan


@pytest.mark.slow  # loading the two ONNX files alone takes 14 s here
def test_bert_base_batch8_two_layers_plan_like_batch1_and_equal_the_reference():
    g8 = _first_layers(load_graph(str(ROOT / "zoo_b8" / "bert_base_dynamo_fp32_b8.onnx")), 2)
    g1 = _first_layers(load_graph(str(ROOT / "zoo" / "bert_base_dynamo_fp32.onnx")), 2)
    assert g8.type_of(g8.outputs[0]).shape[0] == 8
    plan = _check_bert_b8(g8)
    assert plan.kernels == compile_plan(g1, device=None).kernels
    assert sum(s.kind == "matmul" for s in plan.steps) == 12  # merged QKV, QK^T, PV, out, FFN x2
    assert sorted(set(gemm_forms(plan).values())) == ["gemm", "pointer×96"]


@pytest.mark.slow
def test_bert_base_batch8_whole_model_equals_the_reference():
    plan = _check_bert_b8(load_graph(str(ROOT / "zoo_b8" / "bert_base_dynamo_fp32_b8.onnx")))
    assert plan.kernels == 136  # as at batch 1 (it was 172 before fold_batch_reshapes)
