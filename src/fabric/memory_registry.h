// Local registrations: id -> (pointer, size, one registration per NIC),
// and the range checks every operation runs before posting anything.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fabric/transport.h"

namespace moelink::fabric {

struct Registration {
  uint64_t id = 0;
  void* ptr = nullptr;
  size_t size = 0;
  std::vector<MemoryHandle> mrs;  // per domain (NIC)
};

class MemoryRegistry {
 public:
  MemoryRegistry();
  uint64_t add(void* ptr, size_t size, std::vector<MemoryHandle> mrs);
  // Removes and returns the registration; InvalidArgument when unknown.
  std::shared_ptr<Registration> remove(uint64_t id, const std::string& op);
  // InvalidArgument naming `op` when the region is not registered (or was
  // deregistered) or [offset, offset + len) is outside it. The reference
  // is the calling thread's cached entry: valid until this thread's next
  // check (one per operation), even if another thread deregisters the
  // region meanwhile. No reference count changes hands.
  const Registration& check(const MemoryRegion& region, uint64_t offset, uint64_t len,
                            const std::string& op) const;
  std::vector<std::shared_ptr<Registration>> take_all();

 private:
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  // Changes with every add / remove (unique across registries): the
  // per-thread cache in check() is valid only for the generation it saw.
  std::atomic<uint64_t> generation_;
  std::map<uint64_t, std::shared_ptr<Registration>> regs_;
};

// InvalidArgument naming `op` when [offset, offset + len) is outside size.
void check_range(uint64_t size, uint64_t offset, uint64_t len, const std::string& op,
                 const char* side);

}  // namespace moelink::fabric
