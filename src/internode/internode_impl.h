// Constructors of the two inter-node backends (internode_all_to_all.cc picks).
#pragma once

#include <memory>

#include "core/all_to_all_impl.h"

namespace moelink::detail::internode {

std::unique_ptr<AllToAllImpl> make_internode_cpu_impl(const Config& c, const ResolvedOptions& o,
                                                      Bootstrap& bootstrap);
// Throws InvalidArgument in builds without CUDA.
std::unique_ptr<AllToAllImpl> make_internode_gpu_impl(const Config& c, const ResolvedOptions& o,
                                                      Bootstrap& bootstrap);

}  // namespace moelink::detail::internode
