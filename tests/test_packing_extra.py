"""The split-K and chunked packing backends without a GPU: their pointer arithmetic replayed as
cuBLAS would read it (column-major, leading dimensions, transposes) on NumPy buffers, their
candidates, and the slice-summing kernel compiled by nvcc; on the GPU every candidate against the
float64 reference."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from tunedb.kernels.packing import (
    Candidate,
    Member,
    PackingWorkload,
    candidate_waste,
    candidates,
    chunk_candidates,
    splitk_candidates,
    splitk_depth,
)
from tunedb.runtime.blas import OP_T
from tunedb.runtime.pack import make_inputs, reference
from tunedb.runtime.pack_chunks import chunk_plan, member_buffers, member_outputs
from tunedb.runtime.pack_splitk import splitk_plan, stacks, sum_source


def _colmajor(buf: np.ndarray, off: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The column-major ``rows x cols`` matrix cuBLAS reads at element ``off`` with ``ld``."""
    flat = buf.reshape(-1)
    need = off + (rows - 1) + (cols - 1) * ld
    assert 0 <= off and need < flat.size, "a slice reads past its buffer"
    isz = flat.strides[0]
    return np.lib.stride_tricks.as_strided(flat[off:], shape=(rows, cols), strides=(isz, ld * isz))


def _replay(members: list[Member], inputs: list, split: int) -> list[np.ndarray]:
    """The batched call and the slice sum on the host, from the plan's offsets alone."""
    pl = splitk_plan(members, split)
    X, W = stacks(np, members, inputs, pl)
    X, W = X.astype(np.float64), W.astype(np.float64)
    part = np.full((split, pl.P, pl.M, pl.N), np.nan)
    for a_off, b_off, c_off in pl.offsets:
        if pl.transa == OP_T:  # A stored k x m, read transposed
            A = _colmajor(W, a_off, pl.depth, pl.N, pl.lda).T
        else:
            A = _colmajor(W, a_off, pl.N, pl.depth, pl.lda)
        B = _colmajor(X, b_off, pl.depth, pl.M, pl.ldb)
        C = _colmajor(part, c_off, pl.N, pl.M, pl.ldc)
        assert np.isnan(C).all(), "two slices write one partial"
        C[...] = A @ B
    total = part.sum(axis=0)
    outs, p = [], 0
    for mb in members:
        outs.append(total[p:p + mb.batch, :mb.m, :mb.n])
        p += mb.batch
    return outs


@pytest.mark.parametrize("layout", ["nn", "nt"])
@pytest.mark.parametrize("split", [2, 3, 4])
def test_splitk_plan_computes_every_member(layout: str, split: int) -> None:
    ms = [Member(40, 24, 300, layout=layout), Member(17, 24, 296, batch=2, layout=layout),
          Member(33, 9, 301, layout=layout)]
    w = PackingWorkload("t", "test", tuple(ms))
    inputs = make_inputs(w, seed=3)
    got = _replay(ms, inputs, split)
    for g, r in zip(got, reference(w, inputs)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-4)
    pl = splitk_plan(ms, split)
    assert pl.depth % 8 == 0 and pl.padded_k >= 301 and pl.padded_k - 301 < 8 * split
    assert len(pl.offsets) == split * 4


def test_splitk_plan_wrong_offsets_would_fail() -> None:
    """The replay notices a slice reading the wrong depth (what the test above relies on)."""
    ms = [Member(8, 8, 256), Member(8, 8, 256)]
    w = PackingWorkload("t", "test", tuple(ms))
    inputs = make_inputs(w, seed=1)
    pl = splitk_plan(ms, 2)
    X, W = stacks(np, ms, inputs, pl)
    a0, b0, _ = pl.offsets[0]
    a1, b1, _ = pl.offsets[1 * pl.P]  # slice 1 of problem 0
    assert b1 - b0 == pl.depth and a1 - a0 == pl.depth * pl.N
    first = _colmajor(X.astype(np.float64), b0, pl.depth, pl.M, pl.ldb)
    np.testing.assert_array_equal(first.T, X[0, :, :pl.depth])


def test_splitk_candidates() -> None:
    w = PackingWorkload("r20", "replicas", tuple(Member(256, 128, 1152) for _ in range(20)))
    sk = splitk_candidates(w)
    names = {c.name for c in sk}
    assert {"whole:splitk2", "whole:splitk3", "whole:splitk4", "whole:splitk8"} <= names
    assert not any(c.name.startswith("whole:splitk") for c in candidates(w))
    c4 = next(c for c in sk if c.name == "whole:splitk4")
    assert Candidate.from_json(c4.to_json()) == c4
    assert candidate_waste(w, c4) == 0.0  # 1152 = 4 slices of 288
    c3 = Candidate.from_json({**c4.to_json(), "clusters": [{**c4.to_json()["clusters"][0], "split": 3}]})
    assert splitk_depth(1152, 3) == 384 and candidate_waste(w, c3) == 0.0
    odd = PackingWorkload("o", "t", (Member(64, 64, 1000), Member(64, 64, 1000)))
    c8 = next(c for c in splitk_candidates(odd) if c.name == "whole:splitk8")
    assert candidate_waste(odd, c8) == pytest.approx(1 - 1000 / 1024)
    # the stored candidates' JSON (and so their hashes) has no split field
    assert all("split" not in cl for c in candidates(w) for cl in c.to_json()["clusters"])
    # fp16, and members too shallow to slice, get none
    assert splitk_candidates(PackingWorkload("h", "t", (Member(8, 8, 1152, dtype="float16"),) * 2)) == []
    assert splitk_candidates(PackingWorkload("s", "t", (Member(8, 8, 200),) * 2)) == []
    with pytest.raises(ValueError, match="split"):
        Candidate.from_json({"partition": "whole", "clusters": [{"members": [0], "backend": "padded",
                                                                 "split": 2}]})


def _replay_chunks(members: list[Member], inputs: list, rows: int, split: int) -> list[np.ndarray]:
    pl = chunk_plan(members, rows, split)
    bufs = [tuple(b.astype(np.float64) for b in pair) for pair in member_buffers(np, members, inputs, pl)]
    C = np.full((split, pl.total_rows, pl.N), np.nan)
    for i, a_off, x_off, c_off in pl.chunks:
        X, W = bufs[i]
        if pl.transa == OP_T:
            A = _colmajor(W, a_off, pl.depth, pl.N, pl.lda).T
        else:
            A = _colmajor(W, a_off, pl.N, pl.depth, pl.lda)
        B = _colmajor(X, x_off, pl.depth, rows, pl.K)
        out = _colmajor(C, c_off, pl.N, rows, pl.N)
        assert np.isnan(out).all(), "two chunks write the same rows"
        out[...] = A @ B
    assert not np.isnan(C).any(), "rows no chunk writes"
    return member_outputs(C.sum(axis=0), members, pl)


@pytest.mark.parametrize("layout", ["nn", "nt"])
@pytest.mark.parametrize("rows,split", [(8, 1), (16, 1), (64, 1), (16, 2), (8, 3)])
def test_chunk_plan_computes_every_member(layout: str, rows: int, split: int) -> None:
    ms = [Member(40, 24, 300, layout=layout), Member(17, 24, 300, batch=2, layout=layout, weight="s"),
          Member(3, 24, 300, batch=2, layout=layout, weight="s"), Member(33, 9, 290, layout=layout)]
    w = PackingWorkload("t", "test", tuple(ms))
    inputs = make_inputs(w, seed=4)
    for g, r in zip(_replay_chunks(ms, inputs, rows, split), reference(w, inputs)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-4)
    pl = chunk_plan(ms, rows, split)
    assert len(pl.chunks) == split * sum(mb.batch * -(-mb.m // rows) for mb in ms)
    assert all(mp % rows == 0 and 0 <= mp - mb.m < rows for mp, mb in zip(pl.padded_m, ms))
    assert pl.K == (300 if split == 1 else split * splitk_depth(300, split))


def test_chunk_candidates() -> None:
    seqs = (16, 32, 48, 64, 128, 128, 256, 384)
    w = PackingWorkload("bert", "t", tuple(Member(s, 768, 768, dtype="bfloat16", layout="nt")
                                           for s in seqs for _ in range(3)))
    cs = {c.name: c for c in chunk_candidates(w)}
    assert "whole:chunks64" in cs and not any(c.name.startswith("whole:chunks") for c in candidates(w))
    c64 = cs["whole:chunks64"]
    assert Candidate.from_json(c64.to_json()) == c64
    useful = sum(seqs) * 3
    assert candidate_waste(w, c64) == pytest.approx(1 - useful / (3 * (64 * 4 + 128 * 2 + 256 + 384)))
    assert chunk_candidates(PackingWorkload("one", "t", (Member(16, 8, 8),))) == []
    # slices of the depth only where few tiles meet a deep k (LoRA shrink), not for BERT's 768
    assert not any(cl.split > 1 for c in cs.values() for cl in c.clusters if c.partition == "whole"
                   and cl.rows == 64)
    lora = PackingWorkload("lora", "t", tuple(Member(m, r, 4096, dtype="bfloat16")
                                              for m, r in ((245, 8), (98, 64), (40, 16), (25, 8))))
    names = {c.name for c in chunk_candidates(lora)}
    assert {"whole:chunks64", "whole:chunks64k2", "whole:chunks64k4", "whole:chunks64k8"} <= names
    c8 = next(c for c in chunk_candidates(lora) if c.name == "whole:chunks64k8")
    assert Candidate.from_json(c8.to_json()) == c8 and c8.clusters[0].split == 8


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_splitk_sum_kernel_compiles(tmp_path) -> None:
    src = tmp_path / "sum.cu"
    src.write_text(sum_source("float32") + sum_source("bfloat16"))
    r = subprocess.run(["nvcc", "-c", "-arch=sm_90", str(src), "-o", str(tmp_path / "sum.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.raises(Exception, match="split-K output"):
        sum_source("float16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extra_candidates_on_the_gpu(dtype: str) -> None:
    """Every split-K and chunked candidate against the float64 reference, eagerly and replayed as a graph;
    cleared outputs fail the check, so a replay that writes nothing cannot pass."""
    import cupy as cp

    from tunedb.runtime.pack import PackedRun, time_stream, worst_error
    from tunedb.runtime.streams import StreamPool

    ms = (Member(48, 64, 1000, dtype=dtype), Member(17, 64, 1000, dtype=dtype),
          Member(48, 64, 1000, batch=3, dtype=dtype), Member(33, 40, 520, layout="nt", dtype=dtype),
          Member(9, 40, 520, layout="nt", weight="w", dtype=dtype),
          Member(20, 40, 520, layout="nt", weight="w", dtype=dtype))
    w = PackingWorkload("splitk_" + dtype, "test", ms)
    pool = StreamPool(8)
    inputs = make_inputs(w, seed=5)
    refs = reference(w, inputs)
    sk = splitk_candidates(w) + chunk_candidates(w)
    assert any(c.concurrent > 1 for c in sk) and len({c.name for c in sk}) == len(sk)
    assert {cl.backend for c in sk for cl in c.clusters} == {"splitk", "chunks", "serial"}
    for cand in sk:
        run = PackedRun(cp, w, cand, inputs, pool)
        run.run()
        assert worst_error(w, run.outputs(), refs) <= 1.0, cand.name
        run.clear_outputs()
        assert worst_error(w, run.outputs(), refs) > 1.0
        run.capture()
        run.replay()
        assert worst_error(w, run.outputs(), refs) <= 1.0, f"{cand.name} replayed"
        assert min(time_stream(cp, run.replay, run.main, reps=2, samples=2)) > 0
    pool.close()


def test_ingest_stores_the_extra_backends_with_their_parameters() -> None:
    """Since feature schema packing/6, bench rows of split-K / chunked candidates are stored like
    the rest (slices and rows in the config, which hashes them apart); peers stay bench data."""
    from collectors.packing_ingest import records_of
    from tunedb.records import Protocol

    w = PackingWorkload("r4", "replicas", tuple(Member(256, 128, 1152) for _ in range(4)))
    rows = [{"system": "tunedb", "variant": c.name, "candidate": c.to_json(), "status": "ok",
             "samples_us": [1.0, 1.1]} for c in candidates(w)[:2] + splitk_candidates(w)[:2]
            + chunk_candidates(w)[:1]]
    rows.append({"system": "torch", "variant": "graph loop", "status": "ok", "samples_us": [2.0]})
    ws, cs, ms = records_of([{"workload": w.to_json(), "rows": rows}], "dev", "run",
                            Protocol(warmup=3, samples=2, flush_l2=False, batch=10))
    assert len(ws) == 1 and len(cs) == 5 and len(ms) == 5 and len({c.hash for c in cs}) == 5
    backends = [c.config_dict["backends"] for c in cs]
    assert sum(b.startswith("splitk") for b in backends) == 2
    assert sum(b.startswith("chunks") for b in backends) == 1
