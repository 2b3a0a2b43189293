"""The windowed generator's match: which node a window kernel is built around, and the split of a
graph into prologue, window node and epilogue (``match_window``); ``gen_window`` generates from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import canonical_attrs, is_elementwise
from tunedb.kernels.analysis import UnsupportedFusion
from tunedb.kernels.gen_resample import is_resample, resample_chain

WINDOW_OPS = ("conv2d", "max_pool2d", "avg_pool2d")

class GraphView:
    """What ``op_expr`` reads of an Analysis: the graph and value resolution (no aliases here;
    the transposed-rows generator reads through it too)."""

    def __init__(self, g: Graph) -> None:
        self.graph = g

    def resolve(self, v: str) -> str:
        return v


@dataclass(frozen=True)
class WindowKernel:
    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple  # graph inputs, graph outputs, then R and C as numpy.int64
    R: int
    C: int
    shared_bytes: int = 0  # dynamic shared memory ("plane" kernels: the input plane)


@dataclass(frozen=True)
class WindowMatch:
    node: Node
    prologue: tuple[Node, ...]
    epilogue: tuple[Node, ...]
    in_shape: tuple[int, int, int, int]
    out_shape: tuple[int, int, int, int]
    pooled: tuple[Node, ...] = ()  # means over the output plane (``plane_mean``): plane layout only
    chain: tuple[Node, ...] = ()  # a resample's gather along the other axis, after ``node``

    @property
    def out(self) -> str:
        """The window's value: the last gather's of a resample chain."""
        return (self.chain[-1] if self.chain else self.node).outputs[0]


def _is_depthwise(g: Graph, n: Node) -> bool:
    if n.op != "conv2d":
        return False
    x, w = g.type_of(n.inputs[0]).shape, g.type_of(n.inputs[1]).shape
    return (len(x) == 4 and len(w) == 4 and n.attr("groups") == x[1] == w[0] and w[1] == 1)


def is_window_node(g: Graph, n: Node) -> bool:
    """A node the windowed generator can be built around."""
    if n.op == "conv2d":
        return _is_depthwise(g, n)
    if n.op == "gather":
        return is_resample(g, n)
    return n.op in ("max_pool2d", "avg_pool2d") and g.type_of(n.inputs[0]).rank == 4


def plane_mean(g: Graph, n: Node) -> bool:
    """A mean over the last two axes of a 4-D value, kept as [N, C, 1, 1] (EfficientNet's
    squeeze-and-excitation pool): a "plane" window kernel computes it beside its outputs."""
    t = g.type_of(n.inputs[0])
    if n.op == "global_avg_pool":
        return t.rank == 4
    if n.op != "reduce_mean" or t.rank != 4:
        return False
    a = canonical_attrs(n, [g.type_of(v) for v in n.inputs])
    return tuple(sorted(x % 4 for x in a["axes"])) == (2, 3) and bool(a["keepdims"])


def match_window(g: Graph) -> WindowMatch:
    """Split ``g`` into prologue, window node and epilogue; raises ``UnsupportedFusion``."""
    windows = [n for n in g.nodes if n.op in WINDOW_OPS]
    chain = resample_chain(g) if not windows else ()
    if chain:
        windows = [chain[0]]
    if len(windows) != 1 or not is_window_node(g, windows[0]):
        raise UnsupportedFusion("a windowed kernel needs exactly one depthwise conv2d, 2-D pool "
                                "or resample")
    w = windows[0]
    chain = chain[1:]
    pooled = tuple(n for n in g.nodes if plane_mean(g, n))
    readers = {v for n in g.nodes for v in n.inputs}
    for n in pooled:
        if n.outputs[0] not in g.outputs or n.outputs[0] in readers:
            raise UnsupportedFusion(f"plane mean {n.outputs[0]!r} must be an output read by no node")
    for n in g.nodes:
        if n is not w and n not in pooled and n not in chain and not is_elementwise(n.op):
            raise UnsupportedFusion(f"{n.op} {n.outputs[0]!r} is not elementwise")
    prod = {n.outputs[0]: n for n in g.nodes}
    up: set[str] = set()

    def walk(v: str) -> None:
        n = prod.get(v)
        if n is not None and v not in up:
            up.add(v)
            for i in n.inputs:
                walk(i)

    walk(w.inputs[0])
    for extra in [v for n in (w,) + chain for v in n.inputs[1:]]:
        if extra in prod:
            raise UnsupportedFusion(f"window operand {extra!r} is computed, not an input")
    pro = tuple(n for n in g.nodes if n.outputs[0] in up)
    epi = tuple(n for n in g.nodes if n is not w and n.outputs[0] not in up and n not in pooled
                and n not in chain)
    xs = g.type_of(w.inputs[0]).shape
    ys = g.type_of((chain[-1] if chain else w).outputs[0]).shape
    for n in pro:
        if g.type_of(n.outputs[0]).shape != xs and g.type_of(n.outputs[0]).numel != 1:
            raise UnsupportedFusion(f"prologue value {n.outputs[0]!r} is not shaped like the input")
    for n in epi:
        if g.type_of(n.outputs[0]).shape != ys:
            raise UnsupportedFusion(f"epilogue value {n.outputs[0]!r} is not shaped like the output")
        if any(i in up for i in n.inputs):
            raise UnsupportedFusion(f"epilogue {n.outputs[0]!r} reads a prologue value")
    for v in g.outputs:
        if v in up:
            raise UnsupportedFusion(f"output {v!r} is a prologue value")
    wout = (chain[-1] if chain else w).outputs[0]
    epi_values = {wout} | {n.outputs[0] for n in epi}
    for n in pooled:
        if n.inputs[0] not in epi_values:
            raise UnsupportedFusion(f"plane mean {n.outputs[0]!r} reads no window or epilogue value")
    if w.op == "gather" and pooled:
        raise UnsupportedFusion("a resample takes no plane mean")
    return WindowMatch(w, pro, epi, tuple(xs), tuple(ys), pooled, chain)
