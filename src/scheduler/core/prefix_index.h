// The scheduler's index of which engine holds which KV-cache block.
//
// One hash table keyed by block hash (moelink block hash v1, so a key names a
// whole prefix); each entry holds two engine sets: blocks the engine reported
// storing (confirmed), and blocks the scheduler just routed to it and expects
// it to store (provisional, until the engine's events arrive or a time to
// live passes). Matching a prompt walks its block hashes once, narrowing the
// set of engines that still hold every block so far, so one lookup per block
// answers all engines at once.
#pragma once
#include <absl/container/flat_hash_map.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

namespace moelink::scheduler {

using Clock = std::chrono::steady_clock;

inline constexpr int kMaxEngines = 256;

// A set of engine slots (0..kMaxEngines-1).
class EngineSet {
 public:
  void set(int slot) { w_[slot >> 6] |= 1ull << (slot & 63); }
  void reset(int slot) { w_[slot >> 6] &= ~(1ull << (slot & 63)); }
  bool test(int slot) const { return (w_[slot >> 6] >> (slot & 63)) & 1; }
  bool none() const { return (w_[0] | w_[1] | w_[2] | w_[3]) == 0; }
  EngineSet operator&(const EngineSet& o) const {
    EngineSet r;
    for (int i = 0; i < 4; ++i) r.w_[i] = w_[i] & o.w_[i];
    return r;
  }
  EngineSet operator|(const EngineSet& o) const {
    EngineSet r;
    for (int i = 0; i < 4; ++i) r.w_[i] = w_[i] | o.w_[i];
    return r;
  }
  EngineSet without(const EngineSet& o) const {  // this & ~o
    EngineSet r;
    for (int i = 0; i < 4; ++i) r.w_[i] = w_[i] & ~o.w_[i];
    return r;
  }
  // Calls f(slot) for every member, in increasing order.
  template <class F>
  void for_each(F&& f) const {
    for (int w = 0; w < 4; ++w)
      for (uint64_t bits = w_[w]; bits; bits &= bits - 1) f(w * 64 + __builtin_ctzll(bits));
  }

 private:
  std::array<uint64_t, 4> w_{};
};

class PrefixIndex {
 public:
  // The engine reported storing / evicting a block. store() says whether the
  // block is new to the engine's confirmed set (so a caller can take it back).
  bool store(int slot, uint64_t hash);
  void remove(int slot, uint64_t hash);
  // Whether the engine reported storing the block (provisional marks do not count).
  bool holds(int slot, uint64_t hash) const {
    auto it = map_.find(hash);
    return it != map_.end() && it->second.confirmed.test(slot);
  }
  // Forgets every block of one engine (it left, was fenced or cleared its cache).
  void clear(int slot);
  // The scheduler routed a prompt with these blocks to `slot`: count them as
  // held until `expiry` unless the engine reports otherwise.
  void add_provisional(int slot, std::span<const uint64_t> hashes, Clock::time_point expiry);
  // Drops provisional entries whose time has passed.
  void expire(Clock::time_point now);

  // matched[s] = how many leading blocks of `hashes` engine s holds, for
  // every s in `engines` (others are left at 0). `matched` is resized to
  // kMaxEngines.
  void match(std::span<const uint64_t> hashes, const EngineSet& engines,
             std::vector<uint32_t>& matched) const;

  size_t confirmed_blocks(int slot) const { return confirmed_count_[slot]; }
  size_t entries() const { return map_.size(); }

 private:
  struct Entry {
    EngineSet confirmed;
    EngineSet provisional;
    Clock::time_point provisional_until{};  // the latest expiry of any provisional bit
  };
  struct Provisional {
    Clock::time_point expiry;
    std::vector<uint64_t> hashes;
  };
  absl::flat_hash_map<uint64_t, Entry> map_;
  std::deque<Provisional> provisional_queue_;
  std::array<size_t, kMaxEngines> confirmed_count_{};
};

}  // namespace moelink::scheduler
