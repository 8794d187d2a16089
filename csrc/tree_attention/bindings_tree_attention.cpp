// pybind11 entry points of tree attention (tree_attention_partial / _merge / _sm90) and of the sm_90 wgmma
// self-test. Torch-free: tensors arrive as raw device pointers (Python ints from tensor.data_ptr()), strides in
// elements, and the stream as an int (torch.cuda.current_stream().cuda_stream). The Python glue in
// tlt_kernels/_cuda/tree_attention.py validates shapes; the launchers re-check and return a status, raised here.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/bindings_common.h"
#include "tree_attention/tree_attention.h"
#include "tree_attention/wgmma_selftest.h"

namespace py = pybind11;

namespace {

using tlt::bindings::as_ptr;
using tlt::bindings::raise_if_failed;

tlt::TreeAttentionParams make_params(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_table,
                                     uintptr_t context_lens, uintptr_t num_nodes, uintptr_t tree_mask,
                                     uintptr_t partial_out, uintptr_t partial_lse, uintptr_t out,
                                     const py::tuple& q_strides, const py::tuple& k_strides,
                                     const py::tuple& v_strides, const py::tuple& out_strides, int64_t bt_stride_b,
                                     int batch, int num_tree, int num_q_heads, int num_kv_heads, int head_dim,
                                     int block_size, int num_splits, int split_len, float sm_scale, int dtype,
                                     int config) {
  auto strides3 = [](const py::tuple& t, const char* name, int64_t& a, int64_t& b, int64_t& c) {
    if (t.size() != 3) throw std::invalid_argument(std::string(name) + " must be a 3-tuple of element strides");
    a = t[0].cast<int64_t>();
    b = t[1].cast<int64_t>();
    c = t[2].cast<int64_t>();
  };
  tlt::TreeAttentionParams p;
  p.q = as_ptr<const void*>(q);
  p.k_cache = as_ptr<const void*>(k_cache);
  p.v_cache = as_ptr<const void*>(v_cache);
  p.block_table = as_ptr<const int32_t*>(block_table);
  p.context_lens = as_ptr<const int32_t*>(context_lens);
  p.num_nodes = as_ptr<const int32_t*>(num_nodes);
  p.tree_mask = as_ptr<const int32_t*>(tree_mask);
  p.partial_out = as_ptr<float*>(partial_out);
  p.partial_lse = as_ptr<float*>(partial_lse);
  p.out = as_ptr<void*>(out);
  strides3(q_strides, "q_strides", p.q_stride_b, p.q_stride_t, p.q_stride_h);
  strides3(k_strides, "k_strides", p.k_stride_block, p.k_stride_token, p.k_stride_head);
  strides3(v_strides, "v_strides", p.v_stride_block, p.v_stride_token, p.v_stride_head);
  strides3(out_strides, "out_strides", p.out_stride_b, p.out_stride_t, p.out_stride_h);
  p.bt_stride_b = bt_stride_b;
  p.batch = batch;
  p.num_tree = num_tree;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.num_splits = num_splits;
  p.split_len = split_len;
  p.mask_words = (num_tree + 31) / 32;
  p.sm_scale = sm_scale;
  p.dtype = static_cast<tlt::DType>(dtype);
  p.config = config;
  return p;
}

#define TLT_TREE_ATTN_ARGS                                                                                 \
  py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("context_lens"),   \
      py::arg("num_nodes"), py::arg("tree_mask"), py::arg("partial_out"), py::arg("partial_lse"),          \
      py::arg("out"), py::arg("q_strides"), py::arg("k_strides"), py::arg("v_strides"),                    \
      py::arg("out_strides"), py::arg("bt_stride_b"), py::arg("batch"), py::arg("num_tree"),               \
      py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),         \
      py::arg("num_splits"), py::arg("split_len"), py::arg("sm_scale"), py::arg("dtype"), py::arg("stream"), \
      py::arg("config") = 0, py::arg("cache_tokens") = 0, py::arg("kv_fp8") = 0, py::arg("v_scale") = 1.0f

template <tlt::LaunchStatus (*Launch)(const tlt::TreeAttentionParams&, cudaStream_t) noexcept>
void tree_attention_entry(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_table,
                          uintptr_t context_lens, uintptr_t num_nodes, uintptr_t tree_mask, uintptr_t partial_out,
                          uintptr_t partial_lse, uintptr_t out, const py::tuple& q_strides, const py::tuple& k_strides,
                          const py::tuple& v_strides, const py::tuple& out_strides, int64_t bt_stride_b, int batch,
                          int num_tree, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                          int num_splits, int split_len, float sm_scale, int dtype, uintptr_t stream, int config,
                          int64_t cache_tokens, int kv_fp8, float v_scale) {
  tlt::TreeAttentionParams p =
      make_params(q, k_cache, v_cache, block_table, context_lens, num_nodes, tree_mask, partial_out, partial_lse, out,
                  q_strides, k_strides, v_strides, out_strides, bt_stride_b, batch, num_tree, num_q_heads,
                  num_kv_heads, head_dim, block_size, num_splits, split_len, sm_scale, dtype, config);
  p.cache_tokens = cache_tokens;  // token rows of the smaller cache (num_blocks * block_size): the TMA maps' extent
  p.kv_fp8 = static_cast<tlt::Fp8Format>(kv_fp8);  // the launchers check the code
  p.v_scale = v_scale;
  // Launches are asynchronous and cheap; keep the GIL (no Python work runs meanwhile anyway).
  raise_if_failed(Launch(p, reinterpret_cast<cudaStream_t>(stream)));
}

}  // namespace

void register_tree_attention(py::module_& m) {
  m.attr("DTYPE_FLOAT16") = static_cast<int>(tlt::DType::kFloat16);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(tlt::DType::kBFloat16);
  m.attr("KV_FP8_NONE") = static_cast<int>(tlt::Fp8Format::kNone);
  m.attr("KV_FP8_E4M3") = static_cast<int>(tlt::Fp8Format::kE4M3);
  m.attr("KV_FP8_E5M2") = static_cast<int>(tlt::Fp8Format::kE5M2);
  m.def("tree_attention_partial", &tree_attention_entry<tlt::launch_tree_attention_partial>, TLT_TREE_ATTN_ARGS,
        "Step 1 of tree attention: writes out [B,T,Hq,D] for requests with at most one non-empty context split, "
        "else partial_out float32 [B,Hkv,S+1,T*G,D] / partial_lse float32 [B,Hkv,S+1,T*G] at slots "
        "s < ceil(context_lens[b] / split_len) (the last includes the tree). dtype: DTYPE_FLOAT16 or "
        "DTYPE_BFLOAT16; config: 0 (per shape) or a tuning variant (csrc/tree_attention/tree_attention.cu); kv_fp8: "
        "KV_FP8_NONE (caches of q's dtype) or KV_FP8_E4M3 / KV_FP8_E5M2 (fp8 caches, configs 0 and 5); v_scale: the V "
        "cache's dequantization scale (each output row times it).");
  m.def("tree_attention_merge", &tree_attention_entry<tlt::launch_tree_attention_merge>, TLT_TREE_ATTN_ARGS,
        "Step 2 of tree attention: log-sum-exp merge of the used partial slots into out [B,T,Hq,D] for requests "
        "with two or more non-empty splits (zeros for rows t >= num_nodes[b]); launches nothing when num_splits == 1.");
  m.def("tree_attention_sm90", &tree_attention_entry<tlt::launch_tree_attention_sm90>, TLT_TREE_ATTN_ARGS,
        "Step 1 of tree attention on sm_90 wgmma (D=128, T <= 64; config 0/128: 128-token tiles, split_len % 128 "
        "== 0; 64: 64-token tiles; both T*G <= 128; 128|1024: warp-specialized, any T*G; |2048: TMA copies, with "
        "cache_tokens and pages of >= 16 tokens): the same outputs as tree_attention_partial (out, or the partial "
        "slots the merge combines when num_splits > 1).");
  m.def(
      "_wgmma_selftest",
      [](uintptr_t a, uintptr_t b, uintptr_t v, uintptr_t s_out, uintptr_t o_out, int dtype, uintptr_t stream) {
        tlt::WgmmaSelftestParams p;
        p.a = as_ptr<const void*>(a);
        p.b = as_ptr<const void*>(b);
        p.v = as_ptr<const void*>(v);
        p.s_out = as_ptr<float*>(s_out);
        p.o_out = as_ptr<float*>(o_out);
        p.dtype = dtype;
        raise_if_failed(tlt::launch_wgmma_selftest(p, reinterpret_cast<cudaStream_t>(stream)));
      },
      py::arg("a"), py::arg("b"), py::arg("v"), py::arg("s_out"), py::arg("o_out"), py::arg("dtype"), py::arg("stream"),
      "Self-test of the sm_90 wgmma building blocks (csrc/tree_attention/wgmma_sm90.cuh): s_out float32 [64,64] = A B^T and "
      "o_out float32 [64,128] = P V for A, B, V [64,128] row-major 16-bit (dtype DTYPE_FLOAT16 / DTYPE_BFLOAT16), "
      "P = s_out rounded to that type.");
}
