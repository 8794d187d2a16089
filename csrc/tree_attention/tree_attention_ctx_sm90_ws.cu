// Warp-specialized build of the sm_90 tree-attention kernel (T * G > 64 rows, and wide trees (T = 32, 64) in blocks
// of 128 rows, one CTA each). Same work and outputs as the two-warpgroup kernel in tree_attention_ctx_sm90.cu (see
// its header for the span, the folded tree and the tile order); what differs is who waits for whom:
//
//   warpgroup 2 (producer): gathers K and V tiles through the block table into rings of 3 K and 4 V stages
//     (cp.async), each slot guarded by a `full` and an `empty` mbarrier (sm90_pipeline.cuh). It runs ahead as
//     far as the rings allow, from the first cycle on, while the consumers load Q. V has the extra stage because a
//     V tile is read one step later than its K tile (by P V) and so is held longer.
//   warpgroups 0 and 1 (consumers, 64 rows each): Q in registers (the A operand of S, RS wgmma); wait on `full`,
//     issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}, release each slot on `empty` once the wgmma that read it has
//     completed. No CTA-wide barrier in the loop.
//   ping-pong: two named barriers order the consumers' GEMM issue (warpgroup 0 issues step j, then warpgroup 1
//     issues its step j, then warpgroup 0 its step j + 1, ...), so one warpgroup's softmax runs while the other's
//     GEMMs hold the tensor cores. In the lockstep kernel both issued S_j together after the step's barrier and
//     then both did their softmax, the tensor cores idle meanwhile.
// Why: one warpgroup's softmax no longer waits for the other's GEMMs, so a tile costs closer to its copies where
// memory outruns the math; where the copies are the limit it changes nothing (figures: docs/CUDA_NOTES.md,
// "Measurements behind the csrc rules").
//
// fp8 caches (e4m3, e5m2; WsFp8Config): the producer copies each tile as stored into a staging ring and widens it to
// fp16 into the rings (produce_fp8), so the consumers run the 16-bit loop in fp16, bfloat16 rows scaled into fp16 by
// a power of two each (load_q_fragments_fp16): the same scores, P rounded to fp16 for P V.
//
// Registers: 384 threads at one CTA per SM leave 168 per thread at launch; setmaxnreg gives the producer 56 and each
// consumer thread 224 (128 x 56 + 256 x 224 = 63K of the SM's 64K 32-bit registers; the consumers use 220, one
// 4-byte spill).
// Shared memory: 7 x 32 KB of K/V tiles + 14 mbarriers, plus 1 KB to align the swizzled tiles (224 KB + 1 KB).
// The Q-in-shared-memory build (3 + 3 stages) and a 4 K + 3 V build remain as tools/ws_probe.cu's variants.
#include <cuda.h>  // CUtensorMap (the TMA build; no driver call is linked: the encoder comes through the runtime)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/launch_status.h"
#include "tree_attention/sm90_pipeline.cuh"
#include "tree_attention/tree_attention.cuh"  // tree_attn::cp_async_16, TypeTraits
#include "tree_attention/tree_attention_sm90_tile.cuh"
#include "tree_attention/wgmma_sm90.cuh"

#ifndef TLT_WS_PROBE
// Timing probes (tools/ws_probe.cu; never in the package): 1 streaming only, 2 math only, 3 checkpoints, 4 fp8 tiles
// not widened.
#define TLT_WS_PROBE 0
#endif
#if TLT_WS_PROBE == 3
// 32 slots per CTA in p.partial_lse: clock64 at checkpoint i (0-7, 10-15), %globaltimer at the start (8) and the end
// (9), and the cycles one thread spent per activity (16-22: see tools/ws_probe.cu).
#define TLT_WS_SLOTS() \
  (reinterpret_cast<uint64_t*>(p.partial_lse) + ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * 32)
#define TLT_WS_STAMP(i, cond)                                     \
  do {                                                            \
    if (cond) {                                                   \
      TLT_WS_SLOTS()[i] = clock64();                              \
      if ((i) == 0 || (i) == 6) {                                 \
        uint64_t g_;                                              \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_));   \
        TLT_WS_SLOTS()[(i) == 0 ? 8 : 9] = g_;                    \
      }                                                           \
    }                                                             \
  } while (0)
#define TLT_WS_PROF_DECL() long long prof_[8] = {}
#define TLT_WS_TIC(t) const long long t = clock64()
#define TLT_WS_ACC(k, t) (prof_[k] += clock64() - (t))
#define TLT_WS_PROF_STORE(first, last, cond) \
  if (cond)                                  \
    for (int k_ = first; k_ <= last; ++k_) TLT_WS_SLOTS()[16 + k_] = prof_[k_]
#else
#define TLT_WS_STAMP(i, cond) \
  do {                        \
  } while (0)
#define TLT_WS_PROF_DECL() do {} while (0)
#define TLT_WS_TIC(t) do {} while (0)
#define TLT_WS_ACC(k, t) do {} while (0)
#define TLT_WS_PROF_STORE(first, last, cond) do {} while (0)
#endif

namespace tlt {
namespace tree_sm90 {
namespace {

constexpr int kBlockN = 128, kBlockM = 128;
constexpr int kConsumerThreads = 256, kProducerThreads = 128, kThreads = kConsumerThreads + kProducerThreads;
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536, "the SM's registers");
constexpr int kTileBytes = kBlockN * kD * 2;
constexpr int kScores = kBlockN / 2;

// kQInRegisters: Q stays in registers as the A operand of S (RS wgmma, 32 registers per consumer thread), and its
// 32 KB of shared memory become a fourth K stage: the consumers hold one K and up to two V slots while they
// compute, so the copies in flight are what the ring has left. Otherwise Q is staged in shared memory (SS wgmma)
// and both rings have 3 stages.
// kTma: whole context tiles (every row a context token) come by TMA, one 16-token x 64-column box per page half
// (16 boxes a tile, issued by 16 lanes of the producer's first warp; pages of at least 16 tokens), instead of 16
// cp.async per producer thread; the masked tiles (context tail, tree) keep the cp.async gather, which zero-fills
// the rows past the span.
template <bool kQInRegisters_, int kStagesK_ = 3, int kStagesV_ = 3, bool kTma_ = false>
struct WsConfig {
  static constexpr bool kQInRegisters = kQInRegisters_, kTma = kTma_, kFp8 = false;
  static constexpr int kStagesK = kStagesK_, kStagesV = kStagesV_;
  static constexpr int kQBytes = kQInRegisters ? 0 : kBlockM * kD * 2;
  static constexpr int kBarriersOffset = kQBytes + (kStagesK + kStagesV) * kTileBytes;
  static constexpr int kSmemBytes = kBarriersOffset + 2 * (kStagesK + kStagesV) * 8 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 opt-in shared-memory limit");
};
// fp8 caches (e4m3, e5m2): the tiles come as stored into a staging ring of kStaging K and V tiles (16 KB each) and the
// producer widens them to fp16 into the rings (produce_fp8); the consumers' products are fp16 (bfloat16 rows scaled
// into fp16 by a power of two each, load_q_fragments_fp16), so a tile costs the consumers what a 16-bit one does.
// Why fp16: an fp8 pair becomes an fp16 pair in one conversion instruction; into bfloat16 it takes integer work that
// left the producer behind the consumers (docs/TREE_ATTENTION.md, "fp8 caches").
template <int kStagesK_, int kStagesV_, int kStaging_>
struct WsFp8Config {
  static constexpr bool kQInRegisters = true, kTma = false, kFp8 = true;
  static constexpr int kStagesK = kStagesK_, kStagesV = kStagesV_, kStaging = kStaging_;
  static constexpr int kQBytes = 0;
  static constexpr int kStagedTileBytes = kBlockN * kD;  // one fp8 tile
  static constexpr int kBarriersOffset = (kStagesK + kStagesV) * kTileBytes + 2 * kStaging * kStagedTileBytes;
  static constexpr int kSmemBytes = kBarriersOffset + 2 * (kStagesK + kStagesV) * 8 + 1024;
  static_assert(kStaging >= 2, "the copies of one tile in flight while the one before is widened");
  static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 opt-in shared-memory limit");
};

// The ring slots' mbarriers from `base`: K slot s full_k(s), empty_k(s); V slot s full_v(s), empty_v(s).
template <typename Cfg>
struct RingBarriers {
  uint32_t base;
  __device__ uint32_t full_k(int s) const { return base + 8u * s; }
  __device__ uint32_t empty_k(int s) const { return base + 8u * (Cfg::kStagesK + s); }
  __device__ uint32_t full_v(int s) const { return base + 8u * (2 * Cfg::kStagesK + s); }
  __device__ uint32_t empty_v(int s) const { return base + 8u * (2 * Cfg::kStagesK + Cfg::kStagesV + s); }
};
constexpr int kConsumerWarps = kConsumerThreads / 32;
// Named barriers (0 is __syncthreads): Q staged by both consumers; warpgroup w's turn to issue its GEMMs.
// kBarEpilogue: the producer's flags (bad pages, NaN/inf tree V) handed to the consumers before they write.
constexpr int kBarQStaged = 1, kBarTurn0 = 2, kBarProducer = 4, kBarEpilogue = 5;

// Tile i's rows of K (or V) into ring slot `slot`, 16 copies of 16 bytes per producer thread: thread pt copies
// column chunk pt % 16 of rows pt / 16 + 8 it (it < 16), so a warp's copy covers two whole 256-byte rows. Lane L
// of warp w looked up the cache token of row 2w + (L & 1) + 8 (L >> 1); copy `it` takes it from lane
// 2 it + (lane >> 4). A row past the span (token -1) is zero-filled, read from nowhere.
__device__ __forceinline__ void copy_tile(int32_t token, const char* base, uint32_t stride_bytes, uint32_t slot,
                                          int warp, int lane) {
  const int chunk = lane % 16;
#pragma unroll
  for (int it = 0; it < 16; ++it) {
    const int32_t tok = __shfl_sync(0xffffffffu, token, 2 * it + (lane >> 4));
    const int row = 2 * warp + (lane >> 4) + 8 * it;
    const char* src = base + static_cast<uint64_t>(static_cast<uint32_t>(max(tok, 0))) * stride_bytes;
    tree_attn::cp_async_16(slot + wgmma::swizzled_offset(kBlockN, row, chunk), src, tok >= 0 ? 16 : 0);
  }
}

// copy_tile for a V tile i holding tree slots: their rows are checked on the way (copy_row_chunk; a NaN/inf is
// zeroed and its node set in `bad_nodes`). Plain stores among the copies: the caller waits for its copies, fences
// the proxy (wgmma reads the slot) and arrives with release semantics.
template <typename T>
__device__ __forceinline__ void copy_tree_v_tile(int32_t token, const char* base, uint32_t stride_bytes, uint32_t slot,
                                                 int warp, int lane, const Span& sp, int i,
                                                 unsigned long long* bad_nodes) {
  const int chunk = lane % 16;
#pragma unroll 1
  for (int it = 0; it < 16; ++it) {
    const int32_t tok = __shfl_sync(0xffffffffu, token, 2 * it + (lane >> 4));
    const int row = 2 * warp + (lane >> 4) + 8 * it;
    const char* src = base + static_cast<uint64_t>(static_cast<uint32_t>(max(tok, 0))) * stride_bytes;
    copy_row_chunk<T, kBlockN>(slot + wgmma::swizzled_offset(kBlockN, row, chunk), src, tok, sp, i, row, true,
                               bad_nodes);
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  wgmma::fence_proxy_async();
}

// fp8 caches: this thread's 8 staged chunks of a tile (16 values each: rows row0 + 16 it, column chunk `chunk`, at
// `staged` + it * 16 rows) widened to fp16 into the swizzled ring slot `slot` (a row's chunk c becomes its 16-bit
// chunks 2c and 2c + 1). kTreeV: V tile i has tree slots, whose rows go through zero_bad_tree_v (a NaN/inf zeroed and
// its node flagged in `bad_nodes`: the NaN contract); a template argument so that K and context V tiles, nearly all
// tiles, carry no node or finiteness work. Chunk it + 1's shared load is issued before chunk it is widened (its
// latency overlaps that work; the ordered accesses would otherwise wait for one load per chunk).
template <typename KV, bool kTreeV>
__device__ __forceinline__ void widen_staged(uint32_t staged, uint32_t slot, int row0, int chunk, const Span& sp, int i,
                                             unsigned long long* bad_nodes) {
  uint4 next = load_staged_chunk(staged);
#pragma unroll 2
  for (int it = 0; it < 8; ++it) {
    const int row = row0 + 16 * it;
    const uint4 raw = next;
    if (it + 1 < 8) next = load_staged_chunk(staged + (it + 1) * 16 * kD);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      // Chunks 4-7 store their second half first: an 8-lane phase then fills the two 64-column panels' rows at
      // different 16-byte positions (the swizzle keeps each panel's in place), no two lanes on one bank.
      const int half = k ^ (chunk >> 2);
      bool finite;
      uint4 v = tree_attn::widen_fp8x8<__half, KV>(half ? make_uint2(raw.z, raw.w) : make_uint2(raw.x, raw.y), finite);
      if constexpr (kTreeV) {
        const int node = tree_node_of_row<kBlockN>(sp, i, row, true);
        if (node >= 0) tree_attn::zero_bad_tree_v(v, finite, node, bad_nodes);
      }
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + wgmma::swizzled_offset(kBlockN, row,
                                                                                                   2 * chunk + half)),
                   "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                   : "memory");
    }
  }
}

// The producer's loop over fp8 caches (KV). Thread 32 warp + lane copies 16-byte chunk lane % 8 (16 values) of rows
// 4 warp + lane / 8 + 16 it (it < 8) of tile i's K and V, as stored, into staging slot i % kStaging (cp.async; rows
// past the span zero-filled), kStaging - 1 tiles ahead of the tile it widens; once its copies of tile i have landed,
// it widens them into the ring slots (widen_staged) and arrives on their `full` barriers. A thread widens and
// refills only the staging chunks it copied, so the staging ring needs no barrier. Lane L looks up the cache token of
// row 16 (L / 4) + 4 warp + L % 4 (its page a tile ahead); copy `it` takes it from lane 4 it + L / 8.
template <typename KV, typename Cfg>
__device__ __forceinline__ void produce_fp8(const TreeAttentionParams& p, const Span& sp, int h, int warp, int lane,
                                            uint32_t k_s, uint32_t v_s, uint32_t staged_s,
                                            const RingBarriers<Cfg>& bar, unsigned long long* bad_nodes,
                                            bool& saw_bad_page) {
  constexpr int kAhead = Cfg::kStaging - 1, kStaged = Cfg::kStagedTileBytes;
  const int n = sp.n_tiles, chunk = lane % 8, row0 = 4 * warp + lane / 8;
  const int my_row = 16 * (lane / 4) + 4 * warp + lane % 4;
  const char* const k_base = static_cast<const char*>(p.k_cache) + h * p.k_stride_head + 16 * chunk;
  const char* const v_base = static_cast<const char*>(p.v_cache) + h * p.v_stride_head + 16 * chunk;
  const uint32_t mine = row0 * kD + 16 * chunk;  // this thread's first chunk in a staged tile
  auto staged_k = [&](int i) { return staged_s + 2 * (i % Cfg::kStaging) * kStaged + mine; };  // V: + kStaged
  int32_t page = row_page<kBlockN>(p, sp, 0, my_row);  // the page of this lane's row of the next tile issued
  auto issue = [&](int i) {  // tile i's K and V: one commit group (empty past the last tile)
    if (i < n) {
      saw_bad_page = saw_bad_page || page == tree_attn::kBadPage;
      const int32_t token = row_token<kBlockN>(p, sp, i, my_row, page);
      page = row_page<kBlockN>(p, sp, i + 1, my_row);  // in flight until the next issue
#pragma unroll
      for (int it = 0; it < 8; ++it) {
        const int32_t tok = __shfl_sync(0xffffffffu, token, 4 * it + lane / 8);
        const uint64_t row = static_cast<uint32_t>(max(tok, 0));
        const uint32_t dst = staged_k(i) + it * 16 * kD;
        tree_attn::cp_async_16(dst, k_base + row * p.k_stride_token, tok >= 0 ? 16 : 0);
        tree_attn::cp_async_16(dst + kStaged, v_base + row * p.v_stride_token, tok >= 0 ? 16 : 0);
      }
    }
    tree_attn::cp_async_commit();
  };
  for (int i = 0; i < kAhead; ++i) issue(i);
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    issue(i + kAhead);
    tree_attn::cp_async_wait<kAhead>();  // this thread's copies of tile i have landed
    const int sk = i % Cfg::kStagesK, sv = i % Cfg::kStagesV;
    // Slot i % stages; its previous tile (i - stages) freed = completion i / stages - 1 of its empty barrier.
    if (i >= Cfg::kStagesK) sm90::mbarrier_wait(bar.empty_k(sk), static_cast<uint32_t>(i / Cfg::kStagesK - 1) & 1u);
#if TLT_WS_PROBE != 4  // tools/ws_probe.cu: 4 = fp8 tiles copied, not widened (the slots keep what they held)
    widen_staged<KV, false>(staged_k(i), k_s + sk * kTileBytes, row0, chunk, sp, i, bad_nodes);
#endif
    // A release arrival and no proxy fence here: the consumers fence after their wait (as for the cp.async
    // producer's copies), and a fence here would wait for the next tile's copies in flight.
    sm90::mbarrier_arrive(bar.full_k(sk));
    if (i >= Cfg::kStagesV) sm90::mbarrier_wait(bar.empty_v(sv), static_cast<uint32_t>(i / Cfg::kStagesV - 1) & 1u);
#if TLT_WS_PROBE != 4
    if (tile_has_tree<kBlockN>(sp, i))
      widen_staged<KV, true>(staged_k(i) + kStaged, v_s + sv * kTileBytes, row0, chunk, sp, i, bad_nodes);
    else
      widen_staged<KV, false>(staged_k(i) + kStaged, v_s + sv * kTileBytes, row0, chunk, sp, i, bad_nodes);
#endif
    sm90::mbarrier_arrive(bar.full_v(sv));
  }
}

// The producer's loop over 16-bit caches (T): tile i's K and V into ring slots i % stages, 16 cp.async per thread
// (copy_tile; a V tile with tree slots checked on the way, copy_tree_v_tile), or in the TMA build whole context tiles
// by TMA (16 boxes a tile). Lane L looks up the cache token of row 2 warp + (L & 1) + 8 (L >> 1), its page a tile
// ahead; every row's page passes through `page` (the TMA boxes' too), which sets `saw_bad_page`.
template <typename T, typename Cfg>
__device__ __forceinline__ void produce_16bit(const TreeAttentionParams& p, const Span& sp, int h, int warp, int lane,
                                              uint32_t k_s, uint32_t v_s, const RingBarriers<Cfg>& bar,
                                              const CUtensorMap& tmap_k, const CUtensorMap& tmap_v,
                                              unsigned long long* bad_nodes, bool& saw_bad_page) {
  constexpr int kStagesK = Cfg::kStagesK, kStagesV = Cfg::kStagesV;
  const int n = sp.n_tiles, pt = threadIdx.x - kConsumerThreads;  // pt: 32 warp + lane
  const char* const k_base =
      reinterpret_cast<const char*>(static_cast<const T*>(p.k_cache) + h * p.k_stride_head + (pt % 16) * 8);
  const char* const v_base =
      reinterpret_cast<const char*>(static_cast<const T*>(p.v_cache) + h * p.v_stride_head + (pt % 16) * 8);
  const uint32_t k_stride = static_cast<uint32_t>(p.k_stride_token * sizeof(T));
  const uint32_t v_stride = static_cast<uint32_t>(p.v_stride_token * sizeof(T));
  const int my_row = 2 * warp + (lane & 1) + 8 * (lane >> 1);  // the row whose token this lane looks up
  int32_t page = row_page<kBlockN>(p, sp, 0, my_row);
  // TMA build: the page of this lane's box of the next tile (lanes 0-15 of warp 0), looked up a tile ahead.
  int32_t box_page = Cfg::kTma && warp == 0 && lane < 16 ? row_page<kBlockN>(p, sp, 0, 16 * (lane >> 1)) : -1;
  saw_bad_page = saw_bad_page || page == tree_attn::kBadPage;
  TLT_WS_PROF_DECL();
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const int32_t token = row_token<kBlockN>(p, sp, i, my_row, page);
    page = row_page<kBlockN>(p, sp, i + 1, my_row);  // the next tile's page, in flight while this one is copied
    saw_bad_page = saw_bad_page || page == tree_attn::kBadPage;
    const bool tree_v = tile_has_tree<kBlockN>(sp, i);
    // Slot i % stages; its previous tile (i - stages) freed = completion i / stages - 1 of its empty barrier.
    const int sk = i % kStagesK, sv = i % kStagesV;
    TLT_WS_TIC(t_empty_k);
    if (i >= kStagesK) sm90::mbarrier_wait(bar.empty_k(sk), static_cast<uint32_t>(i / kStagesK - 1) & 1u);
    TLT_WS_ACC(5, t_empty_k);
#if TLT_WS_PROBE == 2  // tools/ws_probe.cu: math only, the slots marked full without a copy
    sm90::mbarrier_arrive(bar.full_k(sk));
    if (i >= kStagesV) sm90::mbarrier_wait(bar.empty_v(sv), static_cast<uint32_t>(i / kStagesV - 1) & 1u);
    sm90::mbarrier_arrive(bar.full_v(sv));
#else
    TLT_WS_TIC(t_copy_k);
    if constexpr (Cfg::kTma) {
      const int32_t pg = box_page;  // this lane's box: page half (lane & 1) of rows 16 (lane >> 1) .. + 15
      box_page = warp == 0 && lane < 16 ? row_page<kBlockN>(p, sp, i + 1, 16 * (lane >> 1)) : -1;
      const bool whole = i < sp.n_full;
      const int pos = sp.begin + i * kBlockN + 16 * (lane >> 1);
      const int tok0 = (pg << p.block_shift) + (pos & ((1 << p.block_shift) - 1));
      const uint32_t box_off = (lane & 1) * kBlockN * 128 + (lane >> 1) * 16 * 128;
      // A whole tile: 16 boxes on the slot's barrier (lane 0 announces the bytes first). Else the gather, then
      // one arrival once every producer thread's copies have landed.
      auto fill = [&](const CUtensorMap& tmap, const char* base, uint32_t stride, uint32_t slot, uint32_t full,
                      bool is_v) {
        if (whole) {
          if (warp == 0) {
            if (lane == 0) sm90::mbarrier_arrive_expect_tx(full, kTileBytes);
            __syncwarp();
            if (lane < 16) sm90::tma_load_3d(slot + box_off, &tmap, 64 * (lane & 1), h, tok0, full);
          }
        } else {
          if (is_v && tree_v) {
            copy_tree_v_tile<T>(token, base, stride, slot, warp, lane, sp, i, bad_nodes);
          } else {
            copy_tile(token, base, stride, slot, warp, lane);
            asm volatile("cp.async.wait_all;\n" ::: "memory");
          }
          sm90::named_sync(kBarProducer, kProducerThreads);
          if (pt == 0) sm90::mbarrier_arrive(full);
        }
      };
      fill(tmap_k, k_base, k_stride, k_s + sk * kTileBytes, bar.full_k(sk), false);
      TLT_WS_ACC(6, t_copy_k);
      TLT_WS_STAMP(2, i == 0 && threadIdx.x == kConsumerThreads);
      TLT_WS_TIC(t_empty_v);
      if (i >= kStagesV) sm90::mbarrier_wait(bar.empty_v(sv), static_cast<uint32_t>(i / kStagesV - 1) & 1u);
      TLT_WS_ACC(5, t_empty_v);
      TLT_WS_TIC(t_copy_v);
      fill(tmap_v, v_base, v_stride, v_s + sv * kTileBytes, bar.full_v(sv), true);
      TLT_WS_ACC(6, t_copy_v);
    } else {
      copy_tile(token, k_base, k_stride, k_s + sk * kTileBytes, warp, lane);
      TLT_WS_ACC(6, t_copy_k);
      TLT_WS_STAMP(2, i == 0 && threadIdx.x == kConsumerThreads);
      sm90::cp_async_arrive_noinc(bar.full_k(sk));
      TLT_WS_TIC(t_empty_v);
      if (i >= kStagesV) sm90::mbarrier_wait(bar.empty_v(sv), static_cast<uint32_t>(i / kStagesV - 1) & 1u);
      TLT_WS_ACC(5, t_empty_v);
      TLT_WS_TIC(t_copy_v);
      if (tree_v) {  // plain stores among the copies: wait for them all, then a release arrival
        copy_tree_v_tile<T>(token, v_base, v_stride, v_s + sv * kTileBytes, warp, lane, sp, i, bad_nodes);
        sm90::mbarrier_arrive(bar.full_v(sv));
      } else {
        copy_tile(token, v_base, v_stride, v_s + sv * kTileBytes, warp, lane);
        sm90::cp_async_arrive_noinc(bar.full_v(sv));
      }
      TLT_WS_ACC(6, t_copy_v);
    }
#endif
  }
  TLT_WS_STAMP(7, threadIdx.x == kConsumerThreads);
  TLT_WS_PROF_STORE(5, 6, threadIdx.x == kConsumerThreads);
}

// KV: the caches' storage, T or an fp8 type (Cfg a WsFp8Config).
template <typename T, typename KV, typename Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    tree_attention_sm90_ws_kernel(const TreeAttentionParams p, const __grid_constant__ CUtensorMap tmap_k,
                                  const __grid_constant__ CUtensorMap tmap_v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kStagesK = Cfg::kStagesK, kStagesV = Cfg::kStagesV;
  static_assert(Cfg::kFp8 == tree_attn::kIsFp8<KV> && (Cfg::kFp8 || std::is_same<KV, T>::value), "KV and Cfg agree");
  using MT = std::conditional_t<Cfg::kFp8, __half, T>;  // the products' operands (fp16 over fp8 caches)
  extern __shared__ __align__(16) unsigned char smem[];
  // blockIdx.x = split << row_block_shift | rb: a CTA owns rows 128 rb .. 128 rb + 127 of T * G (one block up to
  // T * G = 128; wide trees take several). The row blocks of one split are adjacent in launch order, so they stream
  // the same K/V tiles at about the same time and all but the first read hit L2. Shifts, not a division: a division
  // here cost the producer a register, and a spill in its loop. Blocks past T * G (the count rounded up to a power
  // of two) have nothing to do.
  const int rb = blockIdx.x & ((1u << p.row_block_shift) - 1u);
  const int split = blockIdx.x >> p.row_block_shift, h = blockIdx.y, b = blockIdx.z;
  const int G = p.group, TG = p.num_tree * G;
  if (kBlockM * rb >= TG) return;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  TLT_WS_STAMP(0, threadIdx.x == 0);

  Span sp;
  bool direct = false;  // this CTA completes its rows: write out, skip the scratch and the merge
  if (!split_span<kBlockN>(p, b, split, sp, direct)) return;
  // n >= 1 whenever the plan's contract holds (a request has at least one node). n == 0 (num_nodes 0 on an empty
  // context, e.g. a graph replayed with a padding row nobody validated) must not hang: step 0 would wait for V_0,
  // which no one copies. Such a CTA runs no step and writes zeros.
  const int n = sp.n_tiles;
  // A row block of at most 64 rows of T * G (the last block of a wide tree, e.g. rows 384..447 of 448) has work for
  // warpgroup 0 only: warpgroup 1 leaves at once, and warpgroup 0 runs alone, without the ping-pong, its slots
  // released by its 4 warps. (The Q-in-shared-memory build stages Q with both warpgroups: it keeps them.)
  const bool one_consumer = Cfg::kQInRegisters && TG - kBlockM * rb <= 64;
  const int consumer_warps = one_consumer ? kConsumerWarps / 2 : kConsumerWarps;

  const uint32_t q_s = (wgmma::smem_addr(smem) + 1023u) & ~1023u;
  unsigned char* const smem_q = smem + (q_s - wgmma::smem_addr(smem));
  const uint32_t k_s = q_s + Cfg::kQBytes, v_s = k_s + kStagesK * kTileBytes, staged_s = v_s + kStagesV * kTileBytes;
  const RingBarriers<Cfg> bar{q_s + Cfg::kBarriersOffset};
  // Set by the producer, read by the consumers after kBarEpilogue: tree nodes whose V (this KV head) holds a NaN/inf
  // (tree_attn::copy_tree_v_chunk), and whether a page id was out of the cache (row_page). Both make NaN rows.
  __shared__ unsigned long long bad_nodes;
  __shared__ int page_bad;
  if (threadIdx.x == 0) {
    bad_nodes = 0ull;
    page_bad = 0;
    for (int s = 0; s < kStagesK; ++s) {
      // One cp.async arrival per producer thread; the TMA build: one arrival (with the bytes, or after a cp.async fill).
      sm90::mbarrier_init(bar.full_k(s), Cfg::kTma ? 1 : kProducerThreads);
      sm90::mbarrier_init(bar.empty_k(s), consumer_warps);   // one arrival per working consumer warp
    }
    for (int s = 0; s < kStagesV; ++s) {
      sm90::mbarrier_init(bar.full_v(s), Cfg::kTma ? 1 : kProducerThreads);
      sm90::mbarrier_init(bar.empty_v(s), consumer_warps);
    }
  }
  __syncthreads();  // the barriers exist; the last CTA-wide barrier
  TLT_WS_STAMP(1, threadIdx.x == 0);

  if (wg == 2) {  // ---- producer ----
    sm90::regs_dec<kProducerRegs>();
    bool saw_bad_page = false;
    if constexpr (Cfg::kFp8)
      produce_fp8<KV, Cfg>(p, sp, h, warp, lane, k_s, v_s, staged_s, bar, &bad_nodes, saw_bad_page);
    else
      produce_16bit<T, Cfg>(p, sp, h, warp, lane, k_s, v_s, bar, tmap_k, tmap_v, &bad_nodes, saw_bad_page);
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives the thread that issued it
    if (saw_bad_page) page_bad = 1;
    sm90::named_arrive(kBarEpilogue, kProducerThreads + 32 * consumer_warps);  // the flags are final
    return;
  }

  // ---- consumers: warpgroup wg owns rows 64 wg .. 64 wg + 63 of the row block ----
  if (one_consumer && wg == 1) return;  // no row of this block is warpgroup 1's
  sm90::regs_inc<kConsumerRegs>();
  const int row0 = kBlockM * rb;                                // the block's first row of T * G
  const int row_base = row0 + 64 * wg + 16 * warp + lane / 4;  // this thread's rows: row_base and row_base + 8
  const T* Q = static_cast<const T*>(p.q) + b * p.q_stride_b;
  auto q_row = [&](int m) { const int t = m / G; return Q + t * p.q_stride_t + (h * G + m - t * G) * p.q_stride_h; };
  // Q in registers: the A fragments of S's k-steps (rows row_base (+8), columns 16 k + 2 (lane % 4) (+8), see
  // wgmma::a_fragment); rows >= T * G zero.
  uint32_t q_frag[Cfg::kQInRegisters ? kD / 16 : 1][4];
  float inv_q_scale[2] = {1.f, 1.f};  // fp8 caches under bfloat16 rows: the rows' powers of two, undone in the softmax
  if constexpr (Cfg::kFp8 && std::is_same<T, __nv_bfloat16>::value) {
    load_q_fragments_fp16(q_row, row_base, TG, lane, q_frag, inv_q_scale);
  } else if constexpr (Cfg::kQInRegisters) {
    load_q_fragments<T>(q_row, row_base, TG, lane, q_frag);
  } else {
    constexpr int kQChunks = kBlockM * (kD / 8) / kConsumerThreads;
#pragma unroll
    for (int it = 0; it < kQChunks; ++it) {
      const int i = threadIdx.x + it * kConsumerThreads;
      const int m = i / (kD / 8), col16 = i % (kD / 8);
      uint4 v = make_uint4(0, 0, 0, 0);  // rows >= T * G are zero
      if (row0 + m < TG) v = *reinterpret_cast<const uint4*>(q_row(row0 + m) + col16 * 8);
      *reinterpret_cast<uint4*>(smem_q + wgmma::swizzled_offset(kBlockM, m, col16)) = v;
    }
    wgmma::fence_proxy_async();
    sm90::named_sync(kBarQStaged, kConsumerThreads);
  }
  const int my_turn = kBarTurn0 + wg, other_turn = kBarTurn0 + 1 - wg;
  if (wg == 1 && n > 0) sm90::named_arrive(other_turn, kConsumerThreads);  // warpgroup 0 goes first (wg 1 works)

  const uint64_t dq0 = wgmma::desc_k_major(q_s + wg * 64 * 128, kBlockM, 0);  // this warpgroup's 64 rows of Q
  const uint64_t dk0 = wgmma::desc_k_major(k_s, kBlockN, 0);
  const uint64_t dv0 = wgmma::desc_mn_major(v_s, kBlockN, 0);

  const float qk_scale[2] = {p.sm_scale * 1.4426950408889634f * inv_q_scale[0],
                             p.sm_scale * 1.4426950408889634f * inv_q_scale[1]};
  float m_i[2], l_i[2], s[kScores], o[64];
  init_rows(m_i, l_i, s, o);

  // Step j = 0 .. n as in the two-warpgroup kernel: S_j (at j = n, of whatever K slot n holds: discarded),
  // then P_{j-1} V_{j-1} (at j = 0 a zero P times V_0, which must have landed: 0 * NaN of unwritten memory is NaN).
  float alpha[2] = {0.f, 0.f};
  TLT_WS_STAMP(3, threadIdx.x == 0);
  TLT_WS_PROF_DECL();
  for (int j = 0; n > 0 && j <= n; ++j) {
    TLT_WS_TIC(t_full);
    if (j < n) sm90::mbarrier_wait(bar.full_k(j % kStagesK), static_cast<uint32_t>(j / kStagesK) & 1u);
    TLT_WS_STAMP(4, j == 0 && threadIdx.x == 0);
    const int jv = max(j - 1, 0);
    sm90::mbarrier_wait(bar.full_v(jv % kStagesV), static_cast<uint32_t>(jv / kStagesV) & 1u);
    TLT_WS_ACC(0, t_full);
    wgmma::fence_proxy_async();  // the producer's cp.async writes, seen through the barrier, made visible to wgmma
#if TLT_WS_PROBE == 1  // tools/ws_probe.cu: streaming only, each slot released as soon as it is full
    if (j < n && lane == 0) sm90::mbarrier_arrive(bar.empty_k(j % kStagesK));
    if (j > 0 && lane == 0) sm90::mbarrier_arrive(bar.empty_v(jv % kStagesV));
    if (j == n) break;
    continue;
#endif
    uint32_t frag[kBlockN / 16][4];
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) wgmma::a_fragment<MT>(s, t, frag[t]);
    wgmma::fence_regs(s);
    wgmma::fence_regs(o);
    TLT_WS_TIC(t_turn);
    if (!one_consumer) sm90::named_sync(my_turn, kConsumerThreads);
    TLT_WS_ACC(1, t_turn);
    TLT_WS_STAMP(10, j == 0 && threadIdx.x == 0);
    TLT_WS_STAMP(14, j == 1 && threadIdx.x == 0);
    wgmma::fence();
    {
      const uint64_t dk = wgmma::desc_add(dk0, (j % kStagesK) * kTileBytes);
#pragma unroll
      for (int k = 0; k < kD / 16; ++k) {
        if constexpr (Cfg::kQInRegisters)
          wgmma::mma_m64n128k16_rs<MT, 0>(s, q_frag[k], wgmma::desc_add(dk, k_step(kBlockN, k)), k > 0);
        else
          mma_s<T>(s, wgmma::desc_add(dq0, k_step(kBlockM, k)), wgmma::desc_add(dk, k_step(kBlockN, k)), k > 0);
      }
      wgmma::commit();
    }
    const uint64_t dv = wgmma::desc_add(dv0, (jv % kStagesV) * kTileBytes);
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t)
      wgmma::mma_m64n128k16_rs<MT>(o, frag[t], wgmma::desc_add(dv, t * 16 * 128), 1);
    wgmma::commit();
    // The other warpgroup's turn; warpgroup 0 issues once more than warpgroup 1 waits for (the initial arrival),
    // so warpgroup 1 skips its last.
    if (!one_consumer && (wg == 0 || j < n)) sm90::named_arrive(other_turn, kConsumerThreads);
    TLT_WS_TIC(t_s);
    wgmma::wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
    TLT_WS_ACC(2, t_s);
    TLT_WS_STAMP(11, j == 0 && threadIdx.x == 0);
    wgmma::fence_regs(s);
    TLT_WS_TIC(t_softmax);
    if (j < n) {
      if (lane == 0) sm90::mbarrier_arrive(bar.empty_k(j % kStagesK));  // K_j read
      if (j >= sp.n_full) mask_tile(p, sp, b, row_base, G, j, s);
      online_softmax(s, qk_scale, m_i, l_i, alpha);
      TLT_WS_STAMP(12, j == 0 && threadIdx.x == 0);
    }
    TLT_WS_ACC(3, t_softmax);
    TLT_WS_TIC(t_pv);
    wgmma::wait<0>();
    TLT_WS_ACC(4, t_pv);
    TLT_WS_STAMP(13, j == 0 && threadIdx.x == 0);
    TLT_WS_STAMP(15, j == 1 && threadIdx.x == 0);
    wgmma::fence_regs(o);
    if (j > 0 && lane == 0) sm90::mbarrier_arrive(bar.empty_v(jv % kStagesV));  // V_{j-1} read
    if (j == n) break;
    rescale_o(o, alpha);
  }

  TLT_WS_STAMP(5, threadIdx.x == 0);
  TLT_WS_PROF_STORE(0, 4, threadIdx.x == 0);
  sm90::named_sync(kBarEpilogue, kProducerThreads + 32 * consumer_warps);  // the producer's flags
  store_rows<T>(p, sp, b, h, split, direct, row_base, o, m_i, l_i, page_bad != 0, bad_nodes);
  TLT_WS_STAMP(6, threadIdx.x == 0);
#endif
}

// The TMA build's tensor map of one cache (K or V): dims (head dim, KV heads, token rows), innermost first, strides
// in bytes; boxes of 64 columns x 1 head x 16 token rows, 128-byte swizzle (the layout the wgmma descriptors
// describe, csrc/tree_attention/wgmma_sm90.cuh). The encoder is the driver's, reached through the runtime (no libcuda link).
// The driver's encoder, looked up once (a function-local static: thread-safe initialization, as engines launch from
// several threads); nullptr when the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() noexcept {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    void* fn = nullptr;
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
                                                                    : nullptr;
  }();
  return encoder;
}

inline LaunchStatus encode_cache_map(CUtensorMap& map, const void* cache, int64_t stride_head, int64_t stride_token,
                                     const TreeAttentionParams& p) noexcept {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  TLT_STATUS_CHECK_ARG(encode != nullptr, "the CUDA driver has no cuTensorMapEncodeTiled (the TMA build needs a CUDA 12+ "
                                          "driver; TLT_TREE_ATTENTION_CUDA_TMA=0 turns it off)");
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(p.num_kv_heads),
                              static_cast<cuuint64_t>(p.cache_tokens)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(stride_head) * 2, static_cast<cuuint64_t>(stride_token) * 2};
  const cuuint32_t box[3] = {64, 1, 16}, elem[3] = {1, 1, 1};
  const CUresult r = encode(&map, p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            3, const_cast<void*>(cache), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TLT_STATUS_CHECK_ARG(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with CUresult " << static_cast<int>(r));
  return {};
}

template <typename T, typename KV, typename Cfg>
LaunchStatus launch_ws(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream) noexcept {
  CUtensorMap tmap_k{}, tmap_v{};  // unused unless Cfg::kTma
  if constexpr (Cfg::kTma) {
    TLT_RETURN_IF_FAILED(encode_cache_map(tmap_k, p.k_cache, p.k_stride_head, p.k_stride_token, p));
    TLT_RETURN_IF_FAILED(encode_cache_map(tmap_v, p.v_cache, p.v_stride_head, p.v_stride_token, p));
  }
  return launch_with_smem(tree_attention_sm90_ws_kernel<T, KV, Cfg>, grid, kThreads, Cfg::kSmemBytes, stream, p, tmap_k,
                          tmap_v);
}

// The build for q's dtype (T); KV the caches' storage: void for T itself (16-bit caches), else an fp8 type.
template <typename Cfg, typename KV = void>
LaunchStatus launch_ws_dtype(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream) noexcept {
  using KvOfBf16 = std::conditional_t<std::is_void<KV>::value, __nv_bfloat16, KV>;
  using KvOfHalf = std::conditional_t<std::is_void<KV>::value, __half, KV>;
  return p.dtype == DType::kBFloat16 ? launch_ws<__nv_bfloat16, KvOfBf16, Cfg>(p, grid, stream)
                                     : launch_ws<__half, KvOfHalf, Cfg>(p, grid, stream);
}
// The fp8 build for the caches' format (p.kv_fp8: e4m3 or e5m2).
template <typename Cfg>
LaunchStatus launch_ws_fp8(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream) noexcept {
  return p.kv_fp8 == Fp8Format::kE4M3 ? launch_ws_dtype<Cfg, __nv_fp8_e4m3>(p, grid, stream)
                                      : launch_ws_dtype<Cfg, __nv_fp8_e5m2>(p, grid, stream);
}

}  // namespace

LaunchStatus launch_sm90_warp_specialized(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream,
                                          int variant) noexcept {
  // fp8: 2 K and 3 V fp16 stages (160 KB) and 2 staged K and V fp8 tiles (64 KB); the TMA variant does not apply.
  if (p.kv_fp8 != Fp8Format::kNone) return launch_ws_fp8<WsFp8Config<2, 3, 2>>(p, grid, stream);
  switch (variant) {
    case 1: return launch_ws_dtype<WsConfig<true, 4, 3>>(p, grid, stream);
    case 2: return launch_ws_dtype<WsConfig<false, 3, 3>>(p, grid, stream);
    case 4: return launch_ws_dtype<WsConfig<true, 3, 4, true>>(p, grid, stream);  // TMA: pages >= 16, cache_tokens
#if TLT_WS_PROBE
    case 3: return launch_ws_dtype<WsConfig<true, 2, 2>>(p, grid, stream);  // probe only: fewer copies in flight
#endif
    default: return launch_ws_dtype<WsConfig<true, 3, 4>>(p, grid, stream);
  }
}

}  // namespace tree_sm90
}  // namespace tlt
