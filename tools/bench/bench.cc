#include "bench.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>

#include "bandwidth.h"
#include "buffers.h"
#include "floor.h"
#include "gpu_info.h"
#include "moelink_runner.h"
#include "nccl_comm.h"
#include "nccl_full.h"
#include "nccl_payload.h"
#include "nvshmem_dense.h"
#include "platform.h"
#include "report.h"
#include "workload.h"

namespace moelink_bench {

namespace {

moelink::Config make_config(const BenchOptions& o, int64_t tokens, int rank, int world) {
  moelink::Config c;
  c.max_num_tokens = tokens;
  c.num_experts = o.experts;
  c.experts_per_token = o.topk;
  c.hidden_dim = o.hidden;
  c.hidden_dim_scale = o.effective_scales();
  c.in_dtype = o.in_type();
  c.out_dtype = o.out_type();
  c.rank = rank;
  c.world_size = world;
  c.dp_size = o.dp_size;
  c.validate();
  return c;
}

void merge(Samples& into, Samples&& from) {
  for (auto& [name, v] : from) into[name] = std::move(v);
}

}  // namespace

int run_rank(const BenchOptions& o, moelink::Bootstrap& boot, int local_rank) {
  const int rank = boot.rank(), W = boot.world_size();
  RunInfo info;
  info.options = &o;
  info.world_size = W;
  // Declared before the communicator: NCCL goes first, then the stream.
  std::unique_ptr<Platform> pl;
  std::unique_ptr<NcclComm> nccl;
  if (o.gpu()) {
    GpuInfo gpu = select_gpu(boot, local_rank);
    pl = make_cuda_platform(gpu.device);
    info.gpu_name = gpu.name;
    info.gpu_count = gpu.count;
    info.sm_count = gpu.sm_count;
    info.rank_pci = gpu.rank_pci;
    info.bandwidth = measure_bandwidth(boot, *pl, gpu);
    info.empty_kernel_us = pl->empty_kernel_us(1000);
    int v = 0;
    if (ncclGetVersion(&v) == ncclSuccess) info.nccl_version = std::to_string(v);
    info.dense = nvshmem_dense_unavailable(o, !gpu.distinct());
    if (o.no_nccl) {
      info.nccl = "off (--no-nccl)";
    } else if (!gpu.distinct()) {
      info.nccl = "off (ranks share a GPU; NCCL needs one GPU per rank)";
    } else {
      nccl = std::make_unique<NcclComm>(boot);
      info.nccl = "on";
    }
  } else {
    // The CPU backend: host memory and a host clock, no CUDA call at all.
    pl = make_host_platform();
    info.nccl = "off (cpu backend)";
    info.dense = "off (cpu backend)";
  }
  if (info.dense.empty()) info.dense = "on";

  std::vector<TokenResult> results;
  for (int64_t tokens : o.tokens) {
    const moelink::Config c = make_config(o, tokens, rank, W);
    const Workload w = make_workload(o, c);
    Buffers b = make_buffers(*pl, w);
    const std::vector<float> expected = expected_combine(w, 0);
    MoelinkRun mr = run_moelink(boot, *pl, o, w, b, expected, backend_of(o.backend));
    Samples all = std::move(mr.samples);
    if (!o.compare_backend.empty())
      merge(all, run_moelink(boot, *pl, o, w, b, expected, backend_of(o.compare_backend),
                             o.compare_backend + "_")
                     .samples);
    if (info.dense == "on") merge(all, time_nvshmem_dense(boot, *pl, o, w));
    if (nccl) {
      merge(all, time_nccl_payload(*nccl, boot, *pl, o, w));
      merge(all, time_nccl_full(*nccl, boot, *pl, o, w, b, expected));
    }
    TokenResult r;
    r.tokens = tokens;
    for (const auto& [name, v] : all) r.stats[name] = summarize(boot, v);
    r.floors = compute_floors(w, rank, info.bandwidth.peer_GBps, info.bandwidth.hbm_GBps);
    r.moelink_buffer_bytes = mr.buffer_bytes;
    r.dispatch_row_bytes = w.dispatch_row_bytes();
    r.combine_row_bytes = w.combine_row_bytes();
    r.expert_capacity = c.expert_capacity();
    if (rank == 0)
      std::fprintf(stderr, "moelink-bench: tokens=%lld done (dispatch p50 %.1f us, combine p50 %.1f us)\n",
                   static_cast<long long>(tokens), r.stats["dispatch"].p50,
                   r.stats["combine"].p50);
    results.push_back(std::move(r));
  }

  if (rank == 0) {
    print_table(stdout, info, results);
    if (!o.json_path.empty()) {
      std::ofstream f(o.json_path);
      f << to_json(info, results).dump(2) << "\n";
      if (!f) throw std::runtime_error("cannot write " + o.json_path);
      std::fprintf(stderr, "moelink-bench: wrote %s\n", o.json_path.c_str());
    }
  }
  boot.barrier();
  return 0;
}

}  // namespace moelink_bench
