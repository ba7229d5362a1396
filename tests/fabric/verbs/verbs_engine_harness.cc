#include "verbs_engine_harness.h"

#include "fabric/engine_factory.h"
#include "fabric/verbs/verbs_engine.h"

namespace moelink_test {

using namespace moelink::fabric;

FakeVerbsCluster::FakeVerbsCluster() { fabric.auto_progress = true; }

FakeVerbsEngine FakeVerbsCluster::make(const std::string& name, int domains, double timeout_s,
                                       const std::function<void(EngineOptions&)>& engine_tweak,
                                       const std::function<void(verbs::VerbsNicOptions&)>& nic_tweak) {
  EngineOptions o;
  o.provider = kVerbsProvider;
  o.name = name;
  o.num_domains = domains;
  o.timeout_s = timeout_s;
  if (engine_tweak) engine_tweak(o);
  verbs::VerbsNicOptions no = verbs::nic_options(o);
  if (nic_tweak) nic_tweak(no);
  FakeVerbsEngine out;
  out.engine = create_engine_on(o, [&](int i) -> std::unique_ptr<Nic> {
    auto dev = std::make_unique<verbs::fake::FakeDevice>(next_lid_++);
    fabric.add(*dev);
    out.devices.push_back(dev.get());
    auto nic = std::make_unique<verbs::VerbsNic>(std::move(dev), i, no);
    out.nics.push_back(nic.get());
    return nic;
  });
  return out;
}

}  // namespace moelink_test
