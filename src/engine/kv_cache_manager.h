// The paged KV cache's bookkeeping for one engine: which pages hold which
// request's tokens, prefix caching of full pages by moelink block hash
// (include/moelink/scheduler/block_hash.h: the scheduler's own hash, so its
// prefix index names exactly what this engine holds), reference counts for
// pages shared by requests with a common prefix, least-recently-used
// eviction of cached pages no request holds, and the KV events the
// scheduler's index needs.
//
// One page holds page_size tokens and is one scheduler block (the engine
// registers with block_size = page_size). A page becomes cached once all its
// tokens are computed (commit); a partial page is never shared.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace moelink::engine {

// What changed in the cache since the last take_events(), in order: the
// hashes of pages newly cached (a chain: each after `parent`, or a
// prompt's first page when parent is empty), or dropped from the cache.
struct KvEvent {
  enum Kind { kStored, kRemoved } kind = kStored;
  std::vector<uint64_t> hashes;
  std::optional<uint64_t> parent;  // kStored
};

class KvCacheManager {
 public:
  using RequestId = uint64_t;

  // num_pages >= 1 pages of page_size >= 1 tokens. prefix_caching = false:
  // no page is ever cached (admit shares nothing, commit names nothing and
  // queues no event; a released request's pages are free again), the
  // baseline the prefix cache is measured against.
  KvCacheManager(int64_t num_pages, int page_size, bool prefix_caching = true);

  int page_size() const { return page_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  int64_t num_pages() const { return static_cast<int64_t>(pages_.size()); }
  // Pages a new allocation can take: free ones and cached ones no request holds.
  int64_t available_pages() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  int64_t cached_pages() const { return static_cast<int64_t>(by_hash_.size()); }

  // Starts request `id` with its prompt: takes the longest run of the
  // prompt's full pages already cached (sharing them) and returns how many
  // tokens they hold. At most prompt.size() - 1 tokens come from the cache:
  // the last prompt token is always computed, for its logits.
  // Throws std::invalid_argument for an id already admitted.
  int64_t admit(RequestId id, std::span<const uint32_t> prompt);

  // Pages enough for `tokens` tokens of request `id`; false (nothing taken)
  // when free and evictable pages do not suffice: the caller preempts
  // someone or waits.
  bool reserve(RequestId id, int64_t tokens);

  // Tokens [0, computed) of request `id` (`tokens` holds at least that many)
  // are in its pages: the full pages among them become cached (their hashes
  // chained from the prompt's first page) and stored events are queued. A
  // page whose hash another request cached first, or whose parent page is
  // no longer cached, stays this request's own.
  void commit(RequestId id, std::span<const uint32_t> tokens, int64_t computed);

  // Ends request `id`: its pages are released (cached ones stay, evictable,
  // most recently used last; the others are free again). Unknown ids are
  // ignored (a request preempted and released twice).
  void release(RequestId id);

  // Drops every cached page no request holds (an AllBlocksCleared for the
  // scheduler when `clear_all` is set, and then also forgets the hashes of
  // held pages).
  void clear(bool clear_all);

  // The pages of request `id`, in token order (empty for an unknown id).
  const std::vector<int32_t>& pages(RequestId id) const;

  // The events since the last call (and whether a clear of everything
  // happened first: the scheduler then drops the engine's whole index).
  std::vector<KvEvent> take_events(bool* cleared_all = nullptr);

  // Checks every invariant (tests): each page is exactly one of free,
  // evictable or held; reference counts match the requests' page lists;
  // the hash map names cached pages only. Throws std::logic_error.
  void check_invariants() const;

 private:
  struct Page {
    int32_t refs = 0;
    bool cached = false;
    uint64_t hash = 0;
    std::list<int32_t>::iterator lru;  // valid when cached and refs == 0
  };
  struct Request {
    std::vector<int32_t> pages;
    int64_t committed_pages = 0;  // pages whose hash is known (cached or not)
    uint64_t last_hash = 0;       // the hash of page committed_pages - 1
  };

  int32_t take_page();  // free first, else evict the least recently used
  void hold(int32_t page);
  void drop(int32_t page);

  int page_size_;
  bool prefix_caching_;
  std::vector<Page> pages_;
  std::vector<int32_t> free_;
  std::list<int32_t> lru_;  // evictable cached pages, least recently used first
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::unordered_map<RequestId, Request> requests_;
  std::vector<KvEvent> events_;
  bool cleared_all_ = false;
};

}  // namespace moelink::engine
