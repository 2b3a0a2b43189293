"""Index-mapped operands of row and elementwise kernels (GroupNorm's per-channel affine behind a
reshape): ``frame.row_index_expr`` splits each term of the map into its row and column parts in
32-bit arithmetic, and a map that steps only every V elements is read once a vector. Checked as
expressions against the flat map, in the generated source, and (slow tier) in emulation against
the float64 reference, including shapes where a vector crosses a channel."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from test_kernels_generalization import groupnorm, instnorm

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels import generate
from tunedb.kernels.analysis import analyze
from tunedb.kernels.domain import index_expr, index_map, rolled_map
from tunedb.kernels.frame import row_index_expr
from tunedb.kernels.schedule import schedule_space


def _py(expr: str) -> str:
    """A generated C index expression as Python (unsigned casts and suffixes dropped, C's
    integer division)."""
    return re.sub(r"(\d+)(u|LL)\b", r"\1", expr.replace("(unsigned)", "")).replace("/", "//")


MAPS = [  # (map, R, C): GroupNorm's channel and group operands, a rolled read, a plain broadcast
    (index_map((1, 320, 1, 1), (8, 320, 32, 32)), 256, 10240),
    (index_map((1, 32, 1), (8, 32, 10240)), 256, 10240),
    (index_map((1, 6, 1, 1), (2, 6, 3, 5)), 4, 45),
    (index_map((3, 1, 5, 1), (3, 4, 5, 6)), 12, 30),
    (rolled_map((2, 3, 8, 16), (2, 3, 8, 16), 3, 8), 48, 16),
    (rolled_map((1, 4, 33, 32), (1, 4, 3, 32), 2, 0), 33, 128),
]


@pytest.mark.parametrize("m,R,C", MAPS)
def test_row_index_expr_is_the_flat_map(m, R, C):
    rng = np.random.default_rng(0)
    rows = sorted({0, R - 1, *rng.integers(0, R, 6).tolist()})
    for V in (1, 2, 4):
        if C % V:
            continue
        got = _py(row_index_expr(m, "row", "col", R, C, V))
        assert "LL" not in row_index_expr(m, "row", "col", R, C, V)  # 32-bit: everything fits
        want = _py(index_expr(m, "flat", R * C))
        for row in rows:
            for col in range(0, C, max(1, C // 97)):
                assert eval(got, {"row": row, "col": col}) == eval(want, {"flat": row * C + col})


def test_row_index_expr_keeps_64_bit_arithmetic_where_offsets_may_not_fit():
    m = index_map((1, 64, 1), (1 << 16, 64, 1 << 10))
    assert "LL" in row_index_expr(m, "row", "col", 1 << 22, 1 << 10, 4)


def _row_schedule(g, mapping: str, vec: int):
    legal, _ = schedule_space(g, sm_count=132)
    return next(s for s in legal if s.mapping == mapping and s.vec == vec and s.split == 1)


def test_group_norm_affine_is_read_once_a_vector_in_32_bit():
    g = groupnorm(8, 320, 32, 32, 32)  # UNet's: 256 rows of 10240, channels of 1024
    src = generate(g, _row_schedule(g, "block_per_row", 4), sm_count=132).kernels[0].source
    loads = re.findall(r"const float iu_\w+ = (\w+)\[([^;]*)\];", src)
    assert len(loads) == 2 and all("LL" not in at and "k" not in at for _, at in loads)
    assert "+ k)" not in src.split("iu_")[-1].split("tdb_st")[0]  # no per-element index left


def test_a_vector_across_a_channel_reads_each_element():
    g = groupnorm(2, 4, 2, 3, 5)  # channels of 15: a vector of 2 or 4 crosses a channel
    checked = 0
    for s in schedule_space(g, sm_count=132)[0]:
        if s.vec > 1:
            src = generate(g, s, sm_count=132).kernels[0].source
            assert "iu_" not in src and "+ k)" in src
            checked += 1
    assert checked


def _jobs():
    b = GraphBuilder("groupnorm_silu_2x12x3x4x4")  # UNet's block: GroupNorm, affine, SiLU
    x = b.input("x", (2, 12, 4, 4))
    g, bb = b.input("g", (12, 1, 1)), b.input("bb", (12, 1, 1))
    y = b.reshape(x, shape=(2, 3, 64))
    m = b.reduce_mean(y, axes=(2,), keepdims=1)
    d = b.sub(y, m)
    v = b.reduce_mean(b.mul(d, d), axes=(2,), keepdims=1)
    n = b.reshape(b.div(d, b.sqrt(b.add(v, b.scalar(1e-5, v)))), shape=(2, 12, 4, 4))
    a = b.add(b.mul(n, g), bb)
    silu = b.build([b.mul(a, b.sigmoid(a))])
    from tunedb.runtime.emu import generable_schedules

    jobs = []
    for graph in (groupnorm(2, 8, 4, 3, 8), groupnorm(2, 4, 2, 3, 5), groupnorm(3, 16, 4, 2, 2),
                  instnorm(2, 3, 16, 40), silu):
        picked: dict[tuple, object] = {}
        for s in generable_schedules(graph):
            picked.setdefault((s.mapping, s.split, s.row_cache, s.vec), s)
        jobs += [(graph, s, generate(graph, s, sm_count=2)) for s in picked.values()]
    return jobs


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_index_mapped_norms_match_reference_in_emulation(tmp_path):
    from tunedb.runtime.emu import build, mismatches

    jobs = _jobs()
    srcs = [k.source for _, _, p in jobs for k in p.kernels]
    assert any("iu_" in s for s in srcs) and any("+ k)" in s for s in srcs)  # both paths
    assert {analyze(g).pattern for g, _, _ in jobs} == {"row_reduce"}
    lib = build(srcs, str(tmp_path))
    failures = mismatches(lib, jobs)
    assert not failures, "\n".join(failures[:20])


def test_few_long_rows_take_a_block_of_512_threads():
    """The roofline fallback schedules GroupNorms (index-mapped, unseen by the model): 256-512
    rows of 16 KB or more a block of 512 threads, as timed on the H200; many rows keep 256."""
    import tunedb

    def picked(g):
        (step,) = [s for s in tunedb.compile(g, device=None).steps if s.kind == "fused"]
        return step.cost_source, step.config_dict["mapping"], step.config_dict["block"]

    assert picked(groupnorm(16, 64, 32, 56, 56)) == ("roofline", "block_per_row", 512)  # 512 x 25 KB
    assert picked(groupnorm(64, 320, 32, 32, 32)) == ("roofline", "block_per_row", 256)  # 2048 rows


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_group_norm_row_kernel_fits_its_registers_under_nvcc(tmp_path):
    """The old per-element 64-bit offsets took UNet's GroupNorm kernel (time embedding added,
    affine, SiLU) to 175-222 registers at 256 threads (one block an SM: 256 rows in two waves)
    and 89 at 512; at both it must build for sm_90 without spilling, two blocks an SM."""
    import subprocess

    b = GraphBuilder("gn_temb_silu_8x320x32x32x32")
    x, t = b.input("x", (8, 320, 32, 32)), b.input("t", (8, 320, 1, 1))
    gamma, beta = b.input("g", (320, 1, 1)), b.input("bb", (320, 1, 1))
    y = b.reshape(b.add(x, t), shape=(8, 32, 10240))
    d = b.sub(y, b.reduce_mean(y, axes=(2,), keepdims=1))
    v = b.reduce_mean(b.mul(d, d), axes=(2,), keepdims=1)
    n = b.reshape(b.div(d, b.sqrt(b.add(v, b.scalar(1e-5, v)))), shape=(8, 320, 32, 32))
    a = b.add(b.mul(n, gamma), beta)
    g = b.build([b.mul(a, b.sigmoid(a))])
    for block in (256, 512):
        s = next(s for s in schedule_space(g, sm_count=132)[0] if s.mapping == "block_per_row"
                 and s.block == block and s.vec == 4 and s.row_cache == "registers" and not s.stream
                 and not s.evict_last and not s.fast_math)
        cu = tmp_path / f"gn{block}.cu"
        cu.write_text(generate(g, s, sm_count=132).kernels[0].source)
        r = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o",
                            str(tmp_path / f"gn{block}.cubin"), str(cu)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
        assert "0 bytes spill stores" in r.stderr and regs * block * 2 <= 65536, r.stderr
