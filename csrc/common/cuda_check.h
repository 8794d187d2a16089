// Error checking for CUDA runtime calls and kernel launches. Torch-free.
//
// TLT_CUDA_CHECK(expr) throws tlt::CudaError (a std::runtime_error, which pybind11 turns into a
// Python RuntimeError) carrying the file, line, failing expression and CUDA's message.
// TLT_CHECK_LAUNCH() follows every <<<...>>> launch: launch-configuration errors surface through
// cudaGetLastError(), not through a return value.
//
// Messages are built with tlt::Message (std::string + snprintf), not an iostream string stream: on
// the GPU machine (GCC 13.3 build, Python 3.12 venv with torch loaded) every error path that built
// one inside the extension crashed the process with SIGSEGV, while raising the same exception types
// with plain std::string messages worked. Keeping iostreams / locales out of the module avoids that
// runtime-library mismatch altogether.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tlt {

// Minimal `<<` string builder (no iostreams): strings, characters, integers, floating point, enums.
class Message {
 public:
  Message& operator<<(const char* s) { text_ += s ? s : "(null)"; return *this; }
  Message& operator<<(const std::string& s) { text_ += s; return *this; }
  Message& operator<<(char c) { text_ += c; return *this; }
  Message& operator<<(bool b) { text_ += b ? "true" : "false"; return *this; }
  template <typename T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0>
  Message& operator<<(T v) { text_ += std::to_string(v); return *this; }
  template <typename T, typename std::enable_if<std::is_floating_point<T>::value, int>::type = 0>
  Message& operator<<(T v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    text_ += buf;
    return *this;
  }
  template <typename E, typename std::enable_if<std::is_enum<E>::value, int>::type = 0>
  Message& operator<<(E v) { return *this << static_cast<typename std::underlying_type<E>::type>(v); }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  Message msg;
  msg << "CUDA error " << cudaGetErrorName(err) << " (" << static_cast<int>(err) << "): " << cudaGetErrorString(err)
      << "\n  in " << expr << "\n  at " << file << ":" << line;
  throw CudaError(msg.str());
}

[[noreturn]] inline void throw_invalid(const std::string& what, const char* file, int line) {
  Message msg;
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
      ::tlt::Message tlt_msg_;                                                \
      tlt_msg_ << msg;                                                        \
      ::tlt::throw_invalid(tlt_msg_.str(), __FILE__, __LINE__);               \
    }                                                                         \
  } while (0)
