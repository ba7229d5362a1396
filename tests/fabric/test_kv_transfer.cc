// KV-cache transfer (include/moelink/kv_transfer.h): layouts and request
// checks in process; prefill -> decode transfers across forked processes on
// the shm and tcp providers.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <vector>

#include "fabric_test_util.h"
#include "moelink/kv_transfer.h"
#include "rank_harness.h"

namespace {

using namespace moelink::fabric;
using moelink::InvalidArgument;
using moelink_test::exchange_descriptors;
using moelink_test::expect_throw_naming;
using moelink_test::make_engine;
using moelink_test::run_processes;
using moelink_test::run_ranks;

constexpr int kTimeout = 90;  // per test, all ranks together

// Small DeepSeek-like geometry: 6 layers, 96 B per token and layer, 4
// tokens per page; the tests' requests end in a partial page.
constexpr int kLayers = 6;
constexpr uint64_t kBpt = 96;
constexpr uint32_t kTpp = 4;
constexpr uint64_t kPool = 24;

KvCacheLayout src_layout() { return KvCacheLayout::layer_major(kLayers, kBpt, kTpp, kPool); }

// Decode side: page-major, 128 bytes in, pages padded by 64 bytes.
KvCacheLayout dst_layout() {
  KvCacheLayout l = KvCacheLayout::page_major(kLayers, kBpt, kTpp, kPool);
  l.base_offset = 128;
  l.page_stride += 64;
  return l;
}

uint8_t pattern(int layer, uint64_t page, size_t i) {
  return static_cast<uint8_t>(layer * 37 + page * 101 + i * 7 + (i >> 8) * 13 + 1);
}

void fill_source(std::vector<uint8_t>& buf, const KvCacheLayout& l) {
  for (int layer = 0; layer < l.num_layers; ++layer)
    for (uint64_t p = 0; p < l.num_pages; ++p)
      for (size_t i = 0; i < l.page_bytes(); ++i)
        buf[l.page_offset(layer, p) + i] = pattern(layer, p, i);
}

std::vector<uint64_t> scattered(uint64_t pool, uint64_t n, uint64_t seed) {
  std::vector<uint64_t> ids(pool);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(n);
  return ids;
}

KvTransferRequest make_request(uint64_t tokens, std::vector<uint64_t> src,
                               std::vector<uint64_t> dst, uint32_t imm_base, KvImmMode mode) {
  KvTransferRequest r;
  r.num_tokens = tokens;
  r.src_pages = std::move(src);
  r.dst_pages = std::move(dst);
  r.imm_base = imm_base;
  r.imm_mode = mode;
  return r;
}

// Checks the request's bytes in the decode cache and clears them (and the
// rest of each written page must still be zero). Returns false on the first
// wrong byte, recorded as a rank failure.
bool check_and_clear(std::vector<uint8_t>& buf, const KvCacheLayout& dst,
                     const KvTransferRequest& req, const std::string& ctx) {
  const uint64_t pages = req.num_pages(dst.tokens_per_page);
  for (int l = 0; l < dst.num_layers; ++l)
    for (uint64_t i = 0; i < pages; ++i) {
      const uint64_t tokens = i + 1 < pages ? kTpp : req.num_tokens - i * kTpp;
      const size_t n = tokens * dst.bytes_per_token;
      const uint64_t at = dst.page_offset(l, req.dst_pages[i]);
      for (size_t j = 0; j < dst.page_bytes(); ++j) {
        const uint8_t want = j < n ? pattern(l, req.src_pages[i], j) : 0;
        if (buf[at + j] != want) {
          RANK_FAIL() << ctx << ": layer " << l << " request page " << i << " (decode page "
                      << req.dst_pages[i] << ") byte " << j << " is " << int(buf[at + j])
                      << ", want " << int(want);
          return false;
        }
      }
      std::memset(&buf[at], 0, dst.page_bytes());
    }
  return true;
}

bool all_zero(const std::vector<uint8_t>& buf, const std::string& ctx) {
  for (size_t i = 0; i < buf.size(); ++i)
    if (buf[i] != 0) {
      RANK_FAIL() << ctx << ": byte " << i << " written outside the requests' pages";
      return false;
    }
  return true;
}

// Every rank's process id, by rank.
std::vector<int32_t> gather_pids(moelink::Bootstrap& b) {
  const int32_t mine = getpid();
  std::vector<int32_t> pids(b.world_size());
  b.all_gather(&mine, pids.data(), sizeof(mine));
  return pids;
}

void remove_shm_files_of(int pid) {
  const std::string prefix = std::to_string(pid) + ":";
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator("/dev/shm", ec))
    if (f.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(f.path(), ec);
}

// ------------------------------------------------------------ in process

TEST(KvLayout, OffsetsOfLayerAndPageMajor) {
  const auto lm = KvCacheLayout::layer_major(61, 1152, 64, 10);
  EXPECT_EQ(lm.page_bytes(), 73728u);
  EXPECT_EQ(lm.page_offset(0, 3), 3u * 73728);
  EXPECT_EQ(lm.page_offset(2, 3), 2u * 10 * 73728 + 3u * 73728);
  EXPECT_EQ(lm.required_bytes(), 61u * 10 * 73728);
  const auto pm = KvCacheLayout::page_major(61, 1152, 64, 10);
  EXPECT_EQ(pm.page_offset(2, 3), 3u * 61 * 73728 + 2u * 73728);
  EXPECT_EQ(pm.required_bytes(), 61u * 10 * 73728);
  KvCacheLayout d;  // defaults: layer-major
  d.num_layers = 2;
  d.bytes_per_token = 8;
  d.tokens_per_page = 2;
  d.num_pages = 3;
  d.base_offset = 5;
  EXPECT_EQ(d.page_offset(1, 2), 5u + 3 * 16 + 2 * 16);
  EXPECT_NO_THROW(lm.validate("t"));
  EXPECT_NO_THROW(pm.validate("t"));
  EXPECT_NO_THROW(dst_layout().validate("t"));
  KvTransferRequest r;
  r.num_tokens = 130;
  EXPECT_EQ(kv_writes_per_layer(lm, r), 3u);
  EXPECT_EQ(kv_request_bytes(lm, r), 130u * 70272);
}

TEST(KvLayout, InvalidLayoutsNameTheField) {
  auto l = KvCacheLayout::layer_major(4, 16, 4, 8);
  l.num_layers = 0;
  expect_throw_naming<InvalidArgument>([&] { l.validate("ctx"); }, {"ctx", "num_layers"});
  l = KvCacheLayout::layer_major(4, 16, 4, 8);
  l.tokens_per_page = 0;
  expect_throw_naming<InvalidArgument>([&] { l.validate("ctx"); }, {"tokens_per_page"});
  l = KvCacheLayout::layer_major(4, 16, 4, 8);
  l.page_stride = 32;  // pages of 64 bytes 32 apart
  expect_throw_naming<InvalidArgument>([&] { l.validate("ctx"); }, {"overlapping pages"});
  l = KvCacheLayout::layer_major(4, 16, 4, 8);
  l.layer_stride = 64 * 4;  // layer 1 starts inside layer 0's pages
  expect_throw_naming<InvalidArgument>([&] { l.validate("ctx"); }, {"overlapping pages"});
}

TEST(KvLayout, InvalidRequestsNameSideAndPage) {
  const auto s = src_layout(), d = dst_layout();
  const uint64_t sb = s.required_bytes(), db = d.required_bytes();
  auto r = make_request(37, scattered(kPool, 10, 1), scattered(kPool, 10, 2), 0,
                        KvImmMode::kPerLayer);
  EXPECT_NO_THROW(validate_kv_request(s, sb, d, db, r));
  auto bad = r;
  bad.dst_pages[4] = kPool;
  expect_throw_naming<InvalidArgument>([&] { validate_kv_request(s, sb, d, db, bad); },
                                       {"destination page id 24", "request page 4", "24 pages"});
  bad = r;
  bad.src_pages[9] = 1000;
  expect_throw_naming<InvalidArgument>([&] { validate_kv_request(s, sb, d, db, bad); },
                                       {"source page id 1000", "request page 9"});
  bad = r;
  bad.dst_pages[7] = bad.dst_pages[2];
  expect_throw_naming<InvalidArgument>([&] { validate_kv_request(s, sb, d, db, bad); },
                                       {"appears twice", "request page 7"});
  bad = r;
  bad.num_tokens = 41;  // 11 pages
  expect_throw_naming<InvalidArgument>([&] { validate_kv_request(s, sb, d, db, bad); },
                                       {"41 tokens need 11 pages", "has 10"});
  expect_throw_naming<InvalidArgument>([&] { validate_kv_request(s, sb - 1, d, db, r); },
                                       {"source cache layout needs"});
  expect_throw_naming<InvalidArgument>([&] { validate_kv_request(s, sb, d, db - 1, r); },
                                       {"destination cache layout needs"});
  const auto other = KvCacheLayout::layer_major(kLayers, kBpt, 8, kPool);
  expect_throw_naming<InvalidArgument>(
      [&] { validate_kv_request(s, sb, other, other.required_bytes(), r); },
                                       {"differ in geometry", "tokens_per_page 4 vs 8"});
  bad = r;
  bad.imm_base = 0xfffffffe;
  expect_throw_naming<InvalidArgument>([&] { validate_kv_request(s, sb, d, db, bad); },
                                       {"exceed 32 bits"});
}

// ------------------------------------------------------------ across processes

class KvTransferTest : public testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    setenv("FI_TCP_IFACE", "lo", 0);
    if (!moelink_test::fabric_provider_available(GetParam()))
      GTEST_SKIP() << "libfabric provider '" << GetParam() << "' is not available here";
  }
  std::string provider() const { return GetParam(); }
};

// Both ranks: engine, caches, descriptors, a warm-up exchange (tcp connects).
struct Side {
  std::unique_ptr<TransferEngine> e;
  std::vector<uint8_t> buf;
  MemoryRegion region;
  std::vector<MemoryDescriptor> d;
  KvCacheLayout layout;
};

Side setup(const std::string& prov, int rank, moelink::Bootstrap& b, bool prefill,
           double timeout_s = 30.0) {
  Side s;
  s.e = make_engine(prov, rank, /*num_domains=*/2, timeout_s);
  s.layout = prefill ? src_layout() : dst_layout();
  s.buf.assign(s.layout.required_bytes() + 100, 0);
  if (prefill) fill_source(s.buf, s.layout);
  s.region = s.e->register_memory(s.buf.data(), s.buf.size());
  s.d = exchange_descriptors(b, *s.e, s.region);
  const GroupId g = s.e->add_peer_group({s.d[1 - rank]});
  s.e->barrier(g, 0xfff0)->wait();
  s.e->wait_imm(0xfff0, 1);
  return s;
}

TEST_P(KvTransferTest, ScatteredPagesByteForByte) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    const bool prefill = rank == 0;
    Side s = setup(prov, rank, b, prefill);
    int round = 0;
    for (KvImmMode mode : {KvImmMode::kPerLayer, KvImmMode::kPerRequest})
      for (uint64_t tokens : {uint64_t{37}, uint64_t{40}, uint64_t{1}}) {  // partial, full, 1
        const uint64_t pages = (tokens + kTpp - 1) / kTpp;
        auto req = make_request(tokens, scattered(kPool, pages, 10 + round),
                                scattered(kPool, pages, 50 + round), 1000, mode);
        const std::string ctx = "round " + std::to_string(round++);
        if (prefill) {
          if (mode == KvImmMode::kPerLayer) {
            // Layer by layer, as prefill would produce them.
            for (int l = 0; l < kLayers; ++l)
              write_kv_cache(*s.e, s.region, src_layout(), s.d[1], dst_layout(), req, l, 1)
                  ->wait();
          } else {
            write_kv_cache(*s.e, s.region, src_layout(), s.d[1], dst_layout(), req)->wait();
          }
        } else {
          if (mode == KvImmMode::kPerLayer)
            for (int l = 0; l < kLayers; ++l) wait_kv_cache(*s.e, dst_layout(), req, "rank0", 30, l, 1);
          else
            wait_kv_cache(*s.e, dst_layout(), req, "rank0", 30);
          check_and_clear(s.buf, dst_layout(), req, ctx);
          all_zero(s.buf, ctx);
          RANK_CHECK(s.e->imm_count(1000) == 0) << ctx << ": counts left over";
        }
        b.barrier();
      }
  }, kTimeout);
}

// Four requests issued back to back before the decode side waits for any;
// it waits in reverse order. Disjoint immediates and decode pages.
TEST_P(KvTransferTest, MultipleRequestsInFlight) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    const bool prefill = rank == 0;
    Side s = setup(prov, rank, b, prefill);
    const auto dst_ids = scattered(kPool, 20, 77);  // 4 requests x 5 pages
    std::vector<KvTransferRequest> reqs;
    for (int k = 0; k < 4; ++k)
      reqs.push_back(make_request(17 + k, scattered(kPool, 5, 200 + k),
                                  std::vector<uint64_t>(dst_ids.begin() + 5 * k,
                                                        dst_ids.begin() + 5 * k + 5),
                                  static_cast<uint32_t>(100 * (k + 1)),
                                  k % 2 ? KvImmMode::kPerRequest : KvImmMode::kPerLayer));
    if (prefill) {
      std::vector<TransferPtr> ts;
      for (const auto& r : reqs)
        ts.push_back(write_kv_cache(*s.e, s.region, src_layout(), s.d[1], dst_layout(), r));
      for (auto& t : ts) t->wait();
    } else {
      for (int k = 3; k >= 0; --k) wait_kv_cache(*s.e, dst_layout(), reqs[k], "rank0", 30);
      for (int k = 0; k < 4; ++k) check_and_clear(s.buf, dst_layout(), reqs[k], "request " + std::to_string(k));
      all_zero(s.buf, "after 4 requests");
    }
    b.barrier();
  }, kTimeout);
}

// Out-of-range and duplicate page ids, bad layer ranges: InvalidArgument,
// nothing posted (a write to oneself would count immediates).
TEST_P(KvTransferTest, WrongPageIdsThrowAndPostNothing) {
  const std::string prov = provider();
  run_processes(1, [&](int, int) {
    auto e = make_engine(prov, 0);
    const auto s = src_layout(), d = dst_layout();
    std::vector<uint8_t> a(s.required_bytes()), c(d.required_bytes());
    auto ra = e->register_memory(a.data(), a.size());
    auto rc = e->register_memory(c.data(), c.size());
    const auto self = e->descriptor(rc);
    auto r = make_request(9, {1, 2, 3}, {4, 5, 6}, 500, KvImmMode::kPerLayer);
    auto bad = r;
    bad.dst_pages[1] = 99;
    expect_throw_naming<InvalidArgument>(
        [&] { write_kv_cache(*e, ra, s, self, d, bad); },
        {"KV transfer to 'rank0'", "destination page id 99", "request page 1"});
    bad = r;
    bad.src_pages[2] = kPool;
    expect_throw_naming<InvalidArgument>([&] { write_kv_cache(*e, ra, s, self, d, bad); },
                                         {"source page id 24", "request page 2"});
    expect_throw_naming<InvalidArgument>([&] { write_kv_cache(*e, ra, s, self, d, r, 5, 2); },
                                         {"2 layers from layer 5", "6-layer"});
    auto per_req = r;
    per_req.imm_mode = KvImmMode::kPerRequest;
    expect_throw_naming<InvalidArgument>(
        [&] { write_kv_cache(*e, ra, s, self, d, per_req, 0, 1); }, {"one immediate per request"});
    expect_throw_naming<InvalidArgument>([&] { wait_kv_cache(*e, d, per_req, "x", 1, 2, 1); },
                                         {"only the whole request"});
    expect_throw_naming<moelink::TimeoutError>(
        [&] { wait_kv_cache(*e, d, per_req, "prefill7", 0.1); },
        {"KV transfer from 'prefill7'", "0 of 18 page writes", "6 layers x 3 pages"});
    usleep(100 * 1000);
    for (uint32_t imm = 500; imm < 500 + kLayers; ++imm)
      RANK_CHECK(e->imm_count(imm) == 0) << "an invalid request posted writes (imm " << imm << ")";
    // The valid one goes through (to itself).
    write_kv_cache(*e, ra, s, self, d, r)->wait();
    wait_kv_cache(*e, d, r, "rank0", 30);
  }, kTimeout);
}

// The prefill process sends 3 of 6 layers and dies; the decode side gets
// its 3 layers, then a TimeoutError naming the peer and the missing layer.
TEST_P(KvTransferTest, TimeoutWhenPrefillDies) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    const bool prefill = rank == 1;  // rank 0 runs the bootstrap: it stays
    Side s = setup(prov, rank, b, prefill, /*timeout_s=*/10.0);
    const std::vector<int32_t> pids = gather_pids(b);  // for the dead rank's shm files
    auto req = make_request(37, scattered(kPool, 10, 3), scattered(kPool, 10, 4), 40,
                            KvImmMode::kPerLayer);
    if (prefill) {
      write_kv_cache(*s.e, s.region, src_layout(), s.d[0], dst_layout(), req, 0, 3)->wait();
      b.barrier();  // decode has layers 0..2
      _exit(0);
    }
    wait_kv_cache(*s.e, dst_layout(), req, "rank1", 30, 0, 3);
    b.barrier();
    const auto start = std::chrono::steady_clock::now();
    expect_throw_naming<moelink::TimeoutError>(
        [&] { wait_kv_cache(*s.e, dst_layout(), req, "rank1", 1.5, 3, -1); },
        {"KV transfer from 'rank1'", "layer 3 has 0 of 10 pages", "prefill peer"});
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    RANK_CHECK(sec >= 1.4 && sec < 10) << "timeout took " << sec << " s";
    s.e.reset();
    if (prov == "shm") remove_shm_files_of(pids[1]);
  }, kTimeout);
}

// The decode process takes 3 of 6 layers and dies; prefill's next writes of
// the same request fail with an error naming the peer (tcp: "could not be
// posted within the engine timeout", after 4 s), or land in the
// dead peer's still-mapped memory (shm may accept them), within the engine's
// timeout: never a hang. The engine stays usable for other peers (itself).
TEST_P(KvTransferTest, PrefillErrorsWhenDecodeDies) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    const bool prefill = rank == 0;  // rank 0 runs the bootstrap: it stays
    Side s = setup(prov, rank, b, prefill, /*timeout_s=*/4.0);
    const std::vector<int32_t> pids = gather_pids(b);  // for the dead rank's shm files
    auto req = make_request(37, scattered(kPool, 10, 5), scattered(kPool, 10, 6), 60,
                            KvImmMode::kPerLayer);
    if (!prefill) {
      wait_kv_cache(*s.e, dst_layout(), req, "rank0", 30, 0, 3);
      b.barrier();  // prefill saw layers 0..2 arrive
      _exit(0);
    }
    write_kv_cache(*s.e, s.region, src_layout(), s.d[1], dst_layout(), req, 0, 3)->wait();
    b.barrier();
    usleep(300 * 1000);  // the decode process is gone
    const auto start = std::chrono::steady_clock::now();
    bool failed = false;
    for (int i = 0; i < 20 && !failed; ++i) {
      try {
        write_kv_cache(*s.e, s.region, src_layout(), s.d[1], dst_layout(), req, 3, 3)->wait();
      } catch (const moelink::Error& err) {
        failed = true;
        RANK_CHECK(std::string(err.what()).find("rank1") != std::string::npos)
            << "the error does not name the dead peer: " << err.what();
      }
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (prov != "shm") {
      RANK_CHECK(failed) << "KV writes to a dead decode peer did not fail";
    }
    RANK_CHECK(sec < 15) << "the writes to a dead peer took " << sec << " s to end";
    // Still usable: a request to itself (imm 200..205) arrives whole.
    auto self = make_request(9, {1, 2, 3}, {4, 5, 6}, 200, KvImmMode::kPerLayer);
    std::vector<uint8_t> mine(src_layout().required_bytes());
    auto mine_region = s.e->register_memory(mine.data(), mine.size());
    write_kv_cache(*s.e, s.region, src_layout(), s.e->descriptor(mine_region), src_layout(), self)
        ->wait();
    wait_kv_cache(*s.e, src_layout(), self, "rank0", 10);
    RANK_CHECK(std::memcmp(&mine[src_layout().page_offset(2, 5)], &s.buf[src_layout().page_offset(2, 2)],
                           src_layout().page_bytes()) == 0)
        << "the engine's request to itself after the dead peer arrived wrong";
    s.e.reset();
    if (prov == "shm") remove_shm_files_of(pids[1]);
  }, kTimeout);
}

INSTANTIATE_TEST_SUITE_P(Providers, KvTransferTest, testing::Values("shm", "tcp"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
