"""Schedule space: legality, pruning reasons, JSON round trip; generated plans: structure and
determinism."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels import Schedule, generate, schedule_space, suite
from tunedb.kernels.analysis import analyze
from tunedb.kernels.prelude import PRELUDE
from tunedb.kernels.schedule import EVICT_LAST_MAPPINGS, STREAM_LARGE_OUTPUTS, STREAM_MAPPINGS, check
from tunedb.kernels.suites import case as suite_case
from tunedb.records import Candidate


def _softmax(R: int, C: int, dt: str = "float32"):
    b = GraphBuilder(f"softmax_{R}x{C}")
    return b.build([b.softmax(b.input("x", (R, C), dt))])


def _reasons(pruned):
    return [why for _, why in pruned]


def test_long_row_register_pruning_names_the_numbers():
    legal, pruned = schedule_space(_softmax(64, 32768))
    assert any("row of 32768 float32 needs 128 registers/thread at block 256, vec 4 > limit 64" in w
               for w in _reasons(pruned))
    regs = [s for s in legal if s.row_cache == "registers" and s.mapping == "block_per_row"]
    assert {s.block for s in regs} == {512, 1024}  # 64 and 32 cache registers per thread
    assert any(s.mapping == "split_row" for s in legal)


def test_vector_width_must_divide_odd_rows():
    legal, pruned = schedule_space(_softmax(32, 1001))
    assert "vector width 4 does not divide C=1001" in _reasons(pruned)
    assert all(s.vec == 1 for s in legal)


def test_vector_bytes_capped_at_16():
    legal, pruned = schedule_space(_softmax(32, 1024, "bfloat16"))
    assert max(s.vec for s in legal) == 8
    legal, pruned = schedule_space(_softmax(32, 1024, "float32"))
    assert max(s.vec for s in legal) == 4
    assert "vector width 8 of 4-byte elements exceeds 16 bytes" in _reasons(pruned)


def test_quick_suite_spaces_are_usable_and_round_trip():
    for case in suite("quick"):
        legal, pruned = schedule_space(case.graph)
        assert 10 <= len(legal) <= 600, (case.name, len(legal))
        assert len(set(legal)) == len(legal)
        for s in legal:
            cfg = s.to_config()
            back = Schedule.from_config(json.loads(json.dumps(cfg)))
            assert back == s
            # a Candidate config is a tuple of JSON scalars
            cand = Candidate("w", "fusion", cfg)
            assert Schedule.from_config(cand.config) == s
        for _s, why in pruned:
            assert why and "\n" not in why


def test_stitch_schemes_describe_the_schedule():
    legal, _ = schedule_space(_softmax(256, 4096))
    by = {s.label(): s for s in legal}
    warp = next(s for s in legal if s.mapping == "block_per_row" and s.row_cache == "registers")
    schemes = set(warp.stitch_map.values())
    assert "smem" in schemes and "register" in schemes
    split = next(s for s in legal if s.mapping == "split_row")
    assert "dsmem" in split.stitch_map.values()
    reread = [s for s in by.values() if s.row_cache == "reread"]
    assert reread and all("global" in s.stitch_map.values() for s in reread)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unknown mapping"):
        Schedule("diagonal")
    with pytest.raises(ValueError, match="vector width 3"):
        Schedule("elementwise", vec=3)
    with pytest.raises(ValueError, match="unknown schedule key"):
        Schedule.from_config({"mapping": "elementwise", "warps": 4})
    g = _softmax(32, 1001)
    with pytest.raises(ValueError, match="does not divide C=1001"):
        generate(g, Schedule("block_per_row", block=256, vec=4))


def test_plan_structure_and_determinism():
    case = next(c for c in suite("quick") if c.family == "norm_backward")
    legal, _ = schedule_space(case.graph)
    s = legal[0]
    p1, p2 = generate(case.graph, s), generate(case.graph, s)
    assert p1 == p2 and p1.source_hash == p2.source_hash
    assert len(p1.kernels) == 2 and p1.scratch and p1.scratch[0][1] > 0
    k0, k1 = p1.kernels
    g = case.graph
    n_buf = len(g.inputs) + len(g.outputs)
    assert k0.args[:n_buf] == tuple(g.inputs) + tuple(g.outputs)
    assert k0.args[n_buf] == p1.scratch[0][0]
    assert [type(a) for a in k0.args[-2:]] == [np.int64, np.int64]
    assert (int(k0.args[-2]), int(k0.args[-1])) == (p1.R, p1.C)
    for k in p1.kernels:
        assert k.source.startswith(PRELUDE) and "#include" not in k.source
        assert f" {k.name}(" in k.source and 'extern "C"' in k.source
        assert all(x >= 1 for x in k.grid + k.block)
    other = generate(case.graph, legal[1])
    assert other.source_hash != p1.source_hash
    assert json.loads(json.dumps(p1.to_json()))["source_hash"] == p1.source_hash


def test_grid_follows_sm_count():
    g = _softmax(8192, 1024)
    s = next(s for s in schedule_space(g)[0] if s.mapping == "warp_per_row")
    assert generate(g, s, sm_count=132).kernels[0].grid[0] > generate(g, s, sm_count=16).kernels[0].grid[0]


def test_fast_math_offered_only_with_transcendentals():
    chain = next(c for c in suite("quick") if c.name.startswith("eltwise_chain8"))
    legal, _ = schedule_space(chain.graph)
    fast = [s for s in legal if s.fast_math]
    assert fast and all(s.mapping == "elementwise" for s in fast)
    src = generate(chain.graph, fast[0]).kernels[0].source
    assert "__expf" in src or "_fast(" in src
    ln = next(c for c in suite("quick") if c.name.startswith("add_layernorm"))
    assert not any(s.fast_math for s in schedule_space(ln.graph)[0])


def test_row_divisions_become_reciprocal_multiplies():
    legal, _ = schedule_space(_softmax(64, 512))
    src = generate(_softmax(64, 512), legal[0]).kernels[0].source
    assert "const float rcp0 = 1.0f / " in src and "* rcp0)" in src


def test_grid_knob_keeps_stored_configs_and_is_pruned_where_it_cannot_apply():
    legal, pruned = schedule_space(_softmax(64, 1024))
    wave = [s for s in legal if s.grid == "wave"]
    full = [s for s in legal if s.grid == "full"]
    # every wave schedule has a full-grid twin, except row prefetch (it streams the next row of
    # a block's grid-stride loop, which a block per row does not have)
    assert wave and len(full) == len([s for s in wave if s.row_cache != "prefetch"])
    assert all(s.row_cache != "prefetch" for s in full)
    # configs stored before the knob existed have no "grid" key and still parse to the same schedule
    assert all("grid" not in s.to_config() for s in wave)
    assert all(s.to_config()["grid"] == "full" and s.label().removesuffix("_cs").removesuffix("_el")
               .endswith(("gridfull", "gridfull_fast")) for s in full)
    old = {k: v for k, v in wave[0].to_config().items()}
    assert Schedule.from_config(old) == wave[0]
    b = GraphBuilder("colmean")
    g = b.build([b.reduce_mean(b.input("x", (64, 256), "float32"), axes=[0], keepdims=True)])
    col_legal, _ = schedule_space(g)
    assert col_legal and all(s.grid == "wave" for s in col_legal)
    full_col = replace(col_legal[0], grid="full")
    assert "grid full needs one of" in check(analyze(g), full_col)
    with pytest.raises(ValueError, match="unknown grid"):
        Schedule("elementwise", grid="huge")


def test_row_prefetch_streams_the_next_row_and_is_pruned_where_it_cannot_apply():
    legal, pruned = schedule_space(_softmax(64, 1024))
    pf = [s for s in legal if s.row_cache == "prefetch"]
    assert pf and {s.mapping for s in pf} <= {"block_per_row", "warp_per_row"}
    src = generate(_softmax(64, 1024), pf[0]).kernels[0].source
    # the first row before the loop, the next one inside it, waited for at the top of each row
    assert src.count("tdb_cp_async<") == 2 and src.count("tdb_cp_commit();") == 2
    assert src.index("tdb_cp_wait();") > src.index("for (long long rb")
    assert "cp.async.cg.shared.global" in src and "#ifndef TDB_CP_ASYNC" in src
    # kernels without prefetch keep their exact sources (no new helpers in the prelude)
    plain = [s for s in legal if s.row_cache == "registers"]
    assert "TDB_CP_ASYNC" not in generate(_softmax(64, 1024), plain[0]).kernels[0].source
    for s in (replace(pf[0], grid="full"), replace(pf[0], mapping="split_row", split=2)):
        assert "prefetch" in check(analyze(_softmax(64, 1024)), s)


def test_swizzle_knob_keeps_stored_configs_and_is_pruned_where_it_cannot_apply():
    g = suite_case("permute", "transpose_add", 96, 160).graph
    legal, pruned = schedule_space(g)
    swz = [s for s in legal if s.swizzle]
    # each swizzled tile is a 64-wide hoisted tile with a plain twin in the space
    assert swz and all(s.tile == 64 and s.unroll == 2 and s.vec >= 2 for s in swz)
    assert all(replace(s, swizzle=False) in legal for s in swz)
    assert all("swizzle" not in s.to_config() for s in legal if not s.swizzle)
    assert all(s.to_config()["swizzle"] is True and "swz" in s.label() for s in swz)
    a = analyze(g)
    plain = replace(swz[0], swizzle=False)
    assert "swizzle needs a 64-wide tile" in check(a, replace(plain, tile=32, swizzle=True))
    assert "swizzle needs a 64-wide tile" in check(a, replace(plain, unroll=1, swizzle=True))
    ew = next(s for s in legal if s.mapping == "elementwise")
    assert "only transpose_tiled" in check(a, replace(ew, swizzle=True))
    src = generate(g, swz[0]).kernels[0].source
    assert "^ sw)" in src and "^ sw)" not in generate(g, plain).kernels[0].source
    with pytest.raises(ValueError, match="swizzle must be"):
        Schedule("transpose_tiled", swizzle=1)


def test_stream_knob_twins_the_space_and_marks_only_full_size_accesses():
    # small outputs (a row's loss): every row schedule but prefetch has its streaming twin
    xent = suite_case("xent", "softmax_xent", 64, 1000).graph
    legal, pruned = schedule_space(xent)
    cs = [s for s in legal if s.stream]
    assert cs and all(replace(s, stream=False) in legal for s in cs)
    assert len(cs) == sum(1 for s in legal if not s.stream and not s.evict_last
                          and s.mapping in STREAM_MAPPINGS and s.row_cache != "prefetch")
    assert all(s.to_config()["stream"] is True and s.label().endswith("_cs") for s in cs)
    assert not any(why == STREAM_LARGE_OUTPUTS for _, why in pruned)
    # outputs as large as the inputs: the twins are pruned with the reason, and still generate
    g = suite_case("bias_act", "gelu_tanh", 64, 256).graph
    legal, pruned = schedule_space(g)
    assert not any(s.stream for s in legal)
    assert all("stream" not in s.to_config() for s in legal)
    cs = [s for s, why in pruned if why == STREAM_LARGE_OUTPUTS]
    assert cs and all(s.stream and replace(s, stream=False) in legal for s in cs)
    assert all(not check(analyze(g), s) for s in cs)
    ew = next(s for s in cs if s.mapping == "elementwise")
    src = generate(g, ew).kernels[0].source
    plain = generate(g, replace(ew, stream=False)).kernels[0].source
    # x and the bias stream in, y streams out
    assert src.count("tdb_ldcs<float") == 2 and "tdb_stcs<float" in src and "tdb_ld<float" not in src
    assert "TDB_STREAM" not in plain and "tdb_ldcs<" not in plain and "tdb_stcs<" not in plain
    # pruned where it measured slower or cannot apply
    sm = analyze(_softmax(64, 1024))
    pf = Schedule("block_per_row", block=256, vec=4, row_cache="prefetch")
    assert not check(sm, pf) and "streaming cache hint" in check(sm, replace(pf, stream=True))
    assert "streaming cache hint" in check(sm, Schedule("split_row", block=256, vec=2, split=2,
                                                        stream=True))
    cc = suite_case("col_reduce", "col_center", 256, 128).graph
    cl = next(s for s in schedule_space(cc)[0] if s.mapping == "col_cluster")
    assert "streaming cache hint" in check(analyze(cc), replace(cl, stream=True))
    with pytest.raises(ValueError, match="stream must be"):
        Schedule("elementwise", stream="yes")


def test_evict_last_knob_twins_register_row_caches_and_marks_every_vector_load():
    g = suite_case("norm", "rmsnorm", 64, 1024).graph
    legal, pruned = schedule_space(g)
    el = [s for s in legal if s.evict_last]
    # one twin per row schedule with its row in registers, nothing else
    assert el and all(replace(s, evict_last=False) in legal for s in el)
    assert len(el) == sum(1 for s in legal if not s.evict_last and not s.stream
                          and s.mapping in EVICT_LAST_MAPPINGS and s.row_cache == "registers")
    assert all(s.to_config()["evict_last"] is True and s.label().endswith("_el") for s in el)
    # configs stored before the knob existed have no "evict_last" key and name the same kernel
    assert all("evict_last" not in s.to_config() for s in legal if not s.evict_last)
    b = next(s for s in el if s.mapping == "block_per_row" and s.vec == 4)
    src = generate(g, b).kernels[0].source
    plain = generate(g, replace(b, evict_last=False)).kernels[0].source
    # the row and the per-column weight both load with the policy; the store does not change
    assert src.count("tdb_ldel<float, 4>(") == 2 and "tdb_ld<float" not in src
    assert "createpolicy.fractional.L2::evict_last" in src and "tdb_st<float, 4>(" in src
    assert "TDB_EVICT_LAST" not in plain and "tdb_ldel<" not in plain
    # pruned where it measured slower or cannot apply, with the reason
    a = analyze(g)
    for s in (replace(b, row_cache="reread"), replace(b, stream=True),
              Schedule("rows_per_block", block=128, vec=4, group=8, evict_last=True)):
        assert "evict-last policy" in check(a, s)
    tr = suite_case("permute", "transpose_add", 64, 96).graph
    t = next(s for s in schedule_space(tr)[0] if s.mapping == "transpose_tiled")
    assert "evict-last policy" in check(analyze(tr), replace(t, evict_last=True))
    with pytest.raises(ValueError, match="evict_last must be"):
        Schedule("block_per_row", evict_last=1)
