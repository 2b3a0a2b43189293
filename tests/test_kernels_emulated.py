"""Numerics of generated kernels without a GPU: each kernel compiled as host C++ (see
``tunedb.runtime.emu``), run on the protocol's inputs and compared with the float64 reference
interpreter under the protocol's tolerance.
One schedule per (quick-suite case, mapping, streaming hint): the one with the fewest threads."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tunedb.kernels import generate, schedule_space, suite
from tunedb.kernels.suites import case as case_of
from tunedb.runtime.emu import build, generable_schedules, mismatches

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found"),
              pytest.mark.slow]  # emulation sweeps: g++ builds of every schedule


def _pick(legal):
    best = {}
    for s in legal:
        key = (s.mapping, s.split if s.mapping == "col_tiled" else 0, s.stream)
        if key not in best or (s.block, -s.vec) < (best[key].block, -best[key].vec):
            best[key] = s
    return list(best.values())


def test_quick_suite_matches_reference_in_emulation(tmp_path):
    jobs = []
    for case in suite("quick"):
        for s in _pick(generable_schedules(case.graph)):
            jobs.append((case, s, generate(case.graph, s, sm_count=2)))
    halves = [jobs[0::2], jobs[1::2]]
    with ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda js: build([k.source for _, _, p in js for k in p.kernels], str(tmp_path)),
                             halves))
    failures = [f for lib, half in zip(libs, halves)
                for f in mismatches(lib, [(c.graph, s, p) for c, s, p in half])]
    assert not failures, "\n".join(failures)
    assert len(jobs) >= 30 and sum(s.stream for _, s, _ in jobs) >= 15


def test_swizzled_transpose_tiles_match_reference_in_emulation(tmp_path):
    """Every swizzled schedule of the quick suite's transposes (each vector width, fp32 and
    16-bit types): the lane-dependent element order must put every value where it belongs."""
    jobs = []
    extra = [case_of("permute", "transpose_bias_relu", 96, 160, "bfloat16"),
             case_of("permute", "transpose_add", 64, 192, "float16")]
    for case in suite("quick") + extra:
        legal, _ = schedule_space(case.graph)
        jobs += [(case, s, generate(case.graph, s, sm_count=2)) for s in legal if s.swizzle]
    assert {s.vec for _, s, _ in jobs} == {2, 4, 8}
    lib = build([k.source for _, _, p in jobs for k in p.kernels], str(tmp_path))
    failures = mismatches(lib, [(c.graph, s, p) for c, s, p in jobs])
    assert not failures, "\n".join(failures)


def _batched_transposes():
    from tunedb.graph.builder import GraphBuilder

    out = []
    for shape, perm, dtype in (((3, 40, 24), (0, 2, 1), "float32"),
                               ((2, 6, 5, 7), (0, 2, 3, 1), "float16"),
                               ((2, 3, 33, 20), (0, 1, 3, 2), "bfloat16"),
                               ((5, 9, 66), (0, 2, 1), "float32")):
        b = GraphBuilder(f"batched_transpose_{'x'.join(map(str, shape))}_{dtype}")
        x = b.input("x", shape, dtype)
        t = b.transpose(x, perm=perm)
        z = b.input("z", tuple(shape[p] for p in perm), dtype)
        out.append(b.build([b.relu(b.add(t, z))]))  # a transposed input and a full-size one
    return out


def test_batched_transposes_match_reference_in_emulation(tmp_path):
    """A transpose that keeps leading batch dims (attention heads, NCHW -> NHWC) is one fused
    kernel: every legal schedule, batches whose rows are not a multiple of the tile included."""
    from tunedb.kernels.analysis import analyze

    jobs = []
    for g in _batched_transposes():
        a = analyze(g)
        assert a.pattern == "transpose" and a.trans_periods and a.trans_periods[0][1] < a.R
        legal, _ = schedule_space(g)
        assert {s.mapping for s in legal} == {"elementwise", "transpose_tiled"}
        jobs += [(g, s, generate(g, s, sm_count=2)) for s in legal if not s.stream]
    lib = build([k.source for _, _, p in jobs for k in p.kernels], str(tmp_path))
    failures = mismatches(lib, jobs)
    assert not failures, "\n".join(failures[:20])
    assert len(jobs) >= 100
