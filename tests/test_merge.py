"""IOS's merge strategy: sibling convolutions of one input as one convolution
(``tunedb.plan.merge``), chosen where the predicted plans say it pays (``merge_choice``)."""

from __future__ import annotations

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.execute import run_reference_steps
from tunedb.plan.merge import bind_constants, check_mergeable, merge_candidates, merge_sibling_convs
from tunedb.plan.record import PlanError
from tunedb.plan.stage_refine import predicted_total


def _w(rng, *shape):
    return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


def fire(batch: int = 1, c: int = 8, e1: int = 16, e3: int = 16, size: int = 9, k: int = 3):
    """A SqueezeNet fire module: squeeze 1x1, then expand 1x1 and expand kxk concatenated."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("fire")
    x = b.input("x", (batch, c, size, size))
    s = b.relu(b.conv2d(x, b.constant(_w(rng, c, c, 1, 1)), b.constant(_w(rng, c)), strides=(1, 1),
                        pads=(0, 0, 0, 0), groups=1))
    p = k // 2
    y1 = b.relu(b.conv2d(s, b.constant(_w(rng, e1, c, 1, 1)), b.constant(_w(rng, e1)), strides=(1, 1),
                         pads=(0, 0, 0, 0), groups=1))
    y3 = b.relu(b.conv2d(s, b.constant(_w(rng, e3, c, k, k)), b.constant(_w(rng, e3)), strides=(1, 1),
                         pads=(p, p, p, p), groups=1))
    return b.build([b.concat(y1, y3, axis=1)])


def heads():
    """An Inception-like block: three 1x1 heads of one input read by different ops, and a 1x3 /
    3x1 pair (asymmetric pads) into one concat."""
    rng = np.random.default_rng(1)
    b = GraphBuilder("heads")
    x = b.input("x", (1, 6, 7, 7))
    one = {"strides": (1, 1), "pads": (0, 0, 0, 0), "groups": 1}
    a = b.relu(b.conv2d(x, b.constant(_w(rng, 4, 6, 1, 1)), b.constant(_w(rng, 4)), **one))
    m = b.relu(b.conv2d(x, b.constant(_w(rng, 5, 6, 1, 1)), b.constant(_w(rng, 5)), **one))
    c = b.conv2d(x, b.constant(_w(rng, 3, 6, 1, 1)), **one)  # no bias, no ReLU
    r = b.conv2d(m, b.constant(_w(rng, 4, 5, 1, 3)), strides=(1, 1), pads=(0, 1, 0, 1), groups=1)
    q = b.conv2d(m, b.constant(_w(rng, 4, 5, 3, 1)), strides=(1, 1), pads=(1, 0, 1, 0), groups=1)
    return b.build([b.concat(a, b.sigmoid(c), axis=1), b.concat(r, q, axis=1)])


def _same(g0, g1, feed):
    a, b = run_reference(g0, feed), run_reference(g1, feed)
    for v in g0.outputs:
        np.testing.assert_allclose(np.asarray(b[v]), np.asarray(a[v]), rtol=1e-12, atol=1e-12)


def test_a_fire_module_merges_into_one_conv_that_is_the_concat():
    g = fire()
    merged, done = merge_sibling_convs(g)
    ops = [n.op for n in merged.nodes]
    assert len(done) == 1 and ops.count("conv2d") == 2 and "concat" not in ops and ops.count("relu") == 2
    conv = [n for n in merged.nodes if n.op == "conv2d"][1]
    assert merged.type_of(conv.inputs[1]).shape == (32, 8, 3, 3) and conv.attr("pads") == (1, 1, 1, 1)
    _same(g, merged, {"x": np.random.default_rng(2).standard_normal((1, 8, 9, 9))})


def test_exact_merges_only_members_of_one_kernel_size():
    kw = dict(device=None, cost_model=False, schedule="ios", bias_epilogue=True)
    merged = dict(compile_plan(heads(), merge="exact", **kw).search)["merged_convs"]
    assert [list(m) for m in merged] == [["v2", "v6", "v9"]]  # the 1x1 heads, not the 1x3/3x1 pair
    assert dict(compile_plan(fire(), merge="exact", **kw).search)["merged_convs"] == ()


def test_inception_heads_merge_into_slices_with_the_same_values():
    g = heads()
    merged, done = merge_sibling_convs(g)
    assert sorted(len(d.members) for d in done) == [2, 3]
    ops = [n.op for n in merged.nodes]
    assert ops.count("conv2d") == 2 and ops.count("slice") == 3  # the 1x3/3x1 pair is the concat
    _same(g, merged, {"x": np.random.default_rng(3).standard_normal((1, 6, 7, 7))})


def test_the_merged_plan_computes_the_unmerged_outputs_and_says_it_merged():
    g = fire()
    feed = {"x": np.random.default_rng(4).standard_normal((1, 8, 9, 9)).astype(np.float32)}
    want = run_reference(g, feed)
    plain = compile_plan(g, device=None, cost_model=False, schedule="ios", bias_epilogue=True)
    plan = compile_plan(g, device=None, cost_model=False, schedule="ios", bias_epilogue=True, merge=True)
    assert plan.kernels < plain.kernels
    got = run_reference_steps(plan, feed)
    for v in g.outputs:
        np.testing.assert_allclose(np.asarray(got[v]), np.asarray(want[v]), rtol=1e-5, atol=1e-6)
    assert len(dict(plan.search)["merged_convs"]) == 1 and "merged_convs" not in dict(plain.search)
    assert "merged convolutions: 1" in plan.explain()
    assert [s.note for s in plan.steps if "merged conv" in s.note] == ["merged conv v6+v10"]
    assert "merged convolutions" not in plain.explain()


def _refusal(kind: str):
    rng = np.random.default_rng(5)
    b = GraphBuilder(kind)
    x = b.input("x", (1, 4, 8, 8))
    w2 = b.input("w2", (4, 4, 1, 1)) if kind == "input weight" else b.constant(_w(rng, 4, 4 // (
        2 if kind == "groups" else 1), 1, 1))
    y1 = b.conv2d(x, b.constant(_w(rng, 4, 4, 1, 1)), strides=(1, 1), pads=(0, 0, 0, 0), groups=1)
    y2 = b.conv2d(x, w2, strides=(2, 2) if kind == "strides" else (1, 1), pads=(0, 0, 0, 0),
                  groups=2 if kind == "groups" else 1)
    return b.build([y1, y2])


@pytest.mark.parametrize("kind, why", [("input weight", "not a constant"), ("strides", "strides"),
                                       ("groups", "groups=2")])
def test_the_rewrite_refuses_what_it_cannot_merge(kind, why):
    g = _refusal(kind)
    convs = [i for i, n in enumerate(g.nodes) if n.op == "conv2d"]
    with pytest.raises(PlanError, match=why):
        check_mergeable(g, convs)
    assert merge_candidates(g) == []
    assert merge_sibling_convs(g)[0] is g
    plan = compile_plan(g, device=None, cost_model=False, schedule="ios", merge=True)
    assert dict(plan.search)["merged_convs"] == ()


def test_bound_weights_merge():
    g = _refusal("input weight")
    bound = bind_constants(g, {"w2": _w(np.random.default_rng(6), 4, 4, 1, 1)}, ["w2"])
    assert bound.inputs == ("x",) and len(merge_candidates(bound)) == 1
    with pytest.raises(PlanError, match="not an input"):
        bind_constants(g, {}, ["nope"])


def test_auto_merges_where_the_prediction_says_it_pays():
    small = compile_plan(fire(), device="cuda", cost_model=False, schedule="ios", bias_epilogue=True,
                         merge="auto")
    (priced,) = [dict(p) for p in dict(small.search)["merge_priced"]]
    assert priced["merged_us"] < priced["unmerged_us"] and len(dict(small.search)["merged_convs"]) == 1
    # a wide 1x1 with a narrow 7x7: merged, the 1x1's channels run 49 taps, mostly zeros
    big = fire(batch=16, c=64, e1=256, e3=8, size=28, k=7)
    wide = compile_plan(big, device="cuda", cost_model=False, schedule="ios", bias_epilogue=True,
                        merge="auto")
    (priced,) = [dict(p) for p in dict(wide.search)["merge_priced"]]
    assert priced["merged_us"] > priced["unmerged_us"] and dict(wide.search)["merged_convs"] == ()
    with pytest.raises(PlanError, match="merge must be"):
        compile_plan(fire(), device=None, cost_model=False, schedule="ios", merge="sometimes")


def test_auto_keeps_the_plan_without_merges_when_the_stages_predict_it_faster():
    for g in (heads(), fire()):
        kw = dict(device="cuda", cost_model=False, schedule="ios", bias_epilogue=True)
        plain, auto = compile_plan(g, **kw), compile_plan(g, merge="auto", **kw)
        search = dict(auto.search)
        assert predicted_total(auto) <= predicted_total(plain) + 1e-6
        totals = [v for k, v in search.items()
                  if k.endswith("predicted_us") and k.startswith(("merge", "unmerged"))]
        assert len(totals) >= 2 and predicted_total(auto) == pytest.approx(min(totals), abs=0.01)
        assert bool(search["merged_convs"]) == (min(totals) < search["unmerged_predicted_us"])


def test_schedule_auto_merges_by_default_and_other_schedules_do_not():
    # one user setting: schedule="auto" takes the merges that pay (SqueezeNet b1's 1.19x) and
    # none where they do not (b16); merge=False still turns them off
    kw = dict(device="cuda", cost_model=False, bias_epilogue=True)
    default = compile_plan(fire(), schedule="auto", **kw)
    explicit = compile_plan(fire(), schedule="auto", merge="auto", **kw)
    assert dict(default.search)["merge"] == "auto" and len(dict(default.search)["merged_convs"]) == 1
    assert default.steps == explicit.steps and default.stages == explicit.stages
    for plan in (compile_plan(fire(), schedule="auto", merge=False, **kw),
                 compile_plan(fire(), schedule="sequential", **kw),
                 compile_plan(fire(), schedule="ios", **kw)):
        assert "merged_convs" not in dict(plan.search)


@pytest.mark.slow
def test_squeezenet_merged_plan_steps_compute_the_model():
    """Every fire module of the shipped SqueezeNet 1.1 merges; the plan's steps, run one by one
    in float64, give the unmerged graph's outputs."""
    from pathlib import Path

    from tunedb.graph.onnx_import import import_onnx

    path = Path(__file__).resolve().parents[1] / "data" / "graphs" / "ios" / "squeezenet1_1_b1.onnx"
    g = import_onnx(path, fill_initializers=True)
    plan = compile_plan(g, device="cuda", cost_model=False, schedule="ios", bias_epilogue=True,
                        concat_views=True, merge=True)
    assert len(dict(plan.search)["merged_convs"]) == 8
    assert not any(n.op == "concat" for n in plan.graph.nodes)
    (x,) = g.inputs
    feed = {x: np.random.default_rng(7).standard_normal(g.type_of(x).shape).astype(np.float32)}
    got, want = run_reference_steps(plan, feed), run_reference(g, feed)
    for v in g.outputs:
        assert np.linalg.norm(got[v] - want[v]) <= 1e-12 * np.linalg.norm(want[v])


@pytest.mark.gpu
def test_merged_plan_runs_on_the_gpu_and_matches_the_reference():
    import cupy as cp

    from tunedb.runtime.inputs import make_inputs
    from tunedb.runtime.stage_exec import StagedExecutor
    from tunedb.runtime.tolerance import check_host, tolerance

    for g in (fire(), heads()):
        plan = compile_plan(g, device="cuda", schedule="ios", bias_epilogue=True, concat_views=True,
                            merge=True)
        assert dict(plan.search)["merged_convs"]
        ex = StagedExecutor(plan)
        dev, ref_in = make_inputs(g, 3)
        outs = {k: cp.asnumpy(v) for k, v in ex.run(dev).items()}
        refs = run_reference(g, ref_in)
        for v in g.outputs:
            ok, err = check_host(outs[v], refs[v], tolerance(g, g.type_of(v).dtype))
            assert ok, f"{g.name} {v}: max abs error {err:.3g}"
