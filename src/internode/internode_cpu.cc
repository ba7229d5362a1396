// kInternodeCPU: the inter-node protocol (protocol.h) with CPU loops where
// the GPU backend runs kernels: the same Proxy thread, the same
// TransferEngine, host tensors. It lets CI run the whole protocol across
// processes over libfabric's shm and tcp providers, and serves as the
// reference the GPU version is held to. Node peers (Options.node_size) share
// one POSIX shared memory segment per node: their slots and rows are stored
// straight into each other's local areas, as the GPU backend does over
// NVLink.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/all_to_all_impl.h"
#include "core/host_ops.h"
#include "core/host_slots.h"
#include "cpu/shared_memory.h"
#include "internode/internode_impl.h"
#include "internode/protocol.h"
#include "internode/proxy.h"
#include "moelink/errors.h"

namespace moelink::detail::internode {

namespace {

using Clock = std::chrono::steady_clock;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using HostBuffer = std::unique_ptr<char, FreeDeleter>;

HostBuffer alloc_host(int64_t bytes) {
  void* p = std::aligned_alloc(4096, static_cast<size_t>(align_up(bytes, 4096)));
  if (p == nullptr)
    throw SystemError("moelink: internode-cpu: cannot allocate " + std::to_string(bytes) +
                      " bytes of host buffers");
  std::memset(p, 0, static_cast<size_t>(bytes));
  return HostBuffer(static_cast<char*>(p));
}

// One route group of a token: the distinct destination rank, the token's
// position among its sender's tokens for that rank, and its routes there.
struct Destination {
  int rank;
  int32_t index;  // j: position in the sender's block for `rank`
  int num_routes;
  RouteEntry routes[kMaxTopK];
};

// A slot this rank received, in receive order: what combine needs.
struct Received {
  int sender;
  int num_routes;
  RouteEntry routes[kMaxTopK];
  int32_t rows[kMaxTopK];  // row per route in out_expert_x, -1: dropped
};

class InternodeCpu final : public AllToAllImpl {
 public:
  InternodeCpu(const Config& c, const ResolvedOptions& o, Bootstrap& bootstrap)
      : AllToAllImpl(c, o),
        layout_(make_layout(geometry_, o.max_private_tokens, o.node_size)),
        send_(alloc_host(layout_.send_bytes)),
        recv_(alloc_host(layout_.recv_bytes)),
        // Mapped and zeroed by every node peer before the proxy starts.
        local_(bootstrap, static_cast<size_t>(layout_.local_bytes * o.node_size), o.node_size),
        signals_{},
        plan_view_{c.world_size, c.dp_size},
        output_(static_cast<size_t>(ProxyOutput::bytes(plan_view_) / 8), 0),
        proxy_(geometry_, layout_, o, &signals_, ProxyOutput{reinterpret_cast<char*>(output_.data())},
               /*spin_polls=*/256),
        tokens_(static_cast<size_t>(geometry_.max_num_tokens)),
        num_dests_(static_cast<size_t>(geometry_.max_num_tokens), 0),
        counters_(static_cast<size_t>(geometry_.num_local_experts), 0),
        counts_(static_cast<size_t>(c.dp_size) * c.world_size, 0),
        blocks_(static_cast<size_t>(c.world_size), 0),
        acc_(static_cast<size_t>(geometry_.hidden_dim)) {
    for (auto& t : tokens_)
      t.resize(static_cast<size_t>(std::min(c.experts_per_token, c.world_size)));
    Proxy::Buffers b;
    b.send = send_.get();
    b.recv = recv_.get();
    b.own_header = send_.get();  // block 0's header
    proxy_.start(b, bootstrap);
  }

  Backend backend() const override { return Backend::kInternodeCPU; }
  size_t buffer_bytes() const override {
    return static_cast<size_t>(layout_.send_bytes + layout_.recv_bytes + layout_.local_bytes);
  }

  void dispatch(const DispatchArgs& a, bool send, bool recv) override {
    if (send) dispatch_send(a);
    if (recv) dispatch_recv(a);
  }
  void combine(const CombineArgs& a, bool send, bool recv) override {
    if (send) combine_send(a);
    if (recv) combine_recv(a);
  }

  ErrorRecord wait_and_take_error() override {
    // The proxy's errors are final and outrank input errors: the object is
    // unusable once one happened.
    if (proxy_.failed()) {
      detail_ = proxy_.error_detail();
      return proxy_.error();
    }
    if (local_timeout_.code != static_cast<int32_t>(ErrorCode::kOk)) {
      detail_ = "the proxy thread did not finish its step";
      return local_timeout_;
    }
    detail_.clear();
    ErrorRecord e = error_;
    error_ = {};
    return e;
  }
  std::string error_detail() const override { return detail_; }

 private:
  // ---------------------------------------------------------------- dispatch

  void dispatch_send(const DispatchArgs& a) {
    const Geometry& G = geometry_;
    const auto start = Clock::now();
    ++epoch_;
    const int64_t m = clamped_m(a.bound_m, a.input_rows, Phase::kDispatchSend);
    dispatch_m_ = m;
    // Every token of the group, not only this replica's: combine needs the
    // other replicas' positions too (protocol.h, step 6).
    std::vector<uint32_t>& counts = counts_;
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t t = 0; t < m; ++t) classify(a, t, counts);
    const int mine = G.rank % G.dp_size;
    const uint32_t* own = counts.data() + static_cast<size_t>(mine) * G.world_size;
    // The header at the front of every block (the proxy reads block 0's).
    const RouteHeader h{epoch_, static_cast<uint32_t>(m)};
    std::memcpy(send_.get(), &h, sizeof(h));
    std::memcpy(send_.get() + sizeof(h), own, sizeof(uint32_t) * G.world_size);
    block_offsets(layout_, own, blocks_.data());
    for (int r = 1; r < G.world_size; ++r)
      std::memcpy(send_.get() + blocks_[r], send_.get(), static_cast<size_t>(layout_.header_bytes));
    for (int64_t t = 0; t < m; ++t) {
      if (!G.sends_token(t)) continue;
      for (int d = 0; d < num_dests_[t]; ++d) {
        const Destination& dest = tokens_[t][d];
        // Node peers straight into their local area (protocol.h), the others
        // into the block the proxy sends.
        char* slot = layout_.is_local(G.rank, dest.rank)
                         ? local_area(dest.rank) + layout_.local_slot_offset(G.rank, dest.index)
                         : send_.get() + blocks_[dest.rank] + layout_.header_bytes +
                               dest.index * layout_.slot_bytes;
        write_slot(a, t, dest, slot);
      }
    }
    times_.dispatch.pack_us = us_since(start);
    request(dispatch_step(epoch_));
  }

  void dispatch_recv(const DispatchArgs& a) {
    const Geometry& G = geometry_;
    std::fill(counters_.begin(), counters_.end(), 0);
    received_.clear();
    const bool ok = wait_done(dispatch_step(epoch_), Phase::kDispatchRecv);
    const auto start = Clock::now();
    if (ok) unpack(a);
    for (int j = 0; j < G.num_local_experts; ++j)
      store<int32_t>(elem(a.out_expert_num_tokens, j),
                     static_cast<int32_t>(std::min<int64_t>(counters_[j], G.expert_capacity)));
    times_.dispatch.unpack_us = us_since(start);
  }

  // ---------------------------------------------------------------- combine

  void combine_send(const CombineArgs& a) {
    const Geometry& G = geometry_;
    const auto start = Clock::now();
    char* rows = send_.get() + layout_.send_combine_offset;
    for (size_t i = 0; i < received_.size(); ++i) {
      const Received& r = received_[i];
      std::fill(acc_.begin(), acc_.end(), 0.0f);
      for (int e = 0; e < r.num_routes; ++e)
        if (r.rows[e] >= 0)
          add_scaled(acc_.data(), elem(a.expert_y, r.routes[e].local_expert, r.rows[e]),
                     a.expert_y.dtype, G.hidden_dim, r.routes[e].weight);
      // Replicas in this node get the row straight into their local area,
      // where the proxy would have written it; the others through the
      // engine, from row i of the send buffer.
      const int grp = G.dp_group_of(r.sender);
      const int64_t row = static_cast<int64_t>(i) + plan(plan_view_.row_shift(grp));
      bool remote = false;
      for (int q = grp * G.dp_size; q < (grp + 1) * G.dp_size; ++q) {
        if (!layout_.is_local(q, G.rank))
          remote = true;
        else if (row >= 0 && row < layout_.combine_rows)  // never outside with a consistent plan
          store_row(local_area(q) + layout_.local_row_offset(row), config_.out_dtype, acc_.data(),
                    G.hidden_dim);
      }
      if (remote)
        store_row(rows + static_cast<int64_t>(i) * layout_.row_bytes, config_.out_dtype,
                  acc_.data(), G.hidden_dim);
    }
    times_.combine.pack_us = us_since(start);
    request(combine_step(epoch_));
  }

  void combine_recv(const CombineArgs& a) {
    const Geometry& G = geometry_;
    if (!wait_done(combine_step(epoch_), Phase::kCombineRecv)) return;
    const auto start = Clock::now();
    bool clamped = false;
    const int64_t m =
        clamp_m(load<int32_t>(a.bound_m.data), std::min(G.max_num_tokens, a.input_rows), &clamped);
    if (plan(kPlanCombineEpoch) != epoch_) return;
    const char* area = recv_.get() + layout_.combine_offset;
    const char* local = local_area(G.rank) + layout_.local_combine_offset;
    for (int64_t t = 0; t < m; ++t) {
      char* out = elem(a.out_tokens, t);
      std::fill(acc_.begin(), acc_.end(), 0.0f);
      if (a.accumulate) add_scaled(acc_.data(), out, config_.out_dtype, G.hidden_dim, 1.0f);
      const int q = G.sender_replica(t);
      const int n = t < dispatch_m_ ? num_dests_[t] : 0;
      for (int d = 0; d < n; ++d) {
        const Destination& dest = tokens_[t][d];
        // Row of token t in rank dest.rank's block (protocol.h, step 6);
        // never trust the counts with our bounds.
        if (dest.index >= plan(plan_view_.row_count(q, dest.rank))) continue;
        const int64_t row = plan(plan_view_.row_base(q, dest.rank)) + dest.index;
        if (row < 0 || row >= layout_.combine_rows) continue;
        const char* src = layout_.is_local(dest.rank, G.rank) ? local : area;
        add_scaled(acc_.data(), src + row * layout_.row_bytes, config_.out_dtype, G.hidden_dim,
                   1.0f);
      }
      store_row(out, config_.out_dtype, acc_.data(), G.hidden_dim);
    }
    times_.combine.unpack_us = us_since(start);
  }

  CallTimes phase_times() override {
    if (!options_.profile) return {};
    CallTimes t = times_;
    const PhaseTimes d = proxy_.dispatch_times(), c = proxy_.combine_times();
    t.dispatch.post_us = d.post_us;
    t.dispatch.wire_us = d.wire_us;
    t.combine.post_us = c.post_us;
    t.combine.wire_us = c.wire_us;
    return t;
  }

  // ---------------------------------------------------------------- helpers

  static double us_since(Clock::time_point start) {
    return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  }

  // Node peer r's local area (this rank's own included), in the node segment.
  char* local_area(int r) const {
    return static_cast<char*>(local_.data()) + layout_.local_index(r) * layout_.local_bytes;
  }

  int64_t plan(int64_t word) const {
    int64_t* words = reinterpret_cast<int64_t*>(
        reinterpret_cast<char*>(const_cast<uint64_t*>(output_.data())) + ProxyOutput::kPlanOffset);
    return std::atomic_ref<int64_t>(words[word]).load(std::memory_order_acquire);
  }

  void request(uint64_t step) {
    std::atomic_ref<uint64_t>(signals_.request).store(step, std::memory_order_release);
  }

  // Waits until the proxy finished `step`. False when it failed (or, as a
  // last resort, did not finish in time).
  bool wait_done(uint64_t step, Phase phase) {
    if (local_timeout_.code != static_cast<int32_t>(ErrorCode::kOk)) return false;
    // The proxy bounds each step by timeout_s; the slack covers scheduling.
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(2 * options_.timeout_s + 5));
    Backoff backoff;
    while (std::atomic_ref<uint64_t>(signals_.done).load(std::memory_order_acquire) < step) {
      if (Clock::now() >= deadline) {
        local_timeout_ = {static_cast<int32_t>(ErrorCode::kTimeout),
                          static_cast<int32_t>(phase),
                          -1,
                          0,
                          static_cast<int64_t>(2 * options_.timeout_s + 5),
                          0};
        return false;
      }
      backoff.pause();
    }
    return !proxy_.failed();
  }

  void record(ErrorCode code, Phase phase, int64_t value, int64_t extra) {
    if (error_.code != static_cast<int32_t>(ErrorCode::kOk)) return;  // first error wins
    error_ = {static_cast<int32_t>(code), static_cast<int32_t>(phase), -1, 0, value, extra};
  }

  int64_t clamped_m(const Tensor& bound_m, int64_t input_rows, Phase phase) {
    const int64_t limit = std::min(geometry_.max_num_tokens, input_rows);
    const int32_t raw = load<int32_t>(bound_m.data);
    bool bad = false;
    const int64_t m = clamp_m(raw, limit, &bad);
    if (bad) record(ErrorCode::kBoundMTooLarge, phase, raw, limit);
    return m;
  }

  // Groups token t's valid routes by destination rank (in route order) and
  // gives each destination the token's position among its sender's tokens
  // for that rank. Bad ids are reported once, by the replica that sends t.
  void classify(const DispatchArgs& a, int64_t t, std::vector<uint32_t>& counts) {
    const Geometry& G = geometry_;
    const int k = G.experts_per_token;
    uint32_t* sender_counts =
        counts.data() + static_cast<size_t>(G.sender_replica(t)) * G.world_size;
    std::vector<Destination>& dests = tokens_[t];
    int n = 0;
    for (int i = 0; i < k; ++i) {
      const int64_t e = load_expert_id(a.indices.data, a.indices.dtype,
                                       t * a.indices.stride[0] + i * a.indices.stride[1]);
      const RouteKind kind = classify_route(e, G.num_experts);
      if (kind == RouteKind::kInvalid && G.sends_token(t))
        record(ErrorCode::kBadExpertId, Phase::kDispatchSend, e, t * k + i);
      if (kind != RouteKind::kValid) continue;
      const int r = G.rank_of_expert(e);
      const RouteEntry entry{static_cast<int32_t>(e % G.num_local_experts),
                             load<float>(elem(a.weights, t, i))};
      int d = 0;
      while (d < n && dests[d].rank != r) ++d;
      if (d == n) {
        dests[d].rank = r;
        dests[d].index = static_cast<int32_t>(sender_counts[r]++);
        dests[d].num_routes = 0;
        ++n;
      }
      dests[d].routes[dests[d].num_routes++] = entry;
    }
    num_dests_[t] = n;
  }

  void write_slot(const DispatchArgs& a, int64_t t, const Destination& d, char* slot) {
    const Geometry& G = geometry_;
    const SlotHeader h{epoch_, static_cast<uint32_t>(d.num_routes), static_cast<uint32_t>(t), 0};
    std::memcpy(slot, &h, sizeof(h));
    std::memcpy(slot + G.slot_routes_offset, d.routes, sizeof(RouteEntry) * d.num_routes);
    std::memcpy(slot + G.slot_token_offset, elem(a.dp_x, t), G.token_bytes);
    for (int s = 0; s < G.hidden_dim_scale; ++s)
      store<float>(slot + G.slot_scale_offset + 4 * s, load<float>(elem(a.dp_x_scale, t, s)));
  }

  // Every slot this rank received, in receive order (sender by sender), to
  // the batched-experts layout.
  void unpack(const DispatchArgs& a) {
    const Geometry& G = geometry_;
    if (plan(kPlanDispatchEpoch) != epoch_) return;
    for (int s = 0; s < G.world_size; ++s) {
      const int64_t count = plan(plan_view_.recv_base(s + 1)) - plan(plan_view_.recv_base(s));
      const int64_t shared_base = plan(plan_view_.shared_base(s));
      const bool local = layout_.is_local(s, G.rank);
      // check_receiver bounds every count by T = local_slots.
      const int64_t n = local ? std::min(count, layout_.local_slots) : count;
      for (int64_t j = 0; j < n; ++j) {
        const char* slot = local ? local_area(G.rank) + layout_.local_slot_offset(s, j)
                                 : recv_.get() + layout_.recv_slot_offset(s, j, shared_base);
        const SlotHeader h = load<SlotHeader>(slot);
        Received r{};
        r.sender = s;
        // A slot of another epoch or with more routes than k cannot come
        // from a moelink sender; it keeps its place in receive order (the
        // sender's combine rows count it) but carries nothing.
        if (h.epoch == epoch_)
          r.num_routes = std::min<int>(static_cast<int>(h.num_routes), G.experts_per_token);
        for (int e = 0; e < r.num_routes; ++e) {
          r.routes[e] = load<RouteEntry>(slot + G.slot_routes_offset + sizeof(RouteEntry) * e);
          r.rows[e] = take_row(r.routes[e].local_expert);
          if (r.rows[e] >= 0)
            copy_slot_to_expert(geometry_, a, slot, r.routes[e].local_expert, r.rows[e]);
        }
        received_.push_back(r);
      }
    }
  }

  int32_t take_row(int32_t j) {
    const Geometry& G = geometry_;
    if (j < 0 || j >= G.num_local_experts) return -1;
    const int32_t row = counters_[j]++;
    if (row < G.expert_capacity) return row;
    record(ErrorCode::kExpertOverflow, Phase::kDispatchRecv, j, G.expert_capacity);
    return -1;
  }

  Layout layout_;
  HostBuffer send_, recv_;
  SharedMemory local_;  // the node's segment: node_size local areas
  ProxySignals signals_;
  PlanView plan_view_;
  std::vector<uint64_t> output_;  // ProxyOutput: ready words (unused here) and the plan
  Proxy proxy_;
  uint32_t epoch_ = 0;
  int64_t dispatch_m_ = 0;
  std::vector<std::vector<Destination>> tokens_;  // [T][min(k, W)] per token of the group
  std::vector<int> num_dests_;                    // [T]
  std::vector<Received> received_;                // this epoch's slots, receive order
  std::vector<int32_t> counters_;                 // [L] rows taken per local expert
  std::vector<uint32_t> counts_;                  // [dp][W] tokens replica q sends rank r
  std::vector<int64_t> blocks_;                   // [W] own dispatch blocks in send
  std::vector<float> acc_;                        // [H] fp32 scratch row
  ErrorRecord error_{};                           // first input error since check()
  ErrorRecord local_timeout_{};
  std::string detail_;
  CallTimes times_;  // pack / unpack of the last calls
};

}  // namespace

std::unique_ptr<AllToAllImpl> make_internode_cpu_impl(const Config& c, const ResolvedOptions& o,
                                                      Bootstrap& bootstrap) {
  return std::make_unique<InternodeCpu>(c, o, bootstrap);
}

}  // namespace moelink::detail::internode
