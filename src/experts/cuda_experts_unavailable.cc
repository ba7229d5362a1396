// A build without the CUDA expert kernels (no CUDA, or CUTLASS not found):
// ExpertDevice::kCUDA says why; kCPU works.
#include "experts/experts_impl.h"
#include "moelink/errors.h"

namespace moelink::detail {

std::unique_ptr<ExpertsImpl> make_cuda_experts(const ExpertConfig&) {
#if defined(MOELINK_WITH_CUDA)
  throw InvalidArgument(
      "moelink: Experts: device = cuda is not in this build: CUTLASS was not found when it was "
      "configured (pip install nvidia-cutlass, or set MOELINK_CUTLASS_DIR); device = cpu works");
#else
  throw InvalidArgument(
      "moelink: Experts: device = cuda is not in this build (built without CUDA); device = cpu "
      "works");
#endif
}

}  // namespace moelink::detail
