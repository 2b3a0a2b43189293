"""Vocabulary-wide rows with several values cached along them (a cross-entropy gradient over
32000-50257 logits): the shipped model never saw such rows and picked a cluster kernel holding
them in registers (one block of 256 threads an SM); they go to the roofline fallback, which
takes the forms the H200 timed fastest over the whole space (generalization_space_h200.json)."""

from __future__ import annotations

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.kernels.analysis import analyze
from tunedb.plan.cost import unseen_by_model
from tunedb.plan.fallback import vocabulary_rows


def xent_grad(rows: int, vocab: int) -> Graph:
    """d(loss)/d(logits) of a cross entropy, as autograd exports it: softmax of the logits times
    the upstream gradient's row sum, minus the upstream gradient (a full-size input)."""
    b = GraphBuilder(f"xent_grad_{rows}x{vocab}")
    x, dy = b.input("x", (rows, vocab)), b.input("dy", (rows, vocab))
    s = b.sub(x, b.reduce_max(x, axes=(1,), keepdims=True))
    lsm = b.sub(s, b.log(b.reduce_sum(b.exp(s), axes=(1,), keepdims=True)))
    return b.build([b.sub(dy, b.mul(b.exp(lsm), b.reduce_sum(dy, axes=(1,), keepdims=True)))])


def _step(g: Graph):
    import tunedb

    (step,) = [s for s in tunedb.compile(g, device=None).steps if s.kind == "fused"]
    return step


def test_vocabulary_rows_are_the_fallbacks_and_take_the_timed_forms():
    a = analyze(xent_grad(512, 50257))
    assert vocabulary_rows(a) and unseen_by_model(a)
    odd, even = _step(xent_grad(512, 50257)), _step(xent_grad(2048, 32000))
    assert odd.cost_source == even.cost_source == "roofline"
    assert odd.schedule_label == "split_row_b1024_v1_t1024_smem_boundary_s2_fast"
    assert even.schedule_label == "split_row_b1024_v4_t1024_registers_boundary_s2_fast"


def test_shorter_rows_and_one_cached_value_keep_the_model():
    assert not vocabulary_rows(analyze(xent_grad(512, 16384)))  # 64 KB rows
    b = GraphBuilder("softmax_50257")
    assert not vocabulary_rows(analyze(b.build([b.softmax(b.input("x", (512, 50257)), axis=-1)])))
