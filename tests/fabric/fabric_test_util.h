// Helpers for the TransferEngine tests: provider probing in a forked child
// (the test process itself never initializes libfabric), and exchanging
// variable-size blobs (addresses, descriptors) through the Bootstrap.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moelink/bootstrap.h"
#include "moelink/transfer_engine.h"

namespace moelink_test {

// Whether `provider` is usable, asked in a forked child. Cached.
bool fabric_provider_available(const std::string& provider);

// An engine named "rank<r>" with test-friendly options.
std::unique_ptr<moelink::fabric::TransferEngine> make_engine(const std::string& provider, int rank,
                                                             int num_domains = 1,
                                                             double timeout_s = 30.0);

// Exchanges every rank's descriptor of `region`; result indexed by rank.
std::vector<moelink::fabric::MemoryDescriptor> exchange_descriptors(
    moelink::Bootstrap& b, moelink::fabric::TransferEngine& e,
    const moelink::fabric::MemoryRegion& region);

}  // namespace moelink_test
