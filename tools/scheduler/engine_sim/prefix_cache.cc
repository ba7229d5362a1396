#include "prefix_cache.h"

#include <stdexcept>

namespace moelink::scheduler::sim {

void PrefixCache::update_evictable(uint64_t hash, Node& n) {
  evictable_.erase({n.last_use, hash});
  if (n.pins == 0 && n.children == 0) {
    n.last_use = ++clock_;
    evictable_.insert({n.last_use, hash});
  }
}

uint32_t PrefixCache::match(std::span<const uint64_t> hashes) const {
  uint32_t i = 0;
  while (i < hashes.size() && nodes_.contains(hashes[i])) ++i;
  return i;
}

void PrefixCache::pin(std::span<const uint64_t> hashes) {
  for (uint64_t h : hashes) {
    Node& n = nodes_.at(h);
    evictable_.erase({n.last_use, h});
    if (n.pins++ == 0) --unpinned_;
  }
}

void PrefixCache::unpin(std::span<const uint64_t> hashes) {
  for (uint64_t h : hashes) {
    auto it = nodes_.find(h);
    if (it == nodes_.end() || it->second.pins == 0) throw std::logic_error("unpin of an unpinned block");
    if (--it->second.pins == 0) ++unpinned_;
    update_evictable(h, it->second);
  }
}

bool PrefixCache::reserve(uint64_t n, std::vector<uint64_t>& evicted) {
  if (n > free_blocks() + unpinned_) return false;
  while (free_blocks() < n) {
    // Not empty: an unpinned block is left, and the deepest unpinned
    // blocks are leaves (see evictable_blocks).
    const auto [use, hash] = *evictable_.begin();
    evictable_.erase(evictable_.begin());
    const Node node = nodes_.at(hash);
    nodes_.erase(hash);
    --unpinned_;
    evicted.push_back(hash);
    if (node.has_parent) {
      auto p = nodes_.find(node.parent);
      if (p != nodes_.end()) {
        --p->second.children;
        update_evictable(node.parent, p->second);
      }
    }
  }
  reserved_ += n;
  return true;
}

void PrefixCache::release(uint64_t n) {
  if (n > reserved_) throw std::logic_error("release of more blocks than reserved");
  reserved_ -= n;
}

bool PrefixCache::store(uint64_t hash, bool has_parent, uint64_t parent) {
  auto it = nodes_.find(hash);
  if (it != nodes_.end()) {
    release(1);
    pin(std::span<const uint64_t>(&hash, 1));
    return false;
  }
  release(1);
  Node& n = nodes_[hash];
  n.has_parent = has_parent && nodes_.contains(parent);
  n.parent = parent;
  n.pins = 1;
  if (n.has_parent) {
    Node& p = nodes_.at(parent);
    ++p.children;
    evictable_.erase({p.last_use, parent});
  }
  return true;
}

}  // namespace moelink::scheduler::sim
