// The worker loop: take new work, post what the transport accepts (kAgain
// keeps it queued), read completions, fail operations past their deadline,
// and sleep briefly when idle (yield mode). The transports (transport.h)
// classify their completions; the worker turns them into operation progress,
// immediate counts and received messages.
#include "fabric/worker.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <future>
#include <utility>

namespace moelink::fabric {

namespace {
// The worker's sleep while a user thread waits (and polls for it).
constexpr std::chrono::microseconds kHelpedSleep{1000};
// While user threads poll, the worker takes the endpoints at most this
// often (deadlines; completions nobody waits for): a pass of the worker
// holds the endpoints, and every one of them stalls an active user thread.
constexpr std::chrono::milliseconds kForcedPass{10};
// Completion-queue reads a submitting thread tries when the provider
// refuses a post for now, before leaving the rest to progress passes.
constexpr int kPostRetries = 64;
// try_lock attempts of a submitting thread (a progress pass is well under a
// microsecond; this is a few).
constexpr int kLockAttempts = 256;
// Destinations refusing posts in one pass before the pass stops posting.
constexpr size_t kHeldDestinations = 4;
// Sets a flag the worker reads and clears (user_posted_, user_polled_),
// writing it only when it changes: user threads set it on every post or
// pass, and each write would take the cache line from the worker.
inline void raise_flag(std::atomic<bool>& flag) {
  if (!flag.load(std::memory_order_relaxed)) flag.store(true, std::memory_order_relaxed);
}
}  // namespace

// A work request in flight: the transport's space (WrContext), the
// in-flight list links and the request itself.
struct Worker::Ctx : WrContext {
  Ctx* prev = nullptr;
  Ctx* next = nullptr;
  // Seen past its deadline (check_deadlines): its peer was marked
  // unreachable once, not on every check while it stays in the list.
  bool expired = false;
  uint64_t peer_state = 0;  // wr.peer->state() when posted
  WorkRequest wr;
};

// Receives one poll's events. On a user thread (on_worker false) the
// completion or failure of an operation with a callback is handed to the
// worker, where callbacks run.
class Worker::Sink final : public CompletionSink {
 public:
  Sink(Worker& w, bool on_worker) : w_(w), on_worker_(on_worker) {}
  bool wake = false;

  void wr_done(WrContext* ctx) override {
    Ctx* c = static_cast<Ctx*>(ctx);
    if (!on_worker_ && c->wr.op->has_callback()) {
      w_.deferred_.push_back(c);
      wake = true;
      return;
    }
    w_.unlink(c);
    c->wr.op->complete_one();
    w_.put_ctx(c);
  }
  void wr_failed(WrContext* ctx, const std::string& why, bool peer_unreachable) override {
    Ctx* c = static_cast<Ctx*>(ctx);
    if (!on_worker_ && c->wr.op->has_callback()) {
      w_.deferred_failed_.push_back({c, why, peer_unreachable});
      wake = true;
      return;
    }
    w_.finish_failed(c, why, peer_unreachable);
  }
  // Counted here and added in one step per poll (flush): one lock and one
  // wake-up for a batch of completions instead of one per write.
  void imm_arrived(uint32_t imm) override {
    for (auto& [value, n] : imms_)
      if (value == imm) {
        ++n;
        return;
      }
    imms_.emplace_back(imm, 1);
  }
  void flush() {
    if (imms_.empty()) return;
    w_.imms_.add(imms_);
    imms_.clear();
  }
  void message_arrived(const char* data, size_t len) override {
    Message m;
    m.data.assign(data, data + len);
    w_.messages_.push(std::move(m));
  }

 private:
  Worker& w_;
  const bool on_worker_;
  std::vector<std::pair<uint32_t, uint64_t>>& imms_ = scratch();
  // Reused from poll to poll (one per thread): no allocation once warm.
  static std::vector<std::pair<uint32_t, uint64_t>>& scratch() {
    thread_local std::vector<std::pair<uint32_t, uint64_t>> v;
    return v;
  }
};

void MessageQueue::push(Message m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    q_.push_back(std::move(m));
  }
  cv_.notify_all();
}

std::optional<Message> MessageQueue::pop(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return !q_.empty(); }))
    return std::nullopt;
  Message m = std::move(q_.front());
  q_.pop_front();
  return m;
}

Worker::Worker(std::vector<Nic*> nics, ImmCounters& imms, MessageQueue& messages,
               const Options& options)
    : nics_(std::move(nics)), imms_(imms), messages_(messages), options_(options) {
  // The NICs posted their receive buffers when they were opened.
  thread_ = std::thread([this] { loop(); });
  if (options_.cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(options_.cpu, &set);
    const int rc = pthread_setaffinity_np(thread_.native_handle(), sizeof(set), &set);
    if (rc != 0) {
      stop();
      throw InvalidArgument("TransferEngine: pinning a worker thread to CPU " +
                            std::to_string(options_.cpu) + " (EngineOptions::worker_cpus) failed: " +
                            std::strerror(rc) + (rc == EINVAL ? " (not in this process's cpuset)" : ""));
    }
  }
}

Worker::~Worker() {
  stop();
  release();
  for (Ctx* c : free_ctxs_) delete c;
}

namespace {
// The worker whose thread this is (null on user threads): one TLS read per
// check, where std::this_thread::get_id() is a call into libpthread.
thread_local const Worker* t_worker = nullptr;
}  // namespace

bool Worker::on_worker_thread() const { return t_worker == this; }

Worker::Ctx* Worker::get_ctx() {
  if (free_ctxs_.empty()) return new Ctx;
  Ctx* c = free_ctxs_.back();
  free_ctxs_.pop_back();
  return c;
}

void Worker::put_ctx(Ctx* c) {
  c->wr.op.reset();
  free_ctxs_.push_back(c);
}

// Appended: the list runs from the oldest post to the newest, so deadlines
// (creation + the engine's one timeout) grow along it (check_deadlines).
void Worker::link(Ctx* c) {
  c->expired = false;
  c->next = nullptr;
  c->prev = inflight_last_;
  if (inflight_last_)
    inflight_last_->next = c;
  else
    inflight_ = c;
  inflight_last_ = c;
}

void Worker::unlink(Ctx* c) {
  if (c->prev)
    c->prev->next = c->next;
  else
    inflight_ = c->next;
  if (c->next)
    c->next->prev = c->prev;
  else
    inflight_last_ = c->prev;
  c->prev = c->next = nullptr;
}

void Worker::finish_failed(Ctx* c, const std::string& why, bool peer_unreachable) {
  unlink(c);
  const std::string failure = c->wr.op->what() + ": completion error on domain " +
                              std::to_string(c->wr.nic->index()) + ": " + why;
  // Marked before the operation fails: a caller that saw the failure and
  // tries the peer again is refused at once (PeerHealth).
  if (peer_unreachable && c->wr.peer) c->wr.peer->mark_unreachable(failure, c->peer_state);
  c->wr.op->fail(std::make_exception_ptr(FabricError("TransferEngine " + failure)));
  put_ctx(c);
}

std::exception_ptr Worker::post_failure(const WorkRequest& wr) const {
  // Refused by try_post, nothing reached the NIC: the error says why (the
  // peer and its first failure) rather than "posting failed".
  if (wr.peer && wr.peer->unreachable())
    return std::make_exception_ptr(
        FabricError("TransferEngine " + wr.op->what() + ": not posted: " + last_post_error_.text));
  const std::string why = "TransferEngine " + wr.op->what() + ": posting failed on domain " +
                          std::to_string(wr.nic->index()) + ": " + last_post_error_.text;
  return last_post_error_.timeout ? std::make_exception_ptr(TimeoutError(why))
                                  : std::make_exception_ptr(FabricError(why));
}

void Worker::flush_all() {
  for (Nic* n : nics_) n->flush();
}

int Worker::poll_all(bool on_worker, bool* wake) {
  Sink sink(*this, on_worker);
  int work = 0;
  for (Nic* n : nics_) work += n->poll(sink);
  sink.flush();
  if (sink.wake) *wake = true;
  return work;
}

// Whether b goes to the same (NIC, destination) as a: a transport may then
// chain a's work request with b's into one doorbell.
static bool same_destination(const WorkRequest& a, const WorkRequest& b) {
  return a.nic == b.nic && a.dest == b.dest;
}

inline bool Worker::lock_for_direct_post(std::unique_lock<EndpointLock>& ep) {
  // Direct posting needs the endpoints (ep_mu_) and nothing queued for the
  // worker before this submission (incoming_), so that work requests are
  // posted in submission order. The worker thread itself (a callback
  // submitting) always queues.
  if (!on_worker_thread()) {
    // The holder is usually in one short progress pass (the worker's, or a
    // waiter's): wait that long rather than hand the work to the worker,
    // which costs a wake-up. Bounded, never blocking: the worker may be
    // running a callback, and a callback may wait for a lock the caller
    // holds.
    for (int attempt = 0; !ep.try_lock() && attempt < kLockAttempts; ++attempt)
      cpu_relax();
  }
  // The common case needs no mu_: the endpoints are ours and nothing is
  // queued or stopping (flags kept beside the state mu_ guards).
  return ep.owns_lock() && !stopped_ && !has_incoming_.load(std::memory_order_acquire) &&
         !stopping_.load(std::memory_order_acquire);
}


void Worker::submit(std::vector<WorkRequest>& wrs, std::shared_ptr<OpState>& op, OpMaker make) {
  std::unique_lock<EndpointLock> ep(ep_mu_, std::defer_lock);
  const bool direct = lock_for_direct_post(ep);
  submit_locked(wrs, op, make, ep, direct);
}

void Worker::submit_locked(std::vector<WorkRequest>& wrs, std::shared_ptr<OpState>& op,
                           OpMaker make, std::unique_lock<EndpointLock>& ep, bool direct) {
  struct Consumed {  // every path leaves the caller's vector empty
    std::vector<WorkRequest>& v;
    ~Consumed() { v.clear(); }
  } consumed{wrs};
  // Makes the operation and sets it on the work requests from `i` on;
  // nothing once it exists, as every request not yet posted carries it
  // from then on (an operation made by an earlier submission: from here).
  const auto give_op = [&](size_t i) {
    if (op) return;
    op = make();
    for (; i < wrs.size(); ++i) wrs[i].op = op;
  };
  if (op)
    for (auto& wr : wrs) wr.op = op;
  if (!direct) {
    give_op(0);
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) {
      for (auto& wr : wrs)
        wr.op->fail(std::make_exception_ptr(FabricError("TransferEngine " + wr.op->what() +
                                                        ": the engine is shutting down")));
      return;
    }
    if (!ep.owns_lock() || stopped_ || !incoming_.empty()) {
      for (auto& wr : wrs) incoming_.push_back(std::move(wr));
      has_incoming_.store(true, std::memory_order_release);
      if (ep.owns_lock()) ep.unlock();
      wake_.notify_one();
      return;
    }
  }
  bool wake = false;
  if (!pending_.empty()) {
    // Behind work the provider refused for now: queue after it, in order
    // (posted first, from here).
    give_op(0);
    for (auto& wr : wrs) pending_.push_back(std::move(wr));
    post_pending(false);
    wake = std::exchange(post_failed_, false);
  } else {
    // Posted here while the operation is still to be made (op null): the
    // last `unowned` contexts of the in-flight list, which get it in
    // give_all(i) with the requests from i on. No completion is read before
    // (this thread holds the endpoints and polls only after give_all).
    size_t unowned = 0;
    const auto give_all = [&](size_t i) {
      if (op) return;
      give_op(i);
      Ctx* c = inflight_last_;
      for (; unowned > 0; --unowned, c = c->prev) c->wr.op = op;
    };
    size_t i = 0;
    for (; i < wrs.size(); ++i) {
      if (op && wrs[i].op->done()) continue;  // failed meanwhile
      const bool more = i + 1 < wrs.size() && same_destination(wrs[i], wrs[i + 1]);
      PostStatus r = try_post(wrs[i], more);
      // The provider's queue is full (-FI_EAGAIN): reading completions frees
      // it, as a raw libfabric loop would do, before leaving it queued.
      if (r == PostStatus::kAgain) give_all(i);
      for (int retry = 0; r == PostStatus::kAgain && retry < kPostRetries; ++retry) {
        poll_all(false, &wake);
        r = try_post(wrs[i], more);
      }
      // Not posted (still busy, or an error): retried by the next progress
      // pass; a hard error fails the op on the worker (where callbacks
      // run), woken for it.
      if (r == PostStatus::kFailed) wake = true;
      if (r != PostStatus::kPosted) break;
      if (!op) ++unowned;
    }
    flush_all();
    give_all(i);
    for (; i < wrs.size(); ++i) pending_.push_back(std::move(wrs[i]));
  }
  ep.unlock();
  raise_flag(user_posted_);
  // Completions, and work the provider refused for now, are a waiter's
  // (progress) or the worker's next pass (at most one idle sleep away): no
  // wake-up for them, as this thread is active and a wake-up is a system
  // call. A deferred callback is the worker's; it is woken for one only
  // when no user thread waits.
  if (wake) {
    needs_worker_.store(true, std::memory_order_release);
    if (!options_.waiters || options_.waiters->load(std::memory_order_relaxed) == 0)
      wake_.notify_one();
  }
}

void Worker::submit_one(WorkRequest& wr, std::shared_ptr<OpState>& op, OpMaker make) {
  std::unique_lock<EndpointLock> ep(ep_mu_, std::defer_lock);
  const bool direct = lock_for_direct_post(ep);
  // Not behind refused work (pending_): the request would queue after it.
  if (direct && pending_.empty() && try_post(wr, false) == PostStatus::kPosted) {
    Ctx* c = inflight_last_;  // try_post appended it
    c->wr.nic->flush();
    // Made after the post (off a hop's way to the wire) and before any
    // completion is read: this thread holds the endpoints.
    op = make();
    c->wr.op = op;
    ep.unlock();
    raise_flag(user_posted_);
    return;
  }
  // Anything else, a refusal included (try_post handed the request back),
  // the general way, with the lock as it is (not tried again).
  thread_local std::vector<WorkRequest> one;  // reused: no allocation once warm
  one.push_back(std::move(wr));
  submit_locked(one, op, make, ep, direct);
}

Pass Worker::progress() {
  if (on_worker_thread()) return Pass::kIdle;
  std::unique_lock<EndpointLock> ep(ep_mu_, std::try_to_lock);
  if (!ep.owns_lock()) return Pass::kBusy;
  if (stopped_) return Pass::kIdle;
  int work = 0;
  bool wake = false;
  // Work queued while the endpoints were busy: post it from here too (a
  // waiter's pass runs often, so it looks at the flag before taking mu_).
  if (has_incoming_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      pending_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
    has_incoming_.store(false, std::memory_order_relaxed);
  }
  if (!pending_.empty()) work += post_pending(false);
  work += poll_all(false, &wake);
  raise_flag(user_polled_);
  // Callbacks and failures of ops with one run on the worker: wake it.
  // Work the provider still refuses only needs a pass: this waiter's next
  // one, or the worker's.
  wake = wake || !deferred_.empty() || !deferred_failed_.empty() || post_failed_;
  post_failed_ = false;
  ep.unlock();
  if (wake) {
    needs_worker_.store(true, std::memory_order_release);
    wake_.notify_one();
  }
  return work > 0 ? Pass::kWork : Pass::kIdle;
}

void Worker::call(const std::function<void()>& fn) {
  std::packaged_task<void()> task(fn);
  auto fut = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw FabricError("TransferEngine: the engine is shutting down");
    tasks_.emplace_back([&task] { task(); });
  }
  wake_.notify_one();
  fut.get();
}

void Worker::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stopping_.store(true, std::memory_order_release);
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<EndpointLock> ep(ep_mu_);  // waits for a user thread posting or polling
  stopped_ = true;
}

void Worker::release() {
  const auto closed = std::make_exception_ptr(
      FabricError("TransferEngine: the engine was destroyed before the operation completed"));
  std::lock_guard<EndpointLock> ep(ep_mu_);
  deferred_.clear();  // still in the in-flight list
  deferred_failed_.clear();
  while (inflight_) {
    Ctx* c = inflight_;
    unlink(c);
    c->wr.op->fail(closed);
    put_ctx(c);
  }
  for (auto& run : pending_.runs())
    for (auto& wr : run.wrs) wr.op->fail(closed);
  pending_.clear();
  std::deque<WorkRequest> incoming;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_);
  }
  for (auto& wr : incoming) wr.op->fail(closed);
}

void Worker::run_tasks() {
  std::deque<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks.swap(tasks_);
    while (!incoming_.empty()) {
      pending_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
    has_incoming_.store(false, std::memory_order_relaxed);
  }
  for (auto& t : tasks) t();
}

// The request moves into the context and, when the transport does not take
// it, back: no reference count changes hands on the hot path.
inline PostStatus Worker::try_post(WorkRequest& wr, bool more) {
  // Its peer is known unreachable: a hard posting error, reported at once,
  // instead of a post the provider refuses for now until the deadline.
  const uint64_t peer_state = wr.peer ? wr.peer->state() : 0;
  if (PeerHealth::unreachable(peer_state)) [[unlikely]] {
    last_post_error_.timeout = false;
    last_post_error_.text = wr.peer->describe();
    return PostStatus::kFailed;
  }
  Ctx* c = get_ctx();
  c->wr = std::move(wr);
  c->peer_state = peer_state;
  const PostStatus r = c->wr.nic->post(c->wr, c, more, &last_post_error_);
  if (r == PostStatus::kPosted) {
    link(c);
    return r;
  }
  wr = std::move(c->wr);
  put_ctx(c);
  return r;
}

// Queued work requests go out in order, except that one the provider
// refuses for now (-FI_EAGAIN) holds back only the later ones to the same
// destination: a peer that stopped answering (tcp reconnecting to a process
// that is gone) must not delay the writes to every other peer, which would
// then time out waiting for this rank and blame it. When kHeldDestinations
// destinations refused, the endpoint itself is full and the pass stops. On
// the worker a hard posting error fails the op; a user thread leaves that
// to the worker. The queue is walked run by run (PendingQueue): a refusal
// ends its run's turn, and later runs to a held destination are stepped
// over without looking at their requests.
int Worker::post_pending(bool on_worker) {
  int posted = 0;
  std::array<std::pair<const Nic*, uint64_t>, kHeldDestinations> held;
  size_t n_held = 0;
  auto& runs = pending_.runs();
  for (auto run = runs.begin(); run != runs.end() && n_held < kHeldDestinations;) {
    const std::pair<const Nic*, uint64_t> dest{run->nic, run->dest};
    if (std::find(held.begin(), held.begin() + n_held, dest) != held.begin() + n_held) {
      ++run;  // behind a refused request to the same destination
      continue;
    }
    std::deque<WorkRequest>& q = run->wrs;
    while (!q.empty()) {
      WorkRequest& wr = q.front();
      if (wr.op->done()) {  // failed meanwhile
        q.pop_front();
        continue;
      }
      const PostStatus r = try_post(wr, q.size() > 1);
      if (r == PostStatus::kPosted) {
        q.pop_front();
        ++posted;
      } else if (r == PostStatus::kFailed && on_worker) {
        wr.op->fail(post_failure(wr));
        q.pop_front();
      } else {
        if (r == PostStatus::kFailed) post_failed_ = true;  // the worker's to report
        // Held for this pass. kHeldDestinations held: the endpoint's queue
        // is full, not one peer's, and the rest waits for the next pass.
        held[n_held++] = dest;
        break;
      }
    }
    run = q.empty() ? pending_.erase(run) : std::next(run);
  }
  flush_all();
  return posted;
}

void Worker::check_deadlines() {
  const auto now = Clock::now();
  if (now < next_deadline_check_) return;
  next_deadline_check_ = now + std::chrono::milliseconds(2);
  // Oldest first, up to the first op still within its deadline: the ones
  // after it were posted later, so their deadlines are later too (up to
  // the few that waited in pending_ while later ones went out; those are
  // caught at most their wait late). One look, not a walk over every work
  // request in flight, on each check.
  for (Ctx* c = inflight_; c; c = c->next) {
    const auto& op = c->wr.op;
    if (now <= op->deadline()) break;
    // Looked at once: a request stays listed until its completion, which
    // may never come.
    if (std::exchange(c->expired, true)) continue;
    const std::string failure =
        op->what() + ": not complete within the engine timeout (the peer is unreachable or gone)";
    // The peer did not answer for a whole timeout: later work to it fails
    // at once (marked first, as in finish_failed).
    if (c->wr.peer) c->wr.peer->mark_unreachable(failure, c->peer_state);
    if (!op->done()) op->fail(std::make_exception_ptr(TimeoutError("TransferEngine " + failure)));
  }
  // Queued work of failed or expired operations is dropped.
  auto& runs = pending_.runs();
  for (auto run = runs.begin(); run != runs.end();) {
    std::deque<WorkRequest>& q = run->wrs;
    for (auto& wr : q) {
      if (now <= wr.op->deadline()) continue;
      // Refused "for now" for a whole timeout, as tcp;ofi_rxm does while it
      // reconnects to a process that is gone: the peer is marked (each
      // request once: it leaves the queue below), then the op fails.
      const std::string failure =
          wr.op->what() +
          ": could not be posted within the engine timeout (the provider refused it until then: "
          "the peer is unreachable, or the provider's queue stayed full)";
      if (wr.peer) wr.peer->mark_unreachable(failure, wr.peer->state());
      if (!wr.op->done())
        wr.op->fail(std::make_exception_ptr(TimeoutError("TransferEngine " + failure)));
    }
    q.erase(std::remove_if(q.begin(), q.end(), [](const WorkRequest& wr) { return wr.op->done(); }),
            q.end());
    run = q.empty() ? pending_.erase(run) : std::next(run);
  }
}

void Worker::loop() {
  t_worker = this;
  int idle = 0;
  for (;;) {
    bool own_work = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) break;
      // While a user thread waits it polls the same completion queues and
      // wakes the worker for what is the worker's (callbacks, errors, queued
      // work), so the worker sleeps then, in both polling modes: a spinning
      // worker would take a core from the waiter (or from another rank's
      // process) and bounce the endpoint lock's cache line. Cost: after the
      // last waiter returns, a completion nobody waits for may be seen up to
      // kHelpedSleep late (yield mode) or kIdleSleep late (busy mode). A
      // user thread that ran passes since the last look counts as waiting:
      // short waits (a few dozen passes) are not counted in waiters().
      const bool polled = user_polled_.exchange(false, std::memory_order_relaxed);
      const bool waiting = polled || (options_.waiters &&
                                      options_.waiters->load(std::memory_order_relaxed) > 0);
      const bool helped = user_posted_.exchange(false, std::memory_order_relaxed) || waiting;
      own_work = !incoming_.empty() || !tasks_.empty() ||
                 needs_worker_.exchange(false, std::memory_order_acq_rel);
      // Busy polling too: the endpoints are a user thread's while it posts
      // or waits (two threads in one libfabric endpoint contend on its
      // locks), so the worker polls only when no user thread is active.
      const bool sleep = helped || (options_.yield_when_idle && idle > 200);
      if (sleep && !own_work) {
        wake_.wait_for(lock, waiting && options_.yield_when_idle ? kHelpedSleep : kIdleSleep);
        own_work = !incoming_.empty() || !tasks_.empty() ||
                   needs_worker_.load(std::memory_order_acquire);
        // A user thread polled the queues since the last look and nothing
        // is the worker's: skip the pass rather than take the endpoints from
        // it (one pass every kForcedPass still reads what nobody waits for
        // and checks deadlines).
        if (!own_work && user_polled_.exchange(false, std::memory_order_relaxed) &&
            Clock::now() < forced_pass_)
          continue;
      }
    }
    // Without work of its own (tasks, queued requests, callbacks) the worker
    // only tries the endpoints, also for a forced pass: a user thread
    // holding them is posting or polling (doing the pass for it), and
    // blocking here would turn that thread's unlocks into futex wake-ups on
    // its critical path. Work the provider refused (pending_) is not the
    // worker's own: an active user thread posts it in its own passes.
    std::unique_lock<EndpointLock> ep(ep_mu_, std::defer_lock);
    if (own_work) {
      ep.lock();
    } else if (!ep.try_lock()) {
      ++idle;
      continue;
    }
    forced_pass_ = Clock::now() + kForcedPass;
    run_tasks();
    int work = 0;
    for (Ctx* c : deferred_) {  // completed while a user thread polled
      unlink(c);
      c->wr.op->complete_one();
      put_ctx(c);
      ++work;
    }
    deferred_.clear();
    for (auto& f : deferred_failed_) {  // failed while a user thread polled
      finish_failed(f.c, f.why, f.peer_unreachable);
      ++work;
    }
    deferred_failed_.clear();
    work += post_pending(true);
    bool unused = false;
    work += poll_all(true, &unused);
    check_deadlines();
    idle = work ? 0 : idle + 1;
  }
}

}  // namespace moelink::fabric
