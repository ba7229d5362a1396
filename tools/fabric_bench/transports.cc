#include "transports.h"

#include <algorithm>
#include <cstring>

namespace moelink_fabric_bench {

using namespace moelink::fabric;

Layout Layout::make(size_t peers, size_t scatter_bytes, size_t pages, size_t page_bytes,
                    size_t pingpong_bytes) {
  Layout l;
  l.scatter_bytes = scatter_bytes;
  l.pages = pages;
  l.page_bytes = page_bytes;
  l.page_stride = 2 * page_bytes;  // a gap after every page: not one contiguous block
  // Source pages in reverse order, destination pages strided by 7 (mod P):
  // neither side is contiguous or in order, as with a KV cache.
  for (size_t i = 0; i < pages; ++i) {
    l.src_pages.push_back(pages - 1 - i);
    l.dst_pages.push_back(pages % 7 ? (i * 7) % pages : i);  // a permutation
  }
  const size_t paged = std::max<size_t>(1, pages) * l.page_stride;
  l.src_bytes = std::max({peers * scatter_bytes, paged, pingpong_bytes, size_t{64}});
  l.dst_bytes = std::max({scatter_bytes, paged, pingpong_bytes, size_t{64}});
  return l;
}

EngineTransport::EngineTransport(moelink::Bootstrap& b, Buffers& buf, const Layout& l,
                                 const std::string& provider, bool yield_when_idle,
                                 int worker_cpu) {
  EngineOptions o;
  if (worker_cpu >= 0) o.worker_cpus = {worker_cpu};
  o.provider = provider;
  o.name = "rank" + std::to_string(b.rank());
  o.num_domains = 1;
  o.yield_when_idle = yield_when_idle;
  o.timeout_s = 30.0;
  e_ = TransferEngine::create(o);  // default recv_buffers (64) and max_message_bytes (4096)
  src_ = e_->register_memory(buf.src.data(), buf.src.size());
  dst_ = e_->register_memory(buf.dst.data(), buf.dst.size());
  for (const auto& blob : b.all_gather_blobs(e_->descriptor(dst_).serialize()))
    d_.push_back(MemoryDescriptor::deserialize(blob.data(), blob.size()));
  if (b.rank() == 0) {
    std::vector<MemoryDescriptor> peers(d_.begin() + 1, d_.end());
    group_ = e_->add_peer_group(peers);
    for (size_t p = 0; p < peers.size(); ++p)
      slices_.push_back(ScatterSlice{p, p * l.scatter_bytes, 0, l.scatter_bytes});
    paged_.page_bytes = l.page_bytes;
    paged_.src_stride = paged_.dst_stride = l.page_stride;
    paged_.src_pages = l.src_pages;
    paged_.dst_pages = l.dst_pages;
  } else {
    back_ = e_->add_peer_group({d_[0]});
  }
}

EngineTransport::~EngineTransport() {
  try {
    wait_ops(0);
  } catch (...) {
  }
  out_.clear();
  e_.reset();
}

RawTransport::RawTransport(moelink::Bootstrap& b, Buffers& buf, const Layout& l,
                           const std::string& provider, bool yield_when_idle)
    : f_(provider, yield_when_idle, 30.0), l_(l), src_(buf.src.data()) {
  src_mr_ = f_.register_memory(buf.src.data(), buf.src.size());
  dst_mr_ = f_.register_memory(buf.dst.data(), buf.dst.size());
  // Blob: endpoint name, remote base, key.
  std::vector<char> mine(f_.name().begin(), f_.name().end());
  const uint64_t base = f_.remote_base(buf.dst.data()), key = dst_mr_.key;
  mine.insert(mine.end(), reinterpret_cast<const char*>(&base),
              reinterpret_cast<const char*>(&base) + 8);
  mine.insert(mine.end(), reinterpret_cast<const char*>(&key),
              reinterpret_cast<const char*>(&key) + 8);
  for (const auto& blob : b.all_gather_blobs(mine)) {
    RawFabric::Remote r;
    const size_t n = blob.size() - 16;
    std::memcpy(&r.base, blob.data() + n, 8);
    std::memcpy(&r.key, blob.data() + n + 8, 8);
    // Like the engine: the sender knows every peer, a peer only the sender.
    const bool needed = b.rank() == 0 || remote_.empty();
    if (needed && static_cast<int>(remote_.size()) != b.rank())
      r.addr = f_.insert(std::string(blob.data(), n));
    remote_.push_back(r);
  }
}

RawTransport::~RawTransport() {
  try {
    wait_ops(0);
  } catch (...) {
  }
  if (src_mr_.mr) fi_close(&src_mr_.mr->fid);
  if (dst_mr_.mr) fi_close(&dst_mr_.mr->fid);
}

}  // namespace moelink_fabric_bench
