// Handshake wire format: round trip, byte order, rejection of junk.
#include <gtest/gtest.h>

#include "fabric/verbs/handshake_msg.h"

namespace moelink::fabric::verbs {
namespace {

HandshakeMsg sample() {
  HandshakeMsg m;
  m.type = MsgType::kAck;
  m.from = 0x0102030405060708;
  m.to = 2;
  m.session = 0xfeedface;
  m.echo_session = 0xcafe;
  m.ud.addr.lid = 0x1234;
  for (int i = 0; i < 16; ++i) m.ud.addr.gid[i] = static_cast<uint8_t>(0xf0 + i);
  m.ud.addr.port = 1;
  m.ud.addr.gid_index = 3;
  m.ud.qpn = 0x123456;
  m.msg_qp = {0x111, 0xabcdef};
  m.write_qp = {0x222, 0x000001};
  m.region = {0x7f0000000000, 0x55, 1 << 20};
  return m;
}

TEST(VerbsHandshakeMsg, RoundTrip) {
  const HandshakeMsg m = sample();
  const auto b = encode(m);
  EXPECT_EQ(b.size(), kHandshakeMsgBytes);
  std::string why;
  auto d = decode(b, &why);
  ASSERT_TRUE(d) << why;
  EXPECT_EQ(*d, m);
}

TEST(VerbsHandshakeMsg, BigEndianLayout) {
  const auto b = encode(sample());
  EXPECT_EQ(b[0], 0x4d);  // 'M'
  EXPECT_EQ(b[3], 0x42);  // 'B'
  EXPECT_EQ(b[5], 1);     // version
  EXPECT_EQ(b[6], 2);     // ACK
  EXPECT_EQ(b[8], 0x01);  // from, most significant byte first
  EXPECT_EQ(b[15], 0x08);
}

TEST(VerbsHandshakeMsg, RejectsJunk) {
  auto b = encode(sample());
  std::string why;
  EXPECT_FALSE(decode(std::span(b).first(b.size() - 1), &why));
  EXPECT_NE(why.find("size"), std::string::npos);
  auto bad = b;
  bad[0] ^= 1;
  EXPECT_FALSE(decode(bad, &why));
  EXPECT_EQ(why, "bad magic");
  bad = b;
  bad[5] = 2;
  EXPECT_FALSE(decode(bad, &why));
  EXPECT_NE(why.find("version 2"), std::string::npos);
  bad = b;
  bad[6] = 9;
  EXPECT_FALSE(decode(bad, &why));
  EXPECT_NE(why.find("unknown type"), std::string::npos);
  HandshakeMsg m = sample();
  m.msg_qp.psn = 0x1000000;
  EXPECT_FALSE(decode(encode(m), &why));
  EXPECT_NE(why.find("PSN"), std::string::npos);
}

}  // namespace
}  // namespace moelink::fabric::verbs
