// The verbs transport (see verbs_nic.h). Tested against the fake layer
// only; never run on a NIC.
#include "fabric/verbs/verbs_nic.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <span>

#include "fabric/verbs/verbs_address.h"
#include "fabric/verbs/wr_id.h"
#include "moelink/errors.h"
#include "moelink/fabric_errors.h"

namespace moelink::fabric::verbs {
namespace {

// RC messages are limited to 2^31 bytes (the port's max_msg_sz on
// ConnectX); the engine does not split larger writes.
constexpr uint64_t kMaxWriteBytes = 1ull << 31;
constexpr std::chrono::milliseconds kIdleControlInterval{1};

uint64_t random_nonzero() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

const char* status_name(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS: return "IBV_WC_SUCCESS";
    case IBV_WC_LOC_LEN_ERR: return "IBV_WC_LOC_LEN_ERR";
    case IBV_WC_LOC_QP_OP_ERR: return "IBV_WC_LOC_QP_OP_ERR";
    case IBV_WC_LOC_PROT_ERR: return "IBV_WC_LOC_PROT_ERR";
    case IBV_WC_WR_FLUSH_ERR: return "IBV_WC_WR_FLUSH_ERR";
    case IBV_WC_REM_INV_REQ_ERR: return "IBV_WC_REM_INV_REQ_ERR";
    case IBV_WC_REM_ACCESS_ERR: return "IBV_WC_REM_ACCESS_ERR";
    case IBV_WC_REM_OP_ERR: return "IBV_WC_REM_OP_ERR";
    case IBV_WC_RETRY_EXC_ERR: return "IBV_WC_RETRY_EXC_ERR";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "IBV_WC_RNR_RETRY_EXC_ERR";
    default: return "IBV_WC_?";
  }
}

uint32_t lkey_of(const Wr& wr) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(wr.desc));
}

// Receives built by RecvChain carry a slot or index in wr_id; the transport
// adds which peer and QP (wr_id.h).
void tag(ibv_recv_wr* head, uint64_t base) {
  for (ibv_recv_wr* w = head; w; w = w->next) w->wr_id = base | (w->wr_id & 0xffffffffu);
}

}  // namespace

struct VerbsNic::Peer {
  uint32_t index = 0;
  uint64_t node = 0;
  std::string name;
  Qp* msg_qp = nullptr;  // owned by the handshake
  Qp* write_qp = nullptr;
  bool ready = false;    // connected: posts go out
  std::string broken;    // non-empty: unusable, and why
  bool broken_timeout = false;
  std::unique_ptr<SendRing> msg_sq, write_sq;
  std::unique_ptr<WriteChain> chain;
  uint32_t msg_inline = 0;
  std::vector<char> msg_buf;  // recv_buffers slots of max_message_bytes
  std::unique_ptr<Mr> msg_mr;
};

VerbsNic::VerbsNic(std::unique_ptr<Device> device, int index, const VerbsNicOptions& options)
    : Nic(index), options_(options), device_(std::move(device)) {
  const std::string where = "TransferEngine domain " + std::to_string(index) + " (ibverbs)";
  if (!device_) throw InvalidArgument(where + ": no device");
  if (options_.rx.recv_buffers < 1 || options_.rx.max_message_bytes < 1 ||
      options_.rx.max_message_bytes > 0x7fffffffu)
    throw InvalidArgument(where + ": recv_buffers must be >= 1 and max_message_bytes 1..2^31-1");
  if (options_.max_chain < 1 || options_.write_send_depth < 1 || options_.write_recv_depth < 1 ||
      options_.msg_send_depth < 1 || options_.cq_depth < 1 || options_.ud_slots < 1 ||
      options_.timeout_s <= 0)
    throw InvalidArgument(where + ": queue depths, max_chain and timeout must be positive");
  node_id_ = options_.node_id ? options_.node_id : random_nonzero();
  const uint64_t session = options_.session ? options_.session : random_nonzero();
  cq_ = device_->create_cq(options_.cq_depth);
  // Enough send slots for a HELLO to every peer of a large job at once (a
  // datagram finding no free slot is dropped and only resent a retry later).
  ud_ = std::make_unique<UdChannel>(*device_, options_.ud_slots, options_.ud_slots);

  // The handshake gives up at ~0.8 of the engine timeout, so operations
  // waiting for the peer fail with its TimeoutError (naming the peer) before
  // their own deadline.
  using std::chrono::milliseconds;
  const double retry_s = std::clamp(options_.timeout_s / 20, 0.005, 0.2);
  HandshakeOptions ho;
  ho.retry_interval = milliseconds(std::max<int64_t>(1, static_cast<int64_t>(retry_s * 1000)));
  ho.max_attempts = std::max(2, static_cast<int>(0.8 * options_.timeout_s / retry_s));
  ho.passive_timeout = milliseconds(static_cast<int64_t>(options_.timeout_s * 1000));
  const auto recv_slots = static_cast<uint32_t>(options_.rx.recv_buffers);
  ho.msg_caps = QpCaps{options_.msg_send_depth, recv_slots, 1, 1, options_.max_inline};
  ho.write_caps =
      QpCaps{options_.write_send_depth, options_.write_recv_depth, 1, 1, options_.max_inline};
  ho.accept_unknown_peers = true;
  LocalNode local;
  local.id = node_id_;
  local.session = session;
  local.ud = ud_->contact();
  handshake_ = std::make_unique<Handshake>(
      *device_, *cq_, local, ho, [this](const UdContact& to, const HandshakeMsg& m) {
        // UD is lossy anyway: a datagram that cannot be sent is a lost one,
        // and the handshake resends.
        try {
          (void)ud_->send(to, encode(m));
        } catch (const Error&) {
        }
      });
  handshake_->on_qps_created(
      [this](uint64_t node, Qp& msg_qp, Qp& write_qp) { on_qps_created(node, msg_qp, write_qp); });
  endpoint_ = encode_endpoint({node_id_, ud_->contact()});
  chain_ids_.resize(options_.max_chain);
  wcs_.resize(32);
}

VerbsNic::~VerbsNic() { close_endpoint(); }

void VerbsNic::close_endpoint() {
  if (closed_) return;
  closed_ = true;
  chain_peer_ = nullptr;
  failed_.clear();
  handshake_.reset();  // destroys every peer's QPs
  for (auto& p : peers_) p->msg_qp = p->write_qp = nullptr;
  ud_.reset();
}

std::string VerbsNic::who(const Peer& p) const {
  char node[32];
  std::snprintf(node, sizeof(node), "%016llx", static_cast<unsigned long long>(p.node));
  return "peer '" + p.name + "' (node " + node + ")";
}

bool VerbsNic::peer_ready(uint64_t dest) const {
  return dest < peers_.size() && peers_[dest]->ready && peers_[dest]->broken.empty();
}

VerbsNic::Peer& VerbsNic::peer_of_node(uint64_t node, const std::string& name) {
  if (auto it = peer_by_node_.find(node); it != peer_by_node_.end()) return *peers_[it->second];
  if (peers_.size() >= kMaxPeers)
    throw FabricError("TransferEngine domain " + std::to_string(index_) + " (ibverbs): more than " +
                      std::to_string(kMaxPeers) + " peers");
  auto p = std::make_unique<Peer>();
  p->index = static_cast<uint32_t>(peers_.size());
  p->node = node;
  p->name = name;
  peer_by_node_.emplace(node, p->index);
  peers_.push_back(std::move(p));
  ++connecting_;
  return *peers_.back();
}

// Runs inside the handshake, before anything names these QPs to the peer.
void VerbsNic::on_qps_created(uint64_t node, Qp& msg_qp, Qp& write_qp) {
  Peer& p = peer_of_node(node, "node " + std::to_string(node));
  const QpCaps& mc = msg_qp.caps();
  const QpCaps& wc = write_qp.caps();
  const int need = static_cast<int>(mc.max_send_wr + mc.max_recv_wr + wc.max_send_wr +
                                    wc.max_recv_wr);
  // A CQ overrun would break every QP on it: refuse the peer instead.
  if (cq_entries_ + need > options_.cq_depth)
    throw FabricError("TransferEngine domain " + std::to_string(index_) +
                      " (ibverbs): the completion queue of depth " +
                      std::to_string(options_.cq_depth) + " cannot take " + who(p) + " (" +
                      std::to_string(need) + " more entries, " + std::to_string(cq_entries_) +
                      " in use)");
  const auto slots = static_cast<uint32_t>(options_.rx.recv_buffers);
  if (mc.max_recv_wr < slots || wc.max_recv_wr < options_.write_recv_depth)
    throw FabricError(who(p) + ": the device granted fewer receive WRs than requested");
  cq_entries_ += need;
  p.msg_qp = &msg_qp;
  p.write_qp = &write_qp;
  p.msg_sq = std::make_unique<SendRing>(mc.max_send_wr);
  p.write_sq = std::make_unique<SendRing>(wc.max_send_wr);
  p.chain = std::make_unique<WriteChain>(RemoteBuffer{}, wc, options_.max_chain);
  p.msg_inline = mc.max_inline_data;
  const size_t bytes = options_.rx.max_message_bytes;
  p.msg_buf.assign(size_t{slots} * bytes, 0);
  p.msg_mr = device_->register_memory(p.msg_buf.data(), p.msg_buf.size());
  // Both receive queues are filled from INIT on, before the peer can send.
  RecvChain rc(std::max(slots, options_.write_recv_depth));
  ibv_recv_wr* msgs = rc.slots(reinterpret_cast<uint64_t>(p.msg_buf.data()), p.msg_mr->lkey(),
                               static_cast<uint32_t>(bytes), slots, 0, slots);
  tag(msgs, pack({true, QpRole::kMessage, p.index, 0}));
  msg_qp.post_recv(msgs);
  ibv_recv_wr* imms = rc.imm(0, options_.write_recv_depth);
  tag(imms, pack({true, QpRole::kWrite, p.index, 0}));
  write_qp.post_recv(imms);
}

MemoryHandle VerbsNic::register_memory(void* ptr, size_t size, MemoryKind kind, int) {
  if (kind == MemoryKind::kCuda)
    throw FabricError("TransferEngine register_memory on domain " + std::to_string(index_) +
                      " (ibverbs): CUDA memory is not supported by the verbs transport yet "
                      "(ibv_reg_dmabuf_mr is not implemented)");
  std::unique_ptr<Mr> mr = device_->register_memory(ptr, size);
  MemoryHandle h;
  h.desc = reinterpret_cast<void*>(static_cast<uintptr_t>(mr->lkey()));
  h.key = mr->rkey();
  h.remote_base = reinterpret_cast<uint64_t>(ptr);  // verbs addresses by virtual address
  h.impl = mr.release();
  return h;
}

void VerbsNic::deregister_memory(const MemoryHandle& mr) { delete static_cast<Mr*>(mr.impl); }

uint64_t VerbsNic::insert_peer(const std::string& endpoint, const std::string& peer_name) {
  const VerbsEndpoint ep = decode_endpoint(endpoint, peer_name);
  if (ep.node == node_id_)
    throw InvalidArgument("TransferEngine (ibverbs) add_peer: '" + peer_name +
                          "' is this NIC itself: loopback connections are not implemented");
  Peer& p = peer_of_node(ep.node, peer_name);
  p.name = peer_name;
  const auto now = Clock::now();
  next_control_ = now;
  // Starts the handshake (creates both QPs, sends HELLO) and returns; the
  // worker's polls complete it. Throws FabricError when the QPs cannot be
  // made; the peer is then failed in the handshake too.
  handshake_->connect(ep.node, peer_name, ep.ud, now);
  return p.index;
}

void VerbsNic::break_peer(Peer& p, const std::string& why, bool timeout) {
  if (!p.broken.empty()) return;
  if (!p.ready) --connecting_;  // it will never connect now
  p.broken = why;
  p.broken_timeout = timeout;
  if (chain_peer_ == &p) {  // a chain still being built can never go out now
    scratch_.clear();
    p.write_sq->pop_newest(p.chain->size(), scratch_);
    for (WrContext* c : scratch_) failed_.emplace_back(c, why);
    p.chain->clear();
    chain_peer_ = nullptr;
  }
}

PostStatus VerbsNic::not_ready(Peer& p, PostError* error) {
  if (p.broken.empty()) return PostStatus::kAgain;  // still connecting
  error->timeout = p.broken_timeout;
  error->text = p.broken;
  return PostStatus::kFailed;
}

PostStatus VerbsNic::post(const Wr& wr, WrContext* ctx, bool more, PostError* error) {
  if (closed_ || wr.dest >= peers_.size()) {
    flush();
    error->timeout = false;
    error->text = closed_ ? "the verbs NIC is closed"
                          : "unknown verbs destination " + std::to_string(wr.dest);
    return PostStatus::kFailed;
  }
  Peer& p = *peers_[wr.dest];
  if (!p.ready || !p.broken.empty()) {
    flush();
    return not_ready(p, error);
  }
  if (wr.kind == Wr::Kind::kSend) {
    flush();
    return post_send(p, wr, ctx, error);
  }
  if (wr.len > kMaxWriteBytes || wr.remote_key > 0xffffffffu) {
    flush();
    error->timeout = false;
    error->text = wr.len > kMaxWriteBytes
                      ? "a write of " + std::to_string(wr.len) + " bytes exceeds the verbs limit of " +
                            std::to_string(kMaxWriteBytes) + " (large writes are not split)"
                      : "remote key " + std::to_string(wr.remote_key) +
                            " is not a 32-bit rkey (a descriptor from a libfabric engine?)";
    return PostStatus::kFailed;
  }
  if (chain_peer_ && chain_peer_ != &p) flush();
  if (p.write_sq->free() == 0) {
    flush();
    return PostStatus::kAgain;
  }
  WriteOp op;
  op.local_addr = reinterpret_cast<uint64_t>(wr.buf);
  op.lkey = lkey_of(wr);
  op.len = static_cast<uint32_t>(wr.len);
  op.remote_offset = 0;
  if (wr.has_imm) op.imm = wr.imm;
  // The WR template is the engine's (peer, remote base, rkey); the WR is
  // built from it by fill_write inside the chain.
  const RemoteBuffer remote{wr.remote_addr, static_cast<uint32_t>(wr.remote_key), wr.len};
  const uint32_t seq = p.write_sq->push(ctx);
  p.chain->add(op, remote);  // cannot fail: in range by construction, capacity checked below
  chain_ids_[p.chain->size() - 1] = pack({false, QpRole::kWrite, p.index, seq});
  chain_peer_ = &p;
  if (!more || p.chain->full()) flush();
  return PostStatus::kPosted;
}

void VerbsNic::flush() {
  if (!chain_peer_) return;
  Peer& p = *chain_peer_;
  chain_peer_ = nullptr;
  const size_t n = p.chain->size();
  ibv_send_wr* head = p.chain->finish(std::span<const uint64_t>(chain_ids_.data(), n));
  try {
    p.write_qp->post_send(head);  // one doorbell for the whole chain
    ++write_doorbells_;
  } catch (const std::exception& e) {
    // Real verbs post the WRs before the rejected one, but the chain's only
    // signaled WR is its last: nothing would ever retire them. Fail them all
    // and give up on the peer.
    const std::string why = "a chain of " + std::to_string(n) + " writes to " + who(p) +
                            " was rejected: " + e.what();
    scratch_.clear();
    p.write_sq->pop_newest(n, scratch_);
    for (WrContext* c : scratch_) failed_.emplace_back(c, why);
    p.chain->clear();
    break_peer(p, why);
    return;
  }
  p.chain->clear();
}

PostStatus VerbsNic::post_send(Peer& p, const Wr& wr, WrContext* ctx, PostError* error) {
  if (p.msg_sq->free() == 0) return PostStatus::kAgain;
  if (wr.len > options_.rx.max_message_bytes) {
    error->timeout = false;
    error->text = "a message of " + std::to_string(wr.len) + " bytes exceeds max_message_bytes " +
                  std::to_string(options_.rx.max_message_bytes);
    return PostStatus::kFailed;
  }
  const uint32_t seq = p.msg_sq->push(ctx);
  fill_send(send_wr_, send_sge_, reinterpret_cast<uint64_t>(wr.buf), lkey_of(wr),
            static_cast<uint32_t>(wr.len), p.msg_inline,
            pack({false, QpRole::kMessage, p.index, seq}));
  try {
    p.msg_qp->post_send(&send_wr_);
  } catch (const std::exception& e) {
    scratch_.clear();
    p.msg_sq->pop_newest(1, scratch_);
    const std::string why = "a send to " + who(p) + " was rejected: " + e.what();
    break_peer(p, why);
    error->timeout = false;
    error->text = why;
    return PostStatus::kFailed;
  }
  return PostStatus::kPosted;
}

int VerbsNic::control_pass(Clock::time_point now) {
  int work = 0;
  try {
    work += ud_->poll([&](std::span<const uint8_t> bytes) { handshake_->on_datagram(bytes, now); });
  } catch (const Error& e) {
    // The UD QP broke: no handshake can finish any more.
    for (auto& p : peers_)
      if (!p->ready) break_peer(*p, "the verbs UD channel failed: " + std::string(e.what()));
  }
  handshake_->tick(now);
  if (connecting_ == 0) return work;
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (p.ready || !p.broken.empty()) continue;
    const PeerConnection& c = handshake_->peer(p.node);
    if (c.state == PeerState::kConnected) {
      p.ready = true;
      --connecting_;
      ++work;
    } else if (c.state == PeerState::kFailed) {
      bool timeout = false;
      std::string why = "verbs handshake failed";
      try {
        if (c.error) std::rethrow_exception(c.error);
      } catch (const TimeoutError& e) {
        timeout = true;
        why = e.what();
      } catch (const std::exception& e) {
        why = e.what();
      }
      break_peer(p, why, timeout);
      ++work;
    }
  }
  return work;
}

int VerbsNic::poll(CompletionSink& sink) {
  if (closed_) return 0;
  int work = 0;
  if (!failed_.empty()) {
    auto failed = std::move(failed_);
    failed_.clear();
    // Not marked unreachable for the engine: a broken peer fails later
    // posts here at once with its first error (break_peer).
    for (auto& [ctx, why] : failed) sink.wr_failed(ctx, why, /*peer_unreachable=*/false);
    work += static_cast<int>(failed.size());
  }
  const auto now = Clock::now();
  if (connecting_ > 0 || now >= next_control_) {
    work += control_pass(now);
    next_control_ = now + kIdleControlInterval;
  }
  const int n = cq_->poll(std::span<ibv_wc>(wcs_));
  for (int i = 0; i < n; ++i) handle(wcs_[i], sink);
  return work + n;
}

void VerbsNic::handle(const ibv_wc& wc, CompletionSink& sink) {
  const WrId id = unpack(wc.wr_id);
  if (id.peer >= peers_.size()) return;  // not one of ours
  Peer& p = *peers_[id.peer];
  const char* qp = id.role == QpRole::kWrite ? "write" : "message";
  auto describe = [&](const char* what) {
    char vendor[32];
    std::snprintf(vendor, sizeof(vendor), "0x%x", wc.vendor_err);
    std::string s = std::string(status_name(wc.status)) + " (" + ibv_wc_status_str(wc.status) +
                    ", vendor error " + vendor + ") on the " + what + " of the " + qp +
                    " QP to " + who(p);
    if (!p.broken.empty()) s += "; the QP was already in error: " + p.broken;
    return s;
  };
  if (id.recv) {
    if (wc.status != IBV_WC_SUCCESS) {
      // Flushed receives follow a QP error that was reported already.
      break_peer(p, describe("receive"));
      return;
    }
    if (id.role == QpRole::kWrite) {
      // WRITE_WITH_IMM: the data is in place before this completion; only
      // the immediate (big-endian in imm_data) is ours to count.
      if (wc.wc_flags & IBV_WC_WITH_IMM) sink.imm_arrived(imm_from_wire(wc.imm_data));
      repost_imm(p);
    } else if (id.low < static_cast<uint32_t>(options_.rx.recv_buffers)) {
      sink.message_arrived(p.msg_buf.data() + size_t{id.low} * options_.rx.max_message_bytes,
                           wc.byte_len);
      repost_msg(p, id.low);
    }
    return;
  }
  SendRing& ring = id.role == QpRole::kWrite ? *p.write_sq : *p.msg_sq;
  if (wc.status == IBV_WC_SUCCESS) {
    (void)ring.retire_through(id.low, [&](WrContext* c, bool) { sink.wr_done(c); });
    return;
  }
  // RC completes in order: the WRs before the failed one are done; it fails;
  // the ones after it come back flushed, each with its own completion.
  const std::string why = describe(wc.status == IBV_WC_WR_FLUSH_ERR ? "flushed work request"
                                                                    : "work request");
  (void)ring.retire_through(id.low, [&](WrContext* c, bool failed) {
    if (failed)
      sink.wr_failed(c, why, /*peer_unreachable=*/false);  // break_peer below fails later posts
    else
      sink.wr_done(c);
  });
  break_peer(p, why);
}

void VerbsNic::repost_imm(Peer& p) {
  if (!p.broken.empty() || !p.write_qp) return;
  ibv_recv_wr wr{};
  wr.wr_id = pack({true, QpRole::kWrite, p.index, 0});
  wr.sg_list = nullptr;  // an immediate needs no buffer
  wr.num_sge = 0;
  try {
    p.write_qp->post_recv(&wr);
  } catch (const std::exception& e) {
    break_peer(p, "reposting an immediate receive for " + who(p) + " failed: " + e.what());
  }
}

void VerbsNic::repost_msg(Peer& p, uint32_t slot) {
  if (!p.broken.empty() || !p.msg_qp) return;
  const size_t bytes = options_.rx.max_message_bytes;
  ibv_sge sge{reinterpret_cast<uint64_t>(p.msg_buf.data() + size_t{slot} * bytes),
              static_cast<uint32_t>(bytes), p.msg_mr->lkey()};
  ibv_recv_wr wr{};
  wr.wr_id = pack({true, QpRole::kMessage, p.index, slot});
  wr.sg_list = &sge;
  wr.num_sge = 1;
  try {
    p.msg_qp->post_recv(&wr);
  } catch (const std::exception& e) {
    break_peer(p, "reposting a message receive for " + who(p) + " failed: " + e.what());
  }
}

}  // namespace moelink::fabric::verbs
