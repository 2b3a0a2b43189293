"""Shape and dtype inference (tunedb.graph.ops): every op, error messages, property tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunedb.graph.ir import OP_SPECS, Graph, GraphError, Node, TensorType
from tunedb.graph.ops import (
    COMPUTE_OPS,
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    LAYOUT_OPS,
    OTHER_REDUCTIONS,
    REDUCTIONS,
    canonical_attrs,
    conv_out_dim,
    infer_graph,
    infer_node,
    is_elementwise,
    is_memory_bound,
    reduction_axes,
)


def T(*shape: int, dtype: str = "float32") -> TensorType:
    return TensorType(shape, dtype)


def infer(op: str, *types: TensorType, n_out: int = 1, **attrs) -> list[TensorType]:
    names = tuple("abcdefgh"[i] for i in range(len(types)))
    outs = ("h",) if n_out == 1 else tuple(f"h{i}" for i in range(n_out))
    return infer_node(Node(op, names, outs, attrs), list(types))


def one(op: str, *types: TensorType, **attrs) -> TensorType:
    (t,) = infer(op, *types, **attrs)
    return t


def test_categories_partition_the_op_table() -> None:
    groups = [ELEMENTWISE_UNARY, ELEMENTWISE_BINARY, REDUCTIONS, OTHER_REDUCTIONS, LAYOUT_OPS, COMPUTE_OPS]
    assert sum(len(g) for g in groups) == len(OP_SPECS)
    assert set().union(*groups) == set(OP_SPECS)
    assert is_elementwise("where") and is_elementwise("gelu") and not is_elementwise("reduce_sum")
    assert is_memory_bound("reduce_sum") and is_memory_bound("transpose")
    assert not is_memory_bound("matmul") and not is_memory_bound("conv2d")
    with pytest.raises(GraphError, match="unknown op 'nope'"):
        is_memory_bound("nope")


@pytest.mark.parametrize("op", sorted(ELEMENTWISE_UNARY - {"not", "cast", "clip"}))
def test_unary_keeps_shape_and_dtype(op: str) -> None:
    assert one(op, T(2, 3, dtype="float16")) == T(2, 3, dtype="float16")


def test_unary_dtype_rules() -> None:
    assert one("not", T(4, dtype="bool")) == T(4, dtype="bool")
    assert one("neg", T(4, dtype="int32")) == T(4, dtype="int32")
    assert one("cast", T(4), to="bfloat16") == T(4, dtype="bfloat16")
    assert one("identity", T(4, dtype="bool")) == T(4, dtype="bool")
    with pytest.raises(GraphError, match=r"exp 'h': input 'a' int64\[4\] has the wrong dtype"):
        one("exp", T(4, dtype="int64"))
    with pytest.raises(GraphError, match="needs bool"):
        one("not", T(4))
    with pytest.raises(GraphError, match="to='float64' is not a dtype"):
        one("cast", T(4), to="float64")
    with pytest.raises(GraphError, match="approximate='erf'"):
        one("gelu", T(4), approximate="erf")


def test_clip_canonicalises_infinite_bounds() -> None:
    n = Node("clip", ("x",), ("y",), {"min": float("-inf"), "max": 6})
    assert canonical_attrs(n, [T(3)]) == {"min": None, "max": 6.0}


@pytest.mark.parametrize("op", sorted(ELEMENTWISE_BINARY - {"where"}))
def test_binary_output_dtype(op: str) -> None:
    dtype = "bool" if op in ("and", "or") else "float32"
    out = one(op, T(8, 1, dtype=dtype), T(3, dtype=dtype))
    assert out.shape == (8, 3)
    assert out.dtype == ("bool" if op in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or") else "float32")


def test_binary_errors_name_op_inputs_shapes_dtypes() -> None:
    with pytest.raises(GraphError, match=r"^add 'h': cannot broadcast float32\[8,3\] with float32\[4\]"):
        one("add", T(8, 3), T(4))
    with pytest.raises(GraphError, match=r"mul 'h': dtype mismatch: 'a' float32\[2\] vs 'b' float16\[2\]"):
        one("mul", T(2), T(2, dtype="float16"))
    with pytest.raises(GraphError, match="dtype mismatch"):
        one("add", T(2), T(2, dtype="int32"))
    with pytest.raises(GraphError, match="needs bool"):
        one("and", T(2), T(2))
    with pytest.raises(GraphError, match="needs float"):
        one("pow", T(2, dtype="int32"), T(2, dtype="int32"))


def test_where() -> None:
    assert one("where", T(4, 1, dtype="bool"), T(5), T(1, 5)) == T(4, 5)
    with pytest.raises(GraphError, match="wrong dtype"):
        one("where", T(4), T(4), T(4))
    with pytest.raises(GraphError, match=r"cannot broadcast bool\[4\] with float32\[5\] with float32\[5\]"):
        one("where", T(4, dtype="bool"), T(5), T(5))


@given(st.lists(st.integers(1, 4), min_size=0, max_size=4),
       st.lists(st.integers(1, 4), min_size=0, max_size=4), st.sampled_from(["add", "lt", "max"]))
@settings(max_examples=200, deadline=None)
def test_broadcasting_matches_numpy(a: list[int], b: list[int], op: str) -> None:
    try:
        want = np.broadcast_shapes(tuple(a), tuple(b))
    except ValueError:
        with pytest.raises(GraphError, match="cannot broadcast"):
            one(op, T(*a), T(*b))
        return
    out = one(op, T(*a), T(*b))
    assert out.shape == want
    assert out.dtype == ("bool" if op == "lt" else "float32")


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(shape),
                            st.none() | st.sets(st.integers(-len(shape), len(shape) - 1), max_size=4),
                            st.booleans())))
@settings(max_examples=200, deadline=None)
def test_reductions_match_numpy(case: tuple) -> None:
    shape, axes, keepdims = case
    rank = len(shape)
    if axes is not None and len({a % rank for a in axes}) != len(axes):
        with pytest.raises(GraphError, match="repeated entries"):
            one("reduce_sum", T(*shape), axes=tuple(axes), keepdims=keepdims)
        return
    ax = None if axes is None else tuple(axes)
    want = np.sum(np.zeros(shape), axis=ax, keepdims=keepdims).shape
    assert one("reduce_sum", T(*shape), axes=ax, keepdims=keepdims).shape == want
    node = Node("reduce_max", ("x",), ("y",), {"axes": ax, "keepdims": keepdims})
    norm = tuple(range(rank)) if ax is None else tuple(sorted(a % rank for a in ax))
    assert canonical_attrs(node, [T(*shape)]) == {"axes": norm, "keepdims": keepdims}
    assert reduction_axes(node, T(*shape)) == norm


def test_reduction_errors_and_other_reductions() -> None:
    with pytest.raises(GraphError, match=r"axes 2 out of range for rank 2"):
        one("reduce_sum", T(2, 3), axes=(2,))
    with pytest.raises(GraphError, match="wrong dtype"):
        one("reduce_mean", T(2, dtype="int32"))
    with pytest.raises(GraphError, match="empty axis"):
        one("reduce_max", T(0, 3), axes=(0,))
    assert one("reduce_sum", T(2, 3, dtype="int32"), axes=(-1,)) == T(2, dtype="int32")
    assert one("argmax", T(2, 3, 4), axis=-2) == T(2, 4, dtype="int64")
    assert one("argmax", T(2, 3, 4), axis=1, keepdims=True) == T(2, 1, 4, dtype="int64")
    assert one("global_avg_pool", T(2, 8, 5, 5)) == T(2, 8, 1, 1)
    assert one("global_max_pool", T(2, 8, 7)) == T(2, 8, 1)
    assert reduction_axes(Node("global_avg_pool", ("x",), ("y",)), T(2, 8, 5, 5)) == (2, 3)
    with pytest.raises(GraphError, match="rank >= 3"):
        one("global_avg_pool", T(2, 8))


def test_unknown_op_arity_attrs() -> None:
    with pytest.raises(GraphError, match="unknown op 'frobnicate'"):
        infer_node(Node("frobnicate", ("a",), ("h",)), [T(2)])
    with pytest.raises(GraphError, match="takes 2 inputs, got 1"):
        one("add", T(2))
    with pytest.raises(GraphError, match="takes 2..3 inputs, got 4"):
        one("gemm", T(2, 2), T(2, 2), T(2), T(2))
    with pytest.raises(GraphError, match="unknown attribute.*axis; allowed: none"):
        one("relu", T(2), axis=1)
    with pytest.raises(GraphError, match="keepdims=2 must be a bool"):
        one("reduce_sum", T(2), keepdims=2)
    with pytest.raises(GraphError, match="has 1 output"):
        infer_node(Node("relu", ("a",), ("h", "i")), [T(2)])


def test_transpose_reshape_squeeze_unsqueeze() -> None:
    assert one("transpose", T(2, 3, 4)) == T(4, 3, 2)
    assert one("transpose", T(2, 3, 4), perm=(0, -1, 1)) == T(2, 4, 3)
    assert canonical_attrs(Node("transpose", ("x",), ("y",), {"perm": (0, -1, 1)}), [T(2, 3, 4)]) \
        == {"perm": (0, 2, 1)}
    with pytest.raises(GraphError, match="repeated entries in perm"):
        one("transpose", T(2, 3), perm=(0, 0))
    assert one("reshape", T(2, 3, 4), shape=(0, -1)) == T(2, 12)
    assert canonical_attrs(Node("reshape", ("x",), ("y",), {"shape": (-1, 4)}), [T(2, 3, 4)]) \
        == {"shape": (6, 4)}
    with pytest.raises(GraphError, match=r"cannot reshape 'a' float32\[2,3\] to \(4, 2\)"):
        one("reshape", T(2, 3), shape=(4, 2))
    with pytest.raises(GraphError, match="more than one -1"):
        one("reshape", T(2, 3), shape=(-1, -1))
    with pytest.raises(GraphError, match="cannot reshape"):
        one("reshape", T(2, 3), shape=(-1, 4))
    assert one("squeeze", T(1, 3, 1)) == T(3)
    assert one("squeeze", T(1, 3, 1), axes=(-1,)) == T(1, 3)
    with pytest.raises(GraphError, match="not of size 1"):
        one("squeeze", T(1, 3), axes=(1,))
    assert one("unsqueeze", T(3, 4), axes=(0, -1)) == T(1, 3, 4, 1)
    assert one("unsqueeze", T(3, 4), axes=(1,)) == T(3, 1, 4)
    assert np.expand_dims(np.zeros((3, 4)), (0, 3)).shape == one("unsqueeze", T(3, 4), axes=(0, 3)).shape


def test_expand_is_bidirectional_and_canonical() -> None:
    assert one("expand", T(3, 1), shape=(2, 1, 6)) == T(2, 3, 6)
    n = Node("expand", ("x",), ("y",), {"shape": (1, 6)})
    assert canonical_attrs(n, [T(3, 1)]) == {"shape": (3, 6)}
    with pytest.raises(GraphError, match=r"cannot expand 'a' float32\[3\] to shape \(4,\)"):
        one("expand", T(3), shape=(4,))


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ((1,), (3,), (), ()), ((-3,), (10**9,), (1,), ()), ((0, 1), (-1, 4), (0, 1), (2, 1)),
    ((-1,), (-(2**62),), (0,), (-1,)), ((5,), (1,), (1,), (-2,)), ((3,), (1,), (0,), (1,)),
    ((100,), (-100,), (-1,), (-3,)),
])
def test_slice_matches_python_slicing(starts, ends, axes, steps) -> None:
    x = np.zeros((5, 7))
    ax = axes or tuple(range(len(starts)))
    st_ = steps or (1,) * len(starts)
    index = [slice(None)] * 2
    for a, s, e, k in zip(ax, starts, ends, st_):
        dim = x.shape[a]
        # ONNX clamps; Python slices clamp the same way once ends below -dim mean "before 0"
        e = None if (k < 0 and e < -dim) else e
        index[a] = slice(s, e, k)
    out = one("slice", T(5, 7), starts=starts, ends=ends, axes=axes, steps=steps)
    assert out.shape == x[tuple(index)].shape
    canon = canonical_attrs(Node("slice", ("x",), ("y",), {"starts": starts, "ends": ends,
                                                             "axes": axes, "steps": steps}), [T(5, 7)])
    again = canonical_attrs(Node("slice", ("x",), ("y",), canon), [T(5, 7)])
    assert canon == again


def test_slice_errors() -> None:
    with pytest.raises(GraphError, match="steps must not be 0"):
        one("slice", T(4), starts=(0,), ends=(4,), steps=(0,))
    with pytest.raises(GraphError, match="must have 1 entries"):
        one("slice", T(4), starts=(0,), ends=(4, 4))


def test_concat_split_pad() -> None:
    assert one("concat", T(2, 3), T(2, 5), T(2, 1), axis=-1) == T(2, 9)
    msg = r"cannot concat 'a' float32\[2,3\] with 'b' float32\[3,3\] on axis 1"
    with pytest.raises(GraphError, match=msg):
        one("concat", T(2, 3), T(3, 3), axis=1)
    assert infer("split", T(6, 4), n_out=3, axis=0, sizes=(1, 2, 3)) == [T(1, 4), T(2, 4), T(3, 4)]
    assert infer("split", T(6, 4), n_out=2, axis=-1) == [T(6, 2), T(6, 2)]
    with pytest.raises(GraphError, match="do not add up"):
        infer("split", T(6, 4), n_out=2, sizes=(1, 2))
    with pytest.raises(GraphError, match="2 sizes but 3 outputs"):
        infer("split", T(6, 4), n_out=3, sizes=(3, 3))
    assert one("pad", T(2, 3), pads=(1, 0, 2, 4)) == T(5, 7)
    assert one("pad", T(4, 3), pads=(-1, 0, 0, 1)) == T(3, 4)
    with pytest.raises(GraphError, match="must have 4 entries"):
        one("pad", T(2, 3), pads=(1, 1))


def test_gather_and_gather_elements() -> None:
    i64 = "int64"
    assert one("gather", T(10, 4), T(2, 3, dtype=i64), axis=0) == T(2, 3, 4)
    assert one("gather", T(10, 4), T(dtype="int32"), axis=1) == T(10)
    assert np.take(np.zeros((10, 4)), np.zeros((2, 3), int), axis=1).shape == \
        one("gather", T(10, 4), T(2, 3, dtype=i64), axis=1).shape
    with pytest.raises(GraphError, match="wrong dtype"):
        one("gather", T(10, 4), T(2))
    assert one("gather_elements", T(4, 5), T(4, 2, dtype=i64), axis=1) == T(4, 2)
    assert one("gather_elements", T(4, 5), T(3, 2, dtype=i64), axis=1) == T(3, 2)
    with pytest.raises(GraphError, match="do not fit data"):
        one("gather_elements", T(4, 5), T(5, 2, dtype=i64), axis=1)


@pytest.mark.parametrize("a,b", [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)),
                                 ((2, 1, 3, 4), (5, 4, 6)), ((7, 3, 4), (4, 2))])
def test_matmul_matches_numpy(a, b) -> None:
    assert one("matmul", T(*a), T(*b)).shape == np.matmul(np.zeros(a), np.zeros(b)).shape


def test_matmul_and_gemm_errors() -> None:
    with pytest.raises(GraphError, match=r"cannot matmul 'a' float32\[3,4\] with 'b' float32\[5,6\]"):
        one("matmul", T(3, 4), T(5, 6))
    with pytest.raises(GraphError, match="cannot matmul"):
        one("matmul", T(2, 3, 4), T(3, 4, 5))
    assert one("gemm", T(4, 3), T(5, 4), T(5), trans_a=True, trans_b=True) == T(3, 5)
    assert one("gemm", T(3, 4), T(4, 5), T(3, 1)) == T(3, 5)
    with pytest.raises(GraphError, match="does not broadcast"):
        one("gemm", T(3, 4), T(4, 5), T(3))
    with pytest.raises(GraphError, match="cannot gemm"):
        one("gemm", T(3, 4), T(5, 4))
    with pytest.raises(GraphError, match="rank 2"):
        one("gemm", T(3, 4, 1), T(4, 5))


def test_conv2d() -> None:
    assert one("conv2d", T(1, 64, 56, 56), T(64, 64, 3, 3), T(64), pads=(1, 1, 1, 1)) == T(1, 64, 56, 56)
    assert one("conv2d", T(2, 3, 224, 224), T(64, 3, 7, 7), strides=(2, 2), pads=(3, 3, 3, 3)) \
        == T(2, 64, 112, 112)
    assert one("conv2d", T(1, 32, 10, 10), T(32, 1, 3, 3), groups=32, dilations=(2, 2)) == T(1, 32, 6, 6)
    # asymmetric pads in ONNX order (top, left, bottom, right)
    assert one("conv2d", T(1, 1, 5, 5), T(1, 1, 3, 3), pads=(0, 2, 0, 0)) == T(1, 1, 3, 5)
    with pytest.raises(GraphError, match="do not fit input .* groups=2"):
        one("conv2d", T(1, 6, 8, 8), T(4, 6, 3, 3), groups=2)
    with pytest.raises(GraphError, match=r"bias 'c' float32\[3\] must have shape \[4\]"):
        one("conv2d", T(1, 6, 8, 8), T(4, 6, 3, 3), T(3))
    with pytest.raises(GraphError, match="does not fit"):
        one("conv2d", T(1, 1, 2, 2), T(1, 1, 3, 3))
    with pytest.raises(GraphError, match="strides=.* must be >= 1"):
        one("conv2d", T(1, 1, 5, 5), T(1, 1, 3, 3), strides=(0, 1))


def test_pools_and_ceil_mode() -> None:
    assert one("max_pool2d", T(1, 64, 112, 112), kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)) \
        == T(1, 64, 56, 56)
    assert one("max_pool2d", T(1, 1, 6, 6), kernel=(3, 3), strides=(2, 2)) == T(1, 1, 2, 2)
    assert one("max_pool2d", T(1, 1, 6, 6), kernel=(3, 3), strides=(2, 2), ceil_mode=True) == T(1, 1, 3, 3)
    assert one("avg_pool2d", T(1, 1, 35, 35), kernel=(3, 3), strides=(2, 2), ceil_mode=True) \
        == T(1, 1, 17, 17)
    # ceil mode never starts a window in the trailing padding
    assert conv_out_dim(5, 2, 2, 1, 1, 1, ceil=True) == 3
    with pytest.raises(GraphError, match="smaller than the kernel"):
        one("max_pool2d", T(1, 1, 6, 6), kernel=(2, 2), pads=(2, 0, 0, 0))
    with pytest.raises(GraphError, match="unknown attribute.*dilations"):
        one("avg_pool2d", T(1, 1, 6, 6), kernel=(2, 2), dilations=(1, 1))


def graph(nodes, inputs=("x",), outputs=("y",), types=None) -> Graph:
    return Graph(inputs, outputs, nodes, types if types is not None else {"x": T(2, 3)})


def test_infer_graph_fills_and_validates() -> None:
    g = infer_graph(graph([Node("exp", ("x",), ("t",)), Node("reduce_sum", ("t",), ("y",), {"axes": (1,)})]))
    assert g.type_map == {"x": T(2, 3), "t": T(2, 3), "y": T(2)}
    with pytest.raises(GraphError, match="topological order"):
        infer_graph(graph([Node("exp", ("t",), ("y",)), Node("exp", ("x",), ("t",))]))
    with pytest.raises(GraphError, match="'z' is not defined"):
        infer_graph(graph([Node("add", ("x", "z"), ("y",))]))
    with pytest.raises(GraphError, match="'x' is defined more than once"):
        infer_graph(graph([Node("exp", ("x",), ("x",))], outputs=("x",)))
    with pytest.raises(GraphError, match="graph output 'q' is not defined"):
        infer_graph(graph([Node("exp", ("x",), ("y",))], outputs=("q",)))
    with pytest.raises(GraphError, match="graph input 'x' has no type"):
        infer_graph(graph([Node("exp", ("x",), ("y",))], types={}))
    with pytest.raises(GraphError, match=r"stored type float32\[9\] but exp node gives float32\[2,3\]"):
        infer_graph(graph([Node("exp", ("x",), ("y",))], types={"x": T(2, 3), "y": T(9)}))
