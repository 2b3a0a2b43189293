"""Stages over the plan with horizontal merges (``benchmarks/stage_rerank.py``'s ``refined_h``):
the IOS search takes a merged epilogue of sibling convolutions as one step that waits on all of
them, the staged plan round-trips through JSON, and it computes the graph under the executor's
memory layout in any order of the groups inside each stage (CPU)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_zoo_attention_plan import _emulate

from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.record import Plan
from tunedb.plan.stages import schedule_plan, step_dag
from tunedb.runtime.inputs import make_inputs

GRAPHS = Path(__file__).resolve().parents[1] / "data" / "graphs"


def _interleavings(plan: Plan):
    """Step orders that keep the stages in turn and run each stage's groups one after another
    forwards, backwards, or a step of each group in turn."""
    def order(mix):
        out = []
        for st in plan.stages:
            out += mix([list(g) for g in st])
        return out

    def round_robin(gs):
        out = []
        while any(gs):
            out += [g.pop(0) for g in gs if g]
        return out

    yield order(lambda gs: [i for g in gs for i in g])
    yield order(lambda gs: [i for g in reversed(gs) for i in g])
    yield order(round_robin)


@pytest.mark.parametrize("horizontal", [True, False])
def test_stages_over_horizontal_merges_round_trip_and_compute_the_graph(horizontal):
    base = compile_plan(str(GRAPHS / "inception_mixed_5b.onnx"), device=None, bias_epilogue=True,
                        pack=False, horizontal=horizontal)
    preds, _ = step_dag(base.steps)
    # a merged epilogue: one step that reads two convolutions' outputs and neither from the other
    merged = [i for i, s in enumerate(base.steps) if s.kind != "layout_view" and len(preds[i]) >= 2
              and all(base.steps[j].kind == "conv2d" for j in preds[i])]
    assert bool(merged) == horizontal
    staged, info = schedule_plan(base)
    assert sum(len(st) > 1 for st in staged.stages) >= 1
    back = Plan.from_json(staged.to_json())
    assert back.to_json() == staged.to_json() and back.stages == staged.stages
    graph = staged.graph
    _, host = make_inputs(graph, 7)
    inputs = {v: np.asarray(host[v], np.float32) for v in graph.inputs}
    ref = run_reference(graph, {v: host[v] for v in graph.inputs})
    for order in _interleavings(back):
        got = _emulate(replace(back, steps=tuple(back.steps[k] for k in order), stages=()), inputs)
        for v in ref:
            assert np.allclose(got[v], ref[v], rtol=1e-4, atol=1e-4), v


def test_prefetch_units_cover_the_plan_and_name_each_weight_once():
    from tunedb.runtime.stage_prefetch import prefetch_units, unit_weights

    base = compile_plan(str(GRAPHS / "inception_mixed_5b.onnx"), device=None, bias_epilogue=True, pack=False)
    staged, _ = schedule_plan(base)
    g = staged.graph
    outside = set(g.inputs) | set(g.constant_map)
    for plan, n_units in ((staged, len(staged.stages)), (base, -(-len(base.steps) // 8))):
        units = prefetch_units(plan)
        assert len(units) == n_units
        assert sorted(i for u in units for i in u) == list(range(len(plan.steps)))
        weights = unit_weights(plan, units)
        flat = [v for vals in weights for v in vals]
        assert len(flat) == len(set(flat)) and set(flat) <= outside
        read = {v for s in plan.steps for v in s.inputs} & outside
        assert set(flat) == read  # every weight a step reads, in the unit that reads it first
        for u, vals in zip(units, weights):
            assert all(any(v in plan.steps[k].inputs for k in u) for v in vals)
    assert len([v for vals in unit_weights(staged, prefetch_units(staged)) for v in vals]) > 10
