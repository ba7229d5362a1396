// The real verbs path, on a machine without RDMA: the only part of it that
// can run here is the "no device" answer, which must be ProviderUnavailable
// (not a crash, not a generic error) so callers can fall back or skip.
#include <gtest/gtest.h>

#include "fabric/verbs/ibv_device.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

TEST(VerbsIbvDevice, NoRdmaDeviceIsProviderUnavailable) {
  try {
    auto dev = IbvDevice::open({});
    GTEST_SKIP() << "an RDMA device (" << dev->name()
                 << ") is present: this test covers machines without one";
  } catch (const ProviderUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find("verbs: no RDMA device"), std::string::npos)
        << e.what();
  }
}

TEST(VerbsIbvDevice, UnknownNamedDeviceIsProviderUnavailable) {
  IbvDeviceOptions o;
  o.name = "mlx5_does_not_exist";
  EXPECT_THROW(IbvDevice::open(o), ProviderUnavailable);
}

}  // namespace
}  // namespace moelink::fabric::verbs
