// COMPILED ONLY -- the ibv path has never run (see verbs_engine.h).
#include "fabric/verbs/verbs_engine.h"

#include <string>
#include <vector>

#include "fabric/verbs/ibv_device.h"
#include "moelink/errors.h"

namespace moelink::fabric::verbs {

VerbsNicOptions nic_options(const EngineOptions& options) {
  VerbsNicOptions n;
  n.timeout_s = options.timeout_s;
  n.rx = ReceiveConfig{options.max_message_bytes, options.recv_buffers};
  return n;
}

NicFactory ibv_nic_factory(const EngineOptions& options) {
  if (options.verbs_port < 1 || options.verbs_port > 255)
    throw InvalidArgument("TransferEngine (ibverbs): verbs_port " +
                          std::to_string(options.verbs_port) + " is outside 1..255");
  if (options.verbs_gid_index < 0 || options.verbs_gid_index > 255)
    throw InvalidArgument("TransferEngine (ibverbs): verbs_gid_index " +
                          std::to_string(options.verbs_gid_index) + " is outside 0..255");
  std::vector<std::string> names = options.verbs_devices;
  if (names.empty()) names = IbvDevice::device_names();
  if (names.empty()) (void)IbvDevice::open({});  // throws ProviderUnavailable, saying why
  const VerbsNicOptions nic = nic_options(options);
  const auto port = static_cast<uint8_t>(options.verbs_port);
  const auto gid_index = static_cast<uint8_t>(options.verbs_gid_index);
  return [names, nic, port, gid_index](int i) -> std::unique_ptr<Nic> {
    IbvDeviceOptions d;
    d.name = names[static_cast<size_t>(i) % names.size()];
    d.port = port;
    d.gid_index = gid_index;
    return std::make_unique<VerbsNic>(IbvDevice::open(d), i, nic);
  };
}

bool ibv_devices_present() { return !IbvDevice::device_names().empty(); }

}  // namespace moelink::fabric::verbs
