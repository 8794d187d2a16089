// Launchers of the tree-attention kernels: argument checks, dtype / head-dim dispatch, launch on the
// caller's stream, launch-error check. Torch-free.
// Launchers return a tlt::LaunchStatus (launch_status.h): no C++ exception leaves this translation unit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/launch_status.h"
#include "tree_attention/tree_attention.cuh"
#include "tree_attention/tree_attention.h"

namespace tlt {
namespace {

constexpr int kNumConfigs = 8;  // p.config values, see launch_partial

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

LaunchStatus check_common(const TreeAttentionParams& p) {
  TLT_STATUS_CHECK_ARG(p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256,
                "head_dim must be 64, 128 or 256 for the CUDA backend, got " << p.head_dim);
  TLT_STATUS_CHECK_ARG(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16,
                "dtype code must be 0 (float16) or 1 (bfloat16), got " << static_cast<int>(p.dtype));
  TLT_RETURN_IF_FAILED(check_tree_attention_scales(p));
  TLT_STATUS_CHECK_ARG(p.batch >= 0 && p.num_tree >= 1, "need batch >= 0 and num_tree >= 1, got " << p.batch << ", " << p.num_tree);
  TLT_STATUS_CHECK_ARG(p.num_kv_heads >= 1 && p.group >= 1 && p.num_q_heads == p.num_kv_heads * p.group,
                "num_q_heads (" << p.num_q_heads << ") must equal num_kv_heads (" << p.num_kv_heads << ") * group (" << p.group << ")");
  TLT_STATUS_CHECK_ARG(p.num_splits >= 1, "num_splits must be >= 1, got " << p.num_splits);
  TLT_STATUS_CHECK_ARG(p.batch <= 65535 && p.num_kv_heads <= 65535, "batch and num_kv_heads must be <= 65535 (grid limits)");
  TLT_STATUS_CHECK_ARG(p.num_q_heads > 0 && p.partial_lse != nullptr && p.partial_out != nullptr && p.num_nodes != nullptr,
                "partial_out, partial_lse and num_nodes must be device pointers");
  TLT_STATUS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.partial_out) % 8 == 0, "partial_out must be 8-byte aligned");
  TLT_STATUS_CHECK_ARG(p.out != nullptr, "out must be a device pointer");
  // out is written two elements (4 bytes) at a time.
  TLT_STATUS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && p.out_stride_b % 2 == 0 && p.out_stride_t % 2 == 0 &&
                           p.out_stride_h % 2 == 0,
                       "out must be 4-byte aligned with even strides, got strides (" << p.out_stride_b << ", "
                                                                                      << p.out_stride_t << ", " << p.out_stride_h << ")");
  TLT_STATUS_CHECK_ARG(p.split_len >= 1, "split_len must be >= 1, got " << p.split_len);
  TLT_STATUS_CHECK_ARG(p.config >= 0 && p.config < kNumConfigs,
                       "config must be in [0, " << kNumConfigs << "), got " << p.config);
  return {};
}

// Default configuration per head dim (kStages, kQInRegs); the row tile (4 or 8 warps) follows M.
//   D=64/128: Q fragments in registers, 4 / 3 ring stages (64-token tiles).
//   D=256: Q re-read from shared memory (the O accumulator alone is 128 registers), 3 stages of
//   32-token tiles.
//   8 warps at D=128: 2 stages (2 and 3 measured within run-to-run noise); config 6 (128-token
//   tiles, Q in shared memory) is the next default candidate once confirmed (sweeps: docs/CUDA_NOTES.md).
template <int D, int kWarps>
using DefaultTraits = tree_attn::KernelTraits<D, kWarps, D == 64 ? 4 : (D == 128 && kWarps == 8 ? 2 : 3), D <= 128>;

template <typename T, class KT, typename KV = T>
LaunchStatus launch_partial_with(const TreeAttentionParams& p, cudaStream_t stream) {
  auto kernel = tree_attn::tree_attention_partial_kernel<T, KT, KV>;
  const int smem = static_cast<int>(tree_attn::kIsFp8<KV> ? KT::kFp8SmemBytes : KT::kSmemBytes);
  // Needed above 48 KiB; cheap and allowed during stream capture, and per device, so set every call.
  TLT_STATUS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t chunks = (int64_t(p.num_tree) * p.group + KT::kBlockM - 1) / KT::kBlockM;
  TLT_STATUS_CHECK_ARG(int64_t(p.num_splits) * chunks <= 0x7fffffff, "too many splits x row chunks for one launch");
  const dim3 grid(static_cast<unsigned>(p.num_splits * chunks), p.batch, p.num_kv_heads);
  kernel<<<grid, KT::kThreads, smem, stream>>>(p);
  TLT_STATUS_CHECK_LAUNCH();
  return {};
}

// p.config: 0 = per-shape default: one CTA of 4 warps (64 rows) when M = T * G <= 64, else 8 warps
// (128 rows, chunks of 128 above that). Tuning variants (bf16, D=128 only, always 8 warps):
// 1 = 3 stages, 2 = 4 stages, 3 = 3 stages with Q in shared memory, 4 = 2 stages with Q in shared
// memory and <= 128 registers (2 CTAs per SM), 6 / 7 = 128-token tiles, 2 stages, Q in shared memory /
// in registers; 5 = the default with 4 warps (64-row chunks), any shape.
template <typename T, int D>
LaunchStatus launch_partial(const TreeAttentionParams& p, cudaStream_t stream) {
  if constexpr (D == 128 && std::is_same<T, __nv_bfloat16>::value) {
    switch (p.config) {
      case 1: return launch_partial_with<T, tree_attn::KernelTraits<128, 8, 3, true>>(p, stream);
      case 2: return launch_partial_with<T, tree_attn::KernelTraits<128, 8, 4, true>>(p, stream);
      case 3: return launch_partial_with<T, tree_attn::KernelTraits<128, 8, 3, false>>(p, stream);
      case 4: return launch_partial_with<T, tree_attn::KernelTraits<128, 8, 2, false, 2>>(p, stream);
      case 6: return launch_partial_with<T, tree_attn::KernelTraits<128, 8, 2, false, 1, 128>>(p, stream);
      case 7: return launch_partial_with<T, tree_attn::KernelTraits<128, 8, 2, true, 1, 128>>(p, stream);
      default: break;
    }
  } else {
    TLT_STATUS_CHECK_ARG(p.config == 0 || p.config == 5,
                         "config " << p.config << " is a tuning variant of bf16 / head_dim 128 only (use 0)");
  }
  if (p.config == 5 || p.num_tree * p.group <= 64) return launch_partial_with<T, DefaultTraits<D, 4>>(p, stream);
  return launch_partial_with<T, DefaultTraits<D, 8>>(p, stream);
}

// fp8 caches (KV). Default (0, or 5 for 4 warps): two ring stages at D <= 128, both rings, so that the fp8 staging ring
// still leaves room for two CTAs per SM (the 16-bit defaults' three stages with it take 150 KB at D = 128: one CTA).
// config 1: the 16-bit defaults' stages (the tuning variant the default was measured against).
template <int D, int kWarps>
using Fp8Traits = tree_attn::KernelTraits<D, kWarps, D <= 128 ? 2 : 3, D <= 128>;

template <typename T, int D, typename KV>
LaunchStatus launch_partial_fp8(const TreeAttentionParams& p, cudaStream_t stream) {
  TLT_STATUS_CHECK_ARG(p.config == 0 || p.config == 1 || p.config == 5,
                       "config " << p.config << " is a tuning variant of caches of q's dtype (fp8 caches: 0, 1 or 5)");
  const bool four_warps = p.config == 5 || p.num_tree * p.group <= 64;
  if (p.config == 1)
    return four_warps ? launch_partial_with<T, DefaultTraits<D, 4>, KV>(p, stream)
                      : launch_partial_with<T, DefaultTraits<D, 8>, KV>(p, stream);
  return four_warps ? launch_partial_with<T, Fp8Traits<D, 4>, KV>(p, stream)
                    : launch_partial_with<T, Fp8Traits<D, 8>, KV>(p, stream);
}

template <typename T, int D>
LaunchStatus launch_merge(const TreeAttentionParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.num_tree * p.num_q_heads;
  const int64_t blocks = (rows + tree_attn::kMergeWarps - 1) / tree_attn::kMergeWarps;
  TLT_STATUS_CHECK_ARG(blocks <= 0x7fffffff, "too many output rows for one launch: " << rows);
  tree_attn::tree_attention_merge_kernel<T, D><<<static_cast<unsigned>(blocks), tree_attn::kMergeWarps * 32, 0, stream>>>(p);
  TLT_STATUS_CHECK_LAUNCH();
  return {};
}

template <template <typename, int> class Launch>
LaunchStatus dispatch(const TreeAttentionParams& p, cudaStream_t stream) {
#define TLT_DISPATCH_D(T)                                 \
  switch (p.head_dim) {                                   \
    case 64: return Launch<T, 64>::run(p, stream);        \
    case 128: return Launch<T, 128>::run(p, stream);      \
    case 256: return Launch<T, 256>::run(p, stream);      \
  }
  if (p.dtype == DType::kBFloat16) {
    TLT_DISPATCH_D(__nv_bfloat16)
  } else {
    TLT_DISPATCH_D(__half)
  }
#undef TLT_DISPATCH_D
  TLT_STATUS_CHECK_ARG(false, "unsupported head_dim " << p.head_dim);
}

template <typename T, int D>
struct PartialLaunch {
  static LaunchStatus run(const TreeAttentionParams& p, cudaStream_t s) { return launch_partial<T, D>(p, s); }
};
template <typename T, int D>
struct PartialLaunchE4M3 {
  static LaunchStatus run(const TreeAttentionParams& p, cudaStream_t s) {
    return launch_partial_fp8<T, D, __nv_fp8_e4m3>(p, s);
  }
};
template <typename T, int D>
struct PartialLaunchE5M2 {
  static LaunchStatus run(const TreeAttentionParams& p, cudaStream_t s) {
    return launch_partial_fp8<T, D, __nv_fp8_e5m2>(p, s);
  }
};
template <typename T, int D>
struct MergeLaunch {
  static LaunchStatus run(const TreeAttentionParams& p, cudaStream_t s) { return launch_merge<T, D>(p, s); }
};

}  // namespace

int cache_num_blocks(const TreeAttentionParams& p) noexcept {
  if (p.cache_tokens <= 0 || p.block_size <= 0) return INT32_MAX;  // unknown: no bound
  const int64_t blocks = p.cache_tokens / p.block_size;
  return blocks < INT32_MAX ? static_cast<int>(blocks) : INT32_MAX;
}

LaunchStatus check_tree_attention_scales(const TreeAttentionParams& p) noexcept {
  TLT_STATUS_CHECK_ARG(p.kv_fp8 == Fp8Format::kNone || p.kv_fp8 == Fp8Format::kE4M3 || p.kv_fp8 == Fp8Format::kE5M2,
                       "kv_fp8 code must be 0 (caches of q's dtype), 1 (e4m3) or 2 (e5m2), got "
                           << static_cast<int>(p.kv_fp8));
  TLT_STATUS_CHECK_ARG(p.v_scale > 0.f && p.v_scale < INFINITY, "v_scale must be a finite number > 0, got " << p.v_scale);
  return {};
}

LaunchStatus check_tree_attention_gather(const TreeAttentionParams& p) noexcept {
  TLT_STATUS_CHECK_ARG(p.q && p.k_cache && p.v_cache && p.block_table && p.context_lens,
                "q, k_cache, v_cache, block_table and context_lens must be device pointers");
  TLT_STATUS_CHECK_ARG(aligned16(p.q) && aligned16(p.k_cache) && aligned16(p.v_cache),
                "q, k_cache and v_cache must be 16-byte aligned (cp.async loads 16 bytes)");
  TLT_STATUS_CHECK_ARG(p.q_stride_b % 8 == 0 && p.q_stride_t % 8 == 0 && p.q_stride_h % 8 == 0,
                "q strides must be multiples of 8 elements (16 bytes)");
  TLT_STATUS_CHECK_ARG(p.k_stride_block % 8 == 0 && p.k_stride_token % 8 == 0 && p.k_stride_head % 8 == 0 &&
                    p.v_stride_block % 8 == 0 && p.v_stride_token % 8 == 0 && p.v_stride_head % 8 == 0,
                "k_cache / v_cache strides must be multiples of 8 elements (16 bytes)");
  TLT_STATUS_CHECK_ARG(p.block_size >= 1, "block_size must be >= 1, got " << p.block_size);
  return {};
}

LaunchStatus launch_tree_attention_partial(const TreeAttentionParams& p, cudaStream_t stream) noexcept {
  TLT_RETURN_IF_FAILED(check_common(p));
  TLT_RETURN_IF_FAILED(check_tree_attention_gather(p));
  TLT_STATUS_CHECK_ARG(p.tree_mask, "tree_mask must be a device pointer");
  TLT_STATUS_CHECK_ARG(p.num_tree <= tree_attn::kMaxTree,
                       "num_tree must be <= " << tree_attn::kMaxTree << " for the CUDA kernels, got " << p.num_tree);
  TLT_STATUS_CHECK_ARG(p.mask_words == (p.num_tree + 31) / 32,
                "mask_words must be ceil(num_tree / 32) = " << (p.num_tree + 31) / 32 << ", got " << p.mask_words);
  if (p.batch == 0) return {};
  TreeAttentionParams q = p;
  q.block_shift = (p.block_size & (p.block_size - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(p.block_size)) : -1;
  q.num_blocks = cache_num_blocks(p);
  switch (q.kv_fp8) {
    case Fp8Format::kE4M3: return dispatch<PartialLaunchE4M3>(q, stream);
    case Fp8Format::kE5M2: return dispatch<PartialLaunchE5M2>(q, stream);
    default: return dispatch<PartialLaunch>(q, stream);
  }
}

LaunchStatus launch_tree_attention_merge(const TreeAttentionParams& p, cudaStream_t stream) noexcept {
  TLT_RETURN_IF_FAILED(check_common(p));
  // One split means every request was finished by step 1.
  if (p.batch == 0 || p.num_splits == 1) return {};
  return dispatch<MergeLaunch>(p, stream);
}

}  // namespace tlt
