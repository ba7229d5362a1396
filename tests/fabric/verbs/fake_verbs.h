// Fake QP layer for the verbs backend's unit tests: implements the Device /
// Qp / Cq interfaces of src/fabric/verbs/qp.h without any NIC. It
//  * checks QP state steps in the order real verbs require
//    (RESET->INIT->RTR->RTS; RC RTR needs a remote) and that sends are
//    posted only in RTS, receives only from INIT;
//  * records every posted WR deep-copied (sges, inline bytes read at post
//    time, as the NIC would), with which ibv_post_send call it came in;
//  * enforces the granted caps like a NIC would reject them: chain longer
//    than the free send queue, too many sges, inline over max_inline_data;
//  * lets tests inject a post failure at a given WR and push completions;
//  * FakeFabric moves UD sends to the addressed UD QP's posted receives
//    (GRH room + payload), optionally dropping or duplicating them.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "fabric/verbs/qp.h"

namespace moelink::fabric::verbs::fake {

struct PostedSend {
  ibv_send_wr wr{};  // next and sg_list cleared; see sges
  std::vector<ibv_sge> sges;
  std::vector<uint8_t> inline_bytes;  // IBV_SEND_INLINE: the data at post time
  int call = 0;                       // which post_send call (doorbell)
  bool delivered = false;             // UD: moved by FakeFabric
};

struct PostedRecv {
  ibv_recv_wr wr{};
  std::vector<ibv_sge> sges;
  bool consumed = false;
};

class FakeCq final : public Cq {
 public:
  int poll(std::span<ibv_wc> out) override;
  void push(const ibv_wc& wc) { q_.push_back(wc); }
  size_t pending() const { return q_.size(); }

 private:
  std::deque<ibv_wc> q_;
};

class FakeDevice;

class FakeQp final : public Qp {
 public:
  FakeQp(FakeDevice& dev, const QpInit& init, uint32_t qpn, const QpCaps& granted);
  ~FakeQp() override;

  QpType type() const override { return type_; }
  uint32_t qpn() const override { return qpn_; }
  const QpCaps& caps() const override { return caps_; }
  QpState state() const override { return state_; }
  void to_init() override;
  void to_rtr(const RcRemote* remote) override;
  void to_rts(uint32_t sq_psn) override;
  void post_send(ibv_send_wr* wr) override;
  void post_recv(ibv_recv_wr* wr) override;

  // Inspection and control for tests.
  std::vector<PostedSend> sends;
  std::vector<PostedRecv> recvs;
  int send_calls = 0, recv_calls = 0;
  std::optional<RcRemote> remote;
  std::optional<uint32_t> sq_psn;
  std::vector<QpState> history;
  uint32_t qkey = 0;
  uint32_t outstanding = 0;             // send WRs not yet retired
  std::optional<int> fail_send_at;      // reject this WR index of the next post
  void retire(uint32_t n) { outstanding -= n; }
  FakeCq* send_cq() const { return send_cq_; }
  FakeCq* recv_cq() const { return recv_cq_; }
  FakeDevice& device() const { return dev_; }

 private:
  void step(QpState from, QpState to);
  FakeDevice& dev_;
  QpType type_;
  uint32_t qpn_;
  QpCaps caps_;
  QpState state_ = QpState::kReset;
  FakeCq* send_cq_;
  FakeCq* recv_cq_;
};

class FakeAh final : public AddressHandle {
 public:
  FakeAh(FakeDevice& dev, const PortAddress& dest) : dest(dest), dev_(dev) {}
  ~FakeAh() override;
  ibv_ah* get() const override { return const_cast<ibv_ah*>(&ah_); }
  PortAddress dest;

 private:
  FakeDevice& dev_;
  ibv_ah ah_{};  // only its address is used, as a handle
};

class FakeMr final : public Mr {
 public:
  FakeMr(void* a, size_t n, uint32_t key) : a_(a), n_(n), key_(key) {}
  void* addr() const override { return a_; }
  size_t length() const override { return n_; }
  uint32_t lkey() const override { return key_; }
  uint32_t rkey() const override { return key_ | 0x80000000u; }

 private:
  void* a_;
  size_t n_;
  uint32_t key_;
};

class FakeDevice final : public Device {
 public:
  // lid distinguishes devices; qpns start at lid * 0x1000 + 1.
  explicit FakeDevice(uint16_t lid);
  std::string name() const override { return "fake" + std::to_string(address_.lid); }
  const PortAddress& address() const override { return address_; }
  std::unique_ptr<Cq> create_cq(int depth) override;
  std::unique_ptr<Qp> create_qp(const QpInit& init) override;
  std::unique_ptr<AddressHandle> create_ah(const PortAddress& dest) override;
  std::unique_ptr<Mr> register_memory(void* addr, size_t length) override;

  // Emulates a device that rounds caps (e.g. grants less inline).
  std::optional<uint32_t> grant_max_inline;
  std::optional<std::string> fail_create_qp;  // next create_qp throws this
  std::vector<FakeQp*> qps;                   // live QPs, in creation order
  FakeQp* find(uint32_t qpn) const;
  size_t ah_count() const { return ahs_.size(); }
  const FakeAh* ah_of(const ibv_ah* h) const;

 private:
  PortAddress address_;
  uint32_t next_qpn_;
  uint32_t next_key_ = 1;
  std::vector<const FakeAh*> ahs_;  // not owned (held by callers)
  friend class FakeQp;
  friend class FakeAh;
};

// Delivers UD datagrams between FakeDevices by (port address, qpn).
class FakeFabric {
 public:
  void add(FakeDevice& d) { devices_.push_back(&d); }
  // Moves every undelivered UD send. filter returns how many copies to
  // deliver (0 = drop, 2 = duplicate); default 1. Returns datagrams moved.
  int pump(const std::function<int(const std::vector<uint8_t>&)>& filter = {});

 private:
  std::vector<FakeDevice*> devices_;
};

}  // namespace moelink::fabric::verbs::fake
