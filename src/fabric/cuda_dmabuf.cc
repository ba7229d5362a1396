// CUDA builds: a dma-buf fd for device memory through the driver's
// cuMemGetHandleForAddressRange, found with cudaGetDriverEntryPointByVersion
// (the runtime hands out the driver's entry point, so moelink_fabric does not
// link libcuda and runs on a machine without a GPU until CUDA memory is
// registered). COMPILED ONLY: never run (see cuda_dmabuf.h).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>
#include <mutex>

#include "fabric/cuda_dmabuf.h"

namespace moelink::fabric {
namespace {

using GetHandleFn = CUresult (*)(void* handle, CUdeviceptr dptr, size_t size,
                                 CUmemRangeHandleType type, unsigned long long flags);

// Looked up once; null when the driver or runtime lacks it (*why set).
GetHandleFn get_handle_fn(std::string* why) {
  static std::once_flag once;
  static GetHandleFn fn = nullptr;
  static std::string error;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    // The ABI of the 11.7 version of the symbol, which is what GetHandleFn
    // declares.
    const cudaError_t rc = cudaGetDriverEntryPointByVersion(
        "cuMemGetHandleForAddressRange", &p, 11070, cudaEnableDefault, &status);
#else
    const cudaError_t rc =
        cudaGetDriverEntryPoint("cuMemGetHandleForAddressRange", &p, cudaEnableDefault, &status);
#endif
    if (rc != cudaSuccess || status != cudaDriverEntryPointSuccess || !p) {
      error = std::string("cuMemGetHandleForAddressRange is not available (") +
              cudaGetErrorString(rc) + ", query status " + std::to_string(static_cast<int>(status)) +
              ")";
      return;
    }
    fn = reinterpret_cast<GetHandleFn>(p);
  });
  if (!fn && why) *why = error;
  return fn;
}

}  // namespace

std::optional<DmabufRange> export_cuda_dmabuf(const void* ptr, size_t size, std::string* why) {
  GetHandleFn fn = get_handle_fn(why);
  if (!fn) return std::nullopt;
  const long page_l = ::sysconf(_SC_PAGESIZE);
  const uint64_t page = page_l > 0 ? static_cast<uint64_t>(page_l) : 4096;
  const uint64_t begin = reinterpret_cast<uintptr_t>(ptr);
  const uint64_t aligned = begin & ~(page - 1);
  const uint64_t end = (begin + size + page - 1) & ~(page - 1);
  int fd = -1;
  const CUresult rc = fn(&fd, static_cast<CUdeviceptr>(aligned), static_cast<size_t>(end - aligned),
                         CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (rc != CUDA_SUCCESS || fd < 0) {
    if (why)
      *why = "cuMemGetHandleForAddressRange(" + std::to_string(end - aligned) +
             " bytes) failed with CUresult " + std::to_string(static_cast<int>(rc));
    return std::nullopt;
  }
  DmabufRange r;
  r.fd = fd;
  r.offset = begin - aligned;
  r.base = reinterpret_cast<void*>(static_cast<uintptr_t>(aligned));
  return r;
}

void close_dmabuf(DmabufRange& range) {
  if (range.fd >= 0) ::close(range.fd);
  range.fd = -1;
}

}  // namespace moelink::fabric
