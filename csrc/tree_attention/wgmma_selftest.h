// Host interface of the wgmma building-block self-test (torch-free; raw device pointers).
#pragma once

#include <cuda_runtime.h>

#include "common/launch_status.h"

namespace tlt {

// One warpgroup, one tile, the two products of an attention step (csrc/tree_attention/wgmma_sm90.cuh):
//   s_out = A B^T        A, B [64, 128] row-major (16-bit, `dtype` 0 = fp16, 1 = bf16); s_out float32 [64, 64]
//   o_out = P V          P = s_out rounded to the 16-bit type, V [64, 128] row-major; o_out float32 [64, 128]
// Inputs are staged through 128-byte-swizzled shared memory exactly as the attention kernel stages Q, K and V.
// The kernel then redoes both products with the 128-wide blocks (the 128-token context tile's) on mirrored
// 128-row operands built from the same inputs, and writes +inf into every s_out / o_out element they disagree on.
struct WgmmaSelftestParams {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* v = nullptr;
  float* s_out = nullptr;
  float* o_out = nullptr;
  int dtype = 1;
};

LaunchStatus launch_wgmma_selftest(const WgmmaSelftestParams& p, cudaStream_t stream) noexcept;

}  // namespace tlt
