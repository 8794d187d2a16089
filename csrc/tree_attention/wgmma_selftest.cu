// Self-test of csrc/tree_attention/wgmma_sm90.cuh on one tile (see wgmma_selftest.h): checks the swizzled staging, both
// descriptor kinds, the accumulator -> A-fragment mapping and the instruction wrappers against torch, before
// any attention kernel is built on them; the 128-wide blocks of the 128-token context tile against the 64-wide ones.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch_status.h"
#include "tree_attention/wgmma_selftest.h"
#include "tree_attention/wgmma_sm90.cuh"

namespace tlt {
namespace {

constexpr int kRows = 64, kCols = 128, kThreads = 128;

// Copies a row-major [64, 128] 16-bit matrix into rows row0 + step * i (i < 64) of a swizzled [tile_rows, 128] tile,
// 16 bytes per chunk.
template <typename T>
__device__ void stage(const T* src, unsigned char* tile, int tile_rows = kRows, int row0 = 0, int step = 1) {
  for (int i = threadIdx.x; i < kRows * (kCols / 8); i += kThreads) {
    const int row = i / (kCols / 8), chunk = i % (kCols / 8);
    const uint4 v = *reinterpret_cast<const uint4*>(src + row * kCols + chunk * 8);
    *reinterpret_cast<uint4*>(tile + wgmma::swizzled_offset(tile_rows, row0 + step * row, chunk)) = v;
  }
}

// The documented outputs (wgmma_selftest.h) come from the 64-wide blocks of the 64-token tile. The 128-wide blocks
// of the 128-token tile (mma_m64n128k16_ss, desc_k_major / desc_mn_major over 128 rows, the float[64] a_fragment)
// then redo the same products on 128-row operands built from the same inputs, the second half mirrored:
//   B' = [B; reverse_rows(B)]  =>  S' = A B'^T = [S | reverse_cols(S)]
//   V' = [V; reverse_rows(V)]  =>  O' = round(S') V' = sum_c P[:, c] V[c] + sum_c P[:, 63-c] V[63-c] = 2 P V
// The mirror makes a mixed-up half (wrong half stride, accumulator column order, fragment index) change the
// result instead of landing on an identical copy. Where S' or O' disagrees, the matching s_out / o_out element is
// overwritten with +inf, which the test reports as the 128-wide path's failure (the 64-wide one never writes inf).
template <typename T>
__global__ void __launch_bounds__(kThreads) wgmma_selftest_kernel(const T* a, const T* b, const T* v, float* s_out,
                                                                  float* o_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // 48 KB, the static limit: the 64-row B and V tiles and later the 128-row B' and V' share `sbv`.
  __shared__ __align__(1024) unsigned char sa[kRows * kCols * 2];
  __shared__ __align__(1024) unsigned char sbv[2 * kRows * kCols * 2];
  unsigned char* const sb = sbv;
  unsigned char* const sv = sbv + kRows * kCols * 2;
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
  wgmma::fence_regs(s);

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
  wgmma::fence_regs(o);

  // The 128-wide path, checked against the 64-wide one's registers; s and o are written out last, an element the
  // 128-wide path disagrees with as +inf.
  __syncthreads();  // S and O read every B and V element: `sbv` takes B'
  stage(b, sbv, 2 * kRows, 0, 1);
  stage(b, sbv, 2 * kRows, 2 * kRows - 1, -1);
  wgmma::fence_proxy_async();
  __syncthreads();
  const uint32_t bv0 = wgmma::smem_addr(sbv);
  float s2[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) s2[i] = 0.f;
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < kCols / 16; ++k)
    wgmma::mma_m64n128k16_ss<T>(s2, wgmma::desc_k_major(a0, kRows, k), wgmma::desc_k_major(bv0, 2 * kRows, k), k > 0);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_regs(s2);
  // S's element 4j + e (j < 8: row r0 + 8 (e / 2), column c = 8j + 2 (l % 4) + e % 2) is S' element 4j + e here,
  // and S' column 127 - c = 8 (15 - j) + 2 (3 - l % 4) + 1 - e % 2: element 4 (15 - j) + 2 (e / 2) + 1 - e % 2 of
  // lane l ^ 3 (the same row, l % 4 mirrored).
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float ref = s[4 * j + e];
      const float mirrored = __shfl_xor_sync(0xffffffff, s2[4 * (15 - j) + 2 * (e / 2) + 1 - e % 2], 3);
      const float tol = 1e-3f + 1e-4f * fabsf(ref);
      if (!(fabsf(s2[4 * j + e] - ref) <= tol && fabsf(mirrored - ref) <= tol)) s[4 * j + e] = INFINITY;
    }
  uint32_t frag2[2 * kRows / 16][4];
#pragma unroll
  for (int t = 0; t < 2 * kRows / 16; ++t) wgmma::a_fragment<T>(s2, t, frag2[t]);

  __syncthreads();  // B' read by every wgmma: its storage takes V'
  stage(v, sbv, 2 * kRows, 0, 1);
  stage(v, sbv, 2 * kRows, 2 * kRows - 1, -1);
  wgmma::fence_proxy_async();
  __syncthreads();
  float o2[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o2[i] = 0.f;
  wgmma::fence();
#pragma unroll
  for (int t = 0; t < 2 * kRows / 16; ++t)
    wgmma::mma_m64n128k16_rs<T>(o2, frag2[t], wgmma::desc_mn_major(bv0, 2 * kRows, t), t > 0);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_regs(o2);
  // O' = 2 O up to fp32 summation order (and a 16-bit rounding flip of P where S' and S differ in the last bit).
#pragma unroll
  for (int i = 0; i < 64; ++i)
    if (!(fabsf(o2[i] - 2.f * o[i]) <= 2e-2f + 4e-3f * fabsf(o[i]))) o[i] = INFINITY;

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
  TLT_RETURN_IF_FAILED(wgmma::require_sm90());
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
