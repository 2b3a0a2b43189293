"""``splitk`` and ``chunks`` packs inside plans, over the plan's own buffers: which clusters
qualify, the pointer arithmetic replayed as cuBLAS reads it on NumPy buffers, the plan record
(JSON, check, explain) and, on the GPU, the packed plan against the unpacked one and float64."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from test_packing_extra import _colmajor

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.packing import Member, PackingWorkload
from tunedb.kernels.packing_inplace import inplace_ok, inplace_plan
from tunedb.plan import compile
from tunedb.plan.packing import graph_workloads, plan_candidates
from tunedb.plan.record import Plan
from tunedb.runtime.pack import make_inputs, reference


def deep(dtype: str = "float32", m: int = 64, k: int = 512):
    """Three independent projections with a deep k (split-K pays where few tiles meet a deep k)."""
    rng = np.random.default_rng(3)
    b = GraphBuilder("deep")
    xs = [b.input(f"x{i}", (m, k), dtype) for i in range(3)]
    ys = [b.matmul(x, b.constant(rng.uniform(-0.1, 0.1, (k, 64)).astype(np.float32), dtype)) for x in xs]
    return b.build([b.add(b.add(ys[0], ys[1]), ys[2])])


def pays(name: str):
    def model(w, cands):
        return [100.0 if c.name == "whole:serial" else 30.0 if c.name == name else 99.0 for c in cands]
    return model


def test_which_clusters_run_in_place():
    same = [Member(64, 64, 512), Member(64, 64, 512, batch=2)]
    assert inplace_ok(same, "splitk", split=2) and inplace_ok(same, "splitk", split=4)
    assert not inplace_ok(same, "splitk", split=3)  # 512 = 3 x 176 - 16: the last slice would pad
    assert not inplace_ok([Member(64, 64, 512), Member(32, 64, 512)], "splitk", split=2)  # two m
    assert not inplace_ok([Member(64, 64, 512)], "splitk", split=2)  # one problem
    uneven = [Member(128, 64, 512), Member(64, 64, 512), Member(192, 64, 512, layout="nn")]
    assert inplace_ok(uneven, "chunks", rows=64) and not inplace_ok(uneven, "chunks", rows=128)
    assert inplace_ok(uneven, "chunks", rows=64, split=2)
    assert not inplace_ok(uneven + [Member(64, 32, 512)], "chunks", rows=64)  # another n
    assert not inplace_ok([Member(64, 64, 512, dtype="float16")] * 2, "splitk", split=2)  # no fp16 sum
    assert not inplace_ok(same, "padded") and not inplace_ok(same, "chunks", rows=0)


def _replay(members, inputs, backend, split, rows):
    """The batched call and the slice sum on the host, from ``inplace_plan``'s offsets alone,
    reading and writing each member's own arrays."""
    pl = inplace_plan(members, backend, split, rows)
    xs = [np.asarray(x, np.float64).reshape(mb.batch, mb.m, mb.k) for mb, (x, _) in zip(members, inputs)]
    ws = [np.asarray(w, np.float64).reshape(mb.batch, *w.shape[-2:]) for mb, (_, w) in zip(members, inputs)]
    outs = [np.full((mb.batch, mb.m, mb.n), np.nan) for mb in members]
    part = np.full((split, pl.problems, pl.rows, pl.n), np.nan) if split > 1 else None
    for i, a, x, c in pl.calls:
        A = (_colmajor(ws[i], a, pl.depth, pl.n, pl.lda).T if pl.nt
             else _colmajor(ws[i], a, pl.n, pl.depth, pl.lda))
        B = _colmajor(xs[i], x, pl.depth, pl.rows, pl.k)
        C = _colmajor(outs[i] if part is None else part, c, pl.n, pl.rows, pl.n)
        assert np.isnan(C).all(), "two problems write one block"
        C[...] = A @ B
    if part is not None:
        for q, (i, o) in enumerate(pl.outs):
            blk = outs[i].reshape(-1)[o:o + pl.rows * pl.n]
            assert np.isnan(blk).all()
            blk[...] = part[:, q].sum(axis=0).reshape(-1)
    return outs


@pytest.mark.parametrize("layout", ["nn", "nt"])
@pytest.mark.parametrize(("backend", "split", "rows"),
                         [("splitk", 2, 0), ("splitk", 4, 0), ("chunks", 1, 64), ("chunks", 2, 32)])
def test_inplace_plan_computes_every_member(layout, backend, split, rows):
    if backend == "splitk":
        ms = [Member(48, 40, 512, layout=layout), Member(48, 40, 512, batch=2, layout=layout)]
    else:
        ms = [Member(128, 40, 512, layout=layout), Member(64, 40, 512, batch=2, layout=layout),
              Member(192, 40, 512, layout=layout)]
    w = PackingWorkload("t", "test", tuple(ms))
    inputs = make_inputs(w, seed=4)
    got = _replay(ms, inputs, backend, split, rows)
    for g, r in zip(got, reference(w, inputs)):
        np.testing.assert_allclose(g.reshape(r.shape), r, rtol=1e-5, atol=1e-4)


def test_plans_offer_and_record_inplace_packs():
    (w,) = graph_workloads(deep(), "deep")
    names = {c.name for c in plan_candidates(w)}
    assert {"whole:splitk2", "whole:splitk4", "whole:chunks64", "whole:chunks64k2"} <= names
    assert not any(n.startswith(("whole:padded", "whole:pointer")) for n in names)  # copies: never
    assert "whole:splitk3" not in names  # 512 does not split in three whole slices
    for name in ("whole:splitk4", "whole:chunks64k2"):
        plan = compile(deep(), cost_model=False, device=None, pack_model=pays(name))
        (pk,) = plan.packs
        assert pk.label == name and pk.source == "model"
        again = Plan.from_json(json.loads(plan.dumps()))
        assert again.packs == plan.packs and again.packs[0].clusters == plan.packs[0].clusters
        cl = again.packs[0].clusters[0]
        assert (cl.split, cl.rows) == ((4, 0) if "splitk" in name else (2, 64))
        assert name.split(":")[1] in plan.explain()
        again.check()


def test_check_refuses_inplace_packs_that_would_need_padding():
    plan = compile(deep(m=192), cost_model=False, device=None, pack_model=pays("whole:chunks64"))
    assert plan.packs[0].label == "whole:chunks64"
    d = json.loads(plan.dumps())
    d["packs"][0]["candidate"]["clusters"][0]["rows"] = 128  # 192 rows are not whole chunks of 128
    with pytest.raises(ValueError, match="chunks does not run in a plan"):
        Plan.from_json(d).check()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sum_into_kernel_compiles(tmp_path) -> None:
    from tunedb.runtime.pack_inplace import sum_into_source

    src = tmp_path / "sum_into.cu"
    src.write_text(sum_into_source("float32") + sum_into_source("bfloat16"))
    r = subprocess.run(["nvcc", "-c", "-arch=sm_90", str(src), "-o", str(tmp_path / "s.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["whole:splitk2", "whole:splitk4", "whole:chunks64", "whole:chunks64k2"])
def test_inplace_packs_match_the_unpacked_plan(dtype, name):
    from test_packing_driver_gpu import _run_both

    packed = compile(deep(dtype), device="cuda", pack_model=pays(name))
    assert packed.packs[0].label == name
    _run_both(packed, compile(deep(dtype), device="cuda", pack=False))
