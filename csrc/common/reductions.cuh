// Device helpers shared by the acceptance kernels (verify_tree, build_draft_tree): element conversion,
// warp/block reductions and scans, and the order-preserving int image of a float. nvcc only; torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tlt {
namespace accept {

// ============================================================================================
// Block-wide helpers (deterministic: fixed element-to-thread partition, fixed reduction trees).
// ============================================================================================

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

struct MaxU64 { __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; } };
struct MinI { __device__ int operator()(int a, int b) const { return a < b ? a : b; } };
struct MaxI { __device__ int operator()(int a, int b) const { return a > b ? a : b; } };

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Every thread gets the result. `red` holds >= NT / 32 elements of T; reusable on return.
template <int NT, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* red) {
  v = warp_reduce(v, op);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  T r = red[0];
#pragma unroll
  for (int w = 1; w < NT / 32; ++w) r = op(r, red[w]);
  __syncthreads();
  return r;
}

// Exclusive prefix sum over the block in thread order; `total` gets the block's sum.
template <int NT>
__device__ __forceinline__ float block_exclusive_scan(float v, float& total, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) red[warp] = incl;
  __syncthreads();
  float before = 0.f;
  total = 0.f;
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) {
    if (w < warp) before += red[w];
    total += red[w];
  }
  __syncthreads();
  return before + incl - v;
}

// Order-preserving int32 image of a float (NaN excluded); -0.0 maps like +0.0 so that ties at zero
// behave as float comparisons do in the reference.
__device__ __forceinline__ int ordered_key(float x) {
  const int k = __float_as_int(x == 0.f ? 0.f : x);
  return k >= 0 ? k : k ^ 0x7FFFFFFF;
}

__device__ __forceinline__ float key_to_float(int k) { return __int_as_float(k >= 0 ? k : k ^ 0x7FFFFFFF); }

}  // namespace accept
}  // namespace tlt
