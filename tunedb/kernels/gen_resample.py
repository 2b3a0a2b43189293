"""A resample (``gather`` along H and/or W of an NCHW tensor at integer indices, as a nearest
upsample exports) as the window of ``gen_window``'s kernels: one output a thread reads its one
tap at the gathered indices, the elementwise work before it run on the tap (a residual add
before a UNet upsample) and after it on the output. The runtime's gather copies ran 3-5x their
bytes, one after another (``docs/generalization-h200.md``, cause E)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tunedb.graph.ir import Graph, Node
from tunedb.kernels.analysis import UnsupportedFusion
from tunedb.kernels.expr import FLOATS


def gather_axis(g: Graph, n: Node) -> int:
    return int(n.attr("axis") or 0) % max(1, g.type_of(n.inputs[0]).rank)


def is_resample(g: Graph, n: Node) -> bool:
    """A ``gather`` along H or W of a 4-D tensor at 1-D integer indices (an input, or a constant
    that is no rotation ``(c + s) % n``, which the row generators read as an index map)."""
    if n.op != "gather" or len(n.inputs) != 2 or g.type_of(n.inputs[0]).rank != 4:
        return False
    it = g.type_of(n.inputs[1])
    if gather_axis(g, n) not in (2, 3) or it.rank != 1 or it.dtype not in ("int32", "int64"):
        return False
    c = g.constant_map.get(n.inputs[1])
    if c is None:
        return True
    n_ax = g.type_of(n.inputs[0]).shape[gather_axis(g, n)]
    vals = c.array.reshape(-1).astype(np.int64) % max(1, n_ax)
    return len(vals) > 0 and bool((vals != (vals[0] + np.arange(len(vals))) % n_ax).any())


def resample_chain(g: Graph) -> tuple[Node, ...]:
    """The graph's resample gathers in order, one or one per axis (H then W or W then H), the
    second reading only the first's value; () when there are none."""
    gs = [n for n in g.nodes if n.op == "gather" and is_resample(g, n)]
    if len(gs) == 2:
        first, second = gs
        if (second.inputs[0] != first.outputs[0] or gather_axis(g, first) == gather_axis(g, second)
                or first.outputs[0] in g.outputs
                or any(first.outputs[0] in n.inputs for n in g.nodes if n is not second)):
            raise UnsupportedFusion("two resample gathers must be one along each axis, in a chain")
    elif len(gs) > 2:
        raise UnsupportedFusion(f"{len(gs)} resample gathers: at most one per axis")
    return tuple(gs)


def resample_body(gen: Any, lines: list[str], it: str) -> list[str]:
    """Lines reading the resampled tap of output (n, c, oh, ow0) into ``acc[0]``: each gathered
    axis's index from its index array (negative counts from the end; clamped into the axis,
    so an index out of range reads an edge, never outside the tensor)."""
    g, m = gen.g, gen.m
    _, _, H, W = m.in_shape
    pos = {2: "oh", 3: "ow0"}
    for n in (m.node,) + m.chain:
        ax = gather_axis(g, n)
        size = H if ax == 2 else W
        raw = f"(int){gen.buffer(n.inputs[1])}[{pos[ax]}]"
        pos[ax] = f"i{ax}"
        lines.append(f"int i{ax} = {raw};")
        lines.append(f"i{ax} = min(max(i{ax} < 0 ? i{ax} + {size} : i{ax}, 0), {size - 1});")
    tap = [f"const {it} xi = nc * {H * W} + ({it}){pos[2]} * {W} + {pos[3]};"]
    xv = gen.cone(m.prologue, m.node.inputs[0], "xi", m.in_shape, {}, "q", tap)
    x = m.node.inputs[0]
    tap.append(f"float acc[1];\nacc[0] = {xv if g.type_of(x).dtype in FLOATS else f'(float)({xv})'};")
    return lines + tap
