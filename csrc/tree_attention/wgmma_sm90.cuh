// sm_90 warpgroup MMA building blocks (torch-free): 128-byte-swizzled shared-memory tiles, wgmma matrix
// descriptors, and the two products of an attention tile, S = Q K^T (both operands from shared memory) and
// O += P V (P from registers, V from shared memory). The CUDA port of the overlapped tree-attention schedule
// (tlt_kernels/_triton/tree_attention_gluon.py), csrc/tree_attention/tree_attention_ctx_sm90.cu, is built from these;
// csrc/tree_attention/wgmma_selftest.cu checks each piece against torch on a GPU.
//
// S is one m64n64 (64-token K tile) or m64n128 (128-token tile) product per k-step; every helper below takes the
// tile's row count, so the same code addresses 64- and 128-row K/V tiles (and the 128-row Q tile).
//
// Tile layout (what the Gluon kernel's NVMMASharedLayout(swizzle 128 B, 16-bit) produces, and what the
// descriptors below describe): a [rows, 128] bf16/fp16 tile is two halves of 64 columns (128 B per row), the
// half h at byte h * rows * 128. Row r of a half is at r * 128; its 16-byte chunk c (columns 8c .. 8c+7 of the
// half) sits at chunk position c ^ (r % 8). Tiles start 1024-byte aligned (the swizzle repeats every 8 rows).
//
// Descriptors (PTX "matrix descriptor", the values the Triton 3.6 compiler emits for these tiles):
//   bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4, 62-63 swizzle
//   (1 = 128 B). K-major operand (Q or K rows, the reduction dim contiguous): stride 1024 (8 rows), leading 0;
//   the k-th 16-wide step starts 32 * (k % 4) bytes into half k / 4. MN-major operand (V as the B of P V: rows =
//   the reduction dim, columns = N): stride 1024 (8 rows of K), leading = one half (rows * 128 bytes, the next 64
//   columns of N); the k-th 16-row step starts at 16 * 128 * k bytes; the instruction's tnspB flag is 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/launch_status.h"
#include "tree_attention/tree_attention.cuh"  // tree_attn::smem_addr, tree_attn::TypeTraits<T>::pack

namespace tlt {
namespace wgmma {

using tree_attn::smem_addr;

// Host side of every launcher of these blocks: wgmma exists on sm_90 only.
inline LaunchStatus require_sm90() noexcept {
  int dev = 0, major = 0;
  TLT_STATUS_CUDA_CHECK(cudaGetDevice(&dev));
  TLT_STATUS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  TLT_STATUS_CHECK_ARG(major == 9, "wgmma needs an sm_90 GPU, the device has compute capability " << major << ".x");
  return {};
}

// Byte offset of the 16-byte chunk holding columns 8 * chunk16 .. + 7 of row `row` in a [rows, 128] tile.
__device__ __forceinline__ uint32_t swizzled_offset(int rows, int row, int chunk16) {
  const int half = chunk16 >> 3, c = chunk16 & 7;
  return static_cast<uint32_t>(half * rows * 128 + row * 128 + ((c ^ (row & 7)) << 4));
}

__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return (static_cast<uint64_t>(addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Descriptor of k-step `k` (16 columns) of a K-major [rows, 128] tile at shared address `base`.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t base, int rows, int k) {
  return desc(base + static_cast<uint32_t>((k >> 2) * rows * 128 + (k & 3) * 32), 0, 1024);
}

// Descriptor of k-step `k` (16 rows) of an MN-major [rows, 128] tile (the B of P V) at shared address `base`.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t base, int rows, int k) {
  return desc(base + static_cast<uint32_t>(k * 16 * 128), static_cast<uint32_t>(rows * 128), 1024);
}

// The descriptor of the tile `byte_offset` bytes (a multiple of 16) past the one `d` describes: the start address
// field is bits 0-13 of the address >> 4, and every shared address is below 256 KB, so the sum never carries out of
// it. One add instead of rebuilding the descriptor for every k-step and ring slot.
__device__ __forceinline__ uint64_t desc_add(uint64_t d, uint32_t byte_offset) { return d + (byte_offset >> 4); }

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of these registers across an asynchronous wgmma's issue or wait
// (it does not know the hardware writes them in between).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Per thread of the warpgroup (thread t, warp w = t / 32, lane l): accumulator element 4j + e of an m64nN product
// is row 16 w + l / 4 + 8 (e / 2), column 8 j + 2 (l % 4) + (e % 2).

// The 32 fp32 accumulator registers of an m64n64 product, as the instruction's operand list ("{%0, ..., %31}, ")
// and as the asm's output constraints, shared by the SS and RS m64n64k16 wrappers below.
#define TLT_WGMMA_D32_REGS                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "          \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define TLT_WGMMA_D32_OUTS                                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d[0..31] (+)= A[64 x 16] B[16 x 64], both K-major in shared memory (B stored [64, 16]: rows of K); scale_d = 0
// overwrites d.
template <typename T>
__device__ __forceinline__ void mma_m64n64k16_ss(float (&d)[32], uint64_t da, uint64_t db, int scale_d);

#define TLT_WGMMA_SS_N64(TYPE, PTX_TYPE)                                                                              \
  template <>                                                                                                        \
  __device__ __forceinline__ void mma_m64n64k16_ss<TYPE>(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {    \
    asm volatile(                                                                                                    \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                 \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " "                                      \
        TLT_WGMMA_D32_REGS                                                                                           \
        "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                                              \
        : TLT_WGMMA_D32_OUTS                                                                                         \
        : "l"(da), "l"(db), "r"(scale_d));                                                                           \
  }
TLT_WGMMA_SS_N64(__nv_bfloat16, "bf16")
TLT_WGMMA_SS_N64(__half, "f16")
#undef TLT_WGMMA_SS_N64

// d[0..31] (+)= A[64 x 16] (registers, the a_fragment layout) B[16 x 64] (K-major in shared memory, stored [64, 16]:
// rows of K). The S of the one-warpgroup tree-attention kernel, whose Q stays in registers.
template <typename T>
__device__ __forceinline__ void mma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int scale_d);

#define TLT_WGMMA_RS_N64(TYPE, PTX_TYPE)                                                                              \
  template <>                                                                                                        \
  __device__ __forceinline__ void mma_m64n64k16_rs<TYPE>(float (&d)[32], const uint32_t (&a)[4], uint64_t db,        \
                                                         int scale_d) {                                              \
    asm volatile(                                                                                                    \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                                 \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " "                                      \
        TLT_WGMMA_D32_REGS                                                                                           \
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                                                 \
        : TLT_WGMMA_D32_OUTS                                                                                         \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));                                        \
  }
TLT_WGMMA_RS_N64(__nv_bfloat16, "bf16")
TLT_WGMMA_RS_N64(__half, "f16")
#undef TLT_WGMMA_RS_N64
#undef TLT_WGMMA_D32_REGS
#undef TLT_WGMMA_D32_OUTS

// The 64 fp32 accumulator registers of an m64n128 product, as the instruction's operand list ("{%0, ..., %63}, ")
// and as the asm's output constraints, shared by the SS and RS wrappers below.
#define TLT_WGMMA_D64_REGS                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "          \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "      \
  "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define TLT_WGMMA_D64_OUTS                                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),     \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),     \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),     \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),     \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d[0..63] (+)= A[64 x 16] B[16 x 128], both K-major in shared memory (B stored [128, 16]); scale_d = 0 overwrites
// d. The S of a 128-token tile: half the per-tile barriers and waits of the 64-token one.
template <typename T>
__device__ __forceinline__ void mma_m64n128k16_ss(float (&d)[64], uint64_t da, uint64_t db, int scale_d);

#define TLT_WGMMA_SS_N128(TYPE, PTX_TYPE)                                                                             \
  template <>                                                                                                        \
  __device__ __forceinline__ void mma_m64n128k16_ss<TYPE>(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {   \
    asm volatile(                                                                                                    \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                                 \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "                                     \
        TLT_WGMMA_D64_REGS                                                                                           \
        "%64, %65, p, 1, 1, 0, 0;\n}\n"                                                                            \
        : TLT_WGMMA_D64_OUTS                                                                                         \
        : "l"(da), "l"(db), "r"(scale_d));                                                                           \
  }
TLT_WGMMA_SS_N128(__nv_bfloat16, "bf16")
TLT_WGMMA_SS_N128(__half, "f16")
#undef TLT_WGMMA_SS_N128

// The A fragment of k-step t (columns 16 t .. 16 t + 15) of an m64n64 (N = 32, t < 4) or m64n128 (N = 64, t < 8)
// accumulator s, for an m64nNk16 product with A from registers: the accumulator's layout is the A operand's (row
// l / 4 (+8), columns 2 (l % 4) (+8)). Column groups 2t and 2t + 1 are elements 8t .. 8t + 7 whatever the width,
// since element 4j + e is in column group j for every N.
template <typename T, int N>
__device__ __forceinline__ void a_fragment(const float (&s)[N], int t, uint32_t (&a)[4]) {
  static_assert(N == 32 || N == 64, "an m64n64 or m64n128 accumulator");
  using Pack = tree_attn::TypeTraits<T>;  // two floats -> one register of two 16-bit values (lo = lower column)
  a[0] = Pack::pack(s[8 * t + 0], s[8 * t + 1]);
  a[1] = Pack::pack(s[8 * t + 2], s[8 * t + 3]);
  a[2] = Pack::pack(s[8 * t + 4], s[8 * t + 5]);
  a[3] = Pack::pack(s[8 * t + 6], s[8 * t + 7]);
}

// d[0..63] (+)= A[64 x 16] (registers) B[16 x 128] in shared memory: MN-major (kTransposeB = 1, the default: V as
// the B of P V) or K-major (kTransposeB = 0, stored [128, 16]: K as the B of S = Q K^T with Q in registers).
template <typename T, int kTransposeB = 1>
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int scale_d);

#define TLT_WGMMA_RS_N128(TYPE, PTX_TYPE, TNSP)                                                                       \
  template <>                                                                                                        \
  __device__ __forceinline__ void mma_m64n128k16_rs<TYPE, TNSP>(float (&d)[64], const uint32_t (&a)[4], uint64_t db, \
                                                                int scale_d) {                                       \
    asm volatile(                                                                                                    \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                                 \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "                                     \
        TLT_WGMMA_D64_REGS                                                                                           \
        "{%64, %65, %66, %67}, %68, p, 1, 1, " #TNSP ";\n}\n"                                                         \
        : TLT_WGMMA_D64_OUTS                                                                                         \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));                                        \
  }
TLT_WGMMA_RS_N128(__nv_bfloat16, "bf16", 1)
TLT_WGMMA_RS_N128(__half, "f16", 1)
TLT_WGMMA_RS_N128(__nv_bfloat16, "bf16", 0)
TLT_WGMMA_RS_N128(__half, "f16", 0)
#undef TLT_WGMMA_RS_N128
#undef TLT_WGMMA_D64_REGS
#undef TLT_WGMMA_D64_OUTS

}  // namespace wgmma
}  // namespace tlt
