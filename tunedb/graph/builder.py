"""GraphBuilder: write graphs as Python calls, with shape inference at every call.

    b = GraphBuilder("bias_gelu")
    x = b.input("x", (8192, 4096), "float32")
    bias = b.input("b", (4096,), "float32")
    y = b.gelu(b.add(x, bias), approximate="tanh")
    g = b.build([y])

Every op of ``OP_SPECS`` is a method of the same name (``not_``, ``and_``, ``or_`` for Python
keywords): inputs positional, attributes as keywords, an optional ``name=`` for the output.
Errors surface at the call that made them. Nodes store canonical attributes (see ``ops``).
"""

from __future__ import annotations

import keyword
from collections.abc import Sequence
from typing import Any

import numpy as np

from tunedb.graph.ir import OP_SPECS, Constant, Graph, GraphError, Node, TensorType, check_dtype
from tunedb.graph.ops import check_node, infer_graph


class GraphBuilder:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self._inputs: list[str] = []
        self._nodes: list[Node] = []
        self._types: dict[str, TensorType] = {}
        self._constants: dict[str, Constant] = {}
        self._counter = 0

    # -- values ------------------------------------------------------------------------------
    def _fresh(self, name: str | None) -> str:
        if name is not None:
            if not isinstance(name, str) or not name:
                raise GraphError(f"value name must be a non-empty string, got {name!r}")
            if name in self._types:
                raise GraphError(f"value {name!r} is already defined")
            return name
        while f"v{self._counter}" in self._types:
            self._counter += 1
        self._counter += 1
        return f"v{self._counter - 1}"

    def _check(self, value: str) -> TensorType:
        if not isinstance(value, str):
            raise GraphError(f"expected a value name, got {value!r} of type {type(value).__name__}")
        try:
            return self._types[value]
        except KeyError:
            raise GraphError(f"value {value!r} is not defined in builder {self.name!r}") from None

    def type_of(self, value: str) -> TensorType:
        return self._check(value)

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        t = TensorType(tuple(shape), check_dtype(dtype))
        name = self._fresh(name)
        self._inputs.append(name)
        self._types[name] = t
        return name

    def constant(self, array: Any, dtype: str | None = None, name: str | None = None) -> str:
        """A constant tensor. Python floats default to float32 and ints to int64 unless ``dtype``
        says otherwise; NumPy arrays keep their dtype (float64 becomes float32: no float64 here)."""
        a = np.asarray(array)
        if dtype is None:
            dtype = ("bool" if a.dtype == np.bool_ else "float32" if a.dtype.kind == "f" and
                     a.dtype != np.float16 else "float16" if a.dtype == np.float16 else
                     "int32" if a.dtype == np.int32 else "int64" if a.dtype.kind in "iu" else "")
            if not dtype:
                raise GraphError(f"constant of NumPy dtype {a.dtype} is not supported")
        const = Constant.from_array(a, check_dtype(dtype))
        name = self._fresh(name)
        self._constants[name] = const
        self._types[name] = const.type
        return name

    def scalar(self, value: float, like: str) -> str:
        """A rank-0 constant with the dtype of value ``like``."""
        return self.constant(np.array(value), dtype=self._check(like).dtype)

    # -- ops ---------------------------------------------------------------------------------
    def op(self, op: str, *inputs: str, name: str | Sequence[str] | None = None,
           num_outputs: int | None = None, **attrs: Any) -> Any:
        """Add one node; returns its output name (a tuple of names for split). Attributes
        given as None take their defaults."""
        if op not in OP_SPECS:
            raise GraphError(f"unknown op {op!r}")
        inputs = self._lift_scalars(op, inputs)
        types = [self._check(v) for v in inputs]
        n_out = OP_SPECS[op][2]
        if n_out is None:  # split: one output per size, or num_outputs equal parts
            n_out = len(attrs.get("sizes") or ()) or num_outputs or 0
            if n_out == 0:
                raise GraphError(f"{op}: give sizes=... or num_outputs=...")
        if isinstance(name, (list, tuple)):
            names = list(name)
        else:
            names = [name] if n_out == 1 else [None] * n_out
            if name is not None and n_out != 1:
                raise GraphError(f"{op}: give a sequence of {n_out} names")
        if len(names) != n_out or len({n for n in names if n}) != len([n for n in names if n]):
            raise GraphError(f"{op}: need {n_out} distinct output names, got {tuple(names)}")
        # An attribute given as None takes the op's default.
        attrs = {k: v for k, v in attrs.items() if v is not None}
        # Check with placeholder names first so a failing call defines nothing.
        placeholder = Node(op, inputs, tuple(n or f"<out{i}>" for i, n in enumerate(names)), attrs)
        out_types, canon = check_node(placeholder, types)
        outs = tuple(self._fresh(n) for n in names)
        self._nodes.append(Node(op, inputs, outs, canon))
        self._types.update(zip(outs, out_types))
        return outs if OP_SPECS[op][2] is None else outs[0]

    def _lift_scalars(self, op: str, inputs: Sequence[Any]) -> tuple[str, ...]:
        """Python numbers among the inputs become rank-0 constants of the dtype of the first
        named input, so ``b.mul(x, 0.125)`` works."""
        if all(isinstance(v, str) for v in inputs):
            return tuple(inputs)
        named = [v for v in inputs if isinstance(v, str)]
        like = next((v for v in named if self._check(v).dtype != "bool"), named[0] if named else None)
        out = []
        for v in inputs:
            if isinstance(v, (bool, int, float)) and like is not None:
                v = self.scalar(v, like)
            elif not isinstance(v, str):
                raise GraphError(f"{op}: input {v!r} is not a value name")
            out.append(v)
        return tuple(out)

    # -- composites (built from primitives) --------------------------------------------------
    def _norm_axes(self, x: str, axis: int | Sequence[int], what: str) -> tuple[int, ...]:
        """An int means the axes from ``axis`` to the last, as ONNX LayerNormalization and
        RMSNormalization count them; a sequence is taken as it is."""
        if not isinstance(axis, int):
            return tuple(axis)
        rank = self._check(x).rank
        if not -rank <= axis < rank:
            raise GraphError(f"{what}: axis {axis} out of range for rank {rank}")
        return tuple(range(axis % rank, rank))

    def softmax(self, x: str, axis: int = -1, name: str | None = None) -> str:
        ax = (axis,)
        e = self.exp(self.sub(x, self.reduce_max(x, axes=ax, keepdims=True)))
        return self.div(e, self.reduce_sum(e, axes=ax, keepdims=True), name=name)

    def log_softmax(self, x: str, axis: int = -1, name: str | None = None) -> str:
        ax = (axis,)
        d = self.sub(x, self.reduce_max(x, axes=ax, keepdims=True))
        return self.sub(d, self.log(self.reduce_sum(self.exp(d), axes=ax, keepdims=True)), name=name)

    def _affine(self, y: str, scale: str | None, bias: str | None, name: str | None) -> str:
        if scale is not None:
            y = self.mul(y, scale, name=name if bias is None else None)
        if bias is not None:
            y = self.add(y, bias, name=name)
        return y

    def layernorm(self, x: str, scale: str | None = None, bias: str | None = None,
                  axis: int | Sequence[int] = -1, eps: float = 1e-5, name: str | None = None) -> str:
        """ONNX LayerNormalization: normalise over the axes from ``axis`` to the last."""
        ax = self._norm_axes(x, axis, "layernorm")
        d = self.sub(x, self.reduce_mean(x, axes=ax, keepdims=True))
        var = self.reduce_mean(self.mul(d, d), axes=ax, keepdims=True)
        y = self.mul(d, self.rsqrt(self.add(var, self.scalar(eps, x))),
                     name=name if scale is None and bias is None else None)
        return self._affine(y, scale, bias, name)

    def rmsnorm(self, x: str, scale: str | None = None, axis: int | Sequence[int] = -1,
                eps: float = 1e-6, name: str | None = None) -> str:
        """x * rsqrt(mean(x^2) + eps) * scale over the axes from ``axis`` to the last."""
        ax = self._norm_axes(x, axis, "rmsnorm")
        ms = self.reduce_mean(self.mul(x, x), axes=ax, keepdims=True)
        y = self.mul(x, self.rsqrt(self.add(ms, self.scalar(eps, x))), name=None if scale else name)
        return self._affine(y, scale, None, name)

    def batchnorm(self, x: str, scale: str | None, bias: str | None, mean: str, var: str,
                  eps: float = 1e-5, name: str | None = None) -> str:
        """Inference batch norm over channel axis 1; parameters have shape [C]."""
        rank = self._check(x).rank
        if rank < 2:
            raise GraphError(f"batchnorm: input {x!r} {self._check(x)} needs rank >= 2")
        trailing = tuple(range(1, rank - 1))

        def per_channel(v: str) -> str:  # [C] -> [C,1,...,1] so it broadcasts against NC...
            return self.unsqueeze(v, axes=trailing) if trailing else v

        inv = self.rsqrt(self.add(var, self.scalar(eps, var)))
        if scale is not None:
            inv = self.mul(inv, scale)
        y = self.mul(self.sub(x, per_channel(mean)), per_channel(inv),
                     name=name if bias is None else None)
        return y if bias is None else self.add(y, per_channel(bias), name=name)

    # -- result ------------------------------------------------------------------------------
    def build(self, outputs: Sequence[str] | str) -> Graph:
        """The graph computing ``outputs``; nodes and constants they do not need are dropped
        (declared inputs are kept: they are the graph's calling convention)."""
        outputs = [outputs] if isinstance(outputs, str) else list(outputs)
        for v in outputs:
            self._check(v)
        live = set(outputs)
        nodes = []
        for node in reversed(self._nodes):
            if live.intersection(node.outputs):
                nodes.append(node)
                live.update(node.inputs)
        nodes.reverse()
        values = live | set(self._inputs) | {o for n in nodes for o in n.outputs}
        graph = Graph(
            inputs=tuple(self._inputs), outputs=tuple(outputs), nodes=tuple(nodes),
            types={v: t for v, t in self._types.items() if v in values},
            constants={v: c for v, c in self._constants.items() if v in live}, name=self.name)
        return infer_graph(graph)


def _make_method(op: str) -> Any:
    def method(self: GraphBuilder, *inputs: str, **attrs: Any) -> Any:
        return self.op(op, *inputs, **attrs)

    lo, hi, _, defaults = OP_SPECS[op]
    method.__name__ = method.__qualname__ = op + "_" if keyword.iskeyword(op) else op
    args = ", ".join(f"{k}={v!r}" for k, v in defaults.items())
    method.__doc__ = f"``{op}`` node: {lo}{'' if hi == lo else '+'} input(s); attributes {args or 'none'}."
    return method


for _op in OP_SPECS:
    _name = _op + "_" if keyword.iskeyword(_op) else _op
    if not hasattr(GraphBuilder, _name):
        setattr(GraphBuilder, _name, _make_method(_op))
