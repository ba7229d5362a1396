// Wire format of the RC handshake messages carried over the UD QP.
// HELLO and ACK carry the same body -- everything the receiver needs to
// bring its RC QPs to RTR -- so whichever arrives first is enough to
// connect, which is what makes lost, duplicated and reordered messages and
// simultaneous opens easy to handle (handshake.h).
//
// Fixed size, big-endian, magic + version first: UD delivers whole
// datagrams or nothing, but anything may arrive on the UD QP (another job's
// stray traffic, an older version), so decode() rejects rather than trusts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fabric/verbs/qp.h"
#include "fabric/verbs/wr_builder.h"

namespace moelink::fabric::verbs {

enum class MsgType : uint8_t { kHello = 1, kAck = 2 };

// Where a node's UD QP can be reached (exchanged out of band for the
// initiator; learned from the HELLO by a passive side).
struct UdContact {
  PortAddress addr;
  uint32_t qpn = 0;
  bool operator==(const UdContact&) const = default;
};

class BeWriter;
class BeReader;
// A UdContact on the wire (24 bytes: LID, GID, port, GID index, QPN), as
// both the HELLO and the endpoint address carry it.
void write_ud_contact(BeWriter& o, const UdContact& c);
UdContact read_ud_contact(BeReader& in);

struct QpEnd {
  uint32_t qpn = 0;
  uint32_t psn = 0;  // 24 bits
  bool operator==(const QpEnd&) const = default;
};

struct HandshakeMsg {
  MsgType type = MsgType::kHello;
  uint64_t from = 0;          // sender's node id
  uint64_t to = 0;            // intended receiver's node id
  uint64_t session = 0;       // sender's incarnation (random per start)
  uint64_t echo_session = 0;  // ACK: the session of the HELLO answered
  UdContact ud;               // sender's UD QP, for replies
  QpEnd msg_qp;               // sender's RC QP for SEND/RECV
  QpEnd write_qp;             // sender's RC QP for WRITE_WITH_IMM
  RemoteBuffer region;        // "rkey info": the sender's default target buffer
  bool operator==(const HandshakeMsg&) const = default;
};

inline constexpr uint32_t kHandshakeMagic = 0x4d4c5642;  // "MLVB"
inline constexpr uint16_t kHandshakeVersion = 1;
// magic 4 + version 2 + type 1 + pad 1 + 4 x u64 + lid 2 + gid 16 + port 1 +
// gid_index 1 + ud qpn 4 + 2 x (qpn 4 + psn 4) + region (8 + 4 + 8).
inline constexpr size_t kHandshakeMsgBytes = 8 + 32 + 20 + 4 + 16 + 20;

std::vector<uint8_t> encode(const HandshakeMsg& m);
// nullopt (and *why set) for a datagram that is not a valid message.
std::optional<HandshakeMsg> decode(std::span<const uint8_t> bytes, std::string* why);

const char* to_string(MsgType t);

}  // namespace moelink::fabric::verbs
