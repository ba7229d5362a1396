// The measured operations, written once and run on both implementations
// (EngineTransport, RawTransport). Rank 0 is the sender, ranks 1..N the peers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "moelink/bootstrap.h"
#include "transports.h"

namespace moelink_fabric_bench {

struct RunOptions {
  std::vector<std::string> ops{"scatter", "paged", "pingpong"};
  size_t scatter_bytes = 4096, pages = 32, page_bytes = 4096, pingpong_bytes = 8;
  int lat_iters = 200, rate_iters = 200, warmup = 20, window = 16, rounds = 2;
  bool yield_when_idle = true;
  // Pin rank r's threads: the calling thread to CPU r, the engine's worker
  // to CPU world + r (past the process's CPU set: see pinned_cpus, main.cc).
  bool pin = false;
  // With pin: the worker on its rank's own CPU instead of CPU world + r
  // (then the engine uses exactly the CPUs the raw loop uses).
  bool worker_on_rank_cpu = false;
};

// Rank 0's measurements of one op with one implementation.
struct OpSamples {
  std::vector<double> lat_us;             // one per latency iteration, all rounds
  std::vector<double> lat_p50_per_round;  // median latency of each round
  std::vector<double> rate_s;             // seconds for rate_iters iterations, one per round
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

enum Imm : uint32_t {
  kScatter = 1, kBarrier = 2, kAck = 3, kPage = 4, kPing = 5, kPong = 6, kEnd = 7, kWarm = 8
};

inline uint8_t pattern(int rank, size_t i) { return static_cast<uint8_t>(rank * 31 + i * 7 + 1); }

inline double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Checks what the op left in this rank's dst (untimed).
void verify(const std::string& op, int rank, const Layout& l, const Buffers& buf,
            const RunOptions& o);

template <class T>
void run_ops(T& t, moelink::Bootstrap& b, const RunOptions& o, const Layout& l, Buffers& buf,
             std::map<std::string, OpSamples>& out) {
  const int rank = b.rank();
  const int n = b.world_size() - 1;
  const bool sender = rank == 0;
  // Connection warm-up (tcp connects on first use, both directions).
  if (sender) {
    t.post_barrier(kWarm);
    t.wait_ops(0);
    t.wait_imm(kAck, n);
  } else {
    t.wait_imm(kWarm, 1);
    t.post_ack(kAck);
    t.wait_ops(0);
  }
  const size_t w = static_cast<size_t>(o.window);
  for (const std::string& op : o.ops) {
    std::fill(buf.dst.begin(), buf.dst.end(), 0);
    b.barrier();
    OpSamples& s = out[op];
    // One latency iteration: post, wait for local completion and the acks.
    auto iteration = [&] {
      if (op == "scatter") {
        if (sender) {
          t.post_scatter(kScatter);
          t.post_barrier(kBarrier);
          t.wait_ops(0);
          t.wait_imm(kAck, n);
        } else {
          t.wait_imm(kScatter, 1);
          t.wait_imm(kBarrier, 1);
          t.post_ack(kAck);
          t.wait_ops(64);
        }
      } else if (op == "paged") {
        if (sender) {
          for (int p = 1; p <= n; ++p) t.post_paged(p, kPage);
          t.wait_ops(0);
          t.wait_imm(kAck, n);
        } else {
          t.wait_imm(kPage, l.pages);
          t.post_ack(kAck);
          t.wait_ops(64);
        }
      } else if (op == "pingpong") {
        if (sender) {
          t.post_write(1, o.pingpong_bytes, kPing);
          t.wait_imm(kPong, 1);
        } else if (rank == 1) {
          t.wait_imm(kPing, 1);
          t.post_write(0, o.pingpong_bytes, kPong);
        }
      } else {
        throw std::runtime_error("unknown op '" + op + "'");
      }
    };
    for (int i = 0; i < o.warmup; ++i) {
      iteration();
      t.wait_ops(64);
    }
    const size_t first = s.lat_us.size();
    for (int i = 0; i < o.lat_iters; ++i) {
      const double t0 = now_us();
      iteration();
      const double t1 = now_us();
      t.wait_ops(64);
      if (sender) s.lat_us.push_back(t1 - t0);
    }
    if (sender && s.lat_us.size() > first)
      s.lat_p50_per_round.push_back(
          median(std::vector<double>(s.lat_us.begin() + static_cast<std::ptrdiff_t>(first), s.lat_us.end())));
    // Message rate: rate_iters iterations with at most `window` in flight
    // (the same window for both implementations), then the acks.
    const int k = o.rate_iters;
    if (op == "scatter" || op == "paged") {
      const size_t per_iter = op == "scatter" ? 2 : static_cast<size_t>(n);
      if (sender) {
        const double t0 = now_us();
        for (int i = 0; i < k; ++i) {
          t.wait_ops((w - 1) * per_iter);
          if (op == "scatter") {
            t.post_scatter(kScatter);
            t.post_barrier(kBarrier);
          } else {
            for (int p = 1; p <= n; ++p) t.post_paged(p, kPage);
          }
        }
        t.wait_ops(0);
        t.wait_imm(kAck, n);
        s.rate_s.push_back((now_us() - t0) * 1e-6);
      } else {
        if (op == "scatter") {
          t.wait_imm(kScatter, k);
          t.wait_imm(kBarrier, k);
        } else {
          t.wait_imm(kPage, l.pages * k);
        }
        t.post_ack(kAck);
      }
    }
    t.wait_ops(0);
    verify(op, rank, l, buf, o);
    // End of the op: the peers keep polling until the sender says so.
    if (sender) {
      t.post_barrier(kEnd);
      t.wait_ops(0);
    } else {
      t.wait_imm(kEnd, 1);
    }
    b.barrier();
  }
  b.barrier();
}

}  // namespace moelink_fabric_bench
