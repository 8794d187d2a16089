// verify_tree launchers for float logits (see verify_tree_launch.cuh: one translation unit per logits dtype and
// scoring; the scored kernels are in verify_tree_f32_scored.cu).
#define TLT_DEFINE_VERIFY_LAUNCHERS
#include "verify_tree/verify_tree_launch.cuh"

namespace tlt {
namespace detail {
template LaunchStatus dispatch_verify_q<float, false>(const VerifyTreeParams& p, cudaStream_t stream);
}  // namespace detail
}  // namespace tlt
