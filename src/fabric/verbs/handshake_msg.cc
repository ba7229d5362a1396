#include "fabric/verbs/handshake_msg.h"

#include <cstring>

namespace moelink::fabric::verbs {
namespace {

class Out {
 public:
  explicit Out(std::vector<uint8_t>& b) : b_(b) {}
  void u8(uint8_t v) { b_.push_back(v); }
  void u16(uint16_t v) { be(v, 2); }
  void u32(uint32_t v) { be(v, 4); }
  void u64(uint64_t v) { be(v, 8); }
  void bytes(const uint8_t* p, size_t n) { b_.insert(b_.end(), p, p + n); }

 private:
  void be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) b_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t>& b_;
};

class In {
 public:
  explicit In(std::span<const uint8_t> b) : b_(b) {}
  uint8_t u8() { return static_cast<uint8_t>(be(1)); }
  uint16_t u16() { return static_cast<uint16_t>(be(2)); }
  uint32_t u32() { return static_cast<uint32_t>(be(4)); }
  uint64_t u64() { return be(8); }
  void bytes(uint8_t* p, size_t n) {
    std::memcpy(p, b_.data() + pos_, n);
    pos_ += n;
  }

 private:
  uint64_t be(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | b_[pos_++];
    return v;
  }
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

}  // namespace

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
  Out o(b);
  o.u32(kHandshakeMagic);
  o.u16(kHandshakeVersion);
  o.u8(static_cast<uint8_t>(m.type));
  o.u8(0);
  o.u64(m.from);
  o.u64(m.to);
  o.u64(m.session);
  o.u64(m.echo_session);
  o.u16(m.ud.addr.lid);
  o.bytes(m.ud.addr.gid.data(), 16);
  o.u8(m.ud.addr.port);
  o.u8(m.ud.addr.gid_index);
  o.u32(m.ud.qpn);
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
  In in(bytes);
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
  m.ud.addr.lid = in.u16();
  in.bytes(m.ud.addr.gid.data(), 16);
  m.ud.addr.port = in.u8();
  m.ud.addr.gid_index = in.u8();
  m.ud.qpn = in.u32();
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
