"""Group sub-graphs: what one step of a plan computes, cut out of the whole graph.

A group's sub-graph has as inputs the values it reads from outside (in order of first use) and
as outputs the values it defines that are used outside the group or are outputs of the whole
graph. Scalar constants are copied in (the generator folds them into the kernel); larger
constants stay inputs, so that a workload's hash depends on shapes, not on weight values. Names
are canonical (``x0..`` inputs, ``c0..`` constants, ``v0..`` node outputs): the same group in
every layer of a model gives the same sub-graph, the same workload hash, the same DB hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tunedb.graph.ir import Graph, GraphError, Node, TensorType
from tunedb.graph.ops import COMPUTE_OPS
from tunedb.plan.views import concat_view_nodes, output_view_nodes, strided_view_nodes

# Ops that cost no kernel when they stand alone: every buffer is contiguous row-major, so a
# reshape of one is the same bytes under another shape.
VIEW_OPS = frozenset(("reshape", "squeeze", "unsqueeze", "identity"))
# Ops the fused-kernel generator may take into a group (tunedb.kernels.analysis); anything else
# is a step of its own.
FUSABLE_OPS = frozenset((
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid",
    "relu", "erf", "floor", "ceil", "sign", "not", "gelu", "clip", "cast", "leaky_relu",
    "add", "sub", "mul", "div", "pow", "max", "min", "mod", "eq", "ne", "lt", "le", "gt", "ge",
    "and", "or", "where", "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod",
    "reshape", "squeeze", "unsqueeze", "expand", "identity", "transpose", "gather_elements",
    "slice", "split", "concat"))  # pieces of inputs: index maps (tunedb.kernels.movement)
COMPUTE_KIND = {"matmul": "matmul", "gemm": "gemm", "conv2d": "conv2d", "max_pool2d": "pool",
                "avg_pool2d": "pool", "global_avg_pool": "pool", "global_max_pool": "pool"}
INLINE_CONST_ELEMS = 1


def is_view(node: Node, types: dict[str, TensorType]) -> bool:
    """A node whose output is its input's bytes: reshape-like ops, and transposes that move
    only size-1 dims."""
    if node.op in VIEW_OPS:
        return True
    if node.op == "transpose":
        shape = types[node.inputs[0]].shape
        perm = node.attr("perm") or tuple(reversed(range(len(shape))))
        moved = [p for p in perm if shape[p] != 1]
        return moved == sorted(moved)
    return False


@dataclass(frozen=True)
class Subgraph:
    graph: Graph
    inputs: tuple[str, ...]    # values of the whole graph, matching graph.inputs
    outputs: tuple[str, ...]   # values of the whole graph, matching graph.outputs


class GraphIndex:
    """Adjacency and per-node facts of a graph, computed once for many sub-graph cuts."""

    def __init__(self, graph: Graph, concat_views: bool = False) -> None:
        self.graph = graph
        self.nodes = graph.nodes
        self.types = graph.type_map
        self.constants = graph.constant_map
        self.outputs = set(graph.outputs)
        self.producer: dict[str, tuple[int, int]] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for k, o in enumerate(n.outputs):
                self.producer[o] = (i, k)
        for i, n in enumerate(self.nodes):
            for v in dict.fromkeys(n.inputs):
                if v:
                    self.consumers.setdefault(v, []).append(i)
        self.succ: list[tuple[int, ...]] = [
            tuple(sorted({c for o in n.outputs for c in self.consumers.get(o, ())})) for n in self.nodes]
        self.pred: list[tuple[int, ...]] = [
            tuple(sorted({self.producer[v][0] for v in n.inputs if v in self.producer})) for n in self.nodes]
        self.inline = {v for v, c in self.constants.items() if c.type.numel <= INLINE_CONST_ELEMS}
        self._const_sig = {v: (c.type.dtype, c.type.shape, c.data) for v, c in self.constants.items()
                           if v in self.inline}
        self.sig = [(n.op, n.attrs, tuple(self.types[o] for o in n.outputs)) for n in self.nodes]
        strided = strided_view_nodes(self.nodes, self.types, self.consumers, self.outputs)
        # Transposes whose input the matmul before them writes in their layout (no copy).
        self.output_view = output_view_nodes(self.nodes, self.types, self.consumers, self.outputs) - strided
        self.view = [is_view(n, self.types) or i in strided or i in self.output_view
                     for i, n in enumerate(self.nodes)]
        # Concats whose producers write their slices (``views.concat_view_nodes``): no kernel,
        # and no fusion either, so the producers' steps stay what they are.
        self.concat_view: set[int] = set()
        if concat_views:
            self.concat_view = concat_view_nodes(
                self.nodes, self.types, self.outputs, {i for i, v in enumerate(self.view) if v})
            for i in self.concat_view:
                self.view[i] = True
        self.compute = [n.op in COMPUTE_OPS or n.op in COMPUTE_KIND for n in self.nodes]
        self.fusable = [n.op in FUSABLE_OPS and i not in self.concat_view for i, n in enumerate(self.nodes)]

    def is_output(self, v: str, inside: set[int] | dict[int, int]) -> bool:
        return v in self.outputs or any(c not in inside for c in self.consumers.get(v, ()))

    def key(self, nodes: Sequence[int]) -> tuple:
        """A hashable identity of the cut ``nodes`` (sorted): equal keys give equal sub-graphs
        up to names, so costs can be cached by it across repeated layers."""
        pos = {j: p for p, j in enumerate(nodes)}
        ext: dict[str, int] = {}
        parts = []
        for j in nodes:
            refs: list[Any] = []
            for v in self.nodes[j].inputs:
                pr = self.producer.get(v)
                if pr is not None and pr[0] in pos:
                    refs.append((pos[pr[0]], pr[1]))
                elif v in self.inline:
                    refs.append(("c", self._const_sig[v]))
                else:
                    if v not in ext:
                        ext[v] = len(ext)
                    refs.append(("x", ext[v], self.types[v]))
            parts.append((self.sig[j], tuple(refs)))
        outs = tuple((pos[j], k) for j in nodes for k, o in enumerate(self.nodes[j].outputs)
                     if self.is_output(o, pos))
        return tuple(parts), outs

    def cut(self, nodes: Iterable[int], name: str = "") -> Subgraph:
        """The sub-graph of ``nodes`` (see the module docstring)."""
        nodes = sorted(set(nodes))
        if not nodes:
            raise GraphError("cannot cut an empty group out of a graph")
        for j in nodes:
            if not 0 <= j < len(self.nodes):
                raise GraphError(f"node index {j} out of range for {len(self.nodes)} nodes")
        pos = {j: p for p, j in enumerate(nodes)}
        rename: dict[str, str] = {}
        inputs: list[str] = []
        consts = {}
        types: dict[str, TensorType] = {}
        new_nodes = []
        counter = 0
        for j in nodes:
            n = self.nodes[j]
            ins = []
            for v in n.inputs:
                if v not in rename:
                    pr = self.producer.get(v)
                    if pr is not None and pr[0] in pos:
                        raise GraphError(f"node {j} reads {v!r} before its producer in the group")
                    if v in self.inline:
                        rename[v] = f"c{len(consts)}"
                        consts[rename[v]] = self.constants[v]
                    else:
                        rename[v] = f"x{len(inputs)}"
                        inputs.append(v)
                    types[rename[v]] = self.types[v]
                ins.append(rename[v])
            outs = []
            for o in n.outputs:
                rename[o] = f"v{counter}"
                counter += 1
                types[rename[o]] = self.types[o]
                outs.append(rename[o])
            new_nodes.append(Node(n.op, tuple(ins), tuple(outs), n.attrs))
        outputs = [o for j in nodes for o in self.nodes[j].outputs if self.is_output(o, pos)]
        g = Graph(inputs=tuple(rename[v] for v in inputs), outputs=tuple(rename[v] for v in outputs),
                  nodes=tuple(new_nodes), types=types, constants=consts, name=name)
        return Subgraph(g, tuple(inputs), tuple(outputs))


def extract_subgraph(graph: Graph, node_ids: Iterable[int], name: str = "") -> Graph:
    """The sub-graph computing the nodes ``node_ids`` (indices into ``graph.nodes``): inputs are
    the values it reads from outside, outputs the values used outside it or returned by
    ``graph``; canonical names, so equal groups give equal graphs and workload hashes."""
    return GraphIndex(graph).cut(node_ids, name).graph
