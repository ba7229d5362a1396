// The real Device over libibverbs (ConnectX-7 / mlx5). COMPILED ONLY: no
// machine this was written on has RDMA, so none of the ibv_* calls behind
// this header has ever run against a NIC. Everything above the Qp
// interface is tested against the fake layer instead (tests/fabric/verbs).
#pragma once

#include <infiniband/verbs.h>

#include <memory>
#include <string>
#include <vector>

#include "fabric/verbs/qp.h"

namespace moelink::fabric::verbs {

struct IbvDeviceOptions {
  std::string name;  // ibv device name, e.g. "mlx5_0"; "" = the first one
  uint8_t port = 1;
  // Source GID index. 0 suits InfiniBand; RoCE v2 needs the index of the
  // port's RoCE v2 GID (not chosen automatically yet).
  uint8_t gid_index = 0;
  // RC path parameters (ibv_modify_qp RTR/RTS): ack timeout 4.096us *
  // 2^timeout, retries, RNR retries (7 = infinite), RNR NAK timer.
  uint8_t timeout = 14, retry_cnt = 7, rnr_retry = 7, min_rnr_timer = 12;
};

// Everything created from the device (CQs, QPs, AHs, MRs) must be destroyed
// before it: ibv_dealloc_pd / ibv_close_device fail while they exist.
class IbvDevice final : public Device {
 public:
  // Throws ProviderUnavailable when no RDMA device (or not the named one)
  // exists -- the only path that runs on a machine without RDMA -- and
  // FabricError when opening it fails.
  static std::unique_ptr<IbvDevice> open(const IbvDeviceOptions& options);
  // ibv_get_device_list's names, in its order; empty without RDMA.
  static std::vector<std::string> device_names();
  ~IbvDevice() override;

  std::string name() const override { return name_; }
  const PortAddress& address() const override { return address_; }
  std::unique_ptr<Cq> create_cq(int depth) override;
  std::unique_ptr<Qp> create_qp(const QpInit& init) override;
  std::unique_ptr<AddressHandle> create_ah(const PortAddress& dest) override;
  std::unique_ptr<Mr> register_memory(void* addr, size_t length) override;

  // For IbvQp: port MTU and the RC path parameters.
  ibv_mtu active_mtu() const { return active_mtu_; }
  const IbvDeviceOptions& options() const { return options_; }
  // The address vector of dest as ibv_modify_qp(RTR) and ibv_create_ah want it.
  ibv_ah_attr ah_attr(const PortAddress& dest) const;

 private:
  IbvDevice() = default;
  IbvDeviceOptions options_;
  std::string name_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  PortAddress address_;
  ibv_mtu active_mtu_ = IBV_MTU_1024;
};

}  // namespace moelink::fabric::verbs
