// The CUDA attention kernels (FlashInfer's MLA kernels behind AttentionOps)
// are not in this build yet: creating an MLAAttention on the GPU says so.
#include "attention/attention_ops.h"
#include "moelink/errors.h"

namespace moelink::detail::attention {

std::unique_ptr<AttentionOps> make_cuda_attention_ops() {
  throw InvalidArgument(
      "moelink: MLAAttention: MLAOptions.device = cuda is not built yet (the CPU path, "
      "device = cpu, implements the whole contract; the GPU kernels are issue 33's next step)");
}

}  // namespace moelink::detail::attention
