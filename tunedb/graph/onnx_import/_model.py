"""ONNX model files: loading and checking, dtype names, stripping and filling initializers.

Shipped benchmark graphs keep the repository light by *stripping* large float initializers: each
becomes a graph input of the same name and type, listed in the model's ``metadata_props`` under
``STRIPPED_KEY``. ``fill_model`` puts seeded values back (the rule is in ``stripped_values``).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tunedb.graph.ir import GraphError

STRIPPED_KEY = "tunedb.stripped_initializers"
_STRIP_MIN_BYTES = 1024

try:  # ml_dtypes ships with onnx >= 1.15 and gives bfloat16 a NumPy dtype.
    import ml_dtypes

    BF16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - onnx depends on ml_dtypes
    BF16 = None


class OnnxImportError(GraphError):
    """An ONNX model cannot be imported; the message is one line naming the problem."""


_DTYPES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16",
           TensorProto.BFLOAT16: "bfloat16", TensorProto.INT32: "int32",
           TensorProto.INT64: "int64", TensorProto.BOOL: "bool"}
_ONNX_OF = {v: k for k, v in _DTYPES.items()}


def dtype_of_onnx(elem_type: int, what: str = "tensor") -> str:
    """tunedb dtype name of an ONNX ``TensorProto`` element type."""
    if elem_type not in _DTYPES:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() \
            else str(elem_type)
        raise OnnxImportError(f"{what} has unsupported dtype {name}; tunedb supports "
                              f"{', '.join(TensorProto.DataType.Name(k) for k in _DTYPES)}")
    return _DTYPES[elem_type]


def onnx_dtype(dtype: str) -> int:
    """ONNX element type of a tunedb dtype name."""
    return _ONNX_OF[dtype]


def dtype_of_array(a: np.ndarray, what: str) -> str:
    if BF16 is not None and a.dtype == BF16:
        return "bfloat16"
    name = "bool" if a.dtype == np.bool_ else str(a.dtype)
    if name not in _ONNX_OF:
        raise OnnxImportError(f"{what} has unsupported dtype {name}")
    return name


# ---------------------------------------------------------------------------------------------
# Loading, stripping and filling models

def load_model(path_or_model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """Read and check an ONNX model; every failure is an ``OnnxImportError`` with one line."""
    if isinstance(path_or_model, onnx.ModelProto):
        model = path_or_model
        where = f"model {model.graph.name or '<unnamed>'!r}"
    else:
        path = os.fspath(path_or_model)
        where = repr(path)
        if not os.path.isfile(path):
            raise OnnxImportError(f"ONNX file {where} not found")
        try:
            model = onnx.load(path)
        except Exception as e:  # DecodeError, truncated files, missing external data
            raise OnnxImportError(f"{where} is not a readable ONNX model: "
                                  f"{one_line(e) or type(e).__name__}") from None
    if not model.HasField("graph") or not model.graph.node and not model.graph.output:
        raise OnnxImportError(f"{where} holds no ONNX graph")
    try:
        onnx.checker.check_model(_checkable(model))
    except Exception as e:  # onnx.checker.ValidationError and friends
        raise OnnxImportError(f"{where} fails the ONNX checker: {one_line(e)}") from None
    return model


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as the checker should see it: ORT's SimplifiedLayerNormalization lives in the
    default domain there but has no ONNX schema, and onnx >= 1.20 refuses GroupNormalization in
    opsets 18-20 as deprecated (opset 21 changed its affine) though exporters write it and
    onnxruntime runs it. The check runs on a copy that moves those nodes to the
    ``com.microsoft`` domain, where the checker skips unknown ops."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def unchecked(n: onnx.NodeProto) -> bool:
        return n.domain in ("", "ai.onnx") and (
            n.op_type == "SimplifiedLayerNormalization"
            or n.op_type == "GroupNormalization" and 18 <= opset < 21)

    if not any(unchecked(n) for n in model.graph.node):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in m.graph.node:
        if unchecked(n):
            n.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def one_line(e: BaseException) -> str:
    """An exception's text on one line (the checker's messages span several)."""
    text = " ".join(s.strip() for s in str(e).splitlines() if s.strip())
    return text if len(text) <= 300 else text[:297] + "..."


def stripped_names(model: onnx.ModelProto) -> list[str]:
    """Names of the initializers ``strip_model`` turned into graph inputs (in order)."""
    for p in model.metadata_props:
        if p.key == STRIPPED_KEY:
            try:
                names = json.loads(p.value)
            except ValueError:
                raise OnnxImportError(f"metadata {STRIPPED_KEY!r} is not a JSON list") from None
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise OnnxImportError(f"metadata {STRIPPED_KEY!r} is not a JSON list of names")
            return names
    return []


def strip_model(model: onnx.ModelProto, min_bytes: int = _STRIP_MIN_BYTES) -> onnx.ModelProto:
    """Copy of ``model`` whose float initializers larger than ``min_bytes`` became graph inputs.

    The names are recorded under ``STRIPPED_KEY`` so that ``fill_model`` can restore values.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    keep, stripped = [], list(stripped_names(out))
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    for init in g.initializer:
        size = numpy_helper.to_array(init).nbytes
        if init.data_type in floats and size > min_bytes:
            stripped.append(init.name)
            if not any(i.name == init.name for i in g.input):
                g.input.append(helper.make_tensor_value_info(init.name, init.data_type, init.dims))
        else:
            keep.append(init)
    del g.initializer[:]
    g.initializer.extend(keep)
    _set_meta(out, stripped)
    return out


def _set_meta(model: onnx.ModelProto, names: list[str]) -> None:
    props = [(p.key, p.value) for p in model.metadata_props if p.key != STRIPPED_KEY]
    if names:
        props.append((STRIPPED_KEY, json.dumps(names)))
    del model.metadata_props[:]
    for k, v in props:
        model.metadata_props.add(key=k, value=v)


def stripped_values(name: str, shape: Sequence[int], dtype: str, seed: int = 0) -> np.ndarray:
    """Deterministic stand-in weights for a stripped initializer.

    Seed rule: ``np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])`` draws
    ``standard_normal(shape)`` in float64, times 0.02, rounded to ``dtype`` (bfloat16 comes back
    as a ``ml_dtypes.bfloat16`` array). A name ending in ``running_var`` gets instead
    ``1 + |standard_normal|`` so that a stripped batch-norm variance stays positive. The values
    depend on (seed, name, shape, dtype) only, not on the order of the initializers.
    """
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])
    v = rng.standard_normal(tuple(shape)) * 0.02
    if name.endswith("running_var"):
        v = 1.0 + np.abs(v) * 50.0
    if dtype == "bfloat16":
        return v.astype(np.float32).astype(BF16)
    if dtype not in ("float32", "float16"):
        raise OnnxImportError(f"stripped initializer {name!r} has non-float dtype {dtype}")
    return v.astype(dtype)


def fill_model(model: onnx.ModelProto | str | os.PathLike, seed: int = 0,
               values: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Copy of ``model`` with every stripped initializer embedded again: ``values[name]`` where
    given (rounded to the initializer's dtype), else ``stripped_values``."""
    src = load_model(model) if not isinstance(model, onnx.ModelProto) else model
    out = onnx.ModelProto()
    out.CopyFrom(src)
    g = out.graph
    names = set(stripped_names(out))
    kept = []
    for vi in g.input:
        if vi.name not in names:
            kept.append(vi)
            continue
        t = vi.type.tensor_type
        dims = [d.dim_value for d in t.shape.dim]
        if any(not d.HasField("dim_value") for d in t.shape.dim):
            raise OnnxImportError(f"stripped initializer {vi.name!r} has no static shape")
        dtype = dtype_of_onnx(t.elem_type, f"input {vi.name!r}")
        if values is not None and vi.name in values:
            v = np.asarray(values[vi.name], dtype=np.float32).reshape(dims)
            vals = v.astype(BF16) if dtype == "bfloat16" else v.astype(dtype)
        else:
            vals = stripped_values(vi.name, dims, dtype, seed)
        g.initializer.append(numpy_helper.from_array(vals, vi.name))
    del g.input[:]
    g.input.extend(kept)
    _set_meta(out, [])
    return out
