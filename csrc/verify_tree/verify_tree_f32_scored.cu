// verify_tree launchers for float logits that also write log-probs (p.scores; see verify_tree_launch.cuh: one
// translation unit per logits dtype and scoring).
#define TLT_DEFINE_VERIFY_LAUNCHERS
#include "verify_tree/verify_tree_launch.cuh"

namespace tlt {
namespace detail {
template LaunchStatus dispatch_verify_q<float, true>(const VerifyTreeParams& p, cudaStream_t stream);
}  // namespace detail
}  // namespace tlt
