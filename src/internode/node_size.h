// How many consecutive ranks form one node for the inter-node backends
// (Options.node_size): node peers exchange bytes directly, the others
// through the NIC (protocol.h).
#pragma once

#include "moelink/bootstrap.h"
#include "moelink/config.h"

namespace moelink::detail::internode {

// Collective over `bootstrap`. `requested` > 0 must divide world_size; 0
// counts the ranks that share this rank's host name, when those form equal
// consecutive blocks (else 1). Every rank must arrive at the same value.
// Throws InvalidArgument naming the field, the value and the rule.
int resolve_node_size(const Config& c, int requested, Bootstrap& bootstrap);

}  // namespace moelink::detail::internode
