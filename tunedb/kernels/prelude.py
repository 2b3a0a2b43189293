"""The device-side prelude every generated kernel starts with.

Self-contained for NVRTC (no #include, not even cuda_fp16.h): float16/bfloat16 live in
``unsigned short`` and convert through inline PTX. Guarded so that many generated sources can
be concatenated into one translation unit (the compile tests do that).
"""

PRELUDE = r"""#ifndef TDB_PRELUDE
#define TDB_PRELUDE
#pragma nv_diag_suppress 177
// tunedb fused-kernel prelude: vector access, fp16/bf16 conversion, warp reductions.
template <typename T, int V> struct alignas(sizeof(T) * V) tdb_vec { T v[V]; };
template <typename T, int V>
__device__ __forceinline__ tdb_vec<T, V> tdb_ld(const T* p) {
  return *reinterpret_cast<const tdb_vec<T, V>*>(p);
}
template <typename T, int V>
__device__ __forceinline__ void tdb_st(T* p, const tdb_vec<T, V>& x) {
  *reinterpret_cast<tdb_vec<T, V>*>(p) = x;
}
__device__ __forceinline__ float tdb_h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short tdb_f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float tdb_bf2f(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short tdb_f2bf(float f) {
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float tdb_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float tdb_sigmoid_fast(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ float tdb_tanh_fast(float x) {
  // tanh(x) = 1 - 2 / (exp(2x) + 1): saturates correctly at +-inf of __expf
  return 1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f);
}
__device__ __forceinline__ float tdb_fmod_floor(float a, float b) {
  float r = fmodf(a, b);
  return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r;
}
__device__ __forceinline__ long long tdb_imod(long long a, long long b) {
  if (b == 0) return 0;
  long long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ long long tdb_idiv(long long a, long long b) { return b == 0 ? 0 : a / b; }
// Thread-block clusters (sm_90): rank in the cluster, cluster-wide barrier (release/acquire),
// and a float load from the shared memory of another block of the cluster (DSMEM).
static __device__ __forceinline__ unsigned tdb_crank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
static __device__ __forceinline__ void tdb_csync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
static __device__ __forceinline__ float tdb_dsmem_ld(const float* p, unsigned rank) {
  unsigned a, b; float v;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(b) : "memory");
  return v;
}
#define TDB_INF __int_as_float(0x7f800000)
#define TDB_WRED(NAME, EXPR)                                                   \
  template <int W> __device__ __forceinline__ float NAME(float a) {            \
    _Pragma("unroll") for (int o = W / 2; o > 0; o >>= 1) {                    \
      float b = __shfl_xor_sync(0xffffffffu, a, o); a = (EXPR);                \
    }                                                                          \
    return a;                                                                  \
  }
TDB_WRED(tdb_wsum, a + b)
TDB_WRED(tdb_wprod, a * b)
TDB_WRED(tdb_wmax, fmaxf(a, b))
TDB_WRED(tdb_wmin, fminf(a, b))
#endif  // TDB_PRELUDE
"""

# Streaming (evict-first) vector access, emitted only into the plans of ``stream`` schedules so
# that every other generated source stays byte-identical. Inline PTX: the very form the A/B of
# ``benchmarks/twins.py`` measured. Host compilers (the CPU emulation of the tests) get the plain
# access.
STREAM = r"""#ifndef TDB_STREAM
#define TDB_STREAM
#if defined(__CUDA_ARCH__)
template <typename T, int V>
__device__ __forceinline__ tdb_vec<T, V> tdb_ldcs(const T* p) {
  tdb_vec<T, V> r;
  constexpr int N = sizeof(T) * V;
  unsigned* w = reinterpret_cast<unsigned*>(&r);
  if constexpr (N == 16) {
    asm("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  } else if constexpr (N == 8) {
    asm("ld.global.cs.v2.u32 {%0,%1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else if constexpr (N == 4) {
    asm("ld.global.cs.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
  } else if constexpr (N == 2) {
    unsigned short h;
    asm("ld.global.cs.u16 %0, [%1];" : "=h"(h) : "l"(p));
    *reinterpret_cast<unsigned short*>(&r) = h;
  } else {
    unsigned b;
    asm("ld.global.cs.u8 %0, [%1];" : "=r"(b) : "l"(p));
    *reinterpret_cast<unsigned char*>(&r) = (unsigned char)b;
  }
  return r;
}
template <typename T, int V>
__device__ __forceinline__ void tdb_stcs(T* p, const tdb_vec<T, V>& x) {
  constexpr int N = sizeof(T) * V;
  const unsigned* w = reinterpret_cast<const unsigned*>(&x);
  if constexpr (N == 16) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  } else if constexpr (N == 8) {
    asm volatile("st.global.cs.v2.u32 [%0], {%1,%2};" :: "l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  } else if constexpr (N == 4) {
    asm volatile("st.global.cs.u32 [%0], %1;" :: "l"(p), "r"(w[0]) : "memory");
  } else if constexpr (N == 2) {
    asm volatile("st.global.cs.u16 [%0], %1;"
                 :: "l"(p), "h"(*reinterpret_cast<const unsigned short*>(&x)) : "memory");
  } else {
    asm volatile("st.global.cs.u8 [%0], %1;"
                 :: "l"(p), "r"((unsigned)*reinterpret_cast<const unsigned char*>(&x)) : "memory");
  }
}
#else
template <typename T, int V> inline tdb_vec<T, V> tdb_ldcs(const T* p) { return tdb_ld<T, V>(p); }
template <typename T, int V> inline void tdb_stcs(T* p, const tdb_vec<T, V>& x) { tdb_st<T, V>(p, x); }
#endif
#endif  // TDB_STREAM
"""

# Evict-last loads (``evict_last`` schedules): L1::evict_last plus an L2 cache-policy operand
# made by ``createpolicy.fractional.L2::evict_last`` -- the form torch.compile's Triton kernels
# give a row's first read, and the form the A/B behind ``EVICT_LAST_MAPPINGS`` measured (volatile,
# so two reads of one row stay two reads). Host compilers get the plain access.
EVICT_LAST = r"""#ifndef TDB_EVICT_LAST
#define TDB_EVICT_LAST
#if defined(__CUDA_ARCH__)
#define TDB_EL_POL ".reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_last.b64 pol, 1.0;\n\t"
#define TDB_EL_LD "ld.global.L1::evict_last.L2::cache_hint"
template <typename T, int V>
__device__ __forceinline__ tdb_vec<T, V> tdb_ldel(const T* p) {
  tdb_vec<T, V> r;
  constexpr int N = sizeof(T) * V;
  unsigned* w = reinterpret_cast<unsigned*>(&r);
  if constexpr (N == 16) {
    asm volatile("{\n\t" TDB_EL_POL TDB_EL_LD ".v4.u32 {%0,%1,%2,%3}, [%4], pol;\n\t}"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  } else if constexpr (N == 8) {
    asm volatile("{\n\t" TDB_EL_POL TDB_EL_LD ".v2.u32 {%0,%1}, [%2], pol;\n\t}"
                 : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else if constexpr (N == 4) {
    asm volatile("{\n\t" TDB_EL_POL TDB_EL_LD ".u32 %0, [%1], pol;\n\t}" : "=r"(w[0]) : "l"(p));
  } else if constexpr (N == 2) {
    unsigned short h;
    asm volatile("{\n\t" TDB_EL_POL TDB_EL_LD ".u16 %0, [%1], pol;\n\t}" : "=h"(h) : "l"(p));
    *reinterpret_cast<unsigned short*>(&r) = h;
  } else {
    unsigned b;
    asm volatile("{\n\t" TDB_EL_POL TDB_EL_LD ".u8 %0, [%1], pol;\n\t}" : "=r"(b) : "l"(p));
    *reinterpret_cast<unsigned char*>(&r) = (unsigned char)b;
  }
  return r;
}
#else
template <typename T, int V> inline tdb_vec<T, V> tdb_ldel(const T* p) { return tdb_ld<T, V>(p); }
#endif
#endif  // TDB_EVICT_LAST
"""
