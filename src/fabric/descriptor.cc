// Serialization of EngineAddress and MemoryDescriptor.
#include "fabric/serialize.h"
#include "moelink/transfer_engine.h"

namespace moelink::fabric {

namespace {
constexpr uint64_t kAddressMagic = 0x6d6c2d6164647231ULL;     // "ml-addr1"
constexpr uint64_t kDescriptorMagic = 0x6d6c2d6d656d6431ULL;  // "ml-memd1"
constexpr uint64_t kMaxDomains = 64;

void write_address(ByteWriter& w, const EngineAddress& a) {
  w.str(a.name);
  w.u64(a.endpoints.size());
  for (const auto& e : a.endpoints) w.str(e);
}

EngineAddress read_address(ByteReader& r, const char* what) {
  EngineAddress a;
  a.name = r.str();
  const uint64_t n = r.u64();
  if (n == 0 || n > kMaxDomains)
    throw InvalidArgument(std::string(what) + ": bad endpoint count " + std::to_string(n));
  for (uint64_t i = 0; i < n; ++i) a.endpoints.push_back(r.str());
  return a;
}
}  // namespace

std::vector<char> EngineAddress::serialize() const {
  ByteWriter w;
  w.u64(kAddressMagic);
  write_address(w, *this);
  return w.take();
}

EngineAddress EngineAddress::deserialize(const void* data, size_t size) {
  ByteReader r(data, size, "EngineAddress");
  if (r.u64() != kAddressMagic) throw InvalidArgument("serialized EngineAddress: bad magic");
  EngineAddress a = read_address(r, "EngineAddress");
  r.expect_end();
  return a;
}

std::vector<char> MemoryDescriptor::serialize() const {
  ByteWriter w;
  w.u64(kDescriptorMagic);
  write_address(w, owner);
  w.u64(size);
  w.u64(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    w.u64(remote_base.at(i));
    w.u64(keys[i]);
  }
  return w.take();
}

MemoryDescriptor MemoryDescriptor::deserialize(const void* data, size_t size) {
  ByteReader r(data, size, "MemoryDescriptor");
  if (r.u64() != kDescriptorMagic) throw InvalidArgument("serialized MemoryDescriptor: bad magic");
  MemoryDescriptor d;
  d.owner = read_address(r, "MemoryDescriptor");
  d.size = r.u64();
  const uint64_t n = r.u64();
  if (n != d.owner.endpoints.size())
    throw InvalidArgument("serialized MemoryDescriptor: " + std::to_string(n) + " keys for " +
                          std::to_string(d.owner.endpoints.size()) + " domains");
  for (uint64_t i = 0; i < n; ++i) {
    d.remote_base.push_back(r.u64());
    d.keys.push_back(r.u64());
  }
  r.expect_end();
  return d;
}

}  // namespace moelink::fabric
