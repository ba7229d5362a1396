// Device memory that the host writes through a GDRCopy mapping (the GPU's
// BAR, write-combined), when libgdrapi and its kernel driver are there at
// run time. The proxy puts its ready words and plan there, so the stream
// waits and the unpack kernels read local HBM instead of polling host
// memory over PCIe. Without GDRCopy the caller keeps pinned host memory.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace moelink::detail::internode {

class GdrMemory {
 public:
  // `bytes` of zeroed device memory on the current device, mapped for host
  // writes. Null, with the reason in *why, when libgdrapi.so cannot be
  // loaded, gdr_open fails (no gdrdrv), or pinning or mapping fails.
  static std::unique_ptr<GdrMemory> create(size_t bytes, std::string* why);
  ~GdrMemory();
  GdrMemory(const GdrMemory&) = delete;
  GdrMemory& operator=(const GdrMemory&) = delete;

  char* device() const { return device_; }
  // The same bytes through the mapping: host stores only (reads are slow
  // and uncached); a store fence orders them (write-combining).
  char* host() const { return host_; }

 private:
  GdrMemory() = default;
  void* allocation_ = nullptr;  // cudaMalloc, larger than asked to align the pin
  char* device_ = nullptr;      // GPU-page (64 KiB) aligned inside it
  char* host_ = nullptr;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  unsigned long handle_ = 0;  // gdr_mh_t
  bool pinned_ = false;
};

}  // namespace moelink::detail::internode
