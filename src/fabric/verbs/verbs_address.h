// What an ibverbs NIC puts in EngineAddress::endpoints: the UD contact its
// peers send handshake datagrams to (LID, GID, port, GID index, UD QPN) and
// the NIC's node id, which names it in those handshakes. Fixed size,
// big-endian, magic + version, so a libfabric endpoint name (or junk) is
// rejected instead of misread.
#pragma once

#include <cstdint>
#include <string>

#include "fabric/verbs/handshake_msg.h"

namespace moelink::fabric::verbs {

struct VerbsEndpoint {
  uint64_t node = 0;
  UdContact ud;
  bool operator==(const VerbsEndpoint&) const = default;
};

inline constexpr uint32_t kEndpointMagic = 0x4d4c5645;  // "MLVE"
inline constexpr uint16_t kEndpointVersion = 1;
// magic 4 + version 2 + node 8 + lid 2 + gid 16 + port 1 + gid_index 1 + qpn 4
inline constexpr size_t kEndpointBytes = 38;

std::string encode_endpoint(const VerbsEndpoint& e);
// InvalidArgument naming the peer when the bytes are not a verbs endpoint.
VerbsEndpoint decode_endpoint(const std::string& bytes, const std::string& peer_name);

}  // namespace moelink::fabric::verbs
