"""Packed plans on the GPU: the members of a pack forked onto streams inside the plan's CUDA
graph give the outputs of the unpacked plan and of the float64 reference; the tenants' pack
runs verified. The CPU side of these plans is tests/test_packing_driver.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from plan_checks import check_outputs
from test_packing_driver import attention, branches, streams_pay

from tunedb.plan import compile
from tunedb.plan.packing import pack_plans, run_tenant_pack, tenant_inputs
from tunedb.plan.record import Plan
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.tolerance import check_host, tolerance

pytestmark = pytest.mark.gpu

GRAPHS = Path(__file__).resolve().parents[1] / "data" / "graphs"


def _packed_and_plain(graph):
    packed = compile(graph, device="cuda", pack_model=streams_pay)
    plain = compile(graph, device="cuda", pack=False)
    assert packed.packs and not plain.packs
    return packed, plain


def _run_both(packed, plain, seed=5):
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.pack_exec import PackExecutor

    dev, ref_in = make_inputs(packed.graph, seed)
    ex = PackExecutor(packed)
    got = {k: v.get() for k, v in ex.run(dev).items()}
    assert ex.graph_capture, ex.capture_error
    assert not ex.fallbacks and ex.summary()["packs"] == len(packed.packs)
    check_outputs(packed, got, ref_in)
    base = {k: v.get() for k, v in PlanExecutor(plain).run(dev).items()}
    g = packed.graph
    for v in g.outputs:  # the same kernels, only launched side by side
        ok, err = check_host(got[v], base[v], tolerance(g, g.type_of(v).dtype))
        assert ok, f"{g.name} output {v!r}: packed and unpacked plans differ by {err:.3g}"
    again = {k: v.get() for k, v in ex.run(dev).items()}  # the captured graph replays alike
    for v in got:
        assert np.array_equal(got[v], again[v])
    ex.close_streams()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_qkv_matches_the_unpacked_plan(dtype):
    _run_both(*_packed_and_plain(attention(dtype)))


def test_packed_conv_branches_match_the_unpacked_plan():
    _run_both(*_packed_and_plain(branches()))


def test_bert_layer_qkv_is_one_gemm_before_packing():
    # Q/K/V of one input are merged into one GEMM (tunedb.plan.rewrite): nothing left to pack
    graph = str(GRAPHS / "bert_layer.onnx")
    packed = compile(graph, device="cuda", pack_model=streams_pay)
    plain = compile(graph, device="cuda", pack=False)
    assert packed.packs == () and len(packed.steps) == len(plain.steps)
    dev, ref_in = make_inputs(packed.graph, 2)
    check_outputs(packed, packed.run(dev), ref_in)


def test_a_serial_cluster_then_a_streams_cluster():
    packed, plain = _packed_and_plain(attention())
    d = json.loads(packed.dumps())
    d["packs"][0]["candidate"] = {"partition": "whole", "clusters": [
        {"members": [0], "backend": "serial"}, {"members": [1, 2], "backend": "streams", "streams": 2}]}
    _run_both(Plan.from_json(d), plain)


def test_tenants_pack_runs_verified():
    plans = [compile(attention(name=f"t{t}"), device="cuda", pack=False) for t in range(3)]
    feeds = [make_inputs(p.graph, t)[1] for t, p in enumerate(plans)]
    for model in (None, streams_pay):  # the rule's padded call, then forked streams
        tp = pack_plans(plans, model=model)
        outs = run_tenant_pack(plans, tp, feeds)
        for (t, k), (x, wt) in zip(tp.members, tenant_inputs(plans, tp, feeds)):
            v = plans[t].steps[k].outputs[0]
            want = (x.astype(np.float64) @ wt.astype(np.float64))[0]
            assert np.allclose(outs[t][v], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_qkv_matches_the_unpacked_plan(dtype):
    from test_packing_driver import grouped_pays

    graph = attention(dtype)
    packed = compile(graph, device="cuda", pack_model=grouped_pays)
    assert packed.packs[0].label == "whole:grouped"
    _run_both(packed, compile(graph, device="cuda", pack=False))

