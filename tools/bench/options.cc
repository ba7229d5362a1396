#include "options.h"
#include "moelink/version.h"

#include <cctype>
#include <cstdio>

#include <CLI/CLI.hpp>

namespace moelink_bench {

moelink::DType BenchOptions::in_type() const {
  if (in_dtype == "bf16") return moelink::DType::kBFloat16;
  if (in_dtype == "fp16") return moelink::DType::kFloat16;
  return moelink::DType::kFloat8E4M3;
}

moelink::DType BenchOptions::out_type() const {
  return out_dtype == "fp16" ? moelink::DType::kFloat16 : moelink::DType::kBFloat16;
}

namespace {

// Single-quotes an argument unless it is plainly safe, so the recorded
// command can be pasted back into a shell.
std::string shell_quote(const std::string& s) {
  bool safe = !s.empty();
  for (char c : s)
    safe &= std::isalnum(static_cast<unsigned char>(c)) || std::string("-_./=,:+@%").find(c) !=
                                                              std::string::npos;
  if (safe) return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

bool parse_options(int argc, char** argv, BenchOptions& o, int& exit_code) {
  CLI::App app{
      "moelink-bench: latency of moelink dispatch/combine against NCCL baselines and the "
      "NVLink bandwidth floor"};
  app.set_version_flag("--version", std::string("moelink-bench ") + moelink::version());
  app.add_option("--nproc", o.nproc,
                 "fork this many ranks on this machine (rank i uses GPU i % device_count); "
                 "without it, read RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK (torchrun)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--backend", o.backend,
                 "nvlink, nvshmem or internode (GPUs), or cpu / internode-cpu (host processes, "
                 "no CUDA)")
      ->check(CLI::IsMember({"nvlink", "nvshmem", "internode", "cpu", "internode-cpu"}))
      ->capture_default_str();
  app.add_option("--fabric-provider", o.fabric_provider,
                 "internode backends: libfabric provider (efa, shm, tcp; default: "
                 "MOELINK_FABRIC_PROVIDER, else the first available)");
  app.add_option("--max-private-tokens", o.max_private_tokens,
                 "internode backends: Options.max_private_tokens (-1: library default)")
      ->check(CLI::Range(-1, 1 << 20))
      ->capture_default_str();
  app.add_option("--node-size", o.node_size,
                 "internode backends: Options.node_size, ranks per node that exchange tokens "
                 "directly (1: every peer through the NIC; 0: by host name; -1: library "
                 "default)")
      ->check(CLI::Range(-1, 1 << 20))
      ->capture_default_str();
  app.add_option("--gpu-direct", o.gpu_direct,
                 "internode: Options.gpu_direct, GPU buffers registered with the NIC (1), host "
                 "staging (0), by provider (-1)")
      ->check(CLI::Range(-1, 1))
      ->capture_default_str();
  app.add_option("--compare", o.compare_backend,
                 "also time this GPU backend in the same run (quantities prefixed with its name, "
                 "e.g. nvlink_dispatch)")
      ->check(CLI::IsMember({"nvlink", "nvshmem", "internode"}));
  app.add_option("--tokens", o.tokens, "comma-separated tokens per rank (per DP group)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--hidden", o.hidden, "hidden dimension H")->capture_default_str();
  app.add_option("--experts", o.experts, "number of experts E")->capture_default_str();
  app.add_option("--topk", o.topk, "experts per token k")->capture_default_str();
  app.add_option("--scales", o.scales, "fp32 scales per token (fp8 only; 0 for bf16/fp16)")
      ->capture_default_str();
  app.add_option("--in-dtype", o.in_dtype, "dispatched token type")
      ->check(CLI::IsMember({"fp8", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--out-dtype", o.out_dtype, "combined token type")
      ->check(CLI::IsMember({"bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--dp-size", o.dp_size, "ranks per data-parallel group")->capture_default_str();
  app.add_option("--iters", o.iters, "timed iterations per token count")
      ->check(CLI::Range(1, 100000000))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed iterations before timing")
      ->check(CLI::Range(0, 100000000))
      ->capture_default_str();
  app.add_option("--pool", o.pool, "routing sets; iteration i uses set i % pool")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--json", o.json_path, "write all results to this JSON file (rank 0)");
  app.add_flag("--no-nccl", o.no_nccl, "skip the NCCL baselines");
  app.add_flag("--no-dense", o.no_dense,
               "skip NVSHMEM's dense all-to-all baseline (run when nvshmem is timed)");
  app.add_option("--num-blocks", o.num_blocks, "moelink Options.num_blocks (0: library default)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--machine", o.machine, "label of the machine kind, recorded in the JSON");
  app.add_flag("--graph", o.graph,
               "also time dispatch and combine captured in CUDA graphs (one per routing set) "
               "and replayed, as inference engines run decode; GPU only");
  app.add_flag("--split", o.split,
               "also time dispatch/combine called as separate send and receive halves");
  app.add_option("--seed", o.seed, "seed of the random inputs and routing")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    exit_code = app.exit(e);
    return false;
  }
  auto usage = [&](const std::string& msg) {
    std::fprintf(stderr, "moelink-bench: %s\n", msg.c_str());
    exit_code = 2;
    return false;
  };
  if (o.hidden < 16 || o.hidden % 16 != 0) return usage("--hidden must be a multiple of 16");
  if (o.topk < 1 || o.topk > o.experts)
    return usage("--topk must be in [1, --experts] (routes to distinct experts)");
  if (o.in_dtype == "fp8" && (o.scales < 1 || o.scales > o.hidden))
    return usage("--scales must be in [1, --hidden] for fp8 tokens");
  if (o.tokens.empty()) return usage("--tokens is empty");
  if (!o.compare_backend.empty() && (o.compare_backend == o.backend || !o.gpu()))
    return usage("--compare must name a GPU backend other than --backend");
  for (int i = 0; i < argc; ++i) o.command_line += (i ? " " : "") + shell_quote(argv[i]);
  return true;
}

}  // namespace moelink_bench
