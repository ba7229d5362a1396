#include "moelink_runner.h"

#include <algorithm>
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

moelink::Backend backend_of(const std::string& name) {
  if (name == "nvshmem") return moelink::Backend::kNVSHMEM;
  if (name == "cpu") return moelink::Backend::kCPU;
  if (name == "internode") return moelink::Backend::kInternode;
  if (name == "internode-cpu") return moelink::Backend::kInternodeCPU;
  return moelink::Backend::kNVLink;
}

namespace {

bool has_proxy(moelink::Backend b) {
  return b == moelink::Backend::kInternode || b == moelink::Backend::kInternodeCPU;
}

moelink::Options options_for(const BenchOptions& o, moelink::Backend backend) {
  moelink::Options opt;
  opt.backend = backend;
  opt.num_blocks = o.num_blocks;
  opt.fabric_provider = o.fabric_provider;
  opt.max_private_tokens = o.max_private_tokens;
  opt.node_size = o.node_size;
  opt.gpu_direct = o.gpu_direct;
  opt.profile = 0;  // the timed loops run without events; phases are timed apart
  return opt;
}

// The proxy backends' phases (pack, post, wire, unpack of dispatch and
// combine), from a second AllToAll created with Options.profile, which
// records CUDA events around the kernels (a little latency the timed loops
// above do not pay).
void time_phases(moelink::Bootstrap& boot, Platform& pl, const BenchOptions& o,
                 const Workload& w, Buffers& b, moelink::Backend backend,
                 const std::string& prefix, Samples& samples) {
  moelink::Options opt = options_for(o, backend);
  opt.profile = 1;
  auto a2a = moelink::AllToAll::create(w.config, boot, opt);
  Caller c{*a2a, b, pl.stream()};
  const int pool = static_cast<int>(b.pool.size());
  const int iters = std::min(o.iters, 200);
  for (int i = 0; i < o.warmup + iters; ++i) {
    c.dispatch(i % pool, true, true);
    c.combine(i % pool, true, true);
    const moelink::CallTimes t = a2a->phase_times();  // waits for the round
    if (i < o.warmup) continue;
    for (const auto& [name, p] : {std::pair{"dispatch", t.dispatch}, std::pair{"combine", t.combine}}) {
      samples[prefix + name + "_pack"].push_back(p.pack_us);
      samples[prefix + name + "_post"].push_back(p.post_us);
      samples[prefix + name + "_wire"].push_back(p.wire_us);
      samples[prefix + name + "_unpack"].push_back(p.unpack_us);
    }
  }
  a2a->check();
  pl.sync();
  boot.barrier();
}

}  // namespace

MoelinkRun run_moelink(moelink::Bootstrap& boot, Platform& pl, const BenchOptions& o,
                       const Workload& w, Buffers& b, const std::vector<float>& expected,
                       moelink::Backend backend, const std::string& prefix) {
  auto a2a = moelink::AllToAll::create(w.config, boot, options_for(o, backend));
  Caller c{*a2a, b, pl.stream()};
  const int rank = boot.rank(), pool = static_cast<int>(b.pool.size());
  MoelinkRun run;
  run.buffer_bytes = a2a->buffer_bytes();

  // Correctness first: expert counts, then identity experts and combine.
  c.dispatch(0, true, true);
  a2a->check();
  std::vector<int32_t> counts(w.L);
  pl.download(counts.data(), b.out_expert_num_tokens.data, counts.size() * 4);
  const std::string what = std::string("moelink ") + moelink::backend_name(backend);
  verify_counts((what + " dispatch").c_str(), rank, counts, w.traffic[0].my_expert_counts);
  pl.identity_experts(identity_of(b, w, static_cast<const int32_t*>(b.out_expert_num_tokens.data)));
  c.combine(0, true, true);
  a2a->check();
  std::vector<uint16_t> out(static_cast<size_t>(w.T * w.H));
  pl.download(out.data(), b.out_tokens.data, out.size() * 2);
  verify_combine((what + " combine").c_str(), rank, w, out, expected);

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
    auto& d = run.samples[prefix + "dispatch"];
    auto& cb = run.samples[prefix + "combine"];
    auto& rt = run.samples[prefix + "roundtrip"];
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
      run.samples[prefix + "dispatch_graph"].push_back(timer->elapsed_us(i, 0, 1));
      run.samples[prefix + "combine_graph"].push_back(timer->elapsed_us(i, 1, 2));
      run.samples[prefix + "roundtrip_graph"].push_back(timer->elapsed_us(i, 0, 2));
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
      auto& v = run.samples[prefix + names[q]];
      for (int i = 0; i < o.iters; ++i) v.push_back(timer->elapsed_us(i, q, q + 1));
    }
  }
  // Destroying the AllToAll is collective in spirit: keep the peers' memory
  // mapped until everyone is done with it.
  pl.sync();
  boot.barrier();
  if (has_proxy(backend)) {
    a2a.reset();
    time_phases(boot, pl, o, w, b, backend, prefix, run.samples);
  }
  return run;
}

}  // namespace moelink_bench
