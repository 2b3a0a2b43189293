"""Copies as index maps (issue 21, generator coverage): a split of a reshaped input (a fused
QKV projection), a repeat of a transposed input (GQA's repeat_kv), slices of a computed
value sunk onto its inputs (GEGLU with its bias add) and views of views
(``domain.reshaped_view``), in one generated kernel; a lone transpose stays the runtime's copy."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import tunedb
from tunedb.graph.builder import GraphBuilder
from tunedb.kernels import generate
from tunedb.kernels.analysis import UnsupportedFusion, analyze
from tunedb.kernels.domain import contiguous_view, index_expr, reshaped_view, shifted_view, view_map


def gqa_repeat(B: int = 2, S: int = 5, KV: int = 2, REP: int = 3, D: int = 8, dtype: str = "float32"):
    """Llama's repeat_kv of the key projection: [B, S, KV*D] -> heads -> each repeated REP times."""
    b = GraphBuilder(f"gqa_repeat_{B}x{S}x{KV}x{REP}x{D}_{dtype}")
    x = b.input("x", (B, S, KV * D), dtype)
    t = b.transpose(b.reshape(x, shape=(B, S, KV, D)), perm=(0, 2, 1, 3))
    e = b.expand(b.unsqueeze(t, axes=(2,)), shape=(B, KV, REP, S, D))
    return b.build([b.reshape(e, shape=(B, KV * REP, S, D))])


def qkv_split(B: int = 2, S: int = 6, H: int = 3, D: int = 4, k_perm: tuple = (0, 2, 1, 3)):
    """Attention input: split of the fused projection, heads of q and k scaled, v as is (GPT-2
    transposes k to [B, H, D, S]: ``k_perm`` (0, 2, 3, 1))."""
    b = GraphBuilder(f"qkv_split_{B}x{S}x{H}x{D}")
    x = b.input("x", (B * S, 3 * H * D))
    q, k, v = b.op("split", b.reshape(x, shape=(B, S, 3 * H * D)), name=["q", "k", "v"], axis=2,
                   sizes=(H * D,) * 3)
    qh = b.transpose(b.reshape(q, shape=(B, S, H, D)), perm=(0, 2, 1, 3))
    kh = b.transpose(b.reshape(k, shape=(B, S, H, D)), perm=k_perm)
    return b.build([b.reshape(v, shape=(B, S, H, D)), b.mul(qh, 0.5), b.mul(kh, 0.25)])


def geglu(B: int = 2, S: int = 6, F: int = 8, dtype: str = "float32"):
    """A diffusion UNet's GEGLU with the projection's bias add: h = x + bias, h[:F] * gelu(h[F:])."""
    b = GraphBuilder(f"geglu_{B}x{S}x{F}_{dtype}")
    bias, x = b.input("bias", (2 * F,), dtype), b.input("x", (B, S, 2 * F), dtype)
    h = b.add(bias, x)
    a = b.slice(h, starts=(0,), ends=(F,), axes=(2,))
    g = b.slice(h, starts=(F,), ends=(2 * F,), axes=(2,))
    return b.build([b.mul(a, b.gelu(g))])


GRAPHS = [gqa_repeat(), gqa_repeat(1, 7, 2, 4, 16, "float16"), qkv_split(), qkv_split(1, 5, 2, 8),
          geglu(), geglu(1, 5, 24, "bfloat16")]


def _offsets(view, numel: int) -> list[int]:
    m = view_map(view)
    return [eval(index_expr(m, str(i), numel).replace("LL", "").replace("/", "//")) for i in range(numel)]


def test_reshaped_views_read_the_same_elements():
    src = np.arange(2 * 3 * 12).reshape(2, 3, 12)
    piece = shifted_view(contiguous_view((2, 3, 12)), 2, 4, 8)  # src[:, :, 8:12]
    want = src[:, :, 8:12]
    for shape in [(2, 3, 2, 2), (6, 4), (2, 1, 3, 4, 1), (2, 3, 4)]:
        view = reshaped_view(piece, shape)
        assert _offsets(view, want.size) == want.reshape(-1).tolist(), shape
    assert reshaped_view(piece, (2, 12)) is None  # a slice's rows merged: no single stride
    assert reshaped_view(shifted_view(contiguous_view((12,)), 0, 12, 3), (3, 4)) is None  # a roll


def test_copies_fuse_as_index_maps():
    for g in GRAPHS:
        a = analyze(g)
        assert a.pattern == "elementwise" and set(dict(a.idx_src).values()) == set(g.inputs)
        assert not [n for n in a.nodes if n.op in ("slice", "split", "transpose", "expand")]
    for g in (gqa_repeat(8, 128, 4, 4, 128), qkv_split(16, 128, 12, 64), geglu(8, 1024, 1280)):
        plan = tunedb.compile(g, cost_model=False, device=None)
        assert [s.kind for s in plan.steps if s.kind != "layout_view"] == ["fused"] and plan.kernels == 1


def test_a_piece_transposed_innermost_is_not_read_element_by_element():
    # GPT-2's k^T moves the innermost dim: element-wise reads would not coalesce, so k goes
    # through a tiled transpose kernel and the split, q and v stay one kernel
    with pytest.raises(UnsupportedFusion, match="read transposed"):
        analyze(qkv_split(k_perm=(0, 2, 3, 1)))
    plan = tunedb.compile(qkv_split(16, 128, 12, 64, (0, 2, 3, 1)), cost_model=False, device=None)
    assert [s.kind for s in plan.steps if s.kind != "layout_view"] == ["fused", "fused"]


def test_a_lone_transpose_stays_the_runtime_copy():
    b = GraphBuilder("head_merge")
    x = b.input("x", (8, 12, 128, 64))
    g = b.build([b.reshape(b.transpose(x, perm=(0, 2, 1, 3)), shape=(8, 128, 768))])
    plan = tunedb.compile(g, cost_model=False, device=None)
    assert [s.kind for s in plan.steps if s.kind != "layout_view"] == ["layout"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_copies_match_reference_in_emulation(tmp_path):
    from tunedb.runtime.emu import build, generable_schedules, mismatches

    jobs = [(g, s, generate(g, s, sm_count=2)) for g in GRAPHS for s in generable_schedules(g)[::3]]
    lib = build([k.source for _, _, p in jobs for k in p.kernels], str(tmp_path))
    failures = mismatches(lib, jobs)
    assert not failures, "\n".join(failures[:20])
    assert len(jobs) >= 40


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_copies_compile_with_nvcc(tmp_path):
    from tunedb.runtime.emu import generable_schedules

    sources = {k.name: k.source for g in GRAPHS for s in generable_schedules(g)[::5]
               for k in generate(g, s).kernels}
    path = tmp_path / "copies.cu"
    path.write_text("\n".join(sources.values()))
    r = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-cubin", "-o", str(tmp_path / "c.cubin"),
                        str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
