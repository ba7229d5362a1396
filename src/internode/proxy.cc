#include "internode/proxy.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moelink/errors.h"
#include "moelink/fabric_errors.h"

namespace moelink::detail::internode {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t load_word(const uint64_t* p) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire);
}
void store_word(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
}

fabric::EngineOptions engine_options(const Geometry& g, const ResolvedOptions& o) {
  fabric::EngineOptions e;
  e.provider = o.fabric_provider;
  e.timeout_s = o.timeout_s;
  e.num_domains = o.fabric_nics;
  e.name = "rank " + std::to_string(g.rank);
  e.yield_when_idle = true;
  // The all-to-all uses one-sided writes only.
  e.recv_buffers = 1;
  return e;
}

}  // namespace

Proxy::Proxy(const Geometry& g, const Layout& l, const ResolvedOptions& o, ProxySignals* signals,
             ProxyOutput output, int spin_polls)
    : g_(g),
      l_(l),
      o_(o),
      signals_(signals),
      output_(output),
      plan_(output.plan()),
      plan_view_{g.world_size, g.dp_size},
      spin_polls_(spin_polls),
      matrix_(g, l),
      block_offset_(static_cast<size_t>(g.world_size), 0),
      headers_(static_cast<size_t>(g.world_size * l.header_bytes)) {
  if (g.world_size > kMaxWorldSize)
    throw InvalidArgument("moelink: internode: world_size = " + std::to_string(g.world_size) +
                          " must be <= " + std::to_string(kMaxWorldSize));
  engine_ = fabric::TransferEngine::create(engine_options(g, o));
  provider_ = engine_->provider();
}

void Proxy::start(const Buffers& buffers, Bootstrap& bootstrap) {
  buffers_ = buffers;
  if (!buffers_.read_recv)
    buffers_.read_recv = [recv = static_cast<const char*>(buffers.recv)](
                             char* dst, int64_t offset, int64_t stride, int64_t bytes, int rows) {
      for (int i = 0; i < rows; ++i)
        std::memcpy(dst + i * bytes, recv + offset + i * stride, static_cast<size_t>(bytes));
    };
  // A rank whose registration fails tells the others instead of leaving
  // them in the exchange below: "" or what its engine said.
  std::string error;
  try {
    send_mr_ = engine_->register_memory(buffers.send, static_cast<size_t>(l_.send_bytes),
                                        buffers.kind, buffers.device);
    recv_mr_ = engine_->register_memory(buffers.recv, static_cast<size_t>(l_.recv_bytes),
                                        buffers.kind, buffers.device);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const auto errors = bootstrap.all_gather_blobs(std::vector<char>(error.begin(), error.end()));
  for (int r = 0; r < g_.world_size; ++r)
    if (!errors[r].empty())
      throw FabricError("moelink: internode: rank " + std::to_string(r) +
                        " could not register its buffers with the TransferEngine (" + provider_ +
                        "): " + std::string(errors[r].begin(), errors[r].end()));
  const auto blobs = bootstrap.all_gather_blobs(engine_->descriptor(recv_mr_).serialize());
  std::vector<fabric::MemoryDescriptor> members;
  for (int r = 0; r < g_.world_size; ++r)
    if (r != g_.rank)
      members.push_back(fabric::MemoryDescriptor::deserialize(blobs[r].data(), blobs[r].size()));
  if (!members.empty()) peers_ = engine_->add_peer_group(members);
  // Nobody writes before every rank has registered its buffers.
  bootstrap.barrier();
  thread_ = std::thread([this] { run(); });
}

Proxy::~Proxy() {
  // The thread finishes the steps already requested (each is bounded by the
  // timeout), so the peers get this rank's last combine notification.
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
  for (auto& t : pending_) {
    try {
      t->wait();
    } catch (...) {
    }
  }
  pending_.clear();
  engine_.reset();
}

ErrorRecord Proxy::error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_;
}

std::string Proxy::error_detail() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_detail_;
}

void Proxy::fail(ErrorCode code, Phase phase, int peer, const std::string& detail) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (error_.code != static_cast<int32_t>(ErrorCode::kOk)) return;  // first error wins
  const auto secs = static_cast<int64_t>(std::ceil(o_.timeout_s));
  error_ = {static_cast<int32_t>(code), static_cast<int32_t>(phase), peer, 0, secs, 0};
  error_detail_ = detail;
  failed_.store(true, std::memory_order_release);
  // Tell the peers which rank is gone: they stop waiting for this one (which
  // gives up now) and name the right rank. Best effort, never waited for.
  if (peer >= 0 && peers_ >= 0) {
    try {
      engine_->barrier(peers_, make_imm(ImmKind::kAbort, peer));
    } catch (...) {
    }
  }
}

double Proxy::remaining_s() const {
  const double left = std::chrono::duration<double>(deadline_ - Clock::now()).count();
  return std::max(left, 1e-3);
}

// ---------------------------------------------------------------- the thread

void Proxy::run() {
  int idle = 0;
  for (;;) {
    const uint64_t done = load_word(&signals_->done);
    if (load_word(&signals_->request) > done) {
      run_step(done + 1);
      store_word(&signals_->done, done + 1);
      // Through a write-combined mapping the plan's stores may still sit in
      // the CPU's buffers: a full fence drains them before the ready word,
      // and the one after pushes the ready word out now.
      if (output_.write_combined) std::atomic_thread_fence(std::memory_order_seq_cst);
      store_word(
          (done + 1) % 2 == 1 ? output_.dispatch_ready() : output_.combine_ready(), 1);
      if (output_.write_combined) std::atomic_thread_fence(std::memory_order_seq_cst);
      idle = 0;
      continue;
    }
    if (stop_.load(std::memory_order_acquire)) return;
    // Idle: spin a while (the next request usually follows soon), then give
    // the core away; several ranks may share few cores.
    if (++idle < spin_polls_) continue;
    if (idle < spin_polls_ + 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(idle < spin_polls_ + 1024 ? 10 : 100));
  }
}

void Proxy::run_step(uint64_t step) {
  if (failed()) return;  // out of step with the peers for good
  const auto epoch = static_cast<uint32_t>((step + 1) / 2);
  const auto start = Clock::now();
  deadline_ = start + std::chrono::duration_cast<Clock::duration>(
                          std::chrono::duration<double>(o_.timeout_s));
  waited_ = {};
  if (step % 2 == 1)
    dispatch(epoch);
  else
    combine(epoch);
  const auto us = [](Clock::duration d) {
    return std::chrono::duration<double, std::micro>(d).count();
  };
  PhaseTimes t;
  t.wire_us = us(waited_);
  t.post_us = us(Clock::now() - start - waited_);
  std::lock_guard<std::mutex> lock(times_mu_);
  (step % 2 == 1 ? dispatch_times_ : combine_times_) = t;
}

PhaseTimes Proxy::dispatch_times() const {
  std::lock_guard<std::mutex> lock(times_mu_);
  return dispatch_times_;
}
PhaseTimes Proxy::combine_times() const {
  std::lock_guard<std::mutex> lock(times_mu_);
  return combine_times_;
}

// Adds the time from construction to destruction to the step's wait time.
class Proxy::WaitTimer {
 public:
  explicit WaitTimer(Clock::duration& total) : total_(total), start_(Clock::now()) {}
  ~WaitTimer() { total_ += Clock::now() - start_; }

 private:
  Clock::duration& total_;
  Clock::time_point start_;
};

bool Proxy::wait_peer(ImmKind kind, int peer, Phase phase) {
  const WaitTimer timer(waited_);
  // In short slices, so that a peer's report that some rank is gone ends
  // the wait early and names that rank rather than the reporter.
  for (;;) {
    try {
      engine_->wait_imm(make_imm(kind, peer), 1, 0.02);
      return true;
    } catch (const TimeoutError& e) {
      if (const int gone = reported_gone(); gone >= 0) {
        fail(ErrorCode::kPeerLost, phase, gone,
             "another rank reported rank " + std::to_string(gone) + " gone");
        return false;
      }
      if (Clock::now() >= deadline_ + report_grace()) {
        fail(ErrorCode::kTimeout, phase, peer, e.what());
        return false;
      }
    } catch (const std::exception& e) {
      fail(ErrorCode::kPeerLost, phase, peer, e.what());
      return false;
    }
  }
}

// After its own deadline a waiter listens a little longer for a peer's
// report: the rank it waits for may itself be stuck waiting for the rank
// that is really gone, with a deadline that expires at about the same time.
Clock::duration Proxy::report_grace() const {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::min(1.0, 0.25 * o_.timeout_s)));
}

int Proxy::reported_gone() const {
  // A report naming this rank comes from a peer that gave up waiting for
  // it while it waited for someone else: not news.
  for (int r = 0; r < g_.world_size; ++r)
    if (r != g_.rank && engine_->imm_count(make_imm(ImmKind::kAbort, r)) > 0) return r;
  return -1;
}

bool Proxy::wait_transfers(Phase phase) {
  const WaitTimer timer(waited_);
  bool ok = true;
  for (auto& t : pending_) {
    try {
      t->wait(remaining_s());
    } catch (const std::exception& e) {
      if (ok) fail(ErrorCode::kPeerLost, phase, -1, e.what());
      ok = false;
    }
  }
  pending_.clear();
  return ok;
}

// ---------------------------------------------------------------- steps

void Proxy::dispatch(uint32_t epoch) {
  const int me = g_.rank, W = g_.world_size;
  const int64_t P = l_.private_tokens;
  // The peers' dispatch areas are free: each one's combine notification of
  // the previous epoch (step 5), sent after it unpacked, has arrived.

  // 1. Own counts (the packer's header, which it also wrote at the front of
  //    every block) and the block offsets.
  const auto* counts = reinterpret_cast<const uint32_t*>(buffers_.own_header + sizeof(RouteHeader));
  matrix_.set_row(me, counts);
  block_offsets(l_, counts, block_offset_.data());

  // 2. Routing info + private tokens: one scatter to every peer, starting
  //    with the next rank, so that the ranks do not all write to rank 0
  //    first. Node peers get the header alone: the packer already stored
  //    their slots in their local areas.
  std::vector<fabric::ScatterSlice> slices;
  for (int i = 1; i < W; ++i) {
    const int r = (me + i) % W;
    const int64_t tokens = l_.is_local(me, r) ? 0 : std::min<int64_t>(counts[r], P);
    const auto len = static_cast<size_t>(l_.header_bytes + tokens * l_.slot_bytes);
    slices.push_back({static_cast<size_t>(member(r)), static_cast<uint64_t>(block_offset_[r]),
                      static_cast<uint64_t>(l_.private_offset(me)), len});
  }
  try {
    if (!slices.empty())
      pending_.push_back(engine_->scatter(peers_, send_mr_, slices, make_imm(ImmKind::kRoute, me)));
  } catch (const std::exception& e) {
    fail(ErrorCode::kPeerLost, Phase::kDispatchSend, -1, e.what());
    return;
  }

  // 3. Every peer's routing info: the matrix. The headers are read in one
  //    go once all have arrived (one device copy for GPU buffers).
  for (int s = 0; s < W; ++s)
    if (s != me && !wait_peer(ImmKind::kRoute, s, Phase::kDispatchRecv)) return;
  try {
    buffers_.read_recv(headers_.data(), l_.private_offset(0), l_.private_stride, l_.header_bytes,
                       W);
  } catch (const std::exception& e) {  // a failed device copy: never out of the thread
    fail(ErrorCode::kPeerLost, Phase::kDispatchRecv, -1,
         std::string("reading the routing headers failed: ") + e.what());
    return;
  }
  for (int s = 0; s < W; ++s) {
    if (s == me) continue;
    const char* h = headers_.data() + s * l_.header_bytes;
    RouteHeader header;
    std::memcpy(&header, h, sizeof(header));
    if (header.epoch != epoch) {
      fail(ErrorCode::kPeerLost, Phase::kDispatchRecv, s,
           "rank " + std::to_string(s) + " sent the routing information of epoch " +
               std::to_string(header.epoch) + " during epoch " + std::to_string(epoch));
      return;
    }
    matrix_.set_row(s, reinterpret_cast<const uint32_t*>(h + sizeof(RouteHeader)));
  }
  matrix_.finish();
  const std::string bad = matrix_.check_receiver(me);
  if (!bad.empty()) {
    fail(ErrorCode::kPeerLost, Phase::kDispatchRecv, -1, bad);
    return;
  }
  write_plan();

  // 4. The tokens past the private ones: one write per remote peer, at
  //    offsets only the matrix gives.
  slices.clear();
  for (int i = 1; i < W; ++i) {
    const int r = (me + i) % W;
    const int64_t rest = static_cast<int64_t>(counts[r]) - P;
    if (rest <= 0 || l_.is_local(me, r)) continue;
    const int64_t dst_slot = matrix_.shared_base(me, r);
    if (dst_slot + rest > l_.shared_slots) {
      fail(ErrorCode::kPeerLost, Phase::kDispatchSend, r,
           "the announced counts do not fit rank " + std::to_string(r) + "'s shared area");
      return;
    }
    const int64_t src = block_offset_[r] + l_.header_bytes + P * l_.slot_bytes;
    const int64_t dst = l_.shared_offset + dst_slot * l_.slot_bytes;
    slices.push_back({static_cast<size_t>(member(r)), static_cast<uint64_t>(src),
                      static_cast<uint64_t>(dst), static_cast<size_t>(rest * l_.slot_bytes)});
  }
  try {
    if (!slices.empty())
      pending_.push_back(engine_->scatter(peers_, send_mr_, slices, make_imm(ImmKind::kData, me)));
  } catch (const std::exception& e) {
    fail(ErrorCode::kPeerLost, Phase::kDispatchSend, -1, e.what());
    return;
  }
  for (int s = 0; s < W; ++s)
    if (!l_.is_local(s, me) && matrix_.count(s, me) > P &&
        !wait_peer(ImmKind::kData, s, Phase::kDispatchRecv))
      return;
  // 5. The send buffer is reused by the combine rows and the next epoch.
  if (wait_transfers(Phase::kDispatchSend)) store_plan(kPlanDispatchEpoch, epoch);
}

// What the unpacking side needs from the matrix (protocol.h, PlanView).
void Proxy::write_plan() {
  const int me = g_.rank, W = g_.world_size, dp = g_.dp_size, grp = g_.dp_group();
  const PlanView& v = plan_view_;
  plan_[kPlanReceived] = matrix_.received(me);
  for (int s = 0; s <= W; ++s) plan_[v.recv_base(s)] = matrix_.recv_base(s, me);
  for (int s = 0; s < W; ++s) plan_[v.shared_base(s)] = matrix_.shared_base(s, me);
  for (int q = 0; q < dp; ++q) {
    const int sender = grp * dp + q;
    for (int r = 0; r < W; ++r) {
      plan_[v.row_base(q, r)] = matrix_.combine_base(grp, r) + matrix_.recv_base(sender, r) -
                                matrix_.recv_base(grp * dp, r);
      plan_[v.row_count(q, r)] = matrix_.count(sender, r);
    }
  }
  for (int g = 0; g < g_.num_dp_groups; ++g)
    plan_[v.row_shift(g)] = matrix_.combine_base(g, me) - matrix_.recv_base(g * dp, me);
}

// The epoch words are read by other threads (and the GPU) once `done` says
// so; the release store of `done` publishes them. Atomic anyway, so that a
// reader that looks early sees an old epoch, never a torn one.
void Proxy::store_plan(int word, int64_t v) {
  std::atomic_ref<int64_t>(plan_[word]).store(v, std::memory_order_release);
}

void Proxy::combine(uint32_t epoch) {
  const int me = g_.rank;
  // Every peer hears from this rank, with rows for its group or with zero
  // bytes: so every rank's combine waits for all peers, which both names a
  // rank that is gone and tells each sender that this rank is done with its
  // dispatch areas (no separate barrier before the next dispatch).
  // Replicas in this node got their rows from the packer directly
  // (protocol.h): they get the notification alone.
  std::vector<fabric::ScatterSlice> slices;
  for (int g = 0; g < g_.num_dp_groups; ++g) {
    const int first = g * g_.dp_size;
    const int64_t rows = matrix_.group_rows(g, me);
    const int64_t dst_row = matrix_.combine_base(g, me);
    if (dst_row + rows > l_.combine_rows) {
      fail(ErrorCode::kPeerLost, Phase::kCombineSend, -1,
           "the announced counts do not fit group " + std::to_string(g) + "'s combine area");
      return;
    }
    const int64_t src = l_.send_combine_offset + matrix_.recv_base(first, me) * l_.row_bytes;
    const int64_t dst = l_.combine_offset + dst_row * l_.row_bytes;
    for (int q = first; q < first + g_.dp_size; ++q) {
      if (q == me) continue;
      const auto len = l_.is_local(q, me) ? 0 : static_cast<size_t>(rows * l_.row_bytes);
      slices.push_back({static_cast<size_t>(member(q)), len ? static_cast<uint64_t>(src) : 0,
                        len ? static_cast<uint64_t>(dst) : 0, len});
    }
  }
  try {
    if (!slices.empty())
      pending_.push_back(
          engine_->scatter(peers_, send_mr_, slices, make_imm(ImmKind::kCombine, me)));
  } catch (const std::exception& e) {
    fail(ErrorCode::kPeerLost, Phase::kCombineSend, -1, e.what());
    return;
  }
  for (int r = 0; r < g_.world_size; ++r)
    if (r != me && !wait_peer(ImmKind::kCombine, r, Phase::kCombineRecv)) return;
  if (wait_transfers(Phase::kCombineSend)) store_plan(kPlanCombineEpoch, epoch);
}

}  // namespace moelink::detail::internode
