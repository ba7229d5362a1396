#include "report.h"

#include <cmath>
#include <cstdlib>
#include <ctime>

#include "git_commit.h"  // generated at build time by git_commit.cmake

namespace moelink_bench {

// A commit passed in (MOELINK_GIT_COMMIT) wins over the build's: the device
// tool's copy of the tree carries a stale .git.
std::string git_commit() {
  const char* e = std::getenv("MOELINK_GIT_COMMIT");
  if (e && *e) return e;
  const std::string c = MOELINK_BENCH_GIT_COMMIT;
  return c.empty() ? "unknown" : c;
}

bool git_dirty() {
  const char* e = std::getenv("MOELINK_GIT_COMMIT");
  return !(e && *e) && MOELINK_BENCH_GIT_DIRTY != 0;
}

namespace {

const Stat* find(const TokenResult& r, const std::string& q) {
  auto it = r.stats.find(q);
  return it == r.stats.end() ? nullptr : &it->second;
}

std::string num(double v, const char* fmt = "%.1f") {
  if (!std::isfinite(v) || v <= 0) return "-";
  char b[32];
  std::snprintf(b, sizeof(b), fmt, v);
  return b;
}

std::string ratio(const Stat* ours, double other) {
  if (!ours || !(other > 0)) return "-";
  return num(ours->p50 / other, "%.2fx");
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof(b), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

nlohmann::json phase_json(const PhaseBytes& p) {
  return {{"nvlink_bytes_total", p.nvlink_total},
          {"nvlink_bytes_max_rank", p.nvlink_max_rank},
          {"nvlink_bytes_out_rank0", p.nvlink_mine_out},
          {"hbm_bytes_max_rank", p.hbm_max_rank},
          {"peer_floor_us", p.peer_floor_us},
          {"hbm_floor_us", p.hbm_floor_us},
          {"floor_us", p.floor_us()}};
}

// p50 of `name`, or 0 when the run has no such quantity.
double p50(const TokenResult& r, const std::string& name) {
  const Stat* s = find(r, name);
  return s ? s->p50 : 0.0;
}

// Round trips of every implementation timed in the run, side by side:
// the backend under test, the --compare backend, NCCL's full path and
// payload, and NVSHMEM's dense all-to-all.
void print_side_by_side(std::FILE* f, const RunInfo& info,
                        const std::vector<TokenResult>& results) {
  const BenchOptions& o = *info.options;
  const std::string cmp = o.compare_backend;
  std::fprintf(f, "\nside by side, p50 dispatch + combine (us); nvshmem dense: %s\n",
               info.dense.c_str());
  std::fprintf(f, "%7s  %12s %12s %12s %12s %14s %14s %15s\n", "tokens", o.backend.c_str(),
               cmp.empty() ? "-" : cmp.c_str(), "nccl full", "nccl payload", "nvshmem dense",
               "ours/nccl_full", cmp.empty() ? "-" : ("ours/" + cmp).c_str());
  for (const TokenResult& r : results) {
    const double ours = p50(r, "dispatch") + p50(r, "combine");
    const double other = cmp.empty() ? 0 : p50(r, cmp + "_dispatch") + p50(r, cmp + "_combine");
    const double full = p50(r, "nccl_full_dispatch") + p50(r, "nccl_full_combine");
    const double pay = p50(r, "nccl_payload_dispatch") + p50(r, "nccl_payload_combine");
    const double dense = p50(r, "nvshmem_dense_dispatch") + p50(r, "nvshmem_dense_combine");
    std::fprintf(f, "%7lld  %12s %12s %12s %12s %14s %14s %15s\n",
                 static_cast<long long>(r.tokens), num(ours).c_str(), num(other).c_str(),
                 num(full).c_str(), num(pay).c_str(), num(dense).c_str(),
                 full > 0 && ours > 0 ? num(ours / full, "%.2fx").c_str() : "-",
                 other > 0 && ours > 0 ? num(ours / other, "%.2fx").c_str() : "-");
  }
}

}  // namespace

void print_table(std::FILE* f, const RunInfo& info, const std::vector<TokenResult>& results) {
  const BenchOptions& o = *info.options;
  std::fprintf(f, "moelink-bench  backend=%s  ranks=%d  dp_size=%d  H=%lld  E=%d  k=%d  S=%d  %s->%s\n",
               o.backend.c_str(), info.world_size, o.dp_size, static_cast<long long>(o.hidden),
               o.experts, o.topk, o.effective_scales(), o.in_dtype.c_str(), o.out_dtype.c_str());
  std::fprintf(f, "iters=%d  warmup=%d  pool=%d  num_blocks=%d%s  nccl: %s\n", o.iters, o.warmup,
               o.pool, o.num_blocks, o.num_blocks == 0 ? " (library default)" : "",
               info.nccl.c_str());
  if (!info.gpu_name.empty()) {
    std::fprintf(f, "gpu: %s x%d visible  peer copy GB/s:", info.gpu_name.c_str(), info.gpu_count);
    for (double v : info.bandwidth.peer_GBps) std::fprintf(f, " %.0f", v);
    std::fprintf(f, "  HBM copy GB/s:");
    for (double v : info.bandwidth.hbm_GBps) std::fprintf(f, " %.0f", v);
    std::fprintf(f, "  empty kernel: %.1f us\n", info.empty_kernel_us);
  }
  std::fprintf(f, "times in microseconds, rank 0, per iteration\n\n");
  std::fprintf(f, "%7s  %-14s %21s %13s %13s %10s %11s %15s\n", "tokens", "phase",
               "ours p50 / p90", "nccl payload", "nccl full", "floor", "ours/floor",
               "ours/nccl_full");
  for (const TokenResult& r : results) {
    struct Row {
      const char* phase;
      const char* payload;
      const char* full;
      double floor;
    };
    const Row rows[] = {
        {"dispatch", "nccl_payload_dispatch", "nccl_full_dispatch", r.floors.dispatch.floor_us()},
        {"combine", "nccl_payload_combine", "nccl_full_combine", r.floors.combine.floor_us()},
        {"roundtrip", nullptr, nullptr,
         r.floors.dispatch.floor_us() + r.floors.combine.floor_us()},
        {"dispatch_graph", "nccl_payload_dispatch", "nccl_full_dispatch",
         r.floors.dispatch.floor_us()},
        {"combine_graph", "nccl_payload_combine", "nccl_full_combine",
         r.floors.combine.floor_us()},
        {"roundtrip_graph", nullptr, nullptr,
         r.floors.dispatch.floor_us() + r.floors.combine.floor_us()},
        {"dispatch_send", nullptr, nullptr, 0},
        {"dispatch_recv", nullptr, nullptr, 0},
        {"combine_send", nullptr, nullptr, 0},
        {"combine_recv", nullptr, nullptr, 0},
        // The proxy backends' phases (profiled apart from the timed loops).
        {"dispatch_pack", nullptr, nullptr, 0},
        {"dispatch_post", nullptr, nullptr, 0},
        {"dispatch_wire", nullptr, nullptr, 0},
        {"dispatch_unpack", nullptr, nullptr, 0},
        {"combine_pack", nullptr, nullptr, 0},
        {"combine_post", nullptr, nullptr, 0},
        {"combine_wire", nullptr, nullptr, 0},
        {"combine_unpack", nullptr, nullptr, 0},
    };
    for (const Row& row : rows) {
      const Stat* ours = find(r, row.phase);
      if (!ours) continue;
      const Stat* pay = row.payload ? find(r, row.payload) : nullptr;
      const Stat* full = row.full ? find(r, row.full) : nullptr;
      const std::string op = num(ours->p50, "%.1f") + " / " + num(ours->p90, "%.1f");
      std::fprintf(f, "%7lld  %-14s %21s %13s %13s %10s %11s %15s\n",
                   static_cast<long long>(r.tokens), row.phase, op.c_str(),
                   pay ? num(pay->p50).c_str() : "-", full ? num(full->p50).c_str() : "-",
                   num(row.floor, "%.2f").c_str(), ratio(ours, row.floor).c_str(),
                   ratio(ours, full ? full->p50 : 0).c_str());
    }
  }
  print_side_by_side(f, info, results);
  std::fflush(f);
}

nlohmann::json to_json(const RunInfo& info, const std::vector<TokenResult>& results) {
  const BenchOptions& o = *info.options;
  nlohmann::json j;
  j["date"] = utc_now();
  j["machine"] = o.machine;
  j["git_commit"] = git_commit();
  j["git_dirty"] = git_dirty();
  j["command"] = o.command_line;
  j["backend"] = o.backend;
  j["world_size"] = info.world_size;
  j["gpu"] = {{"name", info.gpu_name},
              {"count", info.gpu_count},
              {"sm_count", info.sm_count},
              {"rank_pci_bus_id", info.rank_pci}};
  j["config"] = {{"hidden_dim", o.hidden},       {"num_experts", o.experts},
                 {"experts_per_token", o.topk},  {"hidden_dim_scale", o.effective_scales()},
                 {"in_dtype", o.in_dtype},       {"out_dtype", o.out_dtype},
                 {"dp_size", o.dp_size},         {"tokens", o.tokens}};
  j["options"] = {{"iters", o.iters},
                  {"warmup", o.warmup},
                  {"pool", o.pool},
                  {"split", o.split},
                  {"seed", o.seed},
                  // The API does not report the SMs it uses: the flag value is
                  // recorded, 0 meaning the library's per-kernel default.
                  {"num_blocks", o.num_blocks},
                  {"num_blocks_note", o.num_blocks == 0 ? "library default per kernel"
                                                        : "thread blocks per moelink kernel"}};
  j["iterations"] = o.iters;
  j["nccl"] = {{"status", info.nccl}, {"version", info.nccl_version}};
  j["compare_backend"] = o.compare_backend;
  j["nvshmem_dense"] = {{"status", info.dense},
                        {"bytes_per_peer",
                         "dispatch: max_num_tokens x (H x in_bytes + S x 4); combine: "
                         "max_num_tokens x H x out_bytes (worst case, routing-independent)"}};
  j["bandwidth"] = {{"copy_bytes", info.bandwidth.bytes},
                    {"reps", info.bandwidth.reps},
                    {"statistic", "median"},
                    {"peer_GBps_per_rank", info.bandwidth.peer_GBps},
                    {"hbm_copy_GBps_per_rank", info.bandwidth.hbm_GBps}};
  j["empty_kernel_us"] = info.empty_kernel_us;
  nlohmann::json rs = nlohmann::json::array();
  for (const TokenResult& r : results) {
    nlohmann::json q = nlohmann::json::object();
    for (const auto& [name, s] : r.stats)
      q[name] = {{"p50_us", s.p50},
                 {"p90_us", s.p90},
                 {"mean_us", s.mean},
                 {"samples", s.n},
                 {"rank_p50_us", s.rank_p50}};
    nlohmann::json ratios = nlohmann::json::object();
    for (const char* ph : {"dispatch", "combine", "dispatch_graph", "combine_graph"}) {
      const Stat* ours = find(r, ph);
      const bool is_dispatch = std::string(ph).rfind("dispatch", 0) == 0;
      const Stat* full = find(r, std::string("nccl_full_") + (is_dispatch ? "dispatch" : "combine"));
      const double fl = is_dispatch ? r.floors.dispatch.floor_us() : r.floors.combine.floor_us();
      if (ours && fl > 0) ratios[std::string(ph) + "_over_floor"] = ours->p50 / fl;
      if (ours && full && full->p50 > 0)
        ratios[std::string(ph) + "_over_nccl_full"] = ours->p50 / full->p50;
    }
    // Round trips (dispatch p50 + combine p50) against every other
    // implementation the run timed.
    const double ours_rt = p50(r, "dispatch") + p50(r, "combine");
    auto rt_ratio = [&](const std::string& key, const std::string& a, const std::string& b) {
      const double other = p50(r, a) + p50(r, b);
      if (ours_rt > 0 && p50(r, a) > 0 && p50(r, b) > 0) ratios[key] = ours_rt / other;
    };
    rt_ratio("roundtrip_p50_sum_over_nccl_full", "nccl_full_dispatch", "nccl_full_combine");
    rt_ratio("roundtrip_p50_sum_over_nvshmem_dense", "nvshmem_dense_dispatch",
             "nvshmem_dense_combine");
    if (!o.compare_backend.empty())
      rt_ratio("roundtrip_p50_sum_over_" + o.compare_backend, o.compare_backend + "_dispatch",
               o.compare_backend + "_combine");
    rs.push_back({{"tokens", r.tokens},
                  {"expert_capacity", r.expert_capacity},
                  {"moelink_buffer_bytes", r.moelink_buffer_bytes},
                  {"dispatch_row_bytes", r.dispatch_row_bytes},
                  {"combine_row_bytes", r.combine_row_bytes},
                  {"quantities", q},
                  {"dispatch_traffic", phase_json(r.floors.dispatch)},
                  {"combine_traffic", phase_json(r.floors.combine)},
                  {"ratios", ratios}});
  }
  j["results"] = rs;
  return j;
}

}  // namespace moelink_bench
