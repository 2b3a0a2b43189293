"""Tensor-graph IR, op semantics and shape inference, builder, float64 reference, hashing."""

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.hashing import graph_hash, node_hashes
from tunedb.graph.ir import (
    DTYPES,
    FLOAT_DTYPES,
    OP_SPECS,
    Constant,
    Graph,
    GraphError,
    Node,
    TensorType,
)
from tunedb.graph.ops import (
    COMPUTE_OPS,
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    LAYOUT_OPS,
    OTHER_REDUCTIONS,
    REDUCTIONS,
    canonical_attrs,
    check_node,
    infer_graph,
    infer_node,
    is_elementwise,
    is_memory_bound,
)
from tunedb.graph.reference import run_reference

__all__ = [
    "COMPUTE_OPS", "DTYPES", "ELEMENTWISE_BINARY", "ELEMENTWISE_UNARY", "FLOAT_DTYPES",
    "LAYOUT_OPS", "OP_SPECS", "OTHER_REDUCTIONS", "REDUCTIONS", "Constant", "Graph", "GraphBuilder",
    "GraphError", "Node", "TensorType", "canonical_attrs", "check_node", "graph_hash",
    "infer_graph", "infer_node", "is_elementwise", "is_memory_bound", "node_hashes",
    "run_reference",
]
