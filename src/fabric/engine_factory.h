// Internal: a TransferEngine over NICs the caller builds. TransferEngine::create
// uses it for libfabric domains and ibverbs devices; the verbs engine tests
// use it to run the real engine over verbs NICs on the fake device layer
// (tests/fabric/verbs/fake_verbs.h). Not public API.
#pragma once

#include <functional>
#include <memory>

#include "fabric/transport.h"
#include "moelink/transfer_engine.h"

namespace moelink::fabric {

// Builds the NIC of domain `index` (0 .. options.num_domains - 1).
using NicFactory = std::function<std::unique_ptr<Nic>(int index)>;

// Checks the options (InvalidArgument), builds the NICs in order, then the
// engine and its workers.
std::unique_ptr<TransferEngine> create_engine_on(const EngineOptions& options,
                                                 const NicFactory& make_nic);

}  // namespace moelink::fabric
