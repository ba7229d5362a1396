// The thin queue-pair layer the verbs backend is written against. Two
// implementations: IbvDevice (ibv_device.h, real libibverbs calls; compiled
// everywhere, run nowhere yet) and FakeDevice (tests/fabric/verbs, records
// what was posted and lets tests deliver completions). Everything above this
// layer (handshake, WR builders, UD channel) only sees these interfaces, so
// it can be unit-tested on machines without RDMA.
//
// Work requests are the real ibv_send_wr / ibv_recv_wr structs (from the
// header only): the builders' output is then exactly what ibv_post_send
// receives, and tests check the very fields the NIC would read.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace moelink::fabric::verbs {

// Limits of one QP, as granted by the device (ibv_create_qp may round the
// requested values up; builders must respect the granted ones).
struct QpCaps {
  uint32_t max_send_wr = 0;
  uint32_t max_recv_wr = 0;
  uint32_t max_send_sge = 0;
  uint32_t max_recv_sge = 0;
  uint32_t max_inline_data = 0;
};

// Where a port can be reached: LID (InfiniBand) and GID (RoCE, or IB across
// subnets). gid_index selects the local GID used as the source of GRHs.
struct PortAddress {
  uint16_t lid = 0;
  std::array<uint8_t, 16> gid{};
  uint8_t port = 1;
  uint8_t gid_index = 0;
  bool operator==(const PortAddress&) const = default;
};

// The remote half of an RC connection: what ibv_modify_qp(RTR) needs.
struct RcRemote {
  PortAddress addr;
  uint32_t qpn = 0;
  uint32_t psn = 0;  // remote's initial send PSN = our expected receive PSN
};

enum class QpType { kRc, kUd };
// Mirrors the ibv_qp_state steps the backend uses; the fake checks order.
enum class QpState { kReset, kInit, kRtr, kRts, kError };
const char* to_string(QpState s);

class Qp {
 public:
  virtual ~Qp() = default;
  virtual QpType type() const = 0;
  virtual uint32_t qpn() const = 0;
  virtual const QpCaps& caps() const = 0;
  virtual QpState state() const = 0;

  // RESET -> INIT -> RTR -> RTS. RC: `remote` is the peer's QP (required);
  // UD: `remote` is ignored (no connection), qkey is set at INIT.
  virtual void to_init() = 0;
  virtual void to_rtr(const RcRemote* remote) = 0;
  virtual void to_rts(uint32_t sq_psn) = 0;

  // Post a linked list of WRs with one doorbell. Throws FabricError naming
  // the index of the first rejected WR (nothing after it was posted).
  virtual void post_send(ibv_send_wr* wr) = 0;
  virtual void post_recv(ibv_recv_wr* wr) = 0;
};

class Cq {
 public:
  virtual ~Cq() = default;
  // Non-blocking: fills up to out.size() completions, returns how many.
  virtual int poll(std::span<ibv_wc> out) = 0;
};

// A UD destination handle (ibv_ah). get() goes into wr.ud.ah.
class AddressHandle {
 public:
  virtual ~AddressHandle() = default;
  virtual ibv_ah* get() const = 0;
};

// A registered buffer (ibv_mr). Remote writers need rkey; local sges lkey.
class Mr {
 public:
  virtual ~Mr() = default;
  virtual void* addr() const = 0;
  virtual size_t length() const = 0;
  virtual uint32_t lkey() const = 0;
  virtual uint32_t rkey() const = 0;
};

struct QpInit {
  QpType type = QpType::kRc;
  Cq* send_cq = nullptr;
  Cq* recv_cq = nullptr;
  QpCaps caps;        // requested; qp->caps() has what was granted
  uint32_t qkey = 0;  // UD only
};

// One NIC port (one ibv_context + protection domain).
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  virtual const PortAddress& address() const = 0;
  virtual std::unique_ptr<Cq> create_cq(int depth) = 0;
  virtual std::unique_ptr<Qp> create_qp(const QpInit& init) = 0;
  virtual std::unique_ptr<AddressHandle> create_ah(const PortAddress& dest) = 0;
  // Local write + remote write access (targets of WRITE_WITH_IMM).
  virtual std::unique_ptr<Mr> register_memory(void* addr, size_t length) = 0;
};

}  // namespace moelink::fabric::verbs
