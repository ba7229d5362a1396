// The worker thread of one NIC group: it drives progress on the completion
// queues of its NICs (transport.h: libfabric domains or verbs NICs, the
// worker does not know which), completes operations and runs their callbacks.
// Everything that touches the endpoints and completion queues (posting,
// polling, the in-flight list) is under ep_mu_: the worker takes it for one
// loop iteration at a time, and a user thread that finds it free posts its
// work requests itself (submit) and, while waiting, reads completions itself
// (progress) instead of handing off to the worker and sleeping. Completions
// of operations with a callback are left to the worker, so callbacks still
// run on the worker thread. Setup tasks (call(): memory registration,
// address insertion) run on the worker thread under ep_mu_.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fabric/imm_counters.h"
#include "fabric/op_state.h"
#include "fabric/transport.h"

namespace moelink::fabric {

// The lock on a worker's endpoints. Held for one progress pass or one
// submission (a microsecond or so), and tried by every pass of every
// waiter: a test-and-set lock rather than std::mutex, whose unlock is
// another atomic exchange and a check for sleepers. Nobody sleeps on it:
// the few that must have it (the worker with work of its own, stop)
// spin, then yield, for the length of a pass; a user thread only tries it.
class EndpointLock {
 public:
  bool try_lock() {
    // A read first: a locked lock's cache line stays shared while tried.
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void lock() {
    for (int i = 0; !try_lock(); ++i) {
      if (i < 64)
        cpu_relax();
      else
        std::this_thread::yield();
    }
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

// Makes an operation's state: a reference to the caller's callable, not a
// copy (a std::function of a lambda with several captures allocates).
class OpMaker {
 public:
  template <class F>
  explicit OpMaker(F& f)
      : f_(&f), call_([](void* g) -> std::shared_ptr<OpState> { return (*static_cast<F*>(g))(); }) {}
  std::shared_ptr<OpState> operator()() const { return call_(f_); }

 private:
  void* f_;
  std::shared_ptr<OpState> (*call_)(void*);
};

// Whether a peer is known to be unreachable, and since which failure. The
// worker marks it when a work request to the peer fails with an error that
// says so (a broken connection, CompletionSink::wr_failed) or is not
// complete, or not even posted, by its deadline; from then on work requests
// to the peer fail at once, without going to the NIC: tcp;ofi_rxm refuses
// posts to a process that is gone "for now" without end, so each would
// otherwise wait out the engine timeout and blame a busy provider.
// TransferEngine::add_peer of the peer's address clears it. Written and
// read by the workers of every NIC group the peer is reached through.
class PeerHealth {
 public:
  explicit PeerHealth(std::string who) : who_(std::move(who)) {}
  // Bit 0: unreachable; the rest counts clear()s. One load on every post.
  uint64_t state() const { return state_.load(std::memory_order_acquire); }
  static bool unreachable(uint64_t state) { return (state & 1) != 0; }
  bool unreachable() const { return unreachable(state()); }
  // Marks it as of `seen`, the state when the failed work request was
  // posted: not when it was cleared since (the failure is about the
  // connection before add_peer) or is marked already (the first failure is
  // kept: later ones are its consequences).
  void mark_unreachable(const std::string& failure, uint64_t seen) {
    std::lock_guard<std::mutex> lock(mu_);
    if (unreachable(seen) || state_.load(std::memory_order_relaxed) != seen) return;
    failure_ = failure;
    state_.store(seen | 1, std::memory_order_release);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    state_.store((state_.load(std::memory_order_relaxed) | 1) + 1, std::memory_order_release);
    failure_.clear();
  }
  // Why work to the peer is not posted: the peer and its first failure.
  std::string describe() const {
    std::lock_guard<std::mutex> lock(mu_);
    return who_ + " is unreachable since an earlier operation to it failed (" + failure_ +
           "); add_peer with its address again to retry it";
  }

 private:
  const std::string who_;  // "peer 'rank1' (peer 0)"
  std::atomic<uint64_t> state_{0};
  mutable std::mutex mu_;
  std::string failure_;  // under mu_
};

// One RDMA write (with optional immediate) or one send: the transport's
// work request plus the NIC it goes out on, the operation it belongs to and
// its peer's health (null: not tracked).
struct WorkRequest : Wr {
  Nic* nic = nullptr;
  std::shared_ptr<OpState> op;
  PeerHealth* peer = nullptr;
};

// Work requests the provider refused for now, in posting order, kept as
// runs of consecutive requests to one (NIC, destination): a progress pass
// steps over a destination that refuses in one step, not one request at a
// time (thousands of KV-cache pages queued to one peer were walked on
// every pass).
class PendingQueue {
 public:
  struct Run {
    const Nic* nic;
    uint64_t dest;
    std::deque<WorkRequest> wrs;  // never empty while in the queue
  };
  bool empty() const { return runs_.empty(); }
  void push_back(WorkRequest&& wr) {
    if (runs_.empty() || runs_.back().nic != wr.nic || runs_.back().dest != wr.dest)
      runs_.push_back(Run{wr.nic, wr.dest, {}});
    runs_.back().wrs.push_back(std::move(wr));
  }
  std::deque<Run>& runs() { return runs_; }
  // Removes an emptied run and returns the one after it. When the runs
  // around it go to one destination they become one, in order (the
  // shorter one's requests move), so that runs next to each other always
  // go to different destinations.
  std::deque<Run>::iterator erase(std::deque<Run>::iterator run) {
    run = runs_.erase(run);
    if (run == runs_.begin() || run == runs_.end()) return run;
    Run& before = *std::prev(run);
    if (before.nic != run->nic || before.dest != run->dest) return run;
    if (before.wrs.size() < run->wrs.size()) {
      for (auto it = before.wrs.rbegin(); it != before.wrs.rend(); ++it)
        run->wrs.push_front(std::move(*it));
      return std::next(runs_.erase(std::prev(run)));
    }
    for (auto& wr : run->wrs) before.wrs.push_back(std::move(wr));
    return runs_.erase(run);
  }
  void clear() { runs_.clear(); }

 private:
  std::deque<Run> runs_;
};

// Received two-sided messages, in arrival order.
class MessageQueue {
 public:
  void push(Message m);
  std::optional<Message> pop(double timeout_s);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Message> q_;
};

class Worker {
 public:
  struct Options {
    bool yield_when_idle = true;
    // Engine-wide count of user threads driving progress while waiting
    // (yield mode: the worker then sleeps between passes instead of
    // spinning). May be null. Outlives the worker.
    const std::atomic<int>* waiters = nullptr;
    int cpu = -1;  // pin the thread to this CPU (-1: not pinned)
  };
  Worker(std::vector<Nic*> nics, ImmCounters& imms, MessageQueue& messages,
         const Options& options);
  ~Worker();  // stop() + release()
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Posts from the calling thread when the endpoints are free and nothing
  // is queued before it; otherwise queues for the worker.
  // Takes the work requests out of `wrs` (left empty, its capacity kept for
  // the caller's next call). Their operation is `op`; when it is null,
  // make() creates it, after the work requests that could be posted
  // directly went out: the operation's allocation is then not on the way
  // to the wire (a ping-pong hop's latency). `op` holds it afterwards.
  void submit(std::vector<WorkRequest>& wrs, std::shared_ptr<OpState>& op, OpMaker make);
  // submit() of one work request (a write, a send): posted straight from
  // the caller's request when the endpoints are free and nothing waits
  // before it, without the vector, the loop and its bookkeeping; anything
  // else (endpoints busy, work queued, the provider refusing) goes
  // submit()'s way, without trying the lock again. `wr` is consumed.
  void submit_one(WorkRequest& wr, std::shared_ptr<OpState>& op, OpMaker make);
  // One non-blocking progress pass from a user thread (posts queued work,
  // reads completions); kBusy when another thread holds the endpoints.
  Pass progress();
  // Runs fn on the worker thread and waits; rethrows what fn threw.
  void call(const std::function<void()>& fn);
  // Stops the thread. Afterwards close the endpoints, then release().
  void stop();
  // Frees the contexts of operations that never completed and fails them.
  void release();

 private:
  struct Ctx;
  class Sink;
  void loop();
  void run_tasks();
  // Tries the endpoint lock (bounded; never on the worker thread) and says
  // whether work may be posted from this thread: the lock held and nothing
  // queued for the worker or stopping.
  bool lock_for_direct_post(std::unique_lock<EndpointLock>& ep);
  // submit() once lock_for_direct_post(ep) returned `direct`.
  void submit_locked(std::vector<WorkRequest>& wrs, std::shared_ptr<OpState>& op, OpMaker make,
                     std::unique_lock<EndpointLock>& ep, bool direct);
  // `more`: the next work request goes to the same destination (the
  // transport may chain them into one doorbell).
  PostStatus try_post(WorkRequest& wr, bool more);
  // Posts what it can of pending_ (see worker.cc); returns how many.
  int post_pending(bool on_worker);
  // One poll of every NIC. on_worker=false (user thread): completions and
  // failures of ops with a callback are left to the worker (wake set).
  int poll_all(bool on_worker, bool* wake);
  void flush_all();
  Ctx* get_ctx();
  void put_ctx(Ctx* c);
  void link(Ctx* c);
  void unlink(Ctx* c);
  bool on_worker_thread() const;
  void finish_failed(Ctx* c, const std::string& why, bool peer_unreachable);
  // The error of a work request whose post failed (last_post_error_).
  std::exception_ptr post_failure(const WorkRequest& wr) const;
  void check_deadlines();

  std::vector<Nic*> nics_;
  ImmCounters& imms_;
  MessageQueue& messages_;
  Options options_;

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<WorkRequest> incoming_;
  std::atomic<bool> has_incoming_{false};  // !incoming_.empty(), readable without mu_
  // A user thread's pass left something to the worker (deferred callbacks
  // or errors).
  std::atomic<bool> needs_worker_{false};
  // A user thread ran a progress pass since the worker last looked.
  std::atomic<bool> user_polled_{false};
  Clock::time_point forced_pass_{};  // worker thread: a pass is due by then
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};  // stop_, readable without mu_
  // A user thread posted directly since the worker's last pass: it is
  // active (and will wait and poll), so an idle worker sleeps instead of
  // spinning against it for cores and ep_mu_.
  std::atomic<bool> user_posted_{false};

  // Under ep_mu_ (the worker, or a user thread in submit/progress).
  EndpointLock ep_mu_;
  bool stopped_ = false;
  PostError last_post_error_;
  PendingQueue pending_;
  // A user thread's pass met a hard posting error in pending_ (the worker
  // fails the op, where callbacks run; it is woken for that).
  bool post_failed_ = false;
  // In-flight work requests, an intrusive doubly linked list in posting
  // order (oldest first).
  Ctx* inflight_ = nullptr;
  Ctx* inflight_last_ = nullptr;
  std::vector<Ctx*> free_ctxs_;    // pool of contexts
  std::vector<Ctx*> deferred_;     // completed on a user thread, callback pending
  struct DeferredFailure {
    Ctx* c;
    std::string why;
    bool peer_unreachable;
  };
  std::vector<DeferredFailure> deferred_failed_;  // failed there, likewise
  // Worker-thread only.
  Clock::time_point next_deadline_check_{};
  std::thread thread_;
};

}  // namespace moelink::fabric
