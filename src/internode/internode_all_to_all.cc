// In progress.
#include "core/all_to_all_impl.h"
#include "moelink/errors.h"

namespace moelink::detail {

std::unique_ptr<AllToAllImpl> make_internode_impl(const Config&, const ResolvedOptions&,
                                                  Bootstrap&) {
  throw InvalidArgument("moelink: backend \"internode\" is not built yet");
}

}  // namespace moelink::detail
