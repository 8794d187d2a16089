// The KV compaction kernel (torch-free, nvcc only); launched from compact_kv.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "compact_kv/compact_kv.h"

namespace tlt {
namespace accept {

constexpr int kCompactThreads = 256;
constexpr int kCompactStageBytes = 16384;  // staging tile budget: path_len x slab bytes

template <int U>
struct UnitType;
template <> struct UnitType<16> { using type = uint4; };
template <> struct UnitType<8> { using type = uint2; };
template <> struct UnitType<4> { using type = uint32_t; };
template <> struct UnitType<2> { using type = uint16_t; };
template <> struct UnitType<1> { using type = uint8_t; };

// Grid (B, num_caches, slabs). A CTA moves one column slab (`slab` bytes) of every depth of one
// request's path in one cache. Race freedom: a destination slot ctx + d may be the source slot
// ctx + node[d'] of another depth d' (node[d'] == d), so the CTA gathers the slab of *every* depth
// into shared memory, synchronizes, then scatters (the launcher sizes the slab so that path_len x
// slab bytes fit). CTAs never overlap: different requests own different tail slots (ctx + 0 .. ctx +
// max node), caches are distinct tensors, slabs are distinct columns. Depths already in place
// (node[d] == d, e.g. the whole of a chain) are skipped: no traffic.
//
// Dynamic shared memory: src_row[P], dst_row[P] (int64), then the staging tile [P, slab].
template <int U>
__global__ void __launch_bounds__(kCompactThreads) compact_kv_kernel(const CompactKVParams p, int slab) {
  using Unit = typename UnitType<U>::type;
  extern __shared__ __align__(16) unsigned char csm[];
  int64_t* src_row = reinterpret_cast<int64_t*>(csm);
  int64_t* dst_row = src_row + p.path_len;
  Unit* stage = reinterpret_cast<Unit*>(dst_row + p.path_len);  // 16-byte aligned: 16 * P bytes before
  const int b = blockIdx.x;
  unsigned char* cache = reinterpret_cast<unsigned char*>(p.cache_ptrs[blockIdx.y]);
  const int64_t col0 = static_cast<int64_t>(blockIdx.z) * slab;
  const int64_t left = p.row_bytes - col0;
  const int units = static_cast<int>((left < slab ? left : static_cast<int64_t>(slab)) / U);
  const int depths = min(p.num_accepted[b] + 1, p.path_len);
  const int64_t ctx = p.context_lens[b];
  const int32_t* table = p.block_table + b * p.bt_stride_b;
  const int32_t* nodes = p.accepted_nodes + b * p.nodes_stride_b;

  for (int d = threadIdx.x; d < depths; d += kCompactThreads) {
    const int node = nodes[d];
    if (node == d) {
      src_row[d] = -1;
    } else {
      const int64_t ss = ctx + node, ds = ctx + d;
      src_row[d] = static_cast<int64_t>(table[ss / p.block_size]) * p.block_size + ss % p.block_size;
      dst_row[d] = static_cast<int64_t>(table[ds / p.block_size]) * p.block_size + ds % p.block_size;
    }
  }
  __syncthreads();
  const int total = depths * units;
  for (int i = threadIdx.x; i < total; i += kCompactThreads) {
    const int r = i / units, c = i - r * units;
    if (src_row[r] >= 0)
      stage[i] = *reinterpret_cast<const Unit*>(cache + src_row[r] * p.row_bytes + col0 + static_cast<int64_t>(c) * U);
  }
  __syncthreads();  // every source of this slab is read before any destination is written
  for (int i = threadIdx.x; i < total; i += kCompactThreads) {
    const int r = i / units, c = i - r * units;
    if (src_row[r] >= 0)
      *reinterpret_cast<Unit*>(cache + dst_row[r] * p.row_bytes + col0 + static_cast<int64_t>(c) * U) = stage[i];
  }
}

}  // namespace accept
}  // namespace tlt
