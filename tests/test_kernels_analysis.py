"""Domain canonicalisation and value classes of the fused-kernel analysis."""

from __future__ import annotations

import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.analysis import (
    COL,
    FULL,
    ROW,
    SCALAR,
    TRANS,
    UnsupportedFusion,
    analyze,
)
from tunedb.kernels.passes import cache_values


def test_bias_gelu_is_elementwise_with_a_column_operand():
    b = GraphBuilder("bias_gelu")
    x, bias = b.input("x", (4, 8, 96)), b.input("b", (96,))
    y = b.gelu(b.add(x, bias), approximate="tanh")
    a = analyze(b.build([y]))
    assert (a.pattern, a.R, a.C) == ("elementwise", 32, 96)
    assert a.cls["x"] == FULL and a.cls["b"] == COL and a.cls[y] == FULL
    assert a.reductions == ()


def test_layernorm_levels_and_classes():
    b = GraphBuilder("ln")
    x, r = b.input("x", (2, 16, 64), "float16"), b.input("r", (2, 16, 64), "float16")
    g, beta = b.input("g", (64,), "float16"), b.input("beta", (64,), "float16")
    h = b.add(x, r)
    y = b.layernorm(h, g, beta)
    a = analyze(b.build([y]))
    assert (a.pattern, a.R, a.C) == ("row_reduce", 32, 64)
    assert [(r.axis, r.level, r.op) for r in a.reductions] == [("row", 0, "reduce_mean"),
                                                                ("row", 1, "reduce_mean")]
    assert a.row_levels == 2 and a.col_levels == 0
    assert all(a.cls[r.value] == ROW for r in a.reductions)
    assert a.cls["g"] == COL and a.cls[y] == FULL
    # only h = x + r crosses the reductions; the input-only cache holds x and r
    assert cache_values(a, "boundary") == (h,)
    assert set(cache_values(a, "inputs")) == {"x", "r"}


def test_softmax_max_then_sum():
    b = GraphBuilder("sm")
    x = b.input("x", (64, 100))
    a = analyze(b.build([b.softmax(b.mul(x, 0.125))]))
    levels = {r.op: r.level for r in a.reductions}
    assert levels == {"reduce_max": 0, "reduce_sum": 1}
    scal = [v for v, k in a.classes if k == SCALAR]
    assert len(scal) == 1  # the 0.125 constant


def test_cross_entropy_gather_is_a_row_value():
    b = GraphBuilder("xent")
    x, lab = b.input("x", (16, 50)), b.input("label", (16, 1), "int64")
    m = b.reduce_max(x, axes=(1,), keepdims=True)
    lse = b.add(b.log(b.reduce_sum(b.exp(b.sub(x, m)), axes=(1,), keepdims=True)), m)
    pick = b.gather_elements(x, lab, axis=1)
    loss = b.sub(lse, pick)
    a = analyze(b.build([loss]))
    assert a.pattern == "row_reduce"
    assert a.cls["label"] == ROW and a.cls[pick] == ROW and a.cls[loss] == ROW
    assert a.dep[pick] == 0 and a.dep[loss] == 2


def test_transpose_input_is_read_transposed():
    b = GraphBuilder("tr")
    x, z = b.input("x", (40, 24)), b.input("z", (24, 40))
    y = b.add(b.transpose(x, perm=(1, 0)), z)
    a = analyze(b.build([y]))
    assert (a.pattern, a.R, a.C) == ("transpose", 24, 40)
    assert a.cls["x"] == TRANS and a.transposed_inputs == ("x",)


def test_column_reduction_and_consumer():
    b = GraphBuilder("cc")
    x = b.input("x", (30, 20))
    m = b.reduce_mean(x, axes=(0,), keepdims=True)
    y = b.sub(x, m)
    a = analyze(b.build([y]))
    assert (a.pattern, a.R, a.C) == ("col_reduce", 30, 20)
    assert a.reductions[0].axis == "col" and a.cls[m] == COL and a.dep[y] == 1


def test_layernorm_backward_is_multi():
    b = GraphBuilder("lnb")
    dy, x = b.input("dy", (8, 32)), b.input("x", (8, 32))
    mu, rs = b.input("mu", (8, 1)), b.input("rs", (8, 1))
    xh = b.mul(b.sub(x, mu), rs)
    dx = b.mul(rs, b.sub(dy, b.mul(xh, b.reduce_mean(b.mul(dy, xh), axes=(1,), keepdims=True))))
    a = analyze(b.build([dx, b.reduce_sum(b.mul(dy, xh), axes=(0,))]))
    assert a.pattern == "multi"
    assert sorted(r.axis for r in a.reductions) == ["col", "row"]
    assert a.cls["mu"] == ROW and a.cls["rs"] == ROW


def test_batched_bias_picks_a_wider_column_block():
    b = GraphBuilder("bb")
    x, bias = b.input("x", (4, 8, 16)), b.input("bias", (8, 16))
    a = analyze(b.build([b.add(x, bias)]))
    assert (a.R, a.C) == (4, 128) and a.cls["bias"] == COL


@pytest.mark.parametrize("build, why", [
    (lambda b: b.matmul(b.input("a", (8, 8)), b.input("w", (8, 8))), "matmul"),
    (lambda b: b.reduce_sum(b.input("a", (4, 6, 8)), axes=(0, 2)), "neither the trailing"),
    # a computed value read twice cannot move its transpose onto the input (sink_transposes)
    (lambda b: (lambda e: b.add(b.transpose(e, perm=(1, 0)), b.transpose(b.neg(e), perm=(1, 0))))(
        b.exp(b.input("a", (8, 4)))), "transposed"),
    (lambda b: b.reduce_sum(b.input("a", (8, 8), "int32"), axes=(1,)), "floating-point"),
])
def test_unsupported_subgraphs_say_why(build, why):
    b = GraphBuilder("bad")
    g = b.build([build(b)])
    with pytest.raises(UnsupportedFusion, match=why):
        analyze(g)
