"""Attention as the dynamo exporter writes it (three projections of one input, heads
transposed, then each scaled by sqrt(scale)): after ``rewrite_for_plan`` the projections are one
GEMM, the scale follows the matmul, and the split and every head transpose plan as strided
views."""

from __future__ import annotations

import numpy as np

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.rewrite import fold_matmul_scales, merge_parallel_matmuls, rewrite_for_plan

S, H, D = 16, 4, 8


def _attention(dtype: str = "float32") -> Graph:
    b = GraphBuilder("sdpa_exported")
    x = b.input("x", (1, S, H * D), dtype)
    scale = b.constant(np.array(D ** -0.25, np.float32), dtype=dtype)

    def heads(name: str) -> str:
        rng = np.random.default_rng(len(name) + ord(name))
        w = b.constant(rng.standard_normal((H * D, H * D)).astype(np.float32), dtype=dtype)
        bias = b.constant(rng.standard_normal(H * D).astype(np.float32), dtype=dtype)
        y = b.reshape(b.add(b.matmul(x, w), bias), shape=(1, S, H, D))
        return b.transpose(y, perm=(0, 2, 1, 3))

    q, k, v = heads("q"), heads("k"), heads("v")
    kt = b.reshape(b.transpose(b.reshape(k, shape=(H, S, D)), perm=(0, 2, 1)), shape=(1, H, D, S))
    p = b.softmax(b.matmul(b.mul(q, scale), b.mul(kt, scale)))
    return b.build([b.matmul(p, v)])


def _run(g: Graph) -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((1, S, H * D)).astype(np.float32)
    return run_reference(g, {"x": x})


def test_rewrites_keep_the_values_and_leave_no_copy_kernel():
    g = _attention()
    folded = fold_matmul_scales(g)
    assert [n.op for n in folded.nodes].count("mul") == 1  # after the QK^T matmul
    merged = merge_parallel_matmuls(g)  # alone: the scaled heads keep the split from a view
    assert merged is g
    h = rewrite_for_plan(g)
    ops = [n.op for n in h.nodes]
    assert ops.count("matmul") == 3 and ops.count("split") == 1
    want, got = _run(g), _run(h)
    for o in g.outputs:
        np.testing.assert_allclose(got[o], want[o], rtol=1e-5, atol=1e-6)  # c*d rounded once
    kinds = [s.kind for s in compile_plan(g, device=None).steps]
    assert "layout" not in kinds, kinds
    assert kinds.count("matmul") == 3
    assert kinds.count("fused") == 2  # the bias add; the scaled softmax


def test_a_scale_that_would_broadcast_stays_where_it_is():
    b = GraphBuilder("broadcast_scale")
    x = b.input("x", (2, 3), "float32")
    c = b.constant(np.ones((1, 1, 1), np.float32))  # rank 3: the multiply widens its input
    g = b.build([b.matmul(b.mul(x, c), b.input("y", (3, 2), "float32"))])
    assert fold_matmul_scales(g) is g
