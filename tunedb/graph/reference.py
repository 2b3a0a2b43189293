"""Float64 NumPy reference interpreter: the oracle every generated kernel is checked against.

Floats are computed in float64 whatever their graph dtype (no intermediate rounding: ``cast`` to a
float dtype changes no value), integers in int64 (``cast`` to int32 wraps like C), bools stay bool.
Integer ``div`` truncates toward zero (C, CUDA, ONNX); ``mod`` is floored, with the sign of the
divisor (Python, ONNX ``fmod=0``), for ints and floats alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tunedb.graph.ir import FLOAT_DTYPES, Graph, GraphError, Node, TensorType
from tunedb.graph.ops import check_node, conv_out_dim, infer_graph, slice_bounds


def erf_series(x: np.ndarray) -> np.ndarray:
    """erf to ~1e-15 without SciPy: for |x| < 3 the all-positive series
    erf(x) = 2/sqrt(pi) exp(-x^2) sum 2^n x^(2n+1) / (1*3*...*(2n+1)) (no cancellation);
    beyond, erfc's continued fraction, evaluated bottom-up with a fixed depth."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    out = np.empty_like(x)
    small = ax < 3.0
    xs = ax[small]
    term = xs.copy()
    total = xs.copy()
    for n in range(1, 200):
        term = term * (2.0 * xs * xs) / (2 * n + 1)
        total += term
        if not np.any(term > 1e-17 * total):
            break
    out[small] = 2.0 / math.sqrt(math.pi) * np.exp(-xs * xs) * total
    xl = ax[~small]
    frac = np.zeros_like(xl)
    for k in range(60, 0, -1):  # erfc(x) = exp(-x^2)/sqrt(pi) / (x + (1/2)/(x + 1/(x + (3/2)/...)))
        frac = (k / 2.0) / (xl + frac)
    out[~small] = 1.0 - np.exp(-xl * xl) / math.sqrt(math.pi) / (xl + frac)
    out[np.isnan(ax)] = np.nan
    return np.sign(x) * out


def erf(x: np.ndarray) -> np.ndarray:
    # SciPy comes with scikit-learn; imported here so that importing the graph package stays
    # light. The series above is the fallback (and is tested on its own).
    try:
        from scipy.special import erf as scipy_erf
    except ImportError:  # pragma: no cover
        return erf_series(x)
    return scipy_erf(x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.abs(x)
    np.negative(e, out=e)
    np.exp(e, out=e)  # exp(-|x|) never overflows
    # 1/(1+e) for x >= 0, e/(1+e) otherwise; in place, as the oracle runs on 100M-element inputs.
    num = np.where(x >= 0, 1.0, e)
    e += 1.0
    num /= e
    return num


def _gelu(x: np.ndarray, a: dict) -> np.ndarray:
    if a["approximate"] == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _pow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # A constant exponent 2 as a product: np.power calls pow() per element, ~10x slower, and
    # pow(x, 2) is x*x bit for bit. (x*x*x is not pow(x, 3): up to 2 ulps apart, more after
    # cancellation downstream, so other exponents stay with np.power.)
    if a.dtype.kind == "f" and b.size == 1 and np.broadcast_shapes(a.shape, b.shape) == a.shape:
        v = float(b.reshape(()))
        if v == 2.0:
            return a * a
    return np.power(a, b)


def _clip(x: np.ndarray, a: dict) -> np.ndarray:
    lo, hi = a["min"], a["max"]
    if x.dtype.kind == "i":  # integer bounds that keep the result exact
        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
    if lo is not None:
        x = np.maximum(x, np.asarray(lo, dtype=x.dtype))
    if hi is not None:
        x = np.minimum(x, np.asarray(hi, dtype=x.dtype))
    return x


def _cast(x: np.ndarray, a: dict) -> np.ndarray:
    to = a["to"]
    if to in FLOAT_DTYPES:
        return x.astype(np.float64)
    if to == "bool":
        return x != 0
    if x.dtype.kind == "f":
        x = np.trunc(x)
    x = x.astype(np.int64)
    return x.astype(np.int32).astype(np.int64) if to == "int32" else x


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f":
        return a / b
    q = np.abs(a) // np.where(b == 0, 1, np.abs(b))
    return np.where(b == 0, 0, np.sign(a) * np.sign(b) * q)


_UNARY: dict[str, Callable[..., np.ndarray]] = {
    "neg": lambda x, a: -x, "abs": lambda x, a: np.abs(x), "exp": lambda x, a: np.exp(x),
    "log": lambda x, a: np.log(x), "sqrt": lambda x, a: np.sqrt(x),
    "rsqrt": lambda x, a: 1.0 / np.sqrt(x), "reciprocal": lambda x, a: 1.0 / x,
    "sin": lambda x, a: np.sin(x), "cos": lambda x, a: np.cos(x), "tanh": lambda x, a: np.tanh(x),
    "sigmoid": lambda x, a: _sigmoid(x), "relu": lambda x, a: np.maximum(x, np.zeros((), x.dtype)),
    "erf": lambda x, a: erf(x),
    "floor": lambda x, a: np.floor(x) if x.dtype.kind == "f" else x.copy(),
    "ceil": lambda x, a: np.ceil(x) if x.dtype.kind == "f" else x.copy(),
    "sign": lambda x, a: np.sign(x), "not": lambda x, a: np.logical_not(x),
    "identity": lambda x, a: x.copy(), "gelu": _gelu, "clip": _clip, "cast": _cast,
    "leaky_relu": lambda x, a: np.where(x >= 0, x, a["alpha"] * x),
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _div, "pow": _pow,
    "max": np.maximum, "min": np.minimum,
    "mod": lambda a, b: np.mod(a, np.where(b == 0, 1, b)) * (b != 0) if a.dtype.kind == "i"
    else np.mod(a, b),
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal, "and": np.logical_and, "or": np.logical_or,
}
_REDUCE = {"reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_max": np.max,
           "reduce_min": np.min, "reduce_prod": np.prod}


def _slice(x: np.ndarray, a: dict) -> np.ndarray:
    index: list[Any] = [slice(None)] * x.ndim
    bounds = slice_bounds([x.shape[i] for i in a["axes"]], a["starts"], a["ends"], a["steps"])
    for ax, (s, e, _), st in zip(a["axes"], bounds, a["steps"]):
        index[ax] = slice(s, e if e >= 0 else None, st)
    return x[tuple(index)].copy()


def _pad(x: np.ndarray, a: dict) -> np.ndarray:
    r, pads = x.ndim, a["pads"]
    crop = tuple(slice(max(0, -pads[i]), x.shape[i] - max(0, -pads[i + r])) for i in range(r))
    widths = [(max(0, pads[i]), max(0, pads[i + r])) for i in range(r)]
    value = a["value"] if x.dtype.kind == "f" else np.asarray(a["value"]).astype(x.dtype)
    return np.pad(x[crop], widths, mode="constant", constant_values=value)


def _gather_elements(x: np.ndarray, idx: np.ndarray, a: dict) -> np.ndarray:
    ax = a["axis"]
    if idx.size and (idx.min() < -x.shape[ax] or idx.max() >= x.shape[ax]):
        raise GraphError(f"gather_elements: index out of range for axis {ax} of size {x.shape[ax]}")
    grid = list(np.indices(idx.shape, sparse=True))
    grid[ax] = idx
    return x[tuple(grid)]


def _gemm(args: Sequence[np.ndarray], a: dict) -> np.ndarray:
    A = args[0].T if a["trans_a"] else args[0]
    B = args[1].T if a["trans_b"] else args[1]
    y = a["alpha"] * (A @ B) if args[0].dtype.kind == "f" else (A @ B) * int(a["alpha"])
    if len(args) == 3:
        y = y + (a["beta"] * args[2] if args[0].dtype.kind == "f" else int(a["beta"]) * args[2])
    return y


def _windows(x: np.ndarray, k: tuple[int, int], strides: Sequence[int], pads: Sequence[int],
             dil: Sequence[int], out: tuple[int, int], fill: float) -> np.ndarray:
    """View [N, C, OH, OW, KH, KW] of the padded input (padded further at the end where a
    ceil-mode window runs past it)."""
    (kh, kw), (sh, sw), (dh, dw) = k, strides, dil
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    h, w = x.shape[2:]
    extra_h = max(0, (out[0] - 1) * sh + eh - (h + pads[0] + pads[2]))
    extra_w = max(0, (out[1] - 1) * sw + ew - (w + pads[1] + pads[3]))
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2] + extra_h), (pads[1], pads[3] + extra_w)),
                constant_values=fill)
    v = sliding_window_view(xp, (eh, ew), axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    return v[:, :, :out[0], :out[1]]


def _conv2d(args: Sequence[np.ndarray], a: dict) -> np.ndarray:
    x, w = args[0], args[1]
    g = a["groups"]
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = a["strides"], a["pads"], a["dilations"]
    out = (conv_out_dim(h, kh, sh, pt, pb, dh), conv_out_dim(wd, kw, sw, pl, pr, dw))
    cols = _windows(x, (kh, kw), a["strides"], a["pads"], a["dilations"], out, 0.0)
    cols = cols.reshape(n, g, cg, out[0], out[1], kh, kw)
    y = np.einsum("ngchwij,gocij->ngohw", cols, w.reshape(g, o // g, cg, kh, kw), optimize=True)
    y = y.reshape(n, o, out[0], out[1])
    return y + args[2].reshape(1, o, 1, 1) if len(args) == 3 else y


def _pool2d(x: np.ndarray, a: dict, op: str) -> np.ndarray:
    (kh, kw), (sh, sw), pads = a["kernel"], a["strides"], a["pads"]
    dil = a.get("dilations", (1, 1))
    out = (conv_out_dim(x.shape[2], kh, sh, pads[0], pads[2], dil[0], a["ceil_mode"]),
           conv_out_dim(x.shape[3], kw, sw, pads[1], pads[3], dil[1], a["ceil_mode"]))
    if op == "max_pool2d":
        fill = -np.inf if x.dtype.kind == "f" else np.iinfo(np.int64).min
        return _windows(x, (kh, kw), a["strides"], pads, dil, out, fill).max(axis=(4, 5))
    total = _windows(x, (kh, kw), a["strides"], pads, dil, out, 0.0).sum(axis=(4, 5))
    # The divisor counts real elements, plus the declared padding with count_include_pad; never
    # the extra cells a ceil-mode window reaches past the padded input.
    ones = np.ones((1, 1) + x.shape[2:])
    if a["count_include_pad"]:
        ones = np.pad(ones, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])), constant_values=1.0)
        pads = (0, 0, 0, 0)
    count = _windows(ones, (kh, kw), a["strides"], pads, dil, out, 0.0).sum(axis=(4, 5))
    return total / count


def eval_node(node: Node, args: Sequence[np.ndarray], attrs: Mapping[str, Any]) -> list[np.ndarray]:
    """One node on float64/int64/bool arrays; ``attrs`` are canonical (``ops.check_node``)."""
    op, a = node.op, dict(attrs)
    if op in _UNARY:
        return [_UNARY[op](args[0], a)]
    if op in _BINARY:
        return [_BINARY[op](args[0], args[1])]
    if op == "where":
        return [np.where(*args)]
    if op in _REDUCE:
        return [np.asarray(_REDUCE[op](args[0], axis=a["axes"], keepdims=a["keepdims"]))]
    if op == "argmax":
        y = np.argmax(args[0], axis=a["axis"]).astype(np.int64)
        return [np.expand_dims(y, a["axis"]) if a["keepdims"] else y]
    if op in ("global_avg_pool", "global_max_pool"):
        f = np.mean if op == "global_avg_pool" else np.max
        return [f(args[0], axis=tuple(range(2, args[0].ndim)), keepdims=True)]
    x = args[0]
    if op == "transpose":
        return [np.transpose(x, a["perm"]).copy()]
    if op in ("reshape", "expand"):
        return [np.broadcast_to(x, a["shape"]).copy() if op == "expand" else x.reshape(a["shape"])]
    if op == "squeeze":
        return [np.squeeze(x, axis=a["axes"])]
    if op == "unsqueeze":
        return [np.expand_dims(x, a["axes"])]
    if op == "slice":
        return [_slice(x, a)]
    if op == "concat":
        return [np.concatenate(args, axis=a["axis"])]
    if op == "split":
        return [p.copy() for p in np.split(x, np.cumsum(a["sizes"])[:-1], axis=a["axis"])]
    if op == "pad":
        return [_pad(x, a)]
    if op == "gather":
        try:
            return [np.take(x, args[1], axis=a["axis"])]
        except IndexError as e:
            raise GraphError(f"gather: {e}") from None
    if op == "gather_elements":
        return [_gather_elements(x, args[1], a)]
    if op == "matmul":
        return [np.matmul(x, args[1])]
    if op == "gemm":
        return [_gemm(args, a)]
    if op == "conv2d":
        return [_conv2d(args, a)]
    if op in ("max_pool2d", "avg_pool2d"):
        return [_pool2d(x, a, op)]
    raise GraphError(f"no reference semantics for op {op!r}")  # pragma: no cover


def _describe(a: np.ndarray) -> str:
    return f"{a.dtype}[{','.join(map(str, a.shape))}]"


def to_reference(a: np.ndarray, t: TensorType, what: str) -> np.ndarray:
    """Check an array against a graph type and widen it: float64, int64 or bool."""
    a = np.asarray(a)
    want = "f" if t.dtype in FLOAT_DTYPES else "b" if t.dtype == "bool" else "iu"
    if a.shape != t.shape or a.dtype.kind not in want:
        raise GraphError(f"{what}: expected {t}, got {_describe(a)}")
    return a.astype(np.float64 if want == "f" else np.int64 if want == "iu" else np.bool_, copy=False)


def run_reference(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate ``graph`` on ``inputs`` (name -> array) in float64; returns name -> array for
    every graph output. bfloat16/float16 inputs come as float32/float16 arrays of the rounded
    values; any float array is accepted for a float input, any integer array for an int one."""
    graph = infer_graph(graph)
    types = graph.type_map
    missing = [v for v in graph.inputs if v not in inputs]
    extra = sorted(set(inputs) - set(graph.inputs))
    if missing or extra:
        raise GraphError(f"graph {graph.name or '<unnamed>'}: "
                         + (f"missing input(s) {', '.join(map(repr, missing))}" if missing else "")
                         + ("; " if missing and extra else "")
                         + (f"unknown input(s) {', '.join(map(repr, extra))}" if extra else ""))
    env = {v: to_reference(inputs[v], types[v], f"input {v!r}") for v in graph.inputs}
    env.update({v: to_reference(c.array, c.type, f"constant {v!r}") for v, c in graph.constants})
    # The caller's arrays and the graph's constants (``to_reference`` may pass them through
    # uncopied) are never written to.
    given = [np.asarray(inputs[v]) for v in graph.inputs] + [np.asarray(c.array) for _, c in graph.constants]
    foreign = [a for a in env.values() if any(np.may_share_memory(a, g) for g in given)]
    # Each value is dropped after its last use, and a dead intermediate's buffer is reused by the
    # next elementwise op: on 100M-element workloads fresh float64 temporaries (page faults) and
    # dozens of live ones dominated the oracle's time and memory. Values are unchanged.
    last = {v: i for i, node in enumerate(graph.nodes) for v in node.inputs}
    keep = set(graph.outputs)
    owned: set[str] = set()
    with np.errstate(all="ignore"):  # inf/nan are results like any other here
        for i, node in enumerate(graph.nodes):
            _, attrs = check_node(node, [types[v] for v in node.inputs])
            args = [env[v] for v in node.inputs]
            dead = [v for v in dict.fromkeys(node.inputs) if last.get(v) == i and v not in keep]
            outs = None
            if node.op in _INPLACE:
                out = _reusable(dead, owned, env, foreign, args)
                if out is not None:
                    outs = [_INPLACE[node.op](*args, out=out)]
            if outs is None:
                outs = eval_node(node, args, attrs)
            del args
            for v in dead:
                del env[v]
                owned.discard(v)
            for v, y in zip(node.outputs, outs):
                env[v] = to_reference(np.asarray(y), types[v], f"{node.op} {v!r} (reference bug)")
                owned.add(v)
    return {v: env[v].copy() for v in graph.outputs}


# Float elementwise ops that may write into a dead input's buffer (NumPy computes the same
# values with ``out=``; it handles an ``out`` that aliases an input).
_INPLACE: dict[str, Callable[..., np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
}


def _reusable(dead: list[str], owned: set[str], env: dict[str, np.ndarray],
              foreign: list[np.ndarray], args: list[np.ndarray]) -> np.ndarray | None:
    """A dead, node-produced float64 buffer with the op's output shape that no live value (nor a
    caller's array) shares memory with; None if there is none (or the inputs are not floats)."""
    if not dead or any(a.dtype != np.float64 for a in args):
        return None
    shape = np.broadcast_shapes(*(a.shape for a in args))
    for v in dead:
        buf = env[v]
        if (v not in owned or buf.shape != shape or not buf.flags.c_contiguous
                or not buf.flags.owndata or not buf.flags.writeable):
            continue
        others = [a for k, a in env.items() if k not in dead] + foreign
        if not any(np.may_share_memory(buf, a) for a in others):
            return buf
    return None


def example_feeds(graph: Graph, seed: int = 0, masked_tail: int = 16) -> dict[str, np.ndarray]:
    """Inputs for checking an imported model against another runtime: standard-normal float32
    tensors, and int64 inputs as attention masks whose last ``masked_tail`` positions are padding
    (0), so that a model that ignored its mask would give other outputs."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        t = graph.type_of(v)
        if t.dtype == "int64":
            a = np.ones(t.shape, np.int64)
            a[..., -masked_tail:] = 0
        else:
            a = rng.standard_normal(t.shape).astype(np.float32)
        feeds[v] = a
    return feeds
