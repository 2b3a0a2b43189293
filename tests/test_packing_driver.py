"""Packs inside plans (CPU side): the driver's choice, the Plan record, explain, the executor's
layout and the tenants call. tests/test_packing_driver_gpu.py runs the same plans on the GPU."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.kernels.packing import Candidate, Cluster
from tunedb.plan import compile
from tunedb.plan.packing import PlanPack, pack_plans, tenant_inputs
from tunedb.plan.record import Plan, PlanError
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.pack_exec import pack_layout


def attention(dtype: str = "float32", name: str = "qkv"):
    """Q/K/V projections of three inputs (three distinct weights), then attention. Projections
    of ONE input are merged into one GEMM before packing (``tunedb.plan.rewrite``): nothing
    would be left to pack."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(name)
    xs = [b.input(f"x{i}", (64, 96), dtype) for i in range(3)]
    q, k, v = (b.matmul(x, b.constant(rng.uniform(-0.1, 0.1, (96, 96)).astype(np.float32), dtype))
               for x in xs)
    s = b.softmax(b.matmul(q, b.transpose(k, perm=(1, 0))), axis=-1)
    return b.build([b.matmul(s, v)])


def branches():
    """An Inception-like block: three convolutions of one input (1x1, 3x3, 1x1), concatenated."""
    rng = np.random.default_rng(1)
    b = GraphBuilder("branches")
    x = b.input("x", (1, 16, 12, 12))
    outs = [b.conv2d(x, b.constant(rng.uniform(-0.2, 0.2, (o, 16, kk, kk)).astype(np.float32)),
                     pads=(kk // 2,) * 4) for o, kk in ((8, 1), (12, 3), (8, 1))]
    return b.build([b.relu(b.concat(*outs, axis=1))])


def streams_pay(w, cands):
    """A packing model that says forked streams halve the time (more streams a little more) and
    nothing else pays."""
    return [100.0 if c.name == "whole:serial" else 50.0 - c.clusters[0].streams
            if c.name.startswith("whole:streams") else 99.0 for c in cands]


def pays_little(w, cands):
    return [100.0 if c.name == "whole:serial" else 97.0 for c in cands]


def _plan(graph, **kw):
    return compile(graph, cost_model=False, device=None, **kw)


@pytest.fixture(scope="module")
def packed():
    return _plan(attention(), pack_model=streams_pay)


def test_the_driver_packs_qkv_when_the_model_says_it_pays(packed):
    (pk,) = packed.packs
    members = [packed.steps[i] for i in pk.steps]
    assert [s.kind for s in members] == ["matmul"] * 3
    assert {s.inputs[0] for s in members} == {"x0", "x1", "x2"}
    assert pk.label == "whole:streams2" and pk.source == "model"
    assert (pk.predicted_us, pk.serial_us) == (48.0, 100.0)
    assert sorted(i for c in pk.clusters for i in c.members) == list(pk.steps)


def test_packed_plan_round_trips_and_composes_to_the_graph(packed):
    again = Plan.from_json(json.loads(packed.dumps()))
    assert again.packs == packed.packs and again.steps == packed.steps
    dev, ref_in = make_inputs(packed.graph, 3)
    want = run_reference(packed.graph, ref_in)
    got = packed.run(ref_in, backend="reference")
    for v in packed.graph.outputs:
        np.testing.assert_array_equal(got[v], want[v])
    text = packed.explain()
    first, last = packed.packs[0].steps[0], packed.packs[0].steps[-1]
    assert f"pack: steps {first}-{last} (matmul×3) as whole:streams2" in text


def test_no_pack_without_evidence_or_gain(packed):
    assert _plan(attention()).packs == ()  # no packing model, no database: never on a guess
    assert _plan(attention(), pack_model=pays_little).packs == ()  # 3 % is not worth it
    assert _plan(attention(), pack=False, pack_model=streams_pay).packs == ()
    with pytest.raises(PlanError, match="needs a packing model or a database"):
        _plan(attention(), pack=True)
    with pytest.raises(PlanError, match="sequential"):
        _plan(attention(), pack=True, schedule="ios")
    plain = _plan(attention(), pack=False)
    assert sorted(s.nodes for s in plain.steps) == sorted(s.nodes for s in packed.steps)


def _edited(plan, **pack):
    d = json.loads(plan.dumps())
    d["packs"][0].update(pack)
    return d


def test_check_refuses_packs_that_cannot_run(packed):
    first = packed.packs[0].steps[0]
    mm = [i for i, s in enumerate(packed.steps) if s.kind == "matmul" and i not in packed.packs[0].steps]
    other = [i for i, s in enumerate(packed.steps) if s.kind != "matmul"]
    bad = {
        "not two or more consecutive": {"steps": [first, first + 2],
                                        "candidate": {"partition": "whole", "clusters": [
                                            {"members": [0, 1], "backend": "serial"}]}},
        "is not one GEMM/conv": {"steps": [other[0], other[0] + 1],
                                 "candidate": {"partition": "whole", "clusters": [
                                     {"members": [0, 1], "backend": "serial"}]}},
        "do not partition": {"candidate": {"partition": "whole", "clusters": [
            {"members": [0, 1], "backend": "serial"}]}},
        "does not run in a plan": {"candidate": {"partition": "whole", "clusters": [
            {"members": [0, 1, 2], "backend": "padded"}]}},
    }
    for why, edit in bad.items():
        with pytest.raises(PlanError, match=why):
            Plan.from_json(_edited(packed, **edit))
    # the score matmul reads the Q and K outputs: a pack with it is not independent
    dep = [i for i in mm if set(packed.steps[i].inputs) & {v for j in packed.packs[0].steps
                                                           for v in packed.steps[j].outputs}]
    if dep and dep[0] == packed.packs[0].steps[-1] + 1:
        with pytest.raises(PlanError, match="another member's output"):
            Plan.from_json(_edited(packed, steps=list(packed.packs[0].steps) + [dep[0]], candidate={
                "partition": "whole", "clusters": [{"members": [0, 1, 2, 3], "backend": "serial"}]}))
    with pytest.raises(PlanError, match="malformed plan pack"):
        Plan.from_json(_edited(packed, candidate=None) | {"packs": [{"steps": [0, 1]}]})


def test_executor_layout_puts_members_on_their_streams(packed):
    lane, last, layout = pack_layout(packed)
    steps = packed.packs[0].steps
    assert sorted(lane) == list(steps) and sorted(lane.values()) == [1, 1, 2]
    assert last == {steps[-1]: 0}
    ((backend, branches),) = layout[0]
    assert backend == "streams" and sorted(i for b in branches for i in b) == list(steps)
    two = Plan.from_json(_edited(packed, candidate={"partition": "whole", "clusters": [
        {"members": [0], "backend": "serial"}, {"members": [1, 2], "backend": "streams", "streams": 2}]}))
    lane, _, layout = pack_layout(two)
    assert lane[steps[0]] == 0 and sorted(lane[i] for i in steps[1:]) == [1, 2]
    assert [b for b, _ in layout[0]] == ["serial", "streams"]


def test_conv_branches_pack(tmp_path):
    plan = _plan(branches(), pack_model=streams_pay)
    (pk,) = plan.packs
    assert [plan.steps[i].kind for i in pk.steps] == ["conv2d"] * 3
    _, ref_in = make_inputs(plan.graph, 0)
    want = run_reference(plan.graph, ref_in)
    got = plan.run(ref_in, backend="reference")
    np.testing.assert_array_equal(got[plan.graph.outputs[0]], want[plan.graph.outputs[0]])


def test_an_exact_database_hit_decides(tmp_path):
    from collectors.packing_ingest import store_results
    from tunedb.plan.packing import graph_workloads
    from tunedb.records import DeviceInfo

    dev = DeviceInfo("NVIDIA H200", "abc", "9.0", 132, 60 << 20, 141 << 30, "13.0", "13.0", "14.2.0")
    (w,) = graph_workloads(attention(), "qkv")
    allm = [0, 1, 2]

    def row(cand, us):
        return {"system": "tunedb", "variant": cand.name, "status": "ok", "candidate": cand.to_json(),
                "samples_us": [us] * 5}
    serial = Candidate("whole", (Cluster(tuple(allm), "serial"),))
    streams = Candidate("whole", (Cluster(tuple(allm), "streams", 2),))
    for name, times in (("slower", (10.0, 12.0)), ("faster", (10.0, 6.0))):
        db = tmp_path / f"{name}.duckdb"
        doc = {"results": [{"workload": w.to_json(), "rows": [row(serial, times[0]),
                                                             row(streams, times[1])]}], "samples": 5}
        store_results(db, doc, dev, {"test": str(uuid.uuid4())})
        plan = compile(attention(), cost_model=False, db=db, device=dev.id)
        if name == "slower":
            assert plan.packs == ()
        else:
            (pk,) = plan.packs
            assert (pk.source, pk.label, pk.predicted_us, pk.serial_us) == ("db", "whole:streams2", 6.0, 10.0)


def test_a_database_hit_judges_serial_and_the_pack_on_one_board(tmp_path):
    """Serial measured on a fast and a slow board, streams on the slow one only: judged on the
    slow board's basis streams wins by 7 %; a median over both boards would make it 3 %."""
    from collectors.packing_ingest import store_results
    from tunedb.plan.packing import decide, graph_workloads, store_times
    from tunedb.records import DeviceInfo
    from tunedb.store.core import TuningStore

    (w,) = graph_workloads(attention(), "qkv")
    serial = Candidate("whole", (Cluster((0, 1, 2), "serial"),))
    streams = Candidate("whole", (Cluster((0, 1, 2), "streams", 2),))

    def row(cand, us):
        return {"system": "tunedb", "variant": cand.name, "status": "ok", "candidate": cand.to_json(),
                "samples_us": [us] * 5}
    db = tmp_path / "boards.duckdb"
    boards = []
    for board, rows in (("fast", [row(serial, 10.0)]), ("slow", [row(serial, 11.0), row(streams, 10.2)])):
        dev = DeviceInfo("NVIDIA H200", board, "9.0", 132, 60 << 20, 141 << 30, "13.0", "13.0", "14.2.0")
        boards.append(dev.id)
        store_results(db, {"results": [{"workload": w.to_json(), "rows": rows}], "samples": 5}, dev,
                      {"test": str(uuid.uuid4())})
    with TuningStore.open(db) as store:
        times = store_times(store, boards)
        assert times(w) == pytest.approx({"whole:serial": 11.0, "whole:streams2": 10.2})
        got = decide(w, times=times)
    assert got is not None and got[0].name == "whole:streams2" and got[3] == "db"


def test_pack_plans_packs_the_tenants_ready_layers():
    plans = [_plan(attention(name=f"t{t}"), pack=False) for t in range(2)]
    tp = pack_plans(plans)
    assert len(tp.workload.members) == 6 and {t for t, _ in tp.members} == {0, 1}
    assert tp.source == "rule" and tp.candidate.name == "whole:padded"
    assert len({m.weight for m in tp.workload.members}) == 6  # weights stay per tenant
    tp2 = pack_plans(plans, model=streams_pay)
    assert tp2.source == "model" and tp2.candidate.name.startswith("whole:streams")
    feeds = [make_inputs(p.graph, t)[1] for t, p in enumerate(plans)]
    ins = tenant_inputs(plans, tp, feeds)
    for (t, k), (x, wt) in zip(tp.members, ins):
        g = plans[t].graph
        step = plans[t].steps[k]
        x_in = np.asarray(feeds[t][step.inputs[0]], np.float64)
        want = x_in @ g.constant_map[step.inputs[1]].array.astype(np.float64)
        np.testing.assert_allclose((x[0].astype(np.float64) @ wt[0].astype(np.float64)), want, rtol=1e-6)
    with pytest.raises(ValueError, match="needs two or more"):
        pack_plans([_plan(branches(), pack=False)])


def test_plan_pack_record_refuses_an_unknown_source():
    with pytest.raises(ValueError, match="pack source"):
        PlanPack((0, 1), "{}", source="guess")


def grouped_pays(w, cands):
    """A packing model that says one grouped call takes a third of serial's time."""
    return [100.0 if c.name == "whole:serial" else 33.0 if c.name == "whole:grouped" else 99.0
            for c in cands]


def test_grouped_packs_plain_gemms_only():
    plan = _plan(attention(), pack_model=grouped_pays)
    (pk,) = plan.packs
    assert pk.label == "whole:grouped"
    lane, last, layout = pack_layout(plan)
    assert set(lane.values()) == {0} and layout == [[("grouped", [list(pk.steps)])]]
    # convolutions are not plain GEMMs: a grouped call is not offered, so nothing pays
    assert _plan(branches(), pack_model=grouped_pays).packs == ()
    conv = _plan(branches(), pack_model=streams_pay)
    d = json.loads(conv.dumps())
    d["packs"][0]["candidate"] = {"partition": "whole", "clusters": [
        {"members": [0, 1, 2], "backend": "grouped"}]}
    with pytest.raises(PlanError, match="backend grouped does not run in a plan"):
        Plan.from_json(d)


def test_plans_bench_arguments_and_forced_predictor(capsys):
    from tunedb.bench.packing_plans import forced, main

    assert main(["--force", "grouped", "--data", "x"]) == 2
    assert "exactly one of" in capsys.readouterr().err
    plan = _plan(attention(), pack_model=forced("grouped"))
    assert plan.packs[0].label == "whole:grouped"
    plan = _plan(attention(), pack_model=forced("streams"))
    assert plan.packs[0].label == "whole:streams2"  # three members: 2 streams is the most offered


def test_the_shipped_packing_model_is_the_default_and_gets_a_say(monkeypatch):
    from pathlib import Path

    from tunedb.costmodel.packing import FEATURE_SCHEMA, load_predictor
    from tunedb.costmodel.registry import default_models_root, model_dir
    from tunedb.plan.packing import graph_workloads, plan_candidates

    monkeypatch.delenv("TUNEDB_MODELS")  # the shipped registry, as a user gets it
    folder = model_dir(default_models_root(), "NVIDIA H200", "packing")
    card = json.loads((Path(folder) / "card.json").read_text())
    assert card["kind"] == "packing" and card["feature_schema"] == FEATURE_SCHEMA
    m = card["metrics"]
    assert card["workloads"] >= 200 and m["model_within_5pct"] > m["rule_within_5pct"]
    predict = load_predictor(folder)
    (w,) = graph_workloads(attention(), "qkv")
    us = predict(w, plan_candidates(w))
    assert len(us) == len(plan_candidates(w)) and all(u > 0 for u in us)
    plan = compile(attention(), cost_model=False)  # pack="auto": the shipped model decides
    for p in plan.packs:  # whatever it decides is recorded with its evidence and can run
        assert p.source == "model" and p.predicted_us < p.serial_us
    _, feeds = make_inputs(plan.graph, 0)
    out = plan.graph.outputs[0]
    want = run_reference(plan.graph, feeds)[out]
    np.testing.assert_allclose(plan.run(feeds, backend="reference")[out], want)
