// Tree attention over a paged KV cache (flash-decoding with the tree folded in). Torch-free.
//
// For request b, KV head h and query row r = t * G + g (query head h * G + g of draft node t):
//
//   out[b, t, h*G+g] = softmax_j(scale * q . k_j) v_j   over   j in context[0, ctx_b)  U  {tree node j : j anc-or-self of t}
//
// Work split. One CTA per (context split s, row chunk, request b, KV head h) owns up to BLOCK_M =
// 16 * kWarps of the M = T * G query rows that read KV head h (every tree node times every query
// head of the group), so each K/V tile goes to shared memory once and feeds an [M, D] x [D, BLOCK_N]
// tensor-core product: the tree costs about the HBM traffic of one decode step. Row chunks exist
// only for M > 128; the chunks of a split are adjacent in launch order and share tiles through L2.
//
// Per request, `used = ceil(ctx / split_len)` context splits are non-empty. The tree tokens (cache
// slots ctx + j, masked by the packed ancestor bits) are one or two extra tiles of the *last*
// non-empty split (split 0 when ctx == 0); later splits exit at once. A request with used <= 1 is
// complete in split 0, which writes `out` directly in q's dtype (padding rows as zeros): no scratch,
// no merge. Otherwise split s < used writes its normalized partial output and natural-log LSE at
// scratch slot s, and the merge kernel combines exactly those `used` slots (slot S of the plan's
// scratch is not used). The merge is not launched at all when the plan has one split.
//
// Pipeline. kStages-deep cp.async ring of K/V tiles (16-byte copies, zero-filled past the end);
// one __syncthreads per tile: after `cp.async.wait_group kStages-2` + the barrier, tile `it` is
// visible and every warp has finished tile it-1, so its stage is refilled with tile it+kStages-1
// right away. The block-table entries of the next tile to issue are read one iteration ahead into
// registers, so the dependent page-id load never stalls the copy issue. Only a split's last context
// tile is bounds-masked and only tree tiles test ancestor bits; full tiles run unmasked.
//
// fp8 caches (KV = __nv_fp8_e4m3 / __nv_fp8_e5m2, q bf16/fp16). Tiles are copied as they are (8-byte cp.async per 8
// values) into an fp8 staging ring of the same depth; once a tile has landed, each thread widens the chunks it
// copied into the 16-bit ring (exact: every fp8 value is a half and a bfloat16), before the tile's barrier, so the
// math below is unchanged. A thread only ever widens and refills its own staging chunks, so the staging ring needs
// no barrier of its own. k_scale is folded into sm_scale by the caller; v_scale multiplies each output row. The two
// rings together take more shared memory than the 16-bit one alone, so the fp8 launches use fewer stages
// (Fp8Traits in tree_attention.cu: two CTAs per SM).
//
// Math. mma.sync.m16n8k16 (fp16/bf16 in, fp32 accumulate), 16 query rows per warp. Q fragments are
// loaded once into registers (D <= 128; Q is staged in the ring's last stage, which the first
// refill then overwrites) or re-read from a dedicated shared buffer (D = 256, where the fp32 O
// accumulator alone takes 128 registers). ldmatrix feeds Q and K, ldmatrix.trans feeds V; the S
// accumulators of two adjacent n-tiles are the A fragment of the PV product (the C layout of m16n8
// equals the A layout of m16n8k16). Online softmax in base 2 (ex2 with scale * log2 e).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "tree_attention/tree_attention.h"

namespace tlt {
namespace tree_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxTree = 64;  // a row's ancestor bits are preloaded into one 64-bit register

// Compile-time shape of the partial kernel.
//   D: head dim; kWarps: 16 query rows each; kStages: K/V ring depth; kQInRegs: Q fragments in
//   registers; kMinBlocks: __launch_bounds__ occupancy hint;
//   kBlockN_: K/V tile length, 0 = 64 (32 at D = 256, which keeps the S tile small next to the
//   128-register O accumulator).
template <int D_, int kWarps_, int kStages_, bool kQInRegs_, int kMinBlocks_ = 1, int kBlockN_ = 0>
struct KernelTraits {
  static constexpr int D = D_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = kBlockN_ ? kBlockN_ : (D >= 256 ? 32 : 64);
  static constexpr int kStages = kStages_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kMinBlocks = kMinBlocks_;
  // Rows padded by 16 bytes so the 8 row addresses of one ldmatrix phase hit distinct banks.
  static constexpr int kRowStride = D + 8;
  static constexpr int kChunksPerRow = D / 8;  // 16-byte chunks per row
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kKVLoads = kBlockN / kRowsPerPass;  // K (and V) rows each thread copies per tile
  static constexpr int kQLoads = kBlockM / kRowsPerPass;
  static constexpr int kTileElems = kBlockN * kRowStride;
  static constexpr int kStageElems = 2 * kTileElems;  // K then V
  static constexpr int kQElems = kQInRegs ? 0 : kBlockM * kRowStride;
  static constexpr size_t kSmemBytes = size_t(kStages * kStageElems + kQElems) * 2;
  // With fp8 caches: a staging ring of the tiles as stored, one byte per value, rows unpadded, after the above.
  static constexpr size_t kFp8StageBytes = size_t(2) * kBlockN * D;  // K then V
  static constexpr size_t kFp8SmemBytes = kSmemBytes + kStages * kFp8StageBytes;

  static_assert(kStages >= 2, "the ring needs at least two stages");
  static_assert(kThreads % kChunksPerRow == 0 && kKVLoads >= 1 && kBlockN % kRowsPerPass == 0,
                "K/V tile rows must split evenly over the threads");
  static_assert(kBlockM % kRowsPerPass == 0, "Q rows must split evenly over the threads");
  static_assert(!kQInRegs || kBlockM * kRowStride <= kStageElems, "Q is staged in one ring stage");
};

template <typename T>
struct TypeTraits;
template <>
struct TypeTraits<__half> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct TypeTraits<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes == 0 zero-fills the destination (rows past the
// end must be zeros, not garbage: 0 * NaN in the P.V product would poison the row).
__device__ __forceinline__ void cp_async_16(uint32_t dst_shared, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  cp_async_16(smem_addr(dst), src, src_bytes);
}
// 8-byte async copy (an fp8 chunk of 8 values); src_bytes == 0 zero-fills, as above.
__device__ __forceinline__ void cp_async_8(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// A used block-table entry outside [0, num_blocks): row_page / fetch_pages report it as this (below the -1 of "past
// the span") and the row is zero-filled, never read.
constexpr int32_t kBadPage = -2;

// `page` if it is a page of the cache, else kBadPage (one unsigned compare covers negative ids too).
__device__ __forceinline__ int32_t checked_page(int32_t page, int num_blocks) {
  return static_cast<uint32_t>(page) < static_cast<uint32_t>(num_blocks) ? page : kBadPage;
}

// Whether all 8 fp16/bf16 values of a 16-byte chunk are finite: a value is NaN or inf when its exponent bits are all set.
template <typename T>
__device__ __forceinline__ bool finite8(const uint4& v) {
  constexpr uint32_t kExp = std::is_same<T, __half>::value ? 0x7c00u : 0x7f80u;
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) ok = ok && (w[i] & kExp) != kExp && ((w[i] >> 16) & kExp) != kExp;
  return ok;
}

// True for the fp8 storage types of the caches (the partial kernel's KV parameter), false for q's own dtype.
template <typename KV>
constexpr bool kIsFp8 = std::is_same<KV, __nv_fp8_e4m3>::value || std::is_same<KV, __nv_fp8_e5m2>::value;

// 4 fp8 values (a word, first value in the lowest byte) widened to fp16 pairs, exactly: lo the first two, hi the
// last two.
template <typename KV>
__device__ __forceinline__ void widen_fp8x4_half(uint32_t word, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // The conversion reads each 16-bit half of the word in place: no shift and mask to split it first.
  if constexpr (std::is_same<KV, __nv_fp8_e4m3>::value)
    asm("{.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi) : "r"(word));
  else
    asm("{.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e5m2x2 %0, l;\ncvt.rn.f16x2.e5m2x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi) : "r"(word));
#else
  constexpr __nv_fp8_interpretation_t kFormat = std::is_same<KV, __nv_fp8_e4m3>::value ? __NV_E4M3 : __NV_E5M2;
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word & 0xffffu), kFormat);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> 16), kFormat);
  lo = uint32_t(a.x) | (uint32_t(a.y) << 16);
  hi = uint32_t(b.x) | (uint32_t(b.y) << 16);
#endif
}

// 8 fp8 values (an 8-byte chunk, first value in the lowest byte) widened to T, exactly: every e4m3 / e5m2 value is a
// half, and a half with fp8's few mantissa bits is a bfloat16. `finite`: no NaN/inf among them.
template <typename T, typename KV>
__device__ __forceinline__ uint4 widen_fp8x8(const uint2 raw, bool& finite) {
  uint32_t h[4];
  widen_fp8x4_half<KV>(raw.x, h[0], h[1]);
  widen_fp8x4_half<KV>(raw.y, h[2], h[3]);
  const uint4 halves = make_uint4(h[0], h[1], h[2], h[3]);
  finite = finite8<__half>(halves);
  if constexpr (std::is_same<T, __half>::value) {
    return halves;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 pair;
      *reinterpret_cast<uint32_t*>(&pair) = h[i];
      const float2 f = __half22float2(pair);
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
      h[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
    return make_uint4(h[0], h[1], h[2], h[3]);
  }
}

// A tree slot's V chunk bound for shared memory: rows of one tile see different tree slots, and P V would multiply
// this V by the zero weight of rows that do not see the node (0 * NaN = NaN). So a chunk holding a NaN/inf
// (`finite` false) is stored as zeros and its node's bit set in `bad_nodes` (shared); the rows that see the node are
// written as NaN at the end.
__device__ __forceinline__ void zero_bad_tree_v(uint4& v, bool finite, int node, unsigned long long* bad_nodes) {
  if (!finite) {
    v = make_uint4(0u, 0u, 0u, 0u);
    atomicOr(bad_nodes, 1ull << node);
  }
}

// A tree slot's 16-byte V chunk on its way to shared memory (`dst`, a shared address), through zero_bad_tree_v. A
// plain load and store (a tree tile is one or two per CTA), not cp.async.
template <typename T>
__device__ __forceinline__ void copy_tree_v_chunk(uint32_t dst, const void* src, int node,
                                                  unsigned long long* bad_nodes) {
  uint4 v = __ldg(static_cast<const uint4*>(src));
  zero_bad_tree_v(v, finite8<T>(v), node, bad_nodes);
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// 2^x on the SFU; ex2.approx(-inf) = +0, which the masking relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Zeros for out rows [r_begin, r_end) of (b, KV head h); rows are r = t * G + g.
template <typename T, int D>
__device__ __forceinline__ void write_zero_rows(const TreeAttentionParams& p, int b, int h, int r_begin, int r_end,
                                                int tid, int nthreads) {
  constexpr int kPairs = D / 2;
  T* out_b = static_cast<T*>(p.out) + int64_t(b) * p.out_stride_b;
  for (int i = tid; i < (r_end - r_begin) * kPairs; i += nthreads) {
    const int r = r_begin + i / kPairs;
    const int t = r / p.group;
    const int hq = h * p.group + (r - t * p.group);
    *reinterpret_cast<uint32_t*>(out_b + int64_t(t) * p.out_stride_t + int64_t(hq) * p.out_stride_h + 2 * (i % kPairs)) = 0u;
  }
}

enum TileMask : int { kNoMask = 0, kBoundMask = 1, kTreeMask = 2 };

// One online-softmax step of a warp's 16 rows against the K/V tile in (ks, vs).
//   kMode == kBoundMask: columns at slot >= limit are masked (the split's last context tile).
//   kMode == kTreeMask: column j (tree node tree_col0 + j) is kept iff bit j of the row's mask words.
template <typename T, class KT, int kMode>
__device__ __forceinline__ void attend_tile(const T* __restrict__ ks, const T* __restrict__ vs, const T* q_warp_s,
                                            const uint32_t (&qf)[KT::kQInRegs ? KT::D / 16 : 1][4],
                                            float (&o)[KT::D / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                            int col0, int limit, int tree_col0, const uint64_t (&mrow)[2],
                                            float scale_log2, int lane) {
  using Traits = TypeTraits<T>;
  constexpr int D = KT::D;
  constexpr int BN = KT::kBlockN;
  constexpr int LDS = KT::kRowStride;
  constexpr int kNT = BN / 8;
  constexpr int kDT = D / 8;
  const int tig = lane % 4;

  // S = Q K^T: 16 rows x BN tokens.
  float s[kNT][4];
#pragma unroll
  for (int i = 0; i < kNT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    if constexpr (KT::kQInRegs) {
      a[0] = qf[kk][0];
      a[1] = qf[kk][1];
      a[2] = qf[kk][2];
      a[3] = qf[kk][3];
    } else {
      ldmatrix_x4(a, q_warp_s + (lane & 15) * LDS + kk * 16 + (lane >> 4) * 8);
    }
#pragma unroll
    for (int nj = 0; nj < kNT / 2; ++nj) {
      uint32_t bk[4];
      ldmatrix_x4(bk, ks + (nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
      Traits::mma(s[2 * nj], a, bk[0], bk[1]);
      Traits::mma(s[2 * nj + 1], a, bk[2], bk[3]);
    }
  }

  // Scale into the log2 domain; masked entries become -inf (p = 0).
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = nt * 8 + 2 * tig + (e & 1);
      bool ok = true;
      if constexpr (kMode == kBoundMask) ok = col0 + c < limit;
      if constexpr (kMode == kTreeMask) {
        const int j = tree_col0 + c;  // tree node of this column; T <= 64
        ok = (BN <= 64 || j < 64) && ((mrow[e >> 1] >> (j & 63)) & 1u);
      }
      s[nt][e] = ok ? s[nt][e] * scale_log2 : -INFINITY;
    }
  }

  // Online softmax; the 4 lanes of a quad share a row.
  float alpha[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hi], s[nt][2 * hi + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(row_max[hi], mx);
    // A row with nothing unmasked yet keeps m = -inf; subtract 0 then so ex2 gives 0, not NaN.
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[hi] = fast_exp2(row_max[hi] - m_use);
    row_max[hi] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      s[nt][2 * hi] = fast_exp2(s[nt][2 * hi] - m_use);
      s[nt][2 * hi + 1] = fast_exp2(s[nt][2 * hi + 1] - m_use);
      sum += s[nt][2 * hi] + s[nt][2 * hi + 1];
    }
    row_sum[hi] = row_sum[hi] * alpha[hi] + sum;
  }
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    o[dt][0] *= alpha[0];
    o[dt][1] *= alpha[0];
    o[dt][2] *= alpha[1];
    o[dt][3] *= alpha[1];
  }

  // O += P V (P rounded to the input dtype, as FlashAttention does).
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    uint32_t a[4];
    a[0] = Traits::pack(s[2 * kk][0], s[2 * kk][1]);
    a[1] = Traits::pack(s[2 * kk][2], s[2 * kk][3]);
    a[2] = Traits::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = Traits::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
    for (int dj = 0; dj < D / 16; ++dj) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, vs + (kk * 16 + (lane & 15)) * LDS + dj * 16 + (lane >> 4) * 8);
      Traits::mma(o[2 * dj], a, bv[0], bv[1]);
      Traits::mma(o[2 * dj + 1], a, bv[2], bv[3]);
    }
  }
}

// Grid (num_splits * row_chunks, B, Hkv); chunk index fastest. KV: the caches' storage, T or an fp8 type. See the
// file comment.
template <typename T, class KT, typename KV = T>
__global__ void __launch_bounds__(KT::kThreads, KT::kMinBlocks) tree_attention_partial_kernel(const TreeAttentionParams p) {
  using Traits = TypeTraits<T>;
  constexpr bool kFp8 = kIsFp8<KV>;
  static_assert(kFp8 || std::is_same<KV, T>::value, "the caches hold q's dtype or fp8");
  constexpr int D = KT::D;
  constexpr int BN = KT::kBlockN;
  constexpr int BM = KT::kBlockM;
  constexpr int LDS = KT::kRowStride;
  constexpr int kStages = KT::kStages;
  constexpr int kDT = D / 8;
  constexpr int CPR = KT::kChunksPerRow;
  constexpr int RPP = KT::kRowsPerPass;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ring = reinterpret_cast<T*>(smem_raw);  // [kStages][K, V][BN][LDS]
  T* q_s = ring + (KT::kQInRegs ? (kStages - 1) * KT::kStageElems : kStages * KT::kStageElems);
  unsigned char* stage8 = smem_raw + KT::kSmemBytes;  // [kStages][K, V][BN][D] fp8 (kFp8 only)

  const int num_chunks = gridDim.x / p.num_splits;
  const int chunk_ix = blockIdx.x % num_chunks;
  const int m0 = chunk_ix * BM;
  const int b = blockIdx.y;
  const int h = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int gid = lane / 4;  // row (and row + 8) of the mma fragments this lane holds
  const int tig = lane % 4;  // column pair 2*tig, 2*tig+1 within each n-tile

  const int G = p.group;
  const int ctx = p.context_lens[b];
  const int nn = p.num_nodes[b];
  const int M = nn * G;
  const int TG = p.num_tree * G;
  const int used = (ctx + p.split_len - 1) / p.split_len;  // non-empty context splits
  const int last = max(used, 1) - 1;                        // the split that also covers the tree
  const int split = blockIdx.x / num_chunks;
  if (split > last) return;
  const bool direct = used <= 1;  // this CTA completes its rows: write out, skip the scratch
  if (m0 >= M) {  // a chunk of padding rows only (num_nodes[b] < T)
    if (direct) write_zero_rows<T, D>(p, b, h, m0, min(m0 + BM, TG), tid, KT::kThreads);
    return;
  }
  const int split_begin = split * p.split_len;
  const int kv_end = min(split_begin + p.split_len, ctx);
  const int n_ctx_tiles = kv_end > split_begin ? (kv_end - split_begin + BN - 1) / BN : 0;
  const bool ctx_tail = n_ctx_tiles > 0 && (kv_end - split_begin) % BN != 0;
  const int num_tiles = n_ctx_tiles + (split == last ? (nn + BN - 1) / BN : 0);
  const float scale_log2 = p.sm_scale * kLog2e;

  // This thread copies 16-byte chunk `chunk` of tile rows row0 + i * RPP (K and V alike).
  const int chunk = tid % CPR;
  const int row0 = tid / CPR;
  const int32_t* bt = p.block_table + int64_t(b) * p.bt_stride_b;
  const KV* k_base = static_cast<const KV*>(p.k_cache) + int64_t(h) * p.k_stride_head + chunk * 8;
  const KV* v_base = static_cast<const KV*>(p.v_cache) + int64_t(h) * p.v_stride_head + chunk * 8;
  const int shift = p.block_shift;  // log2(block_size), or -1 when it is not a power of two

  // Tile i covers slots [begin, begin + BN), valid below limit: context tiles of this split, then
  // the tree tiles at ctx + j.
  auto tile_begin = [&](int i) { return i < n_ctx_tiles ? split_begin + i * BN : ctx + (i - n_ctx_tiles) * BN; };
  auto tile_limit = [&](int i) { return i < n_ctx_tiles ? kv_end : ctx + nn; };
  // Page ids of this thread's rows of tile i (-1: past the end; kBadPage: out of the cache, flagged), zero-filled.
  bool page_bad = false;
  auto fetch_pages = [&](int i, int (&pg)[KT::kKVLoads]) {
    const int begin = tile_begin(i), limit = i < num_tiles ? tile_limit(i) : begin;
#pragma unroll
    for (int k = 0; k < KT::kKVLoads; ++k) {
      const int slot = begin + row0 + k * RPP;
      pg[k] = slot < limit ? checked_page(__ldg(bt + (shift >= 0 ? slot >> shift : slot / p.block_size)), p.num_blocks)
                           : -1;
      page_bad = page_bad || pg[k] == kBadPage;
    }
  };
  // Tree nodes whose V (this KV head) holds a NaN/inf: see copy_tree_v_chunk.
  __shared__ unsigned long long bad_nodes;
  auto issue_tile = [&](int i, int stage, const int (&pg)[KT::kKVLoads]) {
    const int begin = tile_begin(i);
    T* k_s = ring + stage * KT::kStageElems;
    T* v_s = k_s + KT::kTileElems;
#pragma unroll
    for (int k = 0; k < KT::kKVLoads; ++k) {
      const int n = row0 + k * RPP;
      const int slot = begin + n;
      const int off = shift >= 0 ? slot & ((1 << shift) - 1) : slot % p.block_size;
      const bool valid = pg[k] >= 0;
      const int64_t page = valid ? pg[k] : 0;
      const KV* k_src = valid ? k_base + page * p.k_stride_block + off * p.k_stride_token : k_base;
      const KV* v_src = valid ? v_base + page * p.v_stride_block + off * p.v_stride_token : v_base;
      if constexpr (kFp8) {  // as stored; widen_tile moves them to the 16-bit ring once they have landed
        unsigned char* k8 = stage8 + stage * KT::kFp8StageBytes + n * D + chunk * 8;
        cp_async_8(k8, k_src, valid ? 8 : 0);
        cp_async_8(k8 + BN * D, v_src, valid ? 8 : 0);
      } else {
        cp_async_16(k_s + n * LDS + chunk * 8, k_src, valid ? 16 : 0);
        if (valid && i >= n_ctx_tiles)
          copy_tree_v_chunk<T>(smem_addr(v_s + n * LDS + chunk * 8), v_src, slot - ctx, &bad_nodes);
        else
          cp_async_16(v_s + n * LDS + chunk * 8, v_src, valid ? 16 : 0);
      }
    }
  };
  // fp8: this thread's chunks of tile i, landed in the staging ring, widened into the 16-bit ring (a tree slot's V
  // through zero_bad_tree_v, as copy_tree_v_chunk does).
  auto widen_tile = [&](int i) {
    const int stage = i % kStages, begin = tile_begin(i), limit = tile_limit(i);
    T* k_s = ring + stage * KT::kStageElems;
    T* v_s = k_s + KT::kTileElems;
#pragma unroll
    for (int k = 0; k < KT::kKVLoads; ++k) {
      const int n = row0 + k * RPP;
      const unsigned char* k8 = stage8 + stage * KT::kFp8StageBytes + n * D + chunk * 8;
      bool finite;
      *reinterpret_cast<uint4*>(k_s + n * LDS + chunk * 8) =
          widen_fp8x8<T, KV>(*reinterpret_cast<const uint2*>(k8), finite);
      uint4 v = widen_fp8x8<T, KV>(*reinterpret_cast<const uint2*>(k8 + BN * D), finite);
      if (i >= n_ctx_tiles && begin + n < limit) zero_bad_tree_v(v, finite, begin + n - ctx, &bad_nodes);
      *reinterpret_cast<uint4*>(v_s + n * LDS + chunk * 8) = v;
    }
  };
  if (tid == 0) bad_nodes = 0ull;
  __syncthreads();  // before any tile is issued

  // Prologue: Q (its own commit group, the oldest), then tiles 0 .. kStages-2.
  {
    const T* q_base = static_cast<const T*>(p.q) + int64_t(b) * p.q_stride_b + chunk * 8;
#pragma unroll
    for (int k = 0; k < KT::kQLoads; ++k) {
      const int i = row0 + k * RPP;
      const int r = m0 + i;
      const bool valid = r < M;
      const T* src = q_base;
      if (valid) {
        const int t = r / G;
        src += int64_t(t) * p.q_stride_t + int64_t(h * G + (r - t * G)) * p.q_stride_h;
      }
      cp_async_16(q_s + i * LDS + chunk * 8, src, valid ? 16 : 0);
    }
    cp_async_commit();
  }
  int pg[KT::kKVLoads];
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    fetch_pages(i, pg);
    if (i < num_tiles) issue_tile(i, i, pg);
    cp_async_commit();
  }
  fetch_pages(kStages - 1, pg);

  const int wrow0 = m0 + warp * 16;  // first query row of this warp
  const bool warp_active = wrow0 < M;
  const T* q_warp_s = q_s + warp * 16 * LDS;

  uint32_t qf[KT::kQInRegs ? D / 16 : 1][4];
  if constexpr (KT::kQInRegs) {
    cp_async_wait<kStages - 1>();  // the Q group
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], q_warp_s + (lane & 15) * LDS + kk * 16 + (lane >> 4) * 8);
    // The first refill (iteration 0, after its barrier) overwrites this stage.
  }

  // Ancestor bits of this lane's two rows, bit j = tree node j (zero for rows past M: fully masked,
  // never written). A 64-bit word, not an array, so the per-tile bit pick stays in registers.
  uint64_t mrow[2] = {0ull, 0ull};
  if (split == last) {
    const int32_t* mask_b = p.tree_mask + int64_t(b) * p.num_tree * p.mask_words;
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = wrow0 + gid + 8 * hi;
      if (r < M) {
        const int32_t* w = mask_b + (r / G) * p.mask_words;
        mrow[hi] = static_cast<uint32_t>(__ldg(w));
        if (p.mask_words > 1) mrow[hi] |= uint64_t(static_cast<uint32_t>(__ldg(w + 1))) << 32;
      }
    }
  }

  float o[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // rows gid and gid + 8, log2 domain
  float row_sum[2] = {0.f, 0.f};              // this lane's share; reduced over the quad at the end

  for (int it = 0; it < num_tiles; ++it) {
    cp_async_wait<kStages - 2>();  // tile `it` has landed (for this thread's copies) ...
    if constexpr (kFp8) widen_tile(it);  // (its 16-bit stage was last read at tile it - kStages, barriers ago)
    __syncthreads();               // ... for every thread's, and tile it-1's stage is free
    {
      const int nxt = it + kStages - 1;
      if (nxt < num_tiles) issue_tile(nxt, nxt % kStages, pg);
      cp_async_commit();  // possibly empty: keeps the group count uniform for wait_group
      fetch_pages(nxt + 1, pg);
    }
    if (warp_active) {
      const T* ks = ring + (it % kStages) * KT::kStageElems;
      const T* vs = ks + KT::kTileElems;
      if (it < n_ctx_tiles) {
        if (ctx_tail && it == n_ctx_tiles - 1) {
          attend_tile<T, KT, kBoundMask>(ks, vs, q_warp_s, qf, o, row_max, row_sum, tile_begin(it), kv_end, 0, mrow,
                                         scale_log2, lane);
        } else {
          attend_tile<T, KT, kNoMask>(ks, vs, q_warp_s, qf, o, row_max, row_sum, 0, 0, 0, mrow, scale_log2, lane);
        }
      } else {
        attend_tile<T, KT, kTreeMask>(ks, vs, q_warp_s, qf, o, row_max, row_sum, 0, 0, (it - n_ctx_tiles) * BN, mrow,
                                      scale_log2, lane);
      }
    }
  }
  cp_async_wait<0>();  // no copy may outlive the CTA's shared memory

  // An out-of-range page makes every row of this CTA NaN; a NaN/inf tree V the rows that see its node.
  const bool poisoned = __syncthreads_or(page_bad) != 0;
  const uint64_t bad = bad_nodes;  // complete: every tile was issued before the loop's last barrier
  const int64_t slot_row = (int64_t(b * p.num_kv_heads + h) * (p.num_splits + 1) + split) * TG;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float l = row_sum[hi];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = wrow0 + gid + 8 * hi;
    // l == 0: no key seen (a padding row of an empty context). A NaN l (a NaN score) must stay NaN, in O and the LSE.
    const float inv = poisoned || (mrow[hi] & bad) ? NAN : (l != 0.f ? p.v_scale / l : 0.f);
    if (direct) {
      if (r < TG) {
        // Rows past M (padding nodes) are zeros, whatever their zero-filled Q met (0 * NaN would not be zero).
        const int t = r / G;
        T* dst = static_cast<T*>(p.out) + int64_t(b) * p.out_stride_b + int64_t(t) * p.out_stride_t +
                 int64_t(h * G + (r - t * G)) * p.out_stride_h + 2 * tig;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
          *reinterpret_cast<uint32_t*>(dst + dt * 8) =
              r < M ? Traits::pack(o[dt][2 * hi] * inv, o[dt][2 * hi + 1] * inv) : 0u;
      }
    } else if (r < M) {
      float* dst = p.partial_out + (slot_row + r) * D + 2 * tig;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[dt][2 * hi] * inv, o[dt][2 * hi + 1] * inv);
      // A NaN row keeps a NaN LSE (not -inf, which the merge would read as an empty split and skip).
      if (tig == 0)
        p.partial_lse[slot_row + r] = inv != inv ? NAN : (l != 0.f ? (row_max[hi] + __log2f(l)) * kLn2 : -INFINITY);
    }
  }
}

constexpr int kMergeWarps = 4;

// One warp per output row (b, t, query head) of a request with more than one used split; each lane
// owns D/32 contiguous elements. Requests with one used split were written by the partial kernel.
template <typename T, int D>
__global__ void __launch_bounds__(kMergeWarps * 32) tree_attention_merge_kernel(const TreeAttentionParams p) {
  constexpr int kPerLane = D / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  const int64_t total = int64_t(p.batch) * p.num_tree * p.num_q_heads;
  if (row >= total) return;
  const int hq = int(row % p.num_q_heads);
  const int t = int((row / p.num_q_heads) % p.num_tree);
  const int b = int(row / (int64_t(p.num_q_heads) * p.num_tree));
  const int used = (p.context_lens[b] + p.split_len - 1) / p.split_len;
  if (used <= 1) return;
  T* dst = static_cast<T*>(p.out) + int64_t(b) * p.out_stride_b + int64_t(t) * p.out_stride_t +
           int64_t(hq) * p.out_stride_h + lane * kPerLane;

  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  if (t < p.num_nodes[b]) {
    const int h = hq / p.group;
    const int TG = p.num_tree * p.group;
    const int64_t base = int64_t(b * p.num_kv_heads + h) * (p.num_splits + 1) * TG + t * p.group + (hq - h * p.group);
    // A NaN LSE (a split that met a NaN) makes the row NaN; fmaxf would skip it, so it is flagged apart.
    float m = -INFINITY;
    bool nan_row = false;
    for (int s = 0; s < used; ++s) {
      const float lse = p.partial_lse[base + int64_t(s) * TG];
      nan_row = nan_row || lse != lse;
      m = fmaxf(m, lse);
    }
    if (m != -INFINITY) {
      float wsum = 0.f;
      for (int s = 0; s < used; ++s) {
        const int64_t idx = base + int64_t(s) * TG;
        const float lse = p.partial_lse[idx];
        // An empty slot's O is never read; every other one is, even at weight 0, so a NaN in it still reaches the row.
        if (lse == -INFINITY || lse != lse) continue;
        const float w = __expf(lse - m);
        wsum += w;
        const float* src = p.partial_out + idx * D + lane * kPerLane;
#pragma unroll
        for (int i = 0; i < kPerLane; i += 2) {
          const float2 v = *reinterpret_cast<const float2*>(src + i);
          acc[i] += w * v.x;
          acc[i + 1] += w * v.y;
        }
      }
      const float inv = 1.f / wsum;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] *= inv;
    }
    if (nan_row) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] = NAN;
    }
  }
#pragma unroll
  for (int i = 0; i < kPerLane; i += 2)
    *reinterpret_cast<uint32_t*>(dst + i) = TypeTraits<T>::pack(acc[i], acc[i + 1]);
}

}  // namespace tree_attn
}  // namespace tlt
