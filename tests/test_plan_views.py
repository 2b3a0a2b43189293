"""Strided views (tunedb.plan.views): layouts against NumPy, the attention graphs' views, their
buffers, and plans that still compute the graph (CPU reference walk over the steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from tunedb.bench.plan import collect_entries, load_entry
from tunedb.graph.ir import Node
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.subgraph import GraphIndex
from tunedb.plan.views import Layout, contiguous, reshaped, strided_view_nodes, view_layouts
from tunedb.runtime.copykernel import chunk_bytes, copy_source, transpose_source

ROOT = Path(__file__).resolve().parents[1]
DYNAMIC = ROOT / "data" / "graphs" / "dynamic"


def _numpy_view(lay: Layout) -> np.ndarray:
    base = np.zeros(1, dtype=np.float64)
    return as_strided(base, shape=lay.shape, strides=tuple(8 * s for s in lay.strides))


RESHAPES = [  # (shape, permutation), new shape
    (((2, 3, 4, 5), (0, 2, 1, 3)), (2, 4, 15)),    # heads merged back after a transpose: copy
    (((2, 3, 4, 5), (0, 2, 1, 3)), (8, 3, 5)),     # leading dims merge: a view
    (((2, 3, 4, 5), (0, 1, 2, 3)), (6, 20)),
    (((2, 3, 4, 5), (0, 1, 3, 2)), (6, 5, 4)),
    (((2, 3, 4, 5), (0, 1, 3, 2)), (2, 3, 20)),     # copy
    (((6, 1, 4), (2, 1, 0)), (4, 6)),
    (((6, 8), (1, 0)), (2, 4, 6)),                  # split a strided dim: a view
    (((6, 8), (1, 0)), (8, 2, 3)),
]


@pytest.mark.parametrize("src,new", RESHAPES)
def test_reshape_without_copy_agrees_with_numpy(src, new):
    shape, perm = src
    c = contiguous(shape)
    lay = Layout(tuple(shape[p] for p in perm), tuple(c.strides[p] for p in perm))
    got = reshaped(lay, new)
    arr = _numpy_view(lay)
    want = arr.reshape(new)
    if np.shares_memory(arr, want):
        assert got is not None
        assert [s for s, d in zip(got.strides, new) if d != 1] == \
               [s // 8 for s, d in zip(want.strides, new) if d != 1]
    else:
        assert got is None


def test_slice_and_split_layouts():
    lay = contiguous((4, 10))
    sl = view_layouts(Node("slice", ("x",), ("y",), (("axes", (1,)), ("starts", (2,)), ("ends", (8,)),
                                                      ("steps", (2,)))), lay, [(4, 3)])
    assert sl == [Layout((4, 3), (10, 2), 2)]
    parts = view_layouts(Node("split", ("x",), ("a", "b"), (("axis", 1), ("sizes", (3, 7)))), lay,
                         [(4, 3), (4, 7)])
    assert parts == [Layout((4, 3), (10, 1), 0), Layout((4, 7), (10, 1), 3)]
    neg = Node("slice", ("x",), ("y",), (("axes", (1,)), ("starts", (8,)), ("ends", (2,)), ("steps", (-1,))))
    assert view_layouts(neg, lay, [(4, 6)]) is None


def _graph(name: str, batch: int):
    e = collect_entries([DYNAMIC / f"{name}.onnx"], batches=[batch])[0]
    return load_entry(e)[0]


@pytest.mark.parametrize("name,views", [("bert_layer", 3), ("gpt2_block", 4)])
def test_attention_transposes_feeding_matmuls_are_views(name, views):
    g = _graph(name, 2)
    ix = GraphIndex(g)
    found = strided_view_nodes(g.nodes, g.type_map, ix.consumers, set(g.outputs))
    ops = sorted(g.nodes[i].op for i in found)
    # q, k, v head transposes (and GPT-2's QKV split); never the transpose back, whose reshape
    # to [B, S, H*D] has no strides over the transposed bytes
    assert len(found) == views and set(ops) <= {"transpose", "split"}
    for i in found:
        assert all(ix.nodes[c].op in ("matmul", "reshape", "transpose") for o in g.nodes[i].outputs
                   for c in ix.consumers[o])
    back = [i for i, n in enumerate(g.nodes) if n.op == "transpose" and i not in found]
    assert len(back) == 1


@pytest.mark.parametrize("name", ["bert_layer", "gpt2_block"])
def test_plans_with_views_still_compute_the_graph(name):
    from tunedb.graph.reference import run_reference
    from tunedb.plan.execute import run_reference_steps
    from tunedb.runtime.inputs import make_inputs

    g = _graph(name, 2)
    plan = compile_plan(g, device="generic")
    kinds = [s.kind for s in plan.steps]
    assert kinds.count("layout") == 0  # the transpose back: PV writes the rows (output view)
    assert sum(s.config_dict.get("view") == "output" for s in plan.steps) == 1
    views = [s for s in plan.steps if s.kind == "layout_view"]
    assert any("split" in s.ops or "transpose" in s.ops for s in views)
    # every output of a view step lives in its source's bytes: no buffer of its own
    placed = {v for v, _, _, _ in plan.buffers.assign}
    for s in views:
        src = set(s.inputs)
        for v in s.outputs:
            assert v not in placed or any(a[0] in src for a in plan.buffers.assign)
    _, host = make_inputs(g, 7)
    got = run_reference_steps(plan, host)
    want = run_reference(g, host)
    for v in g.outputs:
        np.testing.assert_allclose(got[v], want[v], rtol=1e-12, atol=1e-12)


def test_plan_json_round_trip_keeps_views():
    from tunedb.plan.record import Plan

    plan = compile_plan(_graph("gpt2_block", 2), device="generic")
    again = Plan.from_json(plan.to_json())
    assert [s.kind for s in again.steps] == [s.kind for s in plan.steps]
    assert again.kernels == plan.kernels


def test_strided_copy_source_compiles_and_indexes(tmp_path):
    import shutil
    import subprocess

    shape, strides = (2, 5, 3, 8), (120, 8, 40, 1)  # [B, H, S, D] read as [B, S, H, D]
    assert chunk_bytes(8 * 4, 256, 512, *(s * 4 for s in strides[:-1])) == 16
    assert chunk_bytes(6 * 2, 256, 512, 24) == 4
    src = copy_source(shape, strides, 4, 16)
    assert "uint4" in src and "120LL" in src and f"< {2 * 5 * 3 * 2}LL" in src
    # the index arithmetic, replayed in Python from the emitted lines, matches NumPy's view
    lines = [ln.strip() for ln in src.splitlines() if ln.strip().startswith("q = r %")]
    arr = np.arange(2 * 3 * 5 * 8).reshape(2, 3, 5, 8).transpose(0, 2, 1, 3)
    flat = np.arange(2 * 3 * 5 * 8)
    out = []
    for i in range(arr.size // 4):
        r, s = i, 0
        for ln in lines:
            d = int(ln.split("%")[1].split("LL")[0])
            st = int(ln.split("q *")[1].split("LL")[0])
            q, r = r % d, r // d
            s += q * st
        out.extend(flat[s:s + 4])
    np.testing.assert_array_equal(np.array(out), arr.reshape(-1))
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    (tmp_path / "k.cu").write_text(src)
    r = subprocess.run(["nvcc", "-arch=sm_90", "-c", str(tmp_path / "k.cu"), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_tiled_transpose_source_compiles_and_indexes(tmp_path):
    import re
    import shutil
    import subprocess

    # [N, C, H, W] read as [N, H, W, C]: unit source stride on output axis 2, the last axis moves
    x = np.arange(2 * 4 * 3 * 5).reshape(2, 4, 3, 5)
    view = x.transpose(0, 2, 3, 1)
    strides = [s // x.itemsize for s in view.strides]
    src = transpose_source(view.shape, strides, 4, 2)
    assert "tile[64][65]" in src and "unsigned int" in src
    # the kernel, replayed in Python block by block and thread by thread from its emitted
    # constants, writes every element of the view once
    num = r"(\d+)LL"
    batch = [tuple(map(int, m)) for m in re.findall(
        rf"q = r % {num}; r /= \d+LL; s \+= q \* {num}; d \+= q \* {num};", src)]
    nb = int(re.search(rf"b < {num}", src).group(1))
    nl, np_ = map(int, re.search(rf"jl = {num} - j0 - ty, il = {num} - i0 - tx", src).groups())
    sl = int(re.search(rf"sp = src \+ s \+ \(j0 \+ ty\) \* {num}", src).group(1))
    dp = int(re.search(rf"dp = dst \+ d \+ \(i0 \+ ty\) \* {num}", src).group(1))
    tile, rows = int(re.search(r"tile\[(\d+)\]", src).group(1)), 8
    flat, out = x.reshape(-1), np.full(view.size, -1)
    for b in range(nb):
        r, s_, d = b, 0, 0
        for dim, ss, ds in batch:
            q, r = r % dim, r // dim
            s_, d = s_ + q * ss, d + q * ds
        for j0 in range(0, nl, tile):
            for i0 in range(0, np_, tile):
                # (ty + k * rows, tx + h * 32) over the 32 x rows threads and their k, h steps
                walk = [(ty + k * rows, tx + h * 32) for ty in range(rows) for tx in range(32)
                        for k in range(tile // rows) for h in range(tile // 32)]
                t = {(a, c): flat[s_ + (j0 + a) * sl + i0 + c] for a, c in walk
                     if j0 + a < nl and i0 + c < np_}
                for a, c in walk:  # a: tile row of the output plane (i), c: its column (j)
                    if j0 + c < nl and i0 + a < np_:
                        assert out[d + (i0 + a) * dp + j0 + c] == -1  # written once
                        out[d + (i0 + a) * dp + j0 + c] = t[c, a]
    np.testing.assert_array_equal(out, view.reshape(-1))
    assert "unsigned short" in transpose_source((8, 6), (1, 8), 2, 0)  # 2-D, float16 bits
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    for i, code in enumerate((src, transpose_source((8, 6), (1, 8), 2, 0))):
        (tmp_path / f"t{i}.cu").write_text(code)
        r = subprocess.run(["nvcc", "-arch=sm_90", "-c", str(tmp_path / f"t{i}.cu"), "-o",
                            str(tmp_path / f"t{i}.o")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]


def test_no_view_for_a_transpose_read_by_an_elementwise_op():
    from tunedb.graph.builder import GraphBuilder

    for shared in (False, True):
        b = GraphBuilder("t")
        x = b.input("x", (4, 6), "float32")
        w = b.input("w", (4, 5), "float32")
        t = b.transpose(x)
        y = b.matmul(t, w)
        outs = [y, b.add(t, t)] if shared else [y]
        g = b.build(outs)
        ix = GraphIndex(g)
        found = strided_view_nodes(g.nodes, g.type_map, ix.consumers, set(g.outputs))
        assert found == (set() if shared else {0})  # the elementwise reader needs the copy
        assert ix.view[0] == (not shared)
