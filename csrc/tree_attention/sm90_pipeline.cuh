// sm_90 producer/consumer building blocks (torch-free): shared-memory mbarriers that cp.async copies complete,
// named barriers between warpgroups, and the warpgroup register reallocation. The warp-specialized tree-attention
// kernel (csrc/tree_attention/tree_attention_ctx_sm90_ws.cu) is built from these.
//
// A ring slot's life: the producer waits on `empty[s]` (the consumers are done with its last tile), issues its
// 16-byte cp.async copies, then `cp_async_arrive_noinc(full[s])`: that arrival happens once all of the thread's
// earlier cp.async copies have landed, and .noinc means it is one of the arrivals `full[s]` was initialized to
// expect (one per producer thread). A consumer waits on `full[s]`, fences the proxy (the wgmma that reads the slot
// is in the async proxy), and arrives on `empty[s]` once the wgmma that read it has completed.
#pragma once

#include <cstdint>

namespace tlt {
namespace sm90 {

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t expected_arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(expected_arrivals) : "memory");
}

// Blocks until the phase with this parity has completed (phases alternate 0, 1, 0, ...: waiting for completion
// number c, counted from 0, is parity c & 1). try_wait suspends the thread for a while instead of spinning.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}

// One of the expected arrivals on `bar`, made when every cp.async this thread issued before it has landed.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// One arrival on `bar` that also announces `bytes` more bytes of asynchronous transactions (TMA copies) the phase
// must see complete before it can.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

// TMA: the box of a 3-D tensor map at coordinates (c0, c1, c2) (innermost first) into shared memory at `dst`; its
// bytes complete a transaction on `bar`. `tensor_map` is the generic address of a __grid_constant__ CUtensorMap.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tensor_map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads, some of which sync (wait) and the rest only
// arrive: the ping-pong between two warpgroups.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The warpgroup's registers per thread, moved to (inc) or from (dec) the SM's pool; every thread of the warpgroup
// executes it. N is a multiple of 8 in [24, 256].
template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace sm90
}  // namespace tlt
