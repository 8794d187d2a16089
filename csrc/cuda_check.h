// Error checking for CUDA runtime calls and kernel launches. Torch-free.
//
// TLT_CUDA_CHECK(expr) throws tlt::CudaError (a std::runtime_error, which pybind11 turns into a
// Python RuntimeError) carrying the file, line, failing expression and CUDA's message.
// TLT_CHECK_LAUNCH() follows every <<<...>>> launch: launch-configuration errors surface through
// cudaGetLastError(), not through a return value.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace tlt {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  std::ostringstream msg;
  msg << "CUDA error " << cudaGetErrorName(err) << " (" << static_cast<int>(err) << "): " << cudaGetErrorString(err)
      << "\n  in " << expr << "\n  at " << file << ":" << line;
  throw CudaError(msg.str());
}

[[noreturn]] inline void throw_invalid(const std::string& what, const char* file, int line) {
  std::ostringstream msg;
  msg << what << " (at " << file << ":" << line << ")";
  throw std::invalid_argument(msg.str());
}

}  // namespace tlt

#define TLT_CUDA_CHECK(expr)                                                  \
  do {                                                                        \
    cudaError_t tlt_err_ = (expr);                                            \
    if (tlt_err_ != cudaSuccess) {                                            \
      ::tlt::throw_cuda_error(tlt_err_, #expr, __FILE__, __LINE__);           \
    }                                                                         \
  } while (0)

#define TLT_CHECK_LAUNCH() TLT_CUDA_CHECK(cudaGetLastError())

// Argument checks in launchers; std::invalid_argument becomes a Python ValueError.
#define TLT_CHECK_ARG(cond, msg)                                              \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::ostringstream tlt_msg_;                                            \
      tlt_msg_ << msg;                                                        \
      ::tlt::throw_invalid(tlt_msg_.str(), __FILE__, __LINE__);               \
    }                                                                         \
  } while (0)
