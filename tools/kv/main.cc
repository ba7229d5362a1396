// moelink-kv-transfer: moves one request's paged KV cache from a prefill
// process (rank 0) to a decode process (rank 1) with write_kv_cache /
// wait_kv_cache, verifies every byte on the decode side and reports
// latency and throughput.
//
// Runs as two forked processes on this machine (default), or as one of two
// ranks started by torchrun (RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moelink/bootstrap.h"
#include "moelink/errors.h"
#include "moelink/kv_transfer.h"
#include "moelink/transfer_engine.h"
#include "moelink/version.h"

namespace {

using namespace moelink::fabric;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string provider = "shm";
  int layers = 61;
  uint64_t bytes_per_token = 70272;  // all layers together (DeepSeek-V3, MLA)
  uint32_t tokens_per_page = 64;
  uint64_t tokens = 500;
  uint64_t pool_pages = 0;  // per side; 0 = 2 * request pages + 3
  int iters = 5;
  int warmup = 1;
  std::string imm_mode = "layer";
  std::string src_layout = "layer";
  std::string dst_layout = "page";
  int domains = 1;
  uint64_t seed = 1;
  double timeout_s = 30;
  bool full = false;
  bool verify = true;
  bool busy_poll = false;
};

constexpr uint32_t kImmBase = 0x1000;
constexpr uint32_t kAckImm = 0xacc;
constexpr uint32_t kWarmImm = 0xfff0;

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// n bytes of the pattern of (layer, source page id), independent of layout.
void pattern(uint8_t* out, size_t n, uint64_t seed, int layer, uint64_t page) {
  const uint64_t key = mix(seed ^ (static_cast<uint64_t>(layer) << 40) ^ (page << 1));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = mix(key + i);
    std::memcpy(out + i, &v, 8);
  }
  if (i < n) {
    const uint64_t v = mix(key + i);
    std::memcpy(out + i, &v, n - i);
  }
}

KvCacheLayout make_layout(const std::string& kind, const Options& o, uint64_t pages) {
  const uint64_t per_layer = o.bytes_per_token / o.layers;
  return kind == "page" ? KvCacheLayout::page_major(o.layers, per_layer, o.tokens_per_page, pages)
                        : KvCacheLayout::layer_major(o.layers, per_layer, o.tokens_per_page, pages);
}

std::vector<uint64_t> scattered_pages(uint64_t pool, uint64_t n, uint64_t seed) {
  std::vector<uint64_t> ids(pool);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(n);
  return ids;
}

std::vector<char> gather_blob(moelink::Bootstrap& b, const std::vector<char>& mine, int from) {
  const uint64_t n = mine.size();
  std::vector<uint64_t> sizes(b.world_size());
  b.all_gather(&n, sizes.data(), sizeof(n));
  const uint64_t max = *std::max_element(sizes.begin(), sizes.end());
  std::vector<char> padded(max), all(max * b.world_size());
  std::memcpy(padded.data(), mine.data(), mine.size());
  b.all_gather(padded.data(), all.data(), max);
  return std::vector<char>(all.begin() + from * max, all.begin() + from * max + sizes[from]);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Checks the request's pages in the decode cache, zeroes them, then checks
// that nothing else was written. Returns the number of wrong bytes' pages.
uint64_t verify_and_clear(uint8_t* cache, size_t cache_bytes, const KvCacheLayout& dst,
                          const KvTransferRequest& req, uint64_t seed, std::string& first_error) {
  uint64_t bad = 0;
  const uint64_t pages = req.num_pages(dst.tokens_per_page);
  std::vector<uint8_t> want(dst.page_bytes());
  for (int l = 0; l < dst.num_layers; ++l)
    for (uint64_t i = 0; i < pages; ++i) {
      const uint64_t tokens =
          i + 1 < pages ? dst.tokens_per_page : req.num_tokens - i * dst.tokens_per_page;
      const size_t n = tokens * dst.bytes_per_token;
      uint8_t* at = cache + dst.page_offset(l, req.dst_pages[i]);
      pattern(want.data(), n, seed, l, req.src_pages[i]);
      if (std::memcmp(at, want.data(), n) != 0) {
        size_t j = 0;
        while (at[j] == want[j]) ++j;
        if (bad++ == 0)
          first_error = "layer " + std::to_string(l) + " request page " + std::to_string(i) +
                        " (decode page " + std::to_string(req.dst_pages[i]) + "): byte " +
                        std::to_string(j) + " is " + std::to_string(at[j]) + ", want " +
                        std::to_string(want[j]);
      }
      std::memset(at, 0, n);
    }
  const uint64_t* w = reinterpret_cast<const uint64_t*>(cache);
  for (size_t i = 0; i < cache_bytes / 8; ++i)
    if (w[i] != 0) {
      if (bad++ == 0)
        first_error = "byte " + std::to_string(i * 8) + " of the decode cache was written "
                      "outside the request's pages";
      std::memset(cache, 0, cache_bytes);
      break;
    }
  return bad;
}

struct Result {
  double ok = 0;  // 1 when every byte matched
  double decode_wait_s = 0;
  char error[200] = {};
};

int run(moelink::Bootstrap& b, const Options& o) {
  const int rank = b.rank();
  const bool prefill = rank == 0;
  EngineOptions eo;
  eo.provider = o.provider;
  eo.name = prefill ? "prefill" : "decode";
  eo.num_domains = o.domains;
  eo.timeout_s = o.timeout_s;
  eo.recv_buffers = 16;
  eo.yield_when_idle = !o.busy_poll;
  auto engine = TransferEngine::create(eo);

  const uint64_t req_pages = (o.tokens + o.tokens_per_page - 1) / o.tokens_per_page;
  const uint64_t pool = o.pool_pages ? o.pool_pages : 2 * req_pages + 3;
  const KvCacheLayout layout = make_layout(prefill ? o.src_layout : o.dst_layout, o, pool);
  layout.validate("moelink-kv-transfer");
  const size_t bytes = layout.required_bytes();
  // Page-aligned, zeroed (decode) or filled with the pattern (prefill).
  uint8_t* cache = static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  std::memset(cache, 0, bytes);
  if (prefill)
    for (int l = 0; l < layout.num_layers; ++l)
      for (uint64_t p = 0; p < pool; ++p)
        pattern(cache + layout.page_offset(l, p), layout.page_bytes(), o.seed, l, p);
  auto region = engine->register_memory(cache, bytes);

  // Exchange descriptors and layouts (decode's is needed by prefill).
  const auto other = gather_blob(b, engine->descriptor(region).serialize(), 1 - rank);
  const MemoryDescriptor peer = MemoryDescriptor::deserialize(other.data(), other.size());
  const KvCacheLayout src = prefill ? layout : make_layout(o.src_layout, o, pool);
  const KvCacheLayout dst = prefill ? make_layout(o.dst_layout, o, pool) : layout;
  const GroupId g = engine->add_peer_group({peer});
  engine->barrier(g, kWarmImm)->wait();  // tcp connects here, not in the timing
  engine->wait_imm(kWarmImm, 1);

  if (prefill) {
    const uint64_t req_bytes = static_cast<uint64_t>(o.layers) * o.tokens * (o.bytes_per_token / o.layers);
    std::printf("moelink-kv-transfer: provider %s (libfabric %s), %d domain(s), workers %s\n",
                engine->provider().c_str(), fabric_runtime_version().c_str(), engine->num_domains(),
                o.busy_poll ? "busy-poll" : "sleep when idle");
    std::printf("  cache: %d layers x %lu B/token/layer (%lu B/token), %u tokens/page, page %lu B, "
                "%lu pages per side (%.1f MB prefill %s-major, decode %s-major)\n",
                o.layers, static_cast<unsigned long>(o.bytes_per_token / o.layers),
                static_cast<unsigned long>(o.bytes_per_token), o.tokens_per_page,
                static_cast<unsigned long>(layout.page_bytes()), static_cast<unsigned long>(pool),
                bytes / 1e6, o.src_layout.c_str(), o.dst_layout.c_str());
    std::printf("  request: %lu tokens = %lu pages (scattered ids, new each iteration), %.2f MB, "
                "%lu page writes, immediates per %s\n",
                static_cast<unsigned long>(o.tokens), static_cast<unsigned long>(req_pages),
                req_bytes / 1e6, static_cast<unsigned long>(req_pages * o.layers),
                o.imm_mode.c_str());
  }

  std::vector<double> lat, local, dwait;
  int failures = 0;
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    KvTransferRequest req;
    req.num_tokens = o.tokens;
    req.imm_base = kImmBase;
    req.imm_mode = o.imm_mode == "request" ? KvImmMode::kPerRequest : KvImmMode::kPerLayer;
    // The decode side allocates its pages and tells prefill (here through
    // the bootstrap; a serving system sends them with the request).
    req.src_pages = scattered_pages(pool, req_pages, o.seed * 1000 + 2 * it);
    req.dst_pages = scattered_pages(pool, req_pages, o.seed * 1000 + 2 * it + 1);
    const bool timed = it >= o.warmup;
    b.barrier();
    if (prefill) {
      const auto t0 = Clock::now();
      auto t = write_kv_cache(*engine, region, src, peer, dst, req);
      t->wait();
      const auto t1 = Clock::now();
      engine->wait_imm(kAckImm, 1);  // decode has every page
      const auto t2 = Clock::now();
      if (timed) {
        local.push_back(std::chrono::duration<double>(t1 - t0).count());
        lat.push_back(std::chrono::duration<double>(t2 - t0).count());
      }
    } else {
      const auto t0 = Clock::now();
      wait_kv_cache(*engine, dst, req, peer.owner.name, o.timeout_s);
      const auto t1 = Clock::now();
      engine->barrier(g, kAckImm)->wait();
      if (timed) dwait.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    Result r;
    if (!prefill) {
      r.decode_wait_s = dwait.empty() ? 0 : dwait.back();
      std::string err;
      const uint64_t bad = o.verify ? verify_and_clear(cache, bytes, dst, req, o.seed, err) : 0;
      if (!o.verify) std::memset(cache, 0, bytes);
      r.ok = bad == 0;
      std::snprintf(r.error, sizeof(r.error), "%s", err.c_str());
    }
    Result all[2];
    b.all_gather(&r, all, sizeof(r));
    if (prefill && all[1].ok != 1) {
      ++failures;
      std::printf("  iteration %d: VERIFICATION FAILED: %s\n", it, all[1].error);
    }
  }
  b.barrier();
  if (prefill) {
    const double m = median(lat);
    const uint64_t req_bytes = static_cast<uint64_t>(o.layers) * o.tokens * (o.bytes_per_token / o.layers);
    const double page_writes = static_cast<double>(req_pages) * o.layers;
    std::printf("  verified: %s (%d iterations, byte for byte on the decode side, rest of its "
                "cache untouched)\n",
                !o.verify ? "skipped" : failures ? "FAILED" : "yes", o.warmup + o.iters);
    std::printf("  latency (issue -> decode saw all pages -> ack back), %d timed: median %.3f ms, "
                "min %.3f ms, max %.3f ms\n",
                o.iters, m * 1e3, *std::min_element(lat.begin(), lat.end()) * 1e3,
                *std::max_element(lat.begin(), lat.end()) * 1e3);
    std::printf("  prefill local completion: median %.3f ms\n", median(local) * 1e3);
    std::printf("  throughput: %.3f GB/s, %.0f pages/s (page = one layer's page, %lu B), "
                "%.1f requests/s\n",
                req_bytes / m / 1e9, page_writes / m, static_cast<unsigned long>(layout.page_bytes()),
                1 / m);
    std::printf("RESULT provider=%s layers=%d tokens=%lu pages=%lu bytes=%lu imm=%s "
                "median_ms=%.3f gbps=%.3f pages_per_s=%.0f verified=%d\n",
                o.provider.c_str(), o.layers, static_cast<unsigned long>(o.tokens),
                static_cast<unsigned long>(req_pages), static_cast<unsigned long>(req_bytes),
                o.imm_mode.c_str(), m * 1e3, req_bytes / m / 1e9, page_writes / m,
                o.verify && failures == 0 ? 1 : 0);
  }
  engine->deregister_memory(region);
  engine.reset();
  std::free(cache);
  return failures ? 1 : 0;
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw moelink::SystemError("moelink-kv-transfer: cannot find a free TCP port");
  close(fd);
  return ntohs(a.sin_port);
}

int run_rank(int rank, int world, const std::string& host, int port, const Options& o) {
  try {
    auto b = moelink::make_tcp_bootstrap(rank, world, host, port, o.timeout_s);
    return run(*b, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelink-kv-transfer (%s): %s\n", rank == 0 ? "prefill" : "decode",
                 e.what());
    return 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Moves one request's paged KV cache from a prefill process to a decode process over the "
      "TransferEngine (paged RDMA writes + immediate counters), verifies it byte for byte and "
      "reports throughput. Forks both processes, or runs as rank 0 (prefill) / 1 (decode) under "
      "torchrun (RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT)."};
  app.set_version_flag("--version", std::string("moelink-kv-transfer ") + moelink::version());
  app.add_option("--provider", o.provider, "libfabric provider: shm, tcp, efa, or '' (first of these)");
  app.add_option("--layers", o.layers, "layers (planes) of the cache")->check(CLI::Range(1, 4096));
  app.add_option("--bytes-per-token", o.bytes_per_token,
                 "KV bytes per token, all layers together (DeepSeek-V3: 70272)");
  app.add_option("--tokens-per-page", o.tokens_per_page, "tokens per page (block)")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--tokens", o.tokens, "tokens of the request (last page may be partial)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 24));
  app.add_option("--pool-pages", o.pool_pages, "pages per side (0: 2 x request pages + 3)");
  app.add_option("--iters", o.iters, "timed iterations")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", o.warmup, "untimed iterations first")->check(CLI::Range(0, 1000));
  app.add_option("--imm", o.imm_mode, "immediates: one per layer or one per request")
      ->check(CLI::IsMember({"layer", "request"}));
  app.add_option("--src-layout", o.src_layout, "prefill cache: layer-major or page-major")
      ->check(CLI::IsMember({"layer", "page"}));
  app.add_option("--dst-layout", o.dst_layout, "decode cache: layer-major or page-major")
      ->check(CLI::IsMember({"layer", "page"}));
  app.add_option("--domains", o.domains, "NICs (domains) per engine")->check(CLI::Range(1, 64));
  app.add_option("--seed", o.seed, "pattern and page-id seed");
  app.add_option("--timeout", o.timeout_s, "seconds before a missing peer is an error");
  app.add_flag("--full", o.full, "full-size request: 8192 tokens (128 pages, 576 MB)");
  app.add_flag("!--no-verify", o.verify, "skip the byte-for-byte check");
  app.add_flag("--busy-poll", o.busy_poll,
               "engine workers never sleep when idle (needs a core per worker)");
  CLI11_PARSE(app, argc, argv);
  if (o.full && app.count("--tokens") == 0) o.tokens = 8192;
  if (o.bytes_per_token == 0 || o.bytes_per_token % o.layers != 0) {
    std::fprintf(stderr, "moelink-kv-transfer: --bytes-per-token %lu is not a positive multiple of "
                         "--layers %d\n",
                 static_cast<unsigned long>(o.bytes_per_token), o.layers);
    return 2;
  }
  const uint64_t req_pages = (o.tokens + o.tokens_per_page - 1) / o.tokens_per_page;
  if (o.pool_pages && o.pool_pages < req_pages) {
    std::fprintf(stderr, "moelink-kv-transfer: --pool-pages %lu is smaller than the request's %lu "
                         "pages\n",
                 static_cast<unsigned long>(o.pool_pages), static_cast<unsigned long>(req_pages));
    return 2;
  }
  if (o.provider == "tcp") setenv("FI_TCP_IFACE", "lo", 0);

  if (std::getenv("RANK") && std::getenv("WORLD_SIZE")) {
    try {
      auto b = moelink::make_env_bootstrap(o.timeout_s);
      if (b->world_size() != 2) {
        std::fprintf(stderr, "moelink-kv-transfer: WORLD_SIZE must be 2 (prefill, decode)\n");
        return 2;
      }
      return run(*b, o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "moelink-kv-transfer: %s\n", e.what());
      return 2;
    }
  }
  const int port = free_port();
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 2;
  }
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    _exit(run_rank(1, 2, "127.0.0.1", port, o));
  }
  const int rc = run_rank(0, 2, "127.0.0.1", port, o);
  int status = 0;
  waitpid(child, &status, 0);
  const int child_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 3;
  if (child_rc != 0) std::fprintf(stderr, "moelink-kv-transfer: decode process failed (%d)\n", child_rc);
  return rc ? rc : child_rc;
}
