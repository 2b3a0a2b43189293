"""GraphBuilder: API, naming, errors at the call, composites, dead-node removal, JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tunedb.graph import GraphBuilder, GraphError, run_reference
from tunedb.graph.ir import OP_SPECS, Graph, TensorType
from tunedb.records import canonical_json


def test_every_op_has_a_method() -> None:
    for op in OP_SPECS:
        name = op + "_" if op in ("not", "and", "or") else op
        assert callable(getattr(GraphBuilder, name)), op
    b = GraphBuilder()
    p = b.input("p", (3,), "bool")
    q = b.input("q", (3,), "bool")
    assert b.type_of(b.not_(b.and_(p, b.or_(p, q)))) == TensorType((3,), "bool")


def test_auto_names_are_unique_and_skip_taken_names() -> None:
    b = GraphBuilder("g")
    x = b.input("v1", (4,), "float32")
    a = b.exp(x)
    c = b.exp(a)
    d = b.neg(c, name="out")
    assert (a, c, d) == ("v0", "v2", "out")
    with pytest.raises(GraphError, match="value 'out' is already defined"):
        b.exp(x, name="out")
    with pytest.raises(GraphError, match="value 'nope' is not defined"):
        b.exp("nope")


def test_errors_surface_at_the_call_and_define_nothing() -> None:
    b = GraphBuilder()
    x = b.input("x", (8, 3), "float32")
    y = b.input("y", (4,), "float32")
    before = dict(b._types)
    with pytest.raises(GraphError, match=r"^add 'h': cannot broadcast float32\[8,3\] with float32\[4\]"):
        b.add(x, y, name="h")
    assert b._types == before
    with pytest.raises(GraphError, match="unknown op 'conv3d'"):
        b.op("conv3d", x)


def test_attributes_are_stored_canonically() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4), "float32")
    r = b.reduce_sum(x, axes=-1)
    t = b.transpose(x)
    s = b.reshape(x, shape=(0, -1))
    g = b.build([r, t, s])
    attrs = {n.op: n.attr_dict for n in g.nodes}
    assert attrs["reduce_sum"] == {"axes": (2,), "keepdims": False}
    assert attrs["transpose"] == {"perm": (2, 1, 0)}
    assert attrs["reshape"] == {"shape": (2, 12)}


def test_split_returns_tuple_and_scalars_become_constants() -> None:
    b = GraphBuilder()
    x = b.input("x", (6, 4), "float16")
    parts = b.split(x, axis=0, sizes=(1, 2, 3))
    assert isinstance(parts, tuple) and [b.type_of(p).shape for p in parts] == [(1, 4), (2, 4), (3, 4)]
    halves = b.split(x, axis=1, num_outputs=2, name=("lo", "hi"))
    assert halves == ("lo", "hi")
    with pytest.raises(GraphError, match="sizes=... or num_outputs"):
        b.split(x)
    y = b.mul(x, 0.125)
    assert b.type_of(y) == TensorType((6, 4), "float16")
    m = b.where(b.gt(x, 0.0), x, 0.0)
    g = b.build([y, m])
    consts = g.constant_map
    assert {c.type for c in consts.values()} == {TensorType((), "float16")}
    assert sorted(float(c.array) for c in consts.values()) == [0.0, 0.0, 0.125]


def test_build_drops_dead_nodes_and_constants_but_keeps_inputs() -> None:
    b = GraphBuilder()
    x = b.input("x", (4,), "float32")
    b.input("unused", (2,), "float32")
    dead = b.exp(b.add(x, 2.0))
    live = b.neg(x)
    g = b.build([live])
    assert [n.op for n in g.nodes] == ["neg"]
    assert g.inputs == ("x", "unused") and g.constants == ()
    assert dead not in g.type_map and set(g.type_map) == {"x", "unused", live}


def test_json_round_trip_of_a_built_graph() -> None:
    b = GraphBuilder("blk")
    x = b.input("x", (2, 8), "bfloat16")
    w = b.constant(np.arange(16, dtype=np.float32).reshape(8, 2) / 7, dtype="bfloat16")
    y = b.layernorm(b.matmul(x, w), None, None)
    g = b.build([y, b.argmax(y, axis=1)])
    text = canonical_json(g.to_json())
    again = Graph.from_json(json.loads(text))
    assert again == g
    assert canonical_json(again.to_json()) == text


def _ref(graph: Graph, **inputs: np.ndarray) -> dict:
    return run_reference(graph, inputs)


def test_softmax_and_log_softmax() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 5), "float32")
    g = b.build([b.softmax(x), b.log_softmax(x, axis=0)])
    xv = np.random.default_rng(0).normal(size=(3, 5)) * 30
    s, ls = _ref(g, x=xv).values()
    e = np.exp(xv - xv.max(-1, keepdims=True))
    np.testing.assert_allclose(s, e / e.sum(-1, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(s.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(np.exp(ls).sum(0), 1.0, rtol=1e-13)


def test_layernorm_rmsnorm_batchnorm() -> None:
    rng = np.random.default_rng(1)
    b = GraphBuilder()
    x = b.input("x", (4, 6, 8), "float32")
    sc = b.input("s", (8,), "float32")
    bi = b.input("b", (8,), "float32")
    ln = b.layernorm(x, sc, bi, eps=1e-5, name="ln")
    ln2 = b.layernorm(x, None, None, axis=1)
    rms = b.rmsnorm(x, sc, name="rms")
    g = b.build([ln, ln2, rms])
    assert g.outputs[0] == "ln" and g.outputs[2] == "rms"
    xv, sv, bv = rng.normal(size=(4, 6, 8)) * 3 + 1, rng.normal(size=8), rng.normal(size=8)
    out = _ref(g, x=xv, s=sv, b=bv)
    mu, var = xv.mean(-1, keepdims=True), xv.var(-1, keepdims=True)
    np.testing.assert_allclose(out["ln"], (xv - mu) / np.sqrt(var + 1e-5) * sv + bv, rtol=1e-12, atol=1e-12)
    plain = out[ln2]
    np.testing.assert_allclose(plain.mean(axis=(1, 2)), 0.0, atol=1e-13)
    np.testing.assert_allclose(plain.var(axis=(1, 2)), 1.0, rtol=1e-4)
    want = xv / np.sqrt((xv ** 2).mean(-1, keepdims=True) + 1e-6) * sv
    np.testing.assert_allclose(out["rms"], want, rtol=1e-12)

    b = GraphBuilder()
    x = b.input("x", (2, 3, 4, 5), "float32")
    p = {k: b.input(k, (3,), "float32") for k in ("g", "be", "m", "v")}
    g = b.build([b.batchnorm(x, p["g"], p["be"], p["m"], p["v"], eps=1e-3)])
    xv = rng.normal(size=(2, 3, 4, 5))
    pv = {k: rng.uniform(0.5, 2, size=3) for k in p}
    (y,) = _ref(g, x=xv, **pv).values()
    c = (slice(None), None, None)
    eps = float(np.float32(1e-3))  # the eps constant has the graph's dtype, float32
    want = (xv - pv["m"][c]) / np.sqrt(pv["v"][c] + eps) * pv["g"][c] + pv["be"][c]
    np.testing.assert_allclose(y, want, rtol=1e-12)


def test_gelu_stays_primitive() -> None:
    b = GraphBuilder()
    x = b.input("x", (4,), "float32")
    g = b.build([b.gelu(x, approximate="tanh")])
    assert [n.op for n in g.nodes] == ["gelu"] and g.nodes[0].attr("approximate") == "tanh"


def test_round_trip_of_a_graph_using_many_ops() -> None:
    b = GraphBuilder("cnn")
    x = b.input("x", (1, 4, 9, 9), "float16")
    w = b.constant(np.linspace(-1, 1, 4 * 2 * 9, dtype=np.float32).reshape(4, 2, 3, 3), dtype="float16")
    y = b.conv2d(x, w, strides=(2, 1), pads=(1, 0, 1, 2), groups=2)
    y = b.max_pool2d(b.clip(y, min=0.0, max=6.0), kernel=(2, 2), strides=(2, 2), ceil_mode=True)
    a, c = b.split(y, axis=1, sizes=(1, 3))
    s = b.slice(c, starts=(-1,), ends=(-100,), axes=(1,), steps=(-1,))
    p = b.pad(a, pads=(0, 0, 1, 0, 0, 0, 0, 1))
    idx = b.constant(np.array([2, 0], np.int64))
    out = b.gather(b.cast(b.global_avg_pool(s), to="float32"), idx, axis=1)
    g = b.build([out, p])
    again = Graph.from_json(json.loads(canonical_json(g.to_json())))
    assert again == g
    xv = np.random.default_rng(0).normal(size=(1, 4, 9, 9)).astype(np.float16)
    r1, r2 = run_reference(g, {"x": xv}), run_reference(again, {"x": xv})
    for k in g.outputs:
        np.testing.assert_array_equal(r1[k], r2[k])
    assert r1[out].shape == (1, 2, 1, 1)


def test_none_attributes_take_defaults_and_duplicate_names_fail() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 6), "float32")
    s = b.slice(x, starts=(1,), ends=(3,), axes=None, steps=None)
    assert b.type_of(s).shape == (2, 6)
    with pytest.raises(GraphError, match="distinct output names"):
        b.split(x, axis=1, num_outputs=2, name=("a", "a"))


def test_floor_bytes_counts_each_value_once():
    b = GraphBuilder("passthrough")
    x = b.input("x", (4, 8), "float32")
    y = b.relu(x)
    g = b.build([y, y, x])
    # x is read once and, passed through as an output, need not be written: 128 + 128
    assert g.io_bytes() == (128, 256)
    assert g.floor_bytes() == 256
    h = b.build([y])
    assert h.floor_bytes() == sum(h.io_bytes()) == 256
