#include "internode/gdr_memory.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>

namespace moelink::detail::internode {

namespace {

// libgdrapi's C interface (gdrapi.h, API version 2), declared here so that
// moelink neither needs its headers to build nor the library to run.
struct GdrHandle {
  unsigned long h;
};
using GdrT = void*;

struct GdrApi {
  GdrT (*open)();
  int (*close)(GdrT);
  int (*pin_buffer)(GdrT, unsigned long addr, size_t size, uint64_t p2p_token, uint32_t va_space,
                    GdrHandle* handle);
  int (*unpin_buffer)(GdrT, GdrHandle);
  int (*map)(GdrT, GdrHandle, void** va, size_t size);
  int (*unmap)(GdrT, GdrHandle, void* va, size_t size);
  GdrT gdr = nullptr;  // one driver connection per process, never closed
  std::string error;   // why GDRCopy is unusable here ("" when usable)
};

template <typename Fn>
bool resolve(void* lib, const char* name, Fn* fn, std::string* error) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr) *error = std::string("libgdrapi has no ") + name;
  return *fn != nullptr;
}

const GdrApi& api() {
  static const GdrApi a = [] {
    GdrApi g{};
    void* lib = dlopen("libgdrapi.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libgdrapi.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      g.error = "libgdrapi.so.2 not found";
      return g;
    }
    if (!resolve(lib, "gdr_open", &g.open, &g.error) ||
        !resolve(lib, "gdr_close", &g.close, &g.error) ||
        !resolve(lib, "gdr_pin_buffer", &g.pin_buffer, &g.error) ||
        !resolve(lib, "gdr_unpin_buffer", &g.unpin_buffer, &g.error) ||
        !resolve(lib, "gdr_map", &g.map, &g.error) || !resolve(lib, "gdr_unmap", &g.unmap, &g.error))
      return g;
    g.gdr = g.open();
    if (g.gdr == nullptr) g.error = "gdr_open failed (is the gdrdrv kernel module loaded?)";
    return g;
  }();
  return a;
}

constexpr uintptr_t kGpuPage = uintptr_t{1} << 16;

}  // namespace

std::unique_ptr<GdrMemory> GdrMemory::create(size_t bytes, std::string* why) {
  const GdrApi& g = api();
  if (!g.error.empty()) {
    *why = g.error;
    return nullptr;
  }
  std::unique_ptr<GdrMemory> m(new GdrMemory());
  // Pin whole GPU pages, from an aligned address: the mapping then starts
  // exactly at device_.
  m->map_bytes_ = (bytes + kGpuPage - 1) & ~(kGpuPage - 1);
  if (cudaMalloc(&m->allocation_, m->map_bytes_ + kGpuPage) != cudaSuccess) {
    (void)cudaGetLastError();
    m->allocation_ = nullptr;
    *why = "cudaMalloc of " + std::to_string(m->map_bytes_ + kGpuPage) + " bytes failed";
    return nullptr;
  }
  const auto base = reinterpret_cast<uintptr_t>(m->allocation_);
  m->device_ = reinterpret_cast<char*>((base + kGpuPage - 1) & ~(kGpuPage - 1));
  if (cudaMemset(m->device_, 0, m->map_bytes_) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    (void)cudaGetLastError();
    *why = "zeroing the device memory failed";
    return nullptr;
  }
  GdrHandle h{};
  if (g.pin_buffer(g.gdr, reinterpret_cast<unsigned long>(m->device_), m->map_bytes_, 0, 0, &h) !=
      0) {
    *why = "gdr_pin_buffer failed";
    return nullptr;
  }
  m->handle_ = h.h;
  m->pinned_ = true;
  void* va = nullptr;
  if (g.map(g.gdr, h, &va, m->map_bytes_) != 0 || va == nullptr) {
    *why = "gdr_map failed";
    return nullptr;  // the destructor unpins
  }
  m->map_ = va;
  m->host_ = static_cast<char*>(va);
  return m;
}

GdrMemory::~GdrMemory() {
  const GdrApi& g = api();
  if (map_ != nullptr) g.unmap(g.gdr, GdrHandle{handle_}, map_, map_bytes_);
  if (pinned_) g.unpin_buffer(g.gdr, GdrHandle{handle_});
  if (allocation_ != nullptr) cudaFree(allocation_);
}

}  // namespace moelink::detail::internode
