"""Op translations of the peer executors (``tunedb.bench.peers``): one table entry per op.

``TORCH_OPS[op](torch, node, args, attrs, graph)`` and ``JAX_OPS[op](jnp, jax, node, args, attrs,
graph)`` compute one node of a tunedb Graph with the reference interpreter's semantics
(``tunedb.graph.reference``); ``attrs`` are the node's canonical attributes. The tables are plain
dicts so that a CPU test can check that every op of a graph has both translations without
importing either framework.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import check_node, conv_out_dim, slice_bounds

TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "int32": "int32", "int64": "int64", "bool": "bool"}


def canonical(node: Node, graph: Graph) -> dict[str, Any]:
    return check_node(node, [graph.type_of(v) for v in node.inputs])[1]


def _out_shape(node: Node, graph: Graph) -> tuple[int, ...]:
    return graph.type_of(node.outputs[0]).shape


def _bounds(x: Any, a: dict) -> list[tuple[int, int, int, int]]:
    """(axis, start, end (-1: before index 0), step) per sliced axis."""
    dims = [x.shape[i] for i in a["axes"]]
    return [(ax, s, e, st) for ax, (s, e, _), st in
            zip(a["axes"], slice_bounds(dims, a["starts"], a["ends"], a["steps"]), a["steps"])]


def _pool_geometry(x_shape: tuple[int, ...], a: dict) -> tuple[int, int, int, int]:
    """Output size and the extra trailing padding a ceil-mode window reaches past."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
    dh, dw = a.get("dilations", (1, 1))
    h, w = x_shape[2], x_shape[3]
    oh = conv_out_dim(h, kh, sh, pt, pb, dh, a["ceil_mode"])
    ow = conv_out_dim(w, kw, sw, pl, pr, dw, a["ceil_mode"])
    extra_h = max(0, (oh - 1) * sh + dh * (kh - 1) + 1 - (h + pt + pb))
    extra_w = max(0, (ow - 1) * sw + dw * (kw - 1) + 1 - (w + pl + pr))
    return oh, ow, extra_h, extra_w


# -- torch ----------------------------------------------------------------------------------------
TorchFn = Callable[[Any, Node, list, dict, Graph], Any]


def _t_unary(name: str) -> TorchFn:
    return lambda t, n, x, a, g: getattr(t, name)(x[0])


def _t_binary(name: str) -> TorchFn:
    return lambda t, n, x, a, g: getattr(t, name)(x[0], x[1])


def _t_round(name: str) -> TorchFn:
    return lambda t, n, x, a, g: getattr(t, name)(x[0]) if x[0].is_floating_point() else x[0]


def _t_div(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    if x[0].is_floating_point():
        return t.div(x[0], x[1])
    return t.div(x[0], x[1], rounding_mode="trunc")  # C / ONNX integer division


def _t_clip(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    lo, hi = a["min"], a["max"]
    if not x[0].is_floating_point():
        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
    return x[0] if lo is None and hi is None else t.clamp(x[0], lo, hi)


def _t_reduce(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    dims, keep, v = tuple(a["axes"]), bool(a["keepdims"]), x[0]
    if n.op == "reduce_prod":  # torch.prod takes one dim at a time
        for d in sorted(dims, reverse=True):
            v = t.prod(v, dim=d, keepdim=keep)
        return v
    fn = {"reduce_sum": t.sum, "reduce_mean": t.mean, "reduce_max": t.amax, "reduce_min": t.amin}[n.op]
    return fn(v, dim=dims, keepdim=keep) if dims else v


def _t_slice(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    v = x[0]
    for ax, s, e, st in _bounds(v, a):
        if st > 0:
            v = v[(slice(None),) * ax + (slice(s, e, st),)]
        else:  # torch slicing has no negative steps
            v = t.index_select(v, ax, t.arange(s, e, st, device=v.device))
    return v


def _t_pad(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    r, pads = x[0].dim(), a["pads"]
    spec: list[int] = []
    for i in reversed(range(r)):  # torch: last dim first, (before, after) pairs; negative crops
        spec += [pads[i], pads[i + r]]
    return t.nn.functional.pad(x[0], spec, value=a["value"])


def _t_gemm(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    A = x[0].t() if a["trans_a"] else x[0]
    B = x[1].t() if a["trans_b"] else x[1]
    y = t.matmul(A, B)
    if a["alpha"] != 1.0:
        y = y * a["alpha"]
    if len(x) == 3:
        y = y + (x[2] if a["beta"] == 1.0 else x[2] * a["beta"])
    return y


def _t_conv(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    F = t.nn.functional
    v = x[0]
    pt, pl, pb, pr = a["pads"]
    pad: Any = (pt, pl)
    if (pt, pl) != (pb, pr):
        v, pad = F.pad(v, (pl, pr, pt, pb)), 0
    return F.conv2d(v, x[1], x[2] if len(x) == 3 else None, tuple(a["strides"]), pad,
                    tuple(a["dilations"]), a["groups"])


def _t_pool(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    F = t.nn.functional
    v = x[0]
    k, s = tuple(a["kernel"]), tuple(a["strides"])
    pt, pl, pb, pr = a["pads"]
    oh, ow = _out_shape(n, g)[2:]
    simple = (pt, pl) == (pb, pr) and 2 * pt <= k[0] and 2 * pl <= k[1]
    if n.op == "max_pool2d":
        if simple:
            return F.max_pool2d(v, k, s, (pt, pl), tuple(a["dilations"]), a["ceil_mode"])
        low = -math.inf if v.is_floating_point() else t.iinfo(v.dtype).min
        padded = F.pad(v, (pl, pr, pt, pb), value=low)
        y = F.max_pool2d(padded, k, s, 0, tuple(a["dilations"]), a["ceil_mode"])
        return y[..., :oh, :ow]
    if simple:
        return F.avg_pool2d(v, k, s, (pt, pl), a["ceil_mode"], a["count_include_pad"])
    # Window sums over the explicitly padded input, divided by the reference's element count.
    total = F.avg_pool2d(F.pad(v, (pl, pr, pt, pb)), k, s, 0, a["ceil_mode"], True, divisor_override=1)
    ones = t.ones((1, 1) + tuple(v.shape[2:]), dtype=v.dtype, device=v.device)
    ones = F.pad(ones, (pl, pr, pt, pb), value=1.0 if a["count_include_pad"] else 0.0)
    count = F.avg_pool2d(ones, k, s, 0, a["ceil_mode"], True, divisor_override=1)
    return (total / count)[..., :oh, :ow]


def _t_global(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    dims = tuple(range(2, x[0].dim()))
    return (t.mean if n.op == "global_avg_pool" else t.amax)(x[0], dim=dims, keepdim=True)


def _t_argmax(t: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    return t.argmax(x[0], dim=a["axis"], keepdim=bool(a["keepdims"]))


TORCH_OPS: dict[str, TorchFn] = {
    **{op: _t_unary(name) for op, name in (
        ("neg", "neg"), ("abs", "abs"), ("exp", "exp"), ("log", "log"), ("sqrt", "sqrt"),
        ("rsqrt", "rsqrt"), ("reciprocal", "reciprocal"), ("sin", "sin"), ("cos", "cos"),
        ("tanh", "tanh"), ("sigmoid", "sigmoid"), ("relu", "relu"), ("erf", "erf"),
        ("sign", "sign"), ("not", "logical_not"))},
    "floor": _t_round("floor"), "ceil": _t_round("ceil"),
    "identity": lambda t, n, x, a, g: x[0],
    "gelu": lambda t, n, x, a, g: t.nn.functional.gelu(x[0], approximate=a["approximate"]),
    "clip": _t_clip,
    "cast": lambda t, n, x, a, g: x[0].to(getattr(t, TORCH_DTYPES[a["to"]])),
    "leaky_relu": lambda t, n, x, a, g: t.nn.functional.leaky_relu(x[0], a["alpha"]),
    **{op: _t_binary(name) for op, name in (
        ("add", "add"), ("sub", "sub"), ("mul", "mul"), ("pow", "pow"), ("max", "maximum"),
        ("min", "minimum"), ("mod", "remainder"), ("eq", "eq"), ("ne", "ne"), ("lt", "lt"),
        ("le", "le"), ("gt", "gt"), ("ge", "ge"), ("and", "logical_and"), ("or", "logical_or"))},
    "div": _t_div,
    "where": lambda t, n, x, a, g: t.where(x[0], x[1], x[2]),
    **{op: _t_reduce for op in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod")},
    "argmax": _t_argmax,
    "transpose": lambda t, n, x, a, g: x[0].permute(*a["perm"]),
    "reshape": lambda t, n, x, a, g: x[0].reshape(_out_shape(n, g)),
    "squeeze": lambda t, n, x, a, g: x[0].reshape(_out_shape(n, g)),
    "unsqueeze": lambda t, n, x, a, g: x[0].reshape(_out_shape(n, g)),
    "expand": lambda t, n, x, a, g: x[0].expand(*_out_shape(n, g)),
    "slice": _t_slice,
    "concat": lambda t, n, x, a, g: t.cat(list(x), dim=a["axis"]),
    "split": lambda t, n, x, a, g: tuple(t.split(x[0], list(a["sizes"]), dim=a["axis"])),
    "pad": _t_pad,
    "gather": lambda t, n, x, a, g: t.index_select(x[0], a["axis"], x[1].reshape(-1)).reshape(
        _out_shape(n, g)),
    # torch.gather takes int64 indices only
    "gather_elements": lambda t, n, x, a, g: t.gather(x[0], a["axis"], x[1].long()),
    "matmul": lambda t, n, x, a, g: t.matmul(x[0], x[1]),
    "gemm": _t_gemm,
    "conv2d": _t_conv,
    "max_pool2d": _t_pool, "avg_pool2d": _t_pool,
    "global_avg_pool": _t_global, "global_max_pool": _t_global,
}


def torch_op(torch: Any, node: Node, args: list[Any], graph: Graph) -> Any:
    fn = TORCH_OPS.get(node.op)
    if fn is None:
        raise NotImplementedError(f"torch peer has no translation for op {node.op!r}")
    return fn(torch, node, args, canonical(node, graph), graph)


# -- JAX ------------------------------------------------------------------------------------------
JaxFn = Callable[[Any, Any, Node, list, dict, Graph], Any]


def _j_unary(name: str) -> JaxFn:
    return lambda jnp, jax, n, x, a, g: getattr(jnp, name)(x[0])


def _j_binary(name: str) -> JaxFn:
    return lambda jnp, jax, n, x, a, g: getattr(jnp, name)(x[0], x[1])


def _j_int_aware(float_name: str, int_fn: Callable[[Any, Any, Any], Any]) -> JaxFn:
    def fn(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
        if jnp.issubdtype(x[0].dtype, jnp.floating):
            return getattr(jnp, float_name)(x[0], x[1])
        return int_fn(jax, x[0], x[1])
    return fn


def _j_round(name: str) -> JaxFn:
    return lambda jnp, jax, n, x, a, g: getattr(jnp, name)(x[0]) if jnp.issubdtype(
        x[0].dtype, jnp.floating) else x[0]


def _j_clip(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    lo, hi = a["min"], a["max"]
    if not jnp.issubdtype(x[0].dtype, jnp.floating):
        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
    return x[0] if lo is None and hi is None else jnp.clip(x[0], lo, hi)


def _j_reduce(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    axes, keep, v = tuple(a["axes"]), bool(a["keepdims"]), x[0]
    fn = {"reduce_sum": jnp.sum, "reduce_mean": jnp.mean, "reduce_max": jnp.max,
          "reduce_min": jnp.min, "reduce_prod": jnp.prod}[n.op]
    if n.op in ("reduce_sum", "reduce_mean") and v.dtype in (jnp.float16, jnp.bfloat16):
        return fn(v, axis=axes, keepdims=keep, dtype=jnp.float32).astype(v.dtype)
    return fn(v, axis=axes, keepdims=keep)


def _j_slice(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    index: list[Any] = [slice(None)] * x[0].ndim
    for ax, s, e, st in _bounds(x[0], a):
        index[ax] = slice(s, e if e >= 0 else None, st)
    return x[0][tuple(index)]


def _j_split(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    cuts, at = [], 0
    for s in a["sizes"][:-1]:
        at += s
        cuts.append(at)
    return tuple(jnp.split(x[0], cuts, axis=a["axis"]))


def _j_pad(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    r, pads = x[0].ndim, a["pads"]
    value = jnp.asarray(a["value"], dtype=x[0].dtype)
    return jax.lax.pad(x[0], value, [(pads[i], pads[i + r], 0) for i in range(r)])  # negative crops


def _precision(jnp: Any, jax: Any, v: Any) -> Any:
    # float32 stays float32 (no TF32), as tunedb's GEMMs and torch with allow_tf32 = False
    return jax.lax.Precision.HIGHEST if v.dtype == jnp.float32 else None


def _j_gemm(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    A = x[0].T if a["trans_a"] else x[0]
    B = x[1].T if a["trans_b"] else x[1]
    y = jnp.matmul(A, B, precision=_precision(jnp, jax, A))
    if a["alpha"] != 1.0:
        y = y * a["alpha"]
    if len(x) == 3:
        y = y + (x[2] if a["beta"] == 1.0 else x[2] * a["beta"])
    return y


def _j_conv(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    pt, pl, pb, pr = a["pads"]
    y = jax.lax.conv_general_dilated(
        x[0], x[1], window_strides=tuple(a["strides"]), padding=[(pt, pb), (pl, pr)],
        rhs_dilation=tuple(a["dilations"]), dimension_numbers=("NCHW", "OIHW", "NCHW"),
        feature_group_count=a["groups"], precision=_precision(jnp, jax, x[0]))
    return y + x[2].reshape(1, -1, 1, 1) if len(x) == 3 else y


def _j_pool(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    lax, v = jax.lax, x[0]
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
    dil = (1, 1) + tuple(a.get("dilations", (1, 1)))
    oh, ow, eh, ew = _pool_geometry(tuple(v.shape), a)
    win, strides = (1, 1, kh, kw), (1, 1, sh, sw)
    padding = ((0, 0), (0, 0), (pt, pb + eh), (pl, pr + ew))
    if n.op == "max_pool2d":
        low = -jnp.inf if jnp.issubdtype(v.dtype, jnp.floating) else jnp.iinfo(v.dtype).min
        init = jnp.asarray(low, v.dtype)
        y = lax.reduce_window(v, init, lax.max, win, strides, padding, window_dilation=dil)
        return y[..., :oh, :ow]
    zero = jnp.asarray(0, v.dtype)
    total = lax.reduce_window(v, zero, lax.add, win, strides, padding)
    ones = jnp.ones((1, 1) + tuple(v.shape[2:]), v.dtype)
    if a["count_include_pad"]:  # the declared padding counts, a ceil-mode overhang does not
        ones = jnp.pad(ones, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=1)
        cpad = ((0, 0), (0, 0), (0, eh), (0, ew))
    else:
        cpad = padding
    count = lax.reduce_window(ones, zero, lax.add, win, strides, cpad)
    return (total / count)[..., :oh, :ow]


def _spatial(v: Any) -> tuple[int, ...]:
    return tuple(range(2, v.ndim))


def _j_argmax(jnp: Any, jax: Any, n: Node, x: list, a: dict, g: Graph) -> Any:
    y = jnp.argmax(x[0], axis=a["axis"]).astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    return jnp.expand_dims(y, a["axis"]) if a["keepdims"] else y


JAX_OPS: dict[str, JaxFn] = {
    **{op: _j_unary(name) for op, name in (
        ("neg", "negative"), ("abs", "abs"), ("exp", "exp"), ("log", "log"), ("sqrt", "sqrt"),
        ("reciprocal", "reciprocal"), ("sin", "sin"), ("cos", "cos"), ("tanh", "tanh"),
        ("sign", "sign"), ("not", "logical_not"))},
    "rsqrt": lambda jnp, jax, n, x, a, g: jax.lax.rsqrt(x[0]),
    "sigmoid": lambda jnp, jax, n, x, a, g: jax.nn.sigmoid(x[0]),
    "relu": lambda jnp, jax, n, x, a, g: jax.nn.relu(x[0]),
    "erf": lambda jnp, jax, n, x, a, g: jax.scipy.special.erf(x[0]),
    "floor": _j_round("floor"), "ceil": _j_round("ceil"),
    "identity": lambda jnp, jax, n, x, a, g: x[0],
    "gelu": lambda jnp, jax, n, x, a, g: jax.nn.gelu(x[0], approximate=a["approximate"] == "tanh"),
    "clip": _j_clip,
    "cast": lambda jnp, jax, n, x, a, g: x[0].astype(jnp.dtype(a["to"])),
    "leaky_relu": lambda jnp, jax, n, x, a, g: jax.nn.leaky_relu(x[0], a["alpha"]),
    **{op: _j_binary(name) for op, name in (
        ("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("pow", "power"),
        ("max", "maximum"), ("min", "minimum"), ("eq", "equal"), ("ne", "not_equal"),
        ("lt", "less"), ("le", "less_equal"), ("gt", "greater"), ("ge", "greater_equal"),
        ("and", "logical_and"), ("or", "logical_or"))},
    "div": _j_int_aware("divide", lambda jax, p, q: jax.lax.div(p, q)),  # ints truncate, like C
    "mod": _j_binary("remainder"),  # floored, the sign of the divisor (the reference's mod)
    "where": lambda jnp, jax, n, x, a, g: jnp.where(x[0], x[1], x[2]),
    **{op: _j_reduce for op in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod")},
    "argmax": _j_argmax,
    "transpose": lambda jnp, jax, n, x, a, g: jnp.transpose(x[0], a["perm"]),
    "reshape": lambda jnp, jax, n, x, a, g: jnp.reshape(x[0], _out_shape(n, g)),
    "squeeze": lambda jnp, jax, n, x, a, g: jnp.reshape(x[0], _out_shape(n, g)),
    "unsqueeze": lambda jnp, jax, n, x, a, g: jnp.reshape(x[0], _out_shape(n, g)),
    "expand": lambda jnp, jax, n, x, a, g: jnp.broadcast_to(x[0], _out_shape(n, g)),
    "slice": _j_slice,
    "concat": lambda jnp, jax, n, x, a, g: jnp.concatenate(list(x), axis=a["axis"]),
    "split": _j_split,
    "pad": _j_pad,
    "gather": lambda jnp, jax, n, x, a, g: jnp.take(x[0], x[1], axis=a["axis"]),
    "gather_elements": lambda jnp, jax, n, x, a, g: jnp.take_along_axis(x[0], x[1], axis=a["axis"]),
    "matmul": lambda jnp, jax, n, x, a, g: jnp.matmul(x[0], x[1], precision=_precision(jnp, jax, x[0])),
    "gemm": _j_gemm,
    "conv2d": _j_conv,
    "max_pool2d": _j_pool, "avg_pool2d": _j_pool,
    "global_avg_pool": lambda jnp, jax, n, x, a, g: jnp.mean(x[0], axis=_spatial(x[0]), keepdims=True),
    "global_max_pool": lambda jnp, jax, n, x, a, g: jnp.max(x[0], axis=_spatial(x[0]), keepdims=True),
}


def jax_op(jnp: Any, jax: Any, node: Node, args: list[Any], graph: Graph) -> Any:
    fn = JAX_OPS.get(node.op)
    if fn is None:
        raise NotImplementedError(f"jax peer has no translation for op {node.op!r}")
    return fn(jnp, jax, node, args, canonical(node, graph), graph)
