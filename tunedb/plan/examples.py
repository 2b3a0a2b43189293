"""Example graphs for planning benchmarks and tests, written with ``GraphBuilder``.

Weights are graph inputs (like the initializers ``strip_model`` removes) so that a 12-layer
encoder stays a few kilobytes of JSON instead of 340 MB of constants.
"""

from __future__ import annotations

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph


def bert_encoder(layers: int = 12, batch: int = 1, seq: int = 128, hidden: int = 768,
                 heads: int = 12, ffn: int | None = None, dtype: str = "float32") -> Graph:
    """A BERT-base style encoder: per layer QKV projections, scaled masked softmax attention,
    output projection + residual + layernorm, GELU MLP + residual + layernorm. Inputs: ``x``
    [batch, seq, hidden], an additive ``mask`` [batch, 1, 1, seq], then each layer's weights."""
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    ffn = ffn or 4 * hidden
    dh = hidden // heads
    b = GraphBuilder(f"bert_l{layers}_b{batch}_s{seq}")
    x = b.input("x", (batch, seq, hidden), dtype)
    mask = b.input("mask", (batch, 1, 1, seq), dtype)
    for i in range(layers):
        def w(name: str, shape: tuple[int, ...], i: int = i) -> str:
            return b.input(f"l{i}.{name}", shape, dtype)

        def heads_of(t: str, perm: tuple[int, ...]) -> str:
            return b.transpose(b.reshape(t, shape=(batch, seq, heads, dh)), perm=perm)

        q = heads_of(b.add(b.matmul(x, w("wq", (hidden, hidden))), w("bq", (hidden,))), (0, 2, 1, 3))
        k = heads_of(b.add(b.matmul(x, w("wk", (hidden, hidden))), w("bk", (hidden,))), (0, 2, 3, 1))
        v = heads_of(b.add(b.matmul(x, w("wv", (hidden, hidden))), w("bv", (hidden,))), (0, 2, 1, 3))
        scores = b.add(b.mul(b.matmul(q, k), b.scalar(1.0 / dh ** 0.5, q)), mask)
        ctx = b.matmul(b.softmax(scores, axis=-1), v)
        ctx = b.reshape(b.transpose(ctx, perm=(0, 2, 1, 3)), shape=(batch, seq, hidden))
        attn = b.add(b.matmul(ctx, w("wo", (hidden, hidden))), w("bo", (hidden,)))
        h = b.layernorm(b.add(attn, x), w("ln1_g", (hidden,)), w("ln1_b", (hidden,)), eps=1e-12)
        ff = b.gelu(b.add(b.matmul(h, w("w1", (hidden, ffn))), w("b1", (ffn,))))
        ff = b.add(b.matmul(ff, w("w2", (ffn, hidden))), w("b2", (hidden,)))
        x = b.layernorm(b.add(ff, h), w("ln2_g", (hidden,)), w("ln2_b", (hidden,)), eps=1e-12)
    return b.build([x])
