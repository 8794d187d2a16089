// Host-side interface of the tree-attention kernels (torch-free; raw device pointers).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/launch_status.h"

namespace tlt {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };
// The caches' storage: q's dtype (kNone), or an fp8 format whose values the kernels widen (exactly) to q's dtype in
// shared memory on their way to the tensor cores.
enum class Fp8Format : int { kNone = 0, kE4M3 = 1, kE5M2 = 2 };

// Everything one step of tree attention reads. Strides are in elements; the head dim is contiguous.
//
//   q            [B, T, Hq, D]                      fp16/bf16 (strides q_stride_{b,t,h})
//   k_cache      [num_blocks, block_size, Hkv, D]   same dtype, or fp8 (kv_fp8) (strides k_stride_{block,token,head})
//   v_cache      [num_blocks, block_size, Hkv, D]   as k_cache (strides v_stride_{block,token,head})
//   block_table  int32 [B, bt_stride_b >= max_blocks]
//   context_lens int32 [B]; num_nodes int32 [B]
//   tree_mask    int32 [B, T, mask_words], mask_words = ceil(T / 32), bit j%32 of word j/32 of row i
//                set iff node j is node i or an ancestor of it
//   partial_out  float32 [B, Hkv, S + 1, T * G, D] (contiguous); partial_lse float32 [B, Hkv, S + 1, T * G]
//                Only slots s < ceil(context_lens[b] / split_len) of requests with two or more such
//                slots are written (the last of them includes the tree); slot S is unused.
//   out          [B, T, Hq, D] fp16/bf16 (strides out_stride_{b,t,h}; 4-byte aligned, even strides)
//
// NaN: a NaN in the K or V of a slot a row attends reaches that row (as in plain attention: a NaN score makes the
// row's sum NaN, and a split's NaN sum gives a NaN LSE the merge propagates); slots no row attends are never read
// (zero-filled copies), and a tree slot's V holding NaN/inf is zeroed on its way to shared memory, the rows that see
// that node written as NaN, so the zero weight of the other rows never meets it.
struct TreeAttentionParams {
  const void* q = nullptr;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  const int32_t* block_table = nullptr;
  const int32_t* context_lens = nullptr;
  const int32_t* num_nodes = nullptr;
  const int32_t* tree_mask = nullptr;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  void* out = nullptr;

  int64_t q_stride_b = 0, q_stride_t = 0, q_stride_h = 0;
  int64_t k_stride_block = 0, k_stride_token = 0, k_stride_head = 0;
  int64_t v_stride_block = 0, v_stride_token = 0, v_stride_head = 0;
  int64_t out_stride_b = 0, out_stride_t = 0, out_stride_h = 0;
  int64_t bt_stride_b = 0;

  int batch = 0;         // B
  int num_tree = 0;      // T
  int num_q_heads = 0;   // Hq
  int num_kv_heads = 0;  // Hkv
  int group = 0;         // G = Hq / Hkv
  int head_dim = 0;      // D in {64, 128, 256}
  int block_size = 0;    // tokens per cache page
  int num_splits = 0;    // S context splits; split S is the tree part
  int split_len = 0;     // context tokens per split
  int mask_words = 0;    // ceil(T / 32)
  float sm_scale = 0.f;  // softmax scale (natural units), the K cache's dequantization scale folded in
  float v_scale = 1.f;   // the V cache's dequantization scale (it holds V / v_scale): multiplies each output row
  DType dtype = DType::kBFloat16;
  // Both caches fp8: the partial kernel's default configurations, and the sm_90 kernels (token and head strides of
  // multiples of 16 elements there; the warp-specialized one without its TMA build).
  Fp8Format kv_fp8 = Fp8Format::kNone;
  // Kernel configuration: 0 picks per shape; 1.. force a tuning variant (tree_attention.cu lists them).
  int config = 0;
  // Set by the launcher: log2(block_size) when it is a power of two, else -1 (divide).
  int block_shift = -1;
  // Set by the launcher of the warp-specialized sm_90 kernel: log2 of its CTAs per (split, KV head, request), one per
  // 128-row block of T * G rounded up to a power of two (blockIdx.x = split << row_block_shift | row block).
  int row_block_shift = 0;
  // Token rows in the cache (num_blocks * block_size), 0 = unknown: bounds the tensor maps of the warp-specialized
  // kernel's TMA build (which needs it).
  int64_t cache_tokens = 0;
  // Set by the launchers: pages in the cache, cache_tokens / block_size (INT32_MAX, no bound, when cache_tokens is 0 or
  // for a caller that launches a kernel directly). A used block-table entry outside [0, num_blocks) is never read;
  // the rows of its CTA come out NaN (the host checks tables it can read; this covers the ones it cannot, e.g. a
  // replayed CUDA graph).
  int num_blocks = INT32_MAX;
};

// The cache storage code and V scale every launcher takes: kv_fp8 0 (caches of q's dtype), 1 (e4m3) or 2 (e5m2);
// v_scale finite and > 0.
LaunchStatus check_tree_attention_scales(const TreeAttentionParams& p) noexcept;

// What every kernel that gathers K/V through the block table with 16-byte cp.async needs (the partial kernel and
// the sm_90 context kernel): q / k_cache / v_cache / block_table / context_lens set, q / k_cache / v_cache 16-byte
// aligned with strides of multiples of 8 elements, block_size >= 1.
LaunchStatus check_tree_attention_gather(const TreeAttentionParams& p) noexcept;
// The launchers' TreeAttentionParams::num_blocks: p.cache_tokens / p.block_size, INT32_MAX when cache_tokens is 0.
int cache_num_blocks(const TreeAttentionParams& p) noexcept;

// Step 1: grid (S * row_chunks, B, Hkv). A request with at most one non-empty context split is
// finished here (out written, padding rows zeroed); otherwise each non-empty split s writes its
// partial_out / partial_lse slot for rows r < num_nodes[b] * G, the last one including the tree.
LaunchStatus launch_tree_attention_partial(const TreeAttentionParams& p, cudaStream_t stream) noexcept;
// Step 2: for requests with two or more non-empty splits, combines those slots with log-sum-exp and
// writes out (zeros for rows t >= num_nodes[b]). A no-op (nothing launched) when num_splits == 1.
LaunchStatus launch_tree_attention_merge(const TreeAttentionParams& p, cudaStream_t stream) noexcept;
// Step 1 on sm_90 (tree_attention_ctx_sm90.cu; wgmma, D = 128, T <= 64): the same work and outputs as
// launch_tree_attention_partial (out for requests with one non-empty split, else partial slots s < used; the merge
// follows when num_splits > 1), one CTA of 128 rows per (split, KV head, request). p.config is its tile width: 0 or
// 128 (split_len a multiple of 128) or 64, for T * G <= 128; 128 | kSm90WarpSpecialized takes the warp-specialized
// build of the 128-token kernel (a producer warpgroup and two ping-ponging consumers, tree_attention_ctx_sm90_ws.cu;
// any T * G, in 128-row blocks), and | kSm90Tma its copies of whole context tiles by TMA (pages of 16 tokens or
// more, p.cache_tokens set; else the cp.async build runs).
constexpr int kSm90WarpSpecialized = 1024, kSm90Tma = 2048;
LaunchStatus launch_tree_attention_sm90(const TreeAttentionParams& p, cudaStream_t stream) noexcept;

}  // namespace tlt
