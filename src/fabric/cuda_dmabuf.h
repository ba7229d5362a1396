// A DMA-BUF file descriptor for CUDA device memory, for registering it with a
// NIC without the provider calling CUDA itself (libfabric FI_MR_DMABUF; the
// verbs equivalent would be ibv_reg_dmabuf_mr). Two implementations, chosen
// by CMake: cuda_dmabuf.cc (CUDA builds: cuMemGetHandleForAddressRange
// through cudaGetDriverEntryPointByVersion, so no link against libcuda) and
// cuda_dmabuf_unavailable.cc (builds without CUDA: always "unavailable").
// COMPILED ONLY: no GPU with a dma-buf capable driver and NIC was available
// where this was written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace moelink::fabric {

struct DmabufRange {
  int fd = -1;           // the caller closes it once the registration is made
  uint64_t offset = 0;   // where [ptr, ptr + size) starts inside the dma-buf
  void* base = nullptr;  // virtual address of the dma-buf's byte 0 (page aligned)
};

// cuMemGetHandleForAddressRange needs a range aligned to the host page size,
// so the pages around [ptr, ptr + size) are exported and the registration
// starts `offset` bytes in. nullopt (and *why) when not possible: built
// without CUDA, a driver without the entry point, memory the driver cannot
// export (not from cuMemAlloc / cudaMalloc, no dma-buf support).
std::optional<DmabufRange> export_cuda_dmabuf(const void* ptr, size_t size, std::string* why);

// Closes a DmabufRange's fd (close(2)); -1 is ignored.
void close_dmabuf(DmabufRange& range);

}  // namespace moelink::fabric
