"""CUDA C of the executor's own kernels (not generated per plan): im2col for float32 and 16-bit
bits (per-sample or batch-merged row order), depthwise convolutions in float32 and bfloat16, a
bfloat16 bias add, window pools.
Compiled once per process by ``executor_ops.KernelSet``; the tests also compile it as host C++.
"""

from __future__ import annotations

_IM2COL = r"""
extern "C" __global__ void tdbx_im2col@O@_@N@(const @T@* __restrict__ x, @T@* __restrict__ cols,
    long long total, long long C, long long H, long long W, long long OH, long long OW,
    long long KH, long long KW, long long SH, long long SW, long long PT, long long PL,
    long long DH, long long DW) {
  // Row r of cols holds the OH*OW output positions of one (n, c, kh, kw): cols[n, c, kh, kw, oh, ow]
  // = x[n, c, oh*SH - PT + kh*DH, ow*SW - PL + kw*DW] (0 outside), viewed as [N, G, C/G*KH*KW, P],
  // one batched GEMM per group; the _cnhw kernels order the rows (c, kh, kw, n): [C*KH*KW, N*P],
  // one GEMM for the whole batch. A block per row: the row's 64-bit index arithmetic once, one
  // 32-bit division per element (per-element 64-bit div/mod made im2col compute-bound).
  const long long P = OH * OW, rows = total / P;
  const int ow_n = (int)OW, sh = (int)SH, sw = (int)SW;
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    long long t = r, n, c, kh, kw;
    @DECODE@
    const @T@* xp = x + (n * C + c) * H * W;
    @T@* out = cols + r * P;
    const int h0 = (int)(kh * DH - PT), w0 = (int)(kw * DW - PL);
    for (int p = threadIdx.x; p < (int)P; p += blockDim.x) {
      const int oh = p / ow_n, ow = p - oh * ow_n;
      const int ih = oh * sh + h0, iw = ow * sw + w0;
      out[p] = (ih >= 0 && ih < H && iw >= 0 && iw < W) ? xp[(long long)ih * W + iw] : (@T@)0;
    }
  }
}

"""
_IM2COL_TILED = r"""
extern "C" __global__ void tdbx_im2col_tiled@O@_@N@(const @T@* __restrict__ x, @T@* __restrict__ cols,
    long long N, long long C, long long H, long long W, long long OH, long long OW, long long KH,
    long long KW, long long SH, long long SW, long long PT, long long PL, long long DH, long long DW) {
  // The rows of tdbx_im2col@O@_@N@ from a 3-D grid: x = kernel position, y = channels (blockDim.z
  // of them), z = samples (grid-stride); threads over (ow, oh) with blockDim.x = OW where it fits,
  // so a warp writes contiguous pixels. No division per element (one per thread).
  const int kh = blockIdx.x / (int)KW, kw = blockIdx.x - kh * (int)KW;
  const int h0 = kh * (int)DH - (int)PT, w0 = kw * (int)DW - (int)PL;
  const long long c = (long long)blockIdx.y * blockDim.z + threadIdx.z, P = OH * OW;
  if (c >= C) return;
  for (long long n = blockIdx.z; n < N; n += gridDim.z) {
    const @T@* xp = x + (n * C + c) * H * W;
    @T@* out = cols + (@ROW@) * P;
    for (int ow = threadIdx.x; ow < (int)OW; ow += blockDim.x) {
      const int iw = ow * (int)SW + w0;
      const bool inside = iw >= 0 && iw < (int)W;
      for (int oh = threadIdx.y; oh < (int)OH; oh += blockDim.y) {
        const int ih = oh * (int)SH + h0;
        out[oh * (int)OW + ow] = (inside && ih >= 0 && ih < (int)H) ? xp[(long long)ih * W + iw] : (@T@)0;
      }
    }
  }
}

"""
_TILED_ROW = {  # kernel-name suffix -> the row of (n, c, kh, kw) in cols
    "": "((n * C + c) * KH + kh) * KW + kw",
    "_cnhw": "((c * KH + kh) * KW + kw) * N + n",
}
# Compiled as a module of its own: the host-C++ harnesses of KERNEL_SOURCE emulate 1-D grids only.
IM2COL_TILED_SOURCE = "".join(
    _IM2COL_TILED.replace("@T@", t).replace("@N@", n).replace("@O@", o).replace("@ROW@", r)
    for t, n in (("float", "f32"), ("unsigned short", "u16")) for o, r in _TILED_ROW.items())

_ROW_ORDER = {  # kernel-name suffix -> how a row index splits into (n, c, kh, kw)
    "": "kw = t % KW; t /= KW; kh = t % KH; t /= KH; c = t % C; n = t / C;",
    "_cnhw": "const long long N = rows / (C * KH * KW); n = t % N; t /= N; "
             "kw = t % KW; t /= KW; kh = t % KH; c = t / KH;",
}

_BF16 = r"""
// bfloat16 as its uint16 bits: widened by a shift, rounded to nearest even (NaN -> 0x7FC0, as
// executor_ops.to_bf16_bits). Unions, not intrinsics: the tests compile this as host C++ too.
#define TDBX_BF16_LOAD(bits, out) { union { unsigned int u; float f; } t_; \
  t_.u = ((unsigned int)(bits)) << 16; out = t_.f; }
#define TDBX_BF16_STORE(value, dst) { union { float f; unsigned int u; } t_; t_.f = (value); \
  unsigned int u_ = t_.u; \
  dst = (unsigned short)((u_ & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u \
                         : (u_ + 0x7fffu + ((u_ >> 16) & 1u)) >> 16); }

extern "C" __global__ void tdbx_dwconv2d_bf16(const unsigned short* __restrict__ x,
    const unsigned short* __restrict__ w, const unsigned short* __restrict__ b,
    unsigned short* __restrict__ y, long long total, long long C, long long H, long long W,
    long long OH, long long OW, long long KH, long long KW, long long SH, long long SW,
    long long PT, long long PL, long long DH, long long DW, long long has_bias) {
  // tdbx_dwconv2d_f32 on bfloat16 bits: float accumulation, one rounding per output.
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    long long ow = i % OW, t = i / OW;
    long long oh = t % OH, nc = t / OH;
    const unsigned short* xp = x + nc * H * W;
    const unsigned short* wp = w + (nc % C) * KH * KW;
    float acc = 0.0f, xv, wv;
    if (has_bias) TDBX_BF16_LOAD(b[nc % C], acc);
    for (long long kh = 0; kh < KH; ++kh) {
      long long ih = oh * SH - PT + kh * DH;
      if (ih < 0 || ih >= H) continue;
      for (long long kw = 0; kw < KW; ++kw) {
        long long iw = ow * SW - PL + kw * DW;
        if (iw < 0 || iw >= W) continue;
        TDBX_BF16_LOAD(xp[ih * W + iw], xv);
        TDBX_BF16_LOAD(wp[kh * KW + kw], wv);
        acc += xv * wv;
      }
    }
    TDBX_BF16_STORE(acc, y[i]);
  }
}

extern "C" __global__ void tdbx_bias_nchw_bf16(unsigned short* __restrict__ y,
    const unsigned short* __restrict__ b, long long total, long long C, long long HW) {
  // y[n, c, :] += b[c] on bfloat16 bits (a convolution's bias after its GEMM).
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    float yv, bv;
    TDBX_BF16_LOAD(y[i], yv);
    TDBX_BF16_LOAD(b[(i / HW) % C], bv);
    TDBX_BF16_STORE(yv + bv, y[i]);
  }
}
"""

_POOL = r"""
extern "C" __global__ void tdbx_pool2d_@N@(const @T@* __restrict__ x, @T@* __restrict__ y,
    long long total, long long H, long long W, long long OH, long long OW, long long KH,
    long long KW, long long SH, long long SW, long long PT, long long PL, long long PB,
    long long PR, long long DH, long long DW, long long mode) {
  // mode 0: max (padding never wins; NaN sticks), 1: average over the real elements,
  // 2: average counting the declared padding too (never a ceil-mode overhang).
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    long long ow = i % OW, t = i / OW;
    long long oh = t % OH, nc = t / OH;
    const @T@* xp = x + nc * H * W;
    @T@ acc = mode == 0 ? @NEGINF@ : (@T@)0;
    long long cnt = 0;
    for (long long kh = 0; kh < KH; ++kh) {
      long long ih = oh * SH - PT + kh * DH;
      for (long long kw = 0; kw < KW; ++kw) {
        long long iw = ow * SW - PL + kw * DW;
        bool inside = ih >= 0 && ih < H && iw >= 0 && iw < W;
        if (inside) {
          @T@ v = xp[ih * W + iw];
          if (mode == 0) { if (v > acc || v != v) acc = v; } else { acc += v; }
        }
        if (mode == 1 ? inside : (ih >= -PT && ih < H + PB && iw >= -PL && iw < W + PR)) ++cnt;
      }
    }
    y[i] = mode == 0 ? acc : acc / (@T@)(cnt > 0 ? cnt : 1);
  }
}
"""

KERNEL_SOURCE = r"""
extern "C" __global__ void tdbx_dwconv2d_f32(const float* __restrict__ x, const float* __restrict__ w,
    const float* __restrict__ b, float* __restrict__ y, long long total, long long C, long long H,
    long long W, long long OH, long long OW, long long KH, long long KW, long long SH, long long SW,
    long long PT, long long PL, long long DH, long long DW, long long has_bias) {
  // Depthwise convolution (groups = in = out channels), bias included: one output per thread.
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    long long ow = i % OW, t = i / OW;
    long long oh = t % OH, nc = t / OH;
    const float* xp = x + nc * H * W;
    const float* wp = w + (nc % C) * KH * KW;
    float acc = has_bias ? b[nc % C] : 0.0f;
    for (long long kh = 0; kh < KH; ++kh) {
      long long ih = oh * SH - PT + kh * DH;
      if (ih < 0 || ih >= H) continue;
      for (long long kw = 0; kw < KW; ++kw) {
        long long iw = ow * SW - PL + kw * DW;
        if (iw >= 0 && iw < W) acc += xp[ih * W + iw] * wp[kh * KW + kw];
      }
    }
    y[i] = acc;
  }
}
""" + _BF16 + "".join(_POOL.replace("@T@", t).replace("@N@", n).replace("@NEGINF@", inf) for t, n, inf in (
    ("float", "f32", "-__int_as_float(0x7f800000)"),
    ("double", "f64", "-__longlong_as_double(0x7ff0000000000000LL)"))) + "".join(
    _IM2COL.replace("@T@", t).replace("@N@", n).replace("@O@", o).replace("@DECODE@", d)
    for t, n in (("float", "f32"), ("unsigned short", "u16")) for o, d in _ROW_ORDER.items())
