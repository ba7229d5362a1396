// TransferEngine::create for provider "ibverbs": one IbvDevice + VerbsNic per
// domain. Built into moelink_fabric only where libibverbs is found
// (MOELINK_WITH_VERBS). COMPILED ONLY: on a machine without RDMA the factory
// throws ProviderUnavailable, which is all that has ever run.
#pragma once

#include "fabric/engine_factory.h"
#include "fabric/verbs/verbs_nic.h"
#include "moelink/transfer_engine.h"

namespace moelink::fabric::verbs {

// The transport's options derived from the engine's (timeout, receives).
VerbsNicOptions nic_options(const EngineOptions& options);

// Opens options.verbs_devices (or every device, round robin) as the
// engine's domains. Throws ProviderUnavailable when there is no RDMA device
// (or not the named one), InvalidArgument for a bad port or GID index.
NicFactory ibv_nic_factory(const EngineOptions& options);

// Whether ibv_get_device_list finds any device.
bool ibv_devices_present();

}  // namespace moelink::fabric::verbs
