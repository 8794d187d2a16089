// The fused tree-verification kernel (torch-free, nvcc only); launched from verify_tree_launch.cuh.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/philox.h"
#include "common/reductions.cuh"
#include "verify_tree/verify_tree.h"

namespace tlt {
namespace accept {

// ============================================================================================
// verify_tree
// ============================================================================================
//
// Work split. Request b is walked by a cluster of C CTAs (grid B * C, cluster (C, 1, 1); C = 1 is
// a plain launch and needs no Hopper). CTA `rank` owns the vocabulary slice [lo, hi) = [rank * S,
// min(V, (rank + 1) * S)) with S = ceil(V / C) rounded up to kVec, so every vector load of a slice
// stays aligned; slices past V are empty and contribute identity partials. Each row statistic is
// reduced in the CTA, published in shared memory, and after one cluster barrier every CTA folds the
// C partials itself with a fixed butterfly over lanes (distributed shared memory; `combine` is
// commutative bit for bit, so every lane and every CTA gets bit-identical values): the walk's control
// flow is cluster-uniform and every CTA reaches every cluster barrier.
//
// Passes per visited row (sampled, no top-k/top-p): one fused pass for (bad, argmax, online
// max/normalizer, draft-row sum), one residual pass per rejection (writes the residual and its
// slice sums), and the final sample scans one slice only (the CTA whose mass range holds u * total).
//
// Why small CTAs: the kernel time is the longest walk of the batch, and once the short walks are done
// that walker's row is streamed by its C CTAs alone. 256-thread CTAs, two per SM, double the C that
// stays co-resident at a given B (C = 4 at B = 64 instead of 2; 16 at B = 1), and each row costs few
// instructions per element (float argmax, exp2 with a premultiplied 1 / temp, no per-element range
// checks: padding loads -inf). A lone walker's row is bound by dependency latency, not by its bytes, so
// more CTAs per row beat bigger CTAs (the ncu profile and the 512-thread A/B: docs/CUDA_NOTES.md).
// Weights are exp2((l - M) * ks), M the row max, ks = log2(e) / T' (see Expo below).

constexpr int kVerifyThreads = 256;
constexpr int kVerifyMinBlocks = 2;                // CTAs per SM the registers allow (<= 128 per thread)
constexpr int kVec = 8;                            // elements per thread per chunk
constexpr int kChunk = kVerifyThreads * kVec;      // elements per block-wide chunk
constexpr int kLoadBytes = 160;                    // bytes a thread loads before processing any
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kTempMin = 0x1p-126f;              // T' = clamp(temperature, kTempMin, kTempMax): ks finite and normal
constexpr float kTempMax = 0x1p126f;
constexpr float kTopPMin = 0x1p-126f;              // smaller top_p act as this (it keeps only the maximal logits)
constexpr float kHalveFrom = 0x1p102f;             // row max from which x - M could overflow: halve both first
constexpr int kStageNodes = 2048;                  // trees up to this size keep parents/tokens in smem
constexpr float kFixedScale = 4294967296.0f;       // 2^32: weights in (0, 1] as 32.32 fixed point
constexpr int kNegInfKey = -2139095041;            // ordered_key(-inf): keeps every token
constexpr int kNoToken = 0x7fffffff;               // "not found" of the sample scan's min-reduction

// Developer phase timing (tools/profile_phases.py, run with an extension built with CUDAFLAGS=-DTLT_VERIFY_PROFILE=1; never in a
// release build): CTA 0's thread 0 stores (SM clock, global timer) at each mark, one global store each (no
// printf between marks: it costs tens of microseconds), and prints them all at the kernel's end.
#ifdef TLT_VERIFY_PROFILE
static __device__ unsigned long long tlt_prof_clock[128], tlt_prof_global[128];
static __device__ const char* tlt_prof_name[128];
static __device__ int tlt_prof_n;
#define TLT_PROF_MARK(name)                                                                        \
  do {                                                                                             \
    if (blockIdx.x == 0 && threadIdx.x == 0 && tlt_prof_n < 128) {                                 \
      unsigned long long g_;                                                                       \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_));                                      \
      tlt_prof_clock[tlt_prof_n] = clock64();                                                      \
      tlt_prof_global[tlt_prof_n] = g_;                                                            \
      tlt_prof_name[tlt_prof_n++] = name;                                                          \
    }                                                                                              \
  } while (0)
#define TLT_PROF_BEGIN() \
  do {                                                                                             \
    if (blockIdx.x == 0 && threadIdx.x == 0) tlt_prof_n = 0;                                       \
    TLT_PROF_MARK("start");                                                                        \
  } while (0)
#define TLT_PROF_PRINT()                                                                           \
  do {                                                                                             \
    if (blockIdx.x == 0 && threadIdx.x == 0)                                                       \
      for (int i_ = 0; i_ < tlt_prof_n; ++i_)                                                      \
        printf("tltprof %s %llu %llu\n", tlt_prof_name[i_], tlt_prof_clock[i_], tlt_prof_global[i_]); \
  } while (0)
#else
#define TLT_PROF_MARK(name) \
  do {                      \
  } while (0)
#define TLT_PROF_BEGIN() \
  do {                   \
  } while (0)
#define TLT_PROF_PRINT() \
  do {                   \
  } while (0)
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TLT_VERIFY_CLUSTERS 1
#else
#define TLT_VERIFY_CLUSTERS 0
#endif


__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Load paths: kNC = read-only cache (inputs the kernel never writes); kCG = L2 only (scratch rows,
// whose elements other CTAs of the cluster wrote: L1 is not coherent across SMs).
enum class Ld { kNC, kCG };

template <Ld M, typename T>
__device__ __forceinline__ T ld(const T* p) {
  if constexpr (M == Ld::kNC) return __ldg(p);
  else return __ldcg(p);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// kVec elements of a row as loaded (16-bit types stay packed until processed: half the registers
// per load in flight).
template <typename T>
struct RawVec {
  static constexpr int kWords = static_cast<int>(sizeof(T)) * kVec / 16;
  static_assert(kWords >= 1, "vector of at least 16 bytes");
  union {
    uint4 raw[kWords];
    T val[kVec];
  };
  __device__ __forceinline__ RawVec() {}
};

// Loads [base, base + kVec) of a row; `fill` (+-inf or 0: exact in every element type) at or past
// `end`. Rows whose start is 16-byte aligned take 16-byte vector loads (base is a multiple of kVec,
// so every vector is aligned too).
template <Ld M, typename T>
__device__ __forceinline__ void load_raw(const T* row, int base, int end, bool aligned, float fill, RawVec<T>& r) {
  if (aligned && base + kVec <= end) {
    const uint4* src = reinterpret_cast<const uint4*>(row + base);
#pragma unroll
    for (int w = 0; w < RawVec<T>::kWords; ++w) r.raw[w] = ld<M>(src + w);
  } else {
    const T f = from_float<T>(fill);
#pragma unroll
    for (int i = 0; i < kVec; ++i) r.val[i] = base + i < end ? ld<M>(row + base + i) : f;
  }
}

template <typename T>
__device__ __forceinline__ void to_floats(const RawVec<T>& r, float (&x)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) x[i] = to_float(r.val[i]);
}

__device__ __forceinline__ void store_vec(float* row, int base, int end, bool aligned, const float (&x)[kVec]) {
  if (aligned && base + kVec <= end) {
    float4* dst = reinterpret_cast<float4*>(row + base);
    __stcg(dst, make_float4(x[0], x[1], x[2], x[3]));
    __stcg(dst + 1, make_float4(x[4], x[5], x[6], x[7]));
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i)
      if (base + i < end) __stcg(row + base + i, x[i]);
  }
}

// Per-thread cp.async ring of the pipelined sweep, at the start of the kernel's dynamic shared memory:
// kRingWords 16-byte words per thread (word w of thread t at [w * kVerifyThreads + t]: a warp's 16-byte
// accesses are contiguous, conflict-free). A thread reads back only the words it copied itself, so the
// ring needs no barrier, and the sweep's callers (which run warp collectives inside f)
// see the same CTA-uniform trip count as before.
constexpr int kRingWords = 16;  // 256 B per thread: 64 KB per CTA, two CTAs per SM still fit
constexpr int kRingBytes = kRingWords * 16 * kVerifyThreads;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define TLT_VERIFY_CP_ASYNC 1
#else
#define TLT_VERIFY_CP_ASYNC 0
#endif

#if TLT_VERIFY_CP_ASYNC
// 16 bytes global -> shared, cached in L2 only (.cg): right for the scratch rows other CTAs wrote, and the
// inputs are streamed once per pass anyway.
__device__ __forceinline__ void cp_async16(uint4* smem, const uint4* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The sweep with S vectors of both rows in flight per thread while one is processed: a thread copies
// vector k + S into the ring slot it has just consumed, so a lone walker's row streams continuously
// instead of stalling once per load batch (the synchronous loop issued ~150 B per thread, waited a DRAM
// round trip, then processed). Vectors that straddle or pass hi take the synchronous load (its fill).
template <Ld MA, typename TA, typename TB, typename F>
__device__ __forceinline__ void sweep_pipelined(const TA* a, float fill_a, const TB* b, bool use_b, int lo, int hi, F&& f) {
  constexpr int WA = RawVec<TA>::kWords, WB = RawVec<TB>::kWords, W = WA + WB;
  constexpr int S = kRingWords / W > 8 ? 8 : kRingWords / W;
  static_assert(S >= 2, "ring of at least two vectors");
  extern __shared__ uint4 verify_ring[];
  uint4* ring = verify_ring + threadIdx.x;
  const int n = hi > lo ? (hi - lo + kChunk - 1) / kChunk : 0;  // CTA-uniform
  const int t0 = lo + static_cast<int>(threadIdx.x) * kVec;
  auto issue = [&](int k, int slot) {
    const int base = t0 + k * kChunk;
    if (k < n && base + kVec <= hi) {
      uint4* dst = ring + slot * W * kVerifyThreads;
      const uint4* sa = reinterpret_cast<const uint4*>(a + base);
#pragma unroll
      for (int w = 0; w < WA; ++w) cp_async16(dst + w * kVerifyThreads, sa + w);
      if (use_b) {
        const uint4* sb = reinterpret_cast<const uint4*>(b + base);
#pragma unroll
        for (int w = 0; w < WB; ++w) cp_async16(dst + (WA + w) * kVerifyThreads, sb + w);
      }
    }
    cp_async_commit();  // empty groups too: the wait count below stays S - 1
  };
#pragma unroll
  for (int k = 0; k < S; ++k) issue(k, k);
  int slot = 0;
  for (int k = 0; k < n; ++k) {
    cp_async_wait<S - 1>();  // groups complete in order: vector k has landed
    const int base = t0 + k * kChunk;
    RawVec<TA> ra;
    RawVec<TB> rb;
    if (base + kVec <= hi) {
      const uint4* src = ring + slot * W * kVerifyThreads;
#pragma unroll
      for (int w = 0; w < WA; ++w) ra.raw[w] = src[w * kVerifyThreads];
      if (use_b) {
#pragma unroll
        for (int w = 0; w < WB; ++w) rb.raw[w] = src[(WA + w) * kVerifyThreads];
      }
    } else {
      load_raw<MA>(a, base, hi, true, fill_a, ra);
      if (use_b) load_raw<Ld::kNC>(b, base, hi, true, 0.f, rb);
    }
    float xa[kVec], xb[kVec];
    to_floats(ra, xa);
    if (use_b) {
      to_floats(rb, xb);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) xb[i] = 0.f;
    }
    f(base, xa, xb);
    issue(k + S, slot);  // after f: this thread's reads of the slot are done
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  cp_async_wait<0>();
}
#endif

// f(base, a, b) for every vector [base, base + kVec) of this thread in the slice [lo, hi): a from
// row `a` (fill_a past hi), b from row `b` when `use_b` (else 0). On sm_80+, rows whose start is 16-byte
// aligned stream through the cp.async ring (sweep_pipelined) and unaligned ones load one vector at a time.
// Below sm_80, U chunks of both rows are loaded (raw) before any is processed: 9 16-byte loads in flight
// per thread for bf16 logits with fp32 draft probabilities (U = 3), 4 for 16-bit rows alone. A thread
// meets its elements in increasing index order on every path (first-max argmax ties rely on it).
template <Ld MA, typename TA, typename TB, typename F>
__device__ __forceinline__ void sweep(const TA* a, bool a_aligned, float fill_a, const TB* b, bool b_aligned, bool use_b,
                                      int lo, int hi, F&& f) {
#if TLT_VERIFY_CP_ASYNC
  if (a_aligned && (b_aligned || !use_b)) {
    sweep_pipelined<MA>(a, fill_a, b, use_b, lo, hi, f);
    return;
  }
#endif
  // The trip count is CTA-uniform (warp collectives inside f need every lane); vectors past hi
  // read nothing. Where the ring serves aligned rows this is the fallback of unaligned ones (V not a
  // multiple of 8, padded strides): one vector at a time, so it adds no registers to the kernel.
  constexpr int kVecBytes = kVec * static_cast<int>(sizeof(TA) + sizeof(TB));
  constexpr int kBatch = kLoadBytes / kVecBytes < 1 ? 1 : kLoadBytes / kVecBytes > 4 ? 4 : kLoadBytes / kVecBytes;
  constexpr int U = TLT_VERIFY_CP_ASYNC ? 1 : kBatch;
  for (int c0 = lo; c0 < hi; c0 += U * kChunk) {
    const int b0 = c0 + static_cast<int>(threadIdx.x) * kVec;
    RawVec<TA> ra[U];
    RawVec<TB> rb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      load_raw<MA>(a, b0 + u * kChunk, hi, a_aligned, fill_a, ra[u]);
      if (use_b) load_raw<Ld::kNC>(b, b0 + u * kChunk, hi, b_aligned, 0.f, rb[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float xa[kVec], xb[kVec];
      to_floats(ra[u], xa);
      if (use_b) {
        to_floats(rb[u], xb);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) xb[i] = 0.f;
      }
      f(b0 + u * kChunk, xa, xb);
    }
  }
}

// A thread's, warp's, CTA's or cluster's share of one row's statistics. The weights sum to
// z * 2^m (online-softmax form, base 2); plain sums use m = 0, where 2^0 = 1 keeps them exact.
struct Partial {
  uint64_t best;  // max of (ordered key ^ sign) << 32 | ~index: largest value, lowest index
  float m, z;     // running max (logit units) and the sum of 2^((x - m) ks)
  float q;        // draft-row sum
  int bad;        // NaN / +inf seen
};

__device__ __forceinline__ Partial partial_identity(float m) { return Partial{0ull, m, 0.f, 0.f, 0}; }

// The target weights (the contract: tlt_kernels/reference/sampling.py) are w(x) = exp((x - M) / T') =
// 2^((x - M) ks), M the row max, ks = log2(e) / T' with T' = clamp(temperature, 2^-126, 2^126) (ks finite and
// normal). The max is subtracted before scaling, so w is in [0, 1], exactly 1 at the max and never NaN for any T'.
// Where M >= 2^102, x - M could pass FLT_MAX: both terms are halved first (exact there) and the scale doubled.
struct Expo {
  float h, mh, kh;  // h = 1 or 1/2, mh = M h, kh = ks / h
};

__device__ __forceinline__ Expo make_expo(float M, float ks) {
  return M >= kHalveFrom ? Expo{0.5f, M * 0.5f, ks * 2.f} : Expo{1.f, M, ks};
}

// 2^((x - M) ks) for a finite M: one FMA and one multiply per element.
__device__ __forceinline__ float weight(float x, const Expo& e) { return exp2f(fmaf(x, e.h, -e.mh) * e.kh); }

// Plain sums fold with m = 0 (weight 2^0 = 1 keeps them exact) and any ks.
__device__ __forceinline__ Partial combine(const Partial& a, const Partial& b, float ks) {
  Partial r;
  r.best = a.best > b.best ? a.best : b.best;
  r.bad = a.bad | b.bad;
  r.q = a.q + b.q;
  r.m = fmaxf(a.m, b.m);
  // Commutative bit for bit (max, |, and IEEE + are): the butterfly folds rely on it.
  if (r.m == -INFINITY) {
    r.z = 0.f;
  } else {
    const Expo e = make_expo(r.m, ks);
    r.z = a.z * weight(a.m, e) + b.z * weight(b.m, e);
  }
  return r;
}

// z rescaled to the frame of max M >= a.m (0 for empty partials).
__device__ __forceinline__ float scaled_z(const Partial& a, float M, float ks) {
  return a.z > 0.f ? a.z * weight(a.m, make_expo(M, ks)) : 0.f;
}

__device__ __forceinline__ Partial shfl_idx(const Partial& v, int l) {
  Partial r;
  r.best = __shfl_sync(0xffffffffu, v.best, l);
  r.m = __shfl_sync(0xffffffffu, v.m, l);
  r.z = __shfl_sync(0xffffffffu, v.z, l);
  r.q = __shfl_sync(0xffffffffu, v.q, l);
  r.bad = __shfl_sync(0xffffffffu, v.bad, l);
  return r;
}

__device__ __forceinline__ Partial shfl_xor(const Partial& v, int o) {
  Partial r;
  r.best = __shfl_xor_sync(0xffffffffu, v.best, o);
  r.m = __shfl_xor_sync(0xffffffffu, v.m, o);
  r.z = __shfl_xor_sync(0xffffffffu, v.z, o);
  r.q = __shfl_xor_sync(0xffffffffu, v.q, o);
  r.bad = __shfl_xor_sync(0xffffffffu, v.bad, o);
  return r;
}

// The stats sweep's partial in scored kernels (p.scores): also the raw normalizer z1 = sum of 2^((x - m) log2 e)
// (temperature 1, no filter) in the frame of p.m, the same running max as p.z's. The folds below take either type;
// the unscored kernels fold plain Partials, so they shuffle and combine nothing more than before.
struct ScoredPartial {
  Partial p;
  float z1;
};

__device__ __forceinline__ const Partial& stats_of(const Partial& v) { return v; }
__device__ __forceinline__ const Partial& stats_of(const ScoredPartial& v) { return v.p; }
__device__ __forceinline__ Partial identity_like(const Partial&, float m) { return partial_identity(m); }
__device__ __forceinline__ ScoredPartial identity_like(const ScoredPartial&, float m) {
  return ScoredPartial{partial_identity(m), 0.f};
}

// z1 folds like z, with the weights' temperature-1 scale: commutative bit for bit, so every CTA gets the same bits.
__device__ __forceinline__ ScoredPartial combine(const ScoredPartial& a, const ScoredPartial& b, float ks) {
  ScoredPartial r;
  r.p = combine(a.p, b.p, ks);
  if (r.p.m == -INFINITY) {
    r.z1 = 0.f;
  } else {
    const Expo e = make_expo(r.p.m, kLog2e);
    r.z1 = a.z1 * weight(a.p.m, e) + b.z1 * weight(b.p.m, e);
  }
  return r;
}

__device__ __forceinline__ ScoredPartial shfl_idx(const ScoredPartial& v, int l) {
  return ScoredPartial{shfl_idx(v.p, l), __shfl_sync(0xffffffffu, v.z1, l)};
}

__device__ __forceinline__ ScoredPartial shfl_xor(const ScoredPartial& v, int o) {
  return ScoredPartial{shfl_xor(v.p, o), __shfl_xor_sync(0xffffffffu, v.z1, o)};
}

// A thread's running sum of 2^((x - m) ks) over its vectors, online: m is the running max, z is in its frame and is
// rescaled (once per vector) when m grows. One form for the sampling normalizer (ks = the temperature's scale) and
// the scored kernels' raw one (ks = log2 e, temperature 1, no filter).
struct OnlineSum {
  float m = -INFINITY, z = 0.f;
  Expo e{1.f, 0.f, 0.f};  // of m, once m > -inf
};

// Adds one vector x (its max vmax, from the caller's argmax tree) to r; the terms are summed pairwise (short
// dependency chains).
__device__ __forceinline__ void online_add(OnlineSum& r, const float (&x)[kVec], float vmax, float ks) {
  if (vmax > r.m) {
    r.e = make_expo(vmax, ks);
    r.z *= weight(r.m, r.e);  // m = -inf: z is 0 and stays 0
    r.m = vmax;
  }
  if (r.m == -INFINITY) return;  // a row of -inf so far adds nothing (a NaN row is flagged bad anyway)
  float w[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) w[i] = weight(x[i], r.e);
#pragma unroll
  for (int s = 1; s < kVec; s <<= 1) {
#pragma unroll
    for (int i = 0; i < kVec; i += 2 * s) w[i] += w[i + s];
  }
  r.z += w[0];
}

// This CTA's place in the mass of the current distribution, for the inverse-CDF sample: the sum of
// ranks before it (pre), through it (end), of all (total), and the last rank with mass (-1: none).
struct Plan {
  float pre, end, total;
  int last;
};

struct Cluster {
  int rank;  // CTA rank in the cluster = vocabulary slice index
  int size;  // C
  int pub;   // publish slot in use next (double-buffered: one cluster barrier per fold)
  int hist;  // radix histogram buffer in use next (same scheme)
};

constexpr int kRadixMaxBits = 9;  // widest radix digit: 512 bins
constexpr int kRadixBins = 1 << kRadixMaxBits;

struct VerifySmem {
  uint64_t hist[2][kRadixBins];
  union {
    uint64_t hsum[kRadixBins];  // the cluster's histogram (radix select, after the cluster barrier)
    uint32_t split[2][kRadixBins];  // this CTA's histogram as 32-bit halves (radix select, during its sweep)
  };
  Partial red[kVerifyThreads / 32];
  Partial pub[2];
  float redf[32];
  int redi[32];
  uint64_t sel[2];  // radix-select decision broadcast: digit, above
  double need;
  int cand_n;       // candidates compacted so far (topp_from_candidates)
  // The scored kernels' stats folds (block_fold, cluster_fold of ScoredPartial). Last and not in a union with red /
  // pub: the fields above keep their offsets, and the unscored kernels their code (a union moved them: +2 to 12
  // registers there).
  ScoredPartial red_scored[kVerifyThreads / 32];
  ScoredPartial pub_scored[2];
};

__device__ __forceinline__ Partial* red_slots(VerifySmem& sm, const Partial&) { return sm.red; }
__device__ __forceinline__ ScoredPartial* red_slots(VerifySmem& sm, const ScoredPartial&) { return sm.red_scored; }
__device__ __forceinline__ Partial* pub_slots(VerifySmem& sm, const Partial&) { return sm.pub; }
__device__ __forceinline__ ScoredPartial* pub_slots(VerifySmem& sm, const ScoredPartial&) { return sm.pub_scored; }

// Every thread gets the CTA's fold (fixed tree: deterministic). P = Partial or ScoredPartial.
template <typename P>
__device__ __forceinline__ P block_fold(P v, VerifySmem& sm, float ks) {
  P* red = red_slots(sm, v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = combine(v, shfl_xor(v, o), ks);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  P r = red[0];
#pragma unroll
  for (int w = 1; w < kVerifyThreads / 32; ++w) r = combine(r, red[w], ks);
  __syncthreads();
  return r;
}

// Cluster-wide fold of a CTA-uniform partial (bit-identical in every CTA). Lane r of every warp
// reads rank r's partial (C <= 32 parallel DSMEM loads instead of C dependent ones), then a fixed
// butterfly over the first C lanes folds them; every thread ends with the same bits. Double buffering
// makes one barrier per fold enough: a slot is rewritten two folds later, after a barrier that every
// CTA reaches only once it has read the slot. With `plan`, also fills this CTA's place in the mass z
// (rescaled to the fold's m) from an inclusive scan over ranks that every CTA computes identically,
// so rank r's `end` and rank r + 1's `pre` are the same float. P = Partial or ScoredPartial (the plan reads z).
template <typename P>
static __device__ P cluster_fold(const P& mine, Cluster& cl, VerifySmem& sm, Plan* plan, float ks) {
#if TLT_VERIFY_CLUSTERS
  if (cl.size > 1) {
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    P* slot = &pub_slots(sm, mine)[cl.pub];
    cl.pub ^= 1;
    if (threadIdx.x == 0) *slot = mine;
    cluster.sync();  // arrive.release / wait.acquire: the slot is visible cluster-wide
    const int lane = threadIdx.x & 31;
    const P part = lane < cl.size ? *cluster.map_shared_rank(slot, lane) : identity_like(mine, -INFINITY);
    P acc = part;
    for (int o = 1; o < cl.size; o <<= 1) acc = combine(acc, shfl_xor(acc, o), ks);  // lanes < C stay among themselves
    acc = shfl_idx(acc, 0);
    if (plan) {
      const float z = lane < cl.size ? scaled_z(stats_of(part), stats_of(acc).m, ks) : 0.f;
      float incl = z;
      for (int o = 1; o < cl.size; o <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      const unsigned with_mass = __ballot_sync(0xffffffffu, lane < cl.size && z > 0.f);
      const float before = __shfl_sync(0xffffffffu, incl, cl.rank > 0 ? cl.rank - 1 : 0);
      plan->pre = cl.rank > 0 ? before : 0.f;
      plan->end = __shfl_sync(0xffffffffu, incl, cl.rank);
      plan->total = __shfl_sync(0xffffffffu, incl, cl.size - 1);
      plan->last = with_mass ? 31 - __clz(static_cast<int>(with_mass)) : -1;
    }
    return acc;
  }
#else
  if (cl.size > 1) __trap();  // the launcher never asks for clusters below sm_90
#endif
  if (plan) {
    const float part = scaled_z(stats_of(mine), stats_of(mine).m, ks);
    *plan = Plan{0.f, part, part, part > 0.f ? 0 : -1};
  }
  return mine;
}

__device__ __forceinline__ void cluster_barrier(const Cluster& cl) {
#if TLT_VERIFY_CLUSTERS
  if (cl.size > 1) cooperative_groups::this_cluster().sync();
#endif
}

// The target distribution of a visited row, kept implicit: p(t) = [key(l_t) >= thr] 2^((l_t - M) ks) / Z
// with ks = log2(e) / T' (so 2^((l - M) ks) = exp((l - M) / T')).
struct RowState {
  int bad;    // NaN/+inf present, or every entry -inf
  int arg;    // argmax, lowest id among ties (greedy token)
  int thr;    // ordered-key threshold of top-k / top-p (kNegInfKey: keep all)
  Expo e;     // the row max M and ks as weight() takes them
  float Z;    // normalizer of the kept weights
  float qsum; // sum of this node's draft row (when `want_q`)
  float M;    // scored kernels: the row max, the frame of Z1
  float Z1;   // scored kernels: the raw normalizer, sum of 2^((l - M) log2 e) over every token
};

__device__ __forceinline__ float target_weight(float x, int thr, const Expo& e) {
  return ordered_key(x) >= thr ? weight(x, e) : 0.f;
}

// Radix select over the row's ordered keys (exact, no sort): returns the largest key K with W(key >= K) >= need,
// where W counts tokens (BY_MASS = false) or sums the weights 2^((l - M) ks) in 32.32 fixed point (BY_MASS = true) over tokens
// with key >= floor. Every such key lies in [key_lo, key_hi] (the caller's bounds: the floor or the candidates'
// smallest key, and the row max), so the bits above their highest differing bit are known and the rest are
// resolved in ceil(bits / 9) levels of at most 9 bits: 3 levels for keys of one sign within a factor of
// 2^16, 4 for all 32 bits. Each CTA histograms its slice; the cluster's histograms are summed per bin. Integer
// histograms make the result independent of the atomics' order (and of the summation order over ranks), so it
// is deterministic and identical in every CTA. With `need_fraction`, need is a fraction of the total W.
template <typename T, bool BY_MASS, Ld LM = Ld::kNC>
__device__ int radix_select(const T* row, int lo, int hi, bool aligned, int floor, int key_lo, int key_hi,
                            const Expo& ex, double need, bool need_fraction, Cluster& cl, VerifySmem& sm) {
  const int tid = threadIdx.x, lane = tid & 31;
  const uint32_t ulo = static_cast<uint32_t>(key_lo) ^ 0x80000000u, uhi = static_cast<uint32_t>(key_hi) ^ 0x80000000u;
  int rem = ulo == uhi ? 0 : 32 - __clz(static_cast<int>(ulo ^ uhi));  // low bits still to resolve
  uint64_t prefix = static_cast<uint64_t>(uhi) >> rem;                  // the known high bits
  uint64_t above = 0;
  bool first = true;
#pragma unroll 1
  while (rem > 0) {  // CTA-uniform
    const int levels = (rem + kRadixMaxBits - 1) / kRadixMaxBits;
    const int width = (rem + levels - 1) / levels;
    const int shift = rem - width;
    const int nb = 1 << width;
    uint64_t* hist = sm.hist[cl.hist];
    cl.hist ^= 1;
    // A slice of at most 65535 tokens (every slice of a cluster of 4 or more at V = 152064; all candidate
    // lists of the bench) histograms w as two 16-bit halves in 32-bit bins with native shared atomics (a
    // bin's half-sums stay below 65535 * 65536 < 2^32), merged into the 64-bit bins after the sweep; longer
    // slices add 64-bit sums (a compare-and-swap loop per add, ATOMS.CAST.SPIN.64), one per distinct digit of
    // a warp. Either way the bins hold the same integers.
    const bool split = hi - lo <= 65535;
    uint32_t* hw = sm.split[0];
    uint32_t* lw = sm.split[1];
    for (int i = tid; i < nb; i += kVerifyThreads) {
      if (split) {
        hw[i] = 0;  // the merge below writes every hist[i]
        lw[i] = 0;
      } else {
        hist[i] = 0;
      }
    }
    __syncthreads();
    sweep<LM>(row, aligned, -INFINITY, row, false, false, lo, hi, [&](int base, const float (&x)[kVec], const float (&)[kVec]) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const int k = ordered_key(x[i]);
        const uint32_t uk = static_cast<uint32_t>(k) ^ 0x80000000u;
        const bool live = base + i < hi && k >= floor && (static_cast<uint64_t>(uk) >> rem) == prefix;
        // Past the first level few tokens match the prefix: most warps have nothing to count.
        const unsigned live_lanes = __ballot_sync(0xffffffffu, live);
        if (live_lanes == 0u) continue;
        const uint32_t digit = live ? (uk >> shift) & static_cast<uint32_t>(nb - 1) : 0xffffffffu;
        uint64_t w = 0;
        if (live) w = BY_MASS ? __float2ull_rn(weight(x[i], ex) * kFixedScale) : 1ull;
        // One digit for every live lane (a narrow first level): sum over the warp, one add per bin.
        const uint32_t lead = __shfl_sync(0xffffffffu, digit, __ffs(live_lanes) - 1);
        const bool one_digit = __all_sync(0xffffffffu, !live || digit == lead);
        if (split) {
          uint32_t h16 = static_cast<uint32_t>(w >> 16), l16 = static_cast<uint32_t>(w & 0xffffu);
          if (one_digit) {
            // w <= 2^32: each half summed over 32 lanes fits 32 bits.
            h16 = __reduce_add_sync(0xffffffffu, h16);
            l16 = __reduce_add_sync(0xffffffffu, l16);
            if (lane == __ffs(live_lanes) - 1) {
              if (h16) atomicAdd(&hw[digit], h16);
              if (l16) atomicAdd(&lw[digit], l16);
            }
          } else if (live) {
            if (h16) atomicAdd(&hw[digit], h16);
            if (l16) atomicAdd(&lw[digit], l16);
          }
        } else {
          // Warp aggregation: lanes with the same digit sum their weights and the group's first lane adds once.
          const unsigned peers = one_digit ? 0xffffffffu : __match_any_sync(0xffffffffu, digit);
          const uint32_t lo16 = __reduce_add_sync(peers, static_cast<uint32_t>(w & 0xffffu));
          const uint32_t hi16 = __reduce_add_sync(peers, static_cast<uint32_t>(w >> 16));
          const uint64_t sum = (static_cast<uint64_t>(hi16) << 16) + lo16;
          if (live && lane == __ffs(peers & live_lanes) - 1 && sum != 0)
            atomicAdd(reinterpret_cast<unsigned long long*>(&hist[digit]), static_cast<unsigned long long>(sum));
        }
      }
    });
    __syncthreads();
    if (split) {
      for (int i = tid; i < nb; i += kVerifyThreads) hist[i] = (static_cast<uint64_t>(hw[i]) << 16) + lw[i];
      __syncthreads();
    }
    const uint64_t* h_all = hist;
#if TLT_VERIFY_CLUSTERS
    if (cl.size > 1) {
      cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      cluster.sync();  // every CTA's histogram is complete
      for (int i = tid; i < nb; i += kVerifyThreads) {
        uint64_t s = 0;
#pragma unroll 4
        for (int r = 0; r < cl.size; ++r) s += cluster.map_shared_rank(hist, r)[i];  // loads in flight 4 at a time
        sm.hsum[i] = s;
      }
      __syncthreads();
      h_all = sm.hsum;
    }
#endif
    if (tid < 32) {
      // Lane l holds bins [l * per, (l + 1) * per) (per = nb / 32, or one bin on the first nb lanes), read
      // from shared memory as needed (held in registers, 16 of them made the top-p instantiation spill).
      const int per = nb >= 32 ? nb >> 5 : 1;
      const int b0 = lane * per, b1 = min(b0 + per, nb);
      uint64_t local = 0;
      for (int bin = b0; bin < b1; ++bin) local += h_all[bin];
      uint64_t incl = local;  // suffix sum over lanes >= lane
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint64_t v = __shfl_down_sync(0xffffffffu, incl, o);
        if (lane + o < 32) incl += v;
      }
      double nd = need;
      if (first && need_fraction) nd = need * static_cast<double>(__shfl_sync(0xffffffffu, incl, 0));
      if (first) sm.need = nd;  // every lane writes the same value
      nd = first ? nd : sm.need;
      // Suffix sums are non-increasing in the digit: the hits are digits 0..d; take the largest.
      int hit = -1;
      uint64_t s = incl - local;
      for (int bin = b1 - 1; bin >= b0 && hit < 0; --bin) {
        s += h_all[bin];
        if (static_cast<double>(above + s) >= nd) hit = bin;
      }
      const int d = max(warp_reduce(hit, MaxI()), 0);
      uint64_t gt = 0;
      for (int bin = max(b0, d + 1); bin < b1; ++bin) gt += h_all[bin];
      gt = warp_reduce(gt, [](uint64_t a, uint64_t b) { return a + b; });
      if (lane == 0) {
        sm.sel[0] = static_cast<uint64_t>(d);
        sm.sel[1] = above + gt;
      }
    }
    __syncthreads();
    prefix = (prefix << width) | sm.sel[0];
    above = sm.sel[1];
    rem = shift;
    first = false;
    __syncthreads();  // sel / hsum are rewritten by the next level
    TLT_PROF_MARK("level");
  }
  return static_cast<int>(static_cast<uint32_t>(prefix) ^ 0x80000000u);
}

// Appends the kept elements of a vector to this CTA's candidate list out[0, sm.cand_n): each warp reserves its
// slots with one shared atomic (no block barrier per chunk), so the list is in no particular order; its readers
// only sum integers over it. Warp-collective: every lane calls it with the same trip count.
__device__ __forceinline__ void append_candidates(const float (&x)[kVec], const bool (&keep)[kVec], float* out,
                                                  VerifySmem& sm) {
  const int lane = threadIdx.x & 31;
  int cnt = 0;
#pragma unroll
  for (int i = 0; i < kVec; ++i) cnt += keep[i];
  int incl = cnt;  // inclusive scan of the warp's counts
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  const int warp_total = __shfl_sync(0xffffffffu, incl, 31);
  if (warp_total == 0) return;  // warp-uniform
  int slot = 0;
  if (lane == 31) slot = atomicAdd(&sm.cand_n, warp_total);
  int k = __shfl_sync(0xffffffffu, slot, 31) + incl - cnt;
#pragma unroll
  for (int i = 0; i < kVec; ++i)
    if (keep[i]) out[k++] = x[i];
}

// Top-p over candidates: the threshold key and normalizer of a row whose statistics (max M, in s.e) are folded, from
// this CTA's tokens with key >= floor, compacted by key alone (no exp2) into cand[lo, lo + n) (its slice of a scratch
// row no other CTA reads) in no particular order (one shared atomic per warp and vector). The select sums their 32.32
// weights against `need` (with `need_fraction`, that fraction of their total), and the normalizer is the kept
// candidates' 32.32 sum: integers, so neither depends on the candidates' order.
//   After top-k, floor = the top-k threshold: the candidates are every token top-k keeps, and the select's integers
// are the full-row select's. For top-p alone the caller sets floor = the key of weight tau 2^-1/16 with
// tau = Z (1 - top_p) / (2 V) (Z the row's normalizer, >= 1): the tokens lighter than tau weigh less than
// Z (1 - top_p) / 2 together, so the threshold is the key of a token of weight >= tau (2^-1/16: a margin for the
// floor key's rounding), and need = top_p Z 2^32. Against the full-row select (need = top_p times the row's 32.32
// total) only Z's float rounding differs there: a float tie.
template <typename TL>
__device__ void topp_from_candidates(const TL* row, bool row_al, int lo, int hi, float* cand, int floor, int key_max,
                                     double need, bool need_fraction, Cluster& cl, VerifySmem& sm,
                                     Plan& plan, RowState& s) {
  if (threadIdx.x == 0) sm.cand_n = 0;
  __syncthreads();
  sweep<Ld::kNC>(row, row_al, -INFINITY, row, false, false, lo, hi,
                 [&](int base, const float (&x)[kVec], const float (&)[kVec]) {
    bool keep[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) keep[i] = base + i < hi && ordered_key(x[i]) >= floor;
    append_candidates(x, keep, cand + lo, sm);
  });
  __syncthreads();  // the count, and the candidates for the other threads
  const int n = sm.cand_n;
  TLT_PROF_MARK("cand");
  const bool al = aligned16(cand);
  s.thr = radix_select<float, true, Ld::kCG>(cand, lo, lo + n, al, floor, floor, key_max, s.e, need,
                                             need_fraction, cl, sm);
  TLT_PROF_MARK("select");
  uint64_t w = 0;
  sweep<Ld::kCG>(cand, al, -INFINITY, cand, false, false, lo, lo + n,
                 [&](int, const float (&x)[kVec], const float (&)[kVec]) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) w += __float2ull_rn(target_weight(x[i], s.thr, s.e) * kFixedScale);
  });
  const uint64_t mine = block_reduce<kVerifyThreads>(w, [](uint64_t a, uint64_t b) { return a + b; }, sm.hsum);
  Partial zp = partial_identity(0.f);
  zp.z = static_cast<float>(static_cast<double>(mine) / 4294967296.0);
  s.Z = cluster_fold(zp, cl, sm, &plan, 1.f).z;
  TLT_PROF_MARK("norm");
}

// The stats sweep's partial folded over the CTA, then the cluster (with the sampling plan when `online`). Scored
// kernels fold the raw normalizer `raw` with it, in the same shuffles and barriers, into z1 (in the frame of the
// result's m); the others fold the plain Partial, as before.
template <bool SCORED>
__device__ __forceinline__ Partial fold_stats(const Partial& t, const OnlineSum& raw, bool online, Cluster& cl,
                                              VerifySmem& sm, Plan& plan, float ks, float& z1) {
  if constexpr (SCORED) {
    const ScoredPartial c = cluster_fold(block_fold(ScoredPartial{t, raw.z}, sm, ks), cl, sm, online ? &plan : nullptr, ks);
    z1 = c.z1;
    return c.p;
  } else {
    (void)raw;
    (void)z1;
    return cluster_fold(block_fold(t, sm, ks), cl, sm, online ? &plan : nullptr, ks);
  }
}

// Statistics of a visited row over this CTA's slice, folded over the cluster: (bad, argmax) always;
// for sampled requests m, Z and `plan` (online max/normalizer in the same pass when there is no
// top-k / top-p; otherwise radix selects, then one normalizer pass); the draft-row sum when `want_q`.
// Per element: one compare-and-select for the argmax (a thread meets its elements in increasing
// index order, so strict > keeps the lowest index among ties; -0.0 == +0.0 as in the reference), a
// NaN flag (+inf shows up as the max), an FMA and an exp2. Padding past hi loads -inf, which neither
// wins the argmax nor adds weight.
// SCORED (the kernel writes log-probs): also M and Z1, the raw normalizer (temperature 1, no filter). Its running
// sum is a second online accumulator of the same pass (one more exp2 per element), folded with the statistics; an
// unfiltered row at temperature exactly 1 reuses Z (the same sum), so it adds nothing there.
template <bool SCORED, typename TL, typename TQ>
__device__ RowState row_state(const TL* row, const TQ* q_row, bool want_q, int lo, int hi, int V, bool greedy,
                              float ks, int top_k, float top_p, float* cand, Cluster& cl, VerifySmem& sm, Plan& plan) {
  const bool row_al = aligned16(row), q_al = want_q && aligned16(q_row);
  const bool cut_k = top_k > 0 && top_k < V, cut_p = top_p < 1.f;
  const bool online = !greedy && !cut_k && !cut_p;
  // The normalizer is also wanted as the candidates' bound (top-p over compacted candidates).
  const bool want_z = online || (cand != nullptr && cut_p && !cut_k && !greedy);
  const bool want_z1 = SCORED && !(online && ks == kLog2e);
  OnlineSum norm, raw;  // the sampling normalizer (want_z) and the raw one (want_z1)
  float bv = -INFINITY, qs = 0.f;
  int bi = -1;
  bool nan = false;
  TLT_PROF_MARK("row");
  sweep<Ld::kNC>(row, row_al, -INFINITY, q_row, q_al, want_q, lo, hi,
                 [&](int base, const float (&x)[kVec], const float (&qv)[kVec]) {
    // Short dependency chains (the walk stalls on dependent arithmetic at ~2 warps per scheduler): the
    // vector's argmax by a fixed pairwise tree (the right element wins only if strictly larger, so the lowest
    // index wins ties, as in a left-to-right scan) merged once into the running one; the NaN flag, the draft-row
    // sum and the normalizer's terms summed pairwise.
    float v[kVec];
    int at[kVec];
    bool bad_x[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      v[i] = x[i];
      at[i] = i;
      bad_x[i] = x[i] != x[i];
    }
#pragma unroll
    for (int w = 1; w < kVec; w <<= 1) {
#pragma unroll
      for (int i = 0; i < kVec; i += 2 * w) {
        if (v[i + w] > v[i]) {
          v[i] = v[i + w];
          at[i] = at[i + w];
        }
        bad_x[i] = bad_x[i] || bad_x[i + w];
      }
    }
    nan |= bad_x[0];
    if (v[0] > bv) {
      bv = v[0];
      bi = base + at[0];
    }
    float qq[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) qq[i] = qv[i];  // 0 unless want_q
#pragma unroll
    for (int w = 1; w < kVec; w <<= 1) {
#pragma unroll
      for (int i = 0; i < kVec; i += 2 * w) qq[i] += qq[i + w];
    }
    qs += qq[0];
    if (want_z) online_add(norm, x, v[0], ks);
    if constexpr (SCORED) {
      if (want_z1) online_add(raw, x, v[0], kLog2e);
    }
  });
  TLT_PROF_MARK("stats_sweep");
  Partial t;
  t.best = bi < 0 ? 0ull
                  : (static_cast<uint64_t>(static_cast<uint32_t>(ordered_key(bv)) ^ 0x80000000u) << 32) |
                        static_cast<uint32_t>(~static_cast<uint32_t>(bi));
  t.bad = nan || bv == INFINITY;
  t.q = qs;
  // (m, z) unused otherwise: keep the fold's rescale trivially exact. Where both sums run, norm.m == raw.m (the same
  // updates of the same running max), so the fold's m is the frame of both.
  t.m = want_z ? norm.m : want_z1 ? raw.m : 0.f;
  t.z = want_z ? norm.z : 0.f;
  float z1 = 0.f;
  const Partial c = fold_stats<SCORED>(t, raw, online, cl, sm, plan, ks, z1);
  RowState s;
  s.arg = static_cast<int>(~static_cast<uint32_t>(c.best));
  const float vmax = key_to_float(static_cast<int>(static_cast<uint32_t>(c.best >> 32) ^ 0x80000000u));
  s.bad = c.bad | (c.best == 0ull) | (vmax == -INFINITY);
  s.thr = kNegInfKey;
  const float M = online ? c.m : vmax;
  s.e = make_expo(M, ks);
  s.Z = online ? c.z : 1.f;
  s.qsum = c.q;
  if constexpr (SCORED) {
    s.M = c.m;  // = vmax on a good row: every scored row tracks the running max (want_z or want_z1)
    s.Z1 = want_z1 ? z1 : c.z;
  }
  TLT_PROF_MARK("stats");
  if (s.bad || greedy || online) return s;
  const int key_max = static_cast<int>(static_cast<uint32_t>(c.best >> 32) ^ 0x80000000u);  // ordered_key(vmax)
  if (cut_k) {
    s.thr = radix_select<TL, false>(row, lo, hi, row_al, s.thr, s.thr, key_max, s.e, static_cast<double>(top_k),
                                    false, cl, sm);
  }
  // Top-p over candidates. After top-k they are the tokens the top-k threshold keeps, and the select's need is top_p
  // of their 32.32 total: the full-row select's integers. Alone, they are found from the statistics' Z (see
  // topp_from_candidates); above top_p = 0.999 its margin, (1 - top_p) Z / 2 in 32.32 units, could fall below the
  // rounding of V integer weights (V / 2 units at most), so the full-row select runs there.
  if (cut_p && cand != nullptr && (cut_k || top_p <= 0.999f)) {
    int floor = s.thr;
    double need = static_cast<double>(top_p);
    if (!cut_k) {
      // c.z is Z in the frame of c.m = M; Z >= 1 (the max weighs 2^0). w >= tau iff l >= M + log2(tau) / ks; a
      // quotient that overflows gives -inf, a floor that keeps every token (still a superset of the candidates).
      const float tau = 0.5f * fmaxf(c.z, 1.f) * (1.f - top_p) / static_cast<float>(V);
      floor = ordered_key(M + (log2f(tau) - 0.0625f) / ks);
      need *= static_cast<double>(c.z) * 4294967296.0;
    }
    topp_from_candidates(row, row_al, lo, hi, cand, floor, key_max, need, cut_k, cl, sm, plan, s);
    return s;
  }
  if (cut_p) {
    s.thr = radix_select<TL, true>(row, lo, hi, row_al, s.thr, s.thr, key_max, s.e, static_cast<double>(top_p),
                                   true, cl, sm);
  }
  TLT_PROF_MARK("select");
  Partial zp = partial_identity(0.f);
  sweep<Ld::kNC>(row, row_al, -INFINITY, row, false, false, lo, hi,
                 [&](int, const float (&x)[kVec], const float (&)[kVec]) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) zp.z += target_weight(x[i], s.thr, s.e);
  });
  TLT_PROF_MARK("norm_sweep");
  s.Z = cluster_fold(block_fold(zp, sm, 1.f), cl, sm, &plan, 1.f).z;
  TLT_PROF_MARK("norm");
  return s;
}

// Inverse-CDF sample inside this CTA's slice [lo, hi) of the current distribution's weights (the residual row, total
// S, after a rejection; else the kept 2^((l - M) ks), total Z): the first token of positive weight whose running mass
// (from `pre`, in token order, 2048-token chunks with a block scan each, stopping at the first claim) exceeds
// `target`; the last token of positive weight if rounding puts target past every running mass; the argmax if the
// slice's weights all underflowed. Claims need positive weight: the block scan's prefixes are not exactly monotone in token
// order, and a rounding gap between two threads' running masses must not hand out a zero-weight token.
// (Not one pass then a rescan over 64 contiguous groups: that summing pass reads the whole slice, this scan stops at
// the target's chunk; docs/CUDA_NOTES.md has the A/B.)
template <typename TL>
__device__ int sample_slice(const TL* row, const float* res, bool has_res, const RowState& s, int lo, int hi,
                            float pre, float target, VerifySmem& sm) {
  const int tid = threadIdx.x;
  const bool res_al = aligned16(res), row_al = aligned16(row);
  float carry = pre;  // the running mass before this slice (the cluster's plan)
  int found = kNoToken, last = -1;
  // Chunk k + 1 is loaded before chunk k's block scan and reductions, so a chunk waits for its barriers
  // rather than for a memory round trip too (the weights are computed after the wait, in the same order).
  union Next {
    RawVec<float> res;
    RawVec<TL> row;
    __device__ Next() {}
  } next;  // one set of registers for either source (the kernel is at its register limit)
  auto fetch = [&](int base) {
    if (has_res) load_raw<Ld::kCG>(res, base, hi, res_al, 0.f, next.res);
    else load_raw<Ld::kNC>(row, base, hi, row_al, -INFINITY, next.row);
  };
  fetch(lo + tid * kVec);
  for (int base0 = lo; base0 < hi; base0 += kChunk) {
    const int base = base0 + tid * kVec;
    float w[kVec];
    if (has_res) {
      to_floats(next.res, w);
    } else {
      to_floats(next.row, w);
#pragma unroll
      for (int i = 0; i < kVec; ++i) w[i] = target_weight(w[i], s.thr, s.e);
    }
    if (base0 + kChunk < hi) fetch(base + kChunk);
    float local = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) local += w[i];
    float chunk_total;
    float c = carry + block_exclusive_scan<kVerifyThreads>(local, chunk_total, sm.redf);
    int mine = kNoToken;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      c += w[i];
      const bool positive = base + i < hi && w[i] > 0.f;
      if (positive && c > target && mine == kNoToken) mine = base + i;
      if (positive) last = base + i;
    }
    found = block_reduce<kVerifyThreads>(mine, MinI(), sm.redi);
    if (found != kNoToken) break;
    carry += chunk_total;
  }
  last = block_reduce<kVerifyThreads>(last, MaxI(), sm.redi);
  return found != kNoToken ? found : last >= 0 ? last : s.arg;
}

// A request's sampling law as the kernels read it: greedy unless temperature > 0 (NaN too); ks = log2(e) / T' with
// T' clamped to [kTempMin, kTempMax]; top_p off unless < 1 (NaN too), at least kTopPMin.
struct RequestLaw {
  bool greedy;
  float ks;
  int top_k;
  float top_p;
};

__device__ __forceinline__ RequestLaw request_law(const VerifyTreeParams& p, int b) {
  RequestLaw r;
  const float temp = p.temperature ? p.temperature[b] : 0.f;
  r.greedy = !(temp > 0.f);
  r.ks = r.greedy ? kLog2e : kLog2e / fminf(fmaxf(temp, kTempMin), kTempMax);
  r.top_k = p.top_k ? p.top_k[b] : 0;
  const float top_p_in = p.top_p ? p.top_p[b] : 1.f;
  r.top_p = top_p_in < 1.f ? fmaxf(top_p_in, kTopPMin) : 1.f;
  return r;
}

// A RowState as the rows kernel leaves it for the walk (the first kVerifyRowStateWords floats of a (request, node),
// 16-byte aligned): bad, arg, thr (as int bits), the Expo, Z, qsum, M, Z1. The walk reads back the same bits. Then
// rank r's sampling plan at kVerifyRowStateWords + 4 r: pre, end, total, last.
static_assert(kVerifyRowStateWords >= 12, "a stored RowState takes three 16-byte words");

__device__ __forceinline__ void store_plan(float* w, const Plan& plan) {
  *reinterpret_cast<float4*>(w) = make_float4(plan.pre, plan.end, plan.total, __int_as_float(plan.last));
}

__device__ __forceinline__ Plan load_plan(const float* w) {
  const float4 v = __ldcg(reinterpret_cast<const float4*>(w));
  return Plan{v.x, v.y, v.z, __float_as_int(v.w)};
}

__device__ __forceinline__ void store_row_state(float* w, const RowState& s, bool scored) {
  float4* v = reinterpret_cast<float4*>(w);
  v[0] = make_float4(__int_as_float(s.bad), __int_as_float(s.arg), __int_as_float(s.thr), s.e.h);
  v[1] = make_float4(s.e.mh, s.e.kh, s.Z, s.qsum);
  v[2] = make_float4(scored ? s.M : 0.f, scored ? s.Z1 : 0.f, 0.f, 0.f);
}

__device__ __forceinline__ RowState load_row_state(const float* w) {
  const float4* v = reinterpret_cast<const float4*>(w);
  const float4 a = __ldcg(v), c = __ldcg(v + 1), d = __ldcg(v + 2);
  RowState s;
  s.bad = __float_as_int(a.x);
  s.arg = __float_as_int(a.y);
  s.thr = __float_as_int(a.z);
  s.e = Expo{a.w, c.x, c.y};
  s.Z = c.z;
  s.qsum = c.w;
  s.M = d.x;
  s.Z1 = d.y;
  return s;
}

// The sampling plan of a row whose statistics the rows kernel computed (the walk folded none): this CTA's kept mass
// over its slice, folded over the cluster; the same pass as row_state's normalizer after a select.
template <typename TL>
__device__ void plan_of_row(const TL* row, const RowState& s, int lo, int hi, Cluster& cl, VerifySmem& sm, Plan& plan) {
  Partial zp = partial_identity(0.f);
  sweep<Ld::kNC>(row, aligned16(row), -INFINITY, row, false, false, lo, hi,
                 [&](int, const float (&x)[kVec], const float (&)[kVec]) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) zp.z += target_weight(x[i], s.thr, s.e);
  });
  cluster_fold(block_fold(zp, sm, 1.f), cl, sm, &plan, 1.f);
}

// The parallel-rows kernel: cluster (b, node) (grid B * T * C, in that order) computes row_state for node's row of
// request b, exactly as the walk would on visiting it, and stores it for the walk (p.row_stats). Every row of every
// node below num_nodes[b] is read, visited or not: bytes traded for the walk's chain of dependent row passes (at
// small B x T the walk is that chain's latency, not its bytes; docs/CUDA_NOTES.md). The draft-row sum is taken for
// nodes with children; top-p candidates go to scratch row `node` of the request (p.scratch_rows >= T).
template <typename TL, typename TQ, bool HAS_Q, bool SCORED, bool TOPP_COMPACT = false>
__global__ void __launch_bounds__(kVerifyThreads, kVerifyMinBlocks) verify_rows_kernel(const VerifyTreeParams p, int csize) {
  __shared__ VerifySmem sm;
  Cluster cl{0, csize, 0, 0};
#if TLT_VERIFY_CLUSTERS
  if (csize > 1) cl.rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
#endif
  const int64_t row_id = blockIdx.x / csize;  // b * T + node
  const int b = static_cast<int>(row_id / p.num_tree), node = static_cast<int>(row_id % p.num_tree);
  const int n = min(p.num_nodes[b], p.num_tree);
  if (node >= n) return;  // cluster-uniform: no CTA of this cluster reaches a barrier
  const int V = p.vocab;
  const int slice = ((V + csize - 1) / csize + kVec - 1) / kVec * kVec;
  const int lo = min(cl.rank * slice, V), hi = min(lo + slice, V);
  const RequestLaw law = request_law(p, b);
  const int32_t* parents_b = p.parents + b * p.parents_stride_b;
  int has_child = 0;
  for (int j = node + 1 + static_cast<int>(threadIdx.x); j < n && !has_child; j += kVerifyThreads)
    has_child = __ldg(parents_b + j) == node;
  has_child = __syncthreads_or(has_child);
  const TL* row = static_cast<const TL*>(p.logits) + b * p.logits_stride_b + node * p.logits_stride_t;
  const TQ* q_row = HAS_Q ? static_cast<const TQ*>(p.draft_probs) + b * p.q_stride_b + node * p.q_stride_t : nullptr;
  float* cand = TOPP_COMPACT ? p.scratch + (static_cast<int64_t>(b) * p.scratch_rows + node) * V : nullptr;
  Plan plan{0.f, 0.f, 0.f, -1};
  const RowState s = row_state<SCORED>(row, q_row, HAS_Q && !law.greedy && has_child, lo, hi, V, law.greedy, law.ks,
                                       law.top_k, law.top_p, cand, cl, sm, plan);
  float* out = p.row_stats + row_id * kVerifyRowWords;
  if (cl.rank == 0 && threadIdx.x == 0) store_row_state(out, s, SCORED);
  // Each rank's place in the row's kept mass (set by row_state's last fold for every sampled row); the walk uses it
  // when it runs with this kernel's C (same slices).
  if (threadIdx.x == 0) store_plan(out + kVerifyRowStateWords + 4 * cl.rank, plan);
  cluster_barrier(cl);  // no CTA may exit while another still reads its shared memory (the last fold's slot)
}

// An emitted token's log-probs under the visited row that predicted it (its logit l; the row's target law, not a
// residual: the acceptance is lossless): the sampling law's ln(w(l) / Z) (0 for greedy rows, a point mass) and the
// raw log_softmax ln(2^((l - M) log2 e) / Z1), each as ln 2 (log2 weight - log2 normalizer), with the exponents the
// walk's weights use (no exp/log round trip).
struct TokenScores {
  float sampled, raw;
};

__device__ __forceinline__ TokenScores token_scores(float l, const RowState& s, bool greedy) {
  const Expo r = make_expo(s.M, kLog2e);
  TokenScores t;
  t.sampled = greedy ? 0.f : kLn2 * (fmaf(l, s.e.h, -s.e.mh) * s.e.kh - log2f(s.Z));
  t.raw = kLn2 * (fmaf(l, r.h, -r.mh) * r.kh - log2f(s.Z1));
  return t;
}

// scores[at] = (sampled, raw): float32 pairs, at = b * (max_depth + 1) + depth.
__device__ __forceinline__ void store_scores(float* scores, int64_t at, const TokenScores& t) {
  scores[2 * at] = t.sampled;
  scores[2 * at + 1] = t.raw;
}

// One verification walk per cluster (see tlt_kernels/reference/verify_tree.py for the contract). With p.row_stats
// (parallel rows) a visited node's RowState, and its sampling plan where the rows kernel ran with this C, is read
// from verify_rows_kernel's output instead of computed from its row.
// `csize` = C, the cluster size the launcher chose (1: no cluster). TOPP_COMPACT: the top-p threshold is
// selected among compacted candidates (p.topp_compact; a separate instantiation, so the default kernel's
// registers are untouched: in the same kernel the extra path made the bf16/fp32 walk spill 244 bytes).
// SCORED: p.scores is set; the walk writes each emitted token's log-probs (token_scores) from the statistics of
// the rows it visits anyway (a separate instantiation too: the unscored kernels are unchanged).
//   Who writes scores[b]: an accepted token's pair by rank 0's thread 0 at its accept; a sampled final token's by
// the CTA that drew it (like its token); the rest of the row (a greedy final token, zeros past it, zeros for a
// flagged request, overwriting the accepted pairs after the block barrier) by rank 0 with the other outputs.
template <typename TL, typename TQ, bool HAS_Q, bool SCORED, bool TOPP_COMPACT = false>
__global__ void __launch_bounds__(kVerifyThreads, kVerifyMinBlocks) verify_tree_kernel(const VerifyTreeParams p, int csize) {
  __shared__ VerifySmem sm;
  TLT_PROF_BEGIN();
  // The sweep's cp.async ring (kRingBytes, sm_80+), then path_tok[D + 1], path_node[D + 1], tried[D],
  // took[D] (D = max depth held), then, for T <= kStageNodes, par_s[T] and tok_s[T] (token or -1 if
  // outside [0, V)).
  extern __shared__ uint4 verify_ring[];
  int* dyn = reinterpret_cast<int*>(verify_ring + (TLT_VERIFY_CP_ASYNC ? kRingBytes / 16 : 0));
  Cluster cl{0, csize, 0, 0};
#if TLT_VERIFY_CLUSTERS
  if (csize > 1) cl.rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
#endif
  const int b = blockIdx.x / csize;
  const int tid = threadIdx.x;
  const int V = p.vocab;
  const int slice = ((V + csize - 1) / csize + kVec - 1) / kVec * kVec;
  const int lo = min(cl.rank * slice, V), hi = min(lo + slice, V);
  const int depth_cap = min(p.max_depth, p.num_tree - 1);
  int* path_tok = dyn;
  int* path_node = path_tok + depth_cap + 1;
  int* tried = path_node + depth_cap + 1;
  int* took = tried + depth_cap;
  for (int i = tid; i < depth_cap; i += kVerifyThreads) tried[i] = took[i] = 0;

  const int n = min(p.num_nodes[b], p.num_tree);
  const RequestLaw law = request_law(p, b);
  const bool greedy = law.greedy;
  const float ks = law.ks;
  // Parallel rows: every node's RowState was computed by verify_rows_kernel; the walk reads it instead of its row.
  const float* row_stats_b = p.row_stats ? p.row_stats + static_cast<int64_t>(b) * p.num_tree * kVerifyRowWords : nullptr;
  const bool row_plans = p.rows_cluster == csize;  // the rows kernel's slices are this walk's: its plans apply
  const int64_t seed = p.seed[b], offset = p.offset[b];
  const TL* logits_b = static_cast<const TL*>(p.logits) + b * p.logits_stride_b;
  const TQ* q_b = HAS_Q ? static_cast<const TQ*>(p.draft_probs) + b * p.q_stride_b : nullptr;
  const int32_t* parents_b = p.parents + b * p.parents_stride_b;
  // Two residual rows per request, ping-pong: a rejection writes the other row, so a zero residual
  // (which keeps the current distribution) costs no second pass.
  float* res_rows[2] = {p.scratch + static_cast<int64_t>(b) * p.scratch_rows * V,
                        p.scratch + (static_cast<int64_t>(b) * p.scratch_rows + 1) * V};
  int res_i = 0;

  // The walk's scalar loads (parent, then token, then the logit and draft probability at the token)
  // form a dependent chain per tried node: small trees are staged in shared memory with one parallel
  // load, and the first child's two values are fetched before the row pass that precedes its test.
  const bool staged = p.num_tree <= kStageNodes;
  int* par_s = took + depth_cap;
  int* tok_s = par_s + (staged ? p.num_tree : 0);
  auto token_global = [&](int j) {
    const int64_t x64 = p.tokens_int64 ? __ldg(static_cast<const int64_t*>(p.draft_tokens) + b * p.tokens_stride_b + j)
                                       : __ldg(static_cast<const int32_t*>(p.draft_tokens) + b * p.tokens_stride_b + j);
    return (x64 < 0 || x64 >= V) ? -1 : static_cast<int>(x64);
  };
  if (staged) {
    for (int i = tid; i < n; i += kVerifyThreads) {
      par_s[i] = __ldg(parents_b + i);
      tok_s[i] = token_global(i);
    }
  }
  __syncthreads();
  auto parent_at = [&](int j) { return staged ? par_s[j] : __ldg(parents_b + j); };
  auto token_at = [&](int j) { return staged ? tok_s[j] : token_global(j); };

  int cur = 0, depth = 0;
  const TL* row = logits_b;
  Plan plan{0.f, 0.f, 0.f, -1};
  int pf_j = -1;  // first child of the visited node, whose row values below were prefetched
  float pf_l = 0.f, pf_q = 0.f;
  auto visit = [&](int node) {
    int child = -1;
    for (int j = node + 1; j < n && child < 0; ++j)
      if (parent_at(j) == node) child = j;
    pf_j = child;
    if (child >= 0 && !greedy) {
      const int x = token_at(child);
      if (x >= 0) {
        pf_l = to_float(__ldg(row + x));
        if (HAS_Q) pf_q = to_float(__ldg(q_b + node * p.q_stride_t + x));
      }
    }
    if (row_stats_b) {
      const float* w = row_stats_b + node * kVerifyRowWords;
      if (row_plans) plan = load_plan(w + kVerifyRowStateWords + 4 * cl.rank);
      return load_row_state(w);
    }
    const bool want_q = HAS_Q && !greedy && depth < p.max_depth && child >= 0;
    // Top-p candidates go to the scratch row without the live residual (its last readers, the residual pass that
    // left it, are done); like residuals, they are written and read by the CTA that owns the slice only.
    return row_state<SCORED>(row, HAS_Q ? q_b + node * p.q_stride_t : static_cast<const TQ*>(nullptr), want_q, lo, hi,
                             V, greedy, ks, law.top_k, law.top_p, TOPP_COMPACT ? res_rows[res_i ^ 1] : nullptr, cl, sm, plan);
  };
  RowState s;
  int err = 0;
  bool has_res = false, q_checked = false;
  float S = 1.f;
  int pending = 0;  // the node whose row is visited next (the root first, then each accepted node), or -1

  // Nodes are topologically ordered, so one scan over node indices meets the children of the
  // current node in increasing order, and the children of an accepted node all come after it.
  // Every value below is cluster-uniform (same loads, same folds), so control flow is too.
  // The visit sits at the top of the loop, its only call site: row_state (the stats sweep, the top-k / top-p selects
  // and the normalizer pass) is inlined once, not once for the root and once for accepted nodes.
  for (int j = 1;; ++j) {
    if (pending >= 0) {
      row = logits_b + pending * p.logits_stride_t;
      s = visit(pending);
      err = s.bad;
      has_res = false;
      q_checked = false;
      S = 1.f;
      pending = -1;
    }
    if (j >= n || err || depth >= p.max_depth) break;
    if (parent_at(j) != cur) continue;
    const int x = token_at(j);
    if (tid == 0) tried[depth] += 1;
    if (x < 0) {
      err = 1;
      break;
    }
    const TQ* q_row = HAS_Q ? q_b + cur * p.q_stride_t : nullptr;
    bool accept = x == s.arg;
    float px = 0.f;
    if (!greedy) {
      if (HAS_Q && !q_checked) {
        q_checked = true;
        if (!(s.qsum > 0.f) || s.qsum == INFINITY) {
          err = 1;
          break;
        }
      }
      const bool pre = j == pf_j;  // the row's first child: values fetched during its pass
      px = has_res ? __ldcg(res_rows[res_i] + x) / S
                   : target_weight(pre ? pf_l : to_float(__ldg(row + x)), s.thr, s.e) / s.Z;
      const float u = philox_uniform(seed, offset, static_cast<uint32_t>(j), kPurposeAccept);
      if (HAS_Q) {
        const float qx = (pre ? pf_q : to_float(__ldg(q_row + x))) / s.qsum;
        accept = u * qx < px;
      } else {
        accept = u < px;
      }
    }
    if (accept) {
      if (tid == 0) {
        path_tok[depth] = x;
        took[depth] = 1;
        path_node[depth + 1] = j;
      }
      if constexpr (SCORED) {
        // A greedy row accepts its argmax, whose logit is the row max M.
        if (cl.rank == 0 && tid == 0) {
          const float lx = greedy ? s.M : j == pf_j ? pf_l : to_float(__ldg(row + x));
          store_scores(p.scores, static_cast<int64_t>(b) * (p.max_depth + 1) + depth, token_scores(lx, s, greedy));
        }
      }
      ++depth;
      cur = j;
      pending = j;
    } else if (!greedy) {
      // Residual r = max(p - q, 0) (q = draft row; without one, p with x zeroed), kept unnormalized as
      // W r = max(w - q W / qsum, 0) with w = W p the current weights: one multiply per element instead of two
      // divisions (the pass was bound by them), and the same distribution, since every reader divides by its
      // mass R. Written to the other scratch row in the pass that sums it; adopted only if R is positive.
      const float* src = res_rows[res_i];
      float* dst = res_rows[res_i ^ 1];
      const bool src_al = aligned16(src), dst_al = aligned16(dst), row_al = aligned16(row);
      const float q_scale = HAS_Q ? (has_res ? S : s.Z) / s.qsum : 0.f;
      Partial r = partial_identity(0.f);
      auto body = [&](int base, const float (&a)[kVec], const float (&qv)[kVec]) {
        float pv[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float w = has_res ? a[i] : target_weight(a[i], s.thr, s.e);
          const float res = HAS_Q ? fmaxf(w - qv[i] * q_scale, 0.f) : (base + i == x ? 0.f : w);
          pv[i] = base + i < hi ? res : 0.f;
        }
        store_vec(dst, base, hi, dst_al, pv);
        // Pairwise: a short dependency chain per vector.
        r.z += ((pv[0] + pv[1]) + (pv[2] + pv[3])) + ((pv[4] + pv[5]) + (pv[6] + pv[7]));
      };
      static_assert(kVec == 8, "the residual's pairwise sum is written for 8 elements per vector");
      if (has_res) {
        sweep<Ld::kCG>(src, src_al, 0.f, q_row, HAS_Q && aligned16(q_row), HAS_Q, lo, hi, body);
      } else {
        sweep<Ld::kNC>(row, row_al, -INFINITY, q_row, HAS_Q && aligned16(q_row), HAS_Q, lo, hi, body);
      }
      TLT_PROF_MARK("resid_sweep");
      // The fold's barriers order every CTA's residual writes before any later read of them.
      Plan next;
      const float R = cluster_fold(block_fold(r, sm, 1.f), cl, sm, &next, 1.f).z;
      TLT_PROF_MARK("resid");
      if (R > 0.f) {
        has_res = true;
        S = R;
        res_i ^= 1;
        plan = next;
      }
    }
  }

  // Final token: greedy = argmax; sampled = inverse CDF of the current distribution. The CTA whose
  // mass range [pre, end) holds u * total (the last CTA with mass if rounding puts it past the end)
  // scans its slice; the others only wait at the exit barrier.
  TLT_PROF_MARK("walk");
  int final_tok = greedy ? s.arg : -1;
  bool owner = false;
  // A row from the rows kernel has no plan yet: this CTA's place in its kept mass (a residual brought its own).
  if (row_stats_b && !row_plans && !greedy && !err && !has_res) plan_of_row(row, s, lo, hi, cl, sm, plan);
  // No mass to sample from (no valid row leads here: its maximal logits weigh 1): flagged, never emitted as -1.
  if (!greedy && !err && plan.last < 0) err = 1;
  if (!greedy && !err && plan.last >= 0) {
    const float u = philox_uniform(seed, offset, static_cast<uint32_t>(cur), kPurposeSample);
    const float target = u * plan.total;
    owner = target < plan.total ? (plan.pre <= target && target < plan.end) : cl.rank == plan.last;
    if (owner) final_tok = sample_slice(row, res_rows[res_i], has_res, s, lo, hi, plan.pre, target, sm);
  }
  __syncthreads();  // path_* / tried / took written by thread 0

  const bool ok = !err;
  const int W = p.max_depth + 1;
  int32_t* out_tok = p.out_tokens + static_cast<int64_t>(b) * W;
  int32_t* out_node = p.out_nodes + static_cast<int64_t>(b) * W;
  // Rank 0 writes the outputs, except the sampled final token, which its owner writes.
  const bool sampled_tok = !greedy && ok && plan.last >= 0;
  if (owner && tid == 0) {
    out_tok[depth] = final_tok;
    if constexpr (SCORED)
      store_scores(p.scores, static_cast<int64_t>(b) * W + depth, token_scores(to_float(__ldg(row + final_tok)), s, false));
  }
  if (cl.rank == 0) {
    for (int d = tid; d < W; d += kVerifyThreads) {
      if (!(d == depth && sampled_tok)) out_tok[d] = !ok ? -1 : d < depth ? path_tok[d] : d == depth ? final_tok : -1;
      out_node[d] = d == 0 ? 0 : (ok && d <= depth) ? path_node[d] : -1;
      if constexpr (SCORED) {
        // A greedy final token is the argmax (logit M); a sampled one's pair is its owner's.
        if (!ok || d > depth) store_scores(p.scores, static_cast<int64_t>(b) * W + d, TokenScores{0.f, 0.f});
        else if (d == depth && !sampled_tok) store_scores(p.scores, static_cast<int64_t>(b) * W + d, token_scores(s.M, s, true));
      }
    }
    if (p.out_stats) {
      int32_t* st = p.out_stats + static_cast<int64_t>(b) * p.max_depth * 2;
      for (int d = tid; d < p.max_depth; d += kVerifyThreads) {
        st[2 * d] = ok && d < depth_cap ? tried[d] : 0;
        st[2 * d + 1] = ok && d < depth_cap ? took[d] : 0;
      }
    }
    if (tid == 0) {
      p.out_num[b] = ok ? depth : 0;
      p.out_error[b] = err;
    }
  }
  // No CTA may exit while another still reads its shared memory (the last fold's slot).
  cluster_barrier(cl);
  TLT_PROF_MARK("end");
  TLT_PROF_PRINT();
}

}  // namespace accept
}  // namespace tlt
