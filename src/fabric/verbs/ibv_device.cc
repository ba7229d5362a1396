// COMPILED ONLY -- never run (see ibv_device.h).
#include "fabric/verbs/ibv_device.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "fabric/verbs/ibv_qp.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

[[noreturn]] void fail(const std::string& what, int err) {
  throw FabricError("verbs " + what + ": " + std::strerror(err) + " (errno " +
                    std::to_string(err) + ")");
}

class IbvCq final : public Cq {
 public:
  explicit IbvCq(ibv_cq* cq) : cq_(cq) {}
  ~IbvCq() override { ibv_destroy_cq(cq_); }
  int poll(std::span<ibv_wc> out) override {
    const int n = ibv_poll_cq(cq_, static_cast<int>(out.size()), out.data());
    if (n < 0) throw FabricError("verbs ibv_poll_cq failed (" + std::to_string(n) + ")");
    return n;
  }
  ibv_cq* get() const { return cq_; }

 private:
  ibv_cq* cq_;
};

class IbvAh final : public AddressHandle {
 public:
  explicit IbvAh(ibv_ah* ah) : ah_(ah) {}
  ~IbvAh() override { ibv_destroy_ah(ah_); }
  ibv_ah* get() const override { return ah_; }

 private:
  ibv_ah* ah_;
};

class IbvMr final : public Mr {
 public:
  explicit IbvMr(ibv_mr* mr) : mr_(mr) {}
  ~IbvMr() override { ibv_dereg_mr(mr_); }
  void* addr() const override { return mr_->addr; }
  size_t length() const override { return mr_->length; }
  uint32_t lkey() const override { return mr_->lkey; }
  uint32_t rkey() const override { return mr_->rkey; }

 private:
  ibv_mr* mr_;
};

}  // namespace

std::unique_ptr<IbvDevice> IbvDevice::open(const IbvDeviceOptions& options) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  // No RDMA in the kernel: null (errno ENOSYS) or an empty list.
  if (list == nullptr || num == 0) {
    const int err = errno;
    if (list) ibv_free_device_list(list);
    throw ProviderUnavailable(std::string("verbs: no RDMA device on this machine") +
                              (list ? "" : std::string(" (") + std::strerror(err) + ")"));
  }
  ibv_device* dev = nullptr;
  for (int i = 0; i < num && !dev; ++i) {
    if (options.name.empty() || options.name == ibv_get_device_name(list[i])) dev = list[i];
  }
  if (!dev) {
    ibv_free_device_list(list);
    throw ProviderUnavailable("verbs: no RDMA device named '" + options.name + "'");
  }
  std::unique_ptr<IbvDevice> d(new IbvDevice());
  d->options_ = options;
  d->name_ = ibv_get_device_name(dev);
  d->ctx_ = ibv_open_device(dev);
  const int open_err = errno;
  ibv_free_device_list(list);
  if (!d->ctx_) fail("ibv_open_device(" + d->name_ + ")", open_err);
  d->pd_ = ibv_alloc_pd(d->ctx_);
  if (!d->pd_) fail("ibv_alloc_pd(" + d->name_ + ")", errno);
  ibv_port_attr port{};
  if (int rc = ibv_query_port(d->ctx_, options.port, &port)) fail("ibv_query_port", rc);
  if (port.state != IBV_PORT_ACTIVE) {
    throw FabricError("verbs: port " + std::to_string(options.port) + " of " + d->name_ +
                      " is not active");
  }
  d->active_mtu_ = port.active_mtu;
  ibv_gid gid{};
  if (int rc = ibv_query_gid(d->ctx_, options.port, options.gid_index, &gid)) {
    fail("ibv_query_gid", rc);
  }
  d->address_.lid = port.lid;
  std::memcpy(d->address_.gid.data(), gid.raw, 16);
  d->address_.port = options.port;
  d->address_.gid_index = options.gid_index;
  return d;
}

std::vector<std::string> IbvDevice::device_names() {
  std::vector<std::string> names;
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (!list) return names;  // no RDMA in the kernel (ENOSYS)
  for (int i = 0; i < num; ++i) names.emplace_back(ibv_get_device_name(list[i]));
  ibv_free_device_list(list);
  return names;
}

IbvDevice::~IbvDevice() {
  if (pd_) ibv_dealloc_pd(pd_);
  if (ctx_) ibv_close_device(ctx_);
}

ibv_ah_attr IbvDevice::ah_attr(const PortAddress& dest) const {
  ibv_ah_attr a{};
  a.dlid = dest.lid;
  a.sl = 0;
  a.src_path_bits = 0;
  a.port_num = options_.port;
  // A non-zero GID means routing by GID (RoCE always; IB across subnets).
  bool has_gid = false;
  for (uint8_t b : dest.gid) has_gid |= b != 0;
  if (has_gid) {
    a.is_global = 1;
    std::memcpy(a.grh.dgid.raw, dest.gid.data(), 16);
    a.grh.sgid_index = options_.gid_index;
    a.grh.hop_limit = 64;
    a.grh.traffic_class = 0;
    a.grh.flow_label = 0;
  }
  return a;
}

std::unique_ptr<Cq> IbvDevice::create_cq(int depth) {
  ibv_cq* cq = ibv_create_cq(ctx_, depth, nullptr, nullptr, 0);
  if (!cq) fail("ibv_create_cq(depth " + std::to_string(depth) + ")", errno);
  return std::make_unique<IbvCq>(cq);
}

std::unique_ptr<Qp> IbvDevice::create_qp(const QpInit& init) {
  auto* send_cq = dynamic_cast<IbvCq*>(init.send_cq);
  auto* recv_cq = dynamic_cast<IbvCq*>(init.recv_cq);
  if (!send_cq || !recv_cq) throw FabricError("verbs create_qp: CQs not from this device");
  ibv_qp_init_attr attr{};
  attr.send_cq = send_cq->get();
  attr.recv_cq = recv_cq->get();
  attr.qp_type = init.type == QpType::kRc ? IBV_QPT_RC : IBV_QPT_UD;
  attr.sq_sig_all = 0;  // signaling is chosen per WR (chains signal only the last)
  attr.cap.max_send_wr = init.caps.max_send_wr;
  attr.cap.max_recv_wr = init.caps.max_recv_wr;
  attr.cap.max_send_sge = init.caps.max_send_sge;
  attr.cap.max_recv_sge = init.caps.max_recv_sge;
  attr.cap.max_inline_data = init.caps.max_inline_data;
  ibv_qp* qp = ibv_create_qp(pd_, &attr);
  if (!qp) fail("ibv_create_qp", errno);
  // ibv_create_qp writes the granted (possibly larger) caps back into attr.
  const QpCaps granted{attr.cap.max_send_wr, attr.cap.max_recv_wr, attr.cap.max_send_sge,
                       attr.cap.max_recv_sge, attr.cap.max_inline_data};
  return std::make_unique<IbvQp>(*this, qp, init.type, granted, init.qkey);
}

std::unique_ptr<AddressHandle> IbvDevice::create_ah(const PortAddress& dest) {
  ibv_ah_attr a = ah_attr(dest);
  ibv_ah* ah = ibv_create_ah(pd_, &a);
  if (!ah) fail("ibv_create_ah", errno);
  return std::make_unique<IbvAh>(ah);
}

std::unique_ptr<Mr> IbvDevice::register_memory(void* addr, size_t length) {
  // Relaxed ordering lets the NIC reorder PCIe writes into (GPU) memory --
  // the PCIe ordering mitigation of the design; it is an optional flag that
  // devices without support ignore.
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                     IBV_ACCESS_RELAXED_ORDERING;
  ibv_mr* mr = ibv_reg_mr(pd_, addr, length, access);
  if (!mr) fail("ibv_reg_mr(" + std::to_string(length) + " bytes)", errno);
  return std::make_unique<IbvMr>(mr);
}

}  // namespace moelink::fabric::verbs
