// Launcher of compact_kv: argument checks, access-width dispatch, launch on the caller's stream, launch-error
// check. Torch-free; returns a LaunchStatus (no exception leaves this nvcc-compiled unit), raised by
// bindings_compact_kv.cpp.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/launch_status.h"
#include "compact_kv/compact_kv.cuh"
#include "compact_kv/compact_kv.h"

namespace tlt {
namespace {

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

}  // namespace

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

}  // namespace tlt
