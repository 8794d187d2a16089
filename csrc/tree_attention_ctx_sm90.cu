// The context part of tree attention on sm_90 wgmma (issue 3), the CUDA twin of the Gluon kernel in
// tlt_kernels/_triton/tree_attention_gluon.py. Reached through _C._tree_attention_context_sm90: the CUDA backend
// takes it by default for one-split plans with 64 < T*G <= 128 (TLT_TREE_ATTENTION_CUDA_CTX, see
// tlt_kernels/_cuda/tree_attention.py); bench/gluon_context_attention.py times it beside the Gluon kernel.
//
// One CTA = two warpgroups = 128 query rows (row m = t * G + g: node t, query head h * G + g; rows >= T * G are
// zero) of one (split, KV head, request), over the split's whole kBlockN-token tiles, in FA3's intra-warpgroup
// order (iteration j):
//
//   S_j = Q K_j^T; O += P_{j-1} V_{j-1}     two async wgmmas, issued back to back (tensor cores)
//   wait S_j; P_j = softmax(S_j)            meanwhile (CUDA cores); base 2, the scale folded into the exponent
//   wait P_{j-1} V_{j-1}; O = alpha_j O      no accumulator stays in flight across the loop's back edge
//
// Two instantiations (p.config picks, see the launcher):
//   kBlockN = 128, kStages = 3 (default): S is m64n128 (64 fp32 per thread), P V is 8 k-steps; Q 32 KB + 3 x (K 32 KB
//     + V 32 KB) = 224 KB. Every iteration pays two barriers, a cp.async wait and two wgmma waits whatever the tile,
//     and at 64 tokens that fixed cost dominated (66-72% of the HBM floor on an H100 against the Gluon kernel's
//     75-78%, 83-86% with its 128-token tile), so the 128-token tile halves it per token.
//   kBlockN = 64, kStages = 4: S is m64n64, P V 4 k-steps; Q 32 KB + 4 x (16 + 16) KB = 160 KB. For split lengths
//     that are multiples of 64 only.
//
// K/V are gathered through the block table by 16-byte cp.async into a ring of kStages swizzled tiles
// (csrc/wgmma_sm90.cuh). Writes the split's partial (o, natural-log lse) in the plan's scratch layout, row
// ((b * Hkv + h) * (S + 1) + split) * (T * G) + m; a split without a whole tile writes lse = -inf, o = 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch_status.h"
#include "tree_attention.cuh"  // tree_attn::cp_async_16 / cp_async_commit / cp_async_wait
#include "wgmma_sm90.cuh"

namespace tlt {
namespace {

constexpr int kD = 128, kBlockM = 128, kThreads = 256;

// One instantiation per tile width: the 128-token tile halves the per-tile fixed cost (two barriers, the cp.async
// wait, two wgmma waits) that dominates at 64 tokens, at the price of one ring slot (shared memory: Q 32 KB +
// kStages x 2 x kBlockN x 256 B must stay within the 227 KB opt-in limit).
template <int kBlockN_, int kStages_>
struct CtxConfig {
  static constexpr int kBlockN = kBlockN_, kStages = kStages_;
  static_assert(kBlockN == 64 || kBlockN == 128, "S is one m64n64 or m64n128 wgmma per k-step");
  static_assert(kStages >= 2, "the loop refills tile j - 1's slot while tile j is read");
  static constexpr int kTileBytes = kBlockN * kD * 2;  // one K or V tile
  // Q + K ring + V ring, plus 1 KB to align the base: the 128-byte swizzle is a function of address bits 4-9, so
  // every tile must start 1024-byte aligned, which the dynamic shared-memory window does not promise.
  static constexpr int kSmemBytes = kBlockM * kD * 2 + 2 * kStages * kTileBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 opt-in shared-memory limit");
  static constexpr int kChunksPerThread = kBlockN * (kD / 8) / kThreads;  // 16-byte chunks of K (and of V) per thread
  static constexpr int kScores = kBlockN / 2;                              // S accumulator floats per thread
};
using Ctx64 = CtxConfig<64, 4>;    // 160 KB + 1 KB
using Ctx128 = CtxConfig<128, 3>;  // 224 KB + 1 KB

using wgmma::fence_regs;

// S (+)= Q K^T for one k-step, the instruction picked by the accumulator's width.
template <typename T>
__device__ __forceinline__ void mma_s(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  wgmma::mma_m64n64k16_ss<T>(d, da, db, scale_d);
}
template <typename T>
__device__ __forceinline__ void mma_s(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  wgmma::mma_m64n128k16_ss<T>(d, da, db, scale_d);
}

// Page ids of this thread's rows of the tile starting at token n0 (row (tid + it * kThreads) / (kD / 8)). Read one
// iteration ahead of the copies: the block-table load's latency would otherwise sit between each iteration's barrier
// and its cp.asyncs. Tiles past the split (valid = false) get page 0: read and never used, so the group count stays
// uniform.
template <int kChunks>
__device__ __forceinline__ void tile_pages(const TreeAttentionParams& p, const int32_t* bt_row, int n0, bool valid,
                                           int32_t (&pages)[kChunks]) {
#pragma unroll
  for (int it = 0; it < kChunks; ++it) {
    const int row = (threadIdx.x + it * kThreads) / (kD / 8);
    pages[it] = valid ? bt_row[(n0 + row) / p.block_size] : 0;
  }
}

// K and V rows n0 .. n0 + kBlockN - 1 of KV head h (pages from tile_pages) into one ring slot, one commit group.
template <typename T, int kBlockN, int kChunks>
__device__ __forceinline__ void issue_tile(const TreeAttentionParams& p, const int32_t (&pages)[kChunks], int h,
                                           int n0, unsigned char* k_slot, unsigned char* v_slot) {
  const T* K = static_cast<const T*>(p.k_cache);
  const T* V = static_cast<const T*>(p.v_cache);
#pragma unroll
  for (int it = 0; it < kChunks; ++it) {
    const int i = threadIdx.x + it * kThreads;
    const int row = i / (kD / 8), chunk = i % (kD / 8);
    const int64_t page = pages[it];
    const int64_t in_page = (n0 + row) % p.block_size;
    const uint32_t off = wgmma::swizzled_offset(kBlockN, row, chunk);
    tree_attn::cp_async_16(k_slot + off,
                           K + page * p.k_stride_block + in_page * p.k_stride_token + h * p.k_stride_head + chunk * 8, 16);
    tree_attn::cp_async_16(v_slot + off,
                           V + page * p.v_stride_block + in_page * p.v_stride_token + h * p.v_stride_head + chunk * 8, 16);
  }
  tree_attn::cp_async_commit();
}

// Online softmax of one m64nN score tile in place (N = 2 * kScores; scores -> unnormalized probabilities, base 2,
// the scale folded into the exponent), for this thread's two rows: running max m_i (shared by the row's 4 lanes),
// this lane's share of the running sum l_i, and the factor alpha that rescales what was accumulated under the old
// max. Element 4j + 2r + e is row r0 + 8r, column 8j + 2 (lane % 4) + e: kScores / 4 column groups j.
template <int kScores>
__device__ __forceinline__ void online_softmax(float (&s)[kScores], float qk_scale, float (&m_i)[2], float (&l_i)[2],
                                               float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kScores / 4; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(m_i[r], mx * qk_scale);
    alpha[r] = exp2f(m_i[r] - m_new);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kScores / 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = exp2f(s[4 * j + 2 * r + e] * qk_scale - m_new);
        s[4 * j + 2 * r + e] = pv;
        sum += pv;
      }
    l_i[r] = l_i[r] * alpha[r] + sum;
    m_i[r] = m_new;
  }
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(kThreads, 1) tree_attention_context_sm90_kernel(const TreeAttentionParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kBlockN = Cfg::kBlockN, kStages = Cfg::kStages, kTileBytes = Cfg::kTileBytes;
  constexpr int kChunks = Cfg::kChunksPerThread, kScores = Cfg::kScores;
  extern __shared__ __align__(16) unsigned char smem[];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int G = p.num_q_heads / p.num_kv_heads, rows = p.num_tree * G;
  const int ctx = p.context_lens[b];
  const int start = split * p.split_len;
  const int end = min(start + p.split_len, ctx);
  const int n_full = end > start ? (end - start) / kBlockN : 0;
  const int32_t* bt_row = p.block_table + static_cast<int64_t>(b) * p.bt_stride_b;

  const uint32_t q_s = (wgmma::smem_addr(smem) + 1023u) & ~1023u;
  unsigned char* const smem_q = smem + (q_s - wgmma::smem_addr(smem));  // generic pointer to the aligned base
  const uint32_t k_s = q_s + kBlockM * kD * 2;  // shared addresses for the descriptors ...
  const uint32_t v_s = k_s + kStages * kTileBytes;
  unsigned char* const k_ring = smem_q + (k_s - q_s);  // ... and generic pointers for cp.async
  unsigned char* const v_ring = smem_q + (v_s - q_s);

  // Prologue: tiles 0 .. kStages - 1 in flight, one per ring slot (iteration j then refills tile j - 1's slot with
  // tile j + kStages - 1, so every tile is issued exactly once), then Q staged (st.shared, zero rows beyond T * G).
#pragma unroll
  for (int t0 = 0; t0 < kStages; ++t0) {
    int32_t pages[kChunks];
    tile_pages(p, bt_row, start + t0 * kBlockN, t0 < n_full, pages);
    issue_tile<T, kBlockN>(p, pages, h, start + t0 * kBlockN, k_ring + t0 * kTileBytes, v_ring + t0 * kTileBytes);
  }
  int32_t next_pages[kChunks];
  tile_pages(p, bt_row, start + kStages * kBlockN, kStages < n_full, next_pages);
  const T* Q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kBlockM * (kD / 8); i += kThreads) {
    const int m = i / (kD / 8), chunk = i % (kD / 8);
    uint4 val = make_uint4(0, 0, 0, 0);
    if (m < rows)
      val = *reinterpret_cast<const uint4*>(Q + b * p.q_stride_b + (m / G) * p.q_stride_t + (h * G + m % G) * p.q_stride_h +
                                            chunk * 8);
    *reinterpret_cast<uint4*>(smem_q + wgmma::swizzled_offset(kBlockM, m, chunk)) = val;
  }

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  // This warpgroup's 64 rows of Q: rows 64 wg .. in each 64-column half of the [128, 128] tile.
  const uint32_t q_wg = q_s + wg * 64 * 128;
  auto desc_q = [&](int k) { return wgmma::desc_k_major(q_wg, kBlockM, k); };

  tree_attn::cp_async_wait<kStages - 1>();  // tile 0 landed
  wgmma::fence_proxy_async();
  __syncthreads();

  // Rows r0 = 16 warp + lane / 4 and r0 + 8 of this warpgroup; the 4 lanes of a row hold kBlockN / 4 of its kBlockN
  // scores each.
  const float qk_scale = p.sm_scale * 1.4426950408889634f;
  float m_i[2] = {-1.0e30f, -1.0e30f}, l_i[2] = {0.f, 0.f};
  float s[kScores], o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;

  // S_0, then P_0 = softmax(S_0) (O is zero: nothing to rescale).
#pragma unroll
  for (int i = 0; i < kScores; ++i) s[i] = 0.f;
  fence_regs(s);
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < kD / 16; ++k) mma_s<T>(s, desc_q(k), wgmma::desc_k_major(k_s, kBlockN, k), k > 0);
  wgmma::commit();
  wgmma::wait<0>();
  fence_regs(s);
  float alpha[2];
  online_softmax(s, qk_scale, m_i, l_i, alpha);

  // FA3's intra-warpgroup order: S_j and P_{j-1} V_{j-1} issued back to back, the softmax of S_j runs while
  // P_{j-1} V_{j-1} does, and no accumulator stays in flight across the loop's back edge (ptxas serializes every
  // wgmma of a kernel where one does: C7514).
  for (int j = 1; j < n_full; ++j) {
    const int prev = (j - 1) % kStages, cur = j % kStages;
    // Tile j landed (committed: tiles 0 .. j + kStages - 2; tiles j + 1 .. may still fly).
    tree_attn::cp_async_wait<kStages - 2>();
    wgmma::fence_proxy_async();
    __syncthreads();
    uint32_t frag[kBlockN / 16][4];
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) wgmma::a_fragment<T>(s, t, frag[t]);
    fence_regs(s);
    fence_regs(o);
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kD / 16; ++k)
      mma_s<T>(s, desc_q(k), wgmma::desc_k_major(k_s + cur * kTileBytes, kBlockN, k), k > 0);
    wgmma::commit();
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t)
      wgmma::mma_m64n128k16_rs<T>(o, frag[t], wgmma::desc_mn_major(v_s + prev * kTileBytes, kBlockN, t), 1);
    wgmma::commit();
    wgmma::wait<1>();  // S_j done (issued first); P_{j-1} V_{j-1} may still run
    fence_regs(s);
    online_softmax(s, qk_scale, m_i, l_i, alpha);
    wgmma::wait<0>();
    fence_regs(o);
#pragma unroll
    for (int q = 0; q < 16; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * q + e] *= alpha[e / 2];
    // Every warpgroup is done with tile j - 1 (K by S_{j-1}, V by P_{j-1} V_{j-1}): its ring slot takes tile
    // j + kStages - 1.
    __syncthreads();
    const int nt = j + kStages - 1;
    issue_tile<T, kBlockN>(p, next_pages, h, start + nt * kBlockN, k_ring + prev * kTileBytes,
                           v_ring + prev * kTileBytes);
    tile_pages(p, bt_row, start + (nt + 1) * kBlockN, nt + 1 < n_full, next_pages);
  }
  if (n_full > 0) {  // the last tile's P V
    uint32_t frag[kBlockN / 16][4];
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) wgmma::a_fragment<T>(s, t, frag[t]);
    fence_regs(o);
    wgmma::fence();
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t)
      wgmma::mma_m64n128k16_rs<T>(o, frag[t], wgmma::desc_mn_major(v_s + ((n_full - 1) % kStages) * kTileBytes,
                                                                     kBlockN, t), 1);
    wgmma::commit();
    wgmma::wait<0>();
    fence_regs(o);
  }
  tree_attn::cp_async_wait<0>();

  // Partial rows of this split.
  const int row_base = 64 * wg + 16 * warp + lane / 4;
  const int64_t slot_row =
      ((static_cast<int64_t>(b) * p.num_kv_heads + h) * (p.num_splits + 1) + split) * static_cast<int64_t>(rows);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_i[r];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const int m = row_base + 8 * r;
    if (m >= rows) continue;
    const bool has = n_full > 0 && l > 0.f;
    const float inv = has ? 1.f / l : 0.f;
    const int64_t row = slot_row + m;
    if ((lane & 3) == 0) p.partial_lse[row] = has ? (m_i[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
    float* dst = p.partial_out + row * kD + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
  }
#endif
}

// Opts the instantiation into its shared memory, then launches it.
template <typename T, typename Cfg>
LaunchStatus launch_context(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream) noexcept {
  TLT_STATUS_CUDA_CHECK(cudaFuncSetAttribute(tree_attention_context_sm90_kernel<T, Cfg>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  tree_attention_context_sm90_kernel<T, Cfg><<<grid, kThreads, Cfg::kSmemBytes, stream>>>(p);
  TLT_STATUS_CHECK_LAUNCH();
  return {};
}

template <typename Cfg>
LaunchStatus launch_context_dtype(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream) noexcept {
  return p.dtype == DType::kBFloat16 ? launch_context<__nv_bfloat16, Cfg>(p, grid, stream)
                                     : launch_context<__half, Cfg>(p, grid, stream);
}

}  // namespace

// p.config picks the tile width (tokens of K/V per iteration; p.split_len must be a multiple of it, and the partial
// kernel's context_done_block must equal it): 0 = the default, 128 (3 ring slots); 128 = the same, named; 64 = the
// 64-token tile (4 ring slots). Anything else is refused, so a tuning index meant for the partial kernel
// (tree_attention.cu) cannot silently select a width.
LaunchStatus launch_tree_attention_context_sm90(const TreeAttentionParams& p, cudaStream_t stream) noexcept {
  TLT_STATUS_CHECK_ARG(p.config == 0 || p.config == 64 || p.config == 128,
                       "the sm_90 context kernel's config is its tile width: 0 (default, 128), 64 or 128, got "
                           << p.config);
  const int block_n = p.config == 64 ? Ctx64::kBlockN : Ctx128::kBlockN;
  TLT_STATUS_CHECK_ARG(p.head_dim == kD, "the sm_90 context kernel covers head_dim 128, got " << p.head_dim);
  TLT_STATUS_CHECK_ARG(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0,
                       "num_q_heads (" << p.num_q_heads << ") must be a multiple of num_kv_heads (" << p.num_kv_heads << ")");
  TLT_STATUS_CHECK_ARG(p.num_tree * (p.num_q_heads / p.num_kv_heads) <= kBlockM,
                       "T * G = " << p.num_tree * (p.num_q_heads / p.num_kv_heads) << " rows exceed " << kBlockM);
  TLT_STATUS_CHECK_ARG(p.split_len > 0 && p.split_len % block_n == 0,
                       "split_len must be a positive multiple of the sm_90 context kernel's tile width " << block_n
                           << " (config " << p.config << "; config=64 selects the 64-token tile), got "
                           << p.split_len);
  TLT_STATUS_CHECK_ARG(p.batch >= 0 && p.num_splits >= 1 && p.num_splits <= 65535, "bad batch / num_splits");
  TLT_RETURN_IF_FAILED(check_tree_attention_gather(p));  // 16-byte cp.async rows, as the partial kernel's
  if (p.batch == 0) return {};
  TLT_RETURN_IF_FAILED(wgmma::require_sm90());
  const dim3 grid(static_cast<unsigned>(p.num_splits), static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(p.batch));
  return block_n == Ctx64::kBlockN ? launch_context_dtype<Ctx64>(p, grid, stream)
                                   : launch_context_dtype<Ctx128>(p, grid, stream);
}

}  // namespace tlt
