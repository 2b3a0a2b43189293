"""Import ONNX models (default domain, opsets 11-23) into tunedb graphs.

    g = import_onnx("bert_layer.onnx", fill_initializers=True)

``import_onnx`` maps ONNX ops to tunedb primitives through ``GraphBuilder`` (so composites such
as softmax and layernorm expand as everywhere else in tunedb), folds the shape arithmetic that
exporters emit into constants, and keeps static shapes only (symbolic dims need ``bindings``).
Every failure is an ``OnnxImportError`` (a ``GraphError``) with a one-line message.

Initializers stripped by ``strip_model`` (how the shipped ``data/graphs`` stay small) stay graph
inputs unless ``fill_initializers=True``, which fills them with ``stripped_values``;
``fill_model`` embeds the same values in a ``ModelProto`` for onnxruntime.
"""

from __future__ import annotations

import os

import onnx

from tunedb.graph.ir import Graph
from tunedb.graph.onnx_import._convert import Importer, supported_ops
from tunedb.graph.onnx_import._model import (
    STRIPPED_KEY,
    OnnxImportError,
    dtype_of_onnx,
    fill_model,
    load_model,
    onnx_dtype,
    strip_model,
    stripped_names,
    stripped_values,
)

__all__ = ["STRIPPED_KEY", "OnnxImportError", "dtype_of_onnx", "fill_model", "import_onnx",
           "load_model", "onnx_dtype", "strip_model", "stripped_names", "stripped_values",
           "supported_ops"]


def import_onnx(path_or_model: str | os.PathLike | onnx.ModelProto,
                bindings: dict[str, int] | None = None, fill_initializers: bool = False,
                seed: int = 0) -> Graph:
    """Convert an ONNX model (a path or a ``ModelProto``) to a shape-inferred tunedb ``Graph``.

    ``bindings`` size the symbolic input dims (``dim_param``). With ``fill_initializers`` the
    initializers stripped by ``strip_model`` are filled with ``stripped_values(name, shape,
    dtype, seed)``; otherwise they stay graph inputs. Graph inputs keep their ONNX names and
    the outputs keep the ONNX output order (and names, unless one clashes with a graph value).
    """
    model = load_model(path_or_model)
    if fill_initializers:
        model = fill_model(model, seed)
    return Importer(model, dict(bindings or {})).run()
