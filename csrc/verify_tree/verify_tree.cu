// Launcher of verify_tree: argument checks and logits-dtype dispatch; the launch itself is in verify_tree_launch.cuh,
// compiled per logits dtype and scoring in verify_tree_{f32,f16,bf16}{,_scored}.cu. Torch-free.
//
// Like tree_attention/tree_attention.cu, no C++ exception leaves this nvcc-compiled translation unit: launchers
// return a LaunchStatus and the host-compiled bindings (bindings_verify_tree.cpp) raise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/launch_status.h"
#include "verify_tree/verify_tree.h"
#include "verify_tree/verify_tree_launch.cuh"

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

// A cluster-size argument: 0 (the launcher picks) or a power of two up to kVerifyMaxCluster.
bool valid_cluster(int c) { return c == 0 || c == 1 || c == 2 || c == 4 || c == 8 || c == 16; }

// The scored instantiations (which also write p.scores) where scores is set, else the plain ones.
template <typename TL>
LaunchStatus dispatch_scoring(const VerifyTreeParams& p, cudaStream_t stream) {
  return p.scores ? detail::dispatch_verify_q<TL, true>(p, stream) : detail::dispatch_verify_q<TL, false>(p, stream);
}

}  // namespace

LaunchStatus launch_verify_tree(const VerifyTreeParams& p, cudaStream_t stream) noexcept {
  TLT_STATUS_CHECK_ARG(p.batch >= 0 && p.batch <= 0x7fffffff, "batch must be >= 0, got " << p.batch);
  TLT_STATUS_CHECK_ARG(p.num_tree >= 1 && p.vocab >= 1, "need T >= 1 and V >= 1, got T=" << p.num_tree << " V=" << p.vocab);
  TLT_STATUS_CHECK_ARG(p.max_depth >= 0, "max_depth must be >= 0, got " << p.max_depth);
  const int depth_cap = p.max_depth < p.num_tree - 1 ? p.max_depth : p.num_tree - 1;
  TLT_STATUS_CHECK_ARG(p.vocab <= kVerifyMaxVocab, "V = " << p.vocab << " exceeds the CUDA kernel's limit " << kVerifyMaxVocab);
  TLT_STATUS_CHECK_ARG(valid_cluster(p.cluster),
                    "cluster must be 0 (auto), 1, 2, 4, 8 or 16, got " << p.cluster);
  TLT_STATUS_CHECK_ARG(depth_cap <= kVerifyMaxDepthSmem,
                    "min(max_depth, T - 1) = " << depth_cap << " exceeds the CUDA kernel's limit " << kVerifyMaxDepthSmem);
  TLT_STATUS_CHECK_ARG(valid_type(p.logits_type), "unknown logits dtype code " << static_cast<int>(p.logits_type));
  TLT_STATUS_CHECK_ARG(p.draft_probs == nullptr || valid_type(p.q_type), "unknown draft_probs dtype code " << static_cast<int>(p.q_type));
  TLT_STATUS_CHECK_ARG(p.scratch_rows >= 2 && (p.row_stats == nullptr || p.scratch_rows >= p.num_tree),
                       "scratch needs rows >= 2 per request (>= T = " << p.num_tree << " with row_stats), got "
                                                                     << p.scratch_rows);
  TLT_STATUS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.row_stats) % 16 == 0, "row_stats must be 16-byte aligned");
  TLT_STATUS_CHECK_ARG(valid_cluster(p.rows_cluster),
                       "rows_cluster must be 0 (auto), 1, 2, 4, 8 or 16, got " << p.rows_cluster);
  if (p.batch == 0) return {};
  TLT_STATUS_CHECK_ARG(p.logits && p.draft_tokens && p.parents && p.num_nodes && p.seed && p.offset && p.scratch &&
                        p.out_tokens && p.out_num && p.out_nodes && p.out_error,
                    "logits, draft_tokens, parents, num_nodes, seed, offset, scratch and the outputs must be device pointers");
  switch (p.logits_type) {
    case ElemType::kFloat32: return dispatch_scoring<float>(p, stream);
    case ElemType::kFloat16: return dispatch_scoring<__half>(p, stream);
    case ElemType::kBFloat16: return dispatch_scoring<__nv_bfloat16>(p, stream);
  }
  TLT_STATUS_CHECK_ARG(false, "unknown logits dtype code " << static_cast<int>(p.logits_type));
}

}  // namespace tlt
