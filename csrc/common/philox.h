// Philox4x32-10 counter-based RNG shared by the host (bindings: philox_uniform_host) and the kernels
// (verify_tree's accept/sample uniforms). Plain C++ with __host__ __device__ under nvcc; torch-free.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TLT_HD __host__ __device__ __forceinline__
#else
#define TLT_HD inline
#endif

namespace tlt {


// ---------------------------------------------------------------------------------------------
// Philox4x32-10, bit-identical to tlt_kernels/rng.py: key = (seed lo, seed hi), counter =
// (offset lo, offset hi, node, purpose), uniform = ((word0 >> 9) + 0.5) * 2^-23. The uniform is
// exact in float32 (23 significant bits plus the half), so every backend produces the same bits.
// ---------------------------------------------------------------------------------------------
constexpr uint32_t kPurposeAccept = 0;
constexpr uint32_t kPurposeSample = 1;

TLT_HD uint32_t philox4x32_10_word0(uint64_t seed, uint64_t offset, uint32_t node, uint32_t purpose) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32), c2 = node, c3 = purpose;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

TLT_HD float philox_uniform(int64_t seed, int64_t offset, uint32_t node, uint32_t purpose) {
  const uint32_t w = philox4x32_10_word0(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), node, purpose);
  return (static_cast<float>(w >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
}

}  // namespace tlt
