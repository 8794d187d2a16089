// The pybind11 module tlt_kernels._C: module-wide entry points (build_info, device queries, the shared RNG and
// error path) and one register_<op> call per op folder. Torch-free: tensors arrive as raw device pointers (Python
// ints from tensor.data_ptr()), strides in elements, and the stream as an int
// (torch.cuda.current_stream().cuda_stream). The Python glue in tlt_kernels/_cuda validates shapes.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/bindings_common.h"
#include "common/philox.h"

namespace py = pybind11;

// One per op folder: csrc/<op>/bindings_<op>.cpp.
void register_tree_attention(py::module_& m);
void register_verify_tree(py::module_& m);
void register_compact_kv(py::module_& m);
void register_build_draft_tree(py::module_& m);

namespace {

py::dict build_info() {
  py::dict info;
  info["archs"] = std::string(TLT_CUDA_ARCHS_STR);
  info["nvcc_version"] = std::string(TLT_NVCC_VERSION_STR);
  info["cuda_runtime_compiled"] = CUDART_VERSION;
  int rt = 0;
  // Needs no GPU or driver: reports the statically linked runtime.
  info["cuda_runtime_version"] = cudaRuntimeGetVersion(&rt) == cudaSuccess ? rt : -1;
  int drv = 0;
  info["cuda_driver_version"] = cudaDriverGetVersion(&drv) == cudaSuccess ? drv : 0;  // 0: no driver
  info["head_dims"] = py::make_tuple(64, 128, 256);
  info["dtypes"] = py::make_tuple("float16", "bfloat16");
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tlt-kernels CUDA kernels (torch-free; raw device pointers as ints, strides in elements)";
  m.def("build_info", &build_info,
        "dict: archs (str), nvcc_version (str), cuda_runtime_compiled / cuda_runtime_version (int, e.g. 13000), "
        "cuda_driver_version (int, 0 without a driver), head_dims, dtypes");
  m.def(
      "device_memory_bandwidth_gbps",
      [](int device) {
        int clock_khz = 0, bus_bits = 0;
        TLT_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
        TLT_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
        return 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9;  // double data rate: two transfers per clock
      },
      py::arg("device"),
      "float: the device's peak memory bandwidth in GB/s from the driver's memory clock and bus width (2 x clock x "
      "width / 8); raises RuntimeError without a driver or device.");
  m.def(
      "_cuda_check_selftest", [](int code) { TLT_CUDA_CHECK(static_cast<cudaError_t>(code)); },
      "Raise what TLT_CUDA_CHECK raises for the given cudaError_t code (tests the error path; needs no GPU).");
  m.def(
      "philox_uniform_host",
      [](int64_t seed, int64_t offset, uint32_t node, uint32_t purpose) {
        return tlt::philox_uniform(seed, offset, node, purpose);
      },
      py::arg("seed"), py::arg("offset"), py::arg("node"), py::arg("purpose"),
      "The kernels' Philox4x32-10 uniform (same __host__ __device__ code), evaluated on the host; needs no GPU.");
  register_tree_attention(m);
  register_verify_tree(m);
  register_compact_kv(m);
  register_build_draft_tree(m);
}
