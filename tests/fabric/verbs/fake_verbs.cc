#include "fake_verbs.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs::fake {

std::recursive_mutex& fake_mutex() {
  static std::recursive_mutex mu;
  return mu;
}

int FakeCq::poll(std::span<ibv_wc> out) {
  FakeLock lock(fake_mutex());
  if (dev_ && dev_->fabric() && dev_->fabric()->auto_progress) dev_->fabric()->progress();
  int n = 0;
  while (n < static_cast<int>(out.size()) && !q_.empty()) {
    out[n++] = q_.front();
    q_.pop_front();
  }
  return n;
}

void FakeCq::push(const ibv_wc& wc) {
  FakeLock lock(fake_mutex());
  if (depth_ > 0 && q_.size() >= static_cast<size_t>(depth_)) ++overruns;
  q_.push_back(wc);
}

FakeQp::FakeQp(FakeDevice& dev, const QpInit& init, uint32_t qpn, const QpCaps& granted)
    : qkey(init.qkey),
      dev_(dev),
      type_(init.type),
      qpn_(qpn),
      caps_(granted),
      send_cq_(dynamic_cast<FakeCq*>(init.send_cq)),
      recv_cq_(dynamic_cast<FakeCq*>(init.recv_cq)) {
  if (!send_cq_ || !recv_cq_) throw FabricError("fake create_qp: CQs not from the fake layer");
  history.push_back(QpState::kReset);
}

FakeQp::~FakeQp() {
  FakeLock lock(fake_mutex());
  std::erase(dev_.qps, this);
}

void FakeQp::step(QpState from, QpState to) {
  if (state_ != from) {
    throw FabricError(std::string("fake ibv_modify_qp: QP ") + std::to_string(qpn_) + " " +
                      to_string(state_) + " -> " + to_string(to) + " (needs " + to_string(from) +
                      ")");
  }
  state_ = to;
  history.push_back(to);
}

void FakeQp::to_init() {
  FakeLock lock(fake_mutex());
  step(QpState::kReset, QpState::kInit);
}

void FakeQp::to_rtr(const RcRemote* r) {
  FakeLock lock(fake_mutex());
  if (type_ == QpType::kRc && !r) throw FabricError("fake: RC QP to RTR without a remote");
  step(QpState::kInit, QpState::kRtr);
  if (r) {
    remote = *r;
    expect_psn = r->psn & 0xffffff;
  }
}

void FakeQp::to_rts(uint32_t psn) {
  FakeLock lock(fake_mutex());
  step(QpState::kRtr, QpState::kRts);
  sq_psn = psn;
  send_psn = psn & 0xffffff;
}

void FakeQp::to_error() {
  FakeLock lock(fake_mutex());
  if (state_ == QpState::kError) return;
  state_ = QpState::kError;
  history.push_back(QpState::kError);
}

size_t FakeQp::unconsumed_recvs() const {
  FakeLock lock(fake_mutex());
  size_t n = 0;
  for (size_t i = next_recv; i < recvs.size(); ++i) n += !recvs[i].consumed;
  return n;
}

void FakeQp::post_send(ibv_send_wr* head) {
  FakeLock lock(fake_mutex());
  const int call = ++send_calls;
  auto reject = [&](int i, const std::string& why) {
    throw FabricError("fake ibv_post_send on QP " + std::to_string(qpn_) + ": WR " +
                      std::to_string(i) + " rejected: " + why);
  };
  // Real verbs stop at the first bad WR; the ones before it are posted.
  int i = 0;
  for (ibv_send_wr* w = head; w; w = w->next, ++i) {
    if (state_ != QpState::kRts) reject(i, std::string("QP in ") + to_string(state_));
    if (fail_send_at && *fail_send_at == i) {
      fail_send_at.reset();
      reject(i, "injected failure");
    }
    if (outstanding >= caps_.max_send_wr) reject(i, "send queue full (ENOMEM)");
    if (w->num_sge < 0 || static_cast<uint32_t>(w->num_sge) > caps_.max_send_sge) {
      reject(i, "num_sge " + std::to_string(w->num_sge) + " > max_send_sge");
    }
    PostedSend p;
    p.wr = *w;
    p.wr.next = nullptr;
    p.wr.sg_list = nullptr;
    p.call = call;
    size_t total = 0;
    for (int s = 0; s < w->num_sge; ++s) {
      p.sges.push_back(w->sg_list[s]);
      total += w->sg_list[s].length;
    }
    if (w->send_flags & IBV_SEND_INLINE) {
      if (total > caps_.max_inline_data) {
        reject(i, "inline " + std::to_string(total) + " bytes > max_inline_data");
      }
      for (const ibv_sge& s : p.sges) {
        const auto* b = reinterpret_cast<const uint8_t*>(s.addr);
        p.inline_bytes.insert(p.inline_bytes.end(), b, b + s.length);
      }
    }
    ++outstanding;
    sends.push_back(std::move(p));
  }
}

void FakeQp::post_recv(ibv_recv_wr* head) {
  FakeLock lock(fake_mutex());
  ++recv_calls;
  int i = 0;
  for (ibv_recv_wr* w = head; w; w = w->next, ++i) {
    if (state_ == QpState::kReset || state_ == QpState::kError) {
      throw FabricError("fake ibv_post_recv on QP " + std::to_string(qpn_) + ": WR " +
                        std::to_string(i) + " rejected: QP in " + to_string(state_));
    }
    if (recvs.size() - next_recv >= caps_.max_recv_wr && unconsumed_recvs() >= caps_.max_recv_wr) {
      throw FabricError("fake ibv_post_recv on QP " + std::to_string(qpn_) + ": WR " +
                        std::to_string(i) + " rejected: receive queue full (ENOMEM)");
    }
    PostedRecv p;
    p.wr = *w;
    p.wr.next = nullptr;
    p.wr.sg_list = nullptr;
    for (int s = 0; s < w->num_sge; ++s) p.sges.push_back(w->sg_list[s]);
    recvs.push_back(std::move(p));
  }
}

FakeAh::~FakeAh() {
  FakeLock lock(fake_mutex());
  std::erase(dev_.ahs_, this);
}

FakeMr::FakeMr(FakeDevice& dev, void* a, size_t n, uint32_t key)
    : dev_(dev), a_(a), n_(n), key_(key) {
  dev_.mrs_.push_back(this);
}

FakeMr::~FakeMr() {
  FakeLock lock(fake_mutex());
  std::erase(dev_.mrs_, this);
}

bool FakeMr::covers(uint64_t addr, uint64_t len) const {
  const auto base = reinterpret_cast<uint64_t>(a_);
  return addr >= base && len <= n_ && addr - base <= n_ - len;
}

FakeDevice::FakeDevice(uint16_t lid) : next_qpn_(uint32_t{lid} * 0x1000 + 1) {
  address_.lid = lid;
  address_.gid[15] = static_cast<uint8_t>(lid);
}

FakeDevice::~FakeDevice() {
  FakeLock lock(fake_mutex());
  if (fabric_) fabric_->remove(*this);
}

std::unique_ptr<Cq> FakeDevice::create_cq(int depth) {
  FakeLock lock(fake_mutex());
  return std::make_unique<FakeCq>(this, depth);
}

std::unique_ptr<Qp> FakeDevice::create_qp(const QpInit& init) {
  FakeLock lock(fake_mutex());
  if (fail_create_qp) {
    std::string why = *fail_create_qp;
    fail_create_qp.reset();
    throw FabricError("fake ibv_create_qp: " + why);
  }
  QpCaps granted = init.caps;
  if (grant_max_inline) granted.max_inline_data = *grant_max_inline;
  auto qp = std::make_unique<FakeQp>(*this, init, next_qpn_++, granted);
  qps.push_back(qp.get());
  return qp;
}

std::unique_ptr<AddressHandle> FakeDevice::create_ah(const PortAddress& dest) {
  FakeLock lock(fake_mutex());
  auto ah = std::make_unique<FakeAh>(*this, dest);
  ahs_.push_back(ah.get());
  return ah;
}

std::unique_ptr<Mr> FakeDevice::register_memory(void* addr, size_t length) {
  FakeLock lock(fake_mutex());
  // Keys differ across devices, as on real NICs' separate key spaces, so an
  // rkey of the wrong device (domain) is caught as a remote access error.
  return std::make_unique<FakeMr>(*this, addr, length, (uint32_t{address_.lid} << 16) | next_key_++);
}

FakeQp* FakeDevice::find(uint32_t qpn) const {
  for (FakeQp* q : qps) {
    if (q->qpn() == qpn) return q;
  }
  return nullptr;
}

const FakeAh* FakeDevice::ah_of(const ibv_ah* h) const {
  for (const FakeAh* a : ahs_) {
    if (a->get() == h) return a;
  }
  return nullptr;
}

const FakeMr* FakeDevice::mr_by_lkey(uint32_t lkey, uint64_t addr, uint64_t len) const {
  for (const FakeMr* m : mrs_)
    if (m->lkey() == lkey && m->covers(addr, len)) return m;
  return nullptr;
}

const FakeMr* FakeDevice::mr_by_rkey(uint32_t rkey, uint64_t addr, uint64_t len) const {
  for (const FakeMr* m : mrs_)
    if (m->rkey() == rkey && m->covers(addr, len)) return m;
  return nullptr;
}

FakeFabric::~FakeFabric() {
  FakeLock lock(fake_mutex());
  for (FakeDevice* d : devices_) d->fabric_ = nullptr;
}

void FakeFabric::add(FakeDevice& d) {
  FakeLock lock(fake_mutex());
  devices_.push_back(&d);
  d.fabric_ = this;
}

void FakeFabric::remove(FakeDevice& d) {
  FakeLock lock(fake_mutex());
  std::erase(devices_, &d);
  d.fabric_ = nullptr;
}

int FakeFabric::pump(const std::function<int(const std::vector<uint8_t>&)>& filter) {
  FakeLock lock(fake_mutex());
  return pump_locked(filter);
}

int FakeFabric::pump_locked(const std::function<int(const std::vector<uint8_t>&)>& filter) {
  int moved = 0;
  for (FakeDevice* src : std::vector<FakeDevice*>(devices_)) {
    for (FakeQp* q : std::vector<FakeQp*>(src->qps)) {
      if (q->type() != QpType::kUd) continue;
      for (PostedSend& s : q->sends) {
        if (s.delivered) continue;
        s.delivered = true;
        // The sender's buffer is read "on the wire": sends copy out now.
        std::vector<uint8_t> bytes = s.inline_bytes;
        if (bytes.empty()) {
          for (const ibv_sge& g : s.sges) {
            const auto* b = reinterpret_cast<const uint8_t*>(g.addr);
            bytes.insert(bytes.end(), b, b + g.length);
          }
        }
        ibv_wc done{};
        done.wr_id = s.wr.wr_id;
        done.status = IBV_WC_SUCCESS;
        done.opcode = IBV_WC_SEND;
        done.qp_num = q->qpn();
        q->retire(1);
        if (s.wr.send_flags & IBV_SEND_SIGNALED) q->send_cq()->push(done);
        const FakeAh* ah = src->ah_of(s.wr.wr.ud.ah);
        if (!ah) continue;  // an unknown AH: lost
        const int copies = filter ? filter(bytes) : 1;
        for (int c = 0; c < copies; ++c) {
          for (FakeDevice* dst : devices_) {
            if (!(dst->address() == ah->dest)) continue;
            FakeQp* r = dst->find(s.wr.wr.ud.remote_qpn);
            if (!r || r->type() != QpType::kUd || r->qkey != s.wr.wr.ud.remote_qkey) continue;
            if (r->state() != QpState::kRtr && r->state() != QpState::kRts) continue;
            while (r->next_recv < r->recvs.size() && r->recvs[r->next_recv].consumed)
              ++r->next_recv;
            if (r->next_recv == r->recvs.size()) continue;  // no receive posted: UD drops it
            PostedRecv& it = r->recvs[r->next_recv++];
            it.consumed = true;
            const ibv_sge& g = it.sges.at(0);
            const size_t n = 40 + bytes.size();
            if (n > g.length) continue;  // too long for the receive: dropped
            auto* out = reinterpret_cast<uint8_t*>(g.addr);
            std::memset(out, 0, 40);  // GRH room
            std::memcpy(out + 40, bytes.data(), bytes.size());
            ibv_wc wc{};
            wc.wr_id = it.wr.wr_id;
            wc.status = IBV_WC_SUCCESS;
            wc.opcode = IBV_WC_RECV;
            wc.byte_len = static_cast<uint32_t>(n);
            wc.qp_num = r->qpn();
            wc.src_qp = q->qpn();
            r->recv_cq()->push(wc);
            ++moved;
          }
        }
      }
    }
  }
  return moved;
}

void FakeFabric::progress() {
  FakeLock lock(fake_mutex());
  pump_locked(ud_filter);
  for (FakeDevice* d : std::vector<FakeDevice*>(devices_))
    for (FakeQp* q : std::vector<FakeQp*>(d->qps))
      if (q->type() == QpType::kRc) run_rc(*q);
}

FakeQp* FakeFabric::find_qp(const PortAddress& addr, uint32_t qpn) const {
  for (FakeDevice* d : devices_)
    if (d->address() == addr) return d->find(qpn);
  return nullptr;
}

FakeFabric::Exec FakeFabric::stall_or(FakeQp& q, ibv_wc_status status, int limit) {
  if (limit >= 0 && ++q.stall > limit) return {Outcome::kError, status};
  return {Outcome::kStall};
}

namespace {

// Verbs leave the opcode of an error completion undefined; this value is
// none of the real ones, so classifying error completions by opcode fails.
constexpr auto kUndefinedOpcode = static_cast<ibv_wc_opcode>(0xee);

PostedRecv* next_receive(FakeQp& r) {
  while (r.next_recv < r.recvs.size() && r.recvs[r.next_recv].consumed) ++r.next_recv;
  return r.next_recv < r.recvs.size() ? &r.recvs[r.next_recv] : nullptr;
}

void complete_recv(FakeQp& r, PostedRecv& rv, ibv_wc_status status, ibv_wc_opcode opcode,
                   uint32_t len, const ibv_send_wr* imm_from, uint32_t src_qp) {
  rv.consumed = true;
  ibv_wc wc{};
  wc.wr_id = rv.wr.wr_id;
  wc.status = status;
  wc.opcode = status == IBV_WC_SUCCESS ? opcode : kUndefinedOpcode;
  wc.byte_len = len;
  wc.qp_num = r.qpn();
  wc.src_qp = src_qp;
  if (imm_from) {
    wc.wc_flags = IBV_WC_WITH_IMM;
    wc.imm_data = imm_from->imm_data;  // as posted: already in wire (big-endian) order
  }
  r.recv_cq()->push(wc);
}

}  // namespace

FakeFabric::Exec FakeFabric::execute(FakeQp& q, const PostedSend& s) {
  FakeQp* r = q.remote ? find_qp(q.remote->addr, q.remote->qpn) : nullptr;
  const bool reachable = r && r->type() == QpType::kRc &&
                         (r->state() == QpState::kRtr || r->state() == QpState::kRts) &&
                         r->remote && r->remote->qpn == q.qpn();
  if (!reachable) return stall_or(q, IBV_WC_RETRY_EXC_ERR, retry_passes);
  // A responder expecting another PSN drops or NAKs the packet: mis-wired
  // QPs (PSNs swapped in a handshake) end in transport retries exceeded.
  if (q.send_psn != r->expect_psn) return {Outcome::kError, IBV_WC_RETRY_EXC_ERR};
  // The NIC reads the source now (inline data was copied at post).
  std::vector<uint8_t> bytes;
  if (s.wr.send_flags & IBV_SEND_INLINE) {
    bytes = s.inline_bytes;
  } else {
    for (const ibv_sge& g : s.sges) {
      if (!q.device().mr_by_lkey(g.lkey, g.addr, g.length))
        return {Outcome::kError, IBV_WC_LOC_PROT_ERR};
      const auto* b = reinterpret_cast<const uint8_t*>(g.addr);
      bytes.insert(bytes.end(), b, b + g.length);
    }
  }
  const auto len = static_cast<uint32_t>(bytes.size());
  switch (s.wr.opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: {
      const bool imm = s.wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
      PostedRecv* rv = imm ? next_receive(*r) : nullptr;
      if (imm && !rv) {
        ++rnr_naks;
        return stall_or(q, IBV_WC_RNR_RETRY_EXC_ERR, rnr_retry_passes);
      }
      if (len > 0) {  // zero-byte writes carry no address to check
        const uint64_t at = s.wr.wr.rdma.remote_addr;
        if (!r->device().mr_by_rkey(s.wr.wr.rdma.rkey, at, len))
          return {Outcome::kError, IBV_WC_REM_ACCESS_ERR};
        std::memcpy(reinterpret_cast<void*>(at), bytes.data(), len);
      }
      if (imm) complete_recv(*r, *rv, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, len, &s.wr, q.qpn());
      break;
    }
    case IBV_WR_SEND: {
      PostedRecv* rv = next_receive(*r);
      if (!rv) {
        ++rnr_naks;
        return stall_or(q, IBV_WC_RNR_RETRY_EXC_ERR, rnr_retry_passes);
      }
      uint64_t room = 0;
      for (const ibv_sge& g : rv->sges) room += g.length;
      if (len > room) {
        complete_recv(*r, *rv, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, 0, nullptr, q.qpn());
        r->to_error();
        return {Outcome::kError, IBV_WC_REM_INV_REQ_ERR};
      }
      uint64_t done = 0;
      for (const ibv_sge& g : rv->sges) {
        const uint64_t n = std::min<uint64_t>(g.length, len - done);
        if (n == 0) break;
        std::memcpy(reinterpret_cast<void*>(g.addr), bytes.data() + done, n);
        done += n;
      }
      complete_recv(*r, *rv, IBV_WC_SUCCESS, IBV_WC_RECV, len, nullptr, q.qpn());
      break;
    }
    default:
      return {Outcome::kError, IBV_WC_REM_INV_REQ_ERR};
  }
  q.send_psn = (q.send_psn + 1) & 0xffffff;
  r->expect_psn = (r->expect_psn + 1) & 0xffffff;
  return {Outcome::kDone};
}

void FakeFabric::flush(FakeQp& q) {
  for (; q.next_exec < q.sends.size(); ++q.next_exec) {
    ibv_wc wc{};
    wc.wr_id = q.sends[q.next_exec].wr.wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = kUndefinedOpcode;
    wc.qp_num = q.qpn();
    q.send_cq()->push(wc);
  }
  q.outstanding = 0;
  q.done_unsignaled = 0;
  for (; q.next_recv < q.recvs.size(); ++q.next_recv) {
    PostedRecv& rv = q.recvs[q.next_recv];
    if (rv.consumed) continue;
    complete_recv(q, rv, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, nullptr, 0);
  }
}

void FakeFabric::run_rc(FakeQp& q) {
  if (q.state() == QpState::kError) {
    flush(q);
    return;
  }
  if (q.state() != QpState::kRts) return;
  while (q.next_exec < q.sends.size()) {
    const PostedSend& s = q.sends[q.next_exec];
    const Exec e = execute(q, s);
    if (e.outcome == Outcome::kStall) return;
    ++q.next_exec;
    q.stall = 0;
    ibv_wc wc{};
    wc.wr_id = s.wr.wr_id;
    wc.qp_num = q.qpn();
    if (e.outcome == Outcome::kDone) {
      ++rc_executed;
      ++q.done_unsignaled;
      if (s.wr.send_flags & IBV_SEND_SIGNALED) {
        // The NIC frees the WQEs of the unsignaled WRs before it now.
        wc.status = IBV_WC_SUCCESS;
        wc.opcode = s.wr.opcode == IBV_WR_SEND ? IBV_WC_SEND : IBV_WC_RDMA_WRITE;
        q.send_cq()->push(wc);
        q.retire(q.done_unsignaled);
        q.done_unsignaled = 0;
      }
      continue;
    }
    // An error always completes, signaled or not; then the QP is in error.
    wc.status = e.status;
    wc.opcode = kUndefinedOpcode;
    wc.vendor_err = 0x51;
    q.send_cq()->push(wc);
    q.to_error();
    flush(q);
    return;
  }
}

}  // namespace moelink::fabric::verbs::fake
