// pybind11 entry points of the acceptance kernels (verify_tree, compact_kv, build_draft_tree).
// Torch-free like bindings.cpp: device pointers and the cudaStream_t arrive as Python ints, strides in
// elements. The Python glue (tlt_kernels/_cuda/{verify_tree,compact_kv,build_draft_tree}.py) checks
// shapes and dtypes; the launchers re-check what the kernels rely on and return a status, raised here.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "acceptance.cuh"
#include "bindings_common.h"

namespace py = pybind11;

namespace {

using tlt::bindings::as_ptr;
using tlt::bindings::raise_if_failed;

void verify_tree_entry(uintptr_t logits, uintptr_t draft_probs, uintptr_t draft_tokens, uintptr_t parents,
                       uintptr_t num_nodes, uintptr_t temperature, uintptr_t top_k, uintptr_t top_p, uintptr_t seed,
                       uintptr_t offset, uintptr_t scratch, uintptr_t out_tokens, uintptr_t out_num,
                       uintptr_t out_nodes, uintptr_t out_error, uintptr_t out_stats, int64_t logits_stride_b,
                       int64_t logits_stride_t, int64_t q_stride_b, int64_t q_stride_t, int64_t tokens_stride_b,
                       int64_t parents_stride_b, int batch, int num_tree, int vocab, int max_depth, bool tokens_int64,
                       int logits_dtype, int q_dtype, uintptr_t stream, int cluster_size, bool topp_compact) {
  tlt::VerifyTreeParams p;
  p.logits = as_ptr<const void*>(logits);
  p.draft_probs = as_ptr<const void*>(draft_probs);
  p.draft_tokens = as_ptr<const void*>(draft_tokens);
  p.parents = as_ptr<const int32_t*>(parents);
  p.num_nodes = as_ptr<const int32_t*>(num_nodes);
  p.temperature = as_ptr<const float*>(temperature);
  p.top_k = as_ptr<const int32_t*>(top_k);
  p.top_p = as_ptr<const float*>(top_p);
  p.seed = as_ptr<const int64_t*>(seed);
  p.offset = as_ptr<const int64_t*>(offset);
  p.scratch = as_ptr<float*>(scratch);
  p.out_tokens = as_ptr<int32_t*>(out_tokens);
  p.out_num = as_ptr<int32_t*>(out_num);
  p.out_nodes = as_ptr<int32_t*>(out_nodes);
  p.out_error = as_ptr<int32_t*>(out_error);
  p.out_stats = as_ptr<int32_t*>(out_stats);
  p.logits_stride_b = logits_stride_b;
  p.logits_stride_t = logits_stride_t;
  p.q_stride_b = q_stride_b;
  p.q_stride_t = q_stride_t;
  p.tokens_stride_b = tokens_stride_b;
  p.parents_stride_b = parents_stride_b;
  p.batch = batch;
  p.num_tree = num_tree;
  p.vocab = vocab;
  p.max_depth = max_depth;
  p.tokens_int64 = tokens_int64;
  p.logits_type = static_cast<tlt::ElemType>(logits_dtype);
  p.q_type = static_cast<tlt::ElemType>(q_dtype);
  p.cluster = cluster_size;
  p.topp_compact = topp_compact;
  raise_if_failed(tlt::launch_verify_tree(p, reinterpret_cast<cudaStream_t>(stream)));
}

void compact_kv_entry(uintptr_t cache_ptrs, uintptr_t block_table, uintptr_t context_lens, uintptr_t accepted_nodes,
                      uintptr_t num_accepted, int64_t bt_stride_b, int64_t nodes_stride_b, int64_t row_bytes,
                      int num_caches, int batch, int path_len, int block_size, int unit, uintptr_t stream) {
  tlt::CompactKVParams p;
  p.cache_ptrs = as_ptr<const uint64_t*>(cache_ptrs);
  p.block_table = as_ptr<const int32_t*>(block_table);
  p.context_lens = as_ptr<const int32_t*>(context_lens);
  p.accepted_nodes = as_ptr<const int32_t*>(accepted_nodes);
  p.num_accepted = as_ptr<const int32_t*>(num_accepted);
  p.bt_stride_b = bt_stride_b;
  p.nodes_stride_b = nodes_stride_b;
  p.row_bytes = row_bytes;
  p.num_caches = num_caches;
  p.batch = batch;
  p.path_len = path_len;
  p.block_size = block_size;
  p.unit = unit;
  raise_if_failed(tlt::launch_compact_kv(p, reinterpret_cast<cudaStream_t>(stream)));
}

void build_draft_tree_entry(uintptr_t cand_parents, uintptr_t cand_tokens, uintptr_t cand_scores,
                            uintptr_t root_tokens, uintptr_t parents, uintptr_t draft_tokens, uintptr_t cand_index,
                            uintptr_t num_nodes, uintptr_t tree_mask, int64_t cp_stride_b, int64_t ct_stride_b,
                            int64_t cs_stride_b, int batch, int num_cand, int num_verify, uintptr_t stream) {
  tlt::BuildDraftTreeParams p;
  p.cand_parents = as_ptr<const int32_t*>(cand_parents);
  p.cand_tokens = as_ptr<const int64_t*>(cand_tokens);
  p.cand_scores = as_ptr<const float*>(cand_scores);
  p.root_tokens = as_ptr<const int64_t*>(root_tokens);
  p.parents = as_ptr<int32_t*>(parents);
  p.draft_tokens = as_ptr<int64_t*>(draft_tokens);
  p.cand_index = as_ptr<int32_t*>(cand_index);
  p.num_nodes = as_ptr<int32_t*>(num_nodes);
  p.tree_mask = as_ptr<int32_t*>(tree_mask);
  p.cp_stride_b = cp_stride_b;
  p.ct_stride_b = ct_stride_b;
  p.cs_stride_b = cs_stride_b;
  p.batch = batch;
  p.num_cand = num_cand;
  p.num_verify = num_verify;
  raise_if_failed(tlt::launch_build_draft_tree(p, reinterpret_cast<cudaStream_t>(stream)));
}

}  // namespace

void register_acceptance(py::module_& m) {
  m.attr("ELEM_FLOAT32") = static_cast<int>(tlt::ElemType::kFloat32);
  m.attr("ELEM_FLOAT16") = static_cast<int>(tlt::ElemType::kFloat16);
  m.attr("ELEM_BFLOAT16") = static_cast<int>(tlt::ElemType::kBFloat16);
  m.attr("BUILD_TREE_MAX_CANDIDATES") = tlt::kBuildTreeMaxCandidates;
  m.attr("VERIFY_MAX_DEPTH") = tlt::kVerifyMaxDepthSmem;
  m.def(
      "philox_uniform_host",
      [](int64_t seed, int64_t offset, uint32_t node, uint32_t purpose) {
        return tlt::philox_uniform(seed, offset, node, purpose);
      },
      py::arg("seed"), py::arg("offset"), py::arg("node"), py::arg("purpose"),
      "The kernels' Philox4x32-10 uniform (same __host__ __device__ code), evaluated on the host; needs no GPU.");
  m.def("verify_tree", &verify_tree_entry, py::arg("logits"), py::arg("draft_probs"), py::arg("draft_tokens"),
        py::arg("parents"), py::arg("num_nodes"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("offset"), py::arg("scratch"), py::arg("out_tokens"), py::arg("out_num"),
        py::arg("out_nodes"), py::arg("out_error"), py::arg("out_stats"), py::arg("logits_stride_b"),
        py::arg("logits_stride_t"), py::arg("q_stride_b"), py::arg("q_stride_t"), py::arg("tokens_stride_b"),
        py::arg("parents_stride_b"), py::arg("batch"), py::arg("num_tree"), py::arg("vocab"), py::arg("max_depth"),
        py::arg("tokens_int64"), py::arg("logits_dtype"), py::arg("q_dtype"), py::arg("stream"),
        py::arg("cluster_size") = 0, py::arg("topp_compact") = false,
        "Fused tree verification, one CTA cluster per request (0 = null for draft_probs / temperature / top_k / "
        "top_p / out_stats). scratch is float32 [B, 2, V]. cluster_size: CTAs per request, 0 = auto (from B, V "
        "and the SM count), else 1, 2, 4, 8 or 16 (> 1 needs sm_90; 16 a non-portable cluster size). topp_compact: "
        "select the top-p threshold among compacted candidates (the full-row threshold up to float ties). dtype codes: ELEM_FLOAT32 / "
        "ELEM_FLOAT16 / ELEM_BFLOAT16.");
  m.def("compact_kv", &compact_kv_entry, py::arg("cache_ptrs"), py::arg("block_table"), py::arg("context_lens"),
        py::arg("accepted_nodes"), py::arg("num_accepted"), py::arg("bt_stride_b"), py::arg("nodes_stride_b"),
        py::arg("row_bytes"), py::arg("num_caches"), py::arg("batch"), py::arg("path_len"), py::arg("block_size"),
        py::arg("unit"), py::arg("stream"),
        "In-place KV compaction of every cache listed in cache_ptrs (uint64 device array), one launch.");
  m.def("build_draft_tree", &build_draft_tree_entry, py::arg("cand_parents"), py::arg("cand_tokens"),
        py::arg("cand_scores"), py::arg("root_tokens"), py::arg("parents"), py::arg("draft_tokens"),
        py::arg("cand_index"), py::arg("num_nodes"), py::arg("tree_mask"), py::arg("cp_stride_b"),
        py::arg("ct_stride_b"), py::arg("cs_stride_b"), py::arg("batch"), py::arg("num_cand"), py::arg("num_verify"),
        py::arg("stream"), "Greedy frontier draft-tree selection + packed ancestor mask (tree_mask 0 = skip).");
}
