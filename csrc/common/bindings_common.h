// Helpers shared by the pybind11 translation units (host compiler only).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/launch_status.h"

namespace tlt {
namespace bindings {

// Device pointers arrive from Python as ints (tensor.data_ptr()).
template <typename P>
inline P as_ptr(uintptr_t v) {
  return reinterpret_cast<P>(v);
}

// Launcher statuses become Python exceptions here, in host-compiler code: std::invalid_argument ->
// ValueError, tlt::CudaError (a std::runtime_error) -> RuntimeError (launch_status.h says why the
// launchers return a status instead of throwing).
inline void raise_if_failed(const LaunchStatus& st) {
  switch (st.code) {
    case LaunchStatus::kOk: return;
    case LaunchStatus::kInvalidArgument: throw std::invalid_argument(st.message);
    case LaunchStatus::kCudaError: throw CudaError(st.message);
  }
  throw std::runtime_error("unknown launch status " + std::to_string(static_cast<int>(st.code)) + ": " + st.message);
}

}  // namespace bindings
}  // namespace tlt
