"""Windowed kernels (depthwise convolutions, pools) with their elementwise neighbours fused in:
every variant run in the CPU emulator against the float64 reference, the sources compiled by
nvcc for sm_90 (slow), and the pattern's limits reported as ``UnsupportedFusion``."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace

import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.analysis import UnsupportedFusion
from tunedb.kernels.codegen import generate
from tunedb.kernels.gen_window import WINDOW_CONFIG, match_window
from tunedb.kernels.schedule import Schedule
from tunedb.runtime.emu import build, check_plan, mismatches
from tunedb.runtime.inputs import make_inputs, reference_outputs

DTYPES = ("float32", "float16", "bfloat16")
N, C, H = 2, 8, 9  # odd spatial size: the stride-2 windows end on a partial edge


def _plan(g):
    return generate(g, Schedule.from_config(WINDOW_CONFIG))


def _chan(b: GraphBuilder, name: str, dtype: str) -> str:
    return b.input(name, (1, C, 1, 1), dtype)


def dwconv_block(dtype: str, k: int, stride: int, act: str = "relu6", residual: bool = False,
                 bias: bool = True, prologue: bool = False, dilation: int = 1):
    """Depthwise conv -> BN affine -> activation (-> residual add), as MobileNet/EfficientNet."""
    tags = ("_res" if residual else "") + ("_pro" if prologue else "")
    b = GraphBuilder(f"dw{k}s{stride}d{dilation}_{act}_{dtype}{tags}")
    x = b.input("x", (N, C, H, H), dtype)
    w = b.input("w", (C, 1, k, k), dtype)
    src = b.relu(x) if prologue else x
    pad = dilation * (k // 2)
    ins = (src, w, b.input("bias", (C,), dtype)) if bias else (src, w)
    y = b.conv2d(*ins, strides=(stride, stride), pads=(pad,) * 4, dilations=(dilation, dilation), groups=C)
    y = b.add(b.mul(y, _chan(b, "scale", dtype)), _chan(b, "shift", dtype))
    if act == "relu6":
        y = b.clip(y, min=0.0, max=6.0)
    elif act == "silu":
        y = b.mul(y, b.sigmoid(y))
    elif act == "hardswish":
        y = b.div(b.mul(y, b.clip(b.add(y, 3.0), min=0.0, max=6.0)), 6.0)
    if residual:
        y = b.add(y, b.input("res", (N, C, -(-H // stride), -(-H // stride)), dtype))
    return b.build([y])


def pool_block(dtype: str, op: str, k: int, stride: int, pad: int, include_pad: bool = False):
    b = GraphBuilder(f"{op}{k}s{stride}p{pad}{'_inc' if include_pad else ''}_{dtype}")
    x = b.input("x", (N, C, H, H), dtype)
    kw = {"count_include_pad": include_pad} if op == "avg_pool2d" else {}
    y = b.op(op, b.add(x, _chan(b, "bias", dtype)), kernel=(k, k), strides=(stride, stride),
             pads=(pad,) * 4, **kw)
    return b.build([b.relu(y)])


def _variants():
    gs = []
    for dt in DTYPES:
        for k in (3, 5, 7):
            for s in (1, 2):
                gs.append(dwconv_block(dt, k, s))
        gs.append(dwconv_block(dt, 3, 1, act="silu", residual=True, prologue=True))
        gs.append(dwconv_block(dt, 5, 2, act="hardswish", bias=False))
        gs.append(dwconv_block(dt, 7, 1, act="none"))
        gs.append(dwconv_block(dt, 3, 1, dilation=2))  # ConvNeXt: 7x7 then a norm elsewhere
        gs.append(pool_block(dt, "max_pool2d", 3, 2, 1))
        gs.append(pool_block(dt, "avg_pool2d", 3, 1, 1))
        gs.append(pool_block(dt, "avg_pool2d", 3, 2, 1, include_pad=True))
    return gs


@pytest.mark.slow  # 36 variants through g++: ~7 s
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_every_window_variant_matches_the_float64_reference(tmp_path):
    graphs = _variants()
    window = Schedule.from_config(WINDOW_CONFIG)
    jobs = [(g, window, generate(g, window)) for g in graphs]
    lib = build([p.kernels[0].source for _, _, p in jobs], str(tmp_path))
    bad = mismatches(lib, jobs, seed=7)
    assert not bad, bad
    assert len(graphs) == 39


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_one_variant_passes_and_a_wrong_window_fails(tmp_path):
    # The fast tier's check, and proof it can fail: 3x3 taps that skip the last column are off.
    good = _plan(dwconv_block("bfloat16", 3, 2, act="silu", residual=True, prologue=True))
    g = dwconv_block("float32", 3, 1)
    plan = _plan(g)
    k = plan.kernels[0]
    assert "kw < 3;" in k.source
    broken = k.source.replace("kw < 3;", "kw < 2;").replace(k.name, k.name + "_broken")
    bad_plan = replace(plan, kernels=(replace(k, name=k.name + "_broken", source=broken),))
    lib = build([good.kernels[0].source, broken], str(tmp_path))
    gg = dwconv_block("bfloat16", 3, 2, act="silu", residual=True, prologue=True)
    dev, ref = make_inputs(gg, 3)
    assert check_plan(lib, gg, good, dev, reference_outputs(gg, ref))[1] <= 1.0
    dev, ref = make_inputs(g, 7)
    assert check_plan(lib, g, bad_plan, dev, reference_outputs(g, ref))[1] > 1.0


def test_sources_are_deterministic_and_the_pattern_split_is_right():
    g = dwconv_block("float16", 3, 1, act="silu", residual=True, prologue=True)
    assert _plan(g).source_hash == _plan(g).source_hash
    m = match_window(g)
    assert m.node.op == "conv2d"
    assert [n.op for n in m.prologue] == ["relu"]
    assert [n.op for n in m.epilogue] == ["mul", "add", "sigmoid", "mul", "add"]


def test_out_of_pattern_graphs_raise_unsupported_fusion():
    b = GraphBuilder("dense")
    x = b.input("x", (1, 4, 5, 5))
    w = b.input("w", (4, 4, 3, 3))
    with pytest.raises(UnsupportedFusion, match="depthwise"):
        match_window(b.build([b.conv2d(x, w, pads=(1, 1, 1, 1))]))
    b = GraphBuilder("rowwise")
    x = b.input("x", (1, 4, 5, 5))
    y = b.max_pool2d(b.relu(x), kernel=(3, 3), pads=(1, 1, 1, 1))
    with pytest.raises(UnsupportedFusion, match="broadcasts"):
        _plan(b.build([b.add(y, b.input("r", (1, 1, 1, 5)))]))
    b = GraphBuilder("prologue_out")
    x = b.input("x", (1, 4, 5, 5))
    r = b.relu(x)
    with pytest.raises(UnsupportedFusion, match="prologue"):
        match_window(b.build([r, b.max_pool2d(r, kernel=(3, 3), pads=(1, 1, 1, 1))]))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_window_sources_compile_with_nvcc_for_sm90(tmp_path):
    sources = {p.kernels[0].name: p.kernels[0].source for p in map(_plan, _variants())}
    cu = tmp_path / "window.cu"
    cu.write_text("\n".join(sources.values()))
    r = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o",
                        str(tmp_path / "window.cubin"), str(cu)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("Compiling entry function") == len(sources)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert len(spills) == len(sources) and not any(spills), spills


def test_a_thread_loads_each_input_column_of_its_strip_once():
    # 2 outputs of a 5x5 stride-1 row share 6 input columns (not 2 x 5 taps); a 3x3 stride-2
    # window, one output a thread (``strip_width``), loads each tap where it adds it
    assert "float row[6];" in _plan(dwconv_block("float32", 5, 1)).kernels[0].source
    strided = _plan(dwconv_block("float32", 3, 2)).kernels[0].source
    assert "float row" not in strided and "for (int kw = 0; kw < 3; ++kw) {" in strided
    narrow = GraphBuilder("narrow")  # a row of 1 output: the strip is the row
    x = narrow.input("x", (1, 4, 5, 1))
    y = narrow.max_pool2d(x, kernel=(3, 3), pads=(1, 1, 1, 1))
    assert "float acc[1];" in _plan(narrow.build([y])).kernels[0].source
