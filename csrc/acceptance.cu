// Launchers of the acceptance kernels (verify_tree, compact_kv, build_draft_tree): argument checks,
// dtype dispatch, launch on the caller's stream, launch-error check. Torch-free.
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

namespace tlt {
namespace {

constexpr int kVerifyMaxPortableCluster = 8;

bool valid_type(ElemType t) { return t == ElemType::kFloat32 || t == ElemType::kFloat16 || t == ElemType::kBFloat16; }

// Compute capability major and SM count of the current device, cached per device (attribute
// queries are not stream operations, so this is fine during graph capture).
LaunchStatus device_info(int& major, int& sms) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices][2] = {};  // 0 = not queried yet; benign race: same values
  int dev = 0;
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

cudaLaunchConfig_t verify_config(const VerifyTreeParams& p, int C, int smem, cudaStream_t stream,
                                 cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(static_cast<int64_t>(p.batch) * C));
  cfg.blockDim = dim3(accept::kVerifyThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// CTAs per request. The kernel time is the longest walk of the batch, and a walk's rows are
// streamed by its C CTAs only (even after the other walks are done), so C is as large as the
// residency allows: the largest of {16, 8, 4, 2} whose slices keep >= 2048 tokens and whose B
// clusters fit in two waves (B <= 2 x cudaOccupancyMaxActiveClusters: two 256-thread CTAs per SM at
// <= 128 registers, a cluster within one GPC). Two waves cost little: most walks stop after a row or
// two and free their SMs for the second wave, while the long walks get 2-4x the SMs (H200, chain16
// B=64: C=8 in two waves 274 us, C=2 co-resident 449 us; top-p chain8 2.4 vs 5.4 ms). C = 16 (the
// non-portable size; skipped where the device refuses it) only when all B clusters are co-resident:
// at B=16 it is no faster than C=8. The occupancy query (not a stream operation) is cached per device
// and C: every instantiation has the same footprint (256 threads, <= 128 registers, ~7 KB of static
// shared memory; the dynamic part is small).
template <typename Kernel>
LaunchStatus pick_cluster(const VerifyTreeParams& p, Kernel kernel, int smem, cudaStream_t stream, int& C) {
  C = 1;
  if (p.cluster == 1) return {};
  int major = 0, sms = 0;
  TLT_RETURN_IF_FAILED(device_info(major, sms));
  (void)sms;
  if (p.cluster > 1) {
    TLT_STATUS_CHECK_ARG(major >= 9, "cluster = " << p.cluster << " needs thread-block clusters (sm_90+), the device has compute capability " << major << ".x");
    C = p.cluster;
    return {};
  }
  if (major < 9) return {};
  constexpr int kMaxDevices = 64;
  static int active[kMaxDevices][5] = {};  // [device][log2 C]; 0 = not queried yet
  int dev = 0;
  TLT_STATUS_CUDA_CHECK(cudaGetDevice(&dev));
  for (int c = kVerifyMaxCluster, lg = 4; c > 1; c /= 2, --lg) {
    if (p.vocab < c * 2048) continue;
    int n = dev >= 0 && dev < kMaxDevices ? active[dev][lg] : 0;
    if (n == 0) {
      cudaLaunchAttribute attr[1];
      VerifyTreeParams one = p;
      one.batch = 1;
      const cudaLaunchConfig_t cfg = verify_config(one, c, smem, stream, attr);
      const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
      if (e != cudaSuccess) {
        if (c <= kVerifyMaxPortableCluster) TLT_STATUS_CUDA_CHECK(e);
        (void)cudaGetLastError();  // a refused non-portable size is not sticky: clear it and go on
        n = 0;
      }
      n = n > 0 ? n : -1;  // -1: cannot run (cached too)
      if (dev >= 0 && dev < kMaxDevices) active[dev][lg] = n;
    }
    const int waves = c > kVerifyMaxPortableCluster ? 1 : 2;
    if (static_cast<int64_t>(p.batch) <= static_cast<int64_t>(waves) * n) {
      C = c;
      return {};
    }
  }
  return {};
}

template <typename TL, typename TQ, bool HAS_Q, bool TOPP_COMPACT = false>
LaunchStatus launch_verify(const VerifyTreeParams& p, cudaStream_t stream) {
  auto kernel = accept::verify_tree_kernel<TL, TQ, HAS_Q, TOPP_COMPACT>;
  const int depth_cap = p.max_depth < p.num_tree - 1 ? p.max_depth : p.num_tree - 1;
  // Path bookkeeping, plus parents and tokens of trees small enough to stage (see the kernel).
  const int staged = p.num_tree <= accept::kStageNodes ? 2 * p.num_tree : 0;
  const int smem = static_cast<int>(sizeof(int)) * (4 * depth_cap + 2 + staged);
  if (smem > 48 * 1024) {
    // Allowed during stream capture (not a stream operation); only deep trees need it.
    TLT_STATUS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  static bool non_portable = false;  // per instantiation; a benign race sets the same attribute twice
  if (!non_portable && p.cluster != 1) {
    int major = 0, sms = 0;
    TLT_RETURN_IF_FAILED(device_info(major, sms));
    // Cluster size 16 (sm_90+): a function attribute, not a stream operation (fine during capture).
    if (major >= 9 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
      (void)cudaGetLastError();  // then 16 is refused by the occupancy query / launch instead
    non_portable = true;
  }
  int C = 1;
  TLT_RETURN_IF_FAILED(pick_cluster(p, kernel, smem, stream, C));
  TLT_STATUS_CHECK_ARG(static_cast<int64_t>(p.batch) * C <= 0x7fffffff,
                       "batch " << p.batch << " x cluster " << C << " CTAs exceeds the grid limit");
  if (C == 1) {
    kernel<<<p.batch, accept::kVerifyThreads, smem, stream>>>(p, 1);
    TLT_STATUS_CUDA_CHECK(cudaGetLastError());
    return {};
  }
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = verify_config(p, C, smem, stream, attr);
  TLT_STATUS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, C));
  TLT_STATUS_CUDA_CHECK(cudaGetLastError());
  return {};
}

template <typename TL>
LaunchStatus dispatch_verify_q(const VerifyTreeParams& p, cudaStream_t stream) {
  // The experimental top-p candidate path is instantiated for fp32 draft probabilities (or none) only; other
  // draft dtypes run the default kernel (same results either way).
  if (p.draft_probs == nullptr)
    return p.topp_compact ? launch_verify<TL, float, false, true>(p, stream) : launch_verify<TL, float, false>(p, stream);
  switch (p.q_type) {
    case ElemType::kFloat32:
      return p.topp_compact ? launch_verify<TL, float, true, true>(p, stream) : launch_verify<TL, float, true>(p, stream);
    case ElemType::kFloat16: return launch_verify<TL, __half, true>(p, stream);
    case ElemType::kBFloat16: return launch_verify<TL, __nv_bfloat16, true>(p, stream);
  }
  TLT_STATUS_CHECK_ARG(false, "unknown draft_probs dtype code " << static_cast<int>(p.q_type));
}

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
    case ElemType::kFloat32: return dispatch_verify_q<float>(p, stream);
    case ElemType::kFloat16: return dispatch_verify_q<__half>(p, stream);
    case ElemType::kBFloat16: return dispatch_verify_q<__nv_bfloat16>(p, stream);
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
