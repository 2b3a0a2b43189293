"""Stages without barriers (``tunedb.runtime.stage_flow``): any order the waits allow computes the
graph. Each IOS plan runs on the CPU under the executor's memory layout (planned buffers of NaN
bytes, ``test_zoo_attention_plan._emulate``) with its steps interleaved across lanes as the
dataflow schedule permits: at random, and adversarially (the highest lane first as far as it can
go). Buffers are reused across stages, so a missing wait reads a value not yet written or one
already overwritten; the same runs with the waits removed must fail."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_zoo_attention_plan import _emulate

from tunedb.graph.multibranch import nasnet_a_graph, randwire_graph
from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.runtime.executor_views import is_concat_view, is_output_view
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.stage_flow import FlowSchedule, critical_groups, flow_schedule, group_conflicts


@pytest.fixture(scope="module", params=["randwire", pytest.param("nasnet", marks=pytest.mark.slow)])
def staged(request):
    graph = randwire_graph(1) if request.param == "randwire" else nasnet_a_graph(1)
    plan = compile_plan(graph, device="cuda", schedule="ios")
    assert sum(len(st) > 1 for st in plan.stages) >= 4
    _, host = make_inputs(graph, 3)
    inputs = {v: np.asarray(host[v], np.float32) for v in graph.inputs}
    ref = run_reference(graph, {v: host[v] for v in graph.inputs})
    return plan, inputs, ref


def _order(flow: FlowSchedule, pick) -> list[int]:
    """Step indices in one interleaving the schedule allows: each lane runs its groups' steps in
    turn; a group starts once the groups it waits on have ended. ``pick(lanes)`` chooses which
    runnable lane takes the next step."""
    queues: dict[int, list[int]] = {}
    for i, fg in enumerate(flow.groups):
        queues.setdefault(fg.lane, []).append(i)
    at = {lane: (0, 0) for lane in queues}  # (group in the lane's queue, step in the group)
    ended: set[int] = set()
    order: list[int] = []
    while True:
        ready = []
        for lane, q in queues.items():
            gi, _ = at[lane]
            if gi < len(q) and all(w in ended for w in flow.groups[q[gi]].waits):
                ready.append(lane)
        if not ready:
            break
        lane = pick(sorted(ready))
        gi, k = at[lane]
        fg = flow.groups[queues[lane][gi]]
        order.append(fg.steps[k])
        if k + 1 < len(fg.steps):
            at[lane] = (gi, k + 1)
        else:
            ended.add(queues[lane][gi])
            at[lane] = (gi + 1, 0)
    return order


def _views_when_built(plan, order: list[int]) -> list[int]:
    """``order`` with each plain view step moved to just after the step that makes its input
    (the front for a graph input): the executor makes views when it builds the plan, so they
    wait on nothing at run time; concat and output views keep their place."""
    plain = [k for k, s in enumerate(plan.steps) if s.kind == "layout_view"
             and not is_concat_view(s) and not is_output_view(s)]
    out = [k for k in order if k not in set(plain)]
    for k in plain:  # plan order: a view of a view comes after the view it reads
        src = plan.steps[k].inputs[0]
        at = max((i for i, j in enumerate(out) if src in plan.steps[j].outputs), default=-1)
        out.insert(at + 1, k)
    return out


def _correct(plan, order, inputs, ref) -> bool:
    if len(order) != len(plan.steps):
        return False  # a deadlock: some group waits on one that never ends
    order = _views_when_built(plan, order)
    try:
        got = _emulate(replace(plan, steps=tuple(plan.steps[k] for k in order), stages=()), inputs)
    except KeyError:  # a step read a value before any step wrote it
        return False
    return all(np.allclose(got[v], ref[v], rtol=1e-4, atol=1e-4) for v in ref)


@pytest.mark.parametrize("critical", [False, True])
def test_every_order_the_waits_allow_computes_the_graph(staged, critical) -> None:
    plan, inputs, ref = staged
    flow = flow_schedule(plan, max(len(st) for st in plan.stages) + 1,
                         critical_groups(plan) if critical else None)
    assert sorted(k for fg in flow.groups for k in fg.steps) == list(range(len(plan.steps)))
    assert flow.lanes > 1
    rng = np.random.default_rng(0)
    picks = [lambda r: r[-1], lambda r: r[0]] + [lambda r: r[rng.integers(len(r))]] * 4
    for pick in picks:
        assert _correct(plan, _order(flow, pick), inputs, ref)
    # the barrier is gone somewhere: a group that may start before an earlier stage has ended
    before = flow.happens_before()
    assert any(j not in before[i] for i, g in enumerate(flow.groups)
               for j, h in enumerate(flow.groups[:i]) if h.stage < g.stage)
    # without the waits the lanes run off: the adversarial order reads what is not yet there
    bare = FlowSchedule(tuple(replace(fg, waits=()) for fg in flow.groups), flow.lanes, ())
    assert not _correct(plan, _order(bare, lambda r: r[-1]), inputs, ref)


def test_groups_of_one_stage_never_wait_on_each_other(staged) -> None:
    plan, _, _ = staged
    for (si, _), deps in group_conflicts(plan):
        assert all(s < si for s, _ in deps)
    flow = flow_schedule(plan, max(len(st) for st in plan.stages) + 1)
    before = flow.happens_before()
    for i, g in enumerate(flow.groups):
        assert not [j for j in before[i] if flow.groups[j].stage == g.stage]


def test_the_longest_path_runs_on_lane_one_alone(staged) -> None:
    """With ``critical``, the groups of the longest predicted path take lane 1 (the stream that
    may get a higher priority) and no other group does, on these graphs."""
    plan, _, _ = staged
    path = critical_groups(plan)
    preds = [sum(plan.steps[k].predicted_us for k in g) for st in plan.stages for g in st]
    assert len(path) >= len(plan.stages) // 2 and sum(preds[i] for i in path) < sum(preds)
    flow = flow_schedule(plan, max(len(st) for st in plan.stages) + 1, path)
    assert {i for i, fg in enumerate(flow.groups) if fg.lane == 1} == path


@pytest.mark.slow
def test_inception_ios_plan_in_dataflow_order_computes_the_graph() -> None:
    """Inception V3 b1 (the stage bench's plan, bias in the epilogue: its weights reach the
    steps through views) in the adversarial order and one random order."""
    from tunedb.bench.stage_cases import cases

    graph, _ = dict(cases())["inception_v3_b1"]()
    plan = compile_plan(graph, device="cuda", schedule="ios", bias_epilogue=True)
    _, host = make_inputs(graph, 3)
    inputs = {v: np.asarray(host[v], np.float32) for v in graph.inputs}
    ref = run_reference(graph, {v: host[v] for v in graph.inputs})
    flow = flow_schedule(plan, max(len(st) for st in plan.stages) + 1, critical_groups(plan))
    rng = np.random.default_rng(1)
    for pick in (lambda r: r[-1], lambda r: r[rng.integers(len(r))]):
        assert _correct(plan, _order(flow, pick), inputs, ref)


def test_measured_schedules_keep_their_barriers_by_default(staged, monkeypatch) -> None:
    """``resolve_joins``: a predicted schedule runs as a dataflow graph, one chosen on stage
    times measured under barriers keeps them; an explicit setting or the environment wins, and
    a wrong word is refused."""
    from tunedb.plan.stages import apply_stages
    from tunedb.runtime.executor import ExecutorError
    from tunedb.runtime.stage_exec import resolve_joins

    plan, _, _ = staged
    monkeypatch.delenv("TUNEDB_STAGE_JOINS", raising=False)
    measured = apply_stages(replace(plan, stages=()), plan.stages, {"schedule": "ios (measured)"})
    assert resolve_joins(plan) == "dataflow" and resolve_joins(measured) == "stage"
    assert resolve_joins(measured, "dataflow") == "dataflow"
    monkeypatch.setenv("TUNEDB_STAGE_JOINS", "stage")
    assert resolve_joins(plan) == "stage"
    with pytest.raises(ExecutorError, match="joins must be one of"):
        resolve_joins(plan, "barrier")
