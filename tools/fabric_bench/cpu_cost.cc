#include "cpu_cost.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <stdexcept>
#include <thread>
#include <vector>

#include "moelink/transfer_engine.h"
#include "raw_fabric.h"

namespace moelink_fabric_bench {

using namespace moelink::fabric;
using json = nlohmann::ordered_json;

namespace {

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Samples {
  std::vector<double> post, round;  // one p50 per repetition
  std::vector<double> stream;       // us per write of the stream, one per repetition
};

json summary(const Samples& s) {
  json j;
  j["post_us_p50"] = p50(s.post);
  j["round_us_p50"] = p50(s.round);
  j["post_us_per_rep"] = s.post;
  j["round_us_per_rep"] = s.round;
  j["stream_us_per_write_p50"] = p50(s.stream);
  j["stream_us_per_write_per_rep"] = s.stream;
  return j;
}

constexpr uint32_t kImm = 11;

// `iters` rounds of post() then complete(token), timed: post = post()
// alone, round = both. The token (the engine's Transfer) is dropped after
// the round's clock is read, so its destruction is not timed, for either.
// out null: a warm-up (tcp connects), not recorded.
template <class Post, class Complete>
void time_rounds(int iters, Samples* out, Post post, Complete complete) {
  std::vector<double> posts, rounds;
  for (int i = 0; i < iters; ++i) {
    const double t0 = now_us();
    auto token = post();
    const double t1 = now_us();
    complete(token);
    const double t2 = now_us();
    posts.push_back(t1 - t0);
    rounds.push_back(t2 - t0);
  }
  if (!out) return;
  out->post.push_back(p50(posts));
  out->round.push_back(p50(rounds));
}

void engine_rep(TransferEngine& a, TransferEngine& b, const MemoryRegion& src,
                const MemoryDescriptor& dst, int iters, Samples* out) {
  time_rounds(
      iters, out, [&] { return a.write(src, 0, dst, 0, 8, kImm); },
      [&](const TransferPtr& op) {
        b.wait_imm(kImm, 1);
        op->wait();
      });
}

void raw_rep(RawFabric& a, RawFabric& b, const RawFabric::Remote& dst, const void* src,
             void* desc, int iters, Samples* out) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  time_rounds(
      iters, out,
      [&] {
        a.write(dst, 0, src, 8, desc, true, kImm);
        return 0;  // no operation object
      },
      [&](int) {
        for (long spin = 0; a.outstanding() > 0 || !b.take_imm(kImm); ++spin) {
          a.progress();
          b.progress();
          if (spin % 4096 == 4095 && std::chrono::steady_clock::now() > give_up)
            throw std::runtime_error("cpu cost: a raw write did not complete within 30 s");
        }
      });
}

// A windowed stream of paged writes, the message-rate pattern of the
// multi-process bench without its scheduling noise: this thread posts
// `ops` operations of kStreamPages 4 KB pages each, at most kStreamWindow in
// flight; one more thread drives the target (its wait for every immediate).
// Returns microseconds per write.
constexpr size_t kStreamPages = 32, kStreamWindow = 16, kPageBytes = 4096;
constexpr uint32_t kStreamImm = 12;

double engine_stream(TransferEngine& a, TransferEngine& b, const MemoryRegion& src,
                     const MemoryDescriptor& dst, int ops) {
  PagedWrite p;
  p.page_bytes = kPageBytes;
  p.src_stride = p.dst_stride = kPageBytes;
  for (size_t i = 0; i < kStreamPages; ++i) {
    p.src_pages.push_back(kStreamPages - 1 - i);
    p.dst_pages.push_back((i * 7) % kStreamPages);
  }
  std::thread target([&] { b.wait_imm(kStreamImm, kStreamPages * static_cast<uint64_t>(ops)); });
  std::deque<TransferPtr> out;
  const double t0 = now_us();
  for (int i = 0; i < ops; ++i) {
    while (out.size() >= kStreamWindow) {
      out.front()->wait();
      out.pop_front();
    }
    out.push_back(a.paged_write(src, dst, p, kStreamImm));
  }
  for (auto& op : out) op->wait();
  target.join();
  return (now_us() - t0) / (static_cast<double>(ops) * kStreamPages);
}

double raw_stream(RawFabric& a, RawFabric& b, const RawFabric::Remote& dst, const char* src,
                  void* desc, int ops) {
  std::thread target([&] { b.wait_imm(kStreamImm, kStreamPages * static_cast<uint64_t>(ops)); });
  const double t0 = now_us();
  for (int i = 0; i < ops; ++i) {
    a.wait_ops(kStreamWindow - 1);
    for (size_t k = 0; k < kStreamPages; ++k)
      a.write(dst, ((k * 7) % kStreamPages) * kPageBytes, src + (kStreamPages - 1 - k) * kPageBytes,
              kPageBytes, desc, true, kStreamImm);
    a.mark_op();
  }
  a.wait_ops(0);
  target.join();
  return (now_us() - t0) / (static_cast<double>(ops) * kStreamPages);
}

}  // namespace

json measure_cpu_cost(const std::string& provider, int iters, int reps) {
  std::vector<char> src(kStreamPages * kPageBytes, 1), dst(kStreamPages * kPageBytes, 0);
  const int stream_ops = std::max(1, iters / static_cast<int>(kStreamPages));
  Samples eng, raw;
  for (int rep = 0; rep < reps; ++rep) {
    {
      EngineOptions o;
      o.provider = provider;
      o.name = "a";
      auto a = TransferEngine::create(o);
      o.name = "b";
      auto b = TransferEngine::create(o);
      auto rs = a->register_memory(src.data(), src.size());
      auto rd = b->register_memory(dst.data(), dst.size());
      const MemoryDescriptor d = b->descriptor(rd);
      engine_rep(*a, *b, rs, d, std::max(1, iters / 10), nullptr);
      engine_rep(*a, *b, rs, d, iters, &eng);
      engine_stream(*a, *b, rs, d, std::max(1, stream_ops / 10));
      eng.stream.push_back(engine_stream(*a, *b, rs, d, stream_ops));
    }
    {
      RawFabric a(provider, true, 30.0), b(provider, true, 30.0);
      auto ma = a.register_memory(src.data(), src.size());
      auto mb = b.register_memory(dst.data(), dst.size());
      RawFabric::Remote r;
      r.addr = a.insert(b.name());
      r.base = b.remote_base(dst.data());
      r.key = mb.key;
      // The first write may need the target's progress to be accepted
      // (connection set-up): poll it from a second thread meanwhile.
      std::atomic<bool> stop{false};
      std::thread helper([&] {
        while (!stop) b.progress();
      });
      a.write(r, 0, src.data(), 8, ma.desc, true, kImm);
      while (a.outstanding() > 0) a.progress();
      stop = true;
      helper.join();
      while (!b.take_imm(kImm)) b.progress();
      raw_rep(a, b, r, src.data(), ma.desc, std::max(1, iters / 10), nullptr);
      raw_rep(a, b, r, src.data(), ma.desc, iters, &raw);
      raw_stream(a, b, r, src.data(), ma.desc, std::max(1, stream_ops / 10));
      raw.stream.push_back(raw_stream(a, b, r, src.data(), ma.desc, stream_ops));
      fi_close(&ma.mr->fid);
      fi_close(&mb.mr->fid);
    }
  }
  json j;
  j["what"] =
      "two endpoints in one process, one thread: post = the call posting one 8-byte write with "
      "an immediate; round = post + the target's immediate counted + the local completion "
      "(engine: write, wait_imm on the target, Transfer::wait; raw: fi_writemsg, then reading "
      "both CQs until both are seen); p50 over `iters` per repetition, median over repetitions";
  j["iters"] = iters;
  j["reps"] = reps;
  j["engine"] = summary(eng);
  j["raw"] = summary(raw);
  j["engine_minus_raw_us"]["post"] = j["engine"]["post_us_p50"].get<double>() -
                                     j["raw"]["post_us_p50"].get<double>();
  j["engine_minus_raw_us"]["round"] = j["engine"]["round_us_p50"].get<double>() -
                                      j["raw"]["round_us_p50"].get<double>();
  j["stream_what"] =
      "us per write of a stream of paged writes (32 pages of 4096 bytes per operation, at most 16 "
      "operations in flight) from one thread, the target driven by a second thread waiting for "
      "every immediate; median over repetitions";
  j["engine_over_raw"]["stream"] = j["engine"]["stream_us_per_write_p50"].get<double>() /
                                   j["raw"]["stream_us_per_write_p50"].get<double>();
  return j;
}

}  // namespace moelink_fabric_bench
