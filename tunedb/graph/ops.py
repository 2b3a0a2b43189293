"""Op semantics at the type level: shape and dtype inference for every op of ``OP_SPECS``.

Each op has a rule that checks its inputs and attributes and returns its output types together
with its *canonical* attributes: defaults filled in, negative axes normalised, ``axes=None``
expanded, reshape's ``-1``/``0`` resolved. The builder stores canonical attributes and the hash is
taken over them, so two spellings of the same op give the same workload.

Dtype rules are strict: operands of a binary op must have the same dtype (no implicit promotion;
insert a ``cast``). Errors are ``GraphError`` naming the op, its output, and the offending input
names, shapes and dtypes, e.g. ``add 'h': cannot broadcast float32[8,3] with float32[4]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from tunedb.graph.ir import DTYPES, FLOAT_DTYPES, Graph, GraphError, Node, TensorType, op_spec

ELEMENTWISE_UNARY: frozenset[str] = frozenset((
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid",
    "relu", "erf", "floor", "ceil", "sign", "not", "identity", "gelu", "clip", "cast", "leaky_relu"))
ELEMENTWISE_BINARY: frozenset[str] = frozenset((
    "add", "sub", "mul", "div", "pow", "max", "min", "mod",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "where"))
REDUCTIONS: frozenset[str] = frozenset(
    ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod"))
# Reductions whose attributes are not (axes, keepdims); see ``reduction_axes``.
OTHER_REDUCTIONS: frozenset[str] = frozenset(("argmax", "global_avg_pool", "global_max_pool"))
LAYOUT_OPS: frozenset[str] = frozenset((
    "transpose", "reshape", "squeeze", "unsqueeze", "expand", "slice", "concat", "split", "pad",
    "gather", "gather_elements"))
COMPUTE_OPS: frozenset[str] = frozenset(("matmul", "gemm", "conv2d", "max_pool2d", "avg_pool2d"))

_FLOAT_ONLY = frozenset(("exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh",
                         "sigmoid", "erf", "gelu", "leaky_relu", "pow"))
_ARITH = frozenset(("add", "sub", "mul", "div", "pow", "max", "min", "mod"))
_COMPARE = frozenset(("eq", "ne", "lt", "le", "gt", "ge"))
_INT_DTYPES = ("int32", "int64")


def is_elementwise(op: str) -> bool:
    return op in ELEMENTWISE_UNARY or op in ELEMENTWISE_BINARY


def is_memory_bound(op: str) -> bool:
    """Everything but the matmul/conv/pool family is limited by memory bandwidth."""
    op_spec(op)
    return op not in COMPUTE_OPS


def _kind(dtype: str) -> str:
    return "float" if dtype in FLOAT_DTYPES else "int" if dtype in _INT_DTYPES else "bool"


class _Ctx:
    """The node being checked, for error messages that name op, output and inputs."""

    def __init__(self, node: Node, types: Sequence[TensorType]) -> None:
        self.node, self.types, self.op = node, list(types), node.op
        self.where = f"{node.op} {node.outputs[0]!r}" if node.outputs else node.op

    def err(self, msg: str) -> GraphError:
        return GraphError(f"{self.where}: {msg}")

    def named(self, i: int) -> str:
        return f"{self.node.inputs[i]!r} {self.types[i]}"

    def need(self, i: int, *kinds: str) -> None:
        if _kind(self.types[i].dtype) not in kinds:
            raise self.err(f"input {self.named(i)} has the wrong dtype; {self.op} needs "
                           f"{' or '.join(kinds)}")

    def same_dtype(self, idx: Sequence[int]) -> str:
        d0 = self.types[idx[0]].dtype
        for i in idx[1:]:
            if self.types[i].dtype != d0:
                raise self.err(f"dtype mismatch: {self.named(idx[0])} vs {self.named(i)} "
                               "(no implicit promotion; insert a cast)")
        return d0

    def rank_at_least(self, i: int, r: int) -> None:
        if self.types[i].rank < r:
            raise self.err(f"input {self.named(i)} must have rank >= {r}")

    def rank_is(self, i: int, r: int) -> None:
        if self.types[i].rank != r:
            raise self.err(f"input {self.named(i)} must have rank {r}")

    # -- attributes -------------------------------------------------------------------------
    def int_(self, a: dict, name: str) -> int:
        v = a[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(f"attribute {name}={v!r} must be an int")
        return v

    def bool_(self, a: dict, name: str) -> bool:
        v = a[name]
        if isinstance(v, bool) or v in (0, 1):  # ONNX spells flags as 0/1
            return bool(v)
        raise self.err(f"attribute {name}={v!r} must be a bool")

    def float_(self, a: dict, name: str) -> float:
        v = a[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.err(f"attribute {name}={v!r} must be a number")
        return float(v)

    def ints(self, a: dict, name: str, n: int | None = None, lo: int | None = None) -> tuple[int, ...]:
        v = a[name]
        if isinstance(v, int) and not isinstance(v, bool):
            v = (v,)
        if not isinstance(v, tuple) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise self.err(f"attribute {name}={v!r} must be a tuple of ints")
        if n is not None and len(v) != n:
            raise self.err(f"attribute {name}={v!r} must have {n} entries")
        if lo is not None and any(x < lo for x in v):
            raise self.err(f"attribute {name}={v!r} must be >= {lo}")
        return v

    def axis(self, a: int, rank: int, name: str = "axis") -> int:
        if not -rank <= a < rank:
            raise self.err(f"{name} {a} out of range for rank {rank}")
        return a + rank if a < 0 else a

    def axes(self, axes: Sequence[int], rank: int, name: str = "axes") -> tuple[int, ...]:
        out = tuple(self.axis(x, rank, name) for x in axes)
        if len(set(out)) != len(out):
            raise self.err(f"repeated entries in {name}={tuple(axes)}")
        return out


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """NumPy broadcasting of shapes, or None where they do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _broadcast(c: _Ctx, idx: Sequence[int]) -> tuple[int, ...]:
    out = broadcast_shapes(*(c.types[i].shape for i in idx))
    if out is None:
        ts = " with ".join(str(c.types[i]) for i in idx)
        names = ", ".join(repr(c.node.inputs[i]) for i in idx if i < len(c.node.inputs))
        raise c.err(f"cannot broadcast {ts} (inputs {names})")
    return out


# -- rules: (ctx, attrs) -> (output types, canonical attrs) -------------------------------------

Rule = Callable[[_Ctx, dict], "tuple[list[TensorType], dict]"]


def _unary(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t, op = c.types[0], c.op
    dtype = t.dtype
    if op in _FLOAT_ONLY:
        c.need(0, "float")
    elif op == "not":
        c.need(0, "bool")
    elif op not in ("identity", "cast"):
        c.need(0, "float", "int")
    if op == "gelu" and a["approximate"] not in ("none", "tanh"):
        raise c.err(f"approximate={a['approximate']!r} must be 'none' or 'tanh'")
    if op == "leaky_relu":
        a["alpha"] = c.float_(a, "alpha")
    if op == "clip":
        for k in ("min", "max"):
            if a[k] is not None:
                a[k] = c.float_(a, k)
        # An infinite bound is no bound; None also keeps the graph JSON free of inf.
        if a["min"] is not None and a["min"] == -math.inf:
            a["min"] = None
        if a["max"] is not None and a["max"] == math.inf:
            a["max"] = None
    if op == "cast":
        if a["to"] not in DTYPES:
            raise c.err(f"to={a['to']!r} is not a dtype; expected one of {', '.join(DTYPES)}")
        dtype = a["to"]
    return [TensorType(t.shape, dtype)], a


def _binary(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    dtype = c.same_dtype((0, 1))
    if c.op == "pow":
        c.need(0, "float")
    elif c.op in _ARITH:
        c.need(0, "float", "int")
    elif c.op in ("and", "or"):
        c.need(0, "bool")
    shape = _broadcast(c, (0, 1))
    return [TensorType(shape, "bool" if c.op in _COMPARE else dtype)], a


def _where(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    c.need(0, "bool")
    dtype = c.same_dtype((1, 2))
    return [TensorType(_broadcast(c, (0, 1, 2)), dtype)], a


def _reduce_shape(shape: tuple[int, ...], axes: Sequence[int], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    c.need(0, *(("float",) if c.op == "reduce_mean" else ("float", "int")))
    axes = tuple(range(t.rank)) if a["axes"] is None else c.axes(c.ints(a, "axes"), t.rank)
    a["axes"], a["keepdims"] = tuple(sorted(axes)), c.bool_(a, "keepdims")
    if c.op in ("reduce_max", "reduce_min") and any(t.shape[i] == 0 for i in axes):
        raise c.err(f"{c.op} over an empty axis of {c.named(0)}")
    return [TensorType(_reduce_shape(t.shape, axes, a["keepdims"]), t.dtype)], a


def _argmax(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    c.need(0, "float", "int")
    a["axis"] = c.axis(c.int_(a, "axis"), t.rank)
    a["keepdims"] = c.bool_(a, "keepdims")
    if t.shape[a["axis"]] == 0:
        raise c.err(f"argmax over an empty axis of {c.named(0)}")
    return [TensorType(_reduce_shape(t.shape, (a["axis"],), a["keepdims"]), "int64")], a


def _global_pool(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    c.rank_at_least(0, 3)
    c.need(0, *(("float",) if c.op == "global_avg_pool" else ("float", "int")))
    return [TensorType(t.shape[:2] + (1,) * (t.rank - 2), t.dtype)], a


def _transpose(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    perm = tuple(reversed(range(t.rank))) if a["perm"] is None else c.ints(a, "perm")
    perm = a["perm"] = c.axes(perm, t.rank, "perm")
    if len(perm) != t.rank:
        raise c.err(f"perm={perm} is not a permutation of the axes of {c.named(0)}")
    return [TensorType(tuple(t.shape[p] for p in perm), t.dtype)], a


def _reshape(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    shape = list(c.ints(a, "shape", lo=-1))
    for i, d in enumerate(shape):
        if d == 0:  # ONNX: 0 copies the input's dimension
            if i >= t.rank:
                raise c.err(f"shape={tuple(shape)}: 0 at position {i} but {c.named(0)} has rank {t.rank}")
            shape[i] = t.shape[i]
    if shape.count(-1) > 1:
        raise c.err(f"shape={tuple(shape)} has more than one -1")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or t.numel % known:
            raise c.err(f"cannot reshape {c.named(0)} to {tuple(a['shape'])}")
        shape[shape.index(-1)] = t.numel // known
    if math.prod(shape) != t.numel:
        raise c.err(f"cannot reshape {c.named(0)} to {tuple(a['shape'])}: element counts differ")
    a["shape"] = tuple(shape)
    return [TensorType(tuple(shape), t.dtype)], a


def _squeeze(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    if a["axes"] is None:
        axes = tuple(i for i, d in enumerate(t.shape) if d == 1)
    else:
        axes = tuple(sorted(c.axes(c.ints(a, "axes"), t.rank)))
        if any(t.shape[i] != 1 for i in axes):
            raise c.err(f"cannot squeeze axes {axes} of {c.named(0)}: not of size 1")
    a["axes"] = axes
    return [TensorType(tuple(d for i, d in enumerate(t.shape) if i not in axes), t.dtype)], a


def _unsqueeze(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    raw = c.ints(a, "axes")
    axes = tuple(sorted(c.axes(raw, t.rank + len(raw))))  # relative to the output, like ONNX
    dims = iter(t.shape)
    shape = tuple(1 if i in axes else next(dims) for i in range(t.rank + len(axes)))
    a["axes"] = axes
    return [TensorType(shape, t.dtype)], a


def _expand(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    target = c.ints(a, "shape", lo=0)
    out = broadcast_shapes(t.shape, target)
    if out is None:
        raise c.err(f"cannot expand {c.named(0)} to shape {target}")
    a["shape"] = out  # ONNX broadcasts both ways; canonically the result shape (broadcast_to)
    return [TensorType(out, t.dtype)], a


def slice_bounds(shape: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                 steps: Sequence[int]) -> list[tuple[int, int, int]]:
    """ONNX Slice clamping for each sliced dim -> (start, end, length). ``end`` is -1 where a
    negative step runs past index 0 (use ``None`` in a Python slice then)."""
    out = []
    for dim, s, e, st in zip(shape, starts, ends, steps):
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), dim), min(max(e, 0), dim)
        else:
            s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)
        out.append((s, e, max(0, -(-(e - s) // st))))
    return out


def _slice(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    starts, ends = c.ints(a, "starts"), c.ints(a, "ends", len(a["starts"]))
    n = len(starts)
    axes = c.axes(c.ints(a, "axes", n) if a["axes"] != () else tuple(range(n)), t.rank)
    steps = c.ints(a, "steps", n) if a["steps"] != () else (1,) * n
    if 0 in steps:
        raise c.err("steps must not be 0")
    dims = [t.shape[i] for i in axes]
    bounds = slice_bounds(dims, starts, ends, steps)
    shape = list(t.shape)
    for ax, (_, _, length) in zip(axes, bounds):
        shape[ax] = length
    # Canonical: sorted axes, clamped bounds; "before index 0" is stored as -dim-1, which clamps
    # back to -1, so canonicalising twice changes nothing.
    rows = sorted(zip(axes, bounds, steps, dims))
    a["axes"] = tuple(r[0] for r in rows)
    a["starts"] = tuple(r[1][0] for r in rows)
    a["ends"] = tuple(r[1][1] if r[1][1] >= 0 else -r[3] - 1 for r in rows)
    a["steps"] = tuple(r[2] for r in rows)
    return [TensorType(tuple(shape), t.dtype)], a


def _concat(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t0 = c.types[0]
    dtype = c.same_dtype(range(len(c.types)))
    c.rank_at_least(0, 1)
    ax = a["axis"] = c.axis(c.int_(a, "axis"), t0.rank)
    for i, t in enumerate(c.types[1:], 1):
        if t.rank != t0.rank or any(d != e for j, (d, e) in enumerate(zip(t.shape, t0.shape)) if j != ax):
            raise c.err(f"cannot concat {c.named(0)} with {c.named(i)} on axis {ax}")
    shape = list(t0.shape)
    shape[ax] = sum(t.shape[ax] for t in c.types)
    return [TensorType(tuple(shape), dtype)], a


def _split(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    c.rank_at_least(0, 1)
    ax = a["axis"] = c.axis(c.int_(a, "axis"), t.rank)
    sizes, n, dim = c.ints(a, "sizes", lo=0), len(c.node.outputs), t.shape[ax]
    if not sizes:
        if n == 0 or dim % n:
            raise c.err(f"cannot split {c.named(0)} evenly into {n} outputs on axis {ax}")
        sizes = (dim // n,) * n
    if sum(sizes) != dim:
        raise c.err(f"sizes={sizes} do not add up to dim {dim} of {c.named(0)} on axis {ax}")
    if len(sizes) != n:
        raise c.err(f"{len(sizes)} sizes but {n} outputs")
    a["sizes"] = sizes
    return [TensorType(t.shape[:ax] + (s,) + t.shape[ax + 1:], t.dtype) for s in sizes], a


def _pad(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t = c.types[0]
    pads = c.ints(a, "pads", 2 * t.rank)
    shape = tuple(d + pads[i] + pads[i + t.rank] for i, d in enumerate(t.shape))
    if any(d < 0 for d in shape):
        raise c.err(f"pads={pads} crop {c.named(0)} below size 0")
    a["pads"], a["value"] = pads, c.float_(a, "value")
    return [TensorType(shape, t.dtype)], a


def _gather(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    t, idx = c.types
    c.rank_at_least(0, 1)
    c.need(1, "int")
    ax = a["axis"] = c.axis(c.int_(a, "axis"), t.rank)
    if c.op == "gather":
        return [TensorType(t.shape[:ax] + idx.shape + t.shape[ax + 1:], t.dtype)], a
    if idx.rank != t.rank or any(i > d for j, (i, d) in enumerate(zip(idx.shape, t.shape)) if j != ax):
        raise c.err(f"indices {c.named(1)} do not fit data {c.named(0)} on axis {ax}")
    return [TensorType(idx.shape, t.dtype)], a


def _matmul(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    ta, tb = c.types
    dtype = c.same_dtype((0, 1))
    c.need(0, "float", "int")
    c.rank_at_least(0, 1)
    c.rank_at_least(1, 1)
    sa = ta.shape if ta.rank > 1 else (1,) + ta.shape
    sb = tb.shape if tb.rank > 1 else tb.shape + (1,)
    batch = broadcast_shapes(sa[:-2], sb[:-2])
    if sa[-1] != sb[-2] or batch is None:
        raise c.err(f"cannot matmul {c.named(0)} with {c.named(1)}")
    shape = batch + ((sa[-2],) if ta.rank > 1 else ()) + ((sb[-1],) if tb.rank > 1 else ())
    return [TensorType(shape, dtype)], a


def _gemm(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    dtype = c.same_dtype(range(len(c.types)))
    c.need(0, "float", "int")
    c.rank_is(0, 2)
    c.rank_is(1, 2)
    for k in ("trans_a", "trans_b"):
        a[k] = c.bool_(a, k)
    a["alpha"], a["beta"] = c.float_(a, "alpha"), c.float_(a, "beta")
    m, ka = c.types[0].shape[::-1] if a["trans_a"] else c.types[0].shape
    kb, n = c.types[1].shape[::-1] if a["trans_b"] else c.types[1].shape
    if ka != kb:
        raise c.err(f"cannot gemm {c.named(0)} (trans_a={a['trans_a']}) with {c.named(1)} "
                    f"(trans_b={a['trans_b']})")
    if len(c.types) == 3 and broadcast_shapes(c.types[2].shape, (m, n)) != (m, n):
        raise c.err(f"C {c.named(2)} does not broadcast to [{m},{n}]")
    return [TensorType((m, n), dtype)], a


def conv_out_dim(size: int, k: int, stride: int, pb: int, pe: int, dil: int, ceil: bool = False) -> int:
    """Output length of a conv/pool window along one dim (ONNX/PyTorch rule for ceil_mode: the
    last window must start inside the input or the leading padding)."""
    span = size + pb + pe - dil * (k - 1) - 1
    if span < 0:
        return 0
    out = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (out - 1) * stride >= size + pb:
        out -= 1
    return out


def _window_attrs(c: _Ctx, a: dict) -> None:
    a["strides"] = c.ints(a, "strides", 2, lo=1)
    a["pads"] = c.ints(a, "pads", 4, lo=0)
    if "dilations" in a:
        a["dilations"] = c.ints(a, "dilations", 2, lo=1)


def _conv2d(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    x, w = c.types[:2]
    dtype = c.same_dtype(range(len(c.types)))
    c.need(0, "float")
    c.rank_is(0, 4)
    c.rank_is(1, 4)
    _window_attrs(c, a)
    g = a["groups"] = c.int_(a, "groups")
    n, ch, h, wd = x.shape
    o, cg, kh, kw = w.shape
    if g < 1 or ch % g or o % g or cg * g != ch:
        raise c.err(f"weights {c.named(1)} do not fit input {c.named(0)} with groups={g}")
    if len(c.types) == 3 and c.types[2].shape != (o,):
        raise c.err(f"bias {c.named(2)} must have shape [{o}]")
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = a["strides"], a["pads"], a["dilations"]
    oh, ow = conv_out_dim(h, kh, sh, pt, pb, dh), conv_out_dim(wd, kw, sw, pl, pr, dw)
    if oh < 1 or ow < 1:
        raise c.err(f"kernel {kh}x{kw} does not fit input {c.named(0)} with pads {a['pads']}")
    return [TensorType((n, o, oh, ow), dtype)], a


def _pool2d(c: _Ctx, a: dict) -> tuple[list[TensorType], dict]:
    x = c.types[0]
    c.need(0, *(("float", "int") if c.op == "max_pool2d" else ("float",)))
    c.rank_is(0, 4)
    _window_attrs(c, a)
    kh, kw = a["kernel"] = c.ints(a, "kernel", 2, lo=1)
    a["ceil_mode"] = c.bool_(a, "ceil_mode")
    if "count_include_pad" in a:
        a["count_include_pad"] = c.bool_(a, "count_include_pad")
    (sh, sw), (pt, pl, pb, pr) = a["strides"], a["pads"]
    dh, dw = a.get("dilations", (1, 1))
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if max(pt, pb) >= eh or max(pl, pr) >= ew:
        raise c.err(f"pads {a['pads']} must be smaller than the kernel {kh}x{kw}")
    oh = conv_out_dim(x.shape[2], kh, sh, pt, pb, dh, a["ceil_mode"])
    ow = conv_out_dim(x.shape[3], kw, sw, pl, pr, dw, a["ceil_mode"])
    if oh < 1 or ow < 1:
        raise c.err(f"kernel {kh}x{kw} does not fit input {c.named(0)} with pads {a['pads']}")
    return [TensorType(x.shape[:2] + (oh, ow), x.dtype)], a


_RULES: dict[str, Rule] = {
    **{op: _unary for op in ELEMENTWISE_UNARY},
    **{op: _binary for op in ELEMENTWISE_BINARY if op != "where"},
    "where": _where,
    **{op: _reduce for op in REDUCTIONS},
    "argmax": _argmax, "global_avg_pool": _global_pool, "global_max_pool": _global_pool,
    "transpose": _transpose, "reshape": _reshape, "squeeze": _squeeze, "unsqueeze": _unsqueeze,
    "expand": _expand, "slice": _slice, "concat": _concat, "split": _split, "pad": _pad,
    "gather": _gather, "gather_elements": _gather, "matmul": _matmul, "gemm": _gemm,
    "conv2d": _conv2d, "max_pool2d": _pool2d, "avg_pool2d": _pool2d,
}


def check_node(node: Node, input_types: Sequence[TensorType]) -> tuple[list[TensorType], dict[str, Any]]:
    """Output types and canonical attributes (all defaults present, axes normalised)."""
    lo, hi, n_out, defaults = op_spec(node.op)
    c = _Ctx(node, input_types)
    if len(input_types) != len(node.inputs):
        raise c.err(f"{len(node.inputs)} inputs but {len(input_types)} input types")
    if len(input_types) < lo or (hi is not None and len(input_types) > hi):
        want = f"{lo}" if lo == hi else f"{lo}..{hi if hi is not None else ''}"
        raise c.err(f"takes {want} inputs, got {len(input_types)}")
    if n_out is not None and len(node.outputs) != n_out:
        raise c.err(f"has {n_out} output(s), got {len(node.outputs)}")
    unknown = sorted(set(node.attr_dict) - set(defaults))
    if unknown:
        raise c.err(f"unknown attribute(s) {', '.join(unknown)}; "
                    f"allowed: {', '.join(sorted(defaults)) or 'none'}")
    attrs = {**defaults, **node.attr_dict}
    return _RULES[node.op](c, attrs)


def infer_node(node: Node, input_types: Sequence[TensorType]) -> list[TensorType]:
    return check_node(node, input_types)[0]


def canonical_attrs(node: Node, input_types: Sequence[TensorType]) -> dict[str, Any]:
    return check_node(node, input_types)[1]


def reduction_axes(node: Node, input_type: TensorType) -> tuple[int, ...]:
    """The (normalised) axes a reduction-like op reduces over."""
    a = canonical_attrs(node, [input_type])
    if node.op in REDUCTIONS:
        return a["axes"]
    if node.op == "argmax":
        return (a["axis"],)
    if node.op in ("global_avg_pool", "global_max_pool"):
        return tuple(range(2, input_type.rank))
    raise GraphError(f"{node.op} is not a reduction")


def infer_graph(graph: Graph) -> Graph:
    """Validate ``graph`` (topological order, each value defined once, op rules) and return it
    with ``types`` holding exactly the type of every value. Graph inputs take their types from
    ``graph.types``; a stored type that disagrees with inference is an error."""
    given = graph.type_map
    types: dict[str, TensorType] = {}

    def define(v: str, t: TensorType, what: str) -> None:
        if not v:
            raise GraphError(f"{what} has an empty value name")
        if v in types:
            raise GraphError(f"value {v!r} is defined more than once ({what})")
        if v in given and given[v] != t:
            raise GraphError(f"value {v!r}: stored type {given[v]} but {what} gives {t}")
        types[v] = t

    for v in graph.inputs:
        if v not in given:
            raise GraphError(f"graph input {v!r} has no type")
        define(v, given[v], "graph input")
    for v, const in graph.constants:
        define(v, const.type, "constant")
    for node in graph.nodes:
        for v in node.inputs:
            if v not in types:
                later = any(v in n.outputs for n in graph.nodes)
                raise GraphError(f"{node.op} {node.outputs[0] if node.outputs else ''!r}: input {v!r} "
                                 + ("is used before it is defined (nodes not in topological order)"
                                    if later else "is not defined"))
        outs = infer_node(node, [types[v] for v in node.inputs])
        for v, t in zip(node.outputs, outs):
            define(v, t, f"{node.op} node")
    for v in graph.outputs:
        if v not in types:
            raise GraphError(f"graph output {v!r} is not defined")
    return Graph(graph.inputs, graph.outputs, graph.nodes, types, graph.constants, graph.name)
