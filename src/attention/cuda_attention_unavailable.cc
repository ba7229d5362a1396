// A build without CUDA (MOELINK_WITH_CUDA off) has no CUDA attention kernels:
// creating an MLAAttention on the GPU says so.
#include "attention/attention_ops.h"
#include "moelink/errors.h"

namespace moelink::detail::attention {

std::unique_ptr<AttentionOps> make_cuda_attention_ops(const MLAConfig&, int, const MLAOptions&) {
  throw InvalidArgument(
      "moelink: MLAAttention: MLAOptions.device = cuda needs a build with CUDA (this one has "
      "none); device = cpu runs the same contract on the host");
}

}  // namespace moelink::detail::attention
