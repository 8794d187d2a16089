// Launcher of the verify_tree kernel (cluster size choice, launch) for one logits dtype, shared by the six
// translation units verify_tree_{f32,f16,bf16}{,_scored}.cu: each instantiates dispatch_verify_q<TL, SCORED> for its
// TL and SCORED (p.scores set: the walk also writes log-probs), so nvcc compiles the 36 kernel instantiations in six
// parallel jobs instead of one (the build's critical path). Internal to csrc/verify_tree/; verify_tree.cu validates
// the arguments and calls dispatch_verify_q.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch_status.h"
#include "verify_tree/verify_tree.cuh"
#include "verify_tree/verify_tree.h"

namespace tlt {
namespace detail {

constexpr int kVerifyMaxPortableCluster = 8;
constexpr int kMaxDevices = 64;  // per-device caches of the launcher (devices past it are queried every call)

// The current device's ordinal, compute capability major and SM count, cached per device (verify_tree.cu).
LaunchStatus device_info(int& dev, int& major, int& sms);

// verify_tree for logits of type TL: picks the draft-probability instantiation and launches it. SCORED must be
// p.scores != nullptr.
template <typename TL, bool SCORED>
LaunchStatus dispatch_verify_q(const VerifyTreeParams& p, cudaStream_t stream);

#ifdef TLT_DEFINE_VERIFY_LAUNCHERS
// `p.batch` clusters of C CTAs (the rows kernel passes B * T as the batch).
inline cudaLaunchConfig_t verify_config(const VerifyTreeParams& p, int C, int smem, cudaStream_t stream,
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
// two and free their SMs for the second wave, while the long walks get 2-4x the SMs (figures:
// docs/CUDA_NOTES.md, "Measurements behind the csrc rules"). C = 16 (the
// non-portable size; skipped where the device refuses it) only when all B clusters are co-resident:
// at B=16 it is no faster than C=8. The occupancy query (not a stream operation) is cached per device
// and C: every instantiation has the same footprint (256 threads, <= 128 registers, ~13 KB of static
// shared memory, the 64 KB cp.async ring plus a small dynamic part).
// `major` and `dev`: the current device's compute capability and ordinal (the caller's query).
// `waves`: how many waves of p.batch clusters are allowed (2 for walks, 1 for the rows kernel, see launch_rows).
template <typename Kernel>
LaunchStatus pick_cluster(const VerifyTreeParams& p, Kernel kernel, int smem, cudaStream_t stream, int major, int dev,
                          int& C, int waves = 2) {
  C = 1;
  if (p.cluster == 1) return {};
  if (p.cluster > 1) {
    TLT_STATUS_CHECK_ARG(major >= 9, "cluster = " << p.cluster << " needs thread-block clusters (sm_90+), the device has compute capability " << major << ".x");
    C = p.cluster;
    return {};
  }
  if (major < 9) return {};
  static int active[kMaxDevices][5] = {};  // [device][log2 C]; 0 = not queried yet
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
    const int allowed = c > kVerifyMaxPortableCluster ? 1 : waves;
    if (static_cast<int64_t>(p.batch) <= static_cast<int64_t>(allowed) * n) {
      C = c;
      return {};
    }
  }
  return {};
}

// Function attributes of one kernel instantiation (each caller keeps its own `smem_allowed` / `non_portable` per
// device): the dynamic shared memory past 48 KB, and cluster size 16 (sm_90+). Neither is a stream operation, so
// both are allowed during stream capture.
template <typename Kernel>
LaunchStatus set_attributes(Kernel kernel, const VerifyTreeParams& p, int smem, int major, int dev, int* smem_allowed,
                            bool* non_portable) {
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (smem > 48 * 1024 && (!cached || smem > smem_allowed[dev])) {
    TLT_STATUS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (cached) smem_allowed[dev] = smem;
  }
  if ((!cached || !non_portable[dev]) && p.cluster != 1) {
    if (major >= 9 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
      (void)cudaGetLastError();  // then 16 is refused by the occupancy query / launch instead
    if (cached) non_portable[dev] = true;
  }
  return {};
}

// p.batch clusters of C CTAs of `kernel` (C = 1: a plain launch).
template <typename Kernel>
LaunchStatus launch_clusters(Kernel kernel, const VerifyTreeParams& p, int C, int smem, cudaStream_t stream) {
  TLT_STATUS_CHECK_ARG(static_cast<int64_t>(p.batch) * C <= 0x7fffffff,
                       p.batch << " clusters x " << C << " CTAs exceed the grid limit");
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

// The parallel-rows kernel (p.row_stats set): one cluster per (request, node), its C (returned) picked like the
// walk's with B * T rows in place of B requests but in one wave, or forced by p.rows_cluster. One wave: every row
// costs about the same (no short walks free SMs early), so a second wave doubles the time (docs/CUDA_NOTES.md,
// "Parallel rows").
template <typename TL, typename TQ, bool HAS_Q, bool SCORED, bool TOPP_COMPACT>
LaunchStatus launch_rows(const VerifyTreeParams& p, cudaStream_t stream, int major, int dev, int& C) {
  auto kernel = accept::verify_rows_kernel<TL, TQ, HAS_Q, SCORED, TOPP_COMPACT>;
  const int smem = major >= 8 ? accept::kRingBytes : 0;
  static int smem_allowed[kMaxDevices] = {};
  static bool non_portable[kMaxDevices] = {};
  TLT_RETURN_IF_FAILED(set_attributes(kernel, p, smem, major, dev, smem_allowed, non_portable));
  const int64_t rows = static_cast<int64_t>(p.batch) * p.num_tree;
  TLT_STATUS_CHECK_ARG(rows <= 0x7fffffff, "B x T = " << rows << " rows exceed the grid limit");
  VerifyTreeParams rp = p;
  rp.batch = static_cast<int>(rows);
  if (p.rows_cluster > 0) rp.cluster = p.rows_cluster;
  C = 1;
  TLT_RETURN_IF_FAILED(pick_cluster(rp, kernel, smem, stream, major, dev, C, 1));
  return launch_clusters(kernel, rp, C, smem, stream);
}

template <typename TL, typename TQ, bool HAS_Q, bool SCORED, bool TOPP_COMPACT = false>
LaunchStatus launch_verify(const VerifyTreeParams& p, cudaStream_t stream) {
  auto kernel = accept::verify_tree_kernel<TL, TQ, HAS_Q, SCORED, TOPP_COMPACT>;
  const int depth_cap = p.max_depth < p.num_tree - 1 ? p.max_depth : p.num_tree - 1;
  // Path bookkeeping, plus parents and tokens of trees small enough to stage (see the kernel).
  const int staged = p.num_tree <= accept::kStageNodes ? 2 * p.num_tree : 0;
  int dev = 0, major = 0, sms = 0;
  TLT_RETURN_IF_FAILED(device_info(dev, major, sms));
  // The sweep's cp.async ring (sm_80+, where the kernel is built with it) comes first.
  const int ring = major >= 8 ? accept::kRingBytes : 0;
  const int smem = ring + static_cast<int>(sizeof(int)) * (4 * depth_cap + 2 + staged);
  static int smem_allowed[kMaxDevices] = {};  // 0: not set yet (the default allows 48 KB)
  static bool non_portable[kMaxDevices] = {};
  TLT_RETURN_IF_FAILED(set_attributes(kernel, p, smem, major, dev, smem_allowed, non_portable));
  VerifyTreeParams wp = p;
  wp.rows_cluster = 0;  // the walk's test `rows_cluster == C` (C >= 1) fails without a rows kernel
  if (p.row_stats)
    TLT_RETURN_IF_FAILED((launch_rows<TL, TQ, HAS_Q, SCORED, TOPP_COMPACT>(p, stream, major, dev, wp.rows_cluster)));
  int C = 1;
  TLT_RETURN_IF_FAILED(pick_cluster(wp, kernel, smem, stream, major, dev, C));
  return launch_clusters(kernel, wp, C, smem, stream);
}

template <typename TL, bool SCORED>
LaunchStatus dispatch_verify_q(const VerifyTreeParams& p, cudaStream_t stream) {
  // The top-p candidate path is instantiated for fp32 draft probabilities (or none) only; other draft dtypes run
  // the default kernel (same results either way). Without a top_p tensor no request filters by top-p: the plain
  // kernel is the same computation without the candidate path's code and registers (before the cp.async ring the
  // candidate instantiations spilled at the 128-register cap, and a top-p-free batch ran them).
  const bool compact = p.topp_compact && p.top_p != nullptr;
  TLT_STATUS_CHECK_ARG(SCORED == (p.scores != nullptr), "the scored launcher runs exactly when scores is set");
  if (p.draft_probs == nullptr) {
    return compact ? launch_verify<TL, float, false, SCORED, true>(p, stream)
                   : launch_verify<TL, float, false, SCORED>(p, stream);
  }
  switch (p.q_type) {
    case ElemType::kFloat32:
      return compact ? launch_verify<TL, float, true, SCORED, true>(p, stream)
                     : launch_verify<TL, float, true, SCORED>(p, stream);
    case ElemType::kFloat16: return launch_verify<TL, __half, true, SCORED>(p, stream);
    case ElemType::kBFloat16: return launch_verify<TL, __nv_bfloat16, true, SCORED>(p, stream);
  }
  TLT_STATUS_CHECK_ARG(false, "unknown draft_probs dtype code " << static_cast<int>(p.q_type));
}
#endif  // TLT_DEFINE_VERIFY_LAUNCHERS

}  // namespace detail
}  // namespace tlt
