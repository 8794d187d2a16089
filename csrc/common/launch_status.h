// Status-returning launch checks, shared by every launcher (torch-free).
//
// No C++ exception leaves an nvcc-compiled translation unit: launchers return a LaunchStatus and
// the pybind11 layer raises (ValueError for kInvalidArgument, RuntimeError for kCudaError), so the
// library is usable as a plain C++ API too. Messages are built with tlt::Message (cuda_check.h),
// never an iostream: std::ostringstream crashed the GPU machine's Python process (see cuda_check.h).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/cuda_check.h"

namespace tlt {

// Result of a launcher: ok() or a code and a message naming the argument (expected vs got) or the
// failing CUDA call.
struct LaunchStatus {
  enum Code : int { kOk = 0, kInvalidArgument = 1, kCudaError = 2 };
  Code code = kOk;
  std::string message;
  bool ok() const { return code == kOk; }
};

}  // namespace tlt

// Return kInvalidArgument with `msg` (a tlt::Message << chain) unless `cond` holds.
#define TLT_STATUS_CHECK_ARG(cond, msg)                                                    \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      ::tlt::Message tlt_msg_;                                                             \
      tlt_msg_ << msg << " (at " << __FILE__ << ":" << __LINE__ << ")";                    \
      return ::tlt::LaunchStatus{::tlt::LaunchStatus::kInvalidArgument, tlt_msg_.str()};  \
    }                                                                                      \
  } while (0)

// Return kCudaError naming the call unless `expr` returns cudaSuccess.
#define TLT_STATUS_CUDA_CHECK(expr)                                                                        \
  do {                                                                                                     \
    const cudaError_t tlt_err_ = (expr);                                                                   \
    if (tlt_err_ != cudaSuccess) {                                                                         \
      ::tlt::Message tlt_msg_;                                                                             \
      tlt_msg_ << "CUDA error " << cudaGetErrorName(tlt_err_) << " (" << static_cast<int>(tlt_err_)       \
               << "): " << cudaGetErrorString(tlt_err_) << "\n  in " #expr "\n  at " << __FILE__ << ":"   \
               << __LINE__;                                                                                \
      return ::tlt::LaunchStatus{::tlt::LaunchStatus::kCudaError, tlt_msg_.str()};                        \
    }                                                                                                      \
  } while (0)

// After every <<<...>>>: launch-configuration errors surface through cudaGetLastError().
#define TLT_STATUS_CHECK_LAUNCH() TLT_STATUS_CUDA_CHECK(cudaGetLastError())

#define TLT_RETURN_IF_FAILED(expr)          \
  do {                                      \
    ::tlt::LaunchStatus tlt_st_ = (expr);   \
    if (!tlt_st_.ok()) return tlt_st_;      \
  } while (0)
