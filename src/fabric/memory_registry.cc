#include "fabric/memory_registry.h"

#include <atomic>

#include "moelink/errors.h"

namespace moelink::fabric {

namespace {
// Generations are unique across all registries, so a thread's cached entry
// can never match a registry that reused a destroyed one's address.
std::atomic<uint64_t> g_generation{1};
uint64_t next_generation() { return g_generation.fetch_add(1, std::memory_order_relaxed); }

// The registration a thread checked last: operations on one buffer skip the
// lock and the map.
struct LastChecked {
  const MemoryRegistry* registry = nullptr;
  uint64_t generation = 0;
  uint64_t id = 0;
  std::shared_ptr<const Registration> reg;
};
thread_local LastChecked t_last;
}  // namespace

MemoryRegistry::MemoryRegistry() : generation_(next_generation()) {}

void check_range(uint64_t size, uint64_t offset, uint64_t len, const std::string& op,
                 const char* side) {
  if (offset > size || len > size - offset)
    throw InvalidArgument("TransferEngine " + op + ": " + side + " range [" +
                          std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                          std::to_string(len) + ") is outside the " + std::to_string(size) +
                          "-byte registration");
}

uint64_t MemoryRegistry::add(void* ptr, size_t size, std::vector<MemoryHandle> mrs) {
  auto r = std::make_shared<Registration>();
  r->ptr = ptr;
  r->size = size;
  r->mrs = std::move(mrs);
  std::lock_guard<std::mutex> lock(mu_);
  r->id = next_id_++;
  regs_[r->id] = r;
  generation_.store(next_generation(), std::memory_order_release);
  return r->id;
}

std::shared_ptr<Registration> MemoryRegistry::remove(uint64_t id, const std::string& op) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regs_.find(id);
  if (it == regs_.end())
    throw InvalidArgument("TransferEngine " + op + ": memory region " + std::to_string(id) +
                          " is not registered");
  auto r = it->second;
  regs_.erase(it);
  generation_.store(next_generation(), std::memory_order_release);
  return r;
}

const Registration& MemoryRegistry::check(const MemoryRegion& region, uint64_t offset,
                                          uint64_t len, const std::string& op) const {
  const uint64_t gen = generation_.load(std::memory_order_acquire);
  if (!(t_last.registry == this && t_last.generation == gen && t_last.id == region.id)) {
    std::shared_ptr<const Registration> r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regs_.find(region.id);
      if (it != regs_.end()) r = it->second;
    }
    // Cached with the generation read before the lookup: a change since
    // then makes the next check look again.
    if (r)
      t_last = LastChecked{this, gen, region.id, std::move(r)};
    else
      t_last = LastChecked{};
  }
  const Registration* r = t_last.reg.get();
  if (!r || r->ptr != region.ptr)
    throw InvalidArgument("TransferEngine " + op + ": source memory " +
                          std::to_string(reinterpret_cast<uintptr_t>(region.ptr)) +
                          " (region " + std::to_string(region.id) +
                          ") is not registered with this engine");
  check_range(r->size, offset, len, op, "source");
  return *r;
}

std::vector<std::shared_ptr<Registration>> MemoryRegistry::take_all() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Registration>> out;
  for (auto& [id, r] : regs_) out.push_back(r);
  regs_.clear();
  generation_.store(next_generation(), std::memory_order_release);
  return out;
}

}  // namespace moelink::fabric
