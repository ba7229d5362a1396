#include "scheduler/core/prefix_index.h"

#include <algorithm>

namespace moelink::scheduler {

bool PrefixIndex::store(int slot, uint64_t hash) {
  Entry& e = map_[hash];
  if (e.confirmed.test(slot)) return false;
  e.confirmed.set(slot);
  ++confirmed_count_[slot];
  return true;
}

void PrefixIndex::remove(int slot, uint64_t hash) {
  auto it = map_.find(hash);
  if (it == map_.end()) return;
  Entry& e = it->second;
  if (e.confirmed.test(slot)) {
    e.confirmed.reset(slot);
    --confirmed_count_[slot];
  }
  e.provisional.reset(slot);
  if (e.confirmed.none() && e.provisional.none()) map_.erase(it);
}

void PrefixIndex::clear(int slot) {
  for (auto it = map_.begin(); it != map_.end();) {
    Entry& e = it->second;
    e.confirmed.reset(slot);
    e.provisional.reset(slot);
    if (e.confirmed.none() && e.provisional.none()) {
      map_.erase(it++);
    } else {
      ++it;
    }
  }
  confirmed_count_[slot] = 0;
}

void PrefixIndex::add_provisional(int slot, std::span<const uint64_t> hashes,
                                  Clock::time_point expiry) {
  if (hashes.empty()) return;
  for (uint64_t h : hashes) {
    Entry& e = map_[h];
    if (e.confirmed.test(slot)) continue;  // the engine said so itself
    e.provisional.set(slot);
    if (e.provisional_until < expiry) e.provisional_until = expiry;
  }
  // Expiries arrive in order (the time to live is fixed), so the queue stays sorted.
  provisional_queue_.push_back({expiry, std::vector<uint64_t>(hashes.begin(), hashes.end())});
}

void PrefixIndex::expire(Clock::time_point now) {
  while (!provisional_queue_.empty() && provisional_queue_.front().expiry <= now) {
    for (uint64_t h : provisional_queue_.front().hashes) {
      auto it = map_.find(h);
      // A later routing of the same block keeps every engine's mark until
      // that one expires too (one expiry per entry keeps entries small).
      if (it == map_.end() || it->second.provisional_until > now) continue;
      it->second.provisional = EngineSet{};
      if (it->second.confirmed.none()) map_.erase(it);
    }
    provisional_queue_.pop_front();
  }
}

void PrefixIndex::match(std::span<const uint64_t> hashes, const EngineSet& engines,
                        std::vector<uint32_t>& matched) const {
  matched.assign(kMaxEngines, 0);
  EngineSet alive = engines;
  uint32_t i = 0;
  // Blocks are looked up in order and the walk stops at the first miss;
  // prefetching a few blocks ahead hides most of each lookup's memory latency.
  constexpr size_t kAhead = 8;
  for (size_t k = 0; k < std::min(kAhead, hashes.size()); ++k) map_.prefetch(hashes[k]);
  for (; i < hashes.size() && !alive.none(); ++i) {
    if (i + kAhead < hashes.size()) map_.prefetch(hashes[i + kAhead]);
    auto it = map_.find(hashes[i]);
    EngineSet holding;
    if (it != map_.end()) holding = (it->second.confirmed | it->second.provisional) & alive;
    alive.without(holding).for_each([&](int s) { matched[s] = i; });
    alive = holding;
  }
  alive.for_each([&](int s) { matched[s] = i; });
}

}  // namespace moelink::scheduler
