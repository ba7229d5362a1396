#include "moelink_runner.h"

#include <functional>
#include <memory>
#include <vector>

#include "moelink/all_to_all.h"
#include "verify.h"

namespace moelink_bench {

namespace {

struct Caller {
  moelink::AllToAll& a;
  Buffers& b;
  cudaStream_t s;
  void dispatch(int p, bool send, bool recv) {
    const RoutingTensors& r = b.pool[p];
    a.dispatch(b.out_expert_num_tokens, b.out_expert_x, b.out_expert_x_scale, b.dp_x,
               b.dp_x_scale, r.indices, r.weights, r.bound_m, s, send, recv);
  }
  void combine(int p, bool send, bool recv) {
    const RoutingTensors& r = b.pool[p];
    a.combine(b.out_tokens, r.indices, r.weights, b.expert_y, r.bound_m, s, send, recv);
  }
};

}  // namespace

MoelinkRun run_moelink(moelink::Bootstrap& boot, Platform& pl, const BenchOptions& o,
                       const Workload& w, Buffers& b, const std::vector<float>& expected) {
  moelink::Options opt;
  opt.backend = o.gpu() ? moelink::Backend::kNVLink : moelink::Backend::kCPU;
  opt.num_blocks = o.num_blocks;
  auto a2a = moelink::AllToAll::create(w.config, boot, opt);
  Caller c{*a2a, b, pl.stream()};
  const int rank = boot.rank(), pool = static_cast<int>(b.pool.size());
  MoelinkRun run;
  run.buffer_bytes = a2a->buffer_bytes();

  // Correctness first: expert counts, then identity experts and combine.
  c.dispatch(0, true, true);
  a2a->check();
  std::vector<int32_t> counts(w.L);
  pl.download(counts.data(), b.out_expert_num_tokens.data, counts.size() * 4);
  verify_counts("moelink dispatch", rank, counts, w.traffic[0].my_expert_counts);
  pl.identity_experts(identity_of(b, w, static_cast<const int32_t*>(b.out_expert_num_tokens.data)));
  c.combine(0, true, true);
  a2a->check();
  std::vector<uint16_t> out(static_cast<size_t>(w.T * w.H));
  pl.download(out.data(), b.out_tokens.data, out.size() * 2);
  verify_combine("moelink combine", rank, w, out, expected);

  for (int i = 0; i < o.warmup; ++i) {
    c.dispatch(i % pool, true, true);
    c.combine(i % pool, true, true);
  }
  a2a->check();  // also waits for the warmup to drain
  boot.barrier();

  {
    auto timer = pl.make_timer(o.iters, 3);
    for (int i = 0; i < o.iters; ++i) {
      timer->mark(i, 0);
      c.dispatch(i % pool, true, true);
      timer->mark(i, 1);
      c.combine(i % pool, true, true);
      timer->mark(i, 2);
    }
    timer->finish();
    a2a->check();
    auto& d = run.samples["dispatch"];
    auto& cb = run.samples["combine"];
    auto& rt = run.samples["roundtrip"];
    for (int i = 0; i < o.iters; ++i) {
      d.push_back(timer->elapsed_us(i, 0, 1));
      cb.push_back(timer->elapsed_us(i, 1, 2));
      rt.push_back(timer->elapsed_us(i, 0, 2));
    }
  }

  if (o.graph && pl.gpu()) {
    // One graph per routing set for each of dispatch and combine, captured in
    // call order; replays advance the library's device-side epoch.
    std::vector<std::function<void()>> gd, gc;
    for (int p = 0; p < pool; ++p) {
      gd.push_back(pl.capture([&] { c.dispatch(p, true, true); }));
      gc.push_back(pl.capture([&] { c.combine(p, true, true); }));
    }
    for (int i = 0; i < o.warmup; ++i) {
      gd[i % pool]();
      gc[i % pool]();
    }
    a2a->check();
    boot.barrier();
    auto timer = pl.make_timer(o.iters, 3);
    for (int i = 0; i < o.iters; ++i) {
      timer->mark(i, 0);
      gd[i % pool]();
      timer->mark(i, 1);
      gc[i % pool]();
      timer->mark(i, 2);
    }
    timer->finish();
    a2a->check();
    for (int i = 0; i < o.iters; ++i) {
      run.samples["dispatch_graph"].push_back(timer->elapsed_us(i, 0, 1));
      run.samples["combine_graph"].push_back(timer->elapsed_us(i, 1, 2));
      run.samples["roundtrip_graph"].push_back(timer->elapsed_us(i, 0, 2));
    }
  }

  if (o.split) {
    for (int i = 0; i < o.warmup; ++i) {
      const int p = i % pool;
      c.dispatch(p, true, false);
      c.dispatch(p, false, true);
      c.combine(p, true, false);
      c.combine(p, false, true);
    }
    a2a->check();
    boot.barrier();
    auto timer = pl.make_timer(o.iters, 5);
    for (int i = 0; i < o.iters; ++i) {
      const int p = i % pool;
      timer->mark(i, 0);
      c.dispatch(p, true, false);
      timer->mark(i, 1);
      c.dispatch(p, false, true);
      timer->mark(i, 2);
      c.combine(p, true, false);
      timer->mark(i, 3);
      c.combine(p, false, true);
      timer->mark(i, 4);
    }
    timer->finish();
    a2a->check();
    const char* names[] = {"dispatch_send", "dispatch_recv", "combine_send", "combine_recv"};
    for (int q = 0; q < 4; ++q) {
      auto& v = run.samples[names[q]];
      for (int i = 0; i < o.iters; ++i) v.push_back(timer->elapsed_us(i, q, q + 1));
    }
  }
  // Destroying the AllToAll is collective in spirit: keep the peers' memory
  // mapped until everyone is done with it.
  pl.sync();
  boot.barrier();
  return run;
}

}  // namespace moelink_bench
