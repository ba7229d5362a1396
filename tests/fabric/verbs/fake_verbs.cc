#include "fake_verbs.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs::fake {

int FakeCq::poll(std::span<ibv_wc> out) {
  int n = 0;
  while (n < static_cast<int>(out.size()) && !q_.empty()) {
    out[n++] = q_.front();
    q_.pop_front();
  }
  return n;
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

FakeQp::~FakeQp() { std::erase(dev_.qps, this); }

void FakeQp::step(QpState from, QpState to) {
  if (state_ != from) {
    throw FabricError(std::string("fake ibv_modify_qp: QP ") + std::to_string(qpn_) + " " +
                      to_string(state_) + " -> " + to_string(to) + " (needs " + to_string(from) +
                      ")");
  }
  state_ = to;
  history.push_back(to);
}

void FakeQp::to_init() { step(QpState::kReset, QpState::kInit); }

void FakeQp::to_rtr(const RcRemote* r) {
  if (type_ == QpType::kRc && !r) throw FabricError("fake: RC QP to RTR without a remote");
  step(QpState::kInit, QpState::kRtr);
  if (r) remote = *r;
}

void FakeQp::to_rts(uint32_t psn) {
  step(QpState::kRtr, QpState::kRts);
  sq_psn = psn;
}

void FakeQp::post_send(ibv_send_wr* head) {
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
  ++recv_calls;
  int i = 0;
  for (ibv_recv_wr* w = head; w; w = w->next, ++i) {
    if (state_ == QpState::kReset || state_ == QpState::kError) {
      throw FabricError("fake ibv_post_recv on QP " + std::to_string(qpn_) + ": WR " +
                        std::to_string(i) + " rejected: QP in " + to_string(state_));
    }
    PostedRecv p;
    p.wr = *w;
    p.wr.next = nullptr;
    p.wr.sg_list = nullptr;
    for (int s = 0; s < w->num_sge; ++s) p.sges.push_back(w->sg_list[s]);
    recvs.push_back(std::move(p));
  }
}

FakeAh::~FakeAh() { std::erase(dev_.ahs_, this); }

FakeDevice::FakeDevice(uint16_t lid) : next_qpn_(uint32_t{lid} * 0x1000 + 1) {
  address_.lid = lid;
  address_.gid[15] = static_cast<uint8_t>(lid);
}

std::unique_ptr<Cq> FakeDevice::create_cq(int) { return std::make_unique<FakeCq>(); }

std::unique_ptr<Qp> FakeDevice::create_qp(const QpInit& init) {
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
  auto ah = std::make_unique<FakeAh>(*this, dest);
  ahs_.push_back(ah.get());
  return ah;
}

std::unique_ptr<Mr> FakeDevice::register_memory(void* addr, size_t length) {
  return std::make_unique<FakeMr>(addr, length, next_key_++);
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

int FakeFabric::pump(const std::function<int(const std::vector<uint8_t>&)>& filter) {
  int moved = 0;
  for (FakeDevice* src : devices_) {
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
            auto it = std::find_if(r->recvs.begin(), r->recvs.end(),
                                   [](const PostedRecv& p) { return !p.consumed; });
            if (it == r->recvs.end()) continue;  // no receive posted: UD drops it
            it->consumed = true;
            const ibv_sge& g = it->sges.at(0);
            const size_t n = 40 + bytes.size();
            if (n > g.length) continue;  // too long for the receive: dropped
            auto* out = reinterpret_cast<uint8_t*>(g.addr);
            std::memset(out, 0, 40);  // GRH room
            std::memcpy(out + 40, bytes.data(), bytes.size());
            ibv_wc wc{};
            wc.wr_id = it->wr.wr_id;
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

}  // namespace moelink::fabric::verbs::fake
