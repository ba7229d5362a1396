// Stands in for the GPU inter-node backend in builds without CUDA.
#include "internode/internode_impl.h"
#include "moelink/errors.h"

namespace moelink::detail::internode {

std::unique_ptr<AllToAllImpl> make_internode_gpu_impl(const Config&, const ResolvedOptions&,
                                                      Bootstrap&) {
  throw InvalidArgument(
      "moelink: this build has no CUDA (MOELINK_WITH_CUDA=OFF): backend \"internode\" is "
      "unavailable; use \"internode-cpu\" for host tensors");
}

}  // namespace moelink::detail::internode
