// Builds without CUDA (MOELINK_WITH_CUDA=OFF): there is no CUDA memory to
// export, and registering kCuda memory falls back to the FI_HMEM iface path
// (which then fails unless the provider accepted FI_HMEM).
#include <unistd.h>

#include "fabric/cuda_dmabuf.h"

namespace moelink::fabric {

std::optional<DmabufRange> export_cuda_dmabuf(const void*, size_t, std::string* why) {
  if (why) *why = "moelink_fabric was built without CUDA (MOELINK_WITH_CUDA=OFF)";
  return std::nullopt;
}

void close_dmabuf(DmabufRange& range) {
  if (range.fd >= 0) ::close(range.fd);
  range.fd = -1;
}

}  // namespace moelink::fabric
