// Entry point of the inter-node backends: kInternodeCPU runs the protocol with
// CPU loops, kInternode with GPU kernels; both over the same Proxy.
#include "core/all_to_all_impl.h"
#include "internode/internode_impl.h"
#include "internode/node_size.h"
#include "moelink/errors.h"

namespace moelink::detail {

std::unique_ptr<AllToAllImpl> make_internode_impl(const Config& c, const ResolvedOptions& o,
                                                  Bootstrap& bootstrap) {
  ResolvedOptions r = o;
  r.node_size = internode::resolve_node_size(c, o.node_size, bootstrap);
  if (r.backend == Backend::kInternodeCPU)
    return internode::make_internode_cpu_impl(c, r, bootstrap);
  return internode::make_internode_gpu_impl(c, r, bootstrap);
}

}  // namespace moelink::detail
