// pybind11 entry point of compact_kv. Torch-free: device pointers and the cudaStream_t arrive as Python ints, strides
// in elements. The Python glue (tlt_kernels/_cuda/compact_kv.py) checks shapes and dtypes; the launcher re-checks
// what the kernel relies on and returns a status, raised here.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/bindings_common.h"
#include "compact_kv/compact_kv.h"

namespace py = pybind11;

namespace {

using tlt::bindings::as_ptr;
using tlt::bindings::raise_if_failed;

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

}  // namespace

void register_compact_kv(py::module_& m) {
  m.def("compact_kv", &compact_kv_entry, py::arg("cache_ptrs"), py::arg("block_table"), py::arg("context_lens"),
        py::arg("accepted_nodes"), py::arg("num_accepted"), py::arg("bt_stride_b"), py::arg("nodes_stride_b"),
        py::arg("row_bytes"), py::arg("num_caches"), py::arg("batch"), py::arg("path_len"), py::arg("block_size"),
        py::arg("unit"), py::arg("stream"),
        "In-place KV compaction of every cache listed in cache_ptrs (uint64 device array), one launch.");
}
