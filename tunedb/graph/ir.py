"""Tensor-graph IR: frozen, hashable, JSON round-trippable records.

A Graph is a DAG of Nodes in topological order. Values are named by strings; every value's
TensorType is stored on the graph (``types``), filled by shape inference when the graph is built
(see ``tunedb.graph.ops.infer``). Constants carry their bytes so that a graph is self-contained.

Op names and attributes are listed in ``OP_SPECS``; ``tunedb.graph.ops`` gives each op its
shape/dtype rule and ``tunedb.graph.reference`` its float64 NumPy semantics.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "int32", "int64", "bool")
FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "bool": 1,
}

AttrValue = int | float | str | bool | None | tuple


# Far beyond any GPU's memory (4 TiB of float32); a larger tensor is a typo or a broken file.
MAX_ELEMENTS = 2**40


class GraphError(ValueError):
    """A graph is malformed: bad shapes, dtypes, attributes, or an unknown op."""


def _dim(d: Any, shape: Any) -> int:
    """A dimension as int; a fraction, a bool or a string is refused, not truncated."""
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, float, np.integer, np.floating)) \
            or not math.isfinite(d) or d != int(d):
        raise GraphError(f"dimension {d!r} in shape {list(shape)} is not an integer")
    return int(d)


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise GraphError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return dtype


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(_dim(d, self.shape) for d in self.shape))
        check_dtype(self.dtype)
        if any(d < 0 for d in self.shape):
            raise GraphError(f"negative dimension in shape {self.shape}")
        if self.numel > MAX_ELEMENTS:
            raise GraphError(f"shape {self.shape} has {self.numel:.3g} elements, more than tunedb "
                             f"handles (2^{MAX_ELEMENTS.bit_length() - 1})")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints: no int64 overflow

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(d: Mapping) -> TensorType:
        return TensorType(tuple(d["shape"]), d["dtype"])

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


def _freeze(v: Any) -> AttrValue:
    """Attribute values are ints, floats, strings, bools, None, or (nested) tuples of those."""
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    if v is None or isinstance(v, str):
        return v
    raise GraphError(f"unsupported attribute value {v!r} of type {type(v).__name__}")


def _thaw(v: AttrValue) -> Any:
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, AttrValue], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        items = self.attrs.items() if isinstance(self.attrs, Mapping) else self.attrs
        object.__setattr__(self, "attrs", tuple(sorted((str(k), _freeze(v)) for k, v in items)))

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, AttrValue]:
        return dict(self.attrs)

    def to_json(self) -> dict:
        return {"op": self.op, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "attrs": {k: _thaw(v) for k, v in self.attrs}}

    @staticmethod
    def from_json(d: Mapping) -> Node:
        return Node(d["op"], tuple(d["inputs"]), tuple(d["outputs"]), d.get("attrs", {}))


def _np_dtype(dtype: str) -> np.dtype:
    # bfloat16 has no NumPy dtype: constants keep its raw bits as uint16.
    return np.dtype("uint16") if dtype == "bfloat16" else np.dtype(dtype)


@dataclass(frozen=True)
class Constant:
    """A constant tensor; ``data`` is the raw little-endian bytes in ``type.dtype``."""

    type: TensorType
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.data) != self.type.nbytes:
            raise GraphError(f"constant of type {self.type} needs {self.type.nbytes} bytes, has "
                             f"{len(self.data)}")

    @staticmethod
    def from_array(a: np.ndarray, dtype: str | None = None) -> Constant:
        a = np.asarray(a)
        dtype = dtype or ("bool" if a.dtype == np.bool_ else str(a.dtype))
        if dtype == "bfloat16":
            bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
            raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even
        else:
            raw = np.ascontiguousarray(a, dtype=_np_dtype(dtype).newbyteorder("<"))
        return Constant(TensorType(a.shape, dtype), raw.tobytes())

    @property
    def array(self) -> np.ndarray:
        """The value as NumPy; bfloat16 is widened to float32."""
        a = np.frombuffer(self.data, dtype=_np_dtype(self.type.dtype).newbyteorder("<"))
        if self.type.dtype == "bfloat16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return a.reshape(self.type.shape).copy()

    def to_json(self) -> dict:
        return {"type": self.type.to_json(), "data": base64.b64encode(self.data).decode("ascii")}

    @staticmethod
    def from_json(d: Mapping) -> Constant:
        return Constant(TensorType.from_json(d["type"]), base64.b64decode(d["data"]))


@dataclass(frozen=True)
class Graph:
    """A typed DAG. ``nodes`` are in topological order; ``types`` covers every value."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[Node, ...]
    types: tuple[tuple[str, TensorType], ...]
    constants: tuple[tuple[str, Constant], ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("inputs", "outputs", "nodes"):
            object.__setattr__(self, f, tuple(getattr(self, f)))
        for f in ("types", "constants"):
            v = getattr(self, f)
            object.__setattr__(self, f, tuple(sorted(v.items() if isinstance(v, Mapping) else v)))
        for name, t in self.types:
            if 0 in t.shape:  # nothing to compute or time; kernels assume at least one element
                raise GraphError(f"value {name!r} has a zero-size dimension: {t}")

    @property
    def type_map(self) -> dict[str, TensorType]:
        return dict(self.types)

    @property
    def constant_map(self) -> dict[str, Constant]:
        return dict(self.constants)

    def io_bytes(self) -> tuple[int, int]:
        """Bytes of the inputs and of the outputs (an output listed twice is written once)."""
        t = self.type_map
        return (sum(t[v].nbytes for v in self.inputs),
                sum(t[v].nbytes for v in dict.fromkeys(self.outputs)))

    def floor_bytes(self) -> int:
        """Fewest bytes a kernel computing this graph must move: each input read once, each
        output written once (an output listed twice, or that is an input passed through, counts
        once)."""
        t = self.type_map
        return sum(t[v].nbytes for v in dict.fromkeys(list(self.inputs) + list(self.outputs)))

    def type_of(self, value: str) -> TensorType:
        for k, t in self.types:
            if k == value:
                return t
        raise GraphError(f"value {value!r} has no type in graph {self.name or '<unnamed>'}")

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    out.setdefault(i, []).append(n)
        return out

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "nodes": [n.to_json() for n in self.nodes],
            "types": {k: t.to_json() for k, t in self.types},
            "constants": {k: c.to_json() for k, c in self.constants},
        }

    @staticmethod
    def from_json(d: Mapping) -> Graph:
        """A graph from its JSON; a missing key or a wrong type is a GraphError naming it."""
        try:
            return Graph(
                inputs=tuple(d["inputs"]),
                outputs=tuple(d["outputs"]),
                nodes=tuple(Node.from_json(n) for n in d["nodes"]),
                types={k: TensorType.from_json(t) for k, t in d["types"].items()},
                constants={k: Constant.from_json(c) for k, c in d.get("constants", {}).items()},
                name=d.get("name", ""),
            )
        except KeyError as e:
            raise GraphError(f"graph JSON lacks the key {e.args[0]!r}") from None
        except (TypeError, AttributeError, binascii.Error) as e:
            raise GraphError(f"graph JSON is malformed: {' '.join(str(e).split())}") from None


# Op table: name -> (min inputs, max inputs (None = variadic), outputs (None = from attrs),
# attribute defaults). Attribute values use the types of ``AttrValue``; axes are ints that may be
# negative (normalised by shape inference). Composite layers (softmax, log_softmax, layernorm,
# rmsnorm, batchnorm) are built from these primitives by ``tunedb.graph.builder``.
_UNARY = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh",
          "sigmoid", "relu", "erf", "floor", "ceil", "sign", "not", "identity")
_BINARY = ("add", "sub", "mul", "div", "pow", "max", "min", "mod",
           "eq", "ne", "lt", "le", "gt", "ge", "and", "or")
_REDUCE = ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod")

OP_SPECS: dict[str, tuple[int, int | None, int | None, dict[str, AttrValue]]] = {
    **{op: (1, 1, 1, {}) for op in _UNARY},
    "gelu": (1, 1, 1, {"approximate": "none"}),          # "none" (erf form) or "tanh"
    "clip": (1, 1, 1, {"min": None, "max": None}),
    "cast": (1, 1, 1, {"to": "float32"}),
    "leaky_relu": (1, 1, 1, {"alpha": 0.01}),
    **{op: (2, 2, 1, {}) for op in _BINARY},
    "where": (3, 3, 1, {}),                               # where(cond, a, b)
    **{op: (1, 1, 1, {"axes": None, "keepdims": False}) for op in _REDUCE},  # axes None = all
    "argmax": (1, 1, 1, {"axis": 0, "keepdims": False}),
    "transpose": (1, 1, 1, {"perm": None}),               # None = reverse axes
    "reshape": (1, 1, 1, {"shape": ()}),                  # static target shape, no -1 left
    "squeeze": (1, 1, 1, {"axes": None}),
    "unsqueeze": (1, 1, 1, {"axes": ()}),
    "expand": (1, 1, 1, {"shape": ()}),                   # NumPy broadcast_to semantics
    "slice": (1, 1, 1, {"starts": (), "ends": (), "axes": (), "steps": ()}),
    "concat": (1, None, 1, {"axis": 0}),
    "split": (1, 1, None, {"axis": 0, "sizes": ()}),      # outputs = len(sizes)
    "pad": (1, 1, 1, {"pads": (), "value": 0.0}),         # pads: (begin..., end...) like ONNX
    "gather": (2, 2, 1, {"axis": 0}),                     # np.take(data, indices, axis)
    "gather_elements": (2, 2, 1, {"axis": 0}),            # np.take_along_axis
    "matmul": (2, 2, 1, {}),                              # np.matmul semantics, batched
    "gemm": (2, 3, 1, {"alpha": 1.0, "beta": 1.0, "trans_a": False, "trans_b": False}),
    "conv2d": (2, 3, 1, {"strides": (1, 1), "pads": (0, 0, 0, 0), "dilations": (1, 1), "groups": 1}),
    "max_pool2d": (1, 1, 1, {"kernel": (1, 1), "strides": (1, 1), "pads": (0, 0, 0, 0),
                             "dilations": (1, 1), "ceil_mode": False}),
    "avg_pool2d": (1, 1, 1, {"kernel": (1, 1), "strides": (1, 1), "pads": (0, 0, 0, 0),
                             "ceil_mode": False, "count_include_pad": False}),
    "global_avg_pool": (1, 1, 1, {}),                     # NCHW -> NC11
    "global_max_pool": (1, 1, 1, {}),
}


def fresh_name(taken: set[str], base: str, sep: str = "_") -> str:
    """``base``, or ``base{sep}{k}`` with the smallest k >= 1 not in ``taken``; added to ``taken``.
    Graph rewrites name the values they add with it."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}{sep}{k}"
    taken.add(name)
    return name


def spliced_nodes(nodes: Sequence[Node], replace: Mapping[int, Sequence[Node]], drop: AbstractSet[int]
                  ) -> list[Node]:
    """``nodes`` in order, node i replaced by ``replace[i]`` and the ``drop`` ones left out: how
    graph rewrites put their new nodes where the old ones stood."""
    out: list[Node] = []
    for i, n in enumerate(nodes):
        if i in replace:
            out += replace[i]
        elif i not in drop:
            out.append(n)
    return out


def op_spec(op: str) -> tuple[int, int | None, int | None, dict[str, AttrValue]]:
    try:
        return OP_SPECS[op]
    except KeyError:
        raise GraphError(f"unknown op {op!r}") from None
