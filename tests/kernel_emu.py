"""CPU emulation of generated kernels, for tests on machines without a GPU.

The generated CUDA C is plain enough to compile as C++ once the prelude is swapped for host
versions of its pieces: each block runs as ``blockDim`` host threads sharing a std::barrier
(``__syncthreads``), warps exchange values through a per-warp slot array (``__shfl_xor_sync``),
and shared memory is a per-block buffer. Slow, exact enough, and it runs the real indexing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from tunedb.kernels.prelude import PRELUDE


def generable_schedules(graph, **kw) -> list:
    """The legal schedules of ``graph`` plus the streaming twins the space leaves out for speed
    alone (large outputs): they still generate, so the checks cover their code paths."""
    from tunedb.kernels.schedule import STREAM_LARGE_OUTPUTS, schedule_space

    legal, pruned = schedule_space(graph, **kw)
    return legal + [s for s, why in pruned if why == STREAM_LARGE_OUTPUTS]


EMU_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <algorithm>
using std::min; using std::max;
struct dim3e { unsigned x = 0, y = 0, z = 0; };
static dim3e gridDim, blockDim;
static thread_local dim3e threadIdx, blockIdx;
struct EmuBlock {
  std::barrier<>* bar; std::vector<std::barrier<>*> wbar; std::vector<float> wslot; unsigned char* smem;
  std::barrier<>* cbar; std::vector<unsigned char*>* csm; unsigned rank;
};
static thread_local EmuBlock* emu_blk;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(x)
#define __align__(n) alignas(n)
#define __cluster_dims__(...)
static inline void __syncthreads() { emu_blk->bar->arrive_and_wait(); }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
  unsigned t = threadIdx.x, w = t / 32;
  emu_blk->wslot[t] = v;
  emu_blk->wbar[w]->arrive_and_wait();
  float r = emu_blk->wslot[(t ^ o)];
  emu_blk->wbar[w]->arrive_and_wait();
  return r;
}
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
#define __expf expf
#define __logf logf
static inline float __fdividef(float a, float b) { return a / b; }
template <typename T, int V> struct alignas(sizeof(T) * V) tdb_vec { T v[V]; };
template <typename T, int V> inline tdb_vec<T, V> tdb_ld(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V)) throw 1;  // misaligned vector access
  return *reinterpret_cast<const tdb_vec<T, V>*>(p);
}
template <typename T, int V> inline void tdb_st(T* p, const tdb_vec<T, V>& x) {
  if (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V)) throw 1;
  *reinterpret_cast<tdb_vec<T, V>*>(p) = x;
}
static inline float tdb_h2f(unsigned short h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
static inline unsigned short tdb_f2h(float x) {
  _Float16 f = (_Float16)x; unsigned short h; std::memcpy(&h, &f, 2); return h;
}
static inline float tdb_bf2f(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
static inline unsigned short tdb_f2bf(float f) {
  unsigned u; std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float tdb_sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
static inline float tdb_sigmoid_fast(float x) { return tdb_sigmoid(x); }
static inline float tdb_tanh_fast(float x) { return 1.0f - 2.0f / (expf(2.0f * x) + 1.0f); }
static inline float tdb_fmod_floor(float a, float b) {
  float r = std::fmod(a, b); return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r;
}
static inline long long tdb_imod(long long a, long long b) {
  if (b == 0) return 0; long long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
static inline long long tdb_idiv(long long a, long long b) { return b == 0 ? 0 : a / b; }
#define TDB_INF __int_as_float(0x7f800000)
#define TDB_WRED(NAME, EXPR) \
  template <int W> inline float NAME(float a) { \
    for (int o = W / 2; o > 0; o >>= 1) { float b = __shfl_xor_sync(0xffffffffu, a, o); a = (EXPR); } \
    return a; }
TDB_WRED(tdb_wsum, a + b)
TDB_WRED(tdb_wprod, a * b)
TDB_WRED(tdb_wmax, std::fmax(a, b))
TDB_WRED(tdb_wmin, std::fmin(a, b))
static int emu_run(unsigned gx, unsigned gy, unsigned gz, unsigned bx, int smem, unsigned cs,
                   const std::function<void()>& fn) {
  gridDim = {gx, gy, gz}; blockDim = {bx, 1, 1};
  int err = 0;
  for (unsigned z = 0; z < gz; ++z)
  for (unsigned y = 0; y < gy; ++y)
  for (unsigned x0 = 0; x0 < gx; x0 += cs) {
    std::barrier<> cbar(bx * cs);
    std::vector<EmuBlock> blks(cs);
    std::vector<std::vector<unsigned char>> sms(cs);
    std::vector<unsigned char*> smp(cs);
    std::vector<std::barrier<>*> all;
    for (unsigned q = 0; q < cs; ++q) {
      auto* bar = new std::barrier<>(bx); all.push_back(bar);
      blks[q].bar = bar; blks[q].wslot.assign(bx, 0.0f);
      for (unsigned w = 0; w < (bx + 31) / 32; ++w) {
        auto* b = new std::barrier<>(std::min(32u, bx - 32 * w)); all.push_back(b); blks[q].wbar.push_back(b);
      }
      sms[q].assign(smem + 16, 0xff);  // garbage, like real shared memory
      blks[q].smem = smp[q] = sms[q].data();
      blks[q].cbar = &cbar; blks[q].csm = &smp; blks[q].rank = q;
    }
    std::vector<std::thread> ts;
    std::vector<int> errs(bx * cs, 0);
    for (unsigned q = 0; q < cs; ++q)
      for (unsigned t = 0; t < bx; ++t)
        ts.emplace_back([&, q, t] {
          threadIdx = {t, 0, 0}; blockIdx = {x0 + q, y, z}; emu_blk = &blks[q];
          try { fn(); } catch (...) { errs[q * bx + t] = 1; }
        });
    for (auto& th : ts) th.join();
    for (auto* p : all) delete p;
    for (int e : errs) err |= e;
  }
  return err;
}
static inline unsigned tdb_crank() { return emu_blk->rank; }
static inline void tdb_csync() { emu_blk->cbar->arrive_and_wait(); }
static inline float tdb_dsmem_ld(const float* p, unsigned rank) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
  float v; std::memcpy(&v, (*emu_blk->csm)[rank] + (b - emu_blk->smem), 4); return v;
}
"""

_SIG = re.compile(r'extern "C" __global__ void (?:__cluster_dims__\((\d+), 1, 1\) )?'
                  r'__launch_bounds__\(\d+\) (\w+)\(\n(.*?)\)', re.S)


def _wrap(source: str) -> str:
    """Host C++ of one kernel source plus an ``emu_<name>`` launcher taking void* args."""
    assert source.startswith(PRELUDE)
    body = source[len(PRELUDE):]
    body = body.replace("extern __shared__ __align__(16) unsigned char tdb_smem[];",
                        "unsigned char* tdb_smem = emu_blk->smem;")
    body = body.replace("__device__ __align__(16) const", "alignas(16) static const")
    out = [body]
    for m in _SIG.finditer(body):
        cs, name, params = int(m.group(1) or 1), m.group(2), [p.strip() for p in m.group(3).split(",\n")]
        args = []
        for i, p in enumerate(params):
            typ = p.rsplit(" ", 1)[0].replace(" __restrict__", "")
            args.append(f"*(long long*)a[{i}]" if typ == "long long" else f"({typ})a[{i}]")
        out.append(f'extern "C" int emu_{name}(void** a, unsigned gx, unsigned gy, unsigned gz, '
                   f"unsigned bx, int smem) {{\n  return emu_run(gx, gy, gz, bx, smem, {cs}, [&] {{ "
                   f"{name}({', '.join(args)}); }});\n}}")
    return "\n".join(out)


def build(sources: list[str], workdir: str | None = None) -> ctypes.CDLL:
    """Compile kernel sources (each with the prelude) into one host shared library."""
    text = EMU_PRELUDE + "\n".join(_wrap(s) for s in dict.fromkeys(sources))
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    d = Path(workdir or tempfile.gettempdir()) / "tdb_emu"
    d.mkdir(exist_ok=True)
    so = d / f"{key}.so"
    if not so.exists():
        src = d / f"{key}.cpp"
        src.write_text(text)
        tmp = d / f"{key}.{os.getpid()}.so"
        # -fno-tree-sra: g++ 12 crashes (ICE) in SRA on some fully unrolled kernels
        subprocess.run([shutil.which("g++") or "g++", "-std=c++20", "-O1", "-fno-tree-sra", "-shared",
                        "-fPIC", "-w",
                        "-o", str(tmp), str(src), "-lpthread"], check=True, capture_output=True, text=True)
        os.replace(tmp, so)
    return ctypes.CDLL(str(so))


def run_plan(lib: ctypes.CDLL, plan, bufs: dict[str, np.ndarray]) -> None:
    """Launch every kernel of ``plan`` on host buffers (name -> contiguous array)."""
    scratch = {n: np.full(nb // 4 + 1, np.nan, np.float32) for n, nb in plan.scratch}
    for k in plan.kernels:
        keep = []
        ptrs = (ctypes.c_void_p * len(k.args))()
        for i, a in enumerate(k.args):
            if not isinstance(a, str):
                v = ctypes.c_longlong(int(a))
                keep.append(v)
                ptrs[i] = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
            else:
                arr = scratch[a] if a in scratch else bufs[a]
                ptrs[i] = arr.ctypes.data
        fn = getattr(lib, f"emu_{k.name}")
        fn.restype = ctypes.c_int
        gx, gy, gz = k.grid
        err = fn(ptrs, gx, gy, gz, k.block[0], k.shared_bytes)
        if err:
            raise RuntimeError(f"kernel {k.name} made a misaligned vector access")


# --- inputs and checking against the float64 reference ------------------------------------------

TOL = {"float32": 2e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def bf16_round(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(raw uint16 bits, float32 value) of ``a`` rounded to bfloat16 (nearest even)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return r, (r.astype(np.uint32) << 16).view(np.float32)


def make_inputs(graph, C: int, seed: int = 0, masks: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Device-layout and reference inputs: normal floats (positive for names starting with
    'rstd'), gather indices in [0, C), bool masks; integer inputs named 'mask*' or listed in
    ``masks`` are 0/1 attention masks (mostly 1, as padding masks are)."""
    rng = np.random.default_rng(seed)
    dev, ref = {}, {}
    for v in graph.inputs:
        t = graph.type_of(v)
        if t.dtype in ("int32", "int64") and (v.startswith("mask") or v in masks):
            a = (rng.random(t.shape) < 0.7).astype(t.dtype)
            dev[v], ref[v] = a, a
        elif t.dtype in ("int32", "int64"):
            a = rng.integers(0, C, size=t.shape).astype(t.dtype)
            dev[v], ref[v] = a, a
        elif t.dtype == "bool":
            a = rng.random(t.shape) < 0.7
            dev[v], ref[v] = a.astype(np.uint8), a
        else:
            x = rng.standard_normal(t.shape).astype(np.float32)
            if v.startswith("rstd"):
                x = np.abs(x) + 0.5
            if t.dtype == "float32":
                dev[v], ref[v] = x, x
            elif t.dtype == "float16":
                h = x.astype(np.float16)
                dev[v], ref[v] = h, h
            else:
                dev[v], ref[v] = bf16_round(x)
    return dev, ref


def poisoned_output(t) -> np.ndarray:
    if t.dtype == "float32":
        return np.full(t.shape, np.nan, np.float32)
    if t.dtype == "float16":
        return np.full(t.shape, np.nan, np.float16)
    if t.dtype == "bfloat16":
        return np.full(t.shape, 0x7FC0, np.uint16)
    return np.full(t.shape, 0x55, {"bool": np.uint8, "int64": np.int64, "int32": np.int32}[t.dtype])


def as_f64(a: np.ndarray, t) -> np.ndarray:
    if t.dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def max_error(graph, bufs: dict, want: dict) -> tuple[str, float]:
    """The worst output and its error |got - want| / (|want| + 1) relative to its tolerance (>1 fails)."""
    worst = ("", 0.0)
    for v in graph.outputs:
        t = graph.type_of(v)
        got = as_f64(bufs[v], t)
        if not np.all(np.isfinite(got)):
            return v, float("inf")
        err = float(np.max(np.abs(got - want[v]) / (np.abs(want[v]) + 1.0))) / TOL.get(t.dtype, 1e-12)
        if err > worst[1]:
            worst = (v, err)
    return worst


def mismatches(lib: ctypes.CDLL, jobs, masks: tuple[str, ...] = ()) -> list[str]:
    """Run each (graph, schedule, plan) of ``jobs`` from ``lib`` into poisoned outputs, on inputs
    drawn once per graph; one line per output off by more than its tolerance."""
    from tunedb.graph.reference import run_reference
    from tunedb.kernels import analyze

    failures = []
    refs: dict[str, tuple] = {}
    for g, s, plan in jobs:
        if g.name not in refs:
            dev, ref = make_inputs(g, analyze(g).C, masks=masks)
            refs[g.name] = (dev, run_reference(g, ref))
        dev, want = refs[g.name]
        bufs = dict(dev)
        bufs.update({v: poisoned_output(g.type_of(v)) for v in g.outputs})
        run_plan(lib, plan, bufs)
        v, err = max_error(g, bufs, want)
        if err > 1.0:
            failures.append(f"{g.name} {s.label()}: output {v} off by {err:.3g}x tolerance")
    return failures
