// pybind11 entry point of verify_tree. Torch-free: device pointers and the cudaStream_t arrive as Python ints, strides
// in elements. The Python glue (tlt_kernels/_cuda/verify_tree.py) checks shapes and dtypes; the launcher re-checks
// what the kernel relies on and returns a status, raised here.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/bindings_common.h"
#include "verify_tree/verify_tree.h"

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
                       int logits_dtype, int q_dtype, uintptr_t stream, int cluster_size, bool topp_compact,
                       uintptr_t scores, uintptr_t row_stats, int scratch_rows, int rows_cluster) {
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
  p.scores = as_ptr<float*>(scores);
  p.row_stats = as_ptr<float*>(row_stats);
  p.scratch_rows = scratch_rows;
  p.rows_cluster = rows_cluster;
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

}  // namespace

void register_verify_tree(py::module_& m) {
  m.attr("ELEM_FLOAT32") = static_cast<int>(tlt::ElemType::kFloat32);
  m.attr("ELEM_FLOAT16") = static_cast<int>(tlt::ElemType::kFloat16);
  m.attr("ELEM_BFLOAT16") = static_cast<int>(tlt::ElemType::kBFloat16);
  m.attr("VERIFY_MAX_DEPTH") = tlt::kVerifyMaxDepthSmem;
  m.attr("VERIFY_ROW_WORDS") = tlt::kVerifyRowWords;
  m.def("verify_tree", &verify_tree_entry, py::arg("logits"), py::arg("draft_probs"), py::arg("draft_tokens"),
        py::arg("parents"), py::arg("num_nodes"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("offset"), py::arg("scratch"), py::arg("out_tokens"), py::arg("out_num"),
        py::arg("out_nodes"), py::arg("out_error"), py::arg("out_stats"), py::arg("logits_stride_b"),
        py::arg("logits_stride_t"), py::arg("q_stride_b"), py::arg("q_stride_t"), py::arg("tokens_stride_b"),
        py::arg("parents_stride_b"), py::arg("batch"), py::arg("num_tree"), py::arg("vocab"), py::arg("max_depth"),
        py::arg("tokens_int64"), py::arg("logits_dtype"), py::arg("q_dtype"), py::arg("stream"),
        py::arg("cluster_size") = 0, py::arg("topp_compact") = false, py::arg("scores") = 0,
        py::arg("row_stats") = 0, py::arg("scratch_rows") = 2, py::arg("rows_cluster") = 0,
        "Fused tree verification, one CTA cluster per request (0 = null for draft_probs / temperature / top_k / "
        "top_p / out_stats / scores / row_stats). scratch is float32 [B, scratch_rows, V] (scratch_rows >= 2; >= T with "
        "row_stats). row_stats: float32 [B, T, VERIFY_ROW_WORDS], set = parallel rows (every node's row statistics "
        "computed at once by a first kernel, then the walk); rows_cluster: its CTAs per row (0 = auto, like cluster_size). scores: float32 [B, max_depth + 1, 2], the "
        "emitted tokens' (sampled, raw) log-probs written by the walk (0 past num_accepted and on flagged requests). cluster_size: CTAs per request, 0 = auto (from B, V "
        "and the SM count), else 1, 2, 4, 8 or 16 (> 1 needs sm_90; 16 a non-portable cluster size). topp_compact: "
        "select the top-p threshold among compacted candidates (the full-row threshold up to float ties). dtype codes: ELEM_FLOAT32 / "
        "ELEM_FLOAT16 / ELEM_BFLOAT16.");
}
