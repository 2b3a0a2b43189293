"""Operands broadcast over blocks of rows (class ``bcol``): an attention mask [B, 1, 1, S] added
to scores [B, H, S, S] is value[r // Q, c] on the [B*H*S, S] domain, Q = H*S; GPT-2's causal
mask [1, 1, S, S] is value[r % S, c] (Q = R, P = S) and a [B, 1, S, S] mask value[(r // Q) * P +
r % P, c] (Q = H*S, P = S).

The analysis gives the class, Q and P (the BERT layer at batch 32 and the GPT-2 block at batch 1
and 32 included); every legal schedule of small masked graphs (softmax, elementwise, column
reductions, a row+column multi pattern, a transpose, a gather) compiles with nvcc for sm_90 and,
run as host C++ (``tunedb.runtime.emu``), matches the float64 reference.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.kernels import analyze, generate, schedule_space
from tunedb.kernels.analysis import BCOL, COL, FULL, UnsupportedFusion
from tunedb.runtime.emu import build, mismatches

BERT = Path(__file__).resolve().parents[1] / "data" / "graphs" / "dynamic" / "bert_layer.onnx"
GPT2 = BERT.with_name("gpt2_block.onnx")
NVCC = shutil.which("nvcc")


def _mask_bias(b: GraphBuilder, B: int, S: int, kind: str, like: str) -> str:
    """The additive mask as BERT builds it: (1 - float(mask)) * -10000 of an int64 [B, S]
    input unsqueezed to [B, 1, 1, S]; or a float [B, 1, 1, S] input ("float")."""
    if kind == "float":
        return b.input("mask", (B, 1, 1, S), b.type_of(like).dtype)
    m = b.unsqueeze(b.unsqueeze(b.input("mask", (B, S), "int64"), axes=(1,)), axes=(2,))
    return b.mul(b.sub(1.0, b.cast(m, to="float32")), -10000.0)


def masked_softmax(B: int, H: int, S: int, dtype: str = "float32", mask: str = "int64") -> Graph:
    b = GraphBuilder(f"masked_softmax_{B}x{H}x{S}_{dtype}_{mask}")
    x = b.input("x", (B, H, S, S), dtype)
    s = b.mul(x, 0.125)
    if mask == "bool":  # where(mask, scores, -10000): a bool bcol condition
        y = b.where(b.input("mask", (B, 1, 1, S), "bool"), s, b.scalar(-10000.0, s))
    elif mask == "expand":  # the mask materialised by an expand to the scores' shape
        y = b.add(s, b.expand(b.input("mask", (B, 1, 1, S), dtype), shape=(B, H, S, S)))
    else:
        bias = _mask_bias(b, B, S, mask, x)
        y = b.add(s, bias if dtype == "float32" or mask == "float" else b.cast(bias, to=dtype))
    return b.build([b.softmax(y)])


def masked_scale(B: int, H: int, S: int) -> Graph:
    """Elementwise only: x / 8 + mask bias."""
    b = GraphBuilder(f"masked_scale_{B}x{H}x{S}")
    x = b.input("x", (B, H, S, S))
    return b.build([b.add(b.div(x, 8.0), _mask_bias(b, B, S, "int64", x))])


def masked_rows(B: int, S: int, C: int) -> Graph:
    """Softmax over long rows (C = 1024, room for split_row) with a [B, 1, C] mask."""
    b = GraphBuilder(f"masked_rows_{B}x{S}x{C}")
    x = b.input("x", (B, S, C))
    return b.build([b.softmax(b.add(x, b.input("mask", (B, 1, C))))])


def masked_colsum(B: int, H: int, S: int, C: int) -> Graph:
    """Column reductions over R = B*H*S of x * mask, and x - their mean (a post-reduction
    full-size output)."""
    b = GraphBuilder(f"masked_colsum_{B}x{H}x{S}x{C}")
    x = b.input("x", (B, H, S, C))
    y = b.mul(x, b.input("mask", (B, 1, 1, C)))
    m = b.reduce_mean(y, axes=(0, 1, 2), keepdims=True)
    return b.build([b.reduce_sum(y, axes=(0, 1, 2)), b.sub(y, m)])


def masked_multi(B: int, H: int, S: int) -> Graph:
    """Row softmax of x + mask and its column sums over all rows: a multi pattern."""
    b = GraphBuilder(f"masked_multi_{B}x{H}x{S}")
    x = b.input("x", (B, H, S, S))
    y = b.add(x, _mask_bias(b, B, S, "float", x))
    return b.build([b.softmax(y), b.reduce_sum(y, axes=(0, 1, 2))])


def masked_transpose(B: int, H: int, S: int, C: int) -> Graph:
    """x [C, B, H, S] read transposed onto [B*H*S, C], plus a [B, 1, 1, C] mask."""
    b = GraphBuilder(f"masked_transpose_{B}x{H}x{S}x{C}")
    x = b.input("x", (C, B, H, S))
    return b.build([b.add(b.transpose(x, perm=(1, 2, 3, 0)), b.input("mask", (B, 1, 1, C)))])


def masked_xent(B: int, S: int, C: int) -> Graph:
    """Cross entropy of logits + mask: the per-row pick x[r, label[r]] reads the mask too."""
    b = GraphBuilder(f"masked_xent_{B}x{S}x{C}")
    x = b.input("x", (B, S, C))
    y = b.add(x, b.input("mask", (B, 1, C)))
    m = b.reduce_max(y, axes=(2,), keepdims=True)
    lse = b.add(b.log(b.reduce_sum(b.exp(b.sub(y, m)), axes=(2,), keepdims=True)), m)
    pick = b.gather_elements(y, b.input("label", (B, S, 1), "int64"), axis=2)
    return b.build([b.sub(lse, pick)])


def causal_softmax(B: int, H: int, S: int, mask: str) -> Graph:
    """softmax(where(mask, x / 8, -10000)) with GPT-2's causal mask: a lower-triangular bool
    [S, S] constant ("const"); or softmax(x / 8 + mask) with a float [B, 1, S, S] input ("batch")."""
    b = GraphBuilder(f"causal_softmax_{B}x{H}x{S}_{mask}")
    x = b.input("x", (B, H, S, S))
    s = b.div(x, 8.0)
    if mask == "const":
        y = b.where(b.constant(np.tril(np.ones((S, S), dtype=bool)), name="tril"), s, b.scalar(-10000.0, s))
    else:
        y = b.add(s, b.input("mask", (B, 1, S, S)))
    return b.build([b.softmax(y)])


def causal_colsum(B: int, H: int, S: int, C: int) -> Graph:
    """masked_colsum with a [1, 1, S, C] mask: value[r % S, c] in a column-reduction kernel."""
    b = GraphBuilder(f"causal_colsum_{B}x{H}x{S}x{C}")
    x = b.input("x", (B, H, S, C))
    y = b.mul(x, b.input("mask", (1, 1, S, C)))
    m = b.reduce_mean(y, axes=(0, 1, 2), keepdims=True)
    return b.build([b.reduce_sum(y, axes=(0, 1, 2)), b.sub(y, m)])


def causal_transpose(B: int, H: int, S: int, C: int) -> Graph:
    b = GraphBuilder(f"causal_transpose_{B}x{H}x{S}x{C}")
    x = b.input("x", (C, B, H, S))
    return b.build([b.add(b.transpose(x, perm=(1, 2, 3, 0)), b.input("mask", (1, 1, S, C)))])


def causal_xent(B: int, S: int, C: int) -> Graph:
    b = GraphBuilder(f"causal_xent_{B}x{S}x{C}")
    x = b.input("x", (B, S, C))
    y = b.add(x, b.input("mask", (1, S, C)))
    m = b.reduce_max(y, axes=(2,), keepdims=True)
    lse = b.add(b.log(b.reduce_sum(b.exp(b.sub(y, m)), axes=(2,), keepdims=True)), m)
    pick = b.gather_elements(y, b.input("label", (B, S, 1), "int64"), axis=2)
    return b.build([b.sub(lse, pick)])


# Emulated under every legal schedule (the rest: one schedule per mapping, vector width and split).
EVERY = [masked_softmax(3, 2, 40), masked_softmax(3, 2, 37), masked_scale(3, 2, 40), masked_scale(3, 2, 37)]
CASES = EVERY + [
    masked_softmax(3, 2, 40, mask="float"), masked_softmax(3, 2, 40, mask="bool"),
    masked_softmax(3, 2, 40, mask="expand"), masked_softmax(3, 2, 40, "bfloat16"),
    masked_colsum(3, 2, 5, 24), masked_multi(3, 2, 16), masked_transpose(3, 2, 8, 24),
    masked_xent(3, 4, 40), masked_rows(2, 3, 1024),
    causal_softmax(2, 2, 37, "const"), causal_softmax(3, 2, 37, "batch")]
# P > 1 in the other generators: emulated (one schedule per mapping and split), their index
# expressions are the ones nvcc compiles for the causal softmax cases above
EMU_ONLY = [causal_colsum(3, 2, 5, 24), causal_transpose(3, 2, 8, 24), causal_xent(3, 4, 40)]


def bert_attention(batch: int) -> Graph:
    """div -> mask add -> softmax of the BERT layer (with the mask's unsqueeze/cast/sub/mul
    chain), cut out of the dynamic-batch export."""
    return _attention(BERT, batch, lambda ix, n: n.op == "add"
                      and ix.types[n.inputs[1]].shape == (batch, 1, 1, 128))


def gpt2_attention(batch: int) -> Graph:
    """div -> where(causal mask, scores, min) -> softmax of the GPT-2 block."""
    return _attention(GPT2, batch, lambda ix, n: n.op == "where")


def _attention(path: Path, batch: int, is_mask_op) -> Graph:
    """The non-compute (matmul-free) neighbourhood of the mask op, cut out of an export."""
    from tunedb.plan.driver import load_graph
    from tunedb.plan.subgraph import GraphIndex

    ix = GraphIndex(load_graph(str(path), {"batch": batch}))
    add = next(i for i, n in enumerate(ix.nodes) if is_mask_op(ix, n))
    group: set[int] = set()

    def walk(i: int, nxt) -> None:
        if i in group or ix.compute[i]:
            return
        group.add(i)
        for j in nxt(i):
            walk(j, nxt)

    walk(add, lambda i: ix.pred[i])
    group.discard(add)
    walk(add, lambda i: ix.succ[i])
    return ix.cut(group, f"{path.stem}_attention_b{batch}").graph


# --- analysis ---------------------------------------------------------------------------------

@pytest.mark.skipif(not BERT.exists(), reason="dynamic-batch BERT export not present")
def test_bert_mask_is_bcol_at_batch_32_and_col_at_batch_1():
    g = bert_attention(32)
    assert sorted(n.op for n in g.nodes) == sorted(
        ["div", "unsqueeze", "unsqueeze", "cast", "sub", "mul", "add", "reduce_max", "sub", "exp",
         "reduce_sum", "div"])
    a = analyze(g)
    mask = next(v for v in g.inputs if g.type_of(v).dtype == "int64")
    assert (a.pattern, a.R, a.C) == ("row_reduce", 32 * 12 * 128, 128)
    assert a.cls[mask] == BCOL and a.q[mask] == 12 * 128
    # the cast / 1 - m / * -10000 chain is bcol too, with the same Q; the scores stay full
    chain = [n.outputs[0] for n in a.nodes if n.op in ("cast", "mul")]
    assert chain and all(a.cls[v] == BCOL and a.q[v] == 1536 for v in chain)
    assert a.cls[next(v for v in g.inputs if v != mask)] == FULL
    assert schedule_space(a)[0]
    a1 = analyze(bert_attention(1))
    assert a1.cls[mask] == COL and a1.q == {}


@pytest.mark.skipif(not GPT2.exists(), reason="dynamic-batch GPT-2 export not present")
@pytest.mark.parametrize("batch", [1, 32])
def test_gpt2_causal_mask_is_bcol_with_p(batch):
    g = gpt2_attention(batch)
    assert sorted(n.op for n in g.nodes) == sorted(
        ["div", "where", "reduce_max", "sub", "exp", "reduce_sum", "div"])
    a = analyze(g)
    mask = next(v for v in [*g.inputs, *g.constant_map] if g.type_of(v).dtype == "bool")
    R = batch * 12 * 128
    assert g.type_of(mask).shape == (128, 128)
    assert (a.pattern, a.R, a.C) == ("row_reduce", R, 128)
    # value[r % 128, c]: one block of all R rows (Q = R), its 128 inner rows kept (P = 128)
    assert a.cls[mask] == BCOL and a.q == {mask: R} and a.p == {mask: 128}
    legal, _ = schedule_space(a)
    src = generate(a, legal[0], sm_count=132).kernels[0].source
    assert "row % 128LL * 128LL + col" in src and f"/ {R}LL" not in src


def test_bcol_p_classification():
    def mask_of(shape: tuple[int, ...], x: tuple[int, ...] = (3, 2, 16, 16)):
        b = GraphBuilder("m")
        xx = b.input("x", x)
        return analyze(b.build([b.softmax(b.add(xx, b.input("m", shape)))]))

    a = mask_of((3, 1, 16, 16))  # [B, 1, S, S]: value[(r // (H*S)) * S + r % S, c]
    assert (a.R, a.cls["m"], a.q, a.p, a.bcol_p) == (96, BCOL, {"m": 32}, {"m": 16}, (("m", 16),))
    a = mask_of((16, 16))  # rank-2 causal mask, leading dims implied
    assert (a.q, a.p) == ({"m": 96}, {"m": 16})
    a = mask_of((3, 1, 1, 16))  # today's bcol: P = 1, none listed in bcol_p
    assert (a.q, a.p, a.bcol_p) == ({"m": 32}, {"m": 1}, ())
    # elementwise graphs keep the simpler split when one exists: x[B, 8, C] + bias[8, C] stays a
    # per-column bias of [B, 8*C] rather than value[r % 8, c] of [B*8, C]
    b = GraphBuilder("bb")
    x = b.input("x", (4, 8, 64))
    e = analyze(b.build([b.relu(b.add(x, b.input("bias", (8, 64))))]))
    assert (e.R, e.C, e.cls["bias"], e.q) == (4, 512, COL, {})
    # one bcol chain broadcast two ways is refused
    b = GraphBuilder("two_ways")
    x = b.input("x", (5, 4, 5, 16))
    m = b.mul(b.input("m", (5, 16)), 2.0)  # value[r % 5, c] here, value[r // 20, c] there
    y = b.add(b.add(x, m), b.reshape(m, shape=(5, 1, 1, 16)))
    with pytest.raises(UnsupportedFusion, match=r"broadcast as value\[\(r // "):
        analyze(b.build([b.softmax(y)]))


def test_bcol_through_expand_and_its_q():
    a = analyze(masked_softmax(3, 2, 40, mask="expand"))
    assert a.cls["mask"] == BCOL and a.q == {"mask": 80}
    t = analyze(masked_transpose(3, 2, 8, 24))
    assert t.pattern == "transpose" and t.cls["x"] == "trans" and t.q == {"mask": 16}
    c = analyze(masked_colsum(3, 2, 5, 24))
    assert (c.pattern, c.R, c.C) == ("col_reduce", 30, 24) and c.q == {"mask": 10}
    s = analyze(masked_softmax(3, 2, 40)).summary()
    assert s["classes"]["bcol"] == 4  # the mask and its cast, 1 - m, * -10000


def test_unsupported_broadcasts_say_why():
    # a per-head mask [1, H, 1, S] over [B, H, S, S] broadcasts over two separate row blocks:
    # an input is read through an index map, a computed value is refused
    b = GraphBuilder("per_head")
    x = b.input("x", (2, 3, 16, 16))
    a = analyze(b.build([b.softmax(b.add(x, b.input("m", (1, 3, 1, 16))))]))
    assert a.cls["m"] == "idx" and dict(a.idx_maps)["m"] == ((256, 3, 16), (1, 16, 1))
    b = GraphBuilder("per_head_computed")
    x = b.input("x", (2, 3, 16, 16))
    m = b.mul(b.input("m", (1, 3, 1, 16)), 2.0)
    with pytest.raises(UnsupportedFusion, match="not a graph input that an index map could read"):
        analyze(b.build([b.softmax(b.add(x, m))]))
    # a bcol value as an output of a reduction kernel
    b = GraphBuilder("bcol_out")
    x = b.input("x", (2, 3, 16, 16))
    bias = _mask_bias(b, 2, 16, "int64", x)
    g = b.build([b.softmax(b.add(x, bias)), bias])
    with pytest.raises(UnsupportedFusion, match=r"output .* is per-column of a block of rows \(bcol\)"):
        analyze(g)


def test_graphs_without_bcol_values_have_no_q():
    b = GraphBuilder("sm")
    x = b.input("x", (64, 100))
    a = analyze(b.build([b.softmax(b.add(x, b.input("m", (100,))))]))
    assert a.q == {} and BCOL not in a.cls.values()


# --- every legal schedule: nvcc, and emulated numerics ------------------------------------------

def _pick_mappings(legal):
    """The schedule with the fewest threads per mapping (non-fast)."""
    best = {}
    for s in legal:
        if not s.fast_math and (s.mapping not in best or s.block < best[s.mapping].block):
            best[s.mapping] = s
    return list(best.values())


def _plans(cases: list[Graph]):
    out = []
    for g in cases:
        legal, _ = schedule_space(g)
        assert legal, g.name
        for s in legal:
            out.append((g, s, generate(g, s, sm_count=2)))
    return out


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_bcol_schedule_compiles_with_nvcc(tmp_path):
    sources: dict[str, str] = {}
    names: dict[str, str] = {}
    for g, s, plan in _plans(CASES):
        for k in plan.kernels:
            sources.setdefault(k.name, k.source)
            names.setdefault(k.name, f"{g.name} {s.label()}")
    assert len(sources) > 300
    paths = []
    for i in range(2):
        p = tmp_path / f"tu{i}.cu"
        p.write_text("\n".join(list(sources.values())[i::2]))
        paths.append(p)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: subprocess.run(
            [NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(p.with_suffix(".cubin")), str(p)],
            capture_output=True, text=True), paths))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    log = "\n".join(r.stderr for r in results)
    assert len(re.findall(r"Compiling entry function", log)) == len(sources)
    spills = re.findall(r"Compiling entry function '(\w+)'.*?\n.*?(\d+) bytes spill stores", log)
    assert not [names.get(k, k) for k, n in spills if int(n) > 0]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_every_bcol_schedule_matches_reference_in_emulation(tmp_path):
    # fast-math variants are left out: the emulator maps __expf & co. to the precise functions,
    # so they would run their precise twin's code again (nvcc compiles them above)
    # one schedule per (case, mapping, split), and per vector width / grid / row cache for the
    # masked softmax cases: every code path of the bcol loads at a CI-sized cost (nvcc above
    # compiles every schedule)
    firsts: dict[tuple, tuple] = {}
    for g, s, p in _plans(CASES + EMU_ONLY):
        if s.fast_math:
            continue
        key = (g.name, s.mapping, s.split > 1) + ((s.vec, s.grid, s.row_cache) if g in EVERY else ())
        if key not in firsts or s.block < firsts[key][1].block:
            firsts[key] = (g, s, p)
    jobs = list(firsts.values())
    if BERT.exists():  # the real BERT attention group, at batch 2 (R = 3072)
        g = bert_attention(2)  # its int64 mask: 0/1, as make_inputs draws integers outside gathers
        jobs += [(g, s, generate(g, s, sm_count=2)) for s in _pick_mappings(schedule_space(g)[0])]
    halves = [jobs[0::2], jobs[1::2]]
    with ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda js: build([k.source for _, _, p in js for k in p.kernels], str(tmp_path)),
                             halves))
    failures = [f for lib, half in zip(libs, halves) for f in mismatches(lib, half)]
    assert not failures, "\n".join(failures[:20])
    mappings = {(g.name, s.mapping) for g, s, _ in jobs}
    for m in ("elementwise", "warp_per_row", "block_per_row", "rows_per_block", "split_row",
              "col_tiled", "col_cluster", "transpose_tiled"):
        assert any(mm == m for _, mm in mappings), m
    # the row mapping value[(r // Q) * P + r % P, c] (P > 1) in every generator that reads bcol
    for m in ("warp_per_row", "rows_per_block", "col_tiled", "col_cluster", "transpose_tiled"):
        assert any(n.startswith("causal") and mm == m for n, mm in mappings), m
