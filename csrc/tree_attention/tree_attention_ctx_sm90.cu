// Tree attention on sm_90 wgmma: the CUDA backend's path for plans with T*G <= 128 rows (and any T*G with
// the warp-specialized build, csrc/tree_attention/tree_attention_ctx_sm90_ws.cu)
// (see tlt_kernels/_cuda/tree_attention.py, TLT_TREE_ATTENTION_CUDA_CTX); the CUDA twin of the Gluon context kernel
// (tlt_kernels/_triton/tree_attention_gluon.py), extended to the whole op.
//
// One CTA = two warpgroups = 128 query rows (row m = t * G + g: node t, query head h * G + g; rows >= T * G are
// zero) of one (split, KV head, request), or one warpgroup = one 64-row chunk of them (see the instantiations below).
// Like the mma.sync partial kernel (tree_attention.cuh), the tree is folded into the request's last non-empty split:
// that split's tiles run past its whole context tiles over the context's tail and the tree's nodes (cache slots
// ctx .. ctx + nn - 1), the only tiles that are masked (tail bound, ancestor bits). A request with one non-empty split
// writes `out` directly; otherwise each split writes its partial (o, lse) slot and tree_attention_merge combines
// them. Tiles are attended in FA3's intra-warpgroup order (iteration j):
//
//   S_j = Q K_j^T; O += P_{j-1} V_{j-1}     two async wgmmas, issued back to back (tensor cores)
//   wait S_j; P_j = softmax(S_j)            meanwhile (CUDA cores); base 2, the scale folded into the exponent
//   wait P_{j-1} V_{j-1}; O = alpha_j O      no accumulator stays in flight across the loop's back edge
//
// One barrier per step. Step j waits for K_j and V_{j-1}, then its barrier also says every warpgroup is done with
// step j - 1, so the slots of K_{j-1} (read by S_{j-1}) and V_{j-2} (read by P_{j-2} V_{j-2}) are refilled right
// there with K_{j+2} and V_{j+1}: K runs one tile ahead of V. A second barrier at the end of each step, to refill
// one step earlier, cost more than it gave: with two warps per scheduler, barrier stalls dominate (figures:
// docs/CUDA_NOTES.md, "Measurements behind the csrc rules").
//
// Two instantiations (p.config picks, see the launcher):
//   config 128 (default): two warpgroups, 128-token tiles. S is m64n128 (64 fp32 per thread), P V is 8 k-steps; Q
//     32 KB + 3 x (K 32 KB + V 32 KB) = 224 KB, one CTA per SM. Every iteration pays a barrier, a cp.async wait and
//     two wgmma waits whatever the tile, so the 128-token tile halves that fixed cost per token against 64 (a
//     two-warpgroup 64-token build was slower: docs/CUDA_NOTES.md).
//   config 64: one warpgroup, 64-token tiles, one CTA per 64-row chunk (two chunks share each K/V tile through L2,
//     adjacent in launch order). S is m64n64 with Q in registers (RS wgmma), P V 4 k-steps; 3 x (16 + 16) KB = 96 KB,
//     two CTAs per SM, so one CTA's prologue, masked tiles and epilogue overlap the other's streaming. For split
//     lengths that are multiples of 64.
//
// fp8 caches (KV): tiles are copied as stored, each 16-value chunk staged where its row's 16-bit chunk 2c goes, and
// every thread widens the chunks it copied in place (widen_rows): the tiles of step j + 1 during step j, between the
// issue of its wgmmas and the wait for S_j, so the widening runs while the tensor cores do (step 0's own tiles before
// its barrier); step j + 1's barrier publishes them.
// K/V are gathered through the block table by 16-byte cp.async into swizzled tiles (csrc/tree_attention/wgmma_sm90.cuh); rows past
// the attended range are zero-filled (never read: a masked column times a NaN in unread memory would be NaN), and so
// are rows whose page id is out of the cache (the CTA's rows are then written as NaN). The V rows of tree slots are
// copied by plain loads and stores, a NaN/inf among them zeroed (tree_attn::copy_tree_v_chunk): rows see different
// tree slots, and the zero weight of a row that does not see the node would otherwise meet it (0 * NaN = NaN).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/launch_status.h"
#include "tree_attention/tree_attention.cuh"  // tree_attn::cp_async_16 / cp_async_commit / cp_async_wait / TypeTraits, kMaxTree
#include "tree_attention/tree_attention_sm90_tile.cuh"
#include "tree_attention/wgmma_sm90.cuh"

namespace tlt {
namespace {

using namespace tree_sm90;
constexpr int kMaxRows = 128, kStages = 3;

// kWarpgroups = 2: 128 rows, Q staged in shared memory (S = Q K^T with both operands there). kWarpgroups = 1
// (64-token tiles only): one 64-row chunk of the T * G rows per CTA, Q kept in registers as the A operand of S (RS
// wgmma), so the K/V rings alone fill shared memory (97.75 KB) and two CTAs share an SM: one streams or does math
// while the other waits or runs its prologue. At T = 8, G = 7 (56 rows) a 128-row CTA would compute half zeros.
template <int kBlockN_, int kWarpgroups_ = 2>
struct CtxConfig {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpgroups = kWarpgroups_;
  static_assert(kBlockN == 64 || kBlockN == 128, "S is one m64n64 or m64n128 wgmma per k-step");
  static_assert(kWarpgroups == 2 || (kWarpgroups == 1 && kBlockN == 64), "one warpgroup: 64-token tiles (S m64n64)");
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kBlockM = 64 * kWarpgroups;
  static constexpr bool kQInSmem = kWarpgroups == 2;
  static constexpr int kMinBlocks = kWarpgroups == 1 ? 2 : 1;
  static constexpr int kTileBytes = kBlockN * kD * 2;  // one K or V tile
  // [Q] + K ring + V ring + the cache token of every row of kStages tiles, plus 1 KB to align the base: the 128-byte
  // swizzle is a function of address bits 4-9, so every tile must start 1024-byte aligned, which the dynamic
  // shared-memory window does not promise.
  static constexpr int kQBytes = kQInSmem ? kBlockM * kD * 2 : 0;
  static constexpr int kPagesOffset = kQBytes + 2 * kStages * kTileBytes;
  static constexpr int kSmemBytes = kPagesOffset + kStages * kBlockN * 4 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 opt-in shared-memory limit");
  static_assert(kMinBlocks == 1 || kMinBlocks * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs must fit one SM");
  static constexpr int kScores = kBlockN / 2;                              // S accumulator floats per thread
};
using Ctx128 = CtxConfig<128, 2>;  // 225.5 KB + 1 KB
using Ctx64 = CtxConfig<64, 1>;    // 96.75 KB + 1 KB, two CTAs per SM

using wgmma::fence_regs;

// 16-byte copy chunks in a cache row of kD values: 16 for caches of q's dtype, 8 for fp8 ones.
template <typename KV>
constexpr int kRowChunks = kD * static_cast<int>(sizeof(KV)) / 16;

// 8 e4m3 values (8 bytes, first value in the lowest byte) widened to bfloat16, exactly, into `out`; false, with
// nothing written, when one of them is NaN (the caller widens by conversion instructions then). An e4m3 byte
// s.eeee.mmm moved to bits 15 and 10-4 of a bfloat16 is the same value times 2^-120 (subnormals included: bfloat16's
// own subnormals cover them), so one bfloat16x2 multiply by 2^120 per pair finishes it: integer ops instead of the
// conversion unit's lower throughput. NaN (s.1111.111) would come out 480.
__device__ __forceinline__ bool widen_e4m3x8_bf16(const uint2& raw, uint4& out) {
  // Bit 7 of a byte set iff its low 7 bits are all ones (+1 carries into bit 7 only then).
  const uint32_t nan_bytes = (((raw.x & 0x7f7f7f7fu) + 0x01010101u) | ((raw.y & 0x7f7f7f7fu) + 0x01010101u)) &
                             0x80808080u;
  if (nan_bytes != 0u) return false;
  const __nv_bfloat162 two_pow_120 = __halves2bfloat162(__ushort_as_bfloat16(0x7b80), __ushort_as_bfloat16(0x7b80));
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // Bytes 2i and 2i + 1 into the high bytes of two 16-bit lanes.
    const uint32_t v = __byte_perm(i < 2 ? raw.x : raw.y, 0u, (i & 1) ? 0x3424u : 0x1404u);
    const uint32_t bits = (v & 0x80008000u) | ((v >> 4) & 0x07f007f0u);
    __nv_bfloat162 pair = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), two_pow_120);
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  out = make_uint4(words[0], words[1], words[2], words[3]);
  return true;
}

// 8 fp8 values (KV) widened exactly to T (as widen_e4m3x8_bf16, else tree_attn::widen_fp8x8); `finite`: no NaN/inf.
template <typename T, typename KV>
__device__ __forceinline__ uint4 widen_fp8x8_fast(const uint2& raw, bool& finite) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value && std::is_same<KV, __nv_fp8_e4m3>::value) {
    uint4 out;
    finite = true;  // e4m3 has no inf: finite unless NaN
    if (widen_e4m3x8_bf16(raw, out)) return out;
  }
  return tree_attn::widen_fp8x8<T, KV>(raw, finite);
}

// fp8 caches: this thread's staged chunks of tile i in ring slot `slot` widened in place, as issue_rows copied them
// (row (threadIdx.x + it * kThreads) / kRowChunks, chunk c = threadIdx.x % kRowChunks). Chunk c (16 values) of a row is
// staged where the row's 16-bit chunk 2c goes and becomes chunks 2c and 2c + 1; chunk 2c + 1's place holds no staging,
// so a thread that widens the chunks it copied writes only where it alone staged: no barrier before the widening.
// kTreeV: a V tile with tree slots, whose rows' 8-value halves go through zero_bad_tree_v as
// tree_attn::copy_tree_v_chunk does; a template argument so that K and context V tiles carry no node or finiteness
// work. Chunk it + 1's shared load is issued before chunk it is widened (the ordered accesses would otherwise wait
// for one load per chunk).
template <typename T, typename KV, int kBlockN, int kThreads, bool kTreeV>
__device__ __forceinline__ void widen_rows(uint32_t slot, const Span& sp, int i, unsigned long long* bad_nodes) {
  constexpr int kChunks = kBlockN * kRowChunks<KV> / kThreads;
  const int chunk = threadIdx.x % kRowChunks<KV>;
  auto row_of = [&](int it) { return (threadIdx.x + it * kThreads) / kRowChunks<KV>; };
  auto load = [&](int it) { return load_staged_chunk(slot + wgmma::swizzled_offset(kBlockN, row_of(it), 2 * chunk)); };
  uint4 next = load(0);
#pragma unroll 1
  for (int it = 0; it < kChunks; ++it) {
    const int row = row_of(it);
    const uint4 raw = next;
    if (it + 1 < kChunks) next = load(it + 1);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      bool finite;
      uint4 v = widen_fp8x8_fast<T, KV>(half ? make_uint2(raw.z, raw.w) : make_uint2(raw.x, raw.y), finite);
      if constexpr (kTreeV) {
        const int tree_node = tree_node_of_row<kBlockN>(sp, i, row, true);
        if (tree_node >= 0) tree_attn::zero_bad_tree_v(v, finite, tree_node, bad_nodes);
      }
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                   ::"r"(slot + wgmma::swizzled_offset(kBlockN, row, 2 * chunk + half)), "r"(v.x), "r"(v.y),
                   "r"(v.z), "r"(v.w)
                   : "memory");
    }
  }
}

// Rows of tile i of K (or V: the cache, its token stride and this head's offset) into one ring slot, each row's cache
// token read from `tokens` (shared memory, one entry per row of the tile). No commit.
// `base`: this thread's 16-byte column chunk of the KV head in the cache; `slot`: the ring slot's shared address.
// kTreeV: a V tile holding tree slots, whose rows are checked on their way (copy_row_chunk, `bad_nodes`).
// fp8 caches (KV): 16 values per chunk, staged at the place of the row's 16-bit chunk 2c and widened there once landed
// (widen_rows, which also checks a tree slot's V).
template <typename T, typename KV, int kBlockN, int kThreads, bool kTreeV>
__device__ __forceinline__ void issue_rows(const int32_t* tokens, const char* base, uint32_t stride_bytes,
                                           uint32_t slot, const Span& sp, int i, unsigned long long* bad_nodes) {
  constexpr bool kFp8 = tree_attn::kIsFp8<KV>;
  constexpr int kChunks = kBlockN * kRowChunks<KV> / kThreads;
  const int chunk = threadIdx.x % kRowChunks<KV>;  // the same 16-byte column chunk in every row this thread copies
#pragma unroll
  for (int it = 0; it < kChunks; ++it) {
    const int row = (threadIdx.x + it * kThreads) / kRowChunks<KV>;
    const int32_t token = tokens[row];
    // A row past the span (token -1) copies nothing from token 0's address: zero-filled. One wide multiply.
    const char* src = base + static_cast<uint64_t>(static_cast<uint32_t>(max(token, 0))) * stride_bytes;
    const uint32_t dst = slot + wgmma::swizzled_offset(kBlockN, row, kFp8 ? 2 * chunk : chunk);
    if constexpr (kFp8)
      tree_attn::cp_async_16(dst, src, token >= 0 ? 16 : 0);
    else
      copy_row_chunk<T, kBlockN>(dst, src, token, sp, i, row, kTreeV, bad_nodes);
  }
}


// KV: the caches' storage, T or an fp8 type (widened to T in shared memory, see widen_rows).
template <typename T, typename KV, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    tree_attention_sm90_kernel(const TreeAttentionParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kBlockN = Cfg::kBlockN, kTileBytes = Cfg::kTileBytes;
  constexpr int kThreads = Cfg::kThreads, kBlockM = Cfg::kBlockM;
  constexpr int kScores = Cfg::kScores;
  constexpr bool kFp8 = tree_attn::kIsFp8<KV>;
  extern __shared__ __align__(16) unsigned char smem[];
  // blockIdx.x = split * chunks + chunk: the row chunks of one split are adjacent, so their K/V re-reads hit L2.
  const int chunks = gridDim.x / p.num_splits, chunk = blockIdx.x % chunks;
  const int split = blockIdx.x / chunks, h = blockIdx.y, b = blockIdx.z;
  const int G = p.group, TG = p.num_tree * G;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  // This thread's rows: row_base and row_base + 8 (of T * G; chunk is 0 with two warpgroups).
  const int row_base = kBlockM * chunk + 64 * wg + 16 * warp + lane / 4;
  // Q first, into registers (rows >= T * G zero): its loads need neither the context length nor the pages, so their
  // latency passes under the block-table lookups and the first copies. Two warpgroups: 16-byte chunks, stored to
  // shared memory after those. One warpgroup: straight into the A fragments of S's k-steps (rows row_base (+8),
  // columns 16 k + 2 (lane % 4) (+8): the accumulator layout, see wgmma::a_fragment).
  constexpr int kQChunks = Cfg::kQInSmem ? kBlockM * (kD / 8) / kThreads : 1;
  uint4 q_regs[kQChunks];                            // two warpgroups (one warpgroup: unused, dropped)
  uint32_t q_frag[Cfg::kQInSmem ? 1 : kD / 16][4];  // one warpgroup (two: unused, dropped)
  {
    const T* Q = static_cast<const T*>(p.q) + b * p.q_stride_b;
    auto q_row = [&](int m) { const int t = m / G; return Q + t * p.q_stride_t + (h * G + m - t * G) * p.q_stride_h; };
    if constexpr (Cfg::kQInSmem) {
#pragma unroll
      for (int it = 0; it < kQChunks; ++it) {
        const int i = threadIdx.x + it * kThreads;
        const int m = i / (kD / 8), col16 = i % (kD / 8);
        q_regs[it] = m < TG ? *reinterpret_cast<const uint4*>(q_row(m) + col16 * 8) : make_uint4(0, 0, 0, 0);
      }
    } else {
      load_q_fragments<T>(q_row, row_base, TG, lane, q_frag);
    }
  }

  Span sp;
  bool direct = false;  // this CTA completes its rows: write out, skip the scratch and the merge
  if (!split_span<kBlockN>(p, b, split, sp, direct)) return;

  const uint32_t q_s = (wgmma::smem_addr(smem) + 1023u) & ~1023u;
  unsigned char* const smem_q = smem + (q_s - wgmma::smem_addr(smem));  // generic pointer to the aligned base
  const uint32_t k_s = q_s + Cfg::kQBytes;  // shared addresses of the K and V rings (descriptors, cp.async)
  const uint32_t v_s = k_s + kStages * kTileBytes;
  // The cache tokens of tile i's rows live in pages_s + (i % kStages) * kBlockN (not in registers: K and V of
  // different tiles are issued together, which would take two sets). Thread t < kBlockN owns row t: it reads tile
  // i + 1's page from the block table into `next_page` one step before storing its token, so the load never stalls.
  int32_t* const pages_s = reinterpret_cast<int32_t*>(smem_q + Cfg::kPagesOffset);
  const bool pager = threadIdx.x < kBlockN;
  auto pages_of = [&](int i) { return pages_s + (i % kStages) * kBlockN; };
  // This thread's 16-byte column chunk of KV head h; rows are token * stride_token past it (token strides below
  // 2^31 bytes: the launcher checks).
  constexpr int kChunkValues = 16 / static_cast<int>(sizeof(KV));
  const char* const k_base = reinterpret_cast<const char*>(static_cast<const KV*>(p.k_cache) + h * p.k_stride_head +
                                                           (threadIdx.x % kRowChunks<KV>) * kChunkValues);
  const char* const v_base = reinterpret_cast<const char*>(static_cast<const KV*>(p.v_cache) + h * p.v_stride_head +
                                                           (threadIdx.x % kRowChunks<KV>) * kChunkValues);
  const uint32_t k_stride = static_cast<uint32_t>(p.k_stride_token * sizeof(KV));
  const uint32_t v_stride = static_cast<uint32_t>(p.v_stride_token * sizeof(KV));
  // Tree nodes whose V (this KV head) holds a NaN/inf (see tree_attn::copy_tree_v_chunk); a page id out of the cache
  // seen by this pager thread (see row_page). Both make NaN rows in store_rows.
  __shared__ unsigned long long bad_nodes;
  bool page_bad = false;
  auto issue_k = [&](int i) {
    if (i < sp.n_tiles)
      issue_rows<T, KV, kBlockN, kThreads, false>(pages_of(i), k_base, k_stride, k_s + (i % kStages) * kTileBytes,
                                                  sp, i, &bad_nodes);
  };
  auto issue_v = [&](int i) {
    if (i >= sp.n_tiles) return;
    const uint32_t slot = v_s + (i % kStages) * kTileBytes;
    if (tile_has_tree<kBlockN>(sp, i))
      issue_rows<T, KV, kBlockN, kThreads, true>(pages_of(i), v_base, v_stride, slot, sp, i, &bad_nodes);
    else
      issue_rows<T, KV, kBlockN, kThreads, false>(pages_of(i), v_base, v_stride, slot, sp, i, &bad_nodes);
  };
  // fp8: tile i's staged K (or V) widened in its ring slot by the threads that copied it (widen_rows).
  auto widen_k = [&](int i) {
    if (i < sp.n_tiles)
      widen_rows<T, KV, kBlockN, kThreads, false>(k_s + (i % kStages) * kTileBytes, sp, i, &bad_nodes);
  };
  auto widen_v = [&](int i) {
    if (i >= sp.n_tiles) return;
    const uint32_t slot = v_s + (i % kStages) * kTileBytes;
    if (tile_has_tree<kBlockN>(sp, i))
      widen_rows<T, KV, kBlockN, kThreads, true>(slot, sp, i, &bad_nodes);
    else
      widen_rows<T, KV, kBlockN, kThreads, false>(slot, sp, i, &bad_nodes);
  };
  int32_t next_page = -1;
  // Stores tile i's tokens (its page read a step ago) and reads tile i + 1's page. Tile i's slot last held tile
  // i - 3, whose K and V were issued before the barrier the caller has just passed.
  auto advance_pages = [&](int i) {
    if (pager) {
      pages_of(i)[threadIdx.x] = row_token<kBlockN>(p, sp, i, threadIdx.x, next_page);
      next_page = row_page<kBlockN>(p, sp, i + 1, threadIdx.x);
      page_bad = page_bad || next_page == tree_attn::kBadPage;
    }
  };

  // Prologue: K and V of tiles 0 .. kStages - 1, one commit group per tile (P_0 .. P_2); step j >= 1 commits
  // H_j = {K_{j+2}, V_{j+1}} after its barrier (H_1 = {K_3}: V_2 is in P_2). Step j needs K_j and V_{j-1}, in P_j
  // (j <= 2) or H_{j-2}: cp.async.wait_group 2 at step 0 (P_1, P_2 may fly), 1 after (H_{j-1} may fly).
  if (pager) {  // the pages of tiles 0 .. kStages, every load in flight before the first is used
    int32_t first[kStages];
#pragma unroll
    for (int i = 0; i < kStages; ++i) first[i] = row_page<kBlockN>(p, sp, i, threadIdx.x);
    next_page = row_page<kBlockN>(p, sp, kStages, threadIdx.x);
    page_bad = next_page == tree_attn::kBadPage;
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      page_bad = page_bad || first[i] == tree_attn::kBadPage;
      pages_of(i)[threadIdx.x] = row_token<kBlockN>(p, sp, i, threadIdx.x, first[i]);
    }
  }
  if (threadIdx.x == 0) bad_nodes = 0ull;
  __syncthreads();
#pragma unroll 1
  for (int i = 0; i < kStages; ++i) {
    issue_k(i);
    issue_v(i);
    tree_attn::cp_async_commit();
  }
  if constexpr (Cfg::kQInSmem) {
#pragma unroll
    for (int it = 0; it < kQChunks; ++it) {
      const int i = threadIdx.x + it * kThreads;
      *reinterpret_cast<uint4*>(smem_q + wgmma::swizzled_offset(kBlockM, i / (kD / 8), i % (kD / 8))) = q_regs[it];
    }
  }

  // Descriptors of K ring slot 0's and V ring slot 0's first k-step (Q's, with two warpgroups, in the loop); every
  // other one is an offset from these.
  const uint64_t dk0 = wgmma::desc_k_major(k_s, kBlockN, 0);
  const uint64_t dv0 = wgmma::desc_mn_major(v_s, kBlockN, 0);

  const float qk_scale = p.sm_scale * 1.4426950408889634f;
  float m_i[2], l_i[2], s[kScores], o[64];
  init_rows(m_i, l_i, s, o);

  // One loop for every step, j = 0 .. n (uniform branches): step j issues S_j (j < n), then P_{j-1} V_{j-1}; at j = 0
  // that product is a zero P (s starts at 0) times V_0, so every step commits its P V group last and `wait_group 1`
  // always means "S_j done" (a wait that depended on the step left ptxas unable to prove it: C7514). Peeling the
  // first and last steps instead tripled the issue and softmax code, and the kernel's instructions overflowed the
  // instruction cache, a cost paid again by every CTA.
  const int n = sp.n_tiles;  // >= 1: a request has at least one node
  float alpha[2] = {0.f, 0.f};
  for (int j = 0; j <= n; ++j) {
    // K_j and V_{j-1} landed: the prologue's three groups, then one group per step from step 1 on.
    if (j == 0)
      tree_attn::cp_async_wait<2>();
    else
      tree_attn::cp_async_wait<1>();
    if (kFp8 && j == 0) {  // V_0 too: step 0's zero P multiplies it (staged bytes read as 16-bit values may be NaN)
      widen_k(0);
      widen_v(0);
    }
    wgmma::fence_proxy_async();
    __syncthreads();  // ... and every warpgroup is done with step j - 1: K_{j-1}'s and V_{j-2}'s slots are free
    if (j > 0) {
      issue_k(j + kStages - 1);
      if (j > 1) issue_v(j + kStages - 2);  // V_2 came with the prologue
      tree_attn::cp_async_commit();
    }
    advance_pages(j + kStages);  // tile j's token slot: its K and V were issued before this barrier
    uint32_t frag[kBlockN / 16][4];
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) wgmma::a_fragment<T>(s, t, frag[t]);
    fence_regs(s);
    fence_regs(o);
    wgmma::fence();
    {  // at j = n, S of whatever K slot n holds: discarded (an S issued on a condition also trips C7514)
      const uint64_t dk = wgmma::desc_add(dk0, (j % kStages) * kTileBytes);
      if constexpr (Cfg::kQInSmem) {
        // This warpgroup's 64 rows of Q: rows 64 wg .. in each 64-column half of the [128, 128] tile.
        const uint64_t dq0 = wgmma::desc_k_major(q_s + wg * 64 * 128, kBlockM, 0);
#pragma unroll
        for (int k = 0; k < kD / 16; ++k)
          mma_s<T>(s, wgmma::desc_add(dq0, k_step(kBlockM, k)), wgmma::desc_add(dk, k_step(kBlockN, k)), k > 0);
      } else {
#pragma unroll
        for (int k = 0; k < kD / 16; ++k)
          wgmma::mma_m64n64k16_rs<T>(s, q_frag[k], wgmma::desc_add(dk, k_step(kBlockN, k)), k > 0);
      }
      wgmma::commit();
    }
    const uint64_t dv = wgmma::desc_add(dv0, (max(j - 1, 0) % kStages) * kTileBytes);
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) wgmma::mma_m64n128k16_rs<T>(o, frag[t], wgmma::desc_add(dv, t * 16 * 128), 1);
    wgmma::commit();
    if constexpr (kFp8) {
      // The tiles step j + 1 reads (K_{j+1}, V_j), widened while the tensor cores run this step's wgmmas: their group
      // is the one before the newest (P_1, P_2 or H_{j-1}); the barrier of step j + 1 publishes them.
      tree_attn::cp_async_wait<1>();
      widen_k(j + 1);
      if (j > 0) widen_v(j);
    }
    wgmma::wait<1>();  // S_j done (issued first); P_{j-1} V_{j-1} may still run
    fence_regs(s);
    if (j < n) {
      if (j >= sp.n_full) mask_tile(p, sp, b, row_base, G, j, s);
      online_softmax(s, qk_scale, m_i, l_i, alpha);
    }
    wgmma::wait<0>();
    fence_regs(o);
    if (j == n) break;
    rescale_o(o, alpha);
  }
  tree_attn::cp_async_wait<0>();  // no copy may outlive the CTA's shared memory

  // bad_nodes is complete: every tile was issued before the last step's barrier.
  const bool poisoned = __syncthreads_or(page_bad) != 0;
  store_rows<T>(p, sp, b, h, split, direct, row_base, o, m_i, l_i, poisoned, bad_nodes);
#endif
}

// The instantiation for q's dtype T and the caches' storage (p.kv_fp8).
template <typename T, typename Cfg>
auto sm90_kernel_for(const TreeAttentionParams& p) noexcept {
  switch (p.kv_fp8) {
    case Fp8Format::kE4M3: return tree_attention_sm90_kernel<T, __nv_fp8_e4m3, Cfg>;
    case Fp8Format::kE5M2: return tree_attention_sm90_kernel<T, __nv_fp8_e5m2, Cfg>;
    default: return tree_attention_sm90_kernel<T, T, Cfg>;
  }
}

template <typename Cfg>
LaunchStatus launch_sm90_dtype(const TreeAttentionParams& p, dim3 grid, cudaStream_t stream) noexcept {
  return launch_with_smem(p.dtype == DType::kBFloat16 ? sm90_kernel_for<__nv_bfloat16, Cfg>(p)
                                                      : sm90_kernel_for<__half, Cfg>(p),
                          grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p);
}

}  // namespace

// p.config picks the tile width (tokens of K/V per iteration; p.split_len must be a multiple of it): 0 = the default,
// 128 (two warpgroups); 128 = the same, named; 64 = the 64-token tile (one warpgroup per 64-row chunk). Anything
// else is refused, so a tuning index meant for the partial kernel (tree_attention.cu) cannot silently select a width.
LaunchStatus launch_tree_attention_sm90(const TreeAttentionParams& p, cudaStream_t stream) noexcept {
  const bool tma = (p.config & kSm90Tma) != 0;
  const bool warp_specialized = (p.config & ~kSm90Tma) == (128 | kSm90WarpSpecialized);
  TLT_STATUS_CHECK_ARG(p.config == 0 || p.config == 64 || p.config == 128 || warp_specialized,
                       "the sm_90 tree-attention kernel's config is its tile width: 0 (default, 128), 64 or 128, or "
                           << (128 | kSm90WarpSpecialized) << " (128, warp-specialized; | " << kSm90Tma
                           << " for TMA copies), got " << p.config);
  const int block_n = p.config == 64 ? Ctx64::kBlockN : Ctx128::kBlockN;
  // CTAs per (split, KV head, request): 64-row chunks (config 64); 128-row blocks (warp-specialized), their count
  // rounded up to a power of two (the kernel splits blockIdx.x by a shift); else one.
  const int rows = p.num_tree * p.group;
  int row_block_shift = 0;
  while (warp_specialized && row_block_shift < 8 && (Ctx128::kBlockM << row_block_shift) < rows) ++row_block_shift;
  const int chunks = p.config == 64 ? (rows + Ctx64::kBlockM - 1) / Ctx64::kBlockM : 1 << row_block_shift;
  TLT_STATUS_CHECK_ARG(p.head_dim == kD, "the sm_90 tree-attention kernel covers head_dim 128, got " << p.head_dim);
  const bool fp8 = p.kv_fp8 != Fp8Format::kNone;
  TLT_RETURN_IF_FAILED(check_tree_attention_scales(p));
  TLT_STATUS_CHECK_ARG(!(fp8 && tma), "fp8 caches run on the warp-specialized kernel's cp.async build, not with the "
                                      "TMA flag " << kSm90Tma);
  // fp8 rows are copied 16 values (bytes) at a time.
  TLT_STATUS_CHECK_ARG(!fp8 || (p.k_stride_token % 16 == 0 && p.k_stride_head % 16 == 0 && p.v_stride_token % 16 == 0 &&
                                p.v_stride_head % 16 == 0),
                       "fp8 caches on the sm_90 kernel need token and head strides of multiples of 16 elements");
  TLT_STATUS_CHECK_ARG(p.num_kv_heads > 0 && p.num_q_heads == p.num_kv_heads * p.group,
                       "num_q_heads (" << p.num_q_heads << ") must equal num_kv_heads (" << p.num_kv_heads
                                       << ") * group (" << p.group << ")");
  TLT_STATUS_CHECK_ARG(p.num_tree >= 1 && p.num_tree <= tree_attn::kMaxTree,
                       "num_tree must be in [1, " << tree_attn::kMaxTree << "], got " << p.num_tree);
  TLT_STATUS_CHECK_ARG(warp_specialized || rows <= kMaxRows,
                       "T * G = " << rows << " rows exceed " << kMaxRows << " (the warp-specialized config "
                                  << (128 | kSm90WarpSpecialized) << " takes up to " << (Ctx128::kBlockM << 8) << ")");
  TLT_STATUS_CHECK_ARG(rows <= (Ctx128::kBlockM << row_block_shift) || !warp_specialized,
                       "T * G = " << rows << " rows exceed the warp-specialized kernel's " << (Ctx128::kBlockM << 8));
  TLT_STATUS_CHECK_ARG(p.mask_words == (p.num_tree + 31) / 32 && p.tree_mask != nullptr && p.num_nodes != nullptr,
                       "tree_mask [B, T, ceil(T / 32)] and num_nodes must be set");
  TLT_STATUS_CHECK_ARG(p.out != nullptr && reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && p.out_stride_b % 2 == 0 &&
                           p.out_stride_t % 2 == 0 && p.out_stride_h % 2 == 0,
                       "out must be a 4-byte aligned device pointer with even strides");
  TLT_STATUS_CHECK_ARG(p.num_splits == 1 || (p.partial_out != nullptr && p.partial_lse != nullptr &&
                                             reinterpret_cast<uintptr_t>(p.partial_out) % 8 == 0),
                       "plans with several splits need partial_out (8-byte aligned) and partial_lse");
  TLT_STATUS_CHECK_ARG(p.split_len > 0 && p.split_len % block_n == 0,
                       "split_len must be a positive multiple of the sm_90 kernel's tile width " << block_n
                           << " (config " << p.config << "; config=64 selects the 64-token tile), got "
                           << p.split_len);
  TLT_STATUS_CHECK_ARG(p.batch >= 0 && p.batch <= 65535 && p.num_kv_heads <= 65535 && p.num_splits >= 1 &&
                           int64_t(p.num_splits) * chunks <= 0x7fffffff,
                       "bad batch / num_kv_heads / num_splits (grid limits)");
  // Pages of a power-of-two size, each a run of block_size token rows: a row's K/V is at token * stride_token (a
  // division per copied row, then a multiply-add per stride, made the copy issue the largest part of the code).
  TLT_STATUS_CHECK_ARG(p.block_size > 0 && (p.block_size & (p.block_size - 1)) == 0,
                       "the sm_90 tree-attention kernel needs a power-of-two block_size, got " << p.block_size);
  TLT_STATUS_CHECK_ARG(p.k_stride_block == p.block_size * p.k_stride_token &&
                           p.v_stride_block == p.block_size * p.v_stride_token,
                       "the sm_90 tree-attention kernel needs pages of contiguous token rows (stride_block == "
                       "block_size * stride_token for K and V)");
  TLT_STATUS_CHECK_ARG(p.k_stride_token > 0 && p.k_stride_token <= INT32_MAX / 2 && p.v_stride_token > 0 &&
                           p.v_stride_token <= INT32_MAX / 2,
                       "the sm_90 tree-attention kernel needs token strides in (0, 2^31) bytes");
  TLT_RETURN_IF_FAILED(check_tree_attention_gather(p));  // 16-byte cp.async rows, as the partial kernel's
  if (p.batch == 0) return {};
  TLT_RETURN_IF_FAILED(wgmma::require_sm90());
  TreeAttentionParams q = p;
  q.block_shift = __builtin_ctz(static_cast<unsigned>(p.block_size));
  q.row_block_shift = row_block_shift;
  q.num_blocks = cache_num_blocks(p);
  const dim3 grid(static_cast<unsigned>(p.num_splits * chunks), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(p.batch));
  // The TMA build needs whole 16-token boxes inside a page and the cache's extent for its tensor maps.
  if (warp_specialized)
    return launch_sm90_warp_specialized(q, grid, stream, tma && p.block_size >= 16 && p.cache_tokens > 0 ? 4 : 0);
  return block_n == Ctx64::kBlockN ? launch_sm90_dtype<Ctx64>(q, grid, stream) : launch_sm90_dtype<Ctx128>(q, grid, stream);
}

}  // namespace tlt
