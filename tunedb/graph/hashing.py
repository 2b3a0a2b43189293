"""Canonical structural hash of a graph: the workload identity in the tuning database.

A Merkle hash over the DAG, so it depends on structure only, not on value names, the graph's
name, or the order of independent nodes:

- a graph input is hashed from its position in ``graph.inputs`` and its type;
- a constant from its dtype, shape and bytes;
- a node from its op, its canonical attributes (defaults filled, axes normalised: see
  ``ops.check_node``) and the hashes of its inputs; each output from the node hash and its index;
- the graph from the ordered input types and the hashes of the ordered outputs.

Every hash is SHA-256 over canonical JSON, never Python's ``hash()``, so it is the same on every
machine and Python version. Bump ``SCHEME`` whenever the scheme changes.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from tunedb.graph.ir import Graph
from tunedb.graph.ops import canonical_attrs, infer_graph

SCHEME = "tunedb.graph_hash/1"


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the byte string every hash is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256_hex(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _jsonable(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}  # canonical JSON refuses inf/nan
    return v


def _h(obj: Any) -> str:
    return sha256_hex(canonical_json(obj))


def node_hashes(graph: Graph) -> dict[str, str]:
    """Structural hash of every value of ``graph`` (inputs, constants, node outputs)."""
    return _value_hashes(infer_graph(graph))


def _value_hashes(graph: Graph) -> dict[str, str]:
    types = graph.type_map
    out: dict[str, str] = {}
    for i, v in enumerate(graph.inputs):
        out[v] = _h(["input", i, types[v].to_json()])
    for v, c in graph.constants:
        out[v] = _h(["const", c.type.dtype, list(c.type.shape), sha256_hex(c.data)])
    for node in graph.nodes:
        attrs = canonical_attrs(node, [types[v] for v in node.inputs])
        nh = _h(["node", node.op, {k: _jsonable(a) for k, a in attrs.items()},
                 [out[v] for v in node.inputs]])
        for k, v in enumerate(node.outputs):
            out[v] = _h(["out", nh, k])
    return out


def graph_hash(graph: Graph) -> str:
    """Hex SHA-256 identifying the computation of ``graph`` (see the module docstring)."""
    graph = infer_graph(graph)
    values = _value_hashes(graph)
    types = graph.type_map
    return _h([SCHEME, [types[v].to_json() for v in graph.inputs], [values[v] for v in graph.outputs]])
