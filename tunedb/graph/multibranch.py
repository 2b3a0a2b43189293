"""Multi-branch CNN graphs for stage scheduling, written with ``GraphBuilder``.

* ``nasnet_a_graph``: NASNet-A-style normal cells (Zoph et al. 2018): each cell takes the two
  previous cell outputs, makes five blocks of two branches added together (separable 3x3 / 5x5
  convolutions, 3x3 average and max pooling, identity) and concatenates the blocks, then a 1x1
  convolution brings the channels back.
* ``randwire_graph``: a RandWire-style stage (Xie et al. 2019): a Watts-Strogatz random graph
  (n nodes, k neighbours, rewiring p, seeded) oriented by node index; each node sums its inputs,
  applies ReLU and a separable 3x3 convolution; the output is the mean of the sink nodes.

Every weight is a graph input named ``w*`` (the caller chooses the values: fan-in-scaled normal
for the benchmarks); the activation input is ``x``. Separable convolution = depthwise 3x3
(``groups = channels``) then pointwise 1x1, as in both papers; batch norm is folded away.
"""

from __future__ import annotations

import numpy as np

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph


class _Net:
    def __init__(self, name: str) -> None:
        self.b = GraphBuilder(name)
        self.n = 0

    def weight(self, shape: tuple[int, ...]) -> str:
        self.n += 1
        return self.b.input(f"w{self.n}", shape)

    def conv(self, x: str, cout: int, k: int, groups: int = 1) -> str:
        cin = self.b.type_of(x).shape[1]
        w = self.weight((cout, cin // groups, k, k))
        p = k // 2
        return self.b.conv2d(x, w, strides=(1, 1), pads=(p, p, p, p), dilations=(1, 1), groups=groups)

    def sep(self, x: str, k: int) -> str:
        c = self.b.type_of(x).shape[1]
        return self.conv(self.conv(self.b.relu(x), c, k, groups=c), c, 1)

    def pool(self, x: str, kind: str) -> str:
        op = self.b.avg_pool2d if kind == "avg" else self.b.max_pool2d
        kw = {"count_include_pad": False} if kind == "avg" else {}
        return op(x, kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), **kw)


def nasnet_a_graph(batch: int = 1, channels: int = 44, size: int = 28, cells: int = 2) -> Graph:
    """NASNet-A-style normal cells on a [batch, channels, size, size] input (see the module)."""
    net = _Net(f"nasnet_a_b{batch}")
    b = net.b
    x = b.input("x", (batch, channels, size, size))
    prev, cur = x, net.conv(b.relu(x), channels, 1)
    for _ in range(cells):
        h0, h1 = net.conv(b.relu(prev), channels, 1), net.conv(b.relu(cur), channels, 1)
        blocks = [
            b.add(net.sep(net.sep(h1, 5), 5), net.sep(net.sep(h0, 3), 3)),
            b.add(net.sep(net.sep(h0, 5), 5), net.sep(net.sep(h0, 3), 3)),
            b.add(net.pool(h1, "avg"), h0),
            b.add(net.pool(h0, "avg"), net.pool(h0, "avg")),
            b.add(net.sep(net.sep(h1, 3), 3), h1),
        ]
        cat = b.concat(h0, *blocks, axis=1)
        prev, cur = cur, net.conv(b.relu(cat), channels, 1)
    return b.build([cur])


def watts_strogatz_dag(n: int, k: int, p: float, seed: int) -> list[list[int]]:
    """Predecessor lists of a Watts-Strogatz graph (ring of ``n``, ``k`` nearest neighbours,
    each edge rewired with probability ``p``), edges oriented from lower to higher index."""
    rng = np.random.default_rng(seed)
    edges: set[tuple[int, int]] = set()
    for i in range(n):
        for j in range(1, k // 2 + 1):
            edges.add((i, (i + j) % n))
    out: set[tuple[int, int]] = set()
    for u, v in sorted(edges):
        if rng.random() < p:
            choices = [w for w in range(n) if w != u and (u, w) not in out and (w, u) not in out]
            v = int(rng.choice(choices))
        out.add((u, v))
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, v in out:
        lo, hi = min(u, v), max(u, v)
        if lo not in preds[hi]:
            preds[hi].append(lo)
    return [sorted(p_) for p_ in preds]


def randwire_graph(batch: int = 1, channels: int = 78, size: int = 28, nodes: int = 16, k: int = 4,
                   p: float = 0.75, seed: int = 0) -> Graph:
    """A RandWire-style stage on a [batch, channels, size, size] input (see the module)."""
    net = _Net(f"randwire_n{nodes}_b{batch}")
    b = net.b
    x = b.input("x", (batch, channels, size, size))
    preds = watts_strogatz_dag(nodes, k, p, seed)
    succ_count = [0] * nodes
    for ps in preds:
        for u in ps:
            succ_count[u] += 1
    outs: list[str] = []
    for i in range(nodes):
        ins = [outs[u] for u in preds[i]] or [x]
        agg = ins[0]
        for v in ins[1:]:
            agg = b.add(agg, v)
        outs.append(net.sep(agg, 3))
    sinks = [outs[i] for i in range(nodes) if succ_count[i] == 0]
    y = sinks[0]
    for v in sinks[1:]:
        y = b.add(y, v)
    return b.build([b.mul(y, b.scalar(1.0 / len(sinks), y))])
