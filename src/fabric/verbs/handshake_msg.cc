#include "fabric/verbs/handshake_msg.h"

#include <cstring>

#include "fabric/verbs/be_codec.h"

namespace moelink::fabric::verbs {

void write_ud_contact(BeWriter& o, const UdContact& c) {
  o.u16(c.addr.lid);
  o.bytes(c.addr.gid.data(), 16);
  o.u8(c.addr.port);
  o.u8(c.addr.gid_index);
  o.u32(c.qpn);
}

UdContact read_ud_contact(BeReader& in) {
  UdContact c;
  c.addr.lid = in.u16();
  in.bytes(c.addr.gid.data(), 16);
  c.addr.port = in.u8();
  c.addr.gid_index = in.u8();
  c.qpn = in.u32();
  return c;
}

const char* to_string(MsgType t) {
  switch (t) {
    case MsgType::kHello: return "HELLO";
    case MsgType::kAck: return "ACK";
  }
  return "?";
}

std::vector<uint8_t> encode(const HandshakeMsg& m) {
  std::vector<uint8_t> b;
  b.reserve(kHandshakeMsgBytes);
  BeWriter o(b);
  o.u32(kHandshakeMagic);
  o.u16(kHandshakeVersion);
  o.u8(static_cast<uint8_t>(m.type));
  o.u8(0);
  o.u64(m.from);
  o.u64(m.to);
  o.u64(m.session);
  o.u64(m.echo_session);
  write_ud_contact(o, m.ud);
  o.u32(m.msg_qp.qpn);
  o.u32(m.msg_qp.psn);
  o.u32(m.write_qp.qpn);
  o.u32(m.write_qp.psn);
  o.u64(m.region.addr);
  o.u32(m.region.rkey);
  o.u64(m.region.size);
  return b;
}

std::optional<HandshakeMsg> decode(std::span<const uint8_t> bytes, std::string* why) {
  auto reject = [&](std::string w) -> std::optional<HandshakeMsg> {
    if (why) *why = std::move(w);
    return std::nullopt;
  };
  if (bytes.size() != kHandshakeMsgBytes) {
    return reject("size " + std::to_string(bytes.size()) + ", expected " +
                  std::to_string(kHandshakeMsgBytes));
  }
  BeReader in(bytes);
  if (in.u32() != kHandshakeMagic) return reject("bad magic");
  if (const uint16_t v = in.u16(); v != kHandshakeVersion) {
    return reject("version " + std::to_string(v) + ", expected " +
                  std::to_string(kHandshakeVersion));
  }
  HandshakeMsg m;
  const uint8_t type = in.u8();
  if (type != static_cast<uint8_t>(MsgType::kHello) && type != static_cast<uint8_t>(MsgType::kAck)) {
    return reject("unknown type " + std::to_string(type));
  }
  m.type = static_cast<MsgType>(type);
  in.u8();
  m.from = in.u64();
  m.to = in.u64();
  m.session = in.u64();
  m.echo_session = in.u64();
  m.ud = read_ud_contact(in);
  m.msg_qp.qpn = in.u32();
  m.msg_qp.psn = in.u32();
  m.write_qp.qpn = in.u32();
  m.write_qp.psn = in.u32();
  m.region.addr = in.u64();
  m.region.rkey = in.u32();
  m.region.size = in.u64();
  // PSNs are 24-bit on the wire of IB; a larger value is a corrupt message.
  if (m.msg_qp.psn > 0xffffff || m.write_qp.psn > 0xffffff) return reject("PSN over 24 bits");
  return m;
}

}  // namespace moelink::fabric::verbs
