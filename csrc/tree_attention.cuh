// Tree attention over a paged KV cache (flash-decoding with a tree split). Torch-free.
//
// For request b, KV head h and query row r = t * G + g (query head h * G + g of draft node t):
//
//   out[b, t, h*G+g] = softmax_j(scale * q . k_j) v_j   over   j in context[0, ctx_b)  U  {tree node j : j anc-or-self of t}
//
// Step 1 (partial kernel, one CTA per (split, 64-row chunk, b, h)): split s < S covers context
// tokens [s * split_len, min((s+1) * split_len, ctx_b)) without a mask; split S covers the tree
// tokens at cache slots ctx_b + j under the packed ancestor mask. Every CTA computes, for its 64 of
// the M = num_nodes[b] * G rows of the group, the normalized partial output O_s = sum_j p_j v_j / l_s
// and lse_s = log(l_s) with the usual online softmax. The chunks of a split are adjacent in launch
// order, so they run together and each K/V tile comes from HBM about once (the others hit L2).
// Step 2 (merge kernel) combines the S + 1 partials: out = sum_s exp(lse_s - m) O_s / sum_s exp(lse_s - m).
//
// Partial kernel layout: 4 warps, BLOCK_M = 64 query rows per CTA (16 per warp), K/V tiles of
// BLOCK_N tokens gathered through the block table with 16-byte cp.async (zero-filled past the end)
// into a double-buffered, row-padded shared buffer. Tensor cores via mma.sync.m16n8k16 (fp16/bf16
// in, fp32 accumulate); ldmatrix feeds Q and K, ldmatrix.trans feeds V; P goes from the S
// accumulators straight into A fragments (the C layout of m16n8 equals the A layout of m16n8k16 for
// two adjacent n-tiles). The online softmax runs in the log2 domain (exp2 with scale * log2(e)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "tree_attention.h"

namespace tlt {
namespace tree_attn {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * 32;
constexpr int kBlockM = kNumWarps * 16;  // query rows per pass
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// K/V tile length: keeps the fp32 O accumulator (D/2 registers per thread) plus the S tile
// (BLOCK_N/2 registers) under the register budget without spills.
template <int D>
struct TileConfig {
  static constexpr int kBlockN = D >= 256 ? 32 : 64;
  // Rows are padded by 16 bytes so the 8 row addresses of one ldmatrix phase hit distinct banks.
  static constexpr int kRowStride = D + 8;  // elements
  static constexpr int kChunksPerRow = D * 2 / 16;  // 16-byte chunks per K/V/Q row
  static constexpr size_t kSmemBytes =
      size_t(kBlockM + 4 * kBlockN) * kRowStride * 2;  // Q + 2 stages of (K, V)
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
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
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
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes == 0 zero-fills the destination (rows past the
// end must be zeros, not garbage: 0 * NaN in the P.V product would poison the row).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
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

// Gather BLOCK_N K and V rows (cache slots [tile_begin, tile_begin + BLOCK_N), valid below kv_end)
// of KV head `h` of request `b` into shared memory. Thread `tid` copies chunk tid % CPR of rows
// tid / CPR, tid / CPR + ROWS_PER_PASS, ...
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(const TreeAttentionParams& p, T* k_s, T* v_s, int b, int h, int tile_begin,
                                             int kv_end, int tid) {
  using Cfg = TileConfig<D>;
  constexpr int kRowsPerPass = kNumThreads / Cfg::kChunksPerRow;
  const int chunk = tid % Cfg::kChunksPerRow;
  const int32_t* bt = p.block_table + int64_t(b) * p.bt_stride_b;
  const T* k_base = static_cast<const T*>(p.k_cache) + int64_t(h) * p.k_stride_head + chunk * 8;
  const T* v_base = static_cast<const T*>(p.v_cache) + int64_t(h) * p.v_stride_head + chunk * 8;
  static_assert(Cfg::kBlockN % kRowsPerPass == 0, "K/V tile rows must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / kRowsPerPass; ++i) {
    const int n = tid / Cfg::kChunksPerRow + i * kRowsPerPass;
    const int slot = tile_begin + n;
    const bool valid = slot < kv_end;
    const T* k_src = k_base;
    const T* v_src = v_base;
    if (valid) {
      const int64_t page = bt[slot / p.block_size];
      const int64_t off = slot % p.block_size;
      k_src += page * p.k_stride_block + off * p.k_stride_token;
      v_src += page * p.v_stride_block + off * p.v_stride_token;
    }
    const int dst = n * Cfg::kRowStride + chunk * 8;
    cp_async_16(k_s + dst, k_src, valid ? 16 : 0);
    cp_async_16(v_s + dst, v_src, valid ? 16 : 0);
  }
}

// Q rows m0 .. m0 + BLOCK_M - 1 of group (b, h) into shared memory (zeros past M).
template <typename T, int D>
__device__ __forceinline__ void load_q_chunk(const TreeAttentionParams& p, T* q_s, int b, int h, int m0, int M,
                                             int tid) {
  using Cfg = TileConfig<D>;
  constexpr int kRowsPerPass = kNumThreads / Cfg::kChunksPerRow;
  const int chunk = tid % Cfg::kChunksPerRow;
  const T* q_base = static_cast<const T*>(p.q) + int64_t(b) * p.q_stride_b + chunk * 8;
  static_assert(kBlockM % kRowsPerPass == 0, "Q rows must split evenly over the threads");
#pragma unroll
  for (int k = 0; k < kBlockM / kRowsPerPass; ++k) {
    const int i = tid / Cfg::kChunksPerRow + k * kRowsPerPass;
    const int r = m0 + i;
    const bool valid = r < M;
    const T* src = q_base;
    if (valid) {
      const int t = r / p.group;
      const int g = r - t * p.group;
      src += int64_t(t) * p.q_stride_t + int64_t(h * p.group + g) * p.q_stride_h;
    }
    cp_async_16(q_s + i * Cfg::kRowStride + chunk * 8, src, valid ? 16 : 0);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kNumThreads) tree_attention_partial_kernel(const TreeAttentionParams p) {
  using Cfg = TileConfig<D>;
  using Traits = TypeTraits<T>;
  constexpr int BN = Cfg::kBlockN;
  constexpr int LDS = Cfg::kRowStride;
  constexpr int kNT = BN / 8;  // n-tiles of the S tile
  constexpr int kDT = D / 8;   // n-tiles of the O tile

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* k_s = q_s + kBlockM * LDS;       // [2][BN][LDS]
  T* v_s = k_s + 2 * BN * LDS;        // [2][BN][LDS]

  // Row chunks of one split are adjacent in launch order: they run concurrently and read the same
  // K/V tiles, so only the first of them fetches a tile from HBM and the others hit L2.
  const int num_row_chunks = gridDim.x / (p.num_splits + 1);
  const int split = blockIdx.x / num_row_chunks;
  const int m0 = (blockIdx.x % num_row_chunks) * kBlockM;
  const int b = blockIdx.y;
  const int h = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int gid = lane / 4;  // row (and row + 8) of the mma fragments this lane holds
  const int tig = lane % 4;  // column pair 2*tig, 2*tig+1 within each n-tile

  const int ctx = p.context_lens[b];
  const int nn = p.num_nodes[b];
  const int M = nn * p.group;
  const int TG = p.num_tree * p.group;
  const bool is_tree = split == p.num_splits;
  int kv_begin, kv_end;
  if (is_tree) {
    kv_begin = ctx;
    kv_end = ctx + nn;
  } else {
    kv_begin = split * p.split_len;
    kv_end = min(kv_begin + p.split_len, ctx);
  }
  const int64_t row_base = (int64_t(b * p.num_kv_heads + h) * (p.num_splits + 1) + split) * TG;
  float* lse_out = p.partial_lse + row_base;
  float* o_out = p.partial_out + row_base * D;

  if (m0 >= M) return;  // a chunk past this request's rows (num_nodes[b] < T)
  if (kv_begin >= kv_end) {  // empty context split: the merge skips lse == -inf
    for (int r = m0 + tid; r < min(M, m0 + kBlockM); r += kNumThreads) lse_out[r] = -INFINITY;
    return;
  }
  const int num_tiles = (kv_end - kv_begin + BN - 1) / BN;
  const float scale_log2 = p.sm_scale * kLog2e;
  const int32_t* mask_b = p.tree_mask + int64_t(b) * p.num_tree * p.mask_words;

  {
    // Prologue: Q chunk and the first K/V tile share one commit group.
    load_q_chunk<T, D>(p, q_s, b, h, m0, M, tid);
    load_kv_tile<T, D>(p, k_s, v_s, b, h, kv_begin, kv_end, tid);
    cp_async_commit();

    const int wrow0 = m0 + warp * 16;  // first query row of this warp
    const bool warp_active = wrow0 < M;
    float o[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};  // rows gid and gid + 8, log2 domain
    float row_sum[2] = {0.f, 0.f};              // this lane's share; reduced over the quad at the end

    for (int it = 0; it < num_tiles; ++it) {
      const int stage = it & 1;
      if (it + 1 < num_tiles) {
        load_kv_tile<T, D>(p, k_s + (stage ^ 1) * BN * LDS, v_s + (stage ^ 1) * BN * LDS, b, h,
                           kv_begin + (it + 1) * BN, kv_end, tid);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();

      if (warp_active) {
        const T* ks = k_s + stage * BN * LDS;
        const T* vs = v_s + stage * BN * LDS;
        const int tile_begin = kv_begin + it * BN;

        // S = Q K^T for this warp's 16 rows x BN tokens.
        float s[kNT][4];
#pragma unroll
        for (int i = 0; i < kNT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4(a, q_s + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int nj = 0; nj < kNT / 2; ++nj) {
            uint32_t bk[4];
            ldmatrix_x4(bk, ks + (nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
            Traits::mma(s[2 * nj], a, bk[0], bk[1]);
            Traits::mma(s[2 * nj + 1], a, bk[2], bk[3]);
          }
        }

        // Scale into the log2 domain and mask: tokens past kv_end, and in the tree split the
        // non-ancestors of each row's node (rows past M are never written; mask them all).
        const bool need_bounds = tile_begin + BN > kv_end;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = tile_begin + nt * 8 + 2 * tig + (e & 1);
            bool ok = !need_bounds || col < kv_end;
            if (is_tree) {
              const int r = wrow0 + gid + 8 * (e >> 1);
              if (ok && r < M) {
                const int j = col - ctx;  // tree node of this key, 0 <= j < num_nodes
                const int t = r / p.group;
                ok = (__ldg(mask_b + t * p.mask_words + (j >> 5)) >> (j & 31)) & 1;
              } else {
                ok = false;
              }
            }
            s[nt][e] = ok ? s[nt][e] * scale_log2 : -INFINITY;
          }
        }

        // Online softmax over the quad that shares a row.
        float alpha[2];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hi], s[nt][2 * hi + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(row_max[hi], mx);
          // A row with nothing unmasked yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          alpha[hi] = exp2f(row_max[hi] - m_use);
          row_max[hi] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            s[nt][2 * hi] = exp2f(s[nt][2 * hi] - m_use);
            s[nt][2 * hi + 1] = exp2f(s[nt][2 * hi + 1] - m_use);
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

        // O += P V. The accumulators of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
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
      __syncthreads();  // the next iteration refills the stage just read
    }

    if (warp_active) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        float l = row_sum[hi];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = wrow0 + gid + 8 * hi;
        if (r < M) {
          const float inv = l > 0.f ? 1.f / l : 0.f;
          float* dst = o_out + int64_t(r) * D + 2 * tig;
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[dt][2 * hi] * inv, o[dt][2 * hi + 1] * inv);
          }
          if (tig == 0) lse_out[r] = l > 0.f ? (row_max[hi] + __log2f(l)) * kLn2 : -INFINITY;
        }
      }
    }
  }
}

// One warp per output row (b, t, head); each lane owns D/32 contiguous elements.
template <typename T, int D>
__global__ void __launch_bounds__(kNumThreads) tree_attention_merge_kernel(const TreeAttentionParams p) {
  constexpr int kPerLane = D / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kNumWarps + threadIdx.x / 32;
  const int64_t total = int64_t(p.batch) * p.num_tree * p.num_q_heads;
  if (row >= total) return;
  const int hq = int(row % p.num_q_heads);
  const int t = int((row / p.num_q_heads) % p.num_tree);
  const int b = int(row / (int64_t(p.num_q_heads) * p.num_tree));
  T* dst = static_cast<T*>(p.out) + int64_t(b) * p.out_stride_b + int64_t(t) * p.out_stride_t +
           int64_t(hq) * p.out_stride_h + lane * kPerLane;

  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;

  if (t < p.num_nodes[b]) {
    const int h = hq / p.group;
    const int g = hq - h * p.group;
    const int TG = p.num_tree * p.group;
    const int64_t base = int64_t(b * p.num_kv_heads + h) * (p.num_splits + 1) * TG + t * p.group + g;
    float m = -INFINITY;
    for (int s = 0; s <= p.num_splits; ++s) m = fmaxf(m, p.partial_lse[base + int64_t(s) * TG]);
    if (m != -INFINITY) {
      float wsum = 0.f;
      for (int s = 0; s <= p.num_splits; ++s) {
        const int64_t idx = base + int64_t(s) * TG;
        const float lse = p.partial_lse[idx];
        if (lse == -INFINITY) continue;  // empty split: its partial_out was never written
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
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) dst[i] = TypeTraits<T>::from_float(acc[i]);
}

}  // namespace tree_attn
}  // namespace tlt
