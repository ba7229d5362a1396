#include "fabric/verbs/verbs_address.h"

#include <span>
#include <vector>

#include "fabric/verbs/be_codec.h"
#include "moelink/errors.h"

namespace moelink::fabric::verbs {

std::string encode_endpoint(const VerbsEndpoint& e) {
  std::vector<uint8_t> b;
  b.reserve(kEndpointBytes);
  BeWriter o(b);
  o.u32(kEndpointMagic);
  o.u16(kEndpointVersion);
  o.u64(e.node);
  write_ud_contact(o, e.ud);
  return std::string(b.begin(), b.end());
}

VerbsEndpoint decode_endpoint(const std::string& bytes, const std::string& peer_name) {
  const std::string who = "TransferEngine (ibverbs) add_peer: the address of '" + peer_name + "'";
  if (bytes.size() != kEndpointBytes)
    throw InvalidArgument(who + " is not an ibverbs endpoint (" + std::to_string(bytes.size()) +
                          " bytes, expected " + std::to_string(kEndpointBytes) +
                          "; is the peer on a libfabric provider?)");
  BeReader in(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  if (in.u32() != kEndpointMagic)
    throw InvalidArgument(who + " is not an ibverbs endpoint (bad magic)");
  if (const uint16_t v = in.u16(); v != kEndpointVersion)
    throw InvalidArgument(who + " has endpoint version " + std::to_string(v) + ", expected " +
                          std::to_string(kEndpointVersion));
  VerbsEndpoint e;
  e.node = in.u64();
  e.ud = read_ud_contact(in);
  if (e.node == 0) throw InvalidArgument(who + " has node id 0");
  return e;
}

}  // namespace moelink::fabric::verbs
