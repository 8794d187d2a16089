// pybind11 entry point of build_draft_tree. Torch-free: device pointers and the cudaStream_t arrive as Python ints,
// strides in elements. The Python glue (tlt_kernels/_cuda/build_draft_tree.py) checks shapes and dtypes; the launcher
// re-checks what the kernel relies on and returns a status, raised here.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/bindings_common.h"
#include "build_draft_tree/build_draft_tree.h"

namespace py = pybind11;

namespace {

using tlt::bindings::as_ptr;
using tlt::bindings::raise_if_failed;

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

void register_build_draft_tree(py::module_& m) {
  m.attr("BUILD_TREE_MAX_CANDIDATES") = tlt::kBuildTreeMaxCandidates;
  m.def("build_draft_tree", &build_draft_tree_entry, py::arg("cand_parents"), py::arg("cand_tokens"),
        py::arg("cand_scores"), py::arg("root_tokens"), py::arg("parents"), py::arg("draft_tokens"),
        py::arg("cand_index"), py::arg("num_nodes"), py::arg("tree_mask"), py::arg("cp_stride_b"),
        py::arg("ct_stride_b"), py::arg("cs_stride_b"), py::arg("batch"), py::arg("num_cand"), py::arg("num_verify"),
        py::arg("stream"), "Greedy frontier draft-tree selection + packed ancestor mask (tree_mask 0 = skip).");
}
