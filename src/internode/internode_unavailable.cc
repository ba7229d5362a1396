// Stands in for the inter-node backend in builds without libfabric, so that
// asking for it fails with an explanation instead of a link error.
#include "core/all_to_all_impl.h"
#include "moelink/errors.h"

namespace moelink::detail {

std::unique_ptr<AllToAllImpl> make_internode_impl(const Config&, const ResolvedOptions& o,
                                                  Bootstrap&) {
  throw InvalidArgument(std::string("moelink: this build has no libfabric (pkg-config libfabric "
                                    "found nothing): backend \"") +
                        backend_name(o.backend) + "\" is unavailable; use \"nvlink\" or \"cpu\"");
}

}  // namespace moelink::detail
