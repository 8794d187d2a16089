// verify_tree's host-facing interface (plain C++, torch-free): parameter struct, limits, launcher. The contract is
// the pure-torch reference in tlt_kernels/reference/{verify_tree,sampling}.py.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch_status.h"

namespace tlt {

// Element types of logits / draft_probs (codes shared with tlt_kernels/_cuda/verify_tree.py).
enum class ElemType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// One fused verification of B draft trees. Strides are in elements; the vocabulary dim is contiguous.
//
//   logits        [B, T, V] fp32/fp16/bf16 (logits_stride_{b,t})
//   draft_probs   [B, T, V] fp32/fp16/bf16 or null (q_stride_{b,t}); null = deterministic candidates
//   draft_tokens  int64 (tokens_int64) or int32 [B, >= T] (tokens_stride_b)
//   parents       int32 [B, >= T] (parents_stride_b); num_nodes int32 [B]
//   temperature   float32 [B] or null (all greedy); top_k int32 [B] or null; top_p float32 [B] or null
//   seed, offset  int64 [B]
//   scratch       float32 [B, scratch_rows, V] contiguous: rows 0 and 1 of a request are the walk's ping-pong residual
//                 rows (only touched after a rejection); with row_stats, rows 0..T-1 first hold the rows kernel's
//                 top-p candidates (scratch_rows >= max(2, T))
//   row_stats     float32 [B, T, kVerifyRowWords] or null: set = parallel rows (verify_rows_kernel computes every
//                 node's row statistics at once, then the walk reads them instead of streaming each visited row):
//                 words [0, 16) a RowState, then each rank's sampling plan (4 words per rank of the rows kernel)
//   out_tokens, out_nodes int32 [B, max_depth + 1]; out_num, out_error int32 [B];
//   out_stats     int32 [B, max_depth, 2] or null
//   scores        float32 [B, max_depth + 1, 2] or null (null: the plain kernels, which write no log-probs): each
//                 emitted token's (sampled, raw) log-probs, [b, d] for d <= out_num[b]: under the row's sampling
//                 law (temperature, top-k, top-p; 0 for greedy requests) and under log_softmax of its logits; 0 past
//                 out_num[b] and on flagged requests (tlt_kernels/reference/verify_tree.py: path_logprobs)
struct VerifyTreeParams {
  const void* logits = nullptr;
  const void* draft_probs = nullptr;
  const void* draft_tokens = nullptr;
  const int32_t* parents = nullptr;
  const int32_t* num_nodes = nullptr;
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  const int64_t* seed = nullptr;
  const int64_t* offset = nullptr;
  float* scratch = nullptr;
  int32_t* out_tokens = nullptr;
  int32_t* out_num = nullptr;
  int32_t* out_nodes = nullptr;
  int32_t* out_error = nullptr;
  int32_t* out_stats = nullptr;

  int64_t logits_stride_b = 0, logits_stride_t = 0;
  int64_t q_stride_b = 0, q_stride_t = 0;
  int64_t tokens_stride_b = 0, parents_stride_b = 0;

  int batch = 0;      // B
  int num_tree = 0;   // T
  int vocab = 0;      // V
  int max_depth = 0;  // deepest node the walk may accept
  int cluster = 0;    // CTAs per request: 0 = pick from B, V and the SM count; else 1, 2, 4, 8 or 16
  bool tokens_int64 = true;
  // Top-p threshold selected among compacted candidates (the full-row select's threshold, up to float ties; see
  // topp_from_candidates). On by default in the Python glue (TLT_VERIFY_TOPP_COMPACT); used when top_p is given.
  bool topp_compact = false;
  ElemType logits_type = ElemType::kFloat32;
  ElemType q_type = ElemType::kFloat32;
  float* scores = nullptr;  // float32 [B, max_depth + 1, 2] or null (see above)
  float* row_stats = nullptr;  // float32 [B, T, kVerifyRowWords] or null (see above)
  int scratch_rows = 2;        // rows per request of scratch
  // CTAs per row of the rows kernel: 0 = picked like the walk's for B * T rows (or `cluster` where that is forced),
  // else 1, 2, 4, 8 or 16. The launcher hands the walk the size it used: where it equals the walk's, the walk takes
  // each row's sampling plan from row_stats instead of a pass over the row.
  int rows_cluster = 0;
};

// Limits of the CUDA kernel (the Python glue reports them before launching).
constexpr int kVerifyMaxDepthSmem = 4096;
constexpr int kVerifyMaxVocab = 0x7fffffff - (1 << 16);  // int32 element offsets plus a sweep step of slack
constexpr int kVerifyMaxCluster = 16;  // 16 needs the non-portable cluster attribute (Hopper)
constexpr int kVerifyRowStateWords = 16;  // a RowState in row_stats, padded to 64 bytes
constexpr int kVerifyRowWords = kVerifyRowStateWords + 4 * kVerifyMaxCluster;  // floats per (request, node)

LaunchStatus launch_verify_tree(const VerifyTreeParams& p, cudaStream_t stream) noexcept;

}  // namespace tlt
