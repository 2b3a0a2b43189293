"""Generator coverage beyond the anchors (issue 21): reductions over middle and non-adjacent
axes, per-channel epilogues behind reshapes (instance / group norm), per-head masks. Each
pattern is checked where it is decided (the analysis), where it is planned (one fused kernel,
no library step) and, in the slow tier, against the float64 reference in emulation and under
nvcc."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import tunedb
from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.kernels import generate
from tunedb.kernels.analysis import UnsupportedFusion, analyze
from tunedb.kernels.domain import index_expr, index_map, rolled_map


def mid_mean(A: int = 3, M: int = 20, B: int = 24, keep: int = 0, dtype: str = "float32"):
    b = GraphBuilder(f"mid_mean_{A}x{M}x{B}_{keep}_{dtype}")
    x = b.input("x", (A, M, B), dtype)
    return b.build([b.reduce_mean(x, axes=(1,), keepdims=keep)])


def mid_center(A: int = 3, M: int = 5, N: int = 4, B: int = 16):
    """x - mean over a middle block of axes, plus a max over the same block as a second output."""
    b = GraphBuilder(f"mid_center_{A}x{M}x{N}x{B}")
    x = b.input("x", (A, M, N, B))
    bias = b.input("bias", (B,))
    m = b.reduce_mean(x, axes=(1, 2), keepdims=1)
    s = b.reduce_max(b.mul(x, x), axes=(1, 2), keepdims=1)
    return b.build([b.add(b.sub(x, m), bias), b.mul(s, 2.0)])


def _norm(b: GraphBuilder, x: str, axes: tuple[int, ...]) -> str:
    m = b.reduce_mean(x, axes=axes, keepdims=1)
    d = b.sub(x, m)
    v = b.reduce_mean(b.mul(d, d), axes=axes, keepdims=1)
    return b.div(d, b.sqrt(b.add(v, b.scalar(1e-5, v))))


def instnorm(N: int = 2, C: int = 6, H: int = 5, W: int = 8):
    b = GraphBuilder(f"instnorm_{N}x{C}x{H}x{W}")
    x = b.input("x", (N, C, H, W))
    g, bb = b.input("g", (C, 1, 1)), b.input("bb", (C, 1, 1))
    return b.build([b.add(b.mul(_norm(b, x, (2, 3)), g), bb)])


def groupnorm(N: int = 2, C: int = 8, G: int = 4, H: int = 3, W: int = 8):
    """Group norm as exporters write it: reshape to groups, normalise, reshape back, affine."""
    b = GraphBuilder(f"groupnorm_{N}x{C}x{G}x{H}x{W}")
    x = b.input("x", (N, C, H, W))
    g, bb = b.input("g", (C, 1, 1)), b.input("bb", (C, 1, 1))
    y = _norm(b, b.reshape(x, shape=(N, G, C // G * H * W)), (2,))
    return b.build([b.add(b.mul(b.reshape(y, shape=(N, C, H, W)), g), bb)])


def per_head_softmax(B: int = 2, H: int = 3, S: int = 16):
    b = GraphBuilder(f"per_head_{B}x{H}x{S}")
    x = b.input("x", (B, H, S, S))
    return b.build([b.softmax(b.add(x, b.input("m", (1, H, 1, S))))])


PATTERNS = [mid_mean(), mid_mean(4, 300, 40, 1), mid_mean(2, 64, 32, 0, "float16"), mid_center(),
            mid_center(2, 40, 30, 8), instnorm(), instnorm(2, 3, 16, 40), groupnorm(),
            groupnorm(2, 4, 2, 8, 96), per_head_softmax()]


def test_index_maps_merge_contiguous_dims_and_evaluate():
    assert index_map((64, 1, 1), (8, 64, 56, 56)) == ((3136, 64, 1),)
    assert index_map((8, 1, 128), (8, 32, 128)) == ((4096, 8, 128), (1, 128, 1))
    assert index_map((1, 1), (4, 5)) == ()
    so, si = (3, 4, 5, 6), (3, 1, 5, 1)
    m = index_map(si, so)
    want = np.broadcast_to(np.arange(np.prod(si)).reshape(si), so).reshape(-1)
    got = [eval(index_expr(m, str(i), int(np.prod(so))).replace("LL", "").replace("/", "//"))
           for i in range(int(np.prod(so)))]
    assert got == list(want)
    # a read rolled along one axis, narrower than it (a concat branch) and shifted
    for shape, src, shift in (((1, 4, 33, 32), (1, 4, 3, 32), 0), ((2, 3, 8, 16), (2, 3, 8, 16), 8)):
        m = rolled_map(shape, src, 2 if shape[2] != src[2] else 3, shift)
        ax = 2 if shape[2] != src[2] else 3
        x = np.arange(np.prod(src)).reshape(src)
        want = np.take(x, [(c + shift) % src[ax] for c in range(shape[ax])], axis=ax).reshape(-1)
        n = int(np.prod(shape))
        got = [eval(index_expr(m, str(i), n).replace("LL", "").replace("/", "//")) for i in range(n)]
        assert got == list(want)


def test_middle_axis_reductions_are_segmented_column_reductions():
    a = analyze(mid_mean(3, 20, 24))
    assert (a.pattern, a.R, a.C, a.col_seg, a.seg) == ("col_reduce", 60, 24, 20, 20)
    c = analyze(mid_center(3, 5, 4, 16))
    assert (c.pattern, c.R, c.C, c.col_seg) == ("col_reduce", 60, 16, 20)
    assert analyze(mid_center(3, 5, 4, 16)).cls["bias"] == "col"
    # leading axes stay plain column reductions
    b = GraphBuilder("lead")
    x = b.input("x", (6, 5, 8))
    assert analyze(b.build([b.reduce_sum(x, axes=(0, 1), keepdims=0)])).col_seg == 0
    # two segment lengths in one kernel, or a segmented reduction next to a row reduction
    b = GraphBuilder("two_segs")
    x = b.input("x", (2, 3, 4, 8))
    with pytest.raises(UnsupportedFusion, match="segments of"):
        analyze(b.build([b.reduce_sum(x, axes=(1, 2), keepdims=1), b.reduce_sum(x, axes=(2,), keepdims=1)]))


def test_norm_epilogues_behind_reshapes_are_index_mapped():
    for g, R, C in ((instnorm(2, 6, 5, 8), 12, 40), (groupnorm(2, 8, 4, 3, 8), 8, 48)):
        a = analyze(g)
        assert (a.pattern, a.R, a.C) == ("row_reduce", R, C)
        assert {a.cls["g"], a.cls["bb"]} == {"idx"}
    assert dict(analyze(groupnorm(2, 8, 4, 3, 8)).idx_maps)["g"] == ((24, 8, 1),)


@pytest.mark.parametrize("graph,ops", [(mid_mean(64, 512, 256), 1), (instnorm(8, 64, 56, 56), 9),
                                       (groupnorm(8, 64, 32, 56, 56), 11),
                                       (per_head_softmax(8, 12, 512), 6)])
def test_patterns_plan_as_one_fused_kernel(graph, ops):
    plan = tunedb.compile(graph, cost_model=False, device=None)
    assert [s.kind for s in plan.steps] == ["fused"] and len(plan.steps[0].ops) == ops


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_patterns_match_reference_in_emulation(tmp_path):
    from tunedb.runtime.emu import build, generable_schedules, mismatches

    jobs = []
    for g in PATTERNS:
        legal = generable_schedules(g)
        # every mapping and split, a few vector widths and blocks each
        picked: dict[tuple, object] = {}
        for s in legal:
            picked.setdefault((s.mapping, s.split, s.row_cache, s.vec), s)
        jobs += [(g, s, generate(g, s, sm_count=2)) for s in picked.values()]
    lib = build([k.source for _, _, p in jobs for k in p.kernels], str(tmp_path))
    failures = mismatches(lib, jobs)
    assert not failures, "\n".join(failures[:20])
    assert sum(s.split > 1 and s.mapping == "col_tiled" for _, s, _ in jobs) >= 6


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_patterns_compile_with_nvcc(tmp_path):
    sources: dict[str, str] = {}
    for g in PATTERNS + MOVEMENT:
        for s in generable_schedules_sample(g):
            for k in generate(g, s).kernels:
                sources.setdefault(k.name, k.source)
    path = tmp_path / "all.cu"
    path.write_text("\n".join(sources.values()))
    r = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-cubin", "-o", str(tmp_path / "all.cubin"),
                        str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def generable_schedules_sample(g):
    from tunedb.runtime.emu import generable_schedules

    legal = generable_schedules(g)
    return legal[:: max(1, len(legal) // 6)]


def test_reference_of_the_patterns_is_what_numpy_says():
    """The graphs above mean what their names say (so the emulation checks the right thing)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 3, 8)).astype(np.float32)
    g, bb = (rng.standard_normal((8, 1, 1)).astype(np.float32) for _ in range(2))
    out = run_reference(groupnorm(2, 8, 4, 3, 8), {"x": x, "g": g, "bb": bb})
    xr = x.reshape(2, 4, -1).astype(np.float64)
    y = ((xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
    np.testing.assert_allclose(list(out.values())[0], y * g + bb, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["reduce_mean", "reduce_max", "reduce_sum"])
@pytest.mark.parametrize("keep", [0, 1])
def test_non_adjacent_axes_split_into_chains_with_the_same_values(op, keep):
    from tunedb.graph.reference import example_feeds
    from tunedb.kernels.split_reduce import axis_blocks, split_reductions

    assert axis_blocks((0, 2, 3)) == [(0,), (2, 3)] and axis_blocks((1,)) == [(1,)]
    b = GraphBuilder(f"bn_stats_{op}_{keep}")
    x = b.input("x", (4, 6, 5, 7))
    r = getattr(b, op)(x, axes=(0, 2, 3), keepdims=keep)
    g = b.build([b.sub(x, r) if keep else r])
    s = split_reductions(g)
    # the block with the most elements first: (2, 3) then (0,), then the original shape back
    assert [(n.op, n.attr("axes")) for n in s.nodes[:3]] == [(op, (2, 3)), (op, (0,)), ("reshape", None)]
    assert s.outputs == g.outputs and split_reductions(s) is s
    feeds = example_feeds(g)
    want, got = run_reference(g, feeds), run_reference(s, feeds)
    for v in g.outputs:
        np.testing.assert_allclose(got[v], want[v], rtol=1e-12)


def test_batch_norm_statistics_plan_without_library_steps():
    b = GraphBuilder("bn_train")
    x = b.input("x", (32, 64, 28, 28))
    plan = tunedb.compile(b.build([_norm(b, x, (0, 2, 3))]), cost_model=False, device=None)
    assert {s.kind for s in plan.steps} == {"fused"}


def rotary(B: int = 2, H: int = 3, S: int = 8, D: int = 16, dtype: str = "float32", table: str = "sd"):
    """Llama's rotate-half rotary embedding: x * cos + concat(-x2, x1) * sin."""
    b = GraphBuilder(f"rotary_{B}x{H}x{S}x{D}_{dtype}_{table}")
    x = b.input("x", (B, H, S, D), dtype)
    shape = (S, D) if table == "sd" else (B, 1, S, D)
    cos, sin = b.input("cos", shape, dtype), b.input("sin", shape, dtype)
    x1 = b.slice(x, starts=(0,), ends=(D // 2,), axes=(3,))
    x2 = b.slice(x, starts=(D // 2,), ends=(D,), axes=(3,))
    rot = b.concat(b.neg(x2), x1, axis=3)
    return b.build([b.add(b.mul(x, cos), b.mul(rot, sin))])


def kv_append(B: int = 2, H: int = 3, P: int = 5, N: int = 2, D: int = 8):
    """A KV-cache update: the past keys with the new ones appended on the sequence axis."""
    b = GraphBuilder(f"kv_append_{B}x{H}x{P}x{N}x{D}")
    past, new = b.input("past", (B, H, P, D)), b.input("new", (B, H, N, D))
    return b.build([b.concat(past, b.mul(new, 0.5), axis=2)])


def glu_split(B: int = 2, S: int = 6, F: int = 24, how: str = "split", dtype: str = "float32"):
    """SwiGLU over a fused gate/up projection: silu(a) * b of its two halves (split or slices)."""
    b = GraphBuilder(f"glu_{how}_{B}x{S}x{F}_{dtype}")
    x = b.input("x", (B, S, 2 * F), dtype)
    if how == "split":
        g, u = b.op("split", x, name=["g", "u"], axis=2, sizes=(F, F))
    else:
        g = b.slice(x, starts=(0,), ends=(F,), axes=(2,))
        u = b.slice(x, starts=(F,), ends=(2 * F,), axes=(2,))
    return b.build([b.mul(b.mul(g, b.sigmoid(g)), u)])


def llama_rotary(B: int = 2, S: int = 8, H: int = 3, D: int = 16):
    """Rotary as a Llama layer runs it: on the head transpose of the projection, cos/sin [1,1,S,D]."""
    b = GraphBuilder(f"llama_rotary_{B}x{S}x{H}x{D}")
    q = b.transpose(b.reshape(b.input("q", (B, S, H * D)), shape=(B, S, H, D)), perm=(0, 2, 1, 3))
    cos, sin = b.input("cos", (1, 1, S, D)), b.input("sin", (1, 1, S, D))
    q1 = b.slice(q, starts=(0,), ends=(D // 2,), axes=(3,))
    q2 = b.slice(q, starts=(D // 2,), ends=(D,), axes=(3,))
    return b.build([b.add(b.mul(q, cos), b.mul(b.concat(b.neg(q2), q1, axis=3), sin))])


MOVEMENT = [rotary(), rotary(2, 2, 8, 64, "float16", "bsd"), kv_append(), kv_append(1, 4, 30, 3, 32),
            glu_split(), glu_split(2, 3, 40, "slice", "bfloat16"), llama_rotary(), llama_rotary(1, 5, 2, 32)]


def test_concats_of_slices_are_rolled_reads():
    a = analyze(rotary())
    assert a.pattern == "elementwise" and not [n for n in a.nodes if n.op in ("slice", "concat")]
    reads = dict(a.idx_src)
    assert set(reads.values()) == {"x"} and len(reads) == 2
    k = analyze(kv_append())
    assert set(dict(k.idx_src).values()) == {"past", "new"}


@pytest.mark.parametrize("graph", [rotary(8, 32, 512, 128), kv_append(8, 32, 1000, 1, 128),
                                   glu_split(8, 512, 4096), glu_split(8, 512, 4096, "slice"),
                                   llama_rotary(8, 512, 32, 128)])
def test_movement_plans_as_one_kernel(graph):
    plan = tunedb.compile(graph, cost_model=False, device=None)
    assert [s.kind for s in plan.steps if s.kind != "layout_view"] == ["fused"] and plan.kernels == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_movement_matches_reference_in_emulation(tmp_path):
    from tunedb.runtime.emu import build, generable_schedules, mismatches

    jobs = [(g, s, generate(g, s, sm_count=2)) for g in MOVEMENT
            for s in generable_schedules(g)[::7]]
    lib = build([k.source for _, _, p in jobs for k in p.kernels], str(tmp_path))
    failures = mismatches(lib, jobs)
    assert not failures, "\n".join(failures[:20])
    assert len(jobs) >= 12


def test_global_pooling_is_its_reduction_and_fuses_with_its_neighbours():
    from tunedb.graph.reference import example_feeds
    from tunedb.kernels.split_reduce import split_reductions

    b = GraphBuilder("squeeze_excite")
    x = b.input("x", (8, 64, 14, 14))
    pooled = b.op("global_avg_pool", x)
    g = b.build([b.mul(x, b.sigmoid(b.op("global_max_pool", b.mul(x, pooled))))])
    s = split_reductions(g)
    pools = [n.op for n in s.nodes if "pool" in n.op or n.op.startswith("reduce")]
    assert pools == ["reduce_mean", "reduce_max"]
    feeds = example_feeds(g)
    want, got = run_reference(g, feeds), run_reference(s, feeds)
    np.testing.assert_allclose(got[g.outputs[0]], want[g.outputs[0]], rtol=1e-12)
    plan = tunedb.compile(g, cost_model=False, device=None)
    assert {st.kind for st in plan.steps} == {"fused"}


def head_split(B: int = 2, S: int = 6, H: int = 3, D: int = 8, dtype: str = "float32"):
    """An attention head split as exporters cut it: (x + bias).view(B, S, H, D).transpose(1, 2) * s."""
    b = GraphBuilder(f"head_split_{B}x{S}x{H}x{D}_{dtype}")
    x, bias = b.input("x", (B, S, H * D), dtype), b.input("bias", (H * D,), dtype)
    y = b.transpose(b.reshape(b.add(x, bias), shape=(B, S, H, D)), perm=(0, 2, 1, 3))
    return b.build([b.mul(y, 0.125)])


def channels_last_norm(N: int = 2, C: int = 16, H: int = 3, W: int = 5):
    """ConvNeXt: (x + bias) NHWC -> NCHW, scaled residual, back to NHWC, LayerNorm over C."""
    b = GraphBuilder(f"cl_norm_{N}x{C}x{H}x{W}")
    x, bias = b.input("x", (N, H, W, C)), b.input("bias", (C,))
    g, res = b.input("g", (C, 1, 1)), b.input("res", (N, C, H, W))
    t = b.transpose(b.add(x, bias), perm=(0, 3, 1, 2))
    y = b.transpose(b.add(b.mul(g, t), res), perm=(0, 2, 3, 1))
    return b.build([_norm(b, y, (3,))])


def test_transposes_of_computed_values_read_inputs():
    a = analyze(head_split())
    assert a.pattern == "elementwise" and dict(a.idx_src) and "transpose" not in [n.op for n in a.nodes]
    c = analyze(channels_last_norm())
    assert c.pattern == "row_reduce" and c.cls["res"] == "idx"
    plan = tunedb.compile(head_split(8, 128, 12, 64), cost_model=False, device=None)
    assert [s.kind for s in plan.steps] == ["fused"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_transposes_match_reference_in_emulation(tmp_path):
    from tunedb.runtime.emu import build, generable_schedules, mismatches

    graphs = [head_split(), head_split(2, 5, 2, 16, "float16"), channels_last_norm(),
              channels_last_norm(2, 64, 2, 3)]
    jobs = [(g, s, generate(g, s, sm_count=2)) for g in graphs for s in generable_schedules(g)[::9]]
    lib = build([k.source for _, _, p in jobs for k in p.kernels], str(tmp_path))
    failures = mismatches(lib, jobs)
    assert not failures, "\n".join(failures[:20])
    assert len(jobs) >= 12


def test_kernels_the_model_never_saw_are_priced_by_the_roofline():
    """A model that knows nothing of middle-axis reductions must not split them (issue 21: the
    shipped one split x - mean over a middle block into 3 kernels)."""
    from tunedb.plan.cost import unseen_by_model

    assert unseen_by_model(analyze(mid_center())) and unseen_by_model(analyze(instnorm()))
    assert unseen_by_model(analyze(per_head_softmax()))  # a softmax reading an index-mapped mask
    assert not unseen_by_model(analyze(rotary())) and not unseen_by_model(analyze(kv_append()))
    calls = []

    def clueless(graph, configs):
        calls.append(graph.name)
        return np.full(len(configs), 1e6)  # every fused kernel "costs" a second

    plan = tunedb.compile(mid_center(32, 64, 16, 256), cost_model=clueless, device=None)
    assert [(s.kind, s.cost_source) for s in plan.steps] == [("fused", "roofline")]


def xent_grad(R: int = 6, C: int = 40, dtype: str = "float32"):
    """Cross-entropy gradient as traced: softmax(x) - onehot, the one-hot an int64 compare of a
    per-column id row [1, C] with the per-row labels."""
    b = GraphBuilder(f"xent_grad_{R}x{C}_{dtype}")
    x = b.input("x", (R, C), dtype)
    ids, label = b.input("ids", (1, C), "int64"), b.input("label", (R, 1), "int64")
    onehot = b.cast(b.eq(ids, label), to=dtype)
    return b.build([b.sub(b.softmax(x), onehot)])


def test_wide_per_column_ids_do_not_narrow_the_vectors(tmp_path):
    from tunedb.kernels.schedule import full_bytes, schedule_space

    a = analyze(xent_grad(8, 4096))
    assert a.cls["ids"] == "col" and full_bytes(a) == 4
    assert max(s.vec for s in schedule_space(a)[0]) == 4


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_wide_per_column_ids_match_reference_in_emulation(tmp_path):
    from tunedb.runtime.emu import build, generable_schedules, mismatches

    graphs = [xent_grad(), xent_grad(4, 64, "float16")]
    jobs = [(g, s, generate(g, s, sm_count=2)) for g in graphs for s in generable_schedules(g)
            if s.vec >= 2][::5]
    lib = build([k.source for _, _, p in jobs for k in p.kernels], str(tmp_path))
    failures = mismatches(lib, jobs)
    assert not failures, "\n".join(failures[:20])
    assert len(jobs) >= 10


def test_few_long_rows_split_over_a_cluster_without_a_model():
    # 256 rows of 160 K (640 KB): a block per row leaves each SM one or two blocks; the fallback
    # splits the rows, 4 blocks an SM. UNet's GroupNorm at batch 8 (256 rows of 10240, 40 KB)
    # ran 1.0-1.7x faster a block per row on the H200 than split, so it keeps that.
    def picked(g):
        (step,) = tunedb.compile(g, cost_model=False, device=None).steps
        return dict(step.config)

    few = picked(groupnorm(8, 320, 32, 128, 128))
    assert few["mapping"] == "split_row" and 256 * few["split"] >= 4 * 132
    assert picked(groupnorm(8, 320, 32, 32, 32))["mapping"] == "block_per_row"  # 40 KB rows
    assert picked(groupnorm(32, 320, 32, 128, 128))["mapping"] == "block_per_row"  # 1024 rows
