// Self-test of csrc/wgmma_sm90.cuh on one tile (see wgmma_selftest.h): checks the swizzled staging, both
// descriptor kinds, the accumulator -> A-fragment mapping and the instruction wrappers against torch, before
// any attention kernel is built on them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch_status.h"
#include "wgmma_selftest.h"
#include "wgmma_sm90.cuh"

namespace tlt {
namespace {

constexpr int kRows = 64, kCols = 128, kThreads = 128;

// Copies a row-major [64, 128] 16-bit matrix into a swizzled tile, 16 bytes per chunk.
template <typename T>
__device__ void stage(const T* src, unsigned char* tile) {
  for (int i = threadIdx.x; i < kRows * (kCols / 8); i += kThreads) {
    const int row = i / (kCols / 8), chunk = i % (kCols / 8);
    const uint4 v = *reinterpret_cast<const uint4*>(src + row * kCols + chunk * 8);
    *reinterpret_cast<uint4*>(tile + wgmma::swizzled_offset(kRows, row, chunk)) = v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) wgmma_selftest_kernel(const T* a, const T* b, const T* v, float* s_out,
                                                                  float* o_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(1024) unsigned char sa[kRows * kCols * 2];
  __shared__ __align__(1024) unsigned char sb[kRows * kCols * 2];
  __shared__ __align__(1024) unsigned char sv[kRows * kCols * 2];
  stage(a, sa);
  stage(b, sb);
  stage(v, sv);
  wgmma::fence_proxy_async();
  __syncthreads();

  float s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  const uint32_t a0 = wgmma::smem_addr(sa), b0 = wgmma::smem_addr(sb), v0 = wgmma::smem_addr(sv);
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < kCols / 16; ++k)
    wgmma::mma_m64n64k16_ss<T>(s, wgmma::desc_k_major(a0, kRows, k), wgmma::desc_k_major(b0, kRows, k), k > 0);
  wgmma::commit();
  wgmma::wait<0>();

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  // Every A fragment is in its registers before the fence, as wgmma requires of register operands.
  uint32_t frag[kRows / 16][4];
#pragma unroll
  for (int t = 0; t < kRows / 16; ++t) wgmma::a_fragment<T>(s, t, frag[t]);
  wgmma::fence();
#pragma unroll
  for (int t = 0; t < kRows / 16; ++t)
    wgmma::mma_m64n128k16_rs<T>(o, frag[t], wgmma::desc_mn_major(v0, kRows, t), t > 0);
  wgmma::commit();
  wgmma::wait<0>();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s_out[(row + 8 * (e / 2)) * 64 + 8 * j + col + (e % 2)] = s[4 * j + e];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o_out[(row + 8 * (e / 2)) * 128 + 8 * j + col + (e % 2)] = o[4 * j + e];
#endif
}

}  // namespace

LaunchStatus launch_wgmma_selftest(const WgmmaSelftestParams& p, cudaStream_t stream) noexcept {
  TLT_STATUS_CHECK_ARG(p.a && p.b && p.v && p.s_out && p.o_out, "a, b, v, s_out and o_out must be device pointers");
  TLT_STATUS_CHECK_ARG(p.dtype == 0 || p.dtype == 1, "dtype must be 0 (fp16) or 1 (bf16), got " << p.dtype);
  int dev = 0, major = 0;
  TLT_STATUS_CUDA_CHECK(cudaGetDevice(&dev));
  TLT_STATUS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  TLT_STATUS_CHECK_ARG(major == 9, "wgmma needs an sm_90 GPU, the device has compute capability " << major << ".x");
  if (p.dtype == 1)
    wgmma_selftest_kernel<__nv_bfloat16><<<1, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(p.a), static_cast<const __nv_bfloat16*>(p.b),
        static_cast<const __nv_bfloat16*>(p.v), p.s_out, p.o_out);
  else
    wgmma_selftest_kernel<__half><<<1, kThreads, 0, stream>>>(static_cast<const __half*>(p.a),
                                                              static_cast<const __half*>(p.b),
                                                              static_cast<const __half*>(p.v), p.s_out, p.o_out);
  TLT_STATUS_CHECK_LAUNCH();
  return {};
}

}  // namespace tlt
