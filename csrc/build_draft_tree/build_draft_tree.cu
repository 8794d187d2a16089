// Launcher of build_draft_tree: argument checks, per-thread item-count dispatch, launch on the caller's stream,
// launch-error check. Torch-free; returns a LaunchStatus (no exception leaves this nvcc-compiled unit), raised by
// bindings_build_draft_tree.cpp.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "build_draft_tree/build_draft_tree.cuh"
#include "build_draft_tree/build_draft_tree.h"
#include "common/launch_status.h"

namespace tlt {
namespace {

template <int ITEMS>
LaunchStatus launch_build(const BuildDraftTreeParams& p, cudaStream_t stream) {
  const size_t smem = 2 * sizeof(int) * static_cast<size_t>(p.num_cand);
  accept::build_draft_tree_kernel<ITEMS><<<p.batch, accept::kBuildThreads, smem, stream>>>(p);
  TLT_STATUS_CUDA_CHECK(cudaGetLastError());
  return {};
}

}  // namespace

LaunchStatus launch_build_draft_tree(const BuildDraftTreeParams& p, cudaStream_t stream) noexcept {
  TLT_STATUS_CHECK_ARG(p.batch >= 0 && p.batch <= 0x7fffffff, "batch must be >= 0, got " << p.batch);
  TLT_STATUS_CHECK_ARG(p.num_cand >= 0 && p.num_cand <= kBuildTreeMaxCandidates,
                    "the CUDA kernel takes up to " << kBuildTreeMaxCandidates << " candidates per request, got N=" << p.num_cand);
  TLT_STATUS_CHECK_ARG(p.num_verify >= 1, "num_verify must be >= 1, got " << p.num_verify);
  if (p.batch == 0) return {};
  TLT_STATUS_CHECK_ARG((p.num_cand == 0 || (p.cand_parents && p.cand_tokens && p.cand_scores)) && p.root_tokens &&
                        p.parents && p.draft_tokens && p.cand_index && p.num_nodes,
                    "candidate inputs and tree outputs must be device pointers");
  const int per_thread = (p.num_cand + accept::kBuildThreads - 1) / accept::kBuildThreads;
  if (per_thread <= 1) return launch_build<1>(p, stream);
  if (per_thread <= 2) return launch_build<2>(p, stream);
  if (per_thread <= 4) return launch_build<4>(p, stream);
  if (per_thread <= 8) return launch_build<8>(p, stream);
  return launch_build<16>(p, stream);
}

}  // namespace tlt
