"""The executor's cuBLAS call planning without a GPU: ``plan_matmul``'s calls, run by a NumPy model
of column-major ``cublasGemmStridedBatchedEx`` on flat buffers, give ``numpy.matmul`` for
row-major, transposed, sliced, batched, broadcast and 1-D operands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from tunedb.runtime import selfcheck
from tunedb.runtime.blas import OP_N, OP_T, GemmCall, as_transposed, plan_matmul, pointer_batch

ROOT = Path(__file__).resolve().parents[1]


def _colmajor(buf, base, rows, cols, ld):
    """The column-major ``rows x cols`` matrix at ``buf[base]`` (what cuBLAS reads), and its
    indices; cuBLAS refuses ``ld < max(1, rows)``."""
    assert ld >= max(1, rows), (ld, rows)
    idx = base + np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld
    assert idx.min() >= 0 and idx.max() < buf.size, "reads outside the buffer"
    return buf[idx], idx


def _cublas(calls, xbuf, x0, ybuf, y0, obuf, o0, alpha=1.0, beta=0.0):
    """cuBLAS semantics: C = alpha op(A) op(B) + beta C per batch; A from y, B from x."""
    for c in calls:
        assert isinstance(c, GemmCall) and c.batch >= 1
        for b in range(c.batch):
            ar, ac = (c.m, c.k) if c.transa == OP_N else (c.k, c.m)
            A, _ = _colmajor(ybuf, y0 + c.a_off + b * c.stride_a, ar, ac, c.lda)
            A = A if c.transa == OP_N else A.T
            br, bc = (c.k, c.n) if c.transb == OP_N else (c.n, c.k)
            B, _ = _colmajor(xbuf, x0 + c.b_off + b * c.stride_b, br, bc, c.ldb)
            B = B if c.transb == OP_N else B.T
            C, idx = _colmajor(obuf, o0 + c.c_off + b * c.stride_c, c.m, c.n, c.ldc)
            res = alpha * (A @ B)
            obuf[idx] = res if beta == 0.0 else res + beta * C  # beta 0: C is not read


def _view(rng, shape, strides=None, start=3, pad=40):
    """A strided view into a flat buffer (random values), its buffer and start offset."""
    shape = tuple(shape)
    if strides is None:  # C-contiguous
        strides, acc = [], 1
        for d in reversed(shape):
            strides.insert(0, acc)
            acc *= max(d, 1)
    span = sum((d - 1) * abs(s) for d, s in zip(shape, strides) if d > 0)
    neg = sum((d - 1) * -s for d, s in zip(shape, strides) if s < 0 and d > 0)
    buf = rng.standard_normal(start + neg + span + 1 + pad)
    base = start + neg
    v = as_strided(buf[base:], shape=shape, strides=tuple(s * 8 for s in strides))
    return v, buf, base, tuple(strides)


def _run_case(rng, xshape, yshape, xstr=None, ystr=None, ostr=None, alpha=1.0, beta=0.0):
    x, xbuf, x0, xst = _view(rng, xshape, xstr)
    y, ybuf, y0, yst = _view(rng, yshape, ystr)
    want_shape = np.matmul(x, y).shape
    o, obuf, o0, ost = _view(rng, want_shape, ostr, start=5)
    old = o.copy()
    before = obuf.copy()
    calls = plan_matmul(x.shape, xst, y.shape, yst, o.shape, ost)
    if calls is None:
        return None
    _cublas(calls, xbuf, x0, ybuf, y0, obuf, o0, alpha, beta)
    np.testing.assert_allclose(o, alpha * np.matmul(x, y) + beta * old, rtol=1e-12, atol=1e-12)
    inside = np.zeros(obuf.size, bool)
    inside[o0 + sum(np.indices(o.shape)[i] * ost[i] for i in range(o.ndim)).ravel()
           if o.ndim else o0] = True
    assert np.array_equal(obuf[~inside], before[~inside]), "wrote outside the output"
    return calls


CASES = [  # x shape, y shape, x strides, y strides (None: C-contiguous)
    ((5, 7), (7, 3), None, None),
    ((1, 7), (7, 1), None, None),
    ((5, 7), (7, 3), (1, 5), None),             # x a transposed view (gemm trans_a)
    ((5, 7), (7, 3), None, (1, 7)),             # y a transposed view (gemm trans_b)
    ((5, 7), (7, 3), (1, 5), (1, 7)),
    ((5, 7), (7, 3), (11, 1), (4, 1)),          # sliced rows: row stride > columns
    ((2, 3, 4, 6), (2, 3, 6, 5), None, None),   # attention-like batch
    ((2, 8, 6), (6, 4), None, None),            # linear layer: folded into one GEMM
    ((3, 1, 6), (6, 4), None, None),            # M == 1 per batch, folded
    ((6, 4), (3, 4, 5), None, None),            # left operand broadcast over the batch
    ((2, 4, 12), (3, 2, 12, 20), None, None),   # grouped conv: weights over (n, g)
    ((4, 6), (2, 6, 9), None, None),            # 1x1 conv: weights over n
    ((2, 1, 4, 6), (1, 3, 6, 5), None, None),   # both broadcast
    ((7,), (7, 3), None, None),                 # 1-D left
    ((5, 7), (7,), None, None),                 # 1-D right
    ((7,), (7,), None, None),                   # dot
    ((2, 5, 7), (7,), None, None),
    ((7,), (2, 7, 3), (2,), None),              # strided 1-D left
    ((2, 3, 4, 6), (2, 3, 6, 5), (72, 24, 1, 4), None),  # batched transposed x
    ((2, 4, 6), (2, 6, 5), (6, 12, 1), None),   # batch stride smaller than the matrix: looped
]


@pytest.mark.parametrize("xs,ys,xst,yst", CASES)
def test_planned_calls_compute_matmul(xs, ys, xst, yst):
    rng = np.random.default_rng(len(xs) * 10 + len(ys))
    calls = _run_case(rng, xs, ys, xst, yst)
    assert calls is not None, "these layouts need no copy"
    assert calls  # something to do


def test_alpha_beta_and_a_strided_output():
    rng = np.random.default_rng(3)
    _run_case(rng, (4, 6), (6, 5), alpha=0.5, beta=2.0)
    _run_case(rng, (3, 4, 6), (6, 5), ostr=(40, 8, 1), alpha=1.5, beta=-1.0)  # padded output rows
    _run_case(rng, (2, 3, 4, 6), (2, 3, 6, 5), beta=1.0)


def test_fold_and_batch_choices():
    rng = np.random.default_rng(4)
    fold = _run_case(rng, (2, 8, 6), (6, 4))
    assert len(fold) == 1 and fold[0].batch == 1 and fold[0].n == 16  # one GEMM, 16 rows
    batched = _run_case(rng, (2, 3, 4, 6), (2, 3, 6, 5))
    assert len(batched) == 1 and batched[0].batch == 6  # (2, 3) batch dims merged
    conv = _run_case(rng, (2, 4, 12), (3, 2, 12, 20))
    assert len(conv) == 3 and {c.batch for c in conv} == {2} and {c.stride_b for c in conv} == {48}
    one = _run_case(rng, (5, 7), (7, 3))
    assert one == [GemmCall(OP_N, OP_N, 3, 5, 7, 0, 3, 0, 0, 7, 0, 0, 3, 0, 1)]


def test_layouts_without_a_cublas_view_ask_for_a_copy():
    rng = np.random.default_rng(5)
    # neither unit row nor unit column stride
    assert _run_case(rng, (4, 6), (6, 5), xstr=(12, 2)) is None
    # a reversed axis
    assert _run_case(rng, (4, 6), (6, 5), ystr=(-5, 1)) is None
    # a column-major output cannot be cuBLAS's C^T
    assert _run_case(rng, (4, 6), (6, 5), ostr=(1, 4)) is None
    # empty output: nothing to do
    assert plan_matmul((0, 6), (6, 1), (6, 5), (5, 1), (0, 5), (5, 1)) == []
    with pytest.raises(ValueError, match="cannot matmul"):
        plan_matmul((4, 6), (6, 1), (5, 5), (5, 1), (4, 5), (5, 1))
    with pytest.raises(ValueError, match="empty inner"):
        plan_matmul((4, 0), (1, 1), (0, 5), (5, 1), (4, 5), (5, 1))


def test_as_transposed():
    assert as_transposed(4, 6, 6, 1) == (OP_N, 6)
    assert as_transposed(4, 6, 1, 4) == (OP_T, 4)
    assert as_transposed(4, 6, 2, 8) is None
    assert as_transposed(1, 6, 99, 1) == (OP_N, 6)
    assert as_transposed(4, 1, 3, 99) == (OP_N, 3)
    assert as_transposed(1, 6, 0, 2) == (OP_T, 2)


def test_blas_module_imports_without_cupy():
    code = "import sys, tunedb.runtime.blas, tunedb.runtime.selfcheck; assert 'cupy' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("spec", selfcheck.CASES, ids=[c[0] for c in selfcheck.CASES])
def test_selfcheck_cases_are_valid_matmuls(spec):
    """The GPU self-check's operands, built on the CPU the same way: the float64 reference must
    accept them, transposed views must really be transposed, and the planned calls must compute
    the product without copies."""
    name, xs, ys, _, tx, ty, alpha, beta = spec
    rng = np.random.default_rng(0)
    x, y = selfcheck.operand(np, rng, xs, tx), selfcheck.operand(np, rng, ys, ty)
    np.matmul(x.astype(np.float64), y.astype(np.float64))  # raised for "x^T @ y^T"
    for a, trans in ((x, tx), (y, ty)):
        assert (a.ndim >= 2 and a.strides[-2] == a.itemsize) == trans, name
    xst = tuple(s // x.itemsize for s in x.strides)
    yst = tuple(s // y.itemsize for s in y.strides)
    calls = _run_case(rng, x.shape, y.shape, xst, yst, alpha=alpha, beta=beta)
    assert calls, name
    if tx or ty:  # the transposed views are read in place, with op T
        assert {c.transb for c in calls} == {OP_T if tx else OP_N}
        assert {c.transa for c in calls} == {OP_T if ty else OP_N}


def _cublas_pointers(call, offs, xbuf, x0, ybuf, y0, obuf, o0):
    """cublasGemmBatchedEx semantics: one matrix product per (a, b, c) offset triple."""
    for a, b, c in offs:
        one = GemmCall(call.transa, call.transb, call.m, call.n, call.k, a, call.lda, 0, b,
                       call.ldb, 0, c, call.ldc, 0, 1)
        _cublas([one], xbuf, x0, ybuf, y0, obuf, o0)


def test_attention_heads_read_in_place_become_one_pointer_batched_call():
    # q, k as heads of [B, S, H, D] read as [B, H, S, D] and [B, H, D, S]: the (B, H) batch has
    # no single stride, so the planner loops over B; the loop merges into one pointer batch
    B, S, H, D = 2, 5, 3, 4
    rng = np.random.default_rng(11)
    q, qbuf, q0, qst = _view(rng, (B, H, S, D), (S * H * D, D, H * D, 1))
    k, kbuf, k0, kst = _view(rng, (B, H, D, S), (S * H * D, D, 1, H * D))
    o, obuf, o0, ost = _view(rng, (B, H, S, S), start=5)
    calls = plan_matmul(q.shape, qst, k.shape, kst, o.shape, ost)
    assert calls is not None and len(calls) == B
    call, offs = pointer_batch(calls)
    assert len(offs) == B * H
    _cublas_pointers(call, offs, qbuf, q0, kbuf, k0, obuf, o0)
    np.testing.assert_allclose(o, q @ k, rtol=1e-12, atol=1e-12)


def test_pointer_batch_only_merges_uniform_calls():
    rng = np.random.default_rng(12)
    assert pointer_batch(_run_case(rng, (2, 3, 4, 6), (2, 3, 6, 5))) is None  # one call already
    a = GemmCall(OP_N, OP_N, 3, 5, 7, 0, 3, 21, 0, 7, 35, 0, 3, 15, 2)
    b = GemmCall(OP_N, OP_N, 3, 5, 7, 100, 3, 21, 200, 7, 35, 300, 3, 15, 2)
    call, offs = pointer_batch([a, b])
    assert call == a and offs == [(0, 0, 0), (21, 35, 15), (100, 200, 300), (121, 235, 315)]
    assert pointer_batch([a, GemmCall(OP_T, OP_N, 3, 5, 7, 100, 7, 21, 200, 7, 35, 300, 3, 15, 2)]) is None


# -- cuBLASLt's bias epilogue (tunedb.runtime.executor_lt) ---------------------------------------
def _cuda_roots():
    """Where CUDA headers and libraries may be: $CUDA_HOME, the usual install, pip's nvidia wheels."""
    import os

    roots = [Path(os.environ["CUDA_HOME"])] if os.environ.get("CUDA_HOME") else []
    roots.append(Path("/usr/local/cuda"))
    for p in sys.path:
        roots += sorted(Path(p).glob("nvidia/*")) if p and Path(p, "nvidia").is_dir() else []
    return [r for r in roots if r.is_dir()]


@pytest.mark.parametrize("trans_b,pad", [(False, 0), (True, 0), (False, 3), (True, 5)])
def test_bias_gemm_call_computes_x_w_plus_bias(trans_b, pad):
    from tunedb.runtime.executor_lt import plan_bias_gemm

    rng = np.random.default_rng(4 + pad)
    M, K, N = 6, 5, 7
    x, xbuf, x0, xst = _view(rng, (M, K), (K + pad, 1))
    w, wbuf, w0, wst = _view(rng, (N, K) if trans_b else (K, N), ((K if trans_b else N) + pad, 1))
    o, obuf, o0, ost = _view(rng, (M, N), (N + pad, 1), start=5)
    bias = rng.standard_normal(N)
    c = plan_bias_gemm(x.shape, xst, w.shape, wst, o.shape, ost, trans_b)
    assert c is not None and c.m == N and c.n == M and c.k == K
    before = obuf.copy()
    A, _ = _colmajor(wbuf, w0, c.a_rows, c.a_cols, c.lda)
    A = A if c.transa == OP_N else A.T
    B, _ = _colmajor(xbuf, x0, c.k, c.n, c.ldb)
    _, idx = _colmajor(obuf, o0, c.m, c.n, c.ldd)
    obuf[idx] = A @ B + bias[:, None]  # cuBLASLt: the bias along D's rows
    np.testing.assert_allclose(o, x @ (w.T if trans_b else w) + bias, rtol=1e-12, atol=1e-12)
    inside = np.zeros(obuf.size, bool)
    inside[idx.ravel()] = True
    assert np.array_equal(obuf[~inside], before[~inside])
    assert plan_bias_gemm(x.shape, (1, M), w.shape, wst, o.shape, ost, trans_b) is None  # x transposed


def test_cublaslt_enums_and_result_struct_match_the_header(tmp_path):
    import ctypes
    import shutil

    from tunedb.runtime import executor_lt as lt

    roots = _cuda_roots()
    heads = [r / "include" for r in roots if (r / "include" / "cublasLt.h").is_file()]
    cxx = shutil.which("c++") or shutil.which("g++")
    if not heads or cxx is None:
        pytest.skip("no cublasLt.h (set CUDA_HOME) or no C++ compiler")
    checks = {"CUBLASLT_MATMUL_DESC_TRANSA": lt.DESC_TRANSA, "CUBLASLT_MATMUL_DESC_TRANSB": lt.DESC_TRANSB,
              "CUBLASLT_MATMUL_DESC_EPILOGUE": lt.DESC_EPILOGUE,
              "CUBLASLT_MATMUL_DESC_BIAS_POINTER": lt.DESC_BIAS_POINTER,
              "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE": lt.DESC_BIAS_DATA_TYPE,
              "CUBLASLT_EPILOGUE_DEFAULT": lt.EPILOGUE_DEFAULT, "CUBLASLT_EPILOGUE_BIAS": lt.EPILOGUE_BIAS,
              "CUBLASLT_EPILOGUE_GELU_BIAS": lt.EPILOGUE_GELU_BIAS,
              "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES": lt.PREF_MAX_WORKSPACE_BYTES,
              "CUBLAS_COMPUTE_32F": lt.COMPUTE_32F, "CUDA_R_32F": lt.CUDA_R_32F, "CUDA_R_16BF": 14,
              "CUBLAS_OP_N": OP_N, "CUBLAS_OP_T": OP_T}
    H = lt.HeuristicResult
    src = ["#include <cstddef>", "#include <cublasLt.h>"]
    src += [f'static_assert({k} == {v}, "{k}");' for k, v in checks.items()]
    src += [f"static_assert(sizeof(cublasLtMatmulHeuristicResult_t) == {ctypes.sizeof(H)}, \"size\");"]
    for f in ("algo", "workspaceSize", "state", "wavesCount"):
        src.append(f"static_assert(offsetof(cublasLtMatmulHeuristicResult_t, {f}) == {getattr(H, f).offset}, "
                   f"\"{f}\");")
    (tmp_path / "check.cpp").write_text("\n".join(src) + "\nint main() { return 0; }\n")
    includes = [f"-I{h}" for r in roots for h in (r / "include",) if h.is_dir()]
    done = subprocess.run([cxx, "-fsyntax-only", *includes, str(tmp_path / "check.cpp")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_cublaslt_descriptors_hold_the_bias_epilogue():
    import ctypes

    from tunedb.runtime import executor_lt as lt

    libs = [p for r in _cuda_roots() for d in ("lib", "lib64")
            for p in sorted((r / d).glob("libcublasLt.so*"))]
    if not libs:
        pytest.skip("no libcublasLt (set CUDA_HOME)")
    lib = lt.lt_library(str(libs[0]))
    call = lt.plan_bias_gemm((128, 768), (768, 1), (768, 2304), (2304, 1), (128, 2304), (2304, 1), False)
    d = lt.Descriptors(lib, call, "bfloat16", 0xABC000)
    assert d.get(lt.DESC_EPILOGUE, ctypes.c_uint32) == lt.EPILOGUE_BIAS
    assert d.get(lt.DESC_BIAS_POINTER, ctypes.c_void_p) == 0xABC000
    assert d.get(lt.DESC_BIAS_DATA_TYPE, ctypes.c_int32) == 14
    assert d.get(lt.DESC_TRANSA, ctypes.c_int32) == OP_N
    with pytest.raises(lt.LtError, match="float32, float16 or bfloat16"):
        lt.Descriptors(lib, call, "float64", 0)
