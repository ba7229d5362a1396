// Fake QP layer for the verbs backend's tests: implements the Device / Qp /
// Cq interfaces of src/fabric/verbs/qp.h without any NIC. It
//  * checks QP state steps in the order real verbs require
//    (RESET->INIT->RTR->RTS; RC RTR needs a remote) and that sends are
//    posted only in RTS, receives only from INIT;
//  * records every posted WR deep-copied (sges, inline bytes read at post
//    time, as the NIC would), with which ibv_post_send call it came in;
//  * enforces the granted caps like a NIC would reject them: chain longer
//    than the free send queue, too many sges, inline over max_inline_data;
//  * lets tests inject a post failure at a given WR and push completions;
//  * FakeFabric moves UD sends to the addressed UD QP's posted receives
//    (GRH room + payload), optionally dropping or duplicating them, and
//    executes RC work requests between its devices (progress()):
//      - RDMA_WRITE[_WITH_IMM] copies the bytes into the target device's
//        registered memory, checking the rkey and range (else
//        IBV_WC_REM_ACCESS_ERR) and the source's lkey (IBV_WC_LOC_PROT_ERR);
//        WITH_IMM consumes the target QP's next posted receive and completes
//        it (IBV_WC_RECV_RDMA_WITH_IMM, imm_data as posted, i.e. big-endian);
//      - SEND consumes the next receive and scatters into its sges (too
//        small: IBV_WC_LOC_LEN_ERR there, IBV_WC_REM_INV_REQ_ERR here);
//      - no posted receive: RNR -- the WR waits (and is counted in
//        rnr_naks) and fails with IBV_WC_RNR_RETRY_EXC_ERR after
//        rnr_retry_passes progress passes (-1 = forever, rnr_retry 7);
//      - the responder must be an RC QP in RTR/RTS connected back to the
//        requester (else it waits, then IBV_WC_RETRY_EXC_ERR after
//        retry_passes), and the requester's PSN must be the one the
//        responder expects (else IBV_WC_RETRY_EXC_ERR at once);
//      - in order per QP; a completion only for signaled WRs, which also
//        frees the send-queue slots of the unsignaled WRs before it; an
//        error completes that WR in error (always, signaled or not), moves
//        the QP to ERROR and flushes every later WR and every posted receive
//        with IBV_WC_WR_FLUSH_ERR, one completion each;
//      - error completions carry a deliberately wrong opcode (verbs leaves it
//        undefined), so code that classifies them by opcode fails tests.
//    With auto_progress, every poll of a CQ of one of its devices runs
//    progress() first: the "NIC" works while someone polls.
//  * CQs count overruns (more entries queued than their depth).
// Thread-safe through one process-wide lock (fake_mutex()) so engines on
// several threads can share it; tests inspecting fake state while engines
// run take FakeLock.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "fabric/verbs/qp.h"

namespace moelink::fabric::verbs::fake {

std::recursive_mutex& fake_mutex();
using FakeLock = std::lock_guard<std::recursive_mutex>;

struct PostedSend {
  ibv_send_wr wr{};  // next and sg_list cleared; see sges
  std::vector<ibv_sge> sges;
  std::vector<uint8_t> inline_bytes;  // IBV_SEND_INLINE: the data at post time
  int call = 0;                       // which post_send call (doorbell)
  bool delivered = false;             // UD: moved by FakeFabric
};

struct PostedRecv {
  ibv_recv_wr wr{};
  std::vector<ibv_sge> sges;
  bool consumed = false;
};

class FakeDevice;
class FakeFabric;

class FakeCq final : public Cq {
 public:
  explicit FakeCq(FakeDevice* dev = nullptr, int depth = 0) : dev_(dev), depth_(depth) {}
  int poll(std::span<ibv_wc> out) override;
  void push(const ibv_wc& wc);
  size_t pending() const { return q_.size(); }
  uint64_t overruns = 0;  // pushes beyond depth (a real CQ would be broken)

 private:
  FakeDevice* dev_;
  int depth_;
  std::deque<ibv_wc> q_;
};

class FakeQp final : public Qp {
 public:
  FakeQp(FakeDevice& dev, const QpInit& init, uint32_t qpn, const QpCaps& granted);
  ~FakeQp() override;

  QpType type() const override { return type_; }
  uint32_t qpn() const override { return qpn_; }
  const QpCaps& caps() const override { return caps_; }
  QpState state() const override { return state_; }
  void to_init() override;
  void to_rtr(const RcRemote* remote) override;
  void to_rts(uint32_t sq_psn) override;
  void post_send(ibv_send_wr* wr) override;
  void post_recv(ibv_recv_wr* wr) override;
  // What the NIC does on a fatal error (or ibv_modify_qp to ERR).
  void to_error();

  // Inspection and control for tests.
  std::vector<PostedSend> sends;
  std::vector<PostedRecv> recvs;
  int send_calls = 0, recv_calls = 0;
  std::optional<RcRemote> remote;
  std::optional<uint32_t> sq_psn;
  std::vector<QpState> history;
  uint32_t qkey = 0;
  uint32_t outstanding = 0;             // send WRs not yet retired
  std::optional<int> fail_send_at;      // reject this WR index of the next post
  void retire(uint32_t n) { outstanding -= n; }
  FakeCq* send_cq() const { return send_cq_; }
  FakeCq* recv_cq() const { return recv_cq_; }
  FakeDevice& device() const { return dev_; }
  size_t unconsumed_recvs() const;

  // RC execution state (FakeFabric).
  size_t next_exec = 0;        // first send not executed yet
  size_t next_recv = 0;        // no unconsumed receive before this one
  uint32_t send_psn = 0;       // next PSN this QP sends
  uint32_t expect_psn = 0;     // next PSN this QP accepts
  int stall = 0;               // progress passes the head WR has waited
  uint32_t done_unsignaled = 0;  // executed since the last signaled WR

 private:
  void step(QpState from, QpState to);
  FakeDevice& dev_;
  QpType type_;
  uint32_t qpn_;
  QpCaps caps_;
  QpState state_ = QpState::kReset;
  FakeCq* send_cq_;
  FakeCq* recv_cq_;
};

class FakeAh final : public AddressHandle {
 public:
  FakeAh(FakeDevice& dev, const PortAddress& dest) : dest(dest), dev_(dev) {}
  ~FakeAh() override;
  ibv_ah* get() const override { return const_cast<ibv_ah*>(&ah_); }
  PortAddress dest;

 private:
  FakeDevice& dev_;
  ibv_ah ah_{};  // only its address is used, as a handle
};

class FakeMr final : public Mr {
 public:
  FakeMr(FakeDevice& dev, void* a, size_t n, uint32_t key);
  ~FakeMr() override;
  void* addr() const override { return a_; }
  size_t length() const override { return n_; }
  uint32_t lkey() const override { return key_; }
  uint32_t rkey() const override { return key_ | 0x80000000u; }
  bool covers(uint64_t addr, uint64_t len) const;

 private:
  FakeDevice& dev_;
  void* a_;
  size_t n_;
  uint32_t key_;
};

class FakeDevice final : public Device {
 public:
  // lid distinguishes devices; qpns start at lid * 0x1000 + 1.
  explicit FakeDevice(uint16_t lid);
  ~FakeDevice() override;
  std::string name() const override { return "fake" + std::to_string(address_.lid); }
  const PortAddress& address() const override { return address_; }
  std::unique_ptr<Cq> create_cq(int depth) override;
  std::unique_ptr<Qp> create_qp(const QpInit& init) override;
  std::unique_ptr<AddressHandle> create_ah(const PortAddress& dest) override;
  std::unique_ptr<Mr> register_memory(void* addr, size_t length) override;

  // Emulates a device that rounds caps (e.g. grants less inline).
  std::optional<uint32_t> grant_max_inline;
  std::optional<std::string> fail_create_qp;  // next create_qp throws this
  std::vector<FakeQp*> qps;                   // live QPs, in creation order
  FakeQp* find(uint32_t qpn) const;
  size_t ah_count() const { return ahs_.size(); }
  const FakeAh* ah_of(const ibv_ah* h) const;
  // The live registration with this lkey / rkey covering [addr, addr+len).
  const FakeMr* mr_by_lkey(uint32_t lkey, uint64_t addr, uint64_t len) const;
  const FakeMr* mr_by_rkey(uint32_t rkey, uint64_t addr, uint64_t len) const;
  FakeFabric* fabric() const { return fabric_; }

 private:
  PortAddress address_;
  uint32_t next_qpn_;
  uint32_t next_key_ = 1;
  std::vector<const FakeAh*> ahs_;  // not owned (held by callers)
  std::vector<const FakeMr*> mrs_;  // not owned
  FakeFabric* fabric_ = nullptr;
  friend class FakeQp;
  friend class FakeAh;
  friend class FakeMr;
  friend class FakeFabric;
};

// Delivers UD datagrams and executes RC work requests between FakeDevices.
class FakeFabric {
 public:
  FakeFabric() = default;
  ~FakeFabric();
  FakeFabric(const FakeFabric&) = delete;
  FakeFabric& operator=(const FakeFabric&) = delete;

  void add(FakeDevice& d);
  void remove(FakeDevice& d);  // called by ~FakeDevice
  // Moves every undelivered UD send. filter returns how many copies to
  // deliver (0 = drop, 2 = duplicate); default 1. Returns datagrams moved.
  int pump(const std::function<int(const std::vector<uint8_t>&)>& filter = {});
  // pump(ud_filter), then executes the RC send queues of every device.
  void progress();

  bool auto_progress = false;
  int rnr_retry_passes = -1;  // -1: RNR waits forever (rnr_retry = 7)
  int retry_passes = 2000;    // unreachable responder: IBV_WC_RETRY_EXC_ERR after
  std::function<int(const std::vector<uint8_t>&)> ud_filter;
  uint64_t rnr_naks = 0;      // progress passes a WR found no receive
  uint64_t rc_executed = 0;   // RC WRs executed successfully

 private:
  enum class Outcome { kDone, kStall, kError };
  struct Exec {
    Outcome outcome;
    ibv_wc_status status = IBV_WC_SUCCESS;
  };
  int pump_locked(const std::function<int(const std::vector<uint8_t>&)>& filter);
  void run_rc(FakeQp& q);
  Exec execute(FakeQp& q, const PostedSend& s);
  Exec stall_or(FakeQp& q, ibv_wc_status status, int limit);
  void flush(FakeQp& q);
  FakeQp* find_qp(const PortAddress& addr, uint32_t qpn) const;
  std::vector<FakeDevice*> devices_;
  friend class FakeCq;
};

}  // namespace moelink::fabric::verbs::fake
