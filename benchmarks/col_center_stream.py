"""Exploration: col_center (y = x - mean(x, 0), fp32 8192x4096) reading x from DRAM once.

    python benchmarks/col_center_stream.py OUT_DIR     (on a GPU; writes col_center_stream.json)

The generated col_center kernels read x twice (the column means precede every output), so their
floor is 1.5x the single-read one. This kernel tries to serve the second read from L2: a
persistent kernel hands out work items by ticket; A(s, r) adds rows chunk r of column strip s
into the strip's column sums (float atomics) and counts itself; B(s, r) waits until strip s is
complete and writes y for its tile, re-reading x while the strip (W columns x 8192 rows) is
still in L2. A items of strip s + LAG are handed out before the B items of strip s. The last
block to exit resets the workspace, so launches repeat. Each variant is checked against a
float64 reference (twice, the second run checks the reset) before it is timed L2-cold.

Measured on an H200 (data/bench/col_center_stream_h200.json): the best variant (W 128, H 64,
LAG 2, 4 blocks per SM) takes 107.8 us, slower than the two-read generated kernel (100.2 us) and
torch.compile (106.6 us under this harness): the strip-wide waits and the atomics cost more than
the second DRAM read saves.
"""

import json
import os
import sys

import numpy as np

from tunedb.bench.provenance import provenance

SRC = r"""
template <int W, int H, int LAG>
__device__ __forceinline__ void run(const float* __restrict__ x, float* __restrict__ y, float* sums,
    unsigned* cnt, unsigned* ctl, int R, int C, int S, int NCH) {
  constexpr int TPR = W / 4, LANES = 256 / TPR, IT = H / LANES;
  __shared__ float4 red[256];
  __shared__ unsigned item_s;
  __shared__ int last_s;
  const int g = threadIdx.x % TPR, lane = threadIdx.x / TPR;
  const unsigned total = 2u * S * NCH, first = (unsigned)LAG * NCH;
  const float invR = 1.0f / (float)R;
  for (;;) {
    if (threadIdx.x == 0) item_s = atomicAdd(&ctl[0], 1u);
    __syncthreads();
    const unsigned t = item_s;
    __syncthreads();
    if (t >= total) break;
    int isB, s, r;
    if (t < first) { isB = 0; s = t / NCH; r = t % NCH; }
    else {
      unsigned u = t - first, p = u / (2u * NCH), off = u % (2u * NCH);
      if (p < (unsigned)(S - LAG)) {
        if (off < (unsigned)NCH) { isB = 0; s = p + LAG; r = off; } else { isB = 1; s = p; r = off - NCH; }
      } else {
        unsigned u2 = u - (unsigned)(S - LAG) * 2u * NCH;
        isB = 1; s = (S - LAG) + u2 / NCH; r = u2 % NCH;
      }
    }
    const long long col = (long long)s * W + g * 4;
    const long long row0 = (long long)r * H + lane;
    if (!isB) {
      float4 v[IT];
#pragma unroll
      for (int i = 0; i < IT; ++i) v[i] = *reinterpret_cast<const float4*>(x + (row0 + i * LANES) * C + col);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int i = 0; i < IT; ++i) { a.x += v[i].x; a.y += v[i].y; a.z += v[i].z; a.w += v[i].w; }
      red[threadIdx.x] = a;
      __syncthreads();
      if (lane == 0) {
#pragma unroll
        for (int l = 1; l < LANES; ++l) {
          float4 b = red[threadIdx.x + l * TPR]; a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
        }
        atomicAdd(reinterpret_cast<float4*>(sums + col), a);
        __threadfence();
      }
      __syncthreads();
      if (threadIdx.x == 0) atomicAdd(&cnt[s], 1u);
    } else {
      if (threadIdx.x == 0) {
        unsigned c;
        for (;;) {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(cnt + s) : "memory");
          if (c >= (unsigned)NCH) break;
          __nanosleep(32);
        }
      }
      __syncthreads();
      float4 m = __ldcg(reinterpret_cast<const float4*>(sums + col));
      m.x *= invR; m.y *= invR; m.z *= invR; m.w *= invR;
      float4 v[IT];
#pragma unroll
      for (int i = 0; i < IT; ++i) v[i] = *reinterpret_cast<const float4*>(x + (row0 + i * LANES) * C + col);
#pragma unroll
      for (int i = 0; i < IT; ++i) {
        float4 o = make_float4(v[i].x - m.x, v[i].y - m.y, v[i].z - m.z, v[i].w - m.w);
        *reinterpret_cast<float4*>(y + (row0 + i * LANES) * C + col) = o;
      }
    }
  }
  // the last block out resets the workspace for the next launch
  __syncthreads();
  if (threadIdx.x == 0) { __threadfence(); last_s = atomicAdd(&ctl[1], 1u) == gridDim.x - 1; }
  __syncthreads();
  if (last_s) {
    for (int i = threadIdx.x; i < C; i += 256) sums[i] = 0.f;
    for (int i = threadIdx.x; i < S; i += 256) cnt[i] = 0u;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) { ctl[0] = 0u; ctl[1] = 0u; __threadfence(); }
  }
}
extern "C" __global__ void __launch_bounds__(256) colc(const float* __restrict__ x, float* __restrict__ y,
    float* sums, unsigned* cnt, unsigned* ctl, int R, int C, int S, int NCH) {
  run<WW, HH, LL>(x, y, sums, cnt, ctl, R, C, S, NCH);
}
"""


def _flushed_times(cp, flush, run, reps: int = 15) -> list[float]:
    """µs of ``run()`` per repetition, each after overwriting the 512 MB ``flush`` buffer (L2 cold)."""
    times = []
    for rep in range(reps):
        flush.fill(rep)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1000)
    return times


def main(out: str) -> None:
    import cupy as cp  # only here: the module imports without a GPU

    R, C = 8192, 4096
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((R, C), dtype=np.float32) + 3.0)
    ref = (cp.asnumpy(x).astype(np.float64) - cp.asnumpy(x).astype(np.float64).mean(0)).astype(np.float32)
    flush = cp.empty(512 * 1024 * 1024 // 4, dtype=cp.float32)
    y = cp.empty_like(x)
    results = []
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    for W in (128, 256, 512):
        for H in (32, 64, 128):
            for LAG in (1, 2):
                try:
                    opts = ("-std=c++17", f"-DWW={W}", f"-DHH={H}", f"-DLL={LAG}")
                    mod = cp.RawModule(code=SRC, options=opts)
                    k = mod.get_function("colc")
                except Exception as e:
                    results.append({"W": W, "H": H, "LAG": LAG, "error": str(e)[:200]})
                    continue
                S, NCH = C // W, R // H
                sums = cp.zeros(C, cp.float32)
                cnt = cp.zeros(S, cp.uint32)
                ctl = cp.zeros(2, cp.uint32)
                for bps in (2, 4, 8):
                    grid = sm * bps
                    args = (x, y, sums, cnt, ctl, np.int32(R), np.int32(C), np.int32(S), np.int32(NCH))
                    ok = True
                    for _ in range(2):  # fresh poisoned output twice: checks the self-reset too
                        y.fill(np.nan)
                        k((grid,), (256,), args)
                        cp.cuda.Device().synchronize()
                        err = float(cp.abs(y - cp.asarray(ref)).max())
                        ok = ok and err < 1e-3
                    times = _flushed_times(cp, flush, lambda k=k, g=grid, a=args: k((g,), (256,), a))
                    res = {"W": W, "H": H, "LAG": LAG, "bps": bps, "ok": ok, "err": err,
                           "us": float(np.median(times[3:])), "min": float(np.min(times[3:]))}
                    results.append(res)
                    print(res, flush=True)
    # peers under the same harness
    import torch
    xt = torch.as_tensor(x, device="cuda")
    f = torch.compile(lambda a: a - a.mean(0, keepdim=True))
    for name, fn in (("torch_eager", lambda a: a - a.mean(0, keepdim=True)), ("torch_compile", f)):
        for _ in range(3):
            fn(xt)
        times = _flushed_times(cp, flush, lambda fn=fn: fn(xt))
        results.append({"peer": name, "us": float(np.median(times[3:]))})
        print(results[-1], flush=True)
    with open(os.path.join(out, "colstream.json"), "w") as fh:  # the variants, peers and provenance
        json.dump({**provenance(), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
