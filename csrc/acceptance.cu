// Launchers of the acceptance kernels (verify_tree, compact_kv, build_draft_tree): argument checks,
// dtype dispatch, launch on the caller's stream, launch-error check. Torch-free. The verify_tree launch itself
// is in acceptance_verify.cuh, compiled per logits dtype in acceptance_verify_{f32,f16,bf16}.cu.
//
// Like tree_attention.cu, no C++ exception leaves this nvcc-compiled translation unit: launchers
// return a LaunchStatus and the host-compiled bindings (bindings_acceptance.cpp) raise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "launch_status.h"

#include "acceptance.cuh"
#include "acceptance_verify.cuh"

namespace tlt {
namespace detail {

// The current device's ordinal, compute capability major and SM count, the last two cached per device (attribute
// queries are not stream operations, so this is fine during graph capture).
LaunchStatus device_info(int& dev, int& major, int& sms) {
  static int cached[kMaxDevices][2] = {};  // 0 = not queried yet; benign race: same values
  TLT_STATUS_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 0 && dev < kMaxDevices && cached[dev][1] > 0) {
    major = cached[dev][0];
    sms = cached[dev][1];
    return {};
  }
  TLT_STATUS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  TLT_STATUS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev >= 0 && dev < kMaxDevices) {
    cached[dev][0] = major;
    cached[dev][1] = sms;
  }
  return {};
}

}  // namespace detail

namespace {

bool valid_type(ElemType t) { return t == ElemType::kFloat32 || t == ElemType::kFloat16 || t == ElemType::kBFloat16; }

template <int U>
LaunchStatus launch_compact(const CompactKVParams& p, cudaStream_t stream) {
  // Slab: as wide as the staging budget allows with every depth of the path staged at once.
  int64_t slab = accept::kCompactStageBytes / p.path_len / U * U;
  if (slab < U) slab = U;
  if (slab > p.row_bytes) slab = p.row_bytes;
  const int64_t slabs = (p.row_bytes + slab - 1) / slab;
  TLT_STATUS_CHECK_ARG(slabs <= 65535, "a cache slot of " << p.row_bytes << " bytes needs " << slabs
                                    << " slabs of " << slab << " bytes (grid z limit 65535)");
  const int64_t smem = 16 * static_cast<int64_t>(p.path_len) + p.path_len * slab;
  auto kernel = accept::compact_kv_kernel<U>;
  if (smem > 48 * 1024) {
    TLT_STATUS_CHECK_ARG(smem <= 227 * 1024, "accepted_nodes has " << p.path_len << " columns: too many for one CTA's staging tile");
    TLT_STATUS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  const dim3 grid(p.batch, p.num_caches, static_cast<unsigned>(slabs));
  kernel<<<grid, accept::kCompactThreads, static_cast<size_t>(smem), stream>>>(p, static_cast<int>(slab));
  TLT_STATUS_CUDA_CHECK(cudaGetLastError());
  return {};
}

template <int ITEMS>
LaunchStatus launch_build(const BuildDraftTreeParams& p, cudaStream_t stream) {
  const size_t smem = 2 * sizeof(int) * static_cast<size_t>(p.num_cand);
  accept::build_draft_tree_kernel<ITEMS><<<p.batch, accept::kBuildThreads, smem, stream>>>(p);
  TLT_STATUS_CUDA_CHECK(cudaGetLastError());
  return {};
}

}  // namespace

LaunchStatus launch_verify_tree(const VerifyTreeParams& p, cudaStream_t stream) noexcept {
  TLT_STATUS_CHECK_ARG(p.batch >= 0 && p.batch <= 0x7fffffff, "batch must be >= 0, got " << p.batch);
  TLT_STATUS_CHECK_ARG(p.num_tree >= 1 && p.vocab >= 1, "need T >= 1 and V >= 1, got T=" << p.num_tree << " V=" << p.vocab);
  TLT_STATUS_CHECK_ARG(p.max_depth >= 0, "max_depth must be >= 0, got " << p.max_depth);
  const int depth_cap = p.max_depth < p.num_tree - 1 ? p.max_depth : p.num_tree - 1;
  TLT_STATUS_CHECK_ARG(p.vocab <= kVerifyMaxVocab, "V = " << p.vocab << " exceeds the CUDA kernel's limit " << kVerifyMaxVocab);
  TLT_STATUS_CHECK_ARG(p.cluster == 0 || p.cluster == 1 || p.cluster == 2 || p.cluster == 4 || p.cluster == 8 ||
                        p.cluster == 16,
                    "cluster must be 0 (auto), 1, 2, 4, 8 or 16, got " << p.cluster);
  TLT_STATUS_CHECK_ARG(depth_cap <= kVerifyMaxDepthSmem,
                    "min(max_depth, T - 1) = " << depth_cap << " exceeds the CUDA kernel's limit " << kVerifyMaxDepthSmem);
  TLT_STATUS_CHECK_ARG(valid_type(p.logits_type), "unknown logits dtype code " << static_cast<int>(p.logits_type));
  TLT_STATUS_CHECK_ARG(p.draft_probs == nullptr || valid_type(p.q_type), "unknown draft_probs dtype code " << static_cast<int>(p.q_type));
  if (p.batch == 0) return {};
  TLT_STATUS_CHECK_ARG(p.logits && p.draft_tokens && p.parents && p.num_nodes && p.seed && p.offset && p.scratch &&
                        p.out_tokens && p.out_num && p.out_nodes && p.out_error,
                    "logits, draft_tokens, parents, num_nodes, seed, offset, scratch and the outputs must be device pointers");
  switch (p.logits_type) {
    case ElemType::kFloat32: return detail::dispatch_verify_q<float>(p, stream);
    case ElemType::kFloat16: return detail::dispatch_verify_q<__half>(p, stream);
    case ElemType::kBFloat16: return detail::dispatch_verify_q<__nv_bfloat16>(p, stream);
  }
  TLT_STATUS_CHECK_ARG(false, "unknown logits dtype code " << static_cast<int>(p.logits_type));
}

LaunchStatus launch_compact_kv(const CompactKVParams& p, cudaStream_t stream) noexcept {
  TLT_STATUS_CHECK_ARG(p.batch >= 0 && p.batch <= 0x7fffffff, "batch must be >= 0, got " << p.batch);
  TLT_STATUS_CHECK_ARG(p.num_caches >= 1 && p.num_caches <= 65535, "num_caches must be in [1, 65535], got " << p.num_caches);
  TLT_STATUS_CHECK_ARG(p.path_len >= 1, "accepted_nodes needs >= 1 column, got " << p.path_len);
  TLT_STATUS_CHECK_ARG(p.block_size >= 1, "block_size must be >= 1, got " << p.block_size);
  TLT_STATUS_CHECK_ARG(p.unit == 16 || p.unit == 8 || p.unit == 4 || p.unit == 2 || p.unit == 1,
                    "unit must be 16, 8, 4, 2 or 1 bytes, got " << p.unit);
  TLT_STATUS_CHECK_ARG(p.row_bytes >= 1 && p.row_bytes % p.unit == 0,
                    "row_bytes (" << p.row_bytes << ") must be a positive multiple of unit (" << p.unit << ")");
  if (p.batch == 0) return {};
  TLT_STATUS_CHECK_ARG(p.cache_ptrs && p.block_table && p.context_lens && p.accepted_nodes && p.num_accepted,
                    "cache_ptrs, block_table, context_lens, accepted_nodes and num_accepted must be device pointers");
  switch (p.unit) {
    case 16: return launch_compact<16>(p, stream);
    case 8: return launch_compact<8>(p, stream);
    case 4: return launch_compact<4>(p, stream);
    case 2: return launch_compact<2>(p, stream);
    default: return launch_compact<1>(p, stream);
  }
}

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
