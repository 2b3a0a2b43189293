"""Graph rewrite: a convolution's bias joins the elementwise kernel after it.

The executor runs a convolution as cuBLAS (after an im2col kernel unless 1x1) and then adds the
bias in a kernel of its own; the ReLU after it is another kernel. ``split_conv_bias`` rewrites
``conv2d(x, w, b)`` as ``add(conv2d(x, w), reshape(b, [C, 1, 1]))``, so that the fusion search
puts the bias add into the fused kernel of what follows (``add + relu``): one kernel fewer per
convolution, and the reshape is a view. Depthwise convolutions keep their bias: their kernel adds
it (``tunedb.runtime.executor_ops``).
"""

from __future__ import annotations

from tunedb.graph.ir import Graph, Node, TensorType, fresh_name
from tunedb.graph.ops import infer_graph


def split_conv_bias(graph: Graph) -> Graph:
    """``graph`` with every biased ``conv2d`` split into the convolution and a broadcast add."""
    types = dict(graph.types)
    taken = set(types)
    nodes: list[Node] = []

    changed = False
    for n in graph.nodes:
        depthwise = n.op == "conv2d" and n.attr("groups", 1) > 1 and \
            n.attr("groups") == types[n.inputs[0]].shape[1] == types[n.outputs[0]].shape[1]
        if n.op != "conv2d" or len(n.inputs) < 3 or not n.inputs[2] or depthwise:
            nodes.append(n)  # a depthwise kernel adds its bias itself
            continue
        changed = True
        y = n.outputs[0]
        raw, bias = fresh_name(taken, f"{y}.nobias", sep=""), fresh_name(taken, f"{y}.bias", sep="")
        channels = types[y].shape[1]
        nodes.append(Node("conv2d", n.inputs[:2], (raw,), n.attrs))
        nodes.append(Node("reshape", (n.inputs[2],), (bias,), {"shape": (channels, 1, 1)}))
        nodes.append(Node("add", (raw, bias), (y,)))
        types[raw] = types[y]
        types[bias] = TensorType((channels, 1, 1), types[n.inputs[2]].dtype)
    if not changed:
        return graph
    return infer_graph(Graph(graph.inputs, graph.outputs, nodes, types, graph.constants, graph.name))
