// Stands in for the NVSHMEM backend in builds without NVSHMEM, so that asking
// for it fails with an explanation instead of a link error.
#include "core/all_to_all_impl.h"
#include "moelink/errors.h"

namespace moelink::detail {

std::unique_ptr<AllToAllImpl> make_nvshmem_impl(const Config&, const ResolvedOptions&,
                                                Bootstrap&) {
  throw InvalidArgument(
      "moelink: this build has no NVSHMEM: backend \"nvshmem\" is unavailable (configure with "
      "CUDA and NVSHMEM_HOME, or pip install nvidia-nvshmem-cu13); use \"nvlink\"");
}

}  // namespace moelink::detail
