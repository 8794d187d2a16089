// compact_kv's host-facing interface (plain C++, torch-free): parameter struct and launcher. The contract is the
// pure-torch reference in tlt_kernels/reference/compact_kv.py.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch_status.h"

namespace tlt {

// In-place move of every request's accepted path, every cache (K and V of every layer), one launch.
//
//   cache_ptrs     uint64 [num_caches] device addresses of [num_blocks, block_size, row] caches
//   block_table    int32 [B, >= max_blocks] (bt_stride_b); context_lens, num_accepted int32 [B]
//   accepted_nodes int32 [B, path_len] (nodes_stride_b)
struct CompactKVParams {
  const uint64_t* cache_ptrs = nullptr;
  const int32_t* block_table = nullptr;
  const int32_t* context_lens = nullptr;
  const int32_t* accepted_nodes = nullptr;
  const int32_t* num_accepted = nullptr;
  int64_t bt_stride_b = 0, nodes_stride_b = 0;
  int64_t row_bytes = 0;  // bytes of one slot (Hkv * D * itemsize)
  int num_caches = 0;
  int batch = 0;
  int path_len = 0;    // P
  int block_size = 0;  // tokens per page
  int unit = 16;       // bytes per access: 16, 8, 4, 2 or 1 (divides row_bytes and every cache address)
};

LaunchStatus launch_compact_kv(const CompactKVParams& p, cudaStream_t stream) noexcept;

}  // namespace tlt
