"""The Plan record: JSON round trip, explain(), check(), buffers, and running it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.plan import KernelStep, Plan, PlanError, compile
from tunedb.plan.examples import bert_encoder


@pytest.fixture(scope="module")
def small_bert():
    g = bert_encoder(layers=2, seq=16, hidden=64, heads=4)
    return g, compile(g, device="generic")


def test_json_round_trip(small_bert):
    _, p = small_bert
    text = json.dumps(p.to_json())
    q = Plan.from_json(json.loads(text))
    assert q == p
    assert Plan.from_json(text) == p
    assert q.to_json() == p.to_json()
    assert q.graph == p.graph and q.steps[3].graph == p.steps[3].graph
    assert p.to_json()["totals"]["kernels"] == p.kernels


def test_step_json_round_trip_keeps_config_and_stitch(small_bert):
    _, p = small_bert
    fused = [s for s in p.steps if s.kind == "fused"]
    assert fused and all(s.config for s in fused)
    for s in fused:
        assert KernelStep.from_json(json.loads(json.dumps(s.to_json()))) == s
        assert s.config_dict["mapping"]


def test_bad_json_is_one_line_error():
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{nope")
    with pytest.raises(PlanError, match="'graph' and 'steps'"):
        Plan.from_json({"steps": []})
    with pytest.raises(PlanError, match="unknown step kind"):
        KernelStep("warp_drive", (), (), (), ())


def test_explain_lists_every_step(small_bert):
    g, p = small_bert
    text = p.explain(width=200)
    lines = text.splitlines()
    for k, s in enumerate(p.steps):
        row = next((ln for ln in lines if ln.startswith(f"│ {k:>2} │")), None)
        assert row is not None, k
        assert s.kind in row and s.ops[0] in row
    assert f"{len(g.nodes)} ops -> {p.kernels} kernel launches" in text
    assert "predicted" in text and "roofline" in text
    assert "register" in text or "shuffle" in text  # stitch schemes of the fused reductions


def test_reference_run_of_the_steps_equals_the_graph(small_bert):
    g, p = small_bert
    rng = np.random.default_rng(1)
    ins = {v: rng.standard_normal(g.type_of(v).shape).astype(np.float32) for v in g.inputs}
    got, want = p.run(ins, backend="reference"), run_reference(g, ins)
    assert set(got) == set(g.outputs)
    for v in g.outputs:
        assert np.array_equal(got[v], want[v])


def test_check_catches_out_of_order_and_missing_steps(small_bert):
    _, p = small_bert
    p.check()
    steps = list(p.steps)
    swapped = Plan(p.graph_json, tuple([steps[3]] + steps[:3] + steps[4:]), p.buffers)
    with pytest.raises(PlanError, match="before a step computes it"):
        swapped.check()
    with pytest.raises(PlanError, match="no step computes node"):
        Plan(p.graph_json, tuple(steps[:-1]), p.buffers).check()
    with pytest.raises(PlanError, match="is in steps"):
        Plan(p.graph_json, tuple(steps + steps[-1:]), p.buffers).check()


def test_cuda_run_without_gpu_says_so(small_bert):
    from tunedb.runtime.device import NoGPUError, import_cupy

    try:
        import_cupy()
    except NoGPUError:
        pass
    else:
        pytest.skip("a GPU is present")
    g, p = small_bert
    with pytest.raises(NoGPUError, match="no CUDA device"):
        p.run({v: np.zeros(g.type_of(v).shape, np.float32) for v in g.inputs})
    with pytest.raises(PlanError, match="unknown backend"):
        p.run({}, backend="tpu")


def test_buffers_never_overlap_while_both_live(small_bert):
    g, p = small_bert
    assign = {v: (b, o, n) for v, b, o, n in p.buffers.assign}
    defined, last = {}, {}
    for k, s in enumerate(p.steps):
        for v in s.outputs:
            defined[v] = k
        for v in s.inputs:
            last[v] = k
    views = {o: i for s in p.steps if s.kind == "layout_view" for i, o in zip(s.inputs, s.outputs)}

    def root(v):
        while v in views:
            v = views[v]
        return v

    life: dict[str, tuple[int, int]] = {}
    for v in defined:
        r = root(v)
        lo, hi = life.get(r, (defined[r], defined[r]))
        life[r] = (lo, max(hi, last.get(v, defined[v])))
    arena = [(r, *assign[r]) for r in life if r in assign and assign[r][0] == 0]
    assert len(arena) > 10
    for i, (a, _, oa, na) in enumerate(arena):
        for b, _, ob, nb in arena[i + 1:]:
            (a0, a1), (b0, b1) = life[a], life[b]
            if a1 < b0 or b1 < a0:
                continue  # never live together: may share bytes
            assert oa + na <= ob or ob + nb <= oa, (a, b)
        assert oa + na <= p.buffers.sizes[0]
    for v in g.outputs:
        assert assign[v][0] >= 1  # outputs get buffers of their own
    assert p.buffers.arena_bytes < p.buffers.naive_bytes


def test_plan_of_a_single_view():
    b = GraphBuilder("view")
    x = b.input("x", (4, 6))
    g = b.build([b.reshape(x, shape=(6, 4))])
    p = compile(g, device="generic")
    assert [s.kind for s in p.steps] == ["layout_view"] and p.kernels == 0
    out = p.run({"x": np.arange(24, dtype=np.float32).reshape(4, 6)}, backend="reference")
    assert out[g.outputs[0]].shape == (6, 4)
