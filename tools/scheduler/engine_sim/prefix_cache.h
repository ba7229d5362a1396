// The simulated engine's KV cache: a fixed number of blocks holding cached
// prefixes (a tree of chained block hashes, as vLLM's and SGLang's caches
// are) and the private blocks of running requests. Blocks no request pins
// are evicted leaves first, least recently used first.
#pragma once
#include <cstdint>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moelink::scheduler::sim {

class PrefixCache {
 public:
  explicit PrefixCache(uint64_t capacity_blocks) : capacity_(capacity_blocks) {}

  uint64_t capacity() const { return capacity_; }
  uint64_t cached_blocks() const { return nodes_.size(); }
  uint64_t free_blocks() const { return capacity_ - nodes_.size() - reserved_; }
  // Every unpinned block: requests pin whole chains from the root, so an
  // unpinned block has no pinned descendant and eviction reaches it once
  // its children are gone (only the leaves are evictable at any moment).
  uint64_t evictable_blocks() const { return unpinned_; }

  // How many leading blocks of `hashes` are cached.
  uint32_t match(std::span<const uint64_t> hashes) const;
  // Pins cached blocks (they cannot be evicted until unpinned).
  void pin(std::span<const uint64_t> hashes);
  void unpin(std::span<const uint64_t> hashes);
  // Sets aside n blocks for a request, evicting unpinned blocks as needed
  // (their hashes are appended to `evicted`). False, changing nothing, if
  // even evicting everything unpinned would not make room.
  bool reserve(uint64_t n, std::vector<uint64_t>& evicted);
  void release(uint64_t n);
  // Turns one reserved block into the cached block `hash` (child of
  // `parent`, or a root when has_parent is false) and pins it. If the block
  // is cached already, the reserved block is released and the cached one
  // pinned. Returns whether it was new.
  bool store(uint64_t hash, bool has_parent, uint64_t parent);

 private:
  struct Node {
    bool has_parent = false;
    uint64_t parent = 0;
    uint32_t children = 0;
    uint32_t pins = 0;
    uint64_t last_use = 0;
  };
  void update_evictable(uint64_t hash, Node& n);

  uint64_t capacity_;
  uint64_t reserved_ = 0;
  uint64_t clock_ = 0;
  uint64_t unpinned_ = 0;  // cached blocks with no pin
  std::unordered_map<uint64_t, Node> nodes_;
  std::set<std::pair<uint64_t, uint64_t>> evictable_;  // (last_use, hash) of unpinned leaves
};

}  // namespace moelink::scheduler::sim
