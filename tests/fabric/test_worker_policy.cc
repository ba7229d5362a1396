// The worker's policies, on the real engine over fake NICs (no provider):
// hard posting errors reported at once, work a NIC refuses for a while
// posted by the worker when no user thread is there, a stuck destination
// holding back only its own writes, and deadlines over a NIC that never
// completes anything.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "fabric/engine_factory.h"
#include "fabric/transport.h"
#include "moelink/errors.h"

namespace {

using namespace moelink::fabric;
using Clock = std::chrono::steady_clock;

// count_completions adds to its counters after done() turned true, so a
// test that waited on the Transfers polls them until `want` operations are
// counted (or 5 s passed); returns the `done` count.
uint64_t counted_done(const std::atomic<uint64_t>& done, const std::atomic<uint64_t>& failed,
                      uint64_t want) {
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (done.load() + failed.load() < want && Clock::now() < until) std::this_thread::yield();
  return done.load();
}

// What the fake NICs share: memory and peers are bookkeeping only.
class FakeNic : public Nic {
 public:
  explicit FakeNic(int index) : Nic(index) {}
  const std::string& provider() const override { return name_; }
  const std::string& endpoint() const override { return name_; }
  bool hmem() const override { return false; }
  MemoryHandle register_memory(void* ptr, size_t, MemoryKind, int) override {
    MemoryHandle h;
    h.key = 1;
    h.remote_base = reinterpret_cast<uint64_t>(ptr);
    return h;
  }
  void deregister_memory(const MemoryHandle&) override {}
  uint64_t insert_peer(const std::string&, const std::string&) override { return 0; }
  void flush() override {}
  void close_endpoint() override {}

 private:
  const std::string name_ = "fake";
};

// Accepts every work request and never completes one.
class BlackHoleNic final : public FakeNic {
 public:
  using FakeNic::FakeNic;
  PostStatus post(const Wr&, WrContext*, bool, PostError*) override { return PostStatus::kPosted; }
  int poll(CompletionSink&) override { return 0; }
};

// The real engine (one domain, one worker) over fake NIC T, and a 4 KB
// registered buffer.
struct FakeEngine {
  std::vector<char> buf = std::vector<char>(4096);  // outlives the engine
  std::unique_ptr<TransferEngine> engine;
  MemoryRegion region;
  template <class T, class... Args>
  static FakeEngine make(double timeout_s, Args... args) {
    EngineOptions o;
    o.timeout_s = timeout_s;
    return make_with<T>(o, args...);
  }
  template <class T, class... Args>
  static FakeEngine make_with(EngineOptions o, Args... args) {
    o.name = "self";
    FakeEngine f;
    f.engine = create_engine_on(o, [&](int i) { return std::make_unique<T>(i, args...); });
    f.region = f.engine->register_memory(f.buf.data(), f.buf.size());
    return f;
  }
};

// Accepts what refuse() lets through; poll() completes what was accepted.
class CompletingNic : public FakeNic {
 public:
  using FakeNic::FakeNic;
  PostStatus post(const Wr& wr, WrContext* ctx, bool, PostError*) override {
    if (refuse(wr)) return PostStatus::kAgain;
    accepted_.push_back(ctx);
    return PostStatus::kPosted;
  }
  int poll(CompletionSink& sink) override {
    const int n = static_cast<int>(accepted_.size());
    for (WrContext* c : accepted_) sink.wr_done(c);
    accepted_.clear();
    return n;
  }

 protected:
  // True: kAgain for this work request (the provider's queue full for now).
  virtual bool refuse(const Wr& wr) = 0;

 private:
  std::deque<WrContext*> accepted_;
};

// Refuses the first `refusals` posts, as a full provider queue does.
class SlowNic final : public CompletingNic {
 public:
  SlowNic(int index, int refusals) : CompletingNic(index), refusals_(refusals) {}

 private:
  bool refuse(const Wr&) override {
    if (refusals_ == 0) return false;
    --refusals_;
    return true;
  }
  int refusals_;
};

// Refuses every post for good (a hard error, as a provider's -FI_EINVAL).
class FailingNic final : public FakeNic {
 public:
  using FakeNic::FakeNic;
  PostStatus post(const Wr&, WrContext*, bool, PostError* error) override {
    error->text = "no route to the peer";
    return PostStatus::kFailed;
  }
  int poll(CompletionSink&) override { return 0; }
};

// A hard posting error on a user thread is the worker's to report (where
// callbacks run): it is woken for it, so the waiter learns at once, not at
// the worker's next forced pass.
TEST(FabricWorker, HardPostingErrorsFailTheOperationAtOnce) {
  FakeEngine f = FakeEngine::make<FailingNic>(10.0);
  TransferEngine* e = f.engine.get();
  const MemoryRegion& r = f.region;
  const MemoryDescriptor d = e->descriptor(r);
  const auto t0 = Clock::now();
  for (int i = 0; i < 50; ++i) {
    try {
      e->write(r, 0, d, 0, 64, 1u)->wait(5.0);
      FAIL() << "a write the NIC refused succeeded";
    } catch (const moelink::FabricError& err) {
      const std::string m = err.what();
      EXPECT_NE(m.find("posting failed"), std::string::npos) << m;
      EXPECT_NE(m.find("no route to the peer"), std::string::npos) << m;
    }
  }
  // Each well under a forced pass (10 ms): left to the forced pass, the 50
  // would take 0.5 s and more; reported at once, a few ms in all.
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 0.3);
}

// A write the NIC refuses more often than a submitting thread retries is
// left queued; with no user thread waiting or polling, the worker posts it
// and completes it (counted, no waiter).
TEST(FabricWorker, RefusedWorkIsPostedWithoutAUserThread) {
  FakeEngine f = FakeEngine::make<SlowNic>(10.0, 1000);
  TransferEngine* e = f.engine.get();
  const MemoryRegion& r = f.region;
  const MemoryDescriptor d = e->descriptor(r);
  std::atomic<uint64_t> done{0}, failed{0};
  (void)e->write(r, 0, d, 0, 64, 1u, count_completions(done, failed));
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (done.load() == 0 && failed.load() == 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(done.load(), 1u) << "the refused write was never posted and completed";
  EXPECT_EQ(failed.load(), 0u);
}

// Refuses every other post, as a provider queue with one free slot: each
// refusal comes after an accepted post whose completion is waiting.
class AlternatingNic final : public CompletingNic {
 public:
  using CompletingNic::CompletingNic;

 private:
  bool refuse(const Wr&) override { return (++posts_ % 2) == 0; }
  uint64_t posts_ = 0;
};

// Single writes take their own path (Worker::submit_one: posted from the
// caller's request when nothing is queued) and, when the NIC refuses, fall
// back to submit(), which retries. One write at a time, each waited for
// (so nothing is queued before the next), every other post refused: the
// writes alternate between the two. Each completes once, with its own
// Transfer; then the same with 200 in flight (most of them queued).
TEST(FabricWorker, SingleWritesRefusedInTurnAreRetried) {
  FakeEngine f = FakeEngine::make<AlternatingNic>(10.0);
  TransferEngine* e = f.engine.get();
  const MemoryDescriptor d = e->descriptor(f.region);
  std::atomic<uint64_t> done{0}, failed{0};
  for (int i = 0; i < 200; ++i) {
    TransferPtr op = e->write(f.region, static_cast<uint64_t>(i) * 16, d, 0, 16, 5u,
                              count_completions(done, failed));
    ASSERT_NE(op, nullptr);
    op->wait(5.0);
  }
  EXPECT_EQ(counted_done(done, failed, 200), 200u);
  std::vector<TransferPtr> ops;
  for (int i = 0; i < 200; ++i)
    ops.push_back(e->write(f.region, static_cast<uint64_t>(i) * 16, d, 0, 16, 5u,
                           count_completions(done, failed)));
  for (auto& op : ops) {
    ASSERT_NE(op, nullptr);
    op->wait(5.0);
  }
  EXPECT_EQ(counted_done(done, failed, 400), 400u);
  EXPECT_EQ(failed.load(), 0u);
}

// A submission whose later requests are refused after earlier ones went
// out: the submitting thread reads completions before retrying, and those
// of the requests it already posted belong to the operation (made after
// the direct posts) by then. Every page is posted and completed once.
TEST(FabricWorker, RefusalsBetweenPostsOfOneOperation) {
  FakeEngine f = FakeEngine::make<AlternatingNic>(10.0);
  TransferEngine* e = f.engine.get();
  const MemoryDescriptor d = e->descriptor(f.region);
  PagedWrite p;
  p.page_bytes = 64;
  p.src_stride = p.dst_stride = 64;
  for (uint64_t i = 0; i < 32; ++i) {
    p.src_pages.push_back(i);
    p.dst_pages.push_back(31 - i);
  }
  for (int round = 0; round < 20; ++round) {
    std::atomic<uint64_t> done{0}, failed{0};
    TransferPtr op = e->paged_write(f.region, d, p, 3u, count_completions(done, failed));
    op->wait(5.0);
    EXPECT_EQ(counted_done(done, failed, 1), 1u);
    EXPECT_EQ(failed.load(), 0u);
  }
}

// Two destinations: "stuck" refuses every post for now (kAgain, as tcp
// reconnecting to a process that is gone), any other accepts.
class OneStuckPeerNic final : public CompletingNic {
 public:
  using CompletingNic::CompletingNic;
  uint64_t insert_peer(const std::string& endpoint, const std::string&) override {
    return endpoint == "stuck" ? 0 : 1;
  }

 private:
  bool refuse(const Wr& wr) override { return wr.dest == 0; }
};

// A destination that refuses holds back only its own queued requests: a
// write to another peer, queued behind hundreds to the stuck one, goes out
// and completes at once.
// A 4 KiB region of a fake peer whose name is also its endpoint.
MemoryDescriptor fake_peer(const char* name) {
  MemoryDescriptor d;
  d.owner.name = name;
  d.owner.endpoints = {name};
  d.size = 4096;
  d.remote_base = {0};
  d.keys = {1};
  return d;
}

TEST(FabricWorker, AStuckPeerHoldsBackOnlyItsOwnWrites) {
  FakeEngine f = FakeEngine::make<OneStuckPeerNic>(10.0);
  TransferEngine* e = f.engine.get();
  const MemoryRegion& r = f.region;
  const MemoryDescriptor stuck = fake_peer("stuck"), fine = fake_peer("fine");
  std::vector<TransferPtr> held;
  for (int i = 0; i < 300; ++i) held.push_back(e->write(r, 0, stuck, 0, 64, 1u));
  const auto t0 = Clock::now();
  e->write(r, 0, fine, 0, 64, 2u)->wait(5.0);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
  for (const auto& t : held) EXPECT_FALSE(t->done());
}

// Two destinations: "slow" refuses its first posts (a provider queue full
// for a while), "fast" every third. Records the order of accepted writes.
class SlowPeerNic final : public CompletingNic {
 public:
  SlowPeerNic(int index, int refusals) : CompletingNic(index), refusals_(refusals) {}
  uint64_t insert_peer(const std::string& endpoint, const std::string&) override {
    return endpoint == "slow" ? 0 : 1;
  }
  PostStatus post(const Wr& wr, WrContext* ctx, bool more, PostError* error) override {
    const PostStatus r = CompletingNic::post(wr, ctx, more, error);
    if (r == PostStatus::kPosted) accepted.emplace_back(wr.dest, wr.remote_addr);
    return r;
  }
  std::vector<std::pair<uint64_t, uint64_t>> accepted;  // (destination, remote address)

 private:
  bool refuse(const Wr& wr) override {
    if (wr.dest != 0) return ++fast_posts_ % 3 == 0;
    if (refusals_ == 0) return false;
    --refusals_;
    return true;
  }
  int refusals_;
  uint64_t fast_posts_ = 0;
};

// Queued work is kept in runs per destination (PendingQueue): writes to
// two peers, interleaved, while one of them refuses for a while and the
// other now and then (the first one's runs are stepped over, and merged as
// the other's runs between them go out). Each destination's writes go out
// in the order they were made, and each once.
TEST(FabricWorker, QueuedWritesKeepTheirOrderPerDestination) {
  std::vector<char> buf(4096);
  SlowPeerNic* nic = nullptr;
  EngineOptions o;
  o.name = "self";
  o.timeout_s = 10.0;
  auto engine = create_engine_on(o, [&](int i) {
    auto n = std::make_unique<SlowPeerNic>(i, 2000);  // more than a submission's retries
    nic = n.get();
    return n;
  });
  const MemoryRegion region = engine->register_memory(buf.data(), buf.size());
  const MemoryDescriptor slow = fake_peer("slow"), fast = fake_peer("fast");
  // Runs of 1, 2, 3, 4, 1, ... writes to one peer, then the other; write i
  // goes to remote address i * 8.
  std::vector<TransferPtr> ops;
  std::vector<uint64_t> to_slow, to_fast;
  bool to_slow_now = true;
  for (uint64_t i = 0, run = 0; i < 400; ++run, to_slow_now = !to_slow_now)
    for (uint64_t k = 0; k <= run % 4 && i < 400; ++k, ++i) {
      ops.push_back(engine->write(region, 0, to_slow_now ? slow : fast, i * 8, 8, 1u));
      (to_slow_now ? to_slow : to_fast).push_back(i * 8);
    }
  for (auto& op : ops) op->wait(5.0);
  std::vector<uint64_t> got_slow, got_fast;
  for (const auto& [dest, addr] : nic->accepted) (dest == 0 ? got_slow : got_fast).push_back(addr);
  EXPECT_EQ(got_slow, to_slow) << "the slow peer's writes out of order, lost or repeated";
  EXPECT_EQ(got_fast, to_fast) << "the fast peer's writes out of order, lost or repeated";
}

TEST(FabricWorker, EachOperationTimesOutAtItsOwnDeadline) {
  FakeEngine f = FakeEngine::make<BlackHoleNic>(0.4);
  TransferEngine* e = f.engine.get();
  const MemoryRegion& r = f.region;
  const MemoryDescriptor d = e->descriptor(r);
  // Three writes 150 ms apart, then one more right away: all in flight,
  // none ever completing.
  std::vector<TransferPtr> ops;
  std::vector<Clock::time_point> posted;
  for (int i = 0; i < 3; ++i) {
    posted.push_back(Clock::now());
    ops.push_back(e->write(r, 0, d, 0, 64, 1u));
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    try {
      ops[i]->wait(5.0);
      FAIL() << "write " << i << " completed on a NIC that completes nothing";
    } catch (const moelink::TimeoutError& err) {
      const double after = std::chrono::duration<double>(Clock::now() - posted[i]).count();
      EXPECT_NE(std::string(err.what()).find("engine timeout"), std::string::npos) << err.what();
      // At its own deadline: not before it, and not held back until a
      // later op's (each is 150 ms after the one before: 0.7 s and more).
      EXPECT_GE(after, 0.38) << "write " << i;
      EXPECT_LT(after, 0.6) << "write " << i;
    }
  }
}

// Operations may outlive the engine, also while a thread waits on one: the
// engine's destruction fails what is still in flight, and the waiter (which
// drives progress itself and, busy-polling, never sleeps) lets go of the
// engine's passes often enough that the destruction does not wait for the
// wait's own timeout. Afterwards the Transfer still answers.
TEST(FabricWorker, DestroyingTheEngineEndsAWaitOnItsOperation) {
  for (const bool yield : {true, false}) {
    SCOPED_TRACE(yield ? "yield when idle" : "busy polling");
    EngineOptions o;
    o.timeout_s = 60;  // no deadline during the test
    o.yield_when_idle = yield;
    FakeEngine f = FakeEngine::make_with<BlackHoleNic>(o);
    const MemoryDescriptor d = f.engine->descriptor(f.region);
    const TransferPtr op = f.engine->write(f.region, 0, d, 0, 64, 1u);
    std::string error;
    std::thread waiter([&] {
      try {
        op->wait(20.0);
        error = "the wait returned";
      } catch (const moelink::Error& err) {
        error = err.what();
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // in its loop
    const auto t0 = Clock::now();
    f.engine.reset();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    waiter.join();
    EXPECT_LT(s, 2.0) << "the destruction waited for the wait";
    EXPECT_NE(error.find("destroyed before the operation completed"), std::string::npos) << error;
    EXPECT_TRUE(op->done());
    EXPECT_THROW(op->wait(0.0), moelink::FabricError);
  }
}

// The message of an operation's error ("" when it succeeded).
std::string error_of(const TransferPtr& t) {
  try {
    t->wait(5.0);
    return "";
  } catch (const moelink::Error& err) {
    return err.what();
  }
}

// Destinations by endpoint: "gone" fails what it was sent with a broken
// connection (peer_unreachable), "bad" with an error of the request alone
// (a wrong key: the peer is fine), any other completes. poll() hands out at
// most `budget` completions, so a test can hold them back.
class BrokenPeerNic final : public FakeNic {
 public:
  static constexpr uint64_t kFine = 0, kGone = 1, kBad = 2;
  using FakeNic::FakeNic;
  std::atomic<int> posts_to_gone{0};
  std::atomic<int> budget{1 << 30};
  uint64_t insert_peer(const std::string& endpoint, const std::string&) override {
    return endpoint == "gone" ? kGone : endpoint == "bad" ? kBad : kFine;
  }
  PostStatus post(const Wr& wr, WrContext* ctx, bool, PostError*) override {
    if (wr.dest == kGone) ++posts_to_gone;
    accepted_.emplace_back(ctx, wr.dest);
    return PostStatus::kPosted;
  }
  int poll(CompletionSink& sink) override {
    int n = 0;
    for (; !accepted_.empty() && budget.load() > 0; ++n, --budget) {
      const auto [c, dest] = accepted_.front();
      accepted_.pop_front();
      if (dest == kGone)
        sink.wr_failed(c, "Connection reset by peer", /*peer_unreachable=*/true);
      else if (dest == kBad)
        sink.wr_failed(c, "Invalid key", /*peer_unreachable=*/false);
      else
        sink.wr_done(c);
    }
    return n;
  }

 private:
  std::deque<std::pair<WrContext*, uint64_t>> accepted_;
};

// The real engine (one domain) over a BrokenPeerNic, which it keeps.
struct BrokenPeerEngine {
  std::vector<char> buf = std::vector<char>(4096);  // outlives the engine
  BrokenPeerNic* nic = nullptr;
  std::unique_ptr<TransferEngine> engine;
  MemoryRegion region;
  explicit BrokenPeerEngine(double timeout_s) {
    EngineOptions o;
    o.name = "self";
    o.timeout_s = timeout_s;
    engine = create_engine_on(o, [&](int i) {
      auto n = std::make_unique<BrokenPeerNic>(i);
      nic = n.get();
      return n;
    });
    region = engine->register_memory(buf.data(), buf.size());
  }
};

// Once a write to a peer failed with a broken connection, every operation
// to it (write, paged write, send, a barrier of a group made afterwards)
// fails at once, well within the engine's 10 s, without reaching the NIC,
// naming the peer and that first failure; a counted write is counted
// failed. Other peers are unaffected, and an error of one request ("bad":
// a wrong key) does not make its peer unreachable.
TEST(FabricWorker, APeerKnownUnreachableFailsAtOnce) {
  BrokenPeerEngine f(10.0);
  TransferEngine* e = f.engine.get();
  const MemoryRegion& r = f.region;
  const MemoryDescriptor gone = fake_peer("gone"), bad = fake_peer("bad"), fine = fake_peer("fine");
  const PeerId gone_id = e->add_peer(gone.owner);
  const std::string first = error_of(e->write(r, 0, gone, 0, 64, 1u));
  EXPECT_NE(first.find("write to peer 'gone'"), std::string::npos) << first;
  EXPECT_NE(first.find("Connection reset by peer"), std::string::npos) << first;
  ASSERT_EQ(f.nic->posts_to_gone.load(), 1);

  PagedWrite p;
  p.page_bytes = 64;
  p.src_stride = p.dst_stride = 64;
  p.src_pages = p.dst_pages = {0, 1, 2};
  const GroupId group = e->add_peer_group({fine, gone});
  std::atomic<uint64_t> done{0}, failed{0};
  const auto t0 = Clock::now();
  const std::vector<std::pair<const char*, TransferPtr>> ops = {
      {"write to peer 'gone'", e->write(r, 0, gone, 0, 64, 1u)},
      {"paged_write to peer 'gone'", e->paged_write(r, gone, p, 1u)},
      {"send to peer 'gone'", e->send(gone_id, r, 0, 64)},
      {"barrier (group 0)", e->barrier(group, 2u)},
      {"write to peer 'gone'", e->write(r, 0, gone, 0, 64, 1u, count_completions(done, failed))}};
  for (const auto& [what, op] : ops) {
    const std::string m = error_of(op);
    EXPECT_NE(m.find(what), std::string::npos) << m;
    EXPECT_NE(m.find("peer 'gone' (peer " + std::to_string(gone_id) + ") is unreachable"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("(write to peer 'gone' (peer " + std::to_string(gone_id) +
                     "): completion error on domain 0: Connection reset by peer)"),
              std::string::npos)
        << "the first failure is not named: " << m;
  }
  EXPECT_EQ(counted_done(done, failed, 1), 0u);
  EXPECT_EQ(failed.load(), 1u);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
  EXPECT_EQ(f.nic->posts_to_gone.load(), 1) << "work to a peer known unreachable reached the NIC";

  EXPECT_EQ(error_of(e->write(r, 0, fine, 0, 64, 3u)), "");
  for (int i = 0; i < 2; ++i) {
    const std::string m = error_of(e->write(r, 0, bad, 0, 64, 4u));
    EXPECT_NE(m.find("completion error on domain 0: Invalid key"), std::string::npos) << m;
  }
}

// add_peer of a peer known unreachable clears that: its next operation goes
// to the NIC again. A work request posted before, failing afterwards, is
// about the connection add_peer gave up on and does not mark it again.
TEST(FabricWorker, AddingAPeerAgainRetriesIt) {
  BrokenPeerEngine f(10.0);
  TransferEngine* e = f.engine.get();
  const MemoryRegion& r = f.region;
  const MemoryDescriptor gone = fake_peer("gone");
  f.nic->budget = 0;  // both in flight, their failures held back
  const TransferPtr a = e->write(r, 0, gone, 0, 64, 1u), b = e->write(r, 0, gone, 0, 64, 1u);
  // The worker posts asynchronously: release a's failure only once b is
  // posted too, or b would meet a peer already marked unreachable.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (f.nic->posts_to_gone.load() < 2 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(f.nic->posts_to_gone.load(), 2) << "the two writes did not reach the NIC";
  f.nic->budget = 1;
  EXPECT_NE(error_of(a).find("Connection reset by peer"), std::string::npos);
  EXPECT_NE(error_of(e->write(r, 0, gone, 0, 64, 1u)).find("is unreachable"), std::string::npos);
  EXPECT_EQ(f.nic->posts_to_gone.load(), 2);
  e->add_peer(gone.owner);
  f.nic->budget = 1;
  EXPECT_NE(error_of(b).find("Connection reset by peer"), std::string::npos);
  f.nic->budget = 1 << 30;
  const std::string m = error_of(e->write(r, 0, gone, 0, 64, 1u));
  EXPECT_EQ(f.nic->posts_to_gone.load(), 3) << "the write after add_peer did not reach the NIC";
  EXPECT_NE(m.find("completion error on domain 0: Connection reset by peer"), std::string::npos)
      << m;
  EXPECT_EQ(m.find("is unreachable"), std::string::npos) << m;
}

// Destinations by endpoint: "silent" accepts and never completes (a hung
// peer, shm to a process that is gone), "refusing" refuses every post for
// now (tcp;ofi_rxm reconnecting to a process that is gone), any other
// completes. Counts what reaches it for "silent".
class SilentPeerNic final : public CompletingNic {
 public:
  using CompletingNic::CompletingNic;
  std::atomic<int> posts_to_silent{0};
  uint64_t insert_peer(const std::string& endpoint, const std::string&) override {
    return endpoint == "silent" ? 1 : endpoint == "refusing" ? 2 : 0;
  }
  PostStatus post(const Wr& wr, WrContext* ctx, bool more, PostError* error) override {
    if (wr.dest != 1) return CompletingNic::post(wr, ctx, more, error);
    ++posts_to_silent;
    return PostStatus::kPosted;
  }

 private:
  bool refuse(const Wr& wr) override { return wr.dest == 2; }
};

// A write not complete, or not even posted, within the engine timeout makes
// its peer unreachable: the next write to it fails at once (not after
// another timeout, blaming a busy provider), naming the peer and the
// timeout; other peers are unaffected.
TEST(FabricWorker, APeerThatTimedOutFailsAtOnce) {
  std::vector<char> buf(4096);
  SilentPeerNic* nic = nullptr;
  EngineOptions o;
  o.name = "self";
  o.timeout_s = 0.5;
  auto e = create_engine_on(o, [&](int i) {
    auto n = std::make_unique<SilentPeerNic>(i);
    nic = n.get();
    return n;
  });
  const MemoryRegion r = e->register_memory(buf.data(), buf.size());
  for (const char* name : {"silent", "refusing"}) {
    SCOPED_TRACE(name);
    const MemoryDescriptor peer = fake_peer(name);
    const std::string first = error_of(e->write(r, 0, peer, 0, 64, 1u));
    EXPECT_NE(first.find("within the engine timeout"), std::string::npos) << first;
    const auto t0 = Clock::now();
    const std::string next = error_of(e->write(r, 0, peer, 0, 64, 1u));
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 0.25) << next;
    EXPECT_NE(next.find("peer '" + std::string(name) + "'"), std::string::npos) << next;
    EXPECT_NE(next.find("is unreachable"), std::string::npos) << next;
    EXPECT_NE(next.find(first.substr(first.find("): ") + 3)), std::string::npos)
        << "the timeout is not named: " << next;
    EXPECT_EQ(next.find("busy"), std::string::npos) << next;
  }
  EXPECT_EQ(nic->posts_to_silent.load(), 1);
  EXPECT_EQ(error_of(e->write(r, 0, fake_peer("fine"), 0, 64, 2u)), "");
}

}  // namespace
