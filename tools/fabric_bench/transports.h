// The two implementations measured by moelink-fabric-bench, behind the same
// small interface so that one piece of benchmark code (ops.cc) drives both:
// EngineTransport calls the TransferEngine's public API, RawTransport posts
// the identical writes itself through RawFabric.
//
// Rank 0 is the sender; ranks 1..N are the peers. Every rank has a source
// buffer `src` and a destination buffer `dst`; the writes go from the
// sender's src to the peers' dst (and acknowledgements back to the sender's
// dst). Interface:
//   post_scatter(imm)       S bytes to each peer (peer p: src + (p-1)*S -> dst + 0), each with imm
//   post_barrier(imm)       a zero-byte write with imm to each peer
//   post_paged(peer, imm)   P pages of B bytes to one peer, each with imm
//   post_write(peer, len, imm)  one write from src + 0 to peer's dst + 0
//   post_ack(imm)           (peers) a zero-byte write with imm to the sender
//   wait_ops(n)             until at most n posted operations lack local completion
//   wait_imm(imm, n)        until imm arrived n times (consumed)
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "moelink/bootstrap.h"
#include "moelink/transfer_engine.h"
#include "raw_fabric.h"

namespace moelink_fabric_bench {

struct Layout {
  size_t scatter_bytes = 4096;  // S, per peer
  size_t pages = 32;            // P
  size_t page_bytes = 4096;     // B
  size_t page_stride = 8192;    // pages are B bytes every `stride` bytes
  std::vector<uint64_t> src_pages, dst_pages;  // page permutations
  size_t src_bytes = 0, dst_bytes = 0;
  static Layout make(size_t peers, size_t scatter_bytes, size_t pages, size_t page_bytes,
                     size_t pingpong_bytes);
};

// Buffers shared by both implementations (registered by each in turn).
struct Buffers {
  std::vector<uint8_t> src, dst;
};

class EngineTransport {
 public:
  // worker_cpu: the CPU of the engine's worker thread (-1: not pinned).
  EngineTransport(moelink::Bootstrap& b, Buffers& buf, const Layout& layout,
                  const std::string& provider, bool yield_when_idle, int worker_cpu);
  ~EngineTransport();
  std::string provider_name() const { return e_->provider(); }
  bool hmem() const { return e_->hmem(); }

  void post_scatter(uint32_t imm) { out_.push_back(e_->scatter(group_, src_, slices_, imm)); }
  void post_barrier(uint32_t imm) { out_.push_back(e_->barrier(group_, imm)); }
  void post_paged(int peer, uint32_t imm) {
    out_.push_back(e_->paged_write(src_, d_[peer], paged_, imm));
  }
  void post_write(int peer, size_t len, uint32_t imm) {
    out_.push_back(e_->write(src_, 0, d_[peer], 0, len, imm));
  }
  void post_ack(uint32_t imm) { out_.push_back(e_->barrier(back_, imm)); }
  void wait_ops(size_t n) {
    while (out_.size() > n) {
      out_.front()->wait();
      out_.pop_front();
    }
  }
  void wait_imm(uint32_t imm, uint64_t n) { e_->wait_imm(imm, n); }

 private:
  std::unique_ptr<moelink::fabric::TransferEngine> e_;
  moelink::fabric::MemoryRegion src_, dst_;
  std::vector<moelink::fabric::MemoryDescriptor> d_;  // every rank's dst
  moelink::fabric::GroupId group_ = -1, back_ = -1;
  std::vector<moelink::fabric::ScatterSlice> slices_;
  moelink::fabric::PagedWrite paged_;
  std::deque<moelink::fabric::TransferPtr> out_;
};

class RawTransport {
 public:
  RawTransport(moelink::Bootstrap& b, Buffers& buf, const Layout& layout,
               const std::string& provider, bool yield_when_idle);
  ~RawTransport();
  std::string provider_name() const { return f_.provider_name(); }
  bool hmem() const { return f_.hmem(); }

  void post_scatter(uint32_t imm) {
    for (size_t p = 1; p < remote_.size(); ++p)
      f_.write(remote_[p], 0, src_ + (p - 1) * l_.scatter_bytes, l_.scatter_bytes, src_mr_.desc,
               true, imm);
    f_.mark_op();
  }
  void post_barrier(uint32_t imm) {
    for (size_t p = 1; p < remote_.size(); ++p)
      f_.write(remote_[p], 0, nullptr, 0, nullptr, true, imm);
    f_.mark_op();
  }
  void post_paged(int peer, uint32_t imm) {
    for (size_t i = 0; i < l_.pages; ++i)
      f_.write(remote_[peer], l_.dst_pages[i] * l_.page_stride,
               src_ + l_.src_pages[i] * l_.page_stride, l_.page_bytes, src_mr_.desc, true, imm);
    f_.mark_op();
  }
  void post_write(int peer, size_t len, uint32_t imm) {
    f_.write(remote_[peer], 0, src_, len, src_mr_.desc, true, imm);
    f_.mark_op();
  }
  void post_ack(uint32_t imm) {
    f_.write(remote_[0], 0, nullptr, 0, nullptr, true, imm);
    f_.mark_op();
  }
  void wait_ops(size_t n) { f_.wait_ops(n); }
  void wait_imm(uint32_t imm, uint64_t n) { f_.wait_imm(imm, n); }

 private:
  RawFabric f_;
  const Layout& l_;
  uint8_t* src_;
  RawFabric::Mr src_mr_, dst_mr_;
  std::vector<RawFabric::Remote> remote_;  // every rank's dst (own entry unused)
};

}  // namespace moelink_fabric_bench
