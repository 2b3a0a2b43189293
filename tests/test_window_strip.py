"""The strip of outputs a window-kernel thread computes: the rule (stride-1 rows a strip of 2,
strided windows one output a thread) and every strip width, forced, still matching the float64
reference in the CPU emulator (benchmarks/window_strip.py times them against each other)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace

import pytest
from test_kernels_window import C, H, N, _variants, dwconv_block, pool_block

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.analysis import UnsupportedFusion
from tunedb.kernels.codegen import KernelPlan, KernelSpec
from tunedb.kernels.gen_window import STRIP, strip_width, window_kernel
from tunedb.kernels.schedule import Schedule
from tunedb.records import sha256_hex
from tunedb.runtime.emu import build, mismatches

WINDOW = Schedule.from_config({"mapping": "elementwise", "block": 256})


def _plan(g, strip):
    w = window_kernel(g, strip=strip)
    return KernelPlan((KernelSpec(w.name, w.source, w.grid, w.block, 0, w.args),), (),
                      sha256_hex(w.source), w.R, w.C, "window")


def _jobs_pass_and_a_mutant_fails(tmp_path, jobs, i, old, new, seed):
    """Every job matches the reference in the emulator, and the check can fail: job ``i``'s
    kernel with ``old`` in its source replaced by ``new`` is caught."""
    g, _, good = jobs[i]
    k = good.kernels[0]
    assert old in k.source  # the mutation takes
    src = k.source.replace(old, new).replace(k.name, "mutant")
    mutant = replace(good, kernels=(replace(k, name="mutant", source=src),))
    lib = build([p.kernels[0].source for _, _, p in jobs] + [src], str(tmp_path))
    assert not mismatches(lib, jobs, seed=seed)
    assert len(mismatches(lib, [(g, WINDOW, mutant)], seed=seed)) == 1


def test_the_rules_give_strips_of_two_and_wide_windows_the_plane():
    # generalization_steps*_h200.json: strips of 2 at stride 1 or with an SFU prologue, else 1;
    # 7x7 stride 1 as a plane with strips of 8, other stride-1 planes 4, strided planes 1
    assert strip_width(56, 1) == strip_width(56, 2, sfu=True) == STRIP == 2
    assert strip_width(56, 2) == 1 and strip_width(1, 1) == 1  # 1 output: the strip is the row
    assert strip_width(56, 1, "plane") == 4 and strip_width(56, 2, "plane") == 1
    assert strip_width(56, 1, "plane", 7) == 8 and strip_width(5, 1, "plane", 7) == 5
    for g, width in ((dwconv_block("float32", 3, 1), 2), (dwconv_block("float32", 3, 2), 1),
                     (pool_block("float32", "max_pool2d", 3, 2, 1), 1)):
        w = window_kernel(g)
        assert f"float acc[{width}];" in w.source and w.shared_bytes == 0
    # a plane, strips of 8 (the 9-wide row's) from its tile, given a wave of blocks (16 planes:
    # 2 SMs); else strips
    wide = window_kernel(dwconv_block("float32", 7, 1), sm_count=2)
    assert wide.shared_bytes > 0 and "float acc[8];" in wide.source
    assert window_kernel(dwconv_block("float32", 7, 1)).shared_bytes == 0  # 132 SMs: batch 1
    assert window_kernel(dwconv_block("float32", 7, 2), sm_count=2).shared_bytes == 0
    # a forced strip overrides the rule, capped at the row; a strip of 0 is refused
    assert "float acc[3];" in window_kernel(dwconv_block("float32", 3, 2), strip=3).source
    assert "float acc[9];" in window_kernel(dwconv_block("float32", 3, 1), strip=16).source
    with pytest.raises(ValueError, match="strip 0"):
        window_kernel(dwconv_block("float32", 3, 1), strip=0)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_every_forced_strip_matches_the_float64_reference(tmp_path):
    # odd rows (5 outputs): the edge strip of stride-1 rows and the stride-2 partial last window
    # (the rule's own widths run in test_kernels_window's variants)
    graphs = [dwconv_block("float32", 3, 2, act="silu", residual=True, prologue=True),
              pool_block("float32", "avg_pool2d", 3, 2, 1, True), dwconv_block("float16", 5, 1)]
    jobs = [(g, WINDOW, _plan(g, s)) for g in graphs for s in (2, 3 if g is graphs[2] else 4)]
    assert len({p.source_hash for _, _, p in jobs}) == len(jobs)
    # and the check can fail: a strip of 4 that stores only its first output
    _jobs_pass_and_a_mutant_fails(tmp_path, jobs, 1, "if (ow0 + v >= 5) break;", "if (v >= 1) break;", 5)


def _plane(g, strip=None):
    w = window_kernel(g, layout="plane", strip=strip)
    return KernelPlan((KernelSpec(w.name, w.source, w.grid, w.block, w.shared_bytes, w.args),), (),
                      sha256_hex(w.source), w.R, w.C, "window")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_plane_kernels_match_the_float64_reference(tmp_path):
    # a block per input plane, the plane in shared memory: prologue, residual, both paddings
    graphs = [dwconv_block("float32", 3, 2, act="silu", residual=True, prologue=True),
              pool_block("bfloat16", "avg_pool2d", 3, 2, 1, True),
              pool_block("float32", "avg_pool2d", 3, 1, 1), dwconv_block("float16", 3, 1, dilation=2)]
    odd = GraphBuilder("odd_planes")  # 3 planes: a block of 2 planes ends half empty
    odd_y = odd.max_pool2d(odd.input("x", (1, 3, 9, 9)), kernel=(3, 3), pads=(1, 1, 1, 1))
    graphs.append(odd.build([odd.relu(odd_y)]))
    jobs = [(g, WINDOW, _plane(g)) for g in graphs] + [(graphs[0], WINDOW, _plane(graphs[0], 3))]
    # the conv weights in registers once a plane (``hoist``: a variant step_variants times)
    hoisted = [window_kernel(g, layout="plane", hoist=True) for g in (graphs[0], graphs[3])]
    assert all("float wr[9];" in w.source and "* wr[kh * 3 + kw];" in w.source for w in hoisted)
    jobs += [(g, WINDOW, KernelPlan((KernelSpec(w.name, w.source, w.grid, w.block, w.shared_bytes, w.args),),
                                    (), sha256_hex(w.source), w.R, w.C, "window"))
             for g, w in zip((graphs[0], graphs[3]), hoisted)]
    # planes a block (plane_packing): 25 stride-2 outputs take a warp (8 planes), 81 stride-1
    # outputs in strips of 4 (27 strips) a warp too, capped at the 3 planes there are (2)
    assert [p.kernels[0].shared_bytes for _, _, p in jobs[:6]] == [8 * 324] * 4 + [2 * 324, 8 * 324]
    assert "float acc[3];" in jobs[5][2].kernels[0].source  # strips read from the tile too
    # a tile read one row off fails
    _jobs_pass_and_a_mutant_fails(tmp_path, jobs, 0, "tile[ih * 9 + iw]", "tile[(ih + 1) * 9 + iw]", 3)


def test_a_plane_too_large_for_shared_memory_is_refused():
    b = GraphBuilder("big_plane")
    y = b.max_pool2d(b.input("x", (1, 2, 224, 224)), kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
    with pytest.raises(UnsupportedFusion, match="shared memory"):
        window_kernel(b.build([y]), layout="plane")
    with pytest.raises(ValueError, match="layout 'tile'"):
        window_kernel(b.build([y]), layout="tile")


@pytest.mark.slow  # nvcc over the 39 variants as plane kernels: ~20 s
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_plane_sources_compile_with_nvcc_for_sm90_without_spills(tmp_path):
    graphs = _variants() + [se_block(dt, s) for dt in ("float32", "float16") for s in (1, 2)]
    sources = {p.kernels[0].name: p.kernels[0].source for p in map(_plane, graphs)}
    cu = tmp_path / "plane.cu"
    cu.write_text("\n".join(sources.values()))
    r = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o",
                        str(tmp_path / "plane.cubin"), str(cu)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert len(spills) == len(sources) and not any(spills), spills


@pytest.mark.slow  # 39 variants through g++: ~10 s
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_every_window_variant_as_a_plane_kernel_matches_the_float64_reference(tmp_path):
    jobs = [(g, WINDOW, _plane(g)) for g in _variants()]
    lib = build([p.kernels[0].source for _, _, p in jobs], str(tmp_path))
    assert not mismatches(lib, jobs, seed=11)


def se_block(dtype: str, stride: int, mean: str = "global_avg_pool"):
    """EfficientNet's SiLU -> depthwise conv -> SiLU, and the squeeze-and-excitation mean of it."""
    b = GraphBuilder(f"se_s{stride}_{mean}_{dtype}")
    x = b.input("x", (N, C, H, H), dtype)
    src = b.mul(x, b.sigmoid(x))
    y = b.conv2d(src, b.input("w", (C, 1, 3, 3), dtype), b.input("bias", (C,), dtype),
                 strides=(stride, stride), pads=(1, 1, 1, 1), groups=C)
    y = b.mul(y, b.sigmoid(y))
    m = b.global_avg_pool(y) if mean == "global_avg_pool" else b.reduce_mean(y, axes=(2, 3), keepdims=True)
    return b.build([y, m])


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_a_plane_kernel_writes_the_plane_mean_beside_its_outputs(tmp_path):
    graphs = [se_block("float32", 2), se_block("bfloat16", 1, "reduce_mean")]
    # + one output a thread at stride 1: 81 outputs, 4 warps a plane sum into one mean
    jobs = [(g, WINDOW, _plane(g)) for g in graphs] + [(graphs[1], WINDOW, _plane(graphs[1], 1))]
    assert "q < (p + 1) * 4;" in jobs[-1][2].kernels[0].source
    assert all("tdb_wsum<32>" in p.kernels[0].source for _, _, p in jobs)
    # a mean over one output too few fails
    _jobs_pass_and_a_mutant_fails(tmp_path, jobs, 0, "/ 25.0f", "/ 24.0f", 2)


def test_a_plane_mean_needs_the_plane_layout_and_must_be_a_final_output():
    g = se_block("float32", 2)
    assert window_kernel(g, sm_count=2).shared_bytes > 0  # the default layout takes the plane
    with pytest.raises(UnsupportedFusion, match="under a wave"):  # 2 blocks of planes
        window_kernel(g)
    with pytest.raises(UnsupportedFusion, match="plane layout"):
        window_kernel(g, layout="strip")
    b = GraphBuilder("mean_read")
    x = b.input("x", (N, C, H, H))
    y = b.max_pool2d(x, kernel=(3, 3), pads=(1, 1, 1, 1))
    m = b.global_avg_pool(y)
    with pytest.raises(UnsupportedFusion, match="read by no node"):
        window_kernel(b.build([b.add(y, m)]), layout="plane")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_a_row_outside_the_input_is_a_predicate_on_each_tap_not_a_branch(tmp_path):
    # a branch around each kernel row made every row's loads wait for the previous row's (one
    # memory latency a row: e5983d8's strided windows 1.2-1.4x slower than bcaadf4's): the row's
    # bounds now join each column's test in strip kernels (plane kernels read shared memory,
    # where all rows in flight spill registers, and keep the branch)
    graphs = [dwconv_block("float32", 3, 2, prologue=True), pool_block("float32", "avg_pool2d", 3, 1, 1),
              pool_block("float16", "max_pool2d", 3, 2, 1)]
    jobs = [(g, WINDOW, _plan(g, None)) for g in graphs] + [(graphs[1], WINDOW, _plane(graphs[1]))]
    for _, _, p in jobs[:3]:
        src = p.kernels[0].source
        assert "if (ih < 0 || ih >= 9) continue;" not in src
        assert "const bool rin = ih >= 0 && ih < 9;" in src and "if (!rin || iw < 0" in src
    assert "if (ih < 0 || ih >= 9) continue;" in jobs[3][2].kernels[0].source
    # the average without the padding counts only taps inside both bounds; a window that also
    # drops the first input row fails
    _jobs_pass_and_a_mutant_fails(tmp_path, jobs, 1, "const bool rin = ih >= 0 && ih < 9;",
                                  "const bool rin = ih >= 1 && ih < 9;", 7)
