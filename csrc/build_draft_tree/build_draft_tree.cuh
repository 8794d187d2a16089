// The EAGLE-2 draft-tree selection kernel (torch-free, nvcc only); launched from build_draft_tree.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "build_draft_tree/build_draft_tree.h"
#include "common/reductions.cuh"

namespace tlt {
namespace accept {

constexpr int kBuildThreads = 128;

// One CTA per request; candidate c = tid * ITEMS + i lives in registers of thread tid. Greedy
// frontier selection takes num_verify - 1 rounds of one block-wide max over packed keys
// (score's ordered image << 32 | ~c: the max is the best score, ties to the lowest index);
// taking c makes its usable children eligible. Then node ids (block scan of the kept flags, so kept
// candidates become nodes 1.. in index order), the outputs, and the packed ancestor mask: each kept
// candidate walks up its parent chain, whose node ids decrease, emitting mask words high to low.
template <int ITEMS>
__global__ void __launch_bounds__(kBuildThreads) build_draft_tree_kernel(const BuildDraftTreeParams p) {
  extern __shared__ int bsm[];  // par[N], node_of[N]
  __shared__ uint64_t red[2][kBuildThreads / 32];
  __shared__ int scan[kBuildThreads / 32];
  const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = p.num_cand, NV = p.num_verify;
  int* par_s = bsm;
  int* node_s = bsm + N;

  uint64_t key[ITEMS];
  int par[ITEMS];
  bool usable[ITEMS], elig[ITEMS], taken[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = tid * ITEMS + i;
    const bool in = c < N;
    par[i] = in ? p.cand_parents[b * p.cp_stride_b + c] : -1;
    const float sc = in ? p.cand_scores[b * p.cs_stride_b + c] : -INFINITY;
    usable[i] = in && sc != -INFINITY;
    const uint32_t uk = static_cast<uint32_t>(ordered_key(sc)) ^ 0x80000000u;
    key[i] = (static_cast<uint64_t>(uk) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(c));
    elig[i] = usable[i] && par[i] < 0;
    taken[i] = false;
    if (in) par_s[c] = par[i];
  }

  // Usable scores are > -inf, so their keys are > 0: 0 means "nothing eligible".
  for (int round = 0; round < NV - 1; ++round) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
      if (elig[i] && !taken[i] && key[i] > best) best = key[i];
    best = warp_reduce(best, MaxU64());
    if (lane == 0) red[round & 1][warp] = best;  // double buffer: one barrier per round
    __syncthreads();
    best = red[round & 1][0];
#pragma unroll
    for (int w = 1; w < kBuildThreads / 32; ++w) best = red[round & 1][w] > best ? red[round & 1][w] : best;
    if (best == 0) break;  // block-uniform
    const int c_best = static_cast<int>(~static_cast<uint32_t>(best));
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = tid * ITEMS + i;
      taken[i] |= c == c_best;
      elig[i] |= usable[i] && par[i] == c_best;
    }
  }

  // Node ids: inclusive scan of kept flags in candidate order.
  int cnt = 0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) cnt += taken[i];
  int incl = cnt;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) scan[warp] = incl;
  __syncthreads();
  int before = 0, kept_total = 0;
#pragma unroll
  for (int w = 0; w < kBuildThreads / 32; ++w) {
    before += w < warp ? scan[w] : 0;
    kept_total += scan[w];
  }
  int node[ITEMS];
  int run = before + incl - cnt;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = tid * ITEMS + i;
    run += taken[i];
    node[i] = taken[i] ? run : 0;
    if (c < N) node_s[c] = node[i];
  }
  __syncthreads();
  const int num_nodes = 1 + kept_total;

  int32_t* out_par = p.parents + static_cast<int64_t>(b) * NV;
  int64_t* out_tok = p.draft_tokens + static_cast<int64_t>(b) * NV;
  int32_t* out_ci = p.cand_index + static_cast<int64_t>(b) * NV;
  const int words = (NV + 31) / 32;
  int32_t* mask = p.tree_mask ? p.tree_mask + static_cast<int64_t>(b) * NV * words : nullptr;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (!taken[i]) continue;
    const int c = tid * ITEMS + i;
    const int nd = node[i];
    out_par[nd] = par[i] < 0 ? 0 : node_s[par[i]];
    out_tok[nd] = p.cand_tokens[b * p.ct_stride_b + c];
    out_ci[nd] = c;
    if (mask) {
      int32_t* mrow = mask + static_cast<int64_t>(nd) * words;
      int w_cur = words - 1;
      uint32_t acc = 0;
      for (int a = c;; a = par_s[a]) {
        const int id = a < 0 ? 0 : node_s[a];
        const int w = id >> 5;
        for (; w_cur > w; --w_cur) {
          mrow[w_cur] = static_cast<int32_t>(acc);
          acc = 0;
        }
        acc |= 1u << (id & 31);
        if (a < 0) break;
      }
      for (; w_cur >= 0; --w_cur) {
        mrow[w_cur] = static_cast<int32_t>(acc);
        acc = 0;
      }
    }
  }
  // Root and padding positions (not owned by a kept candidate).
  for (int q = tid; q < NV; q += kBuildThreads) {
    if (q != 0 && q < num_nodes) continue;
    out_par[q] = q == 0 ? -1 : 0;
    out_tok[q] = q == 0 ? p.root_tokens[b] : 0;
    out_ci[q] = -1;
    if (mask)
      for (int w = 0; w < words; ++w) mask[static_cast<int64_t>(q) * words + w] = (q == 0 && w == 0) ? 1 : 0;
  }
  if (tid == 0) p.num_nodes[b] = num_nodes;
}

}  // namespace accept
}  // namespace tlt
