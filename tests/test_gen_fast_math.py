"""Fast math (``Schedule.fast_math``: ``__expf``, ``__logf``, ``__fdividef`` and the sigmoid and
tanh built on them) against the plan's float64 check. The emulator runs these intrinsics as the
exact libm functions, so here each is replaced by the exact value pushed to the edge of the error
the CUDA C++ Programming Guide documents for it (``__expf(x)``: 2 + floor(|1.173 x|) ulp;
``__logf(x)``: 2^-21.41 absolute in [0.5, 2], else 3 ulp; ``__fdividef``: 2 ulp), with one sign
for every value (a bias, the worst case for sums) or a sign from the value's bits (no
cancellation in a ratio). Kernels at that error still pass the tolerance; the same kernels with
1000 times the error fail it, so the check can tell."""

from __future__ import annotations

import shutil

import pytest
from test_kernels_generalization import groupnorm

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.kernels import generate
from tunedb.kernels.prelude import PRELUDE

# The documented bounds, as host C++ put in front of a kernel's body (after the emulator's own
# definitions, which map the intrinsics to libm). TDB_WC_SCALE scales every bound; TDB_WC_SIGN
# is +1, -1, or 0 for a sign taken from the exact value's low mantissa bit.
WORST_CASE = r"""
#ifndef TDB_WC
#define TDB_WC
#undef __expf
#undef __logf
static inline float tdb_wc_push(float exact, float ulps) {
  if (!std::isfinite(exact) || exact == 0.0f) return exact;
  float sign = TDB_WC_SIGN;
  if (sign == 0.0f) { unsigned u; std::memcpy(&u, &exact, 4); sign = (u & 1u) ? 1.0f : -1.0f; }
  return exact + sign * ulps * TDB_WC_SCALE * std::fabs(exact) * 0x1p-23f;
}
static inline float tdb_wc_expf(float x) {
  return tdb_wc_push(std::exp(x), 2.0f + std::floor(std::fabs(1.173f * x)));
}
static inline float tdb_wc_logf(float x) {
  float l = std::log(x);
  if (x >= 0.5f && x <= 2.0f) {  // absolute error there: as ulps of the result
    float ulps = l == 0.0f ? 0.0f : 3.589e-7f / (std::fabs(l) * 0x1p-23f);  // 2^-21.41
    return tdb_wc_push(l, ulps);
  }
  return tdb_wc_push(l, 3.0f);
}
static inline float tdb_wc_fdividef(float a, float b) { return tdb_wc_push(a / b, 2.0f); }
#define __expf tdb_wc_expf
#define __logf tdb_wc_logf
#define __fdividef tdb_wc_fdividef
#define tdb_sigmoid_fast(x) tdb_wc_fdividef(1.0f, 1.0f + tdb_wc_expf(-(x)))
#define tdb_tanh_fast(x) (1.0f - tdb_wc_fdividef(2.0f, tdb_wc_expf(2.0f * (x)) + 1.0f))
#endif
"""


def _with_error(source: str, scale: float, sign: float) -> str:
    assert source.startswith(PRELUDE)
    head = (f"#ifndef TDB_WC_SCALE\n#define TDB_WC_SCALE {scale:.1f}f\n"
            f"#define TDB_WC_SIGN {sign:.1f}f\n#endif\n")
    return PRELUDE + head + WORST_CASE + source[len(PRELUDE):]


def groupnorm_silu(n: int, c: int, groups: int, h: int, w: int) -> Graph:
    """UNet's block as exported: GroupNorm over a reshape, the per-channel affine, SiLU."""
    b = GraphBuilder(f"groupnorm_silu_{n}x{c}g{groups}x{h}x{w}")
    x = b.input("x", (n, c, h, w))
    g, bb = b.input("g", (c, 1, 1)), b.input("bb", (c, 1, 1))
    y = b.reshape(x, shape=(n, groups, c // groups * h * w))
    m = b.reduce_mean(y, axes=(2,), keepdims=1)
    d = b.sub(y, m)
    v = b.reduce_mean(b.mul(d, d), axes=(2,), keepdims=1)
    nrm = b.reshape(b.div(d, b.sqrt(b.add(v, b.scalar(1e-5, v)))), shape=(n, c, h, w))
    a = b.add(b.mul(nrm, g), bb)
    return b.build([b.mul(a, b.sigmoid(a))])


def scaled_softmax(rows: int, cols: int, scale: float) -> Graph:
    """Attention-style scores: x - max reaches -8 * scale, where ``__expf``'s error grows."""
    b = GraphBuilder(f"softmax_{rows}x{cols}_x{scale:g}")
    x = b.input("x", (rows, cols))
    return b.build([b.softmax(b.mul(x, b.scalar(scale, x)), axis=-1)])


def log_softmax(rows: int, cols: int) -> Graph:
    b = GraphBuilder(f"log_softmax_{rows}x{cols}")
    return b.build([b.log_softmax(b.input("x", (rows, cols)), axis=-1)])


def gelu_tanh(rows: int, cols: int) -> Graph:
    b = GraphBuilder(f"gelu_tanh_{rows}x{cols}")
    x = b.input("x", (rows, cols))
    return b.build([b.gelu(b.mul(x, b.scalar(3.0, x)), approximate="tanh")])


def silu_dwconv_se(stride: int, k: int = 5) -> Graph:
    """EfficientNet's SiLU -> depthwise conv -> SiLU with the squeeze-and-excitation mean: a
    window kernel (``WINDOW_CONFIG`` has fast math), a sigmoid per input and per output."""
    b = GraphBuilder(f"silu_dwconv{k}_s{stride}_se")
    x = b.input("x", (2, 6, 14, 14))
    src = b.mul(x, b.sigmoid(b.mul(x, b.scalar(4.0, x))))
    y = b.conv2d(src, b.input("w", (6, 1, k, k)), b.input("bias", (6,)), strides=(stride, stride),
                 pads=(k // 2,) * 4, groups=6)
    y = b.mul(y, b.sigmoid(y))
    return b.build([y, b.reduce_mean(y, axes=(2, 3), keepdims=True)])


def _window_jobs() -> list[tuple]:
    from tunedb.kernels.gen_window import WINDOW_CONFIG
    from tunedb.kernels.schedule import Schedule

    s = Schedule.from_config(WINDOW_CONFIG)
    assert s.fast_math
    return [(g, s, generate(g, s, sm_count=2)) for g in (silu_dwconv_se(1), silu_dwconv_se(2, 3))]


def _fast_jobs() -> list[tuple]:
    """Each graph under the schedules the roofline fallback would give it, fast-math ones only:
    the first of each mapping in its order (the rule puts the fast twin first)."""
    from tunedb.costmodel.features import DeviceFacts
    from tunedb.graph.hashing import graph_hash
    from tunedb.kernels.analysis import analyze
    from tunedb.kernels.schedule import schedule_space
    from tunedb.plan.cost import _feature_roofline
    from tunedb.plan.fallback import fallback_order

    jobs = []
    for graph in (groupnorm_silu(2, 32, 8, 6, 8), groupnorm_silu(1, 12, 3, 5, 5),
                  scaled_softmax(64, 1000, 8.0), log_softmax(32, 3001), gelu_tanh(96, 260)):
        a = analyze(graph)
        legal = schedule_space(a, 2)[0]
        est, waves = _feature_roofline(a.graph, [s.to_config() for s in legal], graph_hash(graph),
                                       DeviceFacts())
        picked: dict[str, object] = {}
        for i in fallback_order(a, legal, est, waves, 2):
            if legal[i].fast_math:
                picked.setdefault(legal[i].mapping, legal[i])
        jobs += [(graph, s, generate(graph, s, sm_count=2)) for s in picked.values()]
    return jobs + _window_jobs()


def test_fallback_takes_fast_math_where_the_space_offers_it():
    """GroupNorm + SiLU is scheduled by the fallback (index-mapped: unseen by the model); its pick
    is the fast-math twin, whose source calls the intrinsics; a norm without SiLU has no twin."""
    import tunedb

    def step(g):
        (s,) = [s for s in tunedb.compile(g, device=None).steps if s.kind == "fused"]
        return s

    from tunedb.kernels.schedule import Schedule

    g = groupnorm_silu(8, 320, 32, 32, 32)  # UNet's 320-channel GroupNorm + SiLU
    s = step(g)
    assert s.cost_source == "roofline" and s.config_dict["fast_math"] is True
    src = generate(g, Schedule.from_config(s.config_dict), sm_count=132).kernels[0].source
    assert "tdb_sigmoid_fast(" in src[len(PRELUDE):]
    (window,) = _window_jobs()[:1]
    assert "tdb_sigmoid_fast(" in window[2].kernels[0].source[len(PRELUDE):]
    plain = step(groupnorm(8, 320, 32, 32, 32))
    assert plain.cost_source == "roofline" and not plain.config_dict.get("fast_math", False)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_fast_math_at_its_documented_error_passes_and_a_thousand_times_fails(tmp_path):
    from tunedb.runtime.emu import build, mismatches

    jobs = _fast_jobs()
    assert len({g.name for g, _, _ in jobs}) == 7 and all(s.fast_math for _, s, _ in jobs)
    srcs = [k.source for _, _, p in jobs for k in p.kernels]
    for scale, sign in ((1.0, 1.0), (1.0, -1.0), (1.0, 0.0)):
        lib = build([_with_error(s, scale, sign) for s in srcs], str(tmp_path))
        failures = mismatches(lib, jobs)
        assert not failures, f"documented error, sign {sign}:\n" + "\n".join(failures[:20])
    lib = build([_with_error(s, 1000.0, 0.0) for s in srcs], str(tmp_path))
    failed = {line.split()[0] for line in mismatches(lib, jobs)}
    assert failed == {g.name for g, _, _ in jobs}, f"only {sorted(failed)} failed at 1000x"
