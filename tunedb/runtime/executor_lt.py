"""cuBLASLt GEMMs with a bias epilogue: ``out = x @ w + bias`` in one launch.

A ``gemm`` step whose C is a bias vector (``compile(gemm_epilogue=True)`` makes them from a
matmul and its bias add) otherwise runs as two launches: a copy of the bias broadcast into the
output, then cuBLAS with beta = 1. cuBLASLt adds the bias in the GEMM's epilogue
(``CUBLASLT_EPILOGUE_BIAS``, the bias along the rows of its column-major D, which are the columns
of the row-major output). Off unless asked for (``TUNEDB_CUBLASLT=1``, or
``PlanExecutor(cublaslt=True)``): the GPU test ``test_executor_gpu`` checks it, the CPU tests
check the enum values and struct layout against ``cublasLt.h`` and build the descriptors.

Row-major operands as in ``tunedb.runtime.blas``: ``out[M, N] = x[M, K] @ w[K, N]`` is the
column-major ``D[N, M] = W[N, K] @ X[K, M]`` (cuBLASLt's A is ``w``, its B is ``x``). Everything
is set up when the step is built (descriptors, the heuristic's algorithm), so a launch is one
``cublasLtMatmul`` call that a CUDA graph can capture. CuPy is imported by the caller.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunedb.runtime.blas import (
    COMPUTE_32F,
    COMPUTE_32F_FAST_TF32,
    CUDA_R_32F,
    DATA_TYPES,
    OP_N,
    OP_T,
    load_first,
)
from tunedb.runtime.blas import library as blas_library

LT_ENV = "TUNEDB_CUBLASLT"
# cublasLt.h enum values (checked against the header by tests/test_executor_blas.py).
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
EPILOGUE_DEFAULT, EPILOGUE_BIAS, EPILOGUE_GELU_BIAS = 1, 4, 36
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20


class LtError(RuntimeError):
    """cuBLASLt could not be loaded, a descriptor could not be made or a call failed."""


class HeuristicResult(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int), ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def lt_enabled() -> bool:
    return os.environ.get(LT_ENV, "0") not in ("", "0")


@dataclass(frozen=True)
class BiasGemm:
    """One ``cublasLtMatmul`` in its own terms: ``D[m, n] = op(A) @ B + bias[m]``, column-major;
    ``a_rows``/``a_cols``: A as stored (before ``transa``)."""

    transa: int
    m: int
    n: int
    k: int
    a_rows: int
    a_cols: int
    lda: int
    ldb: int
    ldd: int


def plan_bias_gemm(x_shape: tuple[int, ...], x_strides: tuple[int, ...], w_shape: tuple[int, ...],
                   w_strides: tuple[int, ...], out_shape: tuple[int, ...], out_strides: tuple[int, ...],
                   trans_b: bool) -> BiasGemm | None:
    """The call for row-major 2-D ``x`` [M, K], ``w`` [K, N] (``[N, K]`` with ``trans_b``) and
    ``out`` [M, N] with unit column strides (element strides); None for any other layout."""
    if len(x_shape) != 2 or len(w_shape) != 2 or len(out_shape) != 2:
        return None
    M, K = x_shape
    N = w_shape[0] if trans_b else w_shape[1]
    if (w_shape[1] if trans_b else w_shape[0]) != K or tuple(out_shape) != (M, N) or 0 in (M, N, K):
        return None
    if x_strides[1] != 1 or w_strides[1] != 1 or out_strides[1] != 1:
        return None
    ldx, ldw, ldo = x_strides[0], w_strides[0], out_strides[0]
    if ldx < K or ldo < N or ldw < w_shape[1]:
        return None
    if trans_b:  # w [N, K] row-major is the column-major [K, N]: transposed to [N, K]
        return BiasGemm(OP_T, N, M, K, K, N, ldw, ldx, ldo)
    return BiasGemm(OP_N, N, M, K, N, K, ldw, ldx, ldo)


_LIB: list[Any] = []


def _loaded(prefix: str) -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(prefix):
                    return parts[5].strip()
    except OSError:
        pass
    return None


def lt_library(path: str | None = None) -> Any:
    """libcublasLt with the prototypes used here: ``path``, else the copy this process loaded
    (cuBLAS links it), else the dynamic loader's."""
    if _LIB and path is None:
        return _LIB[0]
    if path is None:
        try:  # cuBLAS (CuPy's copy) links cuBLASLt: load it so that the lookup below finds that copy
            blas_library()
        except Exception:  # noqa: BLE001 - fall back to the dynamic loader's search
            pass
    if path:
        names = [path]
    else:
        names = [p for p in (_loaded("libcublasLt.so"), ctypes.util.find_library("cublasLt")) if p]
        names += ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    lib = load_first(names, "cuBLASLt", LtError)
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    protos = {
        "cublasLtCreate": [ctypes.POINTER(vp)], "cublasLtDestroy": [vp],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i, i], "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
        "cublasLtMatmulDescGetAttribute": [vp, i, vp, sz, ctypes.POINTER(sz)],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, ctypes.c_uint64, ctypes.c_uint64,
                                       ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)], "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(HeuristicResult),
                                           ctypes.POINTER(i)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(HeuristicResult),
                           vp, sz, vp],
    }
    for name, args in protos.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LtError(f"cuBLASLt library {names[0]!r} lacks {name}") from None
        fn.argtypes, fn.restype = args, ctypes.c_int
    if path is None:
        _LIB.append(lib)
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise LtError(f"{what} failed: cuBLAS status {status}")


class Descriptors:
    """The matmul descriptor (fp32 accumulation, the ops, the bias epilogue and its pointer) and
    the three matrix layouts of one ``BiasGemm``; destroyed with the object. No handle or GPU
    needed: the CPU tests build them and read the attributes back."""

    def __init__(self, lib: Any, call: BiasGemm, dtype: str, bias_ptr: int, tf32: bool = False,
                 epilogue: int = EPILOGUE_BIAS) -> None:
        if dtype not in DATA_TYPES:
            raise LtError(f"cuBLASLt GEMM on {dtype}: expected float32, float16 or bfloat16")
        self.lib, t = lib, DATA_TYPES[dtype]
        vp = ctypes.c_void_p
        self.desc, self.a, self.b, self.d = vp(), vp(), vp(), vp()
        self._final = weakref.finalize(self, Descriptors._destroy, lib, self.desc, (self.a, self.b, self.d))
        compute = COMPUTE_32F_FAST_TF32 if tf32 and dtype == "float32" else COMPUTE_32F
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), compute, CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        self._set(DESC_TRANSA, ctypes.c_int32(call.transa))
        self._set(DESC_TRANSB, ctypes.c_int32(OP_N))
        self._set(DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        self._set(DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        self._set(DESC_BIAS_DATA_TYPE, ctypes.c_int32(t))
        for lay, (r, c, ld) in ((self.a, (call.a_rows, call.a_cols, call.lda)),
                                (self.b, (call.k, call.n, call.ldb)), (self.d, (call.m, call.n, call.ldd))):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), t, r, c, ld),
                   "cublasLtMatrixLayoutCreate")

    def _set(self, attr: int, value: Any) -> None:
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value),
                                                       ctypes.sizeof(value)), f"matmul attribute {attr}")

    def get(self, attr: int, ctype: Any) -> int:
        v, written = ctype(), ctypes.c_size_t()
        _check(self.lib.cublasLtMatmulDescGetAttribute(self.desc, attr, ctypes.byref(v), ctypes.sizeof(v),
                                                       ctypes.byref(written)), f"get attribute {attr}")
        return int(v.value or 0)

    @staticmethod
    def _destroy(lib: Any, desc: Any, layouts: tuple[Any, ...]) -> None:
        for lay in layouts:
            if lay.value:
                lib.cublasLtMatrixLayoutDestroy(lay)
        if desc.value:
            lib.cublasLtMatmulDescDestroy(desc)


class BlasLt:
    """A cuBLASLt handle and workspace for launches on ``stream``; keep it alive as long as a
    CUDA graph replays its calls."""

    def __init__(self, cp: Any, stream: Any, tf32: bool = False) -> None:
        self.lib, self.cp, self.stream, self.tf32 = lt_library(), cp, stream, tf32
        h = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        self.handle = h
        self._final = weakref.finalize(self, self.lib.cublasLtDestroy, h)
        self._final.atexit = False  # at exit the CUDA context may be gone already
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)

    def gemm_bias(self, x: Any, w: Any, bias: Any, out: Any, *, trans_b: bool, dtype: str,
                  epilogue: int = EPILOGUE_BIAS) -> Callable[[], None] | None:
        """A launch computing ``out = x @ w (w.T with trans_b) + bias`` on the stream, or None
        when the layouts do not fit or the heuristic has no algorithm (the caller falls back).
        ``epilogue=EPILOGUE_GELU_BIAS`` applies cuBLASLt's GELU after the bias: which GELU that
        is (erf or tanh) is what ``test_cublaslt_gelu_epilogue_form`` finds out; no plan uses it."""
        isz = out.dtype.itemsize

        def geom(a: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
            return tuple(int(d) for d in a.shape), tuple(int(s) // isz for s in a.strides)

        call = plan_bias_gemm(*geom(x), *geom(w), *geom(out), trans_b)
        if call is None or bias.size != call.m or not bias.flags.c_contiguous:
            return None
        desc = Descriptors(self.lib, call, dtype, bias.data.ptr, self.tf32, epilogue)
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), ctypes.sizeof(ws)), "workspace preference")
            result, found = HeuristicResult(), ctypes.c_int(0)
            status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc.desc, desc.a, desc.b, desc.d,
                                                             desc.d, pref, 1, ctypes.byref(result),
                                                             ctypes.byref(found))
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0 or found.value < 1 or result.state != 0:
            return None
        scalars = (ctypes.c_float(1.0), ctypes.c_float(0.0))
        args = (self.handle, desc.desc, ctypes.addressof(scalars[0]), w.data.ptr, desc.a, x.data.ptr,
                desc.b, ctypes.addressof(scalars[1]), out.data.ptr, desc.d, out.data.ptr, desc.d,
                ctypes.byref(result), self.workspace.data.ptr, WORKSPACE_BYTES, int(self.stream.ptr) or None)
        fn = self.lib.cublasLtMatmul

        def run() -> None:
            _check(fn(*args), f"cublasLtMatmul (m={call.m}, n={call.n}, k={call.k}, {dtype}, bias)")

        run.keep = (x, w, bias, out, desc, scalars, result)  # type: ignore[attr-defined]
        return run
