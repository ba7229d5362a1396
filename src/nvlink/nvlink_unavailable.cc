// Stands in for the NVLink backend in builds without CUDA, so that asking for
// it fails with an explanation instead of a link error.
#include "core/all_to_all_impl.h"
#include "moelink/errors.h"

namespace moelink::detail {

std::unique_ptr<AllToAllImpl> make_nvlink_impl(const Config&, const ResolvedOptions&, Bootstrap&) {
  throw InvalidArgument(
      "moelink: this build has no CUDA (MOELINK_WITH_CUDA=OFF): backend \"nvlink\" is "
      "unavailable; use \"cpu\"");
}

}  // namespace moelink::detail
