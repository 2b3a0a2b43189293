"""cuBLAS GEMMs that a CUDA graph can capture.

CuPy refuses every cuBLAS call while a stream captures (its ``cublas.setStream`` binding, which
each of its GEMM wrappers calls first, raises ``NotImplementedError``), so the executor's GEMMs
call the cuBLAS C API directly through ``ctypes``, on a handle of their own:

* the handle is bound to one stream once (``cublasSetStream_v2``) and then given a fixed
  workspace (``cublasSetWorkspace_v2``; setting the stream resets it, hence this order), so no
  call allocates or changes state during a capture;
* every GEMM is ``cublasGemmEx`` / ``cublasGemmStridedBatchedEx`` with float32 accumulation
  (``CUBLAS_COMPUTE_32F``: float32 stays float32; ``CUBLAS_COMPUTE_32F_FAST_TF32`` only when asked);
  float32, float16 and bfloat16 (stored as its uint16 bits) data;
* scalars are host pointers (the default pointer mode): cuBLAS reads them when the call is made.

Row-major arrays are used without copies: a row-major ``[r, c]`` matrix with row stride ``s``
is the column-major ``[c, r]`` matrix with leading dimension ``s``, so ``C = A @ B`` is computed
as ``C^T = B^T A^T`` (the right operand is cuBLAS's ``A``, the left its ``B``, and m/n swap).
``plan_matmul`` turns shapes and strides into those calls; it is pure Python so the argument
order can be checked without a GPU. CuPy is imported by the caller: this module imports anywhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h).
OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
GEMM_DEFAULT = -1
DEFAULT_MATH = 0
DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}
# Recommended workspace for Hopper (cuBLAS docs, "cublasSetWorkspace").
WORKSPACE_BYTES = 32 << 20
INT_MAX = 2**31 - 1
STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
          11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED",
          16: "LICENSE_ERROR"}


class BlasError(RuntimeError):
    """cuBLAS could not be loaded or a call failed (one-line message)."""


@dataclass(frozen=True)
class GemmCall:
    """One ``cublasGemm(StridedBatched)Ex`` call in cuBLAS's own (column-major) terms. cuBLAS's
    ``A`` is the right operand ``y``, its ``B`` the left operand ``x``; offsets and strides count
    elements from the first element of each array."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    a_off: int
    lda: int
    stride_a: int
    b_off: int
    ldb: int
    stride_b: int
    c_off: int
    ldc: int
    stride_c: int
    batch: int


# -- planning (no GPU) ----------------------------------------------------------------------------
def as_transposed(r: int, c: int, s0: int, s1: int) -> tuple[int, int] | None:
    """``(op, ld)`` such that ``op`` applied to the column-major matrix at the same address with
    leading dimension ``ld`` reads as ``X^T`` for the ``r x c`` matrix ``X`` with element strides
    ``(s0, s1)``; ``None`` if no such view exists (a copy is needed)."""
    # Row-major X (unit column stride): its memory, read column-major with ld = row stride, is X^T.
    if (s1 == 1 or c == 1) and (r == 1 or s0 >= max(1, c)):
        return OP_N, (s0 if r > 1 else max(1, c))
    # Column-major X (unit row stride): its memory read column-major is X itself; transpose it.
    if (s0 == 1 or r == 1) and (c == 1 or s1 >= max(1, r)):
        return OP_T, (s1 if c > 1 else max(1, r))
    return None


def _batch_strides(shape: Sequence[int], strides: Sequence[int], batch: Sequence[int]) -> list[int]:
    """Per broadcast batch dim, the operand's stride (0 where it broadcasts)."""
    own = len(shape) - 2
    pad = len(batch) - own
    out = []
    for i, size in enumerate(batch):
        j = i - pad
        if j < 0 or shape[j] == 1:
            out.append(0)
        elif shape[j] == size:
            out.append(int(strides[j]))
        else:
            raise ValueError(f"batch dims {tuple(shape[:-2])} do not broadcast to {tuple(batch)}")
    return out


def plan_matmul(xs: Sequence[int], xst: Sequence[int], ys: Sequence[int], yst: Sequence[int],
                os_: Sequence[int], ost: Sequence[int]) -> list[GemmCall] | None:
    """cuBLAS calls computing ``out = x @ y`` (NumPy matmul rules: 1-D operands, broadcast batch
    dims) for arrays of shapes ``xs``/``ys``/``os_`` and element strides ``xst``/``yst``/``ost``.
    ``[]``: nothing to compute (an empty output). ``None``: an operand's layout has no cuBLAS view
    (make that operand contiguous and plan again). The inner dimension must not be empty."""
    xs, xst, ys, yst = list(xs), list(xst), list(ys), list(yst)
    o_shape, o_st = list(os_), list(ost)
    if not xs or not ys:
        raise ValueError("matmul needs operands of rank >= 1")
    if len(ys) == 1:  # (K,) -> (K, 1); the output gains a trailing 1
        ys, yst = [ys[0], 1], [yst[0], 1]
        o_shape.append(1)
        o_st.append(1)
    if len(xs) == 1:  # (K,) -> (1, K); the output gains a 1 before its last dim
        xs, xst = [1, xs[0]], [xs[0] * xst[0] or 1, xst[0]]
        o_shape.insert(len(o_shape) - 1, 1)
        o_st.insert(len(o_st) - 1, max(1, o_shape[-1] * o_st[-1]))
    M, K = xs[-2:]
    K2, N = ys[-2:]
    if K != K2 or len(o_shape) < 2 or tuple(o_shape[-2:]) != (M, N):
        raise ValueError(f"cannot matmul {tuple(xs)} with {tuple(ys)} into {tuple(os_)}")
    batch = o_shape[:-2]
    bx = _batch_strides(xs, xst, batch)
    by = _batch_strides(ys, yst, batch)
    bo = [int(s) for s in o_st[:-2]]
    if M * N == 0 or any(b == 0 for b in batch):
        return []
    if K == 0:
        raise ValueError("matmul with an empty inner dimension")
    # Batch dims of size 1 do not matter; neighbours that step evenly for all three merge.
    dims: list[tuple[int, int, int, int]] = []
    for size, sx, sy, so in zip(batch, bx, by, bo):
        if size == 1:
            continue
        if min(sx, sy, so) < 0:
            return None
        if dims:
            ps, px, py, po = dims[-1]
            if (px, py, po) == (sx * size, sy * size, so * size):
                dims[-1] = (ps * size, sx, sy, so)
                continue
        dims.append((size, sx, sy, so))
    ty = as_transposed(K, N, yst[-2], yst[-1])
    if ty is None:
        return None
    # A batch over x only, laid out row after row (a linear layer on [B, S, H]): one GEMM with
    # B*S rows instead of a batch of small ones.
    if len(dims) == 1 and dims[0][2] == 0:
        size, sx, _, so = dims[0]
        rx = xst[-2] if M > 1 else sx
        ro = o_st[-2] if M > 1 else so
        if (M == 1 or (sx == M * xst[-2] and so == M * o_st[-2])):
            fx = as_transposed(size * M, K, rx, xst[-1])
            fo = as_transposed(size * M, N, ro, o_st[-1])
            if fx is not None and fx[0] == OP_N and fo is not None and fo[0] == OP_N:
                return _checked([GemmCall(ty[0], OP_N, N, size * M, K, 0, ty[1], 0, 0, fx[1], 0,
                                          0, fo[1], 0, 1)])
    tx = as_transposed(M, K, xst[-2], xst[-1])
    to = as_transposed(M, N, o_st[-2], o_st[-1])
    if tx is None or to is None or to[0] != OP_N:
        return None
    inner = dims[-1] if dims else (1, 0, 0, 0)
    outer = dims[:-1]
    calls = []
    for idx in itertools.product(*(range(d[0]) for d in outer)):
        ox = sum(i * d[1] for i, d in zip(idx, outer))
        oy = sum(i * d[2] for i, d in zip(idx, outer))
        oo = sum(i * d[3] for i, d in zip(idx, outer))
        calls.append(GemmCall(ty[0], tx[0], N, M, K, oy, ty[1], inner[2], ox, tx[1], inner[1],
                              oo, to[1], inner[3], inner[0]))
    return _checked(calls)


def pointer_batch(calls: Sequence[GemmCall]) -> tuple[GemmCall, list[tuple[int, int, int]]] | None:
    """Several strided-batched calls that differ only in their offsets (a batch over two or more
    dims that no single stride steps through, e.g. heads of ``[B, S, H, D]`` read as
    ``[B, H, S, D]``) as one ``cublasGemmBatchedEx``: the shared call and, per matrix, its
    ``(a, b, c)`` element offsets. None for a single call or calls of different shapes."""
    if len(calls) < 2:
        return None
    first = calls[0]
    same = ("transa", "transb", "m", "n", "k", "lda", "ldb", "ldc", "stride_a", "stride_b",
            "stride_c", "batch")
    if any(getattr(c, f) != getattr(first, f) for c in calls for f in same):
        return None
    offs = [(c.a_off + i * c.stride_a, c.b_off + i * c.stride_b, c.c_off + i * c.stride_c)
            for c in calls for i in range(c.batch)]
    if len(offs) > INT_MAX:
        raise ValueError("GEMM batch exceeds cuBLAS's 32-bit count")
    return first, offs


def _checked(calls: list[GemmCall]) -> list[GemmCall]:
    for c in calls:
        if max(c.m, c.n, c.k, c.lda, c.ldb, c.ldc, c.batch) > INT_MAX:
            raise ValueError("GEMM dimensions exceed cuBLAS's 32-bit sizes")
    return calls


# -- the library ----------------------------------------------------------------------------------
_LIB: list[Any] = []


def _loaded_cublas_path() -> str | None:
    """The libcublas this process already loaded (CuPy links it), so both share one copy."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if os.path.basename(path).startswith("libcublas.so"):  # not libcublasLt
                        return path
    except OSError:
        pass
    return None


def load_first(names: list[str], what: str, error: type[Exception]) -> ctypes.CDLL:
    """The first of ``names`` the dynamic loader opens; else ``error`` naming why each failed."""
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise error(f"cannot load {what}: " + "; ".join(errors)[:300])


def library() -> Any:
    """The cuBLAS shared library with the prototypes used here (loaded once)."""
    if _LIB:
        return _LIB[0]
    try:  # make sure CuPy's own cuBLAS is loaded, so the lookup below finds that copy
        import cupy

        cupy.cuda.device.get_cublas_handle()
    except Exception:  # noqa: BLE001 - fall back to the dynamic loader's search
        pass
    names = [p for p in (_loaded_cublas_path(), ctypes.util.find_library("cublas")) if p]
    lib = load_first(names + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"], "cuBLAS", BlasError)
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    protos = {
        "cublasCreate_v2": [ctypes.POINTER(vp)],
        "cublasDestroy_v2": [vp],
        "cublasSetStream_v2": [vp, vp],
        "cublasGemmEx": [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i],
        "cublasGemmStridedBatchedEx": [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i,
                                       i, ll, i, i, i],
    }
    optional = {"cublasSetWorkspace_v2": [vp, vp, ctypes.c_size_t],
                "cublasGemmBatchedEx": [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i, i],
                # CUDA >= 12.5; host arrays of ops/sizes/scalars, device arrays of pointers
                "cublasGemmGroupedBatchedEx": [vp, vp, vp, vp, vp, vp, vp, vp, i, vp, vp, i, vp, vp,
                                               vp, i, vp, i, vp, i],
                "cublasSetMathMode": [vp, i],
                "cublasGetVersion_v2": [vp, ctypes.POINTER(i)]}
    for name, args in {**protos, **optional}.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in optional:
                continue
            raise BlasError(f"cuBLAS library {names[0]!r} lacks {name}") from None
        fn.argtypes, fn.restype = args, ctypes.c_int
    _LIB.append(lib)
    return lib


# Handles of collected ``Blas`` objects, destroyed when the next one is made: a garbage
# collection may run while some stream captures, and cublasDestroy frees memory.
_RETIRED: list[int] = []


def check(status: int, what: str) -> None:
    if status != 0:
        raise BlasError(f"{what} failed: CUBLAS_STATUS_{STATUS.get(status, status)}")


class Blas:
    """A cuBLAS handle bound to ``stream`` with a fixed workspace; ``gemm`` builds launches.

    Keep the object alive as long as anything (a CUDA graph) replays its calls: the graph uses
    its workspace."""

    def __init__(self, cp: Any, stream: Any, tf32: bool = False) -> None:
        lib = self.lib = library()
        while _RETIRED:
            lib.cublasDestroy_v2(_RETIRED.pop())
        self.cp, self.stream = cp, stream
        self.compute = COMPUTE_32F_FAST_TF32 if tf32 else COMPUTE_32F
        h = ctypes.c_void_p()
        check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.handle = h.value
        self._final = weakref.finalize(self, _RETIRED.append, self.handle)
        self._final.atexit = False  # at exit the CUDA context may be gone already
        check(lib.cublasSetStream_v2(self.handle, int(stream.ptr) or None), "cublasSetStream")
        # After the stream: setting the stream drops a user workspace.
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self.has_workspace = hasattr(lib, "cublasSetWorkspace_v2")
        if self.has_workspace:
            check(lib.cublasSetWorkspace_v2(self.handle, self.workspace.data.ptr, WORKSPACE_BYTES),
                  "cublasSetWorkspace")
        if hasattr(lib, "cublasSetMathMode"):  # the default already; explicit: no TF32 unless asked
            check(lib.cublasSetMathMode(self.handle, DEFAULT_MATH), "cublasSetMathMode")
        v = ctypes.c_int()
        if hasattr(lib, "cublasGetVersion_v2"):
            check(lib.cublasGetVersion_v2(self.handle, ctypes.byref(v)), "cublasGetVersion")
        self.version = int(v.value)

    def gemm(self, x: Any, y: Any, out: Any, *, alpha: float = 1.0, beta: float = 0.0,
             dtype: str | None = None) -> Callable[[], None]:
        """A launch computing ``out = alpha * (x @ y) + beta * out`` (NumPy matmul broadcasting)
        on the handle's stream. ``x``, ``y``, ``out``: device arrays of one dtype: float32,
        float16, or bfloat16 bits (uint16, with ``dtype="bfloat16"``). Operands whose layout has
        no cuBLAS view go through preallocated contiguous copies (a copy kernel per launch)."""
        cp = self.cp
        name = dtype or str(out.dtype)
        if name not in DATA_TYPES:
            raise BlasError(f"cuBLAS GEMM on {name}: expected float32, float16 or bfloat16")
        if not (x.dtype == y.dtype == out.dtype) or x.dtype.itemsize != (4 if name == "float32" else 2):
            raise BlasError(f"cuBLAS GEMM operands {x.dtype}, {y.dtype} -> {out.dtype} do not match {name}")
        if out.size == 0:
            return lambda: None
        if x.shape[-1] == 0:  # nothing to sum: alpha * 0 + beta * out
            if beta != 0.0:
                raise BlasError("cuBLAS GEMM with an empty inner dimension and beta != 0")
            return lambda: out.fill(0)
        pre: list[Callable[[], None]] = []
        post: list[Callable[[], None]] = []
        calls = plan_matmul(*_geom(x), *_geom(y), *_geom(out))
        if calls is None:
            x, y = _staged(cp, x, pre), _staged(cp, y, pre)
            o2 = _staged(cp, out, pre)
            if o2 is not out:
                if beta == 0.0:
                    pre.pop()  # the output's old values are not needed
                post.append(lambda dst=out, src=o2: cp.copyto(dst, src))
            calls = plan_matmul(*_geom(x), *_geom(y), *_geom(o2))
            out = o2
            if calls is None:
                raise BlasError("no cuBLAS layout even for contiguous operands")
        fn_one, fn_batch = self.lib.cublasGemmEx, self.lib.cublasGemmStridedBatchedEx
        t, isz, comp, h = DATA_TYPES[name], out.dtype.itemsize, self.compute, self.handle
        scalars = (ctypes.c_float(alpha), ctypes.c_float(beta))
        pa, pb = ctypes.addressof(scalars[0]), ctypes.addressof(scalars[1])
        px, py, po = x.data.ptr, y.data.ptr, out.data.ptr
        args = []
        keep: list[Any] = []
        merged = pointer_batch(calls) if hasattr(self.lib, "cublasGemmBatchedEx") else None
        if merged is not None:  # one launch with a device array of matrix pointers
            c, offs = merged
            table = cp.asarray([[py + a * isz for a, _, _ in offs], [px + b * isz for _, b, _ in offs],
                                [po + o * isz for _, _, o in offs]], dtype=cp.uint64)
            keep.append(table)
            pa_, pb_, pc_ = (table[i].data.ptr for i in range(3))
            args.append((self.lib.cublasGemmBatchedEx,
                         (h, c.transa, c.transb, c.m, c.n, c.k, pa, pa_, t, c.lda, pb_, t, c.ldb,
                          pb, pc_, t, c.ldc, len(offs), comp, GEMM_DEFAULT)))
            calls = []
        for c in calls:
            A, B, C = py + c.a_off * isz, px + c.b_off * isz, po + c.c_off * isz
            if c.batch == 1:
                args.append((fn_one, (h, c.transa, c.transb, c.m, c.n, c.k, pa, A, t, c.lda, B, t,
                                      c.ldb, pb, C, t, c.ldc, comp, GEMM_DEFAULT)))
            else:
                args.append((fn_batch, (h, c.transa, c.transb, c.m, c.n, c.k, pa, A, t, c.lda,
                                        c.stride_a, B, t, c.ldb, c.stride_b, pb, C, t, c.ldc,
                                        c.stride_c, c.batch, comp, GEMM_DEFAULT)))

        def run() -> None:
            for f in pre:
                f()
            for fn, a in args:
                status = fn(*a)
                if status != 0:
                    kind = {19: "Ex", 20: "BatchedEx"}.get(len(a), "StridedBatchedEx")
                    check(status, f"cublasGemm{kind} "
                                  f"(m={a[3]}, n={a[4]}, k={a[5]}, {name})")
            for f in post:
                f()

        run.keep = (x, y, out, scalars, keep)  # type: ignore[attr-defined]  # what the pointers point into
        return run

    def close(self) -> None:
        """Give the handle back (destroyed when the next ``Blas`` is made)."""
        self._final()


def _geom(a: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    isz = a.dtype.itemsize
    return tuple(int(d) for d in a.shape), tuple(int(s) // isz for s in a.strides)


def _staged(cp: Any, a: Any, pre: list[Callable[[], None]]) -> Any:
    """``a`` itself if C-contiguous, else a preallocated copy refreshed by a launch in ``pre``."""
    if a.flags.c_contiguous:
        return a
    tmp = cp.empty(a.shape, dtype=a.dtype)
    pre.append(lambda: cp.copyto(tmp, a))
    return tmp
