// The per-NIC UD QP that carries handshake datagrams (issue 3: "one UD QP
// per NIC for addressing and handshakes"). Owns the QP, its CQ, a
// registered buffer of receive and send slots, and a cache of address
// handles (one ibv_ah per destination port, created on first use).
// UD is unreliable and so is this channel: a send that finds no free slot is
// dropped and counted -- the handshake resends anyway.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "fabric/verbs/handshake_msg.h"
#include "fabric/verbs/qp.h"

namespace moelink::fabric::verbs {

class UdChannel {
 public:
  static constexpr uint32_t kQkey = 0x4d4c0001;
  // Every UD receive starts with 40 bytes of room for the GRH, present or not.
  static constexpr uint32_t kGrhBytes = 40;
  static constexpr uint32_t kMaxPayload = 256;

  UdChannel(Device& device, uint32_t recv_slots = 64, uint32_t send_slots = 16);

  UdContact contact() const { return {device_.address(), qp_->qpn()}; }
  // Queues one datagram (copied; the caller's bytes may go). False when
  // dropped for lack of a free send slot. Throws InvalidArgument when
  // larger than kMaxPayload.
  bool send(const UdContact& to, std::span<const uint8_t> bytes);
  // Handles every completion ready: received datagrams go to on_datagram
  // (GRH stripped) and their receive is reposted; send slots are freed.
  // Throws FabricError on a receive completion with an error (QP broken).
  int poll(const std::function<void(std::span<const uint8_t>)>& on_datagram);

  uint64_t dropped_sends() const { return dropped_sends_; }
  uint64_t failed_sends() const { return failed_sends_; }
  Qp& qp() { return *qp_; }

 private:
  static constexpr uint64_t kSendTag = 1ull << 63;  // wr_id of a send slot
  static constexpr uint32_t kSlotBytes = kGrhBytes + kMaxPayload;
  void post_recv(uint32_t slot);
  uint8_t* slot_ptr(uint32_t slot) { return buffer_.data() + size_t{slot} * kSlotBytes; }
  AddressHandle& ah(const PortAddress& dest);

  // Declaration order is destruction order reversed: address handles and
  // the QP go before the CQ and the MR, as verbs requires.
  Device& device_;
  uint32_t recv_slots_, send_slots_;
  std::vector<uint8_t> buffer_;  // recv slots, then send slots
  std::unique_ptr<Mr> mr_;
  std::unique_ptr<Cq> cq_;
  std::unique_ptr<Qp> qp_;
  std::vector<uint32_t> free_send_;
  std::vector<std::pair<PortAddress, std::unique_ptr<AddressHandle>>> ahs_;
  uint64_t dropped_sends_ = 0, failed_sends_ = 0;
};

}  // namespace moelink::fabric::verbs
