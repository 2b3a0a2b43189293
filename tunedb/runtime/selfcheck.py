"""GPU self-check of the executor's cuBLAS path: ``python -m tunedb.runtime.selfcheck``.

Runs the GEMMs of ``tunedb.runtime.blas`` (float32 / float16 / bfloat16, plain, transposed,
strided-batched, broadcast, folded, 1-D, gemm alpha/beta) against a float64 ``cupy.matmul``
under the protocol's tolerance (``tunedb.runtime.tolerance``, K accumulated terms), then
captures all of them into one CUDA graph, replays it on zeroed outputs and checks again. One
line per check, PASS or FAIL; the exit status is the number of failures (0: all passed). Plans
through ``PlanExecutor`` are the GPU tests' (the runtime does not build plans).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from tunedb.runtime.blas import DATA_TYPES, Blas, library
from tunedb.runtime.executor_ops import to_bf16_bits
from tunedb.runtime.tolerance import dtype_tolerance, element_bounds, element_errors

# (name, x shape, y shape, dtype, transpose x, transpose y, alpha, beta). The shapes are those of
# the stored arrays; "transpose x" makes the left operand the transposed view x.T (gemm's trans_a),
# so x^T @ y^T needs x (K, M) and y (N, K).
CASES: list[tuple[str, tuple[int, ...], tuple[int, ...], str, bool, bool, float, float]] = [
    ("gemm f32 257x129 @ 129x65", (257, 129), (129, 65), "float32", False, False, 1.0, 0.0),
    ("gemm f16 128x96 @ 96x80", (128, 96), (96, 80), "float16", False, False, 1.0, 0.0),
    ("gemm bf16 128x96 @ 96x80", (128, 96), (96, 80), "bfloat16", False, False, 1.0, 0.0),
    ("gemm f32 x^T @ y^T (trans views)", (70, 33), (51, 70), "float32", True, True, 1.0, 0.0),
    ("gemm f32 alpha 0.5 beta 2", (40, 24), (24, 36), "float32", False, False, 0.5, 2.0),
    ("strided-batched f32 (4,3,33,17) @ (4,3,17,29)", (4, 3, 33, 17), (4, 3, 17, 29), "float32",
     False, False, 1.0, 0.0),
    ("strided-batched f16 (8,64,32) @ (8,32,48)", (8, 64, 32), (8, 32, 48), "float16", False, False,
     1.0, 0.0),
    ("strided-batched bf16 (6,40,24) @ (6,24,16)", (6, 40, 24), (6, 24, 16), "bfloat16", False,
     False, 1.0, 0.0),
    ("folded linear f32 (2,128,768) @ (768,768)", (2, 128, 768), (768, 768), "float32", False, False,
     1.0, 0.0),
    ("broadcast left f32 (64,48) @ (5,48,40)", (64, 48), (5, 48, 40), "float32", False, False, 1.0, 0.0),
    ("grouped conv f32 (2,4,12) @ (3,2,12,20)", (2, 4, 12), (3, 2, 12, 20), "float32", False, False,
     1.0, 0.0),
    ("1-D f32 (96,) @ (96,32)", (96,), (96, 32), "float32", False, False, 1.0, 0.0),
]


def _bf16_bits(cp: Any, v: Any) -> Any:
    return to_bf16_bits(cp, v)


def operand(xp: Any, rng: np.random.Generator, shape: tuple[int, ...], trans: bool,
            convert: Callable[[Any], Any] = lambda a: a) -> Any:
    """A stored array of ``shape`` (standard normal values, ``convert``-ed to the case's dtype);
    with ``trans`` its transposed view, which cuBLAS reads with op T. ``xp``: cupy or numpy."""
    a = convert(xp.asarray(rng.standard_normal(shape).astype(np.float32)))
    return a.T if trans else a


def _widen(cp: Any, a: Any, dtype: str) -> Any:
    if dtype == "bfloat16":
        return (a.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    return a.astype(cp.float64)


class _Case:
    """Device operands, an output, the launch and its float64 reference."""

    def __init__(self, cp: Any, blas: Any, spec: tuple, seed: int) -> None:
        self.name, xs, ys, self.dtype, tx, ty, self.alpha, self.beta = spec
        rng = np.random.default_rng(seed)
        store = np.float16 if self.dtype == "float16" else np.float32

        def convert(v: Any) -> Any:
            return _bf16_bits(cp, v) if self.dtype == "bfloat16" else v.astype(store)

        self.x, self.y = operand(cp, rng, xs, tx, convert), operand(cp, rng, ys, ty, convert)
        self.terms = self.x.shape[-1] + (self.beta != 0.0)  # K products (and C) per element
        ref = cp.matmul(_widen(cp, self.x, self.dtype), _widen(cp, self.y, self.dtype))
        self.out = cp.empty(ref.shape, dtype=self.x.dtype)
        self.c0 = None
        if self.beta != 0.0:
            c = cp.asarray(rng.standard_normal(ref.shape).astype(np.float32))
            self.c0 = _bf16_bits(cp, c) if self.dtype == "bfloat16" else c.astype(store)
            ref = self.alpha * ref + self.beta * _widen(cp, self.c0, self.dtype)
        elif self.alpha != 1.0:
            ref = self.alpha * ref
        self.ref = ref
        self.launch: Callable[[], None] = blas.gemm(self.x, self.y, self.out, alpha=self.alpha,
                                                    beta=self.beta, dtype=self.dtype)

    def reset(self) -> None:
        if self.c0 is not None:
            self.out[...] = self.c0
        else:
            self.out.fill(0)

    def error_ratio(self, cp: Any) -> float:
        """The worst element's error over its tolerance (> 1 fails)."""
        got = _widen(cp, self.out, self.dtype)
        abs_tol, rtol = dtype_tolerance(self.dtype, terms=self.terms).bounds(cp.asnumpy(self.ref))
        err = element_errors(cp, got, self.ref)
        return float((err / element_bounds(cp, self.ref, abs_tol, rtol)).max())


def _line(ok: bool, name: str, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def main() -> int:
    try:
        import cupy as cp

    except Exception as e:  # noqa: BLE001
        print(f"FAIL  import: {type(e).__name__}: {e}")
        return 1
    fails = 0
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    print(f"device {dev.id}: {props.get('name', b'?')!r}, CuPy {cp.__version__}, "
          f"CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}", flush=True)
    rt = cp.cuda.runtime
    for name, value in DATA_TYPES.items():
        attr = {"float32": "CUDA_R_32F", "float16": "CUDA_R_16F", "bfloat16": "CUDA_R_16BF"}[name]
        if hasattr(rt, attr):
            fails += not _line(getattr(rt, attr) == value, f"enum {attr}",
                               f"ours {value}, CuPy's {getattr(rt, attr)}")
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        lib = library()
        blas = Blas(cp, stream)
    except Exception as e:  # noqa: BLE001
        _line(False, "cuBLAS handle", f"{type(e).__name__}: {e}")
        return fails + 1
    _line(True, "cuBLAS handle", f"library {getattr(lib, '_name', '?')}, version {blas.version}, "
          f"fixed workspace {'set' if blas.has_workspace else 'NOT available (warm-up only)'}")
    cases: list[_Case] = []
    with stream:
        for i, spec in enumerate(CASES):
            try:
                c = _Case(cp, blas, spec, i)
                c.reset()
                c.launch()
                stream.synchronize()
                err = c.error_ratio(cp)
                fails += not _line(err <= 1.0, f"eager {c.name}", f"err/tol {err:.2f}")
                cases.append(c)
            except Exception as e:  # noqa: BLE001
                fails += not _line(False, f"eager {spec[0]}", f"{type(e).__name__}: {e}")
    fails += _capture_check(cp, stream, cases)
    print(f"selfcheck: {'all passed' if not fails else f'{fails} failed'}", flush=True)
    return fails


def _capture_check(cp: Any, stream: Any, cases: list[_Case]) -> int:
    """All cases' GEMMs captured into one CUDA graph, replayed on reset outputs."""
    if not cases:
        return not _line(False, "capture", "no case ran eagerly")
    try:
        with stream:
            stream.begin_capture()
            try:
                for c in cases:
                    c.launch()
            finally:
                graph = stream.end_capture()
            for c in cases:
                c.reset()
            graph.launch(stream)
        stream.synchronize()
    except Exception as e:  # noqa: BLE001
        return not _line(False, f"capture of {len(cases)} GEMMs into one CUDA graph",
                         f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    _line(True, f"capture of {len(cases)} GEMMs into one CUDA graph", "captured and replayed")
    fails = 0
    for c in cases:
        err = c.error_ratio(cp)
        fails += not _line(err <= 1.0, f"graph replay {c.name}", f"err/tol {err:.2f}")
    try:  # a second replay on garbage outputs must overwrite them the same way
        with stream:
            for c in cases:
                if c.c0 is None:
                    c.out.fill(7)
            graph.launch(stream)
        stream.synchronize()
        worst = max(c.error_ratio(cp) for c in cases if c.c0 is None)
        fails += not _line(worst <= 1.0, "second graph replay", f"worst err/tol {worst:.2f}")
    except Exception as e:  # noqa: BLE001
        fails += not _line(False, "second graph replay", f"{type(e).__name__}: {e}")
    return fails


if __name__ == "__main__":
    sys.exit(min(main(), 100))
