// CPU backend: the protocol of docs/design.md run by CPU loops over one POSIX
// shared memory segment that holds every rank's peer-visible buffer (rank r's
// at offset r * geometry().total_bytes). Senders write straight into their
// peers' buffers and publish with release stores of the flags; receivers poll
// their own flags with acquire loads. Everything runs synchronously on the
// calling thread, so the stream argument is ignored and wait_and_take_error
// has nothing to wait for.
//
// It serves processes of one host without GPUs (tests, sanitizers, CI) and is
// the reference the NVLink kernels are compared against, so it follows the
// design note step by step rather than being fast.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/all_to_all_impl.h"
#include "core/float_convert.h"
#include "core/host_ops.h"
#include "core/host_slots.h"
#include "core/layout.h"
#include "cpu/shared_memory.h"
#include "moelink/errors.h"

namespace moelink::detail {

namespace {

using Clock = std::chrono::steady_clock;

struct SlotRef {
  int group;
  int64_t token;
};

class CpuAllToAll final : public AllToAllImpl {
 public:
  CpuAllToAll(const Config& c, const ResolvedOptions& o, Bootstrap& bootstrap)
      : AllToAllImpl(c, o),
        shm_(bootstrap, static_cast<size_t>(geometry_.total_bytes) *
                            static_cast<size_t>(geometry_.world_size)),
        counters_(static_cast<size_t>(geometry_.num_local_experts)),
        // Left uninitialized: only entries of this epoch's valid slots are read.
        route_rows_(new int32_t[static_cast<size_t>(geometry_.num_dp_groups) *
                                static_cast<size_t>(geometry_.max_num_tokens) *
                                static_cast<size_t>(geometry_.experts_per_token)]),
        acc_(static_cast<size_t>(geometry_.hidden_dim)),
        out_row_(static_cast<size_t>(geometry_.combine_row_bytes)) {}

  Backend backend() const override { return Backend::kCPU; }
  size_t buffer_bytes() const override { return static_cast<size_t>(geometry_.total_bytes); }

  // ---------------------------------------------------------------- dispatch

  void dispatch(const DispatchArgs& a, bool send, bool recv) override {
    if (send) dispatch_send(a);
    if (recv) dispatch_recv(a);
  }
  void combine(const CombineArgs& a, bool send, bool recv) override {
    if (send) combine_send(a);
    if (recv) combine_recv(a);
  }

  void dispatch_send(const DispatchArgs& a) {
    ++epoch_;
    if (timed_out_) return;  // out of step with the peers for good: touch nothing
    const Geometry& G = geometry_;
    const int64_t m = valid_tokens(a.bound_m, a.input_rows, Phase::kDispatchSend);
    for (int64_t t = 0; t < m; ++t)
      if (G.sends_token(t)) send_token(a, t);
    // Every rank hears from every sender, even with nothing for it, so that
    // receivers learn m and never wait on silence.
    // One sending unit per rank: the counter equals the epoch once done; m
    // goes first, the release store of the counter publishes it.
    const uint64_t m_word = dispatch_flag(epoch_, static_cast<uint32_t>(m));
    for (int r = 0; r < G.world_size; ++r) {
      store_flag(region(r) + G.dispatch_m_offset + 8 * G.rank, m_word);
      store_flag(region(r) + G.dispatch_flags_offset + 8 * G.rank,
                 send_complete_count(epoch_, 1));
    }
  }

  void dispatch_recv(const DispatchArgs& a) {
    const Geometry& G = geometry_;
    std::fill(counters_.begin(), counters_.end(), 0);
    valid_slots_.clear();
    // After a timeout the counts say "no tokens", so that expert code run
    // before check() sees empty experts rather than stale counts.
    if (!timed_out_ &&
        wait_for_flags(G.dispatch_flags_offset, Phase::kDispatchRecv,
                       [&](uint64_t f) { return f >= send_complete_count(epoch_, 1); })) {
      for (int g = 0; g < G.num_dp_groups; ++g) receive_group(a, g);
    }
    for (int j = 0; j < G.num_local_experts; ++j)
      store<int32_t>(elem(a.out_expert_num_tokens, j),
                     static_cast<int32_t>(std::min<int64_t>(counters_[j], G.expert_capacity)));
  }

  // ---------------------------------------------------------------- combine

  void combine_send(const CombineArgs& a) {
    if (timed_out_) return;
    const Geometry& G = geometry_;
    for (const SlotRef& s : valid_slots_) combine_slot(a, s.group, s.token);
    for (int r = 0; r < G.world_size; ++r)
      store_flag(region(r) + G.combine_flags_offset + 8 * G.rank, send_complete_count(epoch_, 1));
  }

  void combine_recv(const CombineArgs& a) {
    const Geometry& G = geometry_;
    // The only global barrier: nobody starts the next dispatch (which
    // overwrites staging) before every rank finished combine_send.
    if (timed_out_ || !wait_for_flags(G.combine_flags_offset, Phase::kCombineRecv,
                                      [&](uint64_t f) { return f >= send_complete_count(epoch_, 1); }))
      return;
    // Bad bound_m / expert ids were reported by the dispatch that used the
    // same inputs; here they are only clamped / skipped.
    const int64_t m = clamped_m(a.bound_m, a.input_rows, nullptr);
    for (int64_t t = 0; t < m; ++t) combine_token(a, t);
  }

  ErrorRecord wait_and_take_error() override {
    ErrorRecord e = error_;
    error_ = timeout_;  // input errors are reported once; a timeout stays
    return e;
  }

 private:
  char* region(int r) const {
    return static_cast<char*>(shm_.data()) + static_cast<int64_t>(r) * geometry_.total_bytes;
  }
  char* own() const { return region(geometry_.rank); }
  int32_t* route_rows(int g, int64_t t) const {
    const Geometry& G = geometry_;
    return route_rows_.get() + (g * G.max_num_tokens + t) * G.experts_per_token;
  }

  void record(ErrorCode code, Phase phase, int peer, int64_t value, int64_t extra) {
    if (error_.code != static_cast<int32_t>(ErrorCode::kOk)) return;  // first error wins
    error_ = {static_cast<int32_t>(code), static_cast<int32_t>(phase), peer, 0, value, extra};
  }

  // m from bound_m, clamped to [0, min(T, rows of the inputs)]. With
  // `phase`, a clamp is reported as kBoundMTooLarge.
  int64_t clamped_m(const Tensor& bound_m, int64_t input_rows, const Phase* phase) {
    const int64_t limit = std::min(geometry_.max_num_tokens, input_rows);
    const int32_t raw = load<int32_t>(bound_m.data);
    bool bad = false;
    const int64_t m = clamp_m(raw, limit, &bad);
    if (bad && phase) record(ErrorCode::kBoundMTooLarge, *phase, -1, raw, limit);
    return m;
  }
  int64_t valid_tokens(const Tensor& bound_m, int64_t input_rows, Phase phase) {
    return clamped_m(bound_m, input_rows, &phase);
  }

  // Polls this rank's flags at `offset` until `ready` holds for all W of
  // them. On timeout records the first missing peer and returns false.
  template <typename Ready>
  bool wait_for_flags(int64_t offset, Phase phase, Ready ready) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options_.timeout_s));
    for (int s = 0; s < geometry_.world_size; ++s) {
      const char* flag = own() + offset + 8 * s;
      Backoff backoff;
      while (!ready(load_flag(flag))) {
        if (Clock::now() >= deadline) {
          record_timeout(phase, s);
          return false;
        }
        backoff.pause();
      }
    }
    return true;
  }

  void record_timeout(Phase phase, int peer) {
    timed_out_ = true;
    // ErrorRecord holds whole seconds; round up so that "after N s" is never
    // shorter than the actual wait.
    const auto secs = static_cast<int64_t>(std::ceil(options_.timeout_s));
    timeout_ = {static_cast<int32_t>(ErrorCode::kTimeout), static_cast<int32_t>(phase), peer, 0,
                secs, 0};
    if (error_.code == static_cast<int32_t>(ErrorCode::kOk)) error_ = timeout_;
  }

  // ---------------------------------------------------------------- dispatch helpers

  // Classifies token t's routes and writes one staging slot per distinct
  // destination rank, holding that rank's routes in route order.
  void send_token(const DispatchArgs& a, int64_t t) {
    const Geometry& G = geometry_;
    const int k = G.experts_per_token;
    int dest[kMaxTopK];
    RouteEntry entry[kMaxTopK];
    int n = 0;
    for (int i = 0; i < k; ++i) {
      const int64_t e = load_expert_id(a.indices.data, a.indices.dtype,
                                       t * a.indices.stride[0] + i * a.indices.stride[1]);
      const RouteKind kind = classify_route(e, G.num_experts);
      if (kind == RouteKind::kInvalid)
        record(ErrorCode::kBadExpertId, Phase::kDispatchSend, -1, e, t * k + i);
      if (kind != RouteKind::kValid) continue;
      dest[n] = G.rank_of_expert(e);
      entry[n] = {static_cast<int32_t>(e % G.num_local_experts), load<float>(elem(a.weights, t, i))};
      ++n;
    }
    bool sent[kMaxTopK] = {};
    for (int i = 0; i < n; ++i) {
      if (sent[i]) continue;
      RouteEntry mine[kMaxTopK];
      int count = 0;
      for (int j = i; j < n; ++j) {
        if (dest[j] != dest[i]) continue;
        mine[count++] = entry[j];
        sent[j] = true;
      }
      write_slot(a, dest[i], t, mine, count);
    }
  }

  void write_slot(const DispatchArgs& a, int dest, int64_t t, const RouteEntry* routes, int n) {
    const Geometry& G = geometry_;
    char* slot = region(dest) + G.staging_slot_offset(G.dp_group(), t);
    const SlotHeader h{epoch_, static_cast<uint32_t>(n), static_cast<uint32_t>(t), 0};
    std::memcpy(slot, &h, sizeof(h));
    std::memcpy(slot + G.slot_routes_offset, routes, sizeof(RouteEntry) * n);
    std::memcpy(slot + G.slot_token_offset, elem(a.dp_x, t), G.token_bytes);
    for (int s = 0; s < G.hidden_dim_scale; ++s)
      store<float>(slot + G.slot_scale_offset + 4 * s, load<float>(elem(a.dp_x_scale, t, s)));
  }

  // m of group g: the largest m its replicas announced (each replica sends
  // only its share of the tokens, but they all cover [0, m)).
  int64_t group_m(int g) const {
    const Geometry& G = geometry_;
    int64_t m = 0;
    for (int i = 0; i < G.dp_size; ++i) {
      const uint64_t f = load_flag(own() + G.dispatch_m_offset + 8 * (g * G.dp_size + i));
      if (dispatch_flag_epoch(f) == epoch_) m = std::max<int64_t>(m, dispatch_flag_m(f));
    }
    return std::min(m, G.max_num_tokens);  // never trust a peer with our bounds
  }

  void receive_group(const DispatchArgs& a, int g) {
    const Geometry& G = geometry_;
    const int64_t m = group_m(g);
    for (int64_t t = 0; t < m; ++t) {
      const char* slot = own() + G.staging_slot_offset(g, t);
      const SlotHeader h = load<SlotHeader>(slot);
      if (h.epoch != epoch_) continue;  // stale: token t has no route here
      receive_slot(a, g, t, slot, h);
    }
  }

  // Fans a received token out to its local experts, remembering each route's
  // row for combine (-1: dropped).
  void receive_slot(const DispatchArgs& a, int g, int64_t t, const char* slot, const SlotHeader& h) {
    const Geometry& G = geometry_;
    int32_t* rows = route_rows(g, t);
    const int n = std::min<int>(static_cast<int>(h.num_routes & ~kSlotComplete), G.experts_per_token);
    for (int e = 0; e < n; ++e) {
      const auto r = load<RouteEntry>(slot + G.slot_routes_offset + sizeof(RouteEntry) * e);
      rows[e] = take_row(r.local_expert);
      if (rows[e] >= 0) copy_slot_to_expert(geometry_, a, slot, r.local_expert, rows[e]);
    }
    valid_slots_.push_back({g, t});
  }

  int32_t take_row(int32_t j) {
    const Geometry& G = geometry_;
    if (j < 0 || j >= G.num_local_experts) return -1;  // cannot come from a moelink sender
    const int32_t row = counters_[j]++;
    if (row < G.expert_capacity) return row;
    record(ErrorCode::kExpertOverflow, Phase::kDispatchRecv, -1, j, G.expert_capacity);
    return -1;
  }


  // ---------------------------------------------------------------- combine helpers

  // This rank's share of token (g, t): its local experts' outputs weighted
  // and summed in fp32, rounded once, sent to every replica of group g.
  void combine_slot(const CombineArgs& a, int g, int64_t t) {
    const Geometry& G = geometry_;
    const char* slot = own() + G.staging_slot_offset(g, t);
    const SlotHeader h = load<SlotHeader>(slot);
    const int32_t* rows = route_rows(g, t);
    const int n = std::min<int>(static_cast<int>(h.num_routes & ~kSlotComplete), G.experts_per_token);
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    for (int e = 0; e < n; ++e) {
      if (rows[e] < 0) continue;
      const auto r = load<RouteEntry>(slot + G.slot_routes_offset + sizeof(RouteEntry) * e);
      add_scaled(acc_.data(), elem(a.expert_y, r.local_expert, rows[e]), a.expert_y.dtype,
                 G.hidden_dim, r.weight);
    }
    store_row(out_row_.data(), config_.out_dtype, acc_.data(), G.hidden_dim);
    for (int i = 0; i < G.dp_size; ++i)
      std::memcpy(region(g * G.dp_size + i) + G.combine_row_offset(G.rank, t), out_row_.data(),
                  G.combine_row_bytes);
  }

  // out_tokens[t] = sum of the shares of the distinct ranks holding token t's
  // valid routes (known from this rank's own indices), + out_tokens[t].
  void combine_token(const CombineArgs& a, int64_t t) {
    const Geometry& G = geometry_;
    int ranks[kMaxTopK];
    int n = 0;
    for (int i = 0; i < G.experts_per_token; ++i) {
      const int64_t e = load_expert_id(a.indices.data, a.indices.dtype,
                                       t * a.indices.stride[0] + i * a.indices.stride[1]);
      if (classify_route(e, G.num_experts) != RouteKind::kValid) continue;
      const int r = G.rank_of_expert(e);
      if (std::find(ranks, ranks + n, r) == ranks + n) ranks[n++] = r;
    }
    char* out = elem(a.out_tokens, t);
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    if (a.accumulate) add_scaled(acc_.data(), out, config_.out_dtype, G.hidden_dim, 1.0f);
    for (int i = 0; i < n; ++i)
      add_scaled(acc_.data(), own() + G.combine_row_offset(ranks[i], t), config_.out_dtype,
                 G.hidden_dim, 1.0f);
    store_row(out, config_.out_dtype, acc_.data(), G.hidden_dim);
  }

  SharedMemory shm_;
  uint32_t epoch_ = 0;  // dispatches so far; 0 is what fresh (zeroed) flags hold
  std::vector<int32_t> counters_;             // [L] rows taken per local expert
  std::unique_ptr<int32_t[]> route_rows_;     // [G][T][k] row per route entry, -1 dropped
  std::vector<SlotRef> valid_slots_;          // slots received in this epoch
  std::vector<float> acc_;                    // [H] fp32 scratch row
  std::vector<char> out_row_;                 // [H] out_dtype scratch row
  ErrorRecord error_{};                       // first error since the last check()
  ErrorRecord timeout_{};                     // the timeout, once there was one
  bool timed_out_ = false;
};

}  // namespace

std::unique_ptr<AllToAllImpl> make_cpu_impl(const Config& c, const ResolvedOptions& o,
                                            Bootstrap& bootstrap) {
  return std::make_unique<CpuAllToAll>(c, o, bootstrap);
}

}  // namespace moelink::detail
