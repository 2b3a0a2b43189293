"""The CPU emulator: generated kernels verified without a GPU, as the device ``emu``.

The generated CUDA C is plain enough to compile as C++ once the prelude is swapped for host
versions of its pieces: each block runs as ``blockDim`` host threads sharing a std::barrier
(``__syncthreads``), warps exchange values through a per-warp slot array (``__shfl_xor_sync``),
and shared memory is a per-block buffer. Slow, exact enough, and it runs the real indexing.

``EmuDevice`` (``open_device("emu")``, ``--device emu``) takes the measurement protocol's
requests like the GPU: per workload fresh random inputs (``make_inputs``, seeded by the
workload) and the float64 reference; per candidate poisoned outputs, one run, the comparison
of ``tunedb.runtime.tolerance``. It never times: a verified candidate is *not measured* (its
result is ``None``, as for a replay without data), and only failures (``incorrect``,
``compile_error``, ``runtime_error``, ``timeout``) become results, under the emulator's own
device identity, never a GPU's. Emulation runs in a crash-isolated worker process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tunedb.graph.hashing import graph_hash
from tunedb.graph.ir import Graph
from tunedb.kernels.prelude import PRELUDE
from tunedb.kernels.schedule import STREAM_LARGE_OUTPUTS, schedule_space
from tunedb.records import DeviceInfo, Protocol, Workload
from tunedb.runtime.inputs import (
    BOOL_POISON,
    make_inputs,
    poison_value,
    reference_outputs,
    storage_dtype,
    workload_seed,
)
from tunedb.runtime.launch import field, scratch_zeroed
from tunedb.runtime.results import MeasureRequest, MeasureResult
from tunedb.runtime.tolerance import compare_outputs
from tunedb.runtime.worker import Worker

EMU_TASK = "tunedb.runtime.emu:emu_task"
VERIFIED = "verified"  # the worker's word for a candidate that passed (it is not a status)
# The geometry the emulated plans are generated for: the H200's, so the code verified is the
# code the GPU runs (the emulator itself has neither SMs nor an L2).
EMU_INFO = DeviceInfo(name="tunedb CPU emulator (H200 geometry)", uuid_hash="", compute_capability="emu",
                      sm_count=132, l2_bytes=50 << 20, memory_bytes=0, driver="", cuda_runtime="",
                      cupy_version="")


def generable_schedules(graph: Graph, **kw: Any) -> list:
    """The legal schedules of ``graph`` plus the streaming twins the space leaves out for speed
    alone (large outputs): they still generate, so the checks cover their code paths."""
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


def build(sources: Sequence[str], workdir: str | None = None) -> ctypes.CDLL:
    """Compile kernel sources (each with the prelude) into one host shared library (cached by
    the text's hash in ``workdir``, default the temporary directory)."""
    text = EMU_PRELUDE + "\n".join(_wrap(s) for s in dict.fromkeys(sources))
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    d = os.path.join(workdir or tempfile.gettempdir(), "tdb_emu")
    os.makedirs(d, exist_ok=True)
    so = os.path.join(d, f"{key}.so")
    if not os.path.exists(so):
        src = os.path.join(d, f"{key}.cpp")
        with open(src, "w") as f:
            f.write(text)
        tmp = os.path.join(d, f"{key}.{os.getpid()}.so")
        # -fno-tree-sra: g++ 12 crashes (ICE) in SRA on some fully unrolled kernels
        subprocess.run([shutil.which("g++") or "g++", "-std=c++20", "-O1", "-fno-tree-sra", "-shared",
                        "-fPIC", "-w", "-o", tmp, src, "-lpthread"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, so)
    return ctypes.CDLL(so)


def run_plan(lib: ctypes.CDLL, plan: Any, bufs: dict[str, np.ndarray]) -> None:
    """Launch every kernel of ``plan`` (a KernelPlan or its wire form) on host buffers (name ->
    contiguous array). Scratch the plan zeroes starts at 0, the rest holds garbage (NaN)."""
    scratch = {n: np.full(nb // 4 + 1, 0.0 if zero else np.nan, np.float32)
               for n, nb, zero in scratch_zeroed(plan)}
    for k in field(plan, "kernels", ()):
        keep = []
        args = field(k, "args", ())
        ptrs = (ctypes.c_void_p * len(args))()
        for i, a in enumerate(args):
            if isinstance(a, str):
                arr = scratch[a] if a in scratch else bufs[a]
                ptrs[i] = arr.ctypes.data
                continue
            v = ctypes.c_longlong(int(a["value"] if isinstance(a, Mapping) else a))
            keep.append(v)
            ptrs[i] = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
        fn = getattr(lib, f"emu_{field(k, 'name')}")
        fn.restype = ctypes.c_int
        gx, gy, gz = (list(field(k, "grid")) + [1, 1])[:3]
        err = fn(ptrs, gx, gy, gz, int(field(k, "block")[0]), int(field(k, "shared_bytes", 0) or 0))
        if err:
            raise RuntimeError(f"kernel {field(k, 'name')} made a misaligned vector access")


# --- verification: the measurement protocol's, on the host -------------------------------------
def poisoned_outputs(graph: Graph) -> dict[str, np.ndarray]:
    """Output buffers filled with the protocol's poison, so unwritten elements fail."""
    out = {}
    for v in graph.outputs:
        t = graph.type_of(v)
        if t.dtype == "bool":
            out[v] = np.full(t.shape, BOOL_POISON, np.uint8)
        else:
            out[v] = np.full(t.shape, poison_value(t.dtype), storage_dtype(t.dtype))
    return out


def check_plan(lib: ctypes.CDLL, graph: Graph, plan: Any, inputs: Mapping[str, np.ndarray],
               refs: Mapping[str, np.ndarray]) -> tuple[str, float]:
    """Run ``plan`` on copies of ``inputs`` into poisoned outputs; ``(worst output, its error
    over the tolerance)`` against ``refs`` (> 1 fails)."""
    bufs = {k: np.ascontiguousarray(v).copy() for k, v in inputs.items()}
    bufs.update(poisoned_outputs(graph))
    run_plan(lib, plan, bufs)
    return compare_outputs(graph, {v: bufs[v] for v in graph.outputs}, dict(refs))


def mismatches(lib: ctypes.CDLL, jobs: Sequence[tuple[Graph, Any, Any]], seed: int = 0) -> list[str]:
    """Each ``(graph, schedule, plan)`` of ``jobs`` run from ``lib`` on inputs drawn once per
    graph; one line per plan whose worst output is not within its tolerance (NaN fails too).
    Graphs are told apart by their computation and value names, not their names: subgraphs cut
    from a model all carry the same (empty) name."""
    failures = []
    refs: dict[tuple, tuple] = {}
    for g, s, plan in jobs:
        key = (graph_hash(g), g.inputs, g.outputs)
        if key not in refs:
            dev, ref = make_inputs(g, seed)
            refs[key] = (dev, reference_outputs(g, ref))
        dev, want = refs[key]
        v, err = check_plan(lib, g, plan, dev, want)
        if not err <= 1.0:
            failures.append(f"{g.name} {s.label()}: output {v} off by {err:.3g}x tolerance")
    return failures


# --- the device ----------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:1500] if text else type(e).__name__


def emu_task(state: dict, context: dict, items: list) -> Iterator[dict]:
    """Worker task (see ``worker``): ``context`` = {workload_hash, graph (JSON)}; items = wire
    plans. Yields per item ``{"status": "verified"}`` or a failure's wire result."""
    h = context.get("workload_hash", "")
    if state.get("hash") != h:
        graph = Graph.from_json(context["graph"])
        dev, ref = make_inputs(graph, workload_seed(h))
        state.update(hash=h, graph=graph, inputs=dev, refs=reference_outputs(graph, ref))
    yield {"_heartbeat": True}
    graph = state["graph"]
    for item in items:
        if item.get("error"):
            yield {"status": "compile_error", "error": str(item["error"])[:1500]}
            continue
        try:
            lib = build([k["source"] for k in item.get("kernels", ())], context.get("workdir"))
        except subprocess.CalledProcessError as e:
            first = next((ln for ln in (e.stderr or "").splitlines() if "error" in ln), "g++ failed")
            yield {"status": "compile_error", "error": f"g++: {' '.join(first.split())}"[:1500]}
            continue
        try:
            name, err = check_plan(lib, graph, item, state["inputs"], state["refs"])
        except Exception as e:  # noqa: BLE001 - a misaligned access, a missing buffer
            yield {"status": "runtime_error", "error": _one_line(e)}
            continue
        if err > 1.0:
            yield {"status": "incorrect", "error": f"output {name!r} off by {err:.3g}x its tolerance"}
        else:
            yield {"status": VERIFIED}


class EmuDevice:
    """Verifies candidates on the CPU (see the module docstring); offers ``info``, ``clocks()``,
    ``prefetch``, ``measure``, ``stats()``, ``close`` like the GPU device. ``verified`` holds the
    hashes of the candidates that passed."""

    kind = "emu"

    def __init__(self, timeout_s: float = 600.0, protocol: Protocol | None = None,
                 workdir: str | None = None) -> None:
        self.info = EMU_INFO
        self.protocol = protocol or Protocol()
        self.workdir = workdir
        self.worker = Worker(EMU_TASK, timeout_s=timeout_s)
        self.verified: set[str] = set()
        self._stats: dict[str, int] = {"candidates": 0}

    def clocks(self) -> dict[str, float]:
        return {}

    def prefetch(self, requests: list[MeasureRequest], workload: Workload | None = None) -> None:
        return None

    def stats(self) -> dict:
        return dict(self._stats)

    def measure(self, workload: Workload, requests: list[MeasureRequest]
                ) -> Iterator[tuple[int, MeasureResult | None]]:
        """Yield ``(index, failure or None)`` for every request: ``None`` for a verified one
        (nothing was timed)."""
        import json

        context = {"workload_hash": workload.hash, "graph": json.loads(workload.graph_json),
                   "workdir": self.workdir}
        for i, wire in self.worker.run(context, [r.to_wire() for r in requests]):
            status = str(wire.get("status", ""))
            self._stats["candidates"] += 1
            self._stats[status] = self._stats.get(status, 0) + 1
            if status == VERIFIED:
                self.verified.add(requests[i].candidate_hash)
                yield i, None
            else:
                yield i, MeasureResult.from_wire(wire)

    def close(self) -> None:
        self.worker.close()
