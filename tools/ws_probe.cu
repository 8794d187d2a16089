// Timing probe of the warp-specialized sm_90 tree-attention kernel, outside the package: is a 128-token
// tile bound by the copies or by the math, and where does a CTA's fixed time go? One build per mode on the GPU
// machine (tools/ws_probe.sh):
//   TLT_WS_PROBE=0  the kernel as shipped, its TMA build, and the lockstep two-warpgroup kernel beside them;
//   TLT_WS_PROBE=1  streaming only: the producer copies, the consumers release each slot as soon as it is full;
//   TLT_WS_PROBE=2  math only: the producer marks slots full without copying, the consumers compute as usual;
//   TLT_WS_PROBE=3  as shipped, plus clock64 / %globaltimer checkpoints per CTA (JSON lines per L: each phase's
//                   min / median / max over the CTAs in us, and the CTAs' start and end times; the first steps'
//                   checkpoints; and the time one consumer and one producer thread spend per activity over the whole
//                   CTA: waiting for data, for its turn, for S, in mask + softmax, for P V; waiting for free slots,
//                   issuing copies. Consumers that wait for data while the producer never waits for slots mean
//                   the copies are what is slow).
// (A mode whose consumers never waited for data hung: running ahead, they completed an `empty` barrier's phase twice
// before the producer's parity wait saw the first, so the producer waited for a phase that had come and gone. The
// shipped kernel cannot get there: a consumer releases a slot only after waiting for the fill it reads.)
// Qwen2.5-7B shape (Hq 28, Hkv 4, D 128), bf16, 16-token pages in shuffled order, chains of T nodes, one split.
// Prints one JSON line per (kernel, L): microseconds (median of 30 single launches, then the mean of ~200 ms of
// launches back to back) and GB/s of K/V moved.
//   usage: ws_probe B T L1,L2,... [variant]   (variant: the build mode 3 stamps; 0 as shipped, 4 TMA)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../csrc/tree_attention/tree_attention_ctx_sm90_ws.cu"

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

__global__ void fill_bf16(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16((h & 0xffff) / 32768.f - 1.f);
  }
}

int main(int argc, char** argv) {
  using namespace tlt;
  const int B = argc > 1 ? std::atoi(argv[1]) : 64, T = argc > 2 ? std::atoi(argv[2]) : 16;
  std::vector<int> Ls;
  {
    std::string s = argc > 3 ? argv[3] : "1024,4096,16384";
    for (size_t a = 0; a < s.size();) {
      size_t b = s.find(',', a);
      Ls.push_back(std::atoi(s.substr(a, b - a).c_str()));
      if (b == std::string::npos) break;
      a = b + 1;
    }
  }
  const int Hq = 28, Hkv = 4, D = 128, G = Hq / Hkv, page = 16;
  const int maxL = *std::max_element(Ls.begin(), Ls.end());
  const int pages_per_req = (maxL + T + page - 1) / page;
  const int num_blocks = B * pages_per_req;
  __nv_bfloat16 *q, *k, *v, *out;
  const size_t cache_elems = size_t(num_blocks) * page * Hkv * D;
  CHECK(cudaMalloc(&q, size_t(B) * T * Hq * D * 2));
  CHECK(cudaMalloc(&out, size_t(B) * T * Hq * D * 2));
  CHECK(cudaMalloc(&k, cache_elems * 2));
  CHECK(cudaMalloc(&v, cache_elems * 2));
  fill_bf16<<<1024, 256>>>(q, size_t(B) * T * Hq * D, 1);
  fill_bf16<<<1024, 256>>>(k, cache_elems, 2);
  fill_bf16<<<1024, 256>>>(v, cache_elems, 3);
  std::vector<int32_t> bt(size_t(B) * pages_per_req), nodes(B, T), mask(size_t(B) * T);
  for (size_t i = 0; i < bt.size(); ++i) bt[i] = int32_t(i);
  std::srand(7);
  for (size_t i = bt.size() - 1; i > 0; --i) std::swap(bt[i], bt[std::rand() % (i + 1)]);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) mask[size_t(b) * T + t] = int32_t((t == 31 ? 0u : (2u << t)) - 1u);  // chain
  int32_t *d_bt, *d_ctx, *d_nodes, *d_mask;
  CHECK(cudaMalloc(&d_bt, bt.size() * 4));
  CHECK(cudaMalloc(&d_ctx, B * 4));
  CHECK(cudaMalloc(&d_nodes, B * 4));
  CHECK(cudaMalloc(&d_mask, mask.size() * 4));
  CHECK(cudaMemcpy(d_bt, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_nodes, nodes.data(), B * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_mask, mask.data(), mask.size() * 4, cudaMemcpyHostToDevice));

  TreeAttentionParams p;
  p.q = q, p.k_cache = k, p.v_cache = v, p.out = out;
  p.block_table = d_bt, p.context_lens = d_ctx, p.num_nodes = d_nodes, p.tree_mask = d_mask;
  p.q_stride_b = int64_t(T) * Hq * D, p.q_stride_t = Hq * D, p.q_stride_h = D;
  p.out_stride_b = p.q_stride_b, p.out_stride_t = p.q_stride_t, p.out_stride_h = D;
  p.k_stride_block = int64_t(page) * Hkv * D, p.k_stride_token = Hkv * D, p.k_stride_head = D;
  p.v_stride_block = p.k_stride_block, p.v_stride_token = p.k_stride_token, p.v_stride_head = D;
  p.bt_stride_b = pages_per_req;
  p.batch = B, p.num_tree = T, p.num_q_heads = Hq, p.num_kv_heads = Hkv, p.group = G, p.head_dim = D;
  p.block_size = page, p.block_shift = 4, p.num_splits = 1, p.mask_words = 1, p.sm_scale = 0.0884f;
  p.dtype = DType::kBFloat16;
  p.cache_tokens = int64_t(num_blocks) * page;  // the TMA build's tensor maps span the whole cache
#if TLT_WS_PROBE == 3
  const int stamp_variant = argc > 4 ? std::atoi(argv[4]) : 0;  // the build the checkpoints stamp: 0 shipped, 4 TMA
  uint64_t* d_stamps;  // the checkpoints (32 slots per CTA), written through p.partial_lse (one split: never the scratch)
  CHECK(cudaMalloc(&d_stamps, size_t(B) * Hkv * 32 * 8));
  p.partial_lse = reinterpret_cast<float*>(d_stamps);
#endif
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const char* kernels[] = {"ws q-regs K3+V4", "ws q-regs K4+V3", "ws q-smem K3+V3", "ws q-regs K2+V2", "ws TMA K3+V4",
                           "lockstep"};
  constexpr int kLockstep = 5;
  for (int L : Ls) {
    std::vector<int32_t> ctx(B, L);
    CHECK(cudaMemcpy(d_ctx, ctx.data(), B * 4, cudaMemcpyHostToDevice));
    p.split_len = std::max(128, (L + 127) / 128 * 128);
    for (int kern = 0; kern < (TLT_WS_PROBE == 0 ? kLockstep + 1 : kLockstep); ++kern) {
      std::vector<float> us;
      for (int it = 0; it < 35; ++it) {
        CHECK(cudaEventRecord(e0));
        LaunchStatus st;
        if (kern < kLockstep)
          st = tree_sm90::launch_sm90_warp_specialized(p, dim3(1, Hkv, B), nullptr, kern);
        else {
          TreeAttentionParams p2 = p;
          p2.config = 128;
          st = launch_tree_attention_sm90(p2, nullptr);
        }
        if (!st.ok()) {
          std::fprintf(stderr, "launch: %s\n", st.message.c_str());
          return 1;
        }
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 5) us.push_back(ms * 1000.f);
      }
      std::sort(us.begin(), us.end());
      const double med = us[us.size() / 2];
      // Back to back, as an engine's step (or triton's do_bench) runs it: clocks under sustained load.
      const int reps = std::max(20, int(200000 / med));  // ~200 ms
      CHECK(cudaEventRecord(e0));
      for (int it = 0; it < reps; ++it) {
        TreeAttentionParams p2 = p;
        p2.config = 128;
        const LaunchStatus st = kern < kLockstep
                                    ? tree_sm90::launch_sm90_warp_specialized(p, dim3(1, Hkv, B), nullptr, kern)
                                    : launch_tree_attention_sm90(p2, nullptr);
        if (!st.ok()) return 1;
      }
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float total_ms = 0;
      CHECK(cudaEventElapsedTime(&total_ms, e0, e1));
      const double b2b = total_ms * 1000.0 / reps;
      const double bytes = double(B) * (L + T) * Hkv * D * 4;
      std::printf("{\"probe\": %d, \"kernel\": \"%s\", \"B\": %d, \"T\": %d, \"L\": %d, \"us\": %.2f, \"GBps\": %.0f, "
                  "\"us_back_to_back\": %.2f, \"GBps_back_to_back\": %.0f}\n",
                  TLT_WS_PROBE, kernels[kern], B, T, L, med, bytes / med * 1e-3, b2b, bytes / b2b * 1e-3);
    }
  }
#if TLT_WS_PROBE == 3
  // Checkpoints of one launch per L (after the timed ones): where a CTA's time goes, in microseconds (SM clocks
  // converted with the CTA's own %globaltimer span), medians over the CTAs, and when the CTAs start and end.
  const int ctas = B * Hkv;
  for (int L : Ls) {
    std::vector<int32_t> ctx(B, L);
    CHECK(cudaMemcpy(d_ctx, ctx.data(), B * 4, cudaMemcpyHostToDevice));
    TreeAttentionParams q = p;
    q.split_len = std::max(128, (L + 127) / 128 * 128);
    CHECK(cudaMemset(d_stamps, 0, size_t(ctas) * 32 * 8));
    for (int rep = 0; rep < 3; ++rep)
      if (!tree_sm90::launch_sm90_warp_specialized(q, dim3(1, Hkv, B), nullptr, stamp_variant).ok()) return 1;
    CHECK(cudaDeviceSynchronize());
    std::vector<uint64_t> st(size_t(ctas) * 32);
    CHECK(cudaMemcpy(st.data(), d_stamps, st.size() * 8, cudaMemcpyDeviceToHost));
    const char* names[] = {"init", "producer first K issued", "Q loaded", "first K landed", "loop", "epilogue",
                           "total", "producer done issuing"};
    std::vector<std::vector<double>> d(8);
    uint64_t g0 = ~0ull, g1 = 0;
    std::vector<double> starts, ends;
    for (int c = 0; c < ctas; ++c) {
      const uint64_t* x = &st[size_t(c) * 32];
      const double ns_per_clk = double(x[9] - x[8]) / double(x[6] - x[0]);
      auto us = [&](int a, int b2) { return double(int64_t(x[b2] - x[a])) * ns_per_clk * 1e-3; };
      d[0].push_back(us(0, 1));
      d[1].push_back(us(1, 2));
      d[2].push_back(us(1, 3));
      d[3].push_back(us(1, 4));
      d[4].push_back(us(4, 5));
      d[5].push_back(us(5, 6));
      d[6].push_back(us(0, 6));
      d[7].push_back(us(1, 7));
      g0 = std::min(g0, x[8]);
      g1 = std::max(g1, x[9]);
    }
    for (int c = 0; c < ctas; ++c) {
      starts.push_back((st[size_t(c) * 32 + 8] - g0) * 1e-3);
      ends.push_back((st[size_t(c) * 32 + 9] - g0) * 1e-3);
    }
    {  // inside steps 0 and 1 (warpgroup 0's thread 0), from the first K landing: turn taken, S_0 done, softmax done,
       // P V done; step 1's turn and its P V done
      std::vector<std::vector<double>> in(6);
      for (int c = 0; c < ctas; ++c) {
        const uint64_t* x = &st[size_t(c) * 32];
        const double ns_per_clk = double(x[9] - x[8]) / double(x[6] - x[0]);
        for (int k = 0; k < 6; ++k) in[k].push_back(double(int64_t(x[10 + k] - x[4])) * ns_per_clk * 1e-3);
      }
      std::printf("{\"probe\": 3, \"L\": %d, \"steps 0-1 from first K landed (median us)\": [", L);
      for (int k = 0; k < 6; ++k) {
        std::sort(in[k].begin(), in[k].end());
        std::printf("%s%.2f", k ? ", " : "", in[k][in[k].size() / 2]);
      }
      std::printf("]}\n");
    }
    {  // cycles per activity over the whole CTA (consumer: warpgroup 0's thread 0; producer: its thread 0), medians
      const char* acts[] = {"consumer waits for data", "consumer waits for its turn", "consumer waits for S",
                            "consumer mask + softmax", "consumer waits for P V", "producer waits for free slots",
                            "producer issues copies"};
      std::printf("{\"probe\": 3, \"L\": %d, \"per-CTA us by activity (median)\": {", L);
      for (int k = 0; k < 7; ++k) {
        std::vector<double> v;
        for (int c = 0; c < ctas; ++c) {
          const uint64_t* x = &st[size_t(c) * 32];
          v.push_back(double(x[16 + k]) * double(x[9] - x[8]) / double(x[6] - x[0]) * 1e-3);
        }
        std::sort(v.begin(), v.end());
        std::printf("%s\"%s\": %.2f", k ? ", " : "", acts[k], v[v.size() / 2]);
      }
      std::printf("}}\n");
    }
    std::printf("{\"probe\": 3, \"variant\": %d, \"L\": %d, \"span_us\": %.2f", stamp_variant, L, (g1 - g0) * 1e-3);
    for (int k = 0; k < 8; ++k) {
      std::sort(d[k].begin(), d[k].end());
      std::printf(", \"%s\": [%.2f, %.2f, %.2f]", names[k], d[k][0], d[k][d[k].size() / 2], d[k].back());
    }
    std::sort(starts.begin(), starts.end());
    std::sort(ends.begin(), ends.end());
    std::printf(", \"start quantiles\": [%.2f, %.2f, %.2f, %.2f, %.2f]", starts[0], starts[ctas / 4], starts[ctas / 2],
                starts[3 * ctas / 4], starts.back());
    std::printf(", \"end quantiles\": [%.2f, %.2f, %.2f, %.2f, %.2f]}\n", ends[0], ends[ctas / 4], ends[ctas / 2],
                ends[3 * ctas / 4], ends.back());
  }
#endif
  return 0;
}
