// The baseline of moelink-fabric-bench: the same operations written directly
// on libfabric, with what the TransferEngine does on the wire and nothing
// more. Kept deliberately comparable to src/fabric:
//  * fi_getinfo with the engine's hints (FI_EP_RDM, FI_MSG|FI_RMA|..., first
//    with FI_HMEM then without, cq_data_size >= 4, the exact provider stack),
//    one domain, one RDM endpoint, FI_CQ_FORMAT_DATA CQ of 4096 entries,
//    FI_AV_TABLE; the same MR access flags and FI_MR_* handling;
//  * every write is fi_writemsg with one local and one remote iov, the
//    immediate as FI_REMOTE_CQ_DATA, FI_COMPLETION, no FI_DELIVERY_COMPLETE;
//  * the same number of posted receives (64 x 4096 bytes) and their repost
//    under FI_RX_CQ_DATA;
//  * completions read 32 at a time and classified by flags, like the engine;
//  * the same polling policy: once 200 polls in a row and 100 us found
//    nothing, sleep 50 us per iteration (the engine waiters' yield_when_idle
//    policy), or busy-poll when that is off.
// Unlike the engine, everything runs on the calling thread (no worker, no
// queue, no per-request allocation, no operation objects).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

namespace moelink_fabric_bench {

class RawFabric {
 public:
  struct Mr {
    fid_mr* mr = nullptr;
    void* desc = nullptr;
    uint64_t key = 0;
  };
  struct Remote {  // a peer's buffer
    fi_addr_t addr = FI_ADDR_UNSPEC;
    uint64_t base = 0;
    uint64_t key = 0;
  };

  RawFabric(const std::string& provider, bool yield_when_idle, double timeout_s);
  ~RawFabric();
  RawFabric(const RawFabric&) = delete;
  RawFabric& operator=(const RawFabric&) = delete;

  const std::string& provider_name() const { return provider_name_; }
  bool hmem() const { return hmem_; }
  const std::string& name() const { return name_; }
  Mr register_memory(void* ptr, size_t size);
  uint64_t remote_base(const void* ptr) const {
    return virt_addr_ ? reinterpret_cast<uint64_t>(ptr) : 0;
  }
  fi_addr_t insert(const std::string& name);

  // Posts one write (retrying on -FI_EAGAIN while reading completions).
  void write(const Remote& dst, uint64_t dst_offset, const void* buf, size_t len, void* desc,
             bool has_imm, uint32_t imm);
  // Ends an "operation": the writes posted since the last mark.
  void mark_op() { ops_.push_back(posted_); }
  // Waits until at most n operations have writes without local completion.
  void wait_ops(size_t n);
  // Waits until `imm` arrived n times, then consumes n.
  void wait_imm(uint32_t imm, uint64_t n);
  // For a caller that drives two endpoints from one thread (cpu_cost.cc):
  // one CQ read; writes without local completion; consume one `imm`.
  int progress() { return poll(); }
  uint64_t outstanding() const { return posted_ - completed_; }
  bool take_imm(uint32_t imm) {
    auto it = imms_.find(imm);
    if (it == imms_.end() || it->second == 0) return false;
    --it->second;
    return true;
  }

 private:
  int poll();
  template <class Pred>
  void progress_until(Pred pred, const char* what);
  void repost(fi_context2* c);

  bool yield_;
  double timeout_s_;
  std::string provider_name_;
  bool hmem_ = false, virt_addr_ = false, prov_key_ = false, mr_endpoint_ = false;
  bool rx_cq_data_ = false;
  uint64_t next_key_ = 1;
  fi_info* list_ = nullptr;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::string name_;

  std::vector<fi_context2> tx_ctx_;
  std::vector<fi_context2*> free_ctx_;
  std::vector<char> recv_mem_;
  Mr recv_mr_;
  std::vector<fi_context2> rx_ctx_;
  static constexpr size_t kRecvBytes = 4096;
  static constexpr int kRecvBuffers = 64;

  uint64_t posted_ = 0, completed_ = 0;
  std::deque<uint64_t> ops_;  // cumulative posted count at each op's end
  std::unordered_map<uint32_t, uint64_t> imms_;
  int idle_ = 0;  // polls in a row without work (a post counts as work)
  std::chrono::steady_clock::time_point quiet_{};  // the first of them
};

}  // namespace moelink_fabric_bench
