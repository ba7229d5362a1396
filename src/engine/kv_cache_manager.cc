#include "engine/kv_cache_manager.h"

#include <stdexcept>
#include <string>

#include "moelink/scheduler/block_hash.h"

namespace moelink::engine {

KvCacheManager::KvCacheManager(int64_t num_pages, int page_size, bool prefix_caching)
    : page_size_(page_size), prefix_caching_(prefix_caching) {
  if (num_pages < 1 || num_pages > (int64_t{1} << 31) - 1)
    throw std::invalid_argument("moelink: KvCacheManager: num_pages = " + std::to_string(num_pages) +
                                " must be in [1, 2^31 - 1]");
  if (page_size < 1)
    throw std::invalid_argument("moelink: KvCacheManager: page_size = " + std::to_string(page_size) +
                                " must be >= 1");
  pages_.resize(num_pages);
  free_.reserve(num_pages);
  // Lowest page ids first out (free_ is popped from the back).
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

int64_t KvCacheManager::admit(RequestId id, std::span<const uint32_t> prompt) {
  if (requests_.count(id) != 0)
    throw std::invalid_argument("moelink: KvCacheManager.admit: request " + std::to_string(id) +
                                " is already admitted");
  Request& r = requests_[id];
  if (prompt.empty() || !prefix_caching_) return 0;
  // The last prompt token is computed again for its logits: cached pages
  // may cover at most prompt.size() - 1 tokens.
  const int64_t usable = static_cast<int64_t>(prompt.size() - 1) / page_size_;
  uint64_t parent = scheduler::kRootBlockHash;
  for (int64_t b = 0; b < usable; ++b) {
    parent = scheduler::block_hash(parent, prompt.subspan(b * page_size_, page_size_));
    auto it = by_hash_.find(parent);
    if (it == by_hash_.end()) break;
    hold(it->second);
    r.pages.push_back(it->second);
    r.committed_pages = b + 1;
    r.last_hash = parent;
  }
  return r.committed_pages * page_size_;
}

bool KvCacheManager::reserve(RequestId id, int64_t tokens) {
  auto it = requests_.find(id);
  if (it == requests_.end())
    throw std::invalid_argument("moelink: KvCacheManager.reserve: request " + std::to_string(id) +
                                " was not admitted");
  Request& r = it->second;
  const int64_t need = (tokens + page_size_ - 1) / page_size_ - static_cast<int64_t>(r.pages.size());
  if (need <= 0) return true;
  if (need > available_pages()) return false;
  for (int64_t i = 0; i < need; ++i) {
    const int32_t p = take_page();
    hold(p);
    r.pages.push_back(p);
  }
  return true;
}

void KvCacheManager::commit(RequestId id, std::span<const uint32_t> tokens, int64_t computed) {
  auto it = requests_.find(id);
  if (it == requests_.end() || !prefix_caching_) return;
  Request& r = it->second;
  const int64_t full = std::min<int64_t>(computed, static_cast<int64_t>(tokens.size())) / page_size_;
  KvEvent stored;
  for (int64_t b = r.committed_pages; b < full && b < static_cast<int64_t>(r.pages.size()); ++b) {
    const uint64_t parent = b == 0 ? scheduler::kRootBlockHash : r.last_hash;
    const uint64_t h = scheduler::block_hash(parent, tokens.subspan(b * page_size_, page_size_));
    r.last_hash = h;
    r.committed_pages = b + 1;
    Page& page = pages_[r.pages[b]];
    if (page.cached || by_hash_.count(h) != 0) continue;  // another request's copy is the cached one
    // Under a parent no longer cached (another request's copy of it was
    // evicted), the page could never be matched from a prompt's start, and
    // the scheduler drops a stored event with an unknown parent: it stays
    // this request's own.
    if (b > 0 && by_hash_.count(parent) == 0) continue;
    page.cached = true;
    page.hash = h;
    by_hash_[h] = r.pages[b];
    if (stored.hashes.empty() && b > 0) stored.parent = parent;
    if (!stored.hashes.empty() && stored.hashes.back() != parent) {
      // The chain broke (a page cached by someone else sat between): a new
      // event names its own parent.
      events_.push_back(std::move(stored));
      stored = KvEvent{};
      stored.parent = parent;
    }
    stored.hashes.push_back(h);
  }
  if (!stored.hashes.empty()) events_.push_back(std::move(stored));
}

void KvCacheManager::release(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  for (int32_t p : it->second.pages) drop(p);
  requests_.erase(it);
}

void KvCacheManager::clear(bool clear_all) {
  KvEvent removed{KvEvent::kRemoved, {}, {}};
  for (int32_t p : lru_) {
    Page& page = pages_[p];
    by_hash_.erase(page.hash);
    removed.hashes.push_back(page.hash);
    page.cached = false;
    free_.push_back(p);
  }
  lru_.clear();
  if (clear_all) {
    for (auto& [hash, p] : by_hash_) pages_[p].cached = false;  // held pages stay, unnamed
    by_hash_.clear();
    events_.clear();
    cleared_all_ = true;
    return;
  }
  if (!removed.hashes.empty()) events_.push_back(std::move(removed));
}

const std::vector<int32_t>& KvCacheManager::pages(RequestId id) const {
  static const std::vector<int32_t> none;
  auto it = requests_.find(id);
  return it == requests_.end() ? none : it->second.pages;
}

std::vector<KvEvent> KvCacheManager::take_events(bool* cleared_all) {
  if (cleared_all) *cleared_all = cleared_all_;
  cleared_all_ = false;
  std::vector<KvEvent> out;
  out.swap(events_);
  return out;
}

int32_t KvCacheManager::take_page() {
  if (!free_.empty()) {
    const int32_t p = free_.back();
    free_.pop_back();
    return p;
  }
  // The least recently used cached page no request holds: the scheduler
  // hears that its hash is gone.
  const int32_t p = lru_.front();
  lru_.pop_front();
  Page& page = pages_[p];
  by_hash_.erase(page.hash);
  page.cached = false;
  if (events_.empty() || events_.back().kind != KvEvent::kRemoved)
    events_.push_back(KvEvent{KvEvent::kRemoved, {}, {}});
  events_.back().hashes.push_back(page.hash);
  return p;
}

void KvCacheManager::hold(int32_t p) {
  Page& page = pages_[p];
  if (page.refs++ == 0 && page.cached) lru_.erase(page.lru);
}

void KvCacheManager::drop(int32_t p) {
  Page& page = pages_[p];
  if (--page.refs > 0) return;
  if (page.cached) {
    page.lru = lru_.insert(lru_.end(), p);
  } else {
    free_.push_back(p);
  }
}

void KvCacheManager::check_invariants() const {
  std::vector<int32_t> refs(pages_.size(), 0);
  for (const auto& [id, r] : requests_)
    for (int32_t p : r.pages) ++refs[p];
  std::vector<int> seen(pages_.size(), 0);
  for (int32_t p : free_) ++seen[p];
  for (int32_t p : lru_) ++seen[p];
  for (size_t p = 0; p < pages_.size(); ++p) {
    const Page& page = pages_[p];
    auto fail = [&](const std::string& what) {
      throw std::logic_error("KvCacheManager: page " + std::to_string(p) + ": " + what);
    };
    if (page.refs != refs[p]) fail("refs " + std::to_string(page.refs) + " but held " + std::to_string(refs[p]) + " times");
    if ((page.refs > 0) + seen[p] != 1) fail("not exactly one of free, evictable, held");
    if (page.cached && (by_hash_.count(page.hash) == 0 || by_hash_.at(page.hash) != static_cast<int32_t>(p)))
      fail("cached, but its hash names another page");
  }
  for (int32_t p : free_)
    if (pages_[p].cached) throw std::logic_error("KvCacheManager: a free page is cached");
  for (const auto& [hash, p] : by_hash_)
    if (!pages_[p].cached || pages_[p].hash != hash) throw std::logic_error("KvCacheManager: stale hash");
}

}  // namespace moelink::engine
