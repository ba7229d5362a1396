// KV-cache transfer: paged writes of a request's pages, layer by layer or
// all at once, announced through immediate counters.
#include "moelink/kv_transfer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_set>

#include "moelink/errors.h"

namespace moelink::fabric {

namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// a * b, or throws when it overflows 64 bits.
uint64_t mul(uint64_t a, uint64_t b, const std::string& what) {
  if (a != 0 && b > kMax / a) throw InvalidArgument(what + ": layout size overflows 64 bits");
  return a * b;
}
uint64_t add(uint64_t a, uint64_t b, const std::string& what) {
  if (b > kMax - a) throw InvalidArgument(what + ": layout size overflows 64 bits");
  return a + b;
}

// Several engine operations seen as one.
class CompositeTransfer final : public Transfer {
 public:
  explicit CompositeTransfer(std::vector<TransferPtr> parts) : parts_(std::move(parts)) {}
  bool done() const override {
    return std::all_of(parts_.begin(), parts_.end(), [](const TransferPtr& t) { return t->done(); });
  }
  void wait(double timeout_s) const override {
    const auto start = std::chrono::steady_clock::now();
    for (const auto& t : parts_) {
      double left = timeout_s;
      if (timeout_s >= 0) {
        left = timeout_s -
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (left < 0) left = 0;
      }
      t->wait(left);
    }
  }
  std::exception_ptr error() const override {
    for (const auto& t : parts_)
      if (t->done())
        if (auto e = t->error()) return e;
    return nullptr;
  }

 private:
  std::vector<TransferPtr> parts_;
};

// Calls the user's callback once, after the last part completed, with the
// first error seen.
struct JoinedCallback {
  std::mutex mu;
  int left = 0;
  std::exception_ptr first;
  Callback cb;
  void part_done(std::exception_ptr e) {
    bool last = false;
    std::exception_ptr err;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (e && !first) first = e;
      last = --left == 0;
      err = first;
    }
    if (last && cb) cb(err);
  }
};

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

std::string layer_range(int first, int count) {
  if (count == 1) return "layer " + std::to_string(first);
  return "layers " + std::to_string(first) + ".." + std::to_string(first + count - 1);
}

void resolve_layers(const KvCacheLayout& l, int& first, int& count, const std::string& what) {
  if (count < 0) count = l.num_layers - first;
  if (first < 0 || first >= l.num_layers || count < 1 || first + count > l.num_layers)
    throw InvalidArgument(what + ": " + std::to_string(count) + " layers from layer " +
                          std::to_string(first) + " of a " + std::to_string(l.num_layers) +
                          "-layer cache");
}

}  // namespace

uint64_t KvCacheLayout::effective_page_stride() const {
  return page_stride ? page_stride : page_bytes();
}

uint64_t KvCacheLayout::effective_layer_stride() const {
  return layer_stride ? layer_stride : num_pages * effective_page_stride();
}

uint64_t KvCacheLayout::page_offset(int layer, uint64_t page) const {
  return base_offset + static_cast<uint64_t>(layer) * effective_layer_stride() +
         page * effective_page_stride();
}

uint64_t KvCacheLayout::required_bytes() const {
  const std::string what = "KvCacheLayout";
  const uint64_t last = add(mul(static_cast<uint64_t>(num_layers - 1), effective_layer_stride(), what),
                            mul(num_pages - 1, effective_page_stride(), what), what);
  return add(add(base_offset, last, what), page_bytes(), what);
}

void KvCacheLayout::validate(const std::string& what) const {
  auto bad = [&](const std::string& field, uint64_t v, const std::string& rule) {
    throw InvalidArgument(what + ": KV cache layout " + field + " = " + std::to_string(v) +
                          " (" + rule + ")");
  };
  if (num_layers < 1) bad("num_layers", static_cast<uint64_t>(std::max(num_layers, 0)), "must be >= 1");
  if (bytes_per_token == 0) bad("bytes_per_token", 0, "must be >= 1");
  if (tokens_per_page == 0) bad("tokens_per_page", 0, "must be >= 1");
  if (num_pages == 0) bad("num_pages", 0, "must be >= 1");
  const uint64_t pb = mul(bytes_per_token, tokens_per_page, what);
  const uint64_t ps = effective_page_stride();
  mul(num_pages, ps, what);
  const uint64_t ls = effective_layer_stride();
  // Pages must not overlap: either layer-major (pages of a layer apart, the
  // layers beyond the last page of the previous one) or page-major (layers
  // of a page apart, the pages beyond the last layer of the previous one).
  const bool one_layer = num_layers == 1, one_page = num_pages == 1;
  const bool layer_major =
      ps >= pb && (one_layer || ls >= mul(num_pages - 1, ps, what) + pb);
  const bool page_major =
      ls >= pb && (one_page || ps >= mul(static_cast<uint64_t>(num_layers - 1), ls, what) + pb);
  if (!(one_layer && one_page) && !layer_major && !page_major)
    throw InvalidArgument(what + ": KV cache layout has overlapping pages (page_bytes " +
                          std::to_string(pb) + ", page_stride " + std::to_string(ps) +
                          ", layer_stride " + std::to_string(ls) + ", " +
                          std::to_string(num_pages) + " pages, " + std::to_string(num_layers) +
                          " layers)");
  required_bytes();
}

KvCacheLayout KvCacheLayout::layer_major(int num_layers, uint64_t bytes_per_token,
                                         uint32_t tokens_per_page, uint64_t num_pages) {
  KvCacheLayout l;
  l.num_layers = num_layers;
  l.bytes_per_token = bytes_per_token;
  l.tokens_per_page = tokens_per_page;
  l.num_pages = num_pages;
  l.page_stride = l.page_bytes();
  l.layer_stride = num_pages * l.page_stride;
  return l;
}

KvCacheLayout KvCacheLayout::page_major(int num_layers, uint64_t bytes_per_token,
                                        uint32_t tokens_per_page, uint64_t num_pages) {
  KvCacheLayout l;
  l.num_layers = num_layers;
  l.bytes_per_token = bytes_per_token;
  l.tokens_per_page = tokens_per_page;
  l.num_pages = num_pages;
  l.layer_stride = l.page_bytes();
  l.page_stride = static_cast<uint64_t>(num_layers) * l.layer_stride;
  return l;
}

uint64_t KvTransferRequest::num_pages(uint32_t tokens_per_page) const {
  if (tokens_per_page == 0) return 0;
  return (num_tokens + tokens_per_page - 1) / tokens_per_page;
}

uint64_t kv_writes_per_layer(const KvCacheLayout& layout, const KvTransferRequest& req) {
  return req.num_pages(layout.tokens_per_page);
}

uint64_t kv_request_bytes(const KvCacheLayout& layout, const KvTransferRequest& req) {
  return static_cast<uint64_t>(layout.num_layers) * req.num_tokens * layout.bytes_per_token;
}

void validate_kv_request(const KvCacheLayout& src, uint64_t src_bytes, const KvCacheLayout& dst,
                         uint64_t dst_bytes, const KvTransferRequest& req,
                         const std::string& what) {
  src.validate(what + " (prefill/source cache)");
  dst.validate(what + " (decode/destination cache)");
  if (src.num_layers != dst.num_layers || src.bytes_per_token != dst.bytes_per_token ||
      src.tokens_per_page != dst.tokens_per_page)
    throw InvalidArgument(
        what + ": source and destination caches differ in geometry (layers " +
        std::to_string(src.num_layers) + " vs " + std::to_string(dst.num_layers) +
        ", bytes_per_token " + std::to_string(src.bytes_per_token) + " vs " +
        std::to_string(dst.bytes_per_token) + ", tokens_per_page " +
        std::to_string(src.tokens_per_page) + " vs " + std::to_string(dst.tokens_per_page) + ")");
  if (src.required_bytes() > src_bytes)
    throw InvalidArgument(what + ": source cache layout needs " +
                          std::to_string(src.required_bytes()) + " bytes, the registration has " +
                          std::to_string(src_bytes));
  if (dst.required_bytes() > dst_bytes)
    throw InvalidArgument(what + ": destination cache layout needs " +
                          std::to_string(dst.required_bytes()) +
                          " bytes, the peer's registration has " + std::to_string(dst_bytes));
  if (req.num_tokens == 0) throw InvalidArgument(what + ": request has 0 tokens");
  const uint64_t pages = req.num_pages(src.tokens_per_page);
  for (const auto* side : {&req.src_pages, &req.dst_pages})
    if (side->size() != pages)
      throw InvalidArgument(what + ": " + std::to_string(req.num_tokens) + " tokens need " +
                            std::to_string(pages) + " pages of " +
                            std::to_string(src.tokens_per_page) + " tokens, the " +
                            (side == &req.src_pages ? "source" : "destination") +
                            " page list has " + std::to_string(side->size()));
  for (uint64_t i = 0; i < pages; ++i) {
    if (req.src_pages[i] >= src.num_pages)
      throw InvalidArgument(what + ": source page id " + std::to_string(req.src_pages[i]) +
                            " (request page " + std::to_string(i) + ") is outside the source cache's " +
                            std::to_string(src.num_pages) + " pages");
    if (req.dst_pages[i] >= dst.num_pages)
      throw InvalidArgument(what + ": destination page id " + std::to_string(req.dst_pages[i]) +
                            " (request page " + std::to_string(i) +
                            ") is outside the destination cache's " + std::to_string(dst.num_pages) +
                            " pages");
  }
  std::unordered_set<uint64_t> seen;
  for (uint64_t i = 0; i < pages; ++i)
    if (!seen.insert(req.dst_pages[i]).second)
      throw InvalidArgument(what + ": destination page id " + std::to_string(req.dst_pages[i]) +
                            " appears twice (request page " + std::to_string(i) + ")");
  const uint64_t imms = req.imm_mode == KvImmMode::kPerLayer ? static_cast<uint64_t>(src.num_layers) : 1;
  if (static_cast<uint64_t>(req.imm_base) + imms - 1 > std::numeric_limits<uint32_t>::max())
    throw InvalidArgument(what + ": immediates " + std::to_string(req.imm_base) + " + " +
                          std::to_string(imms) + " exceed 32 bits");
}

TransferPtr write_kv_cache(TransferEngine& engine, const MemoryRegion& src,
                           const KvCacheLayout& src_layout, const MemoryDescriptor& dst,
                           const KvCacheLayout& dst_layout, const KvTransferRequest& req,
                           int first_layer, int num_layers, Callback cb) {
  const std::string what = "KV transfer to '" + dst.owner.name + "'";
  validate_kv_request(src_layout, src.size, dst_layout, dst.size, req, what);
  resolve_layers(src_layout, first_layer, num_layers, what);
  if (req.imm_mode == KvImmMode::kPerRequest &&
      (first_layer != 0 || num_layers != src_layout.num_layers))
    throw InvalidArgument(what + ": with one immediate per request all layers go in one call (" +
                          layer_range(first_layer, num_layers) + " asked)");

  const uint64_t tpp = src_layout.tokens_per_page;
  const uint64_t pages = req.num_pages(src_layout.tokens_per_page);
  const uint64_t tail_tokens = req.num_tokens - (pages - 1) * tpp;
  const bool partial = tail_tokens != tpp;
  const uint64_t full = partial ? pages - 1 : pages;

  // Plans: a PagedWrite per immediate for the full pages, one for the
  // partial last pages. Pages are given as absolute byte offsets (stride 1),
  // so any layout is one PagedWrite.
  struct Plan {
    PagedWrite pw;
    uint32_t imm;
  };
  std::vector<Plan> plans;
  auto new_plan = [&](size_t page_bytes, uint32_t imm) -> long {
    Plan p;
    p.pw.page_bytes = page_bytes;
    p.pw.src_stride = 1;
    p.pw.dst_stride = 1;
    p.imm = imm;
    plans.push_back(std::move(p));
    return static_cast<long>(plans.size()) - 1;
  };
  // Layer l's full pages to plan f, its partial last page to plan t (-1: none).
  auto add_layer = [&](int l, long f, long t) {
    if (f >= 0)
      for (uint64_t i = 0; i < full; ++i) {
        plans[f].pw.src_pages.push_back(src_layout.page_offset(l, req.src_pages[i]));
        plans[f].pw.dst_pages.push_back(dst_layout.page_offset(l, req.dst_pages[i]));
      }
    if (t >= 0) {
      plans[t].pw.src_pages.push_back(src_layout.page_offset(l, req.src_pages[pages - 1]));
      plans[t].pw.dst_pages.push_back(dst_layout.page_offset(l, req.dst_pages[pages - 1]));
    }
  };
  const size_t pb = src_layout.page_bytes();
  const size_t tb = tail_tokens * src_layout.bytes_per_token;
  if (req.imm_mode == KvImmMode::kPerRequest) {
    const long f = full ? new_plan(pb, req.imm_base) : -1;
    const long t = partial ? new_plan(tb, req.imm_base) : -1;
    for (int l = first_layer; l < first_layer + num_layers; ++l) add_layer(l, f, t);
  } else {
    for (int l = first_layer; l < first_layer + num_layers; ++l) {
      const uint32_t imm = req.imm_base + static_cast<uint32_t>(l);
      const long f = full ? new_plan(pb, imm) : -1;
      const long t = partial ? new_plan(tb, imm) : -1;
      add_layer(l, f, t);
    }
  }

  auto joined = std::make_shared<JoinedCallback>();
  joined->left = static_cast<int>(plans.size());
  joined->cb = std::move(cb);
  std::vector<TransferPtr> parts;
  parts.reserve(plans.size());
  for (auto& p : plans)
    parts.push_back(engine.paged_write(src, dst, p.pw, p.imm,
                                       [joined](std::exception_ptr e) { joined->part_done(e); }));
  return std::make_shared<CompositeTransfer>(std::move(parts));
}

void wait_kv_cache(TransferEngine& engine, const KvCacheLayout& dst_layout,
                   const KvTransferRequest& req, const std::string& peer, double timeout_s,
                   int first_layer, int num_layers) {
  const std::string what = "KV transfer from '" + peer + "'";
  dst_layout.validate(what);
  resolve_layers(dst_layout, first_layer, num_layers, what);
  if (timeout_s < 0) timeout_s = 30.0;
  const uint64_t per_layer = kv_writes_per_layer(dst_layout, req);
  if (per_layer == 0) throw InvalidArgument(what + ": request has 0 tokens");
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto left = [&] {
    return std::max(0.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now())
                             .count());
  };
  if (req.imm_mode == KvImmMode::kPerRequest) {
    if (first_layer != 0 || num_layers != dst_layout.num_layers)
      throw InvalidArgument(what + ": with one immediate per request only the whole request can "
                                   "be waited for (" + layer_range(first_layer, num_layers) +
                            " asked)");
    const uint64_t n = per_layer * static_cast<uint64_t>(dst_layout.num_layers);
    try {
      engine.wait_imm(req.imm_base, n, timeout_s);
    } catch (const TimeoutError&) {
      throw TimeoutError(what + ": " + std::to_string(engine.imm_count(req.imm_base)) + " of " +
                         std::to_string(n) + " page writes (" +
                         std::to_string(dst_layout.num_layers) + " layers x " +
                         std::to_string(per_layer) + " pages, immediate " +
                         std::to_string(req.imm_base) + ") arrived within " +
                         seconds(timeout_s) + " (is the prefill peer alive?)");
    }
    return;
  }
  for (int l = first_layer; l < first_layer + num_layers; ++l) {
    const uint32_t imm = req.imm_base + static_cast<uint32_t>(l);
    try {
      engine.wait_imm(imm, per_layer, left());
    } catch (const TimeoutError&) {
      throw TimeoutError(what + ": layer " + std::to_string(l) + " has " +
                         std::to_string(engine.imm_count(imm)) + " of " +
                         std::to_string(per_layer) + " pages (immediate " + std::to_string(imm) +
                         "), " +
                         (l == first_layer ? std::string("no layer before it")
                                           : layer_range(first_layer, l - first_layer)) +
                         " complete, after " + seconds(timeout_s) + " (is the prefill peer alive?)");
    }
  }
}

}  // namespace moelink::fabric
