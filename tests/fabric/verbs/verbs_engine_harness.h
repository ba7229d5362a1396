// Real TransferEngines over verbs NICs on fake devices, several in one
// process, all on one FakeFabric that executes their RC work requests while
// they poll (auto_progress). Built through the engine's internal factory
// (fabric/engine_factory.h), so everything above the Device layer is the
// production code: engine, workers, VerbsNic, handshake, UD channel.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fabric/verbs/verbs_nic.h"
#include "fake_verbs.h"
#include "moelink/transfer_engine.h"

namespace moelink_test {

struct FakeVerbsEngine {
  std::unique_ptr<moelink::fabric::TransferEngine> engine;
  std::vector<moelink::fabric::verbs::fake::FakeDevice*> devices;  // owned by the NICs
  std::vector<moelink::fabric::verbs::VerbsNic*> nics;             // owned by the engine
  moelink::fabric::TransferEngine* operator->() const { return engine.get(); }
};

class FakeVerbsCluster {
 public:
  FakeVerbsCluster();
  // An engine named `name` with `domains` NICs (one fake device each).
  // `tweak` may change the NICs' options (depths, chain length).
  FakeVerbsEngine make(const std::string& name, int domains = 1, double timeout_s = 10.0,
                       const std::function<void(moelink::fabric::EngineOptions&)>& engine_tweak = {},
                       const std::function<void(moelink::fabric::verbs::VerbsNicOptions&)>&
                           nic_tweak = {});
  moelink::fabric::verbs::fake::FakeFabric fabric;  // declared first: outlives the engines

 private:
  uint16_t next_lid_ = 1;
};

}  // namespace moelink_test
