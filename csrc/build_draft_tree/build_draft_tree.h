// build_draft_tree's host-facing interface (plain C++, torch-free): parameter struct, limit, launcher. The contract
// is the pure-torch reference in tlt_kernels/reference/build_draft_tree.py.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch_status.h"

namespace tlt {

// Greedy frontier selection of num_verify - 1 candidates per request, laid out as a token tree.
//
//   cand_parents int32 [B, N] (cp_stride_b); cand_tokens int64 [B, N] (ct_stride_b);
//   cand_scores float32 [B, N] (cs_stride_b); root_tokens int64 [B]
//   parents, cand_index int32 [B, num_verify]; draft_tokens int64 [B, num_verify]; num_nodes int32 [B];
//   tree_mask int32 [B, num_verify, ceil(num_verify / 32)] or null (all outputs contiguous)
struct BuildDraftTreeParams {
  const int32_t* cand_parents = nullptr;
  const int64_t* cand_tokens = nullptr;
  const float* cand_scores = nullptr;
  const int64_t* root_tokens = nullptr;
  int32_t* parents = nullptr;
  int64_t* draft_tokens = nullptr;
  int32_t* cand_index = nullptr;
  int32_t* num_nodes = nullptr;
  int32_t* tree_mask = nullptr;
  int64_t cp_stride_b = 0, ct_stride_b = 0, cs_stride_b = 0;
  int batch = 0;
  int num_cand = 0;    // N
  int num_verify = 0;  // tree size, root included
};

// Limit of the CUDA kernel (the Python glue reports it before launching).
constexpr int kBuildTreeMaxCandidates = 2048;

LaunchStatus launch_build_draft_tree(const BuildDraftTreeParams& p, cudaStream_t stream) noexcept;

}  // namespace tlt
