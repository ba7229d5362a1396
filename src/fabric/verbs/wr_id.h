// The wr_id of an RC work request of the verbs transport. An error
// completion carries only wr_id, status and qp_num (opcode and flags are
// undefined then), so everything needed to classify a completion is packed
// in here: send or receive, the peer, which of its two QPs, and the send's
// sequence number or the receive's buffer slot.
//
//   bit 63      1 = receive
//   bit 62      1 = the write QP (WRITE_WITH_IMM), 0 = the message QP
//   bits 32-61  peer index in the NIC (30 bits)
//   bits 0-31   send sequence number / receive slot
#pragma once

#include <cstdint>

namespace moelink::fabric::verbs {

enum class QpRole : uint8_t { kMessage = 0, kWrite = 1 };

struct WrId {
  bool recv = false;
  QpRole role = QpRole::kMessage;
  uint32_t peer = 0;  // < kMaxPeers
  uint32_t low = 0;
  bool operator==(const WrId&) const = default;
};

inline constexpr uint32_t kMaxPeers = 1u << 30;

inline uint64_t pack(const WrId& id) {
  return (uint64_t{id.recv} << 63) | (uint64_t{id.role == QpRole::kWrite} << 62) |
         (uint64_t{id.peer & (kMaxPeers - 1)} << 32) | id.low;
}

inline WrId unpack(uint64_t wr_id) {
  WrId id;
  id.recv = (wr_id >> 63) & 1;
  id.role = ((wr_id >> 62) & 1) ? QpRole::kWrite : QpRole::kMessage;
  id.peer = static_cast<uint32_t>((wr_id >> 32) & (kMaxPeers - 1));
  id.low = static_cast<uint32_t>(wr_id);
  return id;
}

}  // namespace moelink::fabric::verbs
