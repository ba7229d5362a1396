// Errors of the TransferEngine (include/moelink/transfer_engine.h). Every
// message names the operation and, where there is one, the peer.
#pragma once

#include "moelink/errors.h"

namespace moelink {

// A libfabric call failed: a provider error, a completion with an error (the
// peer closed its endpoint or vanished), a failed memory registration; or an
// operation to a peer known unreachable since an earlier failure.
class FabricError : public SystemError {
 public:
  using SystemError::SystemError;
};

// The requested libfabric provider (efa, shm, tcp) is not available on this
// machine, or lacks what the engine needs (RDM endpoints, FI_MSG | FI_RMA,
// 4 bytes of remote CQ data).
class ProviderUnavailable : public FabricError {
 public:
  using FabricError::FabricError;
};

}  // namespace moelink
