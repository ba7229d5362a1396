// TransferEngine across forked processes on the shm and tcp providers.
#include <gtest/gtest.h>
#include <rdma/fabric.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <set>
#include <thread>
#include <numeric>
#include <vector>

#include "fabric/block_cache.h"
#include "fabric/op_state.h"
#include "fabric_test_util.h"
#include "rank_harness.h"
#if MOELINK_WITH_CUDA
#include "gpu_flag_poll.h"
#include "gpu_memory_ops.h"  // CUDA_OK
#endif

namespace {

using namespace moelink::fabric;
using moelink_test::exchange_descriptors;
using moelink_test::make_engine;
using moelink_test::run_processes;
using moelink_test::run_ranks;

constexpr int kTimeout = 90;  // per test, all ranks together

void remove_shm_files_of(int pid) {
  const std::string prefix = std::to_string(pid) + ":";
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator("/dev/shm", ec))
    if (f.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(f.path(), ec);
}

uint8_t pattern(int rank, size_t i) { return static_cast<uint8_t>(rank * 31 + i * 7 + 1); }

// Polls pred every 50 us for up to 20 s; returns its last value.
template <class Pred>
bool eventually(Pred pred) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!pred() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  return pred();
}

class FabricTest : public testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    setenv("FI_TCP_IFACE", "lo", 0);
    if (!moelink_test::fabric_provider_available(GetParam()))
      GTEST_SKIP() << "libfabric provider '" << GetParam() << "' is not available here";
  }
  std::string provider() const { return GetParam(); }
};

// Warm-up: the first operation on tcp connects (75-170 ms); a barrier to
// every peer makes later timings and timeouts independent of it.
void warm_up(TransferEngine& e, moelink::Bootstrap& b, const std::vector<MemoryDescriptor>& d) {
  std::vector<MemoryDescriptor> others;
  for (int r = 0; r < b.world_size(); ++r)
    if (r != b.rank()) others.push_back(d[r]);
  const GroupId g = e.add_peer_group(others);
  e.barrier(g, 0xfff0)->wait();
  e.wait_imm(0xfff0, static_cast<uint64_t>(b.world_size() - 1));
}

TEST(FabricDescriptor, SerializationRoundTrips) {
  MemoryDescriptor d;
  d.owner.name = "rank3";
  d.owner.endpoints = {std::string("\x01\x00\x02", 3), "abc"};
  d.size = 12345;
  d.remote_base = {0x1000, 0};
  d.keys = {7, 99};
  const auto bytes = d.serialize();
  const auto back = MemoryDescriptor::deserialize(bytes.data(), bytes.size());
  EXPECT_EQ(back.owner, d.owner);
  EXPECT_EQ(back.size, d.size);
  EXPECT_EQ(back.remote_base, d.remote_base);
  EXPECT_EQ(back.keys, d.keys);
  const auto a = d.owner.serialize();
  EXPECT_EQ(EngineAddress::deserialize(a.data(), a.size()), d.owner);
  moelink_test::expect_throw_naming<moelink::InvalidArgument>(
      [&] { MemoryDescriptor::deserialize(bytes.data(), bytes.size() - 1); }, {"MemoryDescriptor"});
}

// count_completions() is recognized: its counters replace the callback
// (nothing for the worker to run), and count after done() turned true.
TEST(FabricOpState, CompletionCountersReplaceTheCallback) {
  std::atomic<uint64_t> done{0}, failed{0};
  const std::string name = "write to peer 'x'";
  const std::string* what = &name;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  OpState ok(what, 2, deadline, count_completions(done, failed));
  EXPECT_FALSE(ok.has_callback());
  ok.complete_one();
  EXPECT_FALSE(ok.done());
  EXPECT_EQ(done.load(), 0u);
  ok.complete_one();
  EXPECT_TRUE(ok.done());
  EXPECT_EQ(done.load(), 1u);
  OpState bad(what, 1, deadline, count_completions(done, failed));
  bad.fail(std::make_exception_ptr(moelink::FabricError("lost")));
  bad.complete_one();  // a late completion changes nothing
  EXPECT_TRUE(bad.done());
  EXPECT_EQ(failed.load(), 1u);
  EXPECT_EQ(done.load(), 1u);
  EXPECT_THROW(bad.wait(-1), moelink::FabricError);
  // An ordinary callback stays a callback.
  OpState cb(what, 1, deadline, [](std::exception_ptr) {});
  EXPECT_TRUE(cb.has_callback());
}

// The operations' block cache: a freed block is handed out again on the
// thread that freed it, not returned to malloc (a malloc of the same size
// right after does not get it; glibc's would), also when another thread
// took it; past kBlocksPerThread blocks go to operator delete (ASan's leak
// check sees any block a thread's exit does not free).
TEST(FabricBlockCache, FreedBlocksAreTakenAgainOnTheFreeingThread) {
  using Cache = BlockCache<96, 16>;
  const auto kept = [](void* p) {  // true when p went to the cache, not to malloc
    void* probe = ::operator new(96, std::align_val_t{16});
    const bool in_cache = probe != p;
    ::operator delete(probe, std::align_val_t{16});
    return in_cache && Cache::take() == p;
  };
  void* a = Cache::take();
  void* b = Cache::take();
  ASSERT_NE(a, b);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 16, 0u);
  Cache::give(a);
  EXPECT_TRUE(kept(a)) << "a freed block went back to malloc";
  std::thread([&] {
    Cache::give(b);  // taken on the main thread, freed here
    EXPECT_TRUE(kept(b));
    Cache::give(b);  // freed with this thread's list at its exit
  }).join();
  std::vector<void*> many;
  for (int i = 0; i < 2 * Cache::kBlocksPerThread; ++i) many.push_back(Cache::take());
  for (void* p : many) Cache::give(p);  // the second half to operator delete
  Cache::give(a);                       // the list is full: to operator delete
  // CachedAllocator (std::allocate_shared of the engine's operations, rebound
  // to their control block) takes single objects from it.
  CachedAllocator<OpState> alloc;
  OpState* op = alloc.allocate(1);
  alloc.deallocate(op, 1);
  using OpCache = BlockCache<sizeof(OpState), alignof(OpState)>;
  void* probe = ::operator new(sizeof(OpState), std::align_val_t{alignof(OpState)});
  EXPECT_NE(probe, static_cast<void*>(op));
  ::operator delete(probe, std::align_val_t{alignof(OpState)});
  EXPECT_EQ(OpCache::take(), static_cast<void*>(op));
  OpCache::give(op);
}

// A thread asleep in wait() (no progress hook: it only sleeps) is woken by
// the completion on another thread, and the error shows only once done.
TEST(FabricOpState, SleepersWakeAtCompletion) {
  const std::string name = "write to peer 'x'";
  const std::string* what = &name;
  for (int round = 0; round < 200; ++round) {
    const bool failing = round % 2 == 1;
    OpState op(what, 2, Clock::now() + std::chrono::seconds(30), {});
    std::atomic<bool> woke{false};
    double slept_s = 0;
    std::thread sleeper([&] {
      const auto t0 = Clock::now();
      try {
        op.wait(20.0);
      } catch (const moelink::FabricError&) {
      }
      slept_s = std::chrono::duration<double>(Clock::now() - t0).count();
      woke = true;
    });
    op.complete_one();
    if (round % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    EXPECT_FALSE(op.done());
    EXPECT_EQ(op.error(), nullptr);
    if (failing)
      op.fail(std::make_exception_ptr(moelink::FabricError("lost")));
    else
      op.complete_one();
    sleeper.join();
    EXPECT_TRUE(woke.load());
    ASSERT_LT(slept_s, 10.0) << "round " << round << ": the sleeper missed its wake-up";
    EXPECT_TRUE(op.done());
    EXPECT_EQ(op.error() != nullptr, failing);
  }
}

// A waiter holds the passes from one pass to the next (another waiter
// finds them busy) and lets go at its pauses; it is counted in waiters()
// from its first pause on (every 64 passes in drive_until), so a short
// wait is never counted; a cleared hook runs no pass.
TEST(FabricProgressHook, AWaiterHoldsThePassesAndCountsFromItsFirstPause) {
  std::vector<int> seen;  // waiters() at each pass
  ProgressHook* self = nullptr;
  ProgressHook hook([&] {
    seen.push_back(self->waiters().load());
    return Pass::kIdle;
  }, /*busy=*/true);
  self = &hook;
  const auto forever = Clock::now() + std::chrono::seconds(30);
  for (const int passes : {10, 200}) {
    seen.clear();
    {
      ProgressHook::Waiter w(hook);
      int left = passes;
      drive_until([&] { return left-- == 0; }, [](Clock::time_point) {}, [&] { return forever; },
                  w, std::numeric_limits<int>::max());
      if (passes == 10) {  // still holding the passes: another waiter is kept out
        ProgressHook::Waiter other(hook);
        EXPECT_EQ(other.pass(), Pass::kBusy);
      }
    }
    EXPECT_EQ(hook.waiters().load(), 0) << passes << " passes";
    ASSERT_EQ(seen.size(), static_cast<size_t>(passes));
    for (int i = 0; i < passes; ++i)
      EXPECT_EQ(seen[i], i < 63 ? 0 : 1) << "pass " << i << " of " << passes;
  }
  {
    ProgressHook::Waiter a(hook), b(hook);
    EXPECT_EQ(a.pass(), Pass::kIdle);
    EXPECT_EQ(b.pass(), Pass::kBusy);
    a.pause();
    EXPECT_EQ(b.pass(), Pass::kIdle);
    EXPECT_EQ(hook.waiters().load(), 1);
  }
  hook.clear();
  seen.clear();
  ProgressHook::Waiter late(hook);
  EXPECT_EQ(late.pass(), Pass::kIdle);
  EXPECT_TRUE(seen.empty()) << "a cleared hook ran a pass";
}

// drive_until's clock for the spin window, advanced by hand: each pass
// takes kStep, each sleep its full kIdleSleep slice.
struct StepClock {
  using time_point = Clock::time_point;
  static inline time_point t{};
  static time_point now() { return t; }
};

// The yield-mode waiter's policy, on the pass count, with no real time
// in it. Passes finding work every kSpinPolls + 100 passes (more idle
// passes in a row than kSpinPolls, each gap well inside kSpinWindow), as
// pages arriving over shm, where every write needs passes on both sides:
// the waiter never sleeps between them (with 200 passes and no window it
// slept after each, and a transfer crawled at a sleep per page). Once
// nothing comes it sleeps after a window (and kSpinPolls passes), then
// before every pass; the same from the start when nothing ever comes.
TEST(FabricProgressHook, AWaiterSpinsWhilePassesFindWorkThenSleeps) {
  constexpr int kGap = kSpinPolls + 100;
  const auto step = std::chrono::nanoseconds(kSpinWindow) / (2 * kGap);  // a gap: half a window
  ASSERT_GT(step.count(), 0);
  const int window_passes = static_cast<int>(kSpinWindow / step);
  for (const int works : {20, 0}) {
    SCOPED_TRACE(std::to_string(works) + " passes with work");
    StepClock::t = Clock::now();
    int pass = 0;
    ProgressHook hook([&] {
      StepClock::t += step;
      ++pass;
      return pass <= works * kGap && pass % kGap == 0 ? Pass::kWork : Pass::kIdle;
    });
    const int last_work = works * kGap;
    const int total = last_work + kSpinPolls + window_passes + 500;
    std::vector<int> slept;  // passes run before each sleep
    ProgressHook::Waiter w(hook);
    const auto forever = StepClock::t + std::chrono::hours(1);
    EXPECT_TRUE(drive_until<StepClock>(
        [&] { return pass >= total; },
        [&](Clock::time_point until) {
          slept.push_back(pass);
          StepClock::t = until;
        },
        [&] { return forever; }, w, kSpinPolls));
    ASSERT_FALSE(slept.empty()) << "the waiter never slept";
    EXPECT_GT(slept.front(), last_work + kSpinPolls) << "slept while work kept arriving";
    EXPECT_GE(slept.front(), last_work + window_passes) << "slept within a window of work";
    EXPECT_LE(slept.front(), last_work + kSpinPolls + window_passes + 1)
        << "spun on past its window with nothing arriving";
    // Asleep before every pass from then on.
    EXPECT_EQ(slept.size(), static_cast<size_t>(total - slept.front()));
  }
}

TEST(FabricProvider, UnknownProviderThrows) {
  run_processes(1, [](int, int) {
    moelink_test::expect_throw_naming<moelink::ProviderUnavailable>(
        [] { make_engine("no-such-provider", 0); }, {"no-such-provider"});
  }, kTimeout);
}

// efa-direct needs libfabric >= 2.1 (and an EFA device): below that the
// error says so; with it but without a device, the usual unavailability.
TEST(FabricProvider, EfaDirectNamesWhatItNeeds) {
  run_processes(1, [](int, int) {
    const uint32_t v = fi_version();
    if (v < FI_VERSION(2, 1)) {
      moelink_test::expect_throw_naming<moelink::ProviderUnavailable>(
          [] { make_engine("efa-direct", 0); }, {"efa-direct", ">= 2.1", "loaded libfabric"});
    } else if (!moelink_test::fabric_provider_available("efa-direct")) {
      moelink_test::expect_throw_naming<moelink::ProviderUnavailable>(
          [] { make_engine("efa-direct", 0); }, {"efa-direct"});
    }
  }, kTimeout);
}

TEST_P(FabricTest, WriteWithImmediateBothDirections) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    auto e = make_engine(prov, rank);
    std::vector<uint8_t> src(1 << 16), dst(1 << 16, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(rank, i);
    auto rs = e->register_memory(src.data(), src.size());
    auto rd = e->register_memory(dst.data(), dst.size());
    auto d = exchange_descriptors(b, *e, rd);
    warm_up(*e, b, d);
    const int peer = 1 - rank;
    // 1000 bytes from src+24 to peer's dst+100, then the whole rest.
    e->write(rs, 24, d[peer], 100, 1000, 7u)->wait();
    std::atomic<int> called{0};
    e->write(rs, 0, d[peer], 4096, 60000, 8u, [&](std::exception_ptr err) {
       if (!err) called++;
     })->wait();
    RANK_CHECK(called == 1) << "callback not called";
    e->wait_imm(7, 1);
    e->wait_imm(8, 1);
    for (size_t i = 0; i < 1000; ++i)
      if (dst[100 + i] != pattern(peer, 24 + i)) {
        RANK_FAIL() << "byte " << i << " of the first write is wrong";
        break;
      }
    for (size_t i = 0; i < 60000; ++i)
      if (dst[4096 + i] != pattern(peer, i)) {
        RANK_FAIL() << "byte " << i << " of the second write is wrong";
        break;
      }
    RANK_CHECK(dst[99] == 0 && dst[1100] == 0) << "write spilled outside its range";
    RANK_CHECK(e->imm_count(7) == 0) << "wait_imm did not consume";
    b.barrier();
  }, kTimeout);
}

TEST_P(FabricTest, PagedWriteWithStrides) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    auto e = make_engine(prov, rank, /*num_domains=*/2);
    constexpr size_t kPage = 256, kSrcStride = 512, kDstStride = 384, kPages = 16;
    std::vector<uint8_t> src(kSrcStride * kPages), dst(64 + kDstStride * kPages, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(rank, i);
    auto rs = e->register_memory(src.data(), src.size());
    auto rd = e->register_memory(dst.data(), dst.size());
    auto d = exchange_descriptors(b, *e, rd);
    warm_up(*e, b, d);
    PagedWrite p;
    p.page_bytes = kPage;
    p.src_stride = kSrcStride;
    p.dst_stride = kDstStride;
    p.dst_offset = 64;
    for (size_t i = 0; i < 10; ++i) {  // pages 0..9 to slots (3i) % 16, reversed
      p.src_pages.push_back(9 - i);
      p.dst_pages.push_back((3 * i) % kPages);
    }
    e->paged_write(rs, d[1 - rank], p, 21u)->wait();
    e->wait_imm(21, p.src_pages.size());
    for (size_t i = 0; i < p.src_pages.size(); ++i)
      for (size_t j = 0; j < kPage; ++j) {
        const size_t at = 64 + p.dst_pages[i] * kDstStride + j;
        if (dst[at] != pattern(1 - rank, p.src_pages[i] * kSrcStride + j)) {
          RANK_FAIL() << "page " << i << " byte " << j << " is wrong";
          i = p.src_pages.size();
          break;
        }
      }
    b.barrier();
  }, kTimeout);
}

// Each rank scatters a different slice of one buffer to every other rank,
// then a barrier; repeated to check the counters' consumption.
TEST_P(FabricTest, ScatterAndBarrierOverGroup) {
  const std::string prov = provider();
  for (int domains : {1, 2}) {
    constexpr int kWorld = 3;
    run_ranks(kWorld, [&](int rank, moelink::Bootstrap& b) {
      auto e = make_engine(prov, rank, domains);
      constexpr size_t kSlice = 4000;
      std::vector<uint8_t> src(kSlice * kWorld), dst(kSlice * kWorld, 0);
      auto rs = e->register_memory(src.data(), src.size());
      auto rd = e->register_memory(dst.data(), dst.size());
      auto d = exchange_descriptors(b, *e, rd);
      warm_up(*e, b, d);
      std::vector<MemoryDescriptor> members(d.begin(), d.end());  // includes self
      const GroupId g = e->add_peer_group(members);
      for (int round = 0; round < 3; ++round) {
        for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(rank + round, i);
        std::vector<ScatterSlice> slices;
        for (int m = 0; m < kWorld; ++m)  // slice m of src to member m at offset rank*kSlice
          slices.push_back({static_cast<size_t>(m), m * kSlice, rank * kSlice, kSlice});
        e->scatter(g, rs, slices, 100 + round)->wait();
        e->wait_imm(100 + round, kWorld);
        for (int from = 0; from < kWorld; ++from)
          for (size_t j = 0; j < kSlice; ++j)
            if (dst[from * kSlice + j] != pattern(from + round, rank * kSlice + j)) {
              RANK_FAIL() << "round " << round << ": slice from rank " << from << " byte " << j;
              break;
            }
        e->barrier(g, 200)->wait();  // nobody overwrites dst before all checked
        e->wait_imm(200, kWorld);
      }
      b.barrier();
    }, kTimeout);
  }
}

TEST_P(FabricTest, SendRecvMessages) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    auto e = make_engine(prov, rank);
    std::vector<char> buf(4096);
    auto rb = e->register_memory(buf.data(), buf.size());
    auto addrs = b.all_gather_blobs(e->address().serialize());
    const PeerId peer =
        e->add_peer(EngineAddress::deserialize(addrs[1 - rank].data(), addrs[1 - rank].size()));
    for (int i = 0; i < 20; ++i) {
      const std::string text = "hello " + std::to_string(i) + " from rank" + std::to_string(rank);
      std::memcpy(buf.data() + 100, text.data(), text.size());
      e->send(peer, rb, 100, text.size())->wait();
    }
    for (int i = 0; i < 20; ++i) {
      auto m = e->recv(30.0);
      RANK_CHECK(m.has_value()) << "message " << i << " did not arrive";
      if (!m) break;
      const std::string got(m->data.begin(), m->data.end());
      RANK_CHECK(got.rfind("hello ", 0) == 0 && got.find("rank" + std::to_string(1 - rank)) !=
                                                    std::string::npos)
          << "unexpected message '" << got << "'";
    }
    RANK_CHECK(!e->recv(0.05).has_value()) << "extra message";
    b.barrier();
  }, kTimeout);
}

TEST_P(FabricTest, InvalidUseNamesOperationAndPeer) {
  const std::string prov = provider();
  run_processes(1, [&](int, int) {
    using moelink::InvalidArgument;
    using moelink_test::expect_throw_naming;
    auto e = make_engine(prov, 0);
    std::vector<char> a(4096), other(64);
    auto ra = e->register_memory(a.data(), a.size());
    const auto self = e->descriptor(ra);  // writes to oneself are fine
    e->write(ra, 0, self, 2048, 1024, 5u)->wait();
    e->wait_imm(5, 1);
    MemoryRegion fake{9999, other.data(), other.size()};
    expect_throw_naming<InvalidArgument>([&] { e->write(fake, 0, self, 0, 8); },
                                         {"write to peer 'rank0'", "not registered"});
    expect_throw_naming<InvalidArgument>([&] { e->write(ra, 4000, self, 0, 200); },
                                         {"write to peer 'rank0'", "source range", "4096"});
    expect_throw_naming<InvalidArgument>([&] { e->write(ra, 0, self, 4000, 200); },
                                         {"write", "destination range"});
    expect_throw_naming<InvalidArgument>([&] { e->send(7, ra, 0, 8); }, {"unknown peer 7"});
    expect_throw_naming<InvalidArgument>([&] { e->barrier(3, 1); }, {"barrier", "unknown peer group 3"});
    PagedWrite p;
    p.page_bytes = 512;
    p.src_stride = 512;
    p.dst_stride = 512;
    p.src_pages = {0, 8};
    p.dst_pages = {0, 1};
    expect_throw_naming<InvalidArgument>([&] { e->paged_write(ra, self, p); },
                                         {"paged_write", "page 1", "source range"});
    expect_throw_naming<moelink::TimeoutError>([&] { e->wait_imm(77, 1, 0.05); },
                                               {"wait_imm", "immediate 77", "0 of 1"});
    e->deregister_memory(ra);
    expect_throw_naming<InvalidArgument>([&] { e->write(ra, 0, self, 0, 8); }, {"not registered"});
    expect_throw_naming<InvalidArgument>([&] { e->deregister_memory(ra); }, {"not registered"});
  }, kTimeout);
}

// Rank 1 vanishes (exits without closing anything) after the exchange; rank
// 0's operations fail with an error naming the peer within the timeout, and
// its engine is destroyed cleanly afterwards.
TEST_P(FabricTest, PeerDisappearsMidTransfer) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    auto e = make_engine(prov, rank, 1, /*timeout_s=*/4.0);
    std::vector<char> buf(1 << 20);
    auto r = e->register_memory(buf.data(), buf.size());
    auto d = exchange_descriptors(b, *e, r);
    warm_up(*e, b, d);
    const int32_t my_pid = getpid();
    std::vector<int32_t> pids(2);
    b.all_gather(&my_pid, pids.data(), sizeof(my_pid));
    if (rank == 1) _exit(0);
    usleep(300 * 1000);
    const auto start = std::chrono::steady_clock::now();
    bool failed = false;
    for (int i = 0; i < 50 && !failed; ++i) {
      try {
        e->write(r, 0, d[1], 0, buf.size(), 1u)->wait();
      } catch (const moelink::Error& err) {
        failed = true;
        RANK_CHECK(std::string(err.what()).find("peer 'rank1'") != std::string::npos)
            << "error does not name the peer: " << err.what();
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // shm may accept writes into a dead peer's memory: then they succeed.
    if (prov != "shm") {
      RANK_CHECK(failed) << "writes to a vanished peer did not fail";
    }
    RANK_CHECK(s < 30) << "failure took " << s << " s";
    // A counted write to the vanished peer is counted as failed (shm may
    // accept it: then as done).
    std::atomic<uint64_t> done{0}, lost{0};
    (void)e->write(r, 0, d[1], 0, 4096, 2u, count_completions(done, lost));
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (done.load() + lost.load() < 1 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    RANK_CHECK(done.load() + lost.load() == 1) << "the counted write was never counted";
    if (prov != "shm") {
      RANK_CHECK(lost.load() == 1) << "the counted write to a vanished peer was not counted failed";
    }
    moelink_test::expect_throw_naming<moelink::TimeoutError>([&] { e->wait_imm(1, 1, 0.2); },
                                                             {"wait_imm"});
    e.reset();
    // The shm provider leaves the vanished rank's region ("<pid>:<n>:<m>").
    if (prov == "shm") remove_shm_files_of(pids[1]);
  }, kTimeout);
}

// Rank 1 hangs with rank 0's writes to it in flight (its worker stuck in a
// callback: nothing sent to it completes), then exits. tcp fails those
// writes with a broken connection; shm only by the engine timeout (2 s
// here: it never learns of the exit). Rank 1 is then known to be
// unreachable: rank 0's next write to it fails at once, naming the peer and
// the first failure, where tcp, reconnecting to a process that is gone,
// refused it "for now" until the timeout (10 s) and blamed a busy provider.
// Writes to rank 2 still go through.
TEST_P(FabricTest, ADeadPeerFailsAtOnceOthersKeepWorking) {
  const std::string prov = provider();
  run_ranks(3, [&](int rank, moelink::Bootstrap& b) {
    const double timeout_s = prov == "shm" ? 2.0 : 10.0;
    auto e = make_engine(prov, rank, 1, timeout_s);
    std::vector<char> buf(1 << 20);
    auto r = e->register_memory(buf.data(), buf.size());
    auto d = exchange_descriptors(b, *e, r);
    warm_up(*e, b, d);
    const int32_t my_pid = getpid();
    std::vector<int32_t> pids(3);
    b.all_gather(&my_pid, pids.data(), sizeof(my_pid));
    if (rank == 1) {
      std::atomic<bool> hung{false};
      (void)e->write(r, 0, d[1], 0, 8, 99u, [&](std::exception_ptr) {
        hung = true;
        for (;;) pause();
      });
      while (!hung) usleep(100);
      b.barrier();  // hung
      b.barrier();  // rank 0's writes are in flight
      _exit(0);
    }
    b.barrier();
    if (rank == 2) {  // the live peer: answers rank 0's write, then leaves
      b.barrier();
      e->wait_imm(21, 1, 30);
      e->write(r, 0, d[0], 0, 8, 22u)->wait();
      return;
    }
    std::vector<TransferPtr> in_flight;
    for (int i = 0; i < 32; ++i) in_flight.push_back(e->write(r, 0, d[1], 0, buf.size(), 1u));
    b.barrier();
    // Every failure so far; one of them is the one rank 1 is known dead by.
    std::vector<std::string> failures;
    const auto failed = [&](const TransferPtr& t) {
      try {
        t->wait();
        return false;
      } catch (const moelink::Error& err) {
        failures.push_back(err.what());
        return true;
      }
    };
    for (const auto& t : in_flight) (void)failed(t);
    // Should tcp have buffered all of them: the next write fails (at the
    // timeout at worst).
    for (int i = 0; i < 3 && failures.empty(); ++i)
      (void)failed(e->write(r, 0, d[1], 0, buf.size(), 1u));
    RANK_CHECK(!failures.empty()) << "no write to the dead peer failed";
    for (const auto& f : failures)
      RANK_CHECK(f.find("peer 'rank1'") != std::string::npos)
          << "the error does not name the peer: " << f;
    if (!failures.empty()) {
      usleep(300 * 1000);  // tcp;ofi_rxm is reconnecting by now
      const size_t before = failures.size();
      const auto start = std::chrono::steady_clock::now();
      const bool refused = failed(e->write(r, 0, d[1], 0, 4096, 2u));
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      RANK_CHECK(refused) << "a write to the dead peer succeeded";
      const std::string next = refused ? failures.back() : "";
      RANK_CHECK(s < 1.0) << "the write to a peer known dead took " << s << " s (engine timeout "
                          << timeout_s << " s): " << next;
      RANK_CHECK(next.find("peer 'rank1'") != std::string::npos &&
                 next.find("unreachable") != std::string::npos)
          << "the error does not say the peer is unreachable: " << next;
      RANK_CHECK(next.find("busy") == std::string::npos)
          << "the error blames the provider: " << next;
      // It carries the first failure's cause (what follows the operation's name).
      bool carries = false;
      for (size_t i = 0; i < before; ++i) {
        const std::string& f = failures[i];
        carries = carries || next.find(f.substr(f.find("): ") + 3)) != std::string::npos;
      }
      RANK_CHECK(carries) << "the error does not carry the first failure's cause: " << next;
    }
    e->write(r, 0, d[2], 0, 4096, 21u)->wait();
    e->wait_imm(22, 1, 30);
    e.reset();
    if (prov == "shm") remove_shm_files_of(pids[1]);
  }, kTimeout);
}

// count_completions: fire-and-forget writes (the Transfers dropped at
// once) are counted as they complete, by whichever thread reads them.
TEST_P(FabricTest, CompletionCountersCountWrites) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    auto e = make_engine(prov, rank);
    std::vector<uint8_t> src(64 * 256), dst(64 * 256, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(rank, i);
    auto rs = e->register_memory(src.data(), src.size());
    auto rd = e->register_memory(dst.data(), dst.size());
    auto d = exchange_descriptors(b, *e, rd);
    warm_up(*e, b, d);
    constexpr int kWrites = 64;
    if (rank == 0) {
      std::atomic<uint64_t> done{0}, failed{0};
      for (int i = 0; i < kWrites; ++i)
        (void)e->write(rs, i * 256, d[1], i * 256, 256, 12u, count_completions(done, failed));
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (done.load() + failed.load() < kWrites && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      RANK_CHECK(done.load() == kWrites && failed.load() == 0)
          << "counted " << done.load() << " done and " << failed.load() << " failed of " << kWrites;
    } else {
      e->wait_imm(12, kWrites);
      for (size_t i = 0; i < dst.size(); ++i)
        if (dst[i] != pattern(0, i)) {
          RANK_FAIL() << "byte " << i << " is wrong";
          break;
        }
    }
    b.barrier();
  }, kTimeout);
}

// signal_on_imm raises its flag only once the last of `count` arrivals is
// in (with the bytes in place), consumes them, fires at once for arrivals
// already counted, and refuses bad flags and counts by name.
TEST_P(FabricTest, SignalOnImmRaisesAFlag) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    auto e = make_engine(prov, rank);
    std::vector<uint8_t> src(3 * 4096), dst(3 * 4096, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(rank, i);
    auto rs = e->register_memory(src.data(), src.size());
    auto rd = e->register_memory(dst.data(), dst.size());
    auto d = exchange_descriptors(b, *e, rd);
    warm_up(*e, b, d);
    alignas(8) uint64_t flag = 0, early = 0;
    auto read = [](uint64_t& f) { return std::atomic_ref<uint64_t>(f).load(std::memory_order_acquire); };
    if (rank == 1) {
      e->signal_on_imm(9, 3, &flag, 42);
      moelink_test::expect_throw_naming<moelink::InvalidArgument>(
          [&] { e->signal_on_imm(9, 1, nullptr, 1); }, {"signal_on_imm", "flag is null"});
      moelink_test::expect_throw_naming<moelink::InvalidArgument>(
          [&] { e->signal_on_imm(9, 1, reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(&early) + 1), 1); },
          {"signal_on_imm", "aligned"});
      moelink_test::expect_throw_naming<moelink::InvalidArgument>(
          [&] { e->signal_on_imm(9, 0, &flag, 1); }, {"count is 0"});
    }
    b.barrier();
    if (rank == 0) {
      e->write(rs, 0, d[1], 0, 4096, 9u)->wait();
      e->write(rs, 4096, d[1], 4096, 4096, 9u)->wait();
    }
    b.barrier();
    if (rank == 1) {
      // Two of three arrived (wait until the engine counted them): no flag.
      eventually([&] { return e->imm_count(9) >= 2; });
      RANK_CHECK(e->imm_count(9) == 2) << "the two writes were not counted";
      RANK_CHECK(read(flag) == 0) << "flag raised after 2 of 3 arrivals";
    }
    b.barrier();
    if (rank == 0) e->write(rs, 8192, d[1], 8192, 4096, 9u)->wait();
    if (rank == 1) {
      RANK_CHECK(eventually([&] { return read(flag) == 42; }))
          << "flag not raised after the third arrival";
      RANK_CHECK(e->imm_count(9) == 0) << "the signal did not consume its arrivals";
      for (size_t i = 0; i < dst.size(); ++i)
        if (dst[i] != pattern(0, i)) {
          RANK_FAIL() << "byte " << i << " not in place when the flag was raised";
          break;
        }
    }
    b.barrier();
    // Arrivals counted before the signal is asked for fire it at once.
    if (rank == 0) e->write(rs, 0, d[1], 0, 8, 10u)->wait();
    if (rank == 1) {
      eventually([&] { return e->imm_count(10) >= 1; });
      e->signal_on_imm(10, 1, &early, 7);
      RANK_CHECK(read(early) == 7) << "a signal for arrivals already counted did not fire at once";
    }
    b.barrier();
  }, kTimeout);
}

#if MOELINK_WITH_CUDA
// What signal_on_imm is for: a GPU kernel polls the flag in pinned mapped
// host memory while the engine's worker (no user thread waits here) counts
// the arrivals. The kernel keeps polling after 2 of 3 writes, sees the
// value after the third and then reads all their bytes (poisoned before).
TEST_P(FabricTest, SignalOnImmRaisesAFlagAGpuKernelPolls) {
  if (moelink_test::probe_gpu_count() == 0)
    GTEST_SKIP() << "no CUDA GPU on this machine: this test runs on the H200 device machine "
                    "(tools/gpu_check.sh)";
  const std::string prov = provider();
  constexpr size_t kBytes = 3 * 4096, kWords = kBytes / 8;
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    auto e = make_engine(prov, rank);
    // Rank 1: [flag | FlagPoll | data] in one mapped pinned allocation.
    char* mem = nullptr;
    uint64_t* flag = nullptr;
    moelink_test::FlagPoll* poll = nullptr;
    char* data = nullptr;
    std::vector<uint8_t> src(kBytes);
    for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(rank, i);
    cudaStream_t stream = nullptr;
    MemoryRegion region;
    if (rank == 1) {
      CUDA_OK(cudaSetDevice(0));
      CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&mem), 4096 + kBytes, cudaHostAllocMapped));
      flag = reinterpret_cast<uint64_t*>(mem);
      *flag = 0;
      poll = new (mem + 64) moelink_test::FlagPoll();
      data = mem + 4096;
      std::memset(data, 0xEE, kBytes);  // poison: unwritten words change the checksum
      region = e->register_memory(data, kBytes);
    } else {
      region = e->register_memory(src.data(), src.size());
    }
    auto d = exchange_descriptors(b, *e, region);
    warm_up(*e, b, d);
    auto volatile_read = [](uint64_t& f) {
      return std::atomic_ref<uint64_t>(f).load(std::memory_order_acquire);
    };
    if (rank == 1) {
      e->signal_on_imm(9, 3, flag, 42);
      CUDA_OK(moelink_test::launch_flag_poll(flag, 42, reinterpret_cast<const uint64_t*>(data),
                                             kWords, 30'000'000'000ull, poll, stream));
      RANK_CHECK(eventually([&] { return volatile_read(poll->started) == 1; }))
          << "the polling kernel did not start";
    }
    b.barrier();
    if (rank == 0) {
      e->write(region, 0, d[1], 0, 4096, 9u)->wait();
      e->write(region, 4096, d[1], 4096, 4096, 9u)->wait();
    }
    b.barrier();
    if (rank == 1) {
      RANK_CHECK(eventually([&] { return e->imm_count(9) == 2; })) << "the two writes were not counted";
      RANK_CHECK(volatile_read(*flag) == 0) << "flag raised after 2 of 3 arrivals";
      RANK_CHECK(volatile_read(poll->done) == 0) << "the kernel stopped polling before the flag";
    }
    b.barrier();
    if (rank == 0) e->write(region, 8192, d[1], 8192, 4096, 9u)->wait();
    if (rank == 1) {
      CUDA_OK(cudaStreamSynchronize(stream));
      std::vector<uint8_t> want(kBytes);
      for (size_t i = 0; i < want.size(); ++i) want[i] = pattern(0, i);
      RANK_CHECK(poll->done == 1) << "the kernel did not finish";
      RANK_CHECK(poll->timed_out == 0) << "the kernel never saw the flag (30 s)";
      RANK_CHECK(poll->seen == 42) << "the kernel saw " << poll->seen << ", not 42";
      RANK_CHECK(poll->checksum ==
                 moelink_test::data_checksum(reinterpret_cast<const uint64_t*>(want.data()), kWords))
          << "the bytes the kernel read after the flag are not the three writes'";
      RANK_CHECK(e->imm_count(9) == 0) << "the signal did not consume its arrivals";
      e->deregister_memory(region);
      CUDA_OK(cudaStreamDestroy(stream));
      CUDA_OK(cudaFreeHost(mem));
    }
    b.barrier();
  }, kTimeout);
}
#endif

// The CPUs a thread of this process may run on, from
// /proc/self/task/<tid>/status ("Cpus_allowed_list:\t3").
std::string cpus_allowed(const std::string& tid) {
  std::ifstream f("/proc/self/task/" + tid + "/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("Cpus_allowed_list:", 0) == 0) return line.substr(line.find_first_not_of(" \t", 18));
  return "";
}

// worker_cpus pins each worker (here: one per domain) and the engine still
// moves bytes; CPUs outside the process's set are refused by name.
TEST_P(FabricTest, WorkerCpusPinTheWorkers) {
  const std::string prov = provider();
  run_ranks(2, [&](int rank, moelink::Bootstrap& b) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    RANK_CHECK(sched_getaffinity(0, sizeof(allowed), &allowed) == 0);
    std::vector<int> cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    EngineOptions o;
    o.provider = prov;
    o.name = "rank" + std::to_string(rank);
    o.recv_buffers = 16;
    o.timeout_s = 30;
    o.num_domains = 2;
    o.domains_per_worker = 1;
    o.worker_cpus = {cpus.back(), cpus.front()};
    for (int bad : {-1, CPU_SETSIZE + 3}) {
      EngineOptions w = o;
      w.worker_cpus = {cpus.front(), bad};
      moelink_test::expect_throw_naming<moelink::InvalidArgument>(
          [&] { TransferEngine::create(w); }, {"worker_cpus[1]", std::to_string(bad), "outside 0.."});
    }
    auto e = TransferEngine::create(o);
    // Threads pinned to one CPU: the two workers (this test runs unpinned).
    std::multiset<std::string> pinned;
    for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
      const std::string list = cpus_allowed(t.path().filename().string());
      if (list.find_first_of(",-") == std::string::npos && !list.empty()) pinned.insert(list);
    }
    if (cpus.size() > 1) {
      RANK_CHECK(pinned.count(std::to_string(cpus.back())) == 1 &&
                 pinned.count(std::to_string(cpus.front())) == 1)
          << "expected one worker on CPU " << cpus.back() << " and one on CPU " << cpus.front();
    }
    std::vector<uint8_t> src(4096), dst(4096, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(rank, i);
    auto rs = e->register_memory(src.data(), src.size());
    auto rd = e->register_memory(dst.data(), dst.size());
    auto d = exchange_descriptors(b, *e, rd);
    warm_up(*e, b, d);
    e->write(rs, 0, d[1 - rank], 0, src.size(), 5u)->wait();
    e->wait_imm(5, 1);
    for (size_t i = 0; i < dst.size(); ++i)
      if (dst[i] != pattern(1 - rank, i)) {
        RANK_FAIL() << "byte " << i << " is wrong";
        break;
      }
    b.barrier();
  }, kTimeout);
}

INSTANTIATE_TEST_SUITE_P(Providers, FabricTest, testing::Values("shm", "tcp"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
