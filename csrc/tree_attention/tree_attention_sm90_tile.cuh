// Tile-level pieces shared by the sm_90 tree-attention kernels (torch-free): the span one CTA attends, the page and
// cache-token lookup of a tile row, the tree mask of a score tile and the online softmax of one, in the wgmma
// accumulator layout (element 4j + 2r + e of a thread: row 16 warp + lane / 4 + 8r, column 8j + 2 (lane % 4) + e).
// Used by csrc/tree_attention/tree_attention_ctx_sm90.cu (one or two warpgroups, every thread copies and computes) and
// csrc/tree_attention/tree_attention_ctx_sm90_ws.cu (a producer warpgroup feeding two consumer warpgroups).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common/launch_status.h"
#include "tree_attention/tree_attention.cuh"  // tree_attn::fast_exp2
#include "tree_attention/tree_attention.h"
#include "tree_attention/wgmma_sm90.cuh"

namespace tlt {
namespace tree_sm90 {

constexpr int kD = 128;  // head dim of every sm_90 tree-attention kernel

// Byte offset of k-step k in a K-major tile of `rows` rows (see wgmma::desc_k_major).
__device__ __forceinline__ uint32_t k_step(int rows, int k) {
  return static_cast<uint32_t>((k >> 2) * rows * 128 + (k & 3) * 32);
}

// A thread's state at the start of its span: the running max of its two rows at -1e30 (see online_softmax), their
// sums, the score tile and the output accumulator at zero.
template <int kScores>
__device__ __forceinline__ void init_rows(float (&m_i)[2], float (&l_i)[2], float (&s)[kScores], float (&o)[64]) {
  m_i[0] = m_i[1] = -1.0e30f;
  l_i[0] = l_i[1] = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kScores; ++i) s[i] = 0.f;
}

// S (+)= Q K^T for one k-step, the instruction picked by the accumulator's width.
template <typename T>
__device__ __forceinline__ void mma_s(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  wgmma::mma_m64n64k16_ss<T>(d, da, db, scale_d);
}
template <typename T>
__device__ __forceinline__ void mma_s(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  wgmma::mma_m64n128k16_ss<T>(d, da, db, scale_d);
}

// What one CTA attends: cache slots [begin, limit) of request b, KV head h, in tiles of kBlockN from `begin`; tiles
// below n_full hold context only and run unmasked.
struct Span {
  const int32_t* bt_row;
  int begin, limit, n_full, n_tiles, ctx, nn;
};

// Page of row `row` of tile i (-1 past the span; tree_attn::kBadPage for an id outside the cache, which the caller
// flags: both zero-filled, never read), and the row's cache token, page * block_size + slot in the page. With
// stride_block == block_size * stride_token (the launcher checks), the row's K (V) starts at token * stride_token:
// one multiply per copied row.
template <int kBlockN>
__device__ __forceinline__ int32_t row_page(const TreeAttentionParams& p, const Span& sp, int i, int row) {
  const int pos = sp.begin + i * kBlockN + row;
  return pos < sp.limit ? tree_attn::checked_page(__ldg(sp.bt_row + (pos >> p.block_shift)), p.num_blocks) : -1;
}
template <int kBlockN>
__device__ __forceinline__ int32_t row_token(const TreeAttentionParams& p, const Span& sp, int i, int row, int32_t page) {
  const int pos = sp.begin + i * kBlockN + row;
  return page < 0 ? -1 : (page << p.block_shift) + (pos & ((1 << p.block_shift) - 1));
}

// Bit j: tree node j is node t or one of its ancestors (none for padding nodes t >= nn).
__device__ __forceinline__ uint64_t row_ancestors(const TreeAttentionParams& p, const Span& sp, int b, int t) {
  if (t >= sp.nn) return 0;
  const int32_t* w = p.tree_mask + (static_cast<int64_t>(b) * p.num_tree + t) * p.mask_words;
  uint64_t anc = static_cast<uint32_t>(__ldg(w));
  if (p.mask_words > 1) anc |= static_cast<uint64_t>(static_cast<uint32_t>(__ldg(w + 1))) << 32;
  return anc;
}

// Masks the columns of tile i a row does not attend (score -> -inf): slots past the span, and tree nodes that are not
// the row's node or one of its ancestors. Element 4j + 2r + e is row `row_base + 8r`, column 8j + 2 (lane % 4) + e.
// Runs on one or two tiles per CTA: the keep bits are found in a rolled loop (an unrolled one was a fifth of the
// kernel's instructions), then applied.
template <int kScores>
__device__ __forceinline__ void mask_tile(const TreeAttentionParams& p, const Span& sp, int b, int row_base, int G,
                                          int i, float (&s)[kScores]) {
  static_assert(kScores <= 64, "one keep bit per column of this thread, two rows in 32-bit words");
  const int col0 = sp.begin + i * 2 * kScores + 2 * (threadIdx.x % 4);
  uint32_t keep[2] = {0u, 0u};  // bit 2j + e: column 8j + 2 (lane % 4) + e is attended
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint64_t anc = row_ancestors(p, sp, b, (row_base + 8 * r) / G);
#pragma unroll 1
    for (int c = 0; c < kScores / 2; ++c) {
      const int pos = col0 + 8 * (c >> 1) + (c & 1);
      const bool k = pos < sp.ctx || (pos < sp.limit && ((anc >> (pos - sp.ctx)) & 1ull));
      keep[r] |= static_cast<uint32_t>(k) << c;
    }
  }
#pragma unroll
  for (int j = 0; j < kScores / 4; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (!((keep[r] >> (2 * j + e)) & 1u)) s[4 * j + 2 * r + e] = -INFINITY;
}

// Online softmax of one m64nN score tile in place (N = 2 * kScores; scores -> unnormalized probabilities, base 2,
// the scale folded into the exponent), for this thread's two rows: running max m_i (shared by the row's 4 lanes),
// this lane's share of the running sum l_i, and the factor alpha that rescales what was accumulated under the old
// max. m_i starts at -1e30, not -inf, so a row whose columns so far were all masked gives exp2(-inf) = 0, not NaN.
// qk_scale[r]: row r's scale (rows of Q scaled by different powers of two, load_q_fragments_fp16).
template <int kScores>
__device__ __forceinline__ void online_softmax(float (&s)[kScores], const float (&qk_scale)[2], float (&m_i)[2],
                                               float (&l_i)[2], float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kScores / 4; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(m_i[r], mx * qk_scale[r]);
    alpha[r] = tree_attn::fast_exp2(m_i[r] - m_new);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kScores / 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = tree_attn::fast_exp2(fmaf(s[4 * j + 2 * r + e], qk_scale[r], -m_new));
        s[4 * j + 2 * r + e] = pv;
        sum += pv;
      }
    l_i[r] = l_i[r] * alpha[r] + sum;
    m_i[r] = m_new;
  }
}
template <int kScores>
__device__ __forceinline__ void online_softmax(float (&s)[kScores], float qk_scale, float (&m_i)[2], float (&l_i)[2],
                                               float (&alpha)[2]) {
  const float both[2] = {qk_scale, qk_scale};
  online_softmax(s, both, m_i, l_i, alpha);
}

// O *= alpha row by row after a tile (the running max moved). alpha is exactly 1 for a row whose max did not move
// (most tiles once a few are seen): the 64 multiplies are skipped when that holds for the warp's 16 rows.
__device__ __forceinline__ void rescale_o(float (&o)[64], const float (&alpha)[2]) {
  if (!__all_sync(0xffffffff, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
    for (int q = 0; q < 16; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * q + e] *= alpha[e / 2];
  }
}

// Q straight into registers as the A fragments of S's k-steps: this thread's rows row_base and row_base + 8 (rows
// >= rows zero), columns 16 k + 2 (lane % 4) (+8), the accumulator layout (wgmma::a_fragment). q_row(m) points at
// row m's first element.
template <typename T, typename QRow>
__device__ __forceinline__ void load_q_fragments(QRow q_row, int row_base, int rows, int lane,
                                                 uint32_t (&q_frag)[kD / 16][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = row_base + 8 * r;
    const T* row = m < rows ? q_row(m) + 2 * (lane % 4) : nullptr;
#pragma unroll
    for (int k = 0; k < kD / 16; ++k) {
      q_frag[k][r] = row ? *reinterpret_cast<const uint32_t*>(row + 16 * k) : 0u;
      q_frag[k][2 + r] = row ? *reinterpret_cast<const uint32_t*>(row + 16 * k + 8) : 0u;
    }
  }
}

// load_q_fragments for fp16 products over bfloat16 rows (the fp8 caches' keys widened to fp16): each row is scaled
// by the power of two 2^e that puts its largest finite |q| in [2^14, 2^15), so a bfloat16 component within 2^28 of it
// is an fp16 normal, exact (an all-zero or non-finite row: e = 0; e is kept within [-126, 126], a float's range);
// inv_scale[r] = 2^-e undoes it in the softmax's scale. NaN and inf components stay NaN and inf.
template <typename QRow>
__device__ __forceinline__ void load_q_fragments_fp16(QRow q_row, int row_base, int rows, int lane,
                                                      uint32_t (&q_frag)[kD / 16][4], float (&inv_scale)[2]) {
  load_q_fragments<__nv_bfloat16>(q_row, row_base, rows, lane, q_frag);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    auto finite_abs = [](float x) { return fabsf(x) <= FLT_MAX ? fabsf(x) : 0.f; };  // NaN and inf: 0
    float largest = 0.f;  // the row's largest finite |q|: its 4 lanes' shares of columns 16 k + 2 (lane % 4) (+8)
#pragma unroll
    for (int k = 0; k < kD / 16; ++k)
#pragma unroll
      for (int w = r; w < 4; w += 2) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q_frag[k][w]));
        largest = fmaxf(largest, fmaxf(finite_abs(f.x), finite_abs(f.y)));
      }
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffff, largest, 1));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffff, largest, 2));
    int exponent = 0;  // largest = f 2^exponent, f in [0.5, 1)
    frexpf(largest, &exponent);
    const int e = largest > 0.f ? min(max(15 - exponent, -126), 126) : 0;
    const float scale = ldexpf(1.f, e);
    inv_scale[r] = ldexpf(1.f, -e);
#pragma unroll
    for (int k = 0; k < kD / 16; ++k)
#pragma unroll
      for (int w = r; w < 4; w += 2) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q_frag[k][w]));
        const __half2 h = __floats2half2_rn(f.x * scale, f.y * scale);
        q_frag[k][w] = *reinterpret_cast<const uint32_t*>(&h);
      }
  }
}

// The span split `split` of request b attends, in tiles of kBlockN. False when the split is past the request's last
// non-empty one (the whole CTA returns: nothing to write). direct: the request has at most one non-empty split, so
// this CTA completes its rows (writes out; no scratch, no merge).
template <int kBlockN>
__device__ __forceinline__ bool split_span(const TreeAttentionParams& p, int b, int split, Span& sp, bool& direct) {
  sp.ctx = p.context_lens[b];
  sp.nn = p.num_nodes[b];
  const int used = (sp.ctx + p.split_len - 1) / p.split_len;  // non-empty context splits
  const int last = max(used, 1) - 1;                           // the split that also covers the tree
  if (split > last) return false;
  direct = used <= 1;
  sp.bt_row = p.block_table + static_cast<int64_t>(b) * p.bt_stride_b;
  sp.begin = split * p.split_len;
  const int ctx_end = min(sp.begin + p.split_len, sp.ctx);  // == ctx in the last split
  sp.limit = split == last ? sp.ctx + sp.nn : ctx_end;
  sp.n_full = max(ctx_end - sp.begin, 0) / kBlockN;
  sp.n_tiles = (sp.limit - sp.begin + kBlockN - 1) / kBlockN;
  return true;
}

// This thread's two finished rows (row_base and row_base + 8 of T * G; accumulator o, running max m_i and this lane's
// share of the running sum l_i): normalized into out (direct; padding rows as zeros) or into the split's partial
// slot with the row's log-sum-exp (real nodes' rows only: the merge reads nothing else). NaN rows: every real row
// when `poisoned` (a page id out of the cache), and those that see a node of `bad_nodes` (a NaN/inf tree V, zeroed
// in shared memory); a NaN sum (a NaN score) stays NaN too, its LSE NaN, not the -inf of an empty split.
template <typename T>
__device__ __forceinline__ void store_rows(const TreeAttentionParams& p, const Span& sp, int b, int h, int split,
                                           bool direct, int row_base, const float (&o)[64], const float (&m_i)[2],
                                           const float (&l_i)[2], bool poisoned, uint64_t bad_nodes) {
  const int G = p.group, TG = p.num_tree * G, lane = threadIdx.x % 32;
  const int M = sp.nn * G;  // rows of real nodes; rows M .. TG - 1 are padding (zeros in out, never in the scratch)
  const int64_t slot_row =
      ((static_cast<int64_t>(b) * p.num_kv_heads + h) * (p.num_splits + 1) + split) * static_cast<int64_t>(TG);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_i[r];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const int m = row_base + 8 * r;
    const bool nan_row = m < M && (poisoned || (bad_nodes != 0 && (row_ancestors(p, sp, b, m / G) & bad_nodes) != 0));
    // v_scale: the V cache holds V / v_scale (1 for caches of q's dtype), so every output row is scaled by it.
    const float inv = nan_row ? NAN : (l != 0.f ? p.v_scale / l : 0.f);
    if (direct) {
      if (m >= TG) continue;
      const int t = m / G;
      T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + t * p.out_stride_t + (h * G + m - t * G) * p.out_stride_h +
               2 * (lane & 3);
      // Padding rows (m >= M) are zeros whatever their zero Q met (0 * NaN would not be).
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<uint32_t*>(dst + 8 * j) =
            m < M ? tree_attn::TypeTraits<T>::pack(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv) : 0u;
    } else if (m < M) {
      const int64_t row = slot_row + m;
      if ((lane & 3) == 0)
        p.partial_lse[row] = inv != inv ? NAN : (l != 0.f ? (m_i[r] + log2f(l)) * 0.6931471805599453f : -INFINITY);
      float* dst = p.partial_out + row * kD + 2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
  }
}

// One 16-byte chunk of an fp8 staging buffer (shared address `addr`), ordered with the buffer's other accesses (the
// widening that follows rewrites shared memory the compiler cannot see through the asm).
__device__ __forceinline__ uint4 load_staged_chunk(uint32_t addr) {
  uint4 raw;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
               : "r"(addr)
               : "memory");
  return raw;
}

// Whether tile i holds tree slots (a V tile of it then goes through tree_attn::copy_tree_v_chunk): uniform per CTA.
template <int kBlockN>
__device__ __forceinline__ bool tile_has_tree(const Span& sp, int i) {
  return sp.limit > sp.ctx && sp.begin + (i + 1) * kBlockN > sp.ctx;
}

// The tree node whose V row `row` of tile i holds (-1 when it is a context row or past the span, or when `tree_v` is
// false: a K tile, or a V tile without tree slots).
template <int kBlockN>
__device__ __forceinline__ int tree_node_of_row(const Span& sp, int i, int row, bool tree_v) {
  const int pos = sp.begin + i * kBlockN + row;
  return tree_v && pos >= sp.ctx && pos < sp.limit ? pos - sp.ctx : -1;
}

// One 16-byte chunk of row `row` of tile i into the swizzled slot at shared address `dst`: from `src` (cache token
// `token`, -1 past the span: zero-filled), by cp.async, except a tree slot's V (`tree_v`), checked on its way (see
// tree_attn::copy_tree_v_chunk).
template <typename T, int kBlockN>
__device__ __forceinline__ void copy_row_chunk(uint32_t dst, const char* src, int32_t token, const Span& sp, int i,
                                               int row, bool tree_v, unsigned long long* bad_nodes) {
  const int pos = sp.begin + i * kBlockN + row;
  if (tree_v && token >= 0 && pos >= sp.ctx)
    tree_attn::copy_tree_v_chunk<T>(dst, src, pos - sp.ctx, bad_nodes);
  else
    tree_attn::cp_async_16(dst, src, token >= 0 ? 16 : 0);
}

// Opts `kernel` into `smem_bytes` of dynamic shared memory (past the 48 KB default), then launches it on args.
template <typename... Params, typename... Args>
LaunchStatus launch_with_smem(void (*kernel)(Params...), dim3 grid, int threads, int smem_bytes, cudaStream_t stream,
                              const Args&... args) noexcept {
  TLT_STATUS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  TLT_STATUS_CHECK_LAUNCH();
  return {};
}

// The warp-specialized two-consumer build (csrc/tree_attention/tree_attention_ctx_sm90_ws.cu): 128-token tiles, any T * G in blocks
// of 128 rows, grid (splits << p.row_block_shift, Hkv, B); the caller (launch_tree_attention_sm90) has checked the
// params. variant: 0 (default) Q in registers, 3 K and 4 V stages, cp.async copies; 4 the same with whole context
// tiles by TMA (needs p.block_size >= 16 and p.cache_tokens); tools/ws_probe.cu also times 1 (4 K and 3 V stages),
// 2 (Q in shared memory, 3 + 3 stages) and 3 (2 + 2, probe builds only).
LaunchStatus launch_sm90_warp_specialized(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream,
                                          int variant = 0) noexcept;

}  // namespace tree_sm90
}  // namespace tlt
