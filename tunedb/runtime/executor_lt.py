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

from tunedb.graph.ir import Graph, Node
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
# A plan step's ``epilogue`` that runs matmul + bias + GELU as one GELU_BIAS call.
GELU_BIAS = "gelu_bias"
# max over x of |GELU_erf(x) - GELU_tanh(x)| (at x = 2.70, where GELU is 2.69): what running
# the erf GELU that exporters write as cuBLASLt's GELU_BIAS (the tanh form) changes.
GELU_TANH_MAX_ABS_ERR = 4.74e-4


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
        is the tanh form (``test_executor_gpu``); ``gelu_bias_launch`` uses it."""
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


# -- matmul + bias + GELU as one GELU_BIAS call ----------------------------------------------------
@dataclass(frozen=True)
class BiasGelu:
    """Names, in a step's sub-graph, of ``out = GELU(x @ w + bias)``."""

    x: str
    w: str
    bias: str
    out: str
    trans_b: bool


def _scalar(g: Graph, v: str) -> float | None:
    c = g.constant_map.get(v)
    return float(c.array.ravel()[0]) if c is not None and c.array.size == 1 else None


def _erf_gelu(g: Graph, h: str, rest: list[Node]) -> bool:
    """``rest`` is exactly the erf GELU of ``h`` as exporters write it:
    ``h * 0.5 * (1 + erf(h / sqrt(2)))`` (or ``* (1/sqrt(2))``), the products in any order."""
    if len(rest) != 5 or g.outputs[0] not in {o for n in rest for o in n.outputs}:
        return False
    by_out = {n.outputs[0]: n for n in rest}
    erfs = [n for n in rest if n.op == "erf"]
    if len(erfs) != 1 or erfs[0].inputs[0] not in by_out:
        return False
    scaled = by_out[erfs[0].inputs[0]]
    root2 = 2 ** 0.5
    if scaled.op == "div" and scaled.inputs[0] == h:
        c = _scalar(g, scaled.inputs[1])
        ok = c is not None and abs(c / root2 - 1) < 4e-3  # sqrt(2) rounded to bfloat16 counts
    elif scaled.op == "mul" and h in scaled.inputs:
        c = _scalar(g, scaled.inputs[1] if scaled.inputs[0] == h else scaled.inputs[0])
        ok = c is not None and abs(c * root2 - 1) < 4e-3
    else:
        ok = False
    plus = [n for n in rest if n.op == "add" and erfs[0].outputs[0] in n.inputs]
    if not ok or len(plus) != 1:
        return False
    one = [v for v in plus[0].inputs if v != erfs[0].outputs[0]]
    if len(one) != 1 or _scalar(g, one[0]) != 1.0:
        return False
    muls: list[Node] = []

    def factors(v: str) -> list[str]:
        n = by_out.get(v)
        if n is None or n.op != "mul" or n is scaled:
            return [v]
        muls.append(n)
        return factors(n.inputs[0]) + factors(n.inputs[1])

    fs = factors(g.outputs[0])
    p = plus[0].outputs[0]
    halves = [v for v in fs if v not in (h, p) and _scalar(g, v) == 0.5]
    return len(muls) == 2 and len(fs) == 3 and fs.count(h) == 1 and fs.count(p) == 1 and len(halves) == 1


def bias_gelu_parts(g: Graph) -> BiasGelu | None:
    """The parts of a sub-graph that is exactly ``GELU(x @ w + bias)``: one matmul (or a gemm
    without C, A not transposed) by a 2-D ``w``, the add of a bias vector along its columns,
    then the GELU (a ``gelu`` node, or the erf form of ``_erf_gelu``) as its one output; None
    for anything else."""
    if len(g.outputs) != 1:
        return None
    types = g.type_map
    mm = [n for n in g.nodes if n.op in ("matmul", "gemm")]
    if len(mm) != 1 or types[mm[0].inputs[1]].rank != 2 or types[mm[0].inputs[0]].rank < 2:
        return None
    m = mm[0]
    trans_b = False
    if m.op == "gemm":
        if len([v for v in m.inputs if v]) != 2 or m.attr("trans_a") or m.attr("alpha", 1.0) != 1.0:
            return None
        trans_b = bool(m.attr("trans_b"))
    y = m.outputs[0]
    adds = [n for n in g.nodes if n.op == "add" and y in n.inputs]
    if len(adds) != 1 or list(adds[0].inputs).count(y) != 1:
        return None
    bias = adds[0].inputs[1] if adds[0].inputs[0] == y else adds[0].inputs[0]
    n_cols = types[y].shape[-1]
    bshape = types[bias].shape
    if not bshape or bshape[-1] != n_cols or any(d != 1 for d in bshape[:-1]) or len(bshape) > types[y].rank:
        return None
    h = adds[0].outputs[0]
    rest = [n for n in g.nodes if n is not m and n is not adds[0]]
    gelu = len(rest) == 1 and rest[0].op == "gelu" and rest[0].inputs == (h,) and rest[0].outputs == g.outputs
    if not gelu and not _erf_gelu(g, h, rest):
        return None
    if types[g.outputs[0]].shape != types[y].shape:
        return None
    return BiasGelu(m.inputs[0], m.inputs[1], bias, g.outputs[0], trans_b)


def gelu_bias_launch(lt: BlasLt | None, sub: Graph, arrays: dict[str, Any]) -> Callable[[], None] | None:
    """One cuBLASLt GELU_BIAS launch computing the ``bias_gelu_parts`` sub-graph ``sub`` on its
    device ``arrays`` (by sub-graph name, inputs and output), or None when there is no cuBLASLt,
    the sub-graph is no such GEMM, an operand is strided or the heuristic has no algorithm (the
    caller runs the step otherwise). cuBLASLt's GELU is the tanh form: within
    ``GELU_TANH_MAX_ABS_ERR`` of the erf form, which the plan accepts only where that is far
    inside the dtype's tolerance (``tunedb.plan.gelu_epilogue``)."""
    parts = bias_gelu_parts(sub)
    if lt is None or parts is None:
        return None
    x, w, bias, out = (arrays[v] for v in (parts.x, parts.w, parts.bias, parts.out))
    if not (x.flags.c_contiguous and out.flags.c_contiguous and bias.flags.c_contiguous):
        return None  # a reshape below would copy
    dtype = sub.type_of(parts.out).dtype
    return lt.gemm_bias(x.reshape(-1, x.shape[-1]), w, bias.reshape(-1), out.reshape(-1, out.shape[-1]),
                        trans_b=parts.trans_b, dtype=dtype, epilogue=EPILOGUE_GELU_BIAS)


def gelu_bias_step(ex: Any, sub: Graph, arrays: dict[str, Any], k: int, step: Any
                   ) -> tuple[list[Callable[[], None]] | None, int, str]:
    """``(launches, count, path)`` of an executor's (``ex``) plan step ``k`` whose epilogue is
    ``GELU_BIAS``: one cuBLASLt launch, else ``(None, 0, op by op)`` with the reason in
    ``ex.fallbacks`` (the step then runs op by op: the erf GELU, exactly)."""
    one = gelu_bias_launch(ex.lt, sub, arrays)
    if one is not None:
        return [one], 1, "cublasLt gelu epilogue"
    why = ex.lt_error or ("cuBLASLt off" if ex.lt is None else "no GELU_BIAS algorithm or layout")
    ex.fallbacks.append(f"step {k} ({'+'.join(step.ops)}): no cuBLASLt GELU_BIAS ({why}); ran op by op")
    return None, 0, "cupy op by op"
