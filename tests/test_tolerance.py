"""The one tolerance table: correct kernels with a large dynamic range pass, wrong ones fail.

The kernels here are the arithmetic a generated kernel performs (float32 throughout, one
rounding to the stored dtype on store) written in NumPy; the reference is the float64 oracle
on the same (dtype-rounded) inputs, as in the measurement protocol.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.runtime.inputs import bf16_bits, bf16_to_f32
from tunedb.runtime.tolerance import Tolerance, check_host, compare_outputs, output_scale, tolerance

DTYPES = ("float32", "float16", "bfloat16")
LR, B1, B2, EPS = 1.0, 0.9, 0.999, 1e-6
SHAPE = (64, 256)


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values rounded to ``dtype`` (float32 holding them; bfloat16 as its float32 value)."""
    if dtype == "bfloat16":
        return bf16_to_f32(bf16_bits(np.asarray(x, np.float32))).reshape(np.shape(x))
    return np.asarray(x).astype(dtype).astype(np.float32)


def adam_graph(dtype: str):
    """One Adam step: p - lr * m' / (sqrt(v') + eps), m' and v' the updated moments."""
    b = GraphBuilder(f"adam_{dtype}")
    p, g, m, v = (b.input(n, SHAPE, dtype) for n in ("p", "g", "m", "v"))
    m1 = b.add(b.mul(m, b.scalar(B1, m)), b.mul(g, b.scalar(1 - B1, g)))
    v1 = b.add(b.mul(v, b.scalar(B2, v)), b.mul(b.mul(g, g), b.scalar(1 - B2, g)))
    step = b.div(m1, b.add(b.sqrt(v1), b.scalar(EPS, v1)))
    return b.build([b.sub(p, b.mul(step, b.scalar(LR, step)))])


def adam_inputs(dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Early-training moments: second moments spread over ten decades down to 1e-10 (near-zero
    roots make steps up to ~1e3), and a tenth of the weights that this step nearly zeroes.
    float16 holds nothing below 6e-8: its moments start at 1e-7, its first moments larger."""
    rng = np.random.default_rng(seed)
    v = 10.0 ** rng.uniform(-7 if dtype == "float16" else -10, 0, SHAPE)
    g = rng.standard_normal(SHAPE) * np.sqrt(v) * 0.1
    m = rng.standard_normal(SHAPE) * (0.1 if dtype == "float16" else 1e-2)
    k = {c: float(_round(np.float32(c), dtype)) for c in (B1, 1 - B1, B2, 1 - B2, EPS)}
    m1, v1 = k[B1] * m + k[1 - B1] * g, k[B2] * v + k[1 - B2] * g * g
    step = LR * m1 / (np.sqrt(v1) + k[EPS])
    p = rng.standard_normal(SHAPE)
    hit = rng.random(SHAPE) < 0.1
    p[hit] = step[hit] * (1 + 1e-4 * rng.standard_normal(int(hit.sum())))
    return {k: _round(a, dtype) for k, a in dict(p=p, g=g, m=m, v=v).items()}


def adam_kernel(x: dict[str, np.ndarray], dtype: str) -> np.ndarray:
    """The generated kernel's arithmetic: float32, rounded to ``dtype`` once on store (the
    graph's scalar constants have the graph's dtype)."""
    f = {k: a.astype(np.float32) for k, a in x.items()}

    def c(value: float) -> np.float32:
        return np.float32(_round(np.float32(value), dtype))

    m1 = f["m"] * c(B1) + f["g"] * c(1 - B1)
    v1 = f["v"] * c(B2) + f["g"] * f["g"] * c(1 - B2)
    out = f["p"] - (m1 / (np.sqrt(v1) + c(EPS))) * c(LR)
    return _round(out, dtype)


def layernorm_graph(dtype: str):
    b = GraphBuilder(f"ln_{dtype}")
    x = b.input("x", SHAPE, dtype)
    return b.build([b.layernorm(x, b.input("s", SHAPE[-1:], dtype), b.input("t", SHAPE[-1:], dtype))])


def layernorm_kernel(x: dict[str, np.ndarray], dtype: str, axis: int = -1) -> np.ndarray:
    a = x["x"].astype(np.float32)
    d = a - a.mean(axis=axis, keepdims=True, dtype=np.float32)
    var = (d * d).mean(axis=axis, keepdims=True, dtype=np.float32)
    return _round(d / np.sqrt(var + np.float32(1e-5)) * x["s"] + x["t"], dtype)


def _ref(graph, x: dict[str, np.ndarray]) -> np.ndarray:
    return run_reference(graph, x)[graph.outputs[0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_correct_optimizer_step_with_near_zero_roots_passes(dtype: str) -> None:
    g = adam_graph(dtype)
    x = adam_inputs(dtype)
    ref, out = _ref(g, x), adam_kernel(x, dtype)
    assert np.abs(ref).max() > 100 * output_scale(ref[np.abs(ref) < 1])  # a large dynamic range
    ok, err = check_host(out, ref, tolerance(g, dtype))
    assert ok, f"max abs error {err:.3g}"
    assert compare_outputs(g, {g.outputs[0]: out}, {g.outputs[0]: ref})[1] <= 1.0


def test_an_absolute_tolerance_on_the_unit_scale_fails_that_step() -> None:
    """The case is not vacuous: float32 rounding of the ~1e3 steps shows on the nearly zeroed
    weights beyond an absolute 1e-5, which the output's scale (its RMS) absorbs."""
    g = adam_graph("float32")
    x = adam_inputs("float32")
    ref, out = _ref(g, x), adam_kernel(x, "float32")
    tol = tolerance(g, "float32")
    assert not check_host(out, ref, Tolerance(tol.atol / output_scale(ref), tol.rtol))[0]
    assert check_host(out, ref, tol)[0]


def _wrong_kernels(out: np.ndarray) -> dict[str, np.ndarray]:
    shifted = np.roll(out, 1, axis=-1)  # every element read one index off
    edge = out.copy()
    edge[:, 1:] = out[:, :-1]  # the same off-by-one, the first column right
    missing = out.copy()
    missing[17, 3] = np.nan  # one element never written (the poison stays)
    return {"off by one": shifted, "off by one, edges kept": edge, "missing element": missing}


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_optimizer_steps_fail(dtype: str) -> None:
    g = adam_graph(dtype)
    x = adam_inputs(dtype, seed=1)
    ref, out = _ref(g, x), adam_kernel(x, dtype)
    tol = tolerance(g, dtype)
    assert check_host(out, ref, tol)[0]
    for what, bad in _wrong_kernels(out).items():
        assert not check_host(bad, ref, tol)[0], what


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_layernorms_fail_and_the_right_one_passes(dtype: str) -> None:
    g = layernorm_graph(dtype)
    rng = np.random.default_rng(2)
    x = {"x": _round(rng.standard_normal(SHAPE), dtype),
         "s": _round(1 + 0.1 * rng.standard_normal(SHAPE[-1]), dtype),
         "t": _round(0.1 * rng.standard_normal(SHAPE[-1]), dtype)}
    ref, out = _ref(g, x), layernorm_kernel(x, dtype)
    tol = tolerance(g, dtype)
    assert check_host(out, ref, tol)[0]
    wrong = {"wrong reduction axis": layernorm_kernel(x, dtype, axis=0), **_wrong_kernels(out)}
    for what, bad in wrong.items():
        assert not check_host(bad, ref, tol)[0], what


def test_integer_outputs_must_match_and_scale_ignores_non_finite() -> None:
    assert output_scale(np.array([3.0, -4.0, np.inf, np.nan])) == pytest.approx(np.sqrt(12.5))
    assert output_scale(np.zeros(4)) == 1.0
    b = GraphBuilder("argmax")
    g = b.build([b.argmax(b.input("x", (4, 8)), axis=1)])
    tol = tolerance(g, "int64")
    assert tol.exact
    ref = np.array([1, 2, 3, 4])
    assert check_host(ref, ref, tol)[0] and not check_host(ref + np.array([0, 0, 0, 1]), ref, tol)[0]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_generated_optimizer_step_passes_in_emulation(dtype: str) -> None:
    """The same step as a generated kernel (the elementwise schedule with the fewest threads),
    run by the CPU emulator into poisoned outputs: it passes, with the same error as the NumPy
    model of its arithmetic above."""
    from tunedb.kernels import generate
    from tunedb.runtime.emu import EMU_INFO, build, check_plan, generable_schedules

    g = adam_graph(dtype)
    s = min((s for s in generable_schedules(g, sm_count=EMU_INFO.sm_count) if not s.fast_math),
            key=lambda s: s.block)
    plan = generate(g, s, sm_count=EMU_INFO.sm_count)
    x = adam_inputs(dtype)
    dev = {k: bf16_bits(v) if dtype == "bfloat16" else v.astype(dtype) for k, v in x.items()}
    ref = {g.outputs[0]: _ref(g, x)}
    _, ratio = check_plan(build([k.source for k in plan.kernels]), g, plan, dev, ref)
    model = compare_outputs(g, {g.outputs[0]: adam_kernel(x, dtype)}, ref)[1]
    assert ratio <= 1.0 and ratio == pytest.approx(model, rel=1e-6)
