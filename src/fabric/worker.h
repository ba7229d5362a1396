// The worker thread of one NIC group: it drives progress on the completion
// queues of its domains, completes operations and runs their callbacks.
// Everything that touches the endpoints and completion queues (posting,
// polling, the in-flight list) is under ep_mu_: the worker takes it for one
// loop iteration at a time, and a user thread that finds it free posts its
// work requests itself (submit) and, while waiting, reads completions itself
// (progress) instead of handing off to the worker and sleeping. Completions
// of operations with a callback are left to the worker, so callbacks still
// run on the worker thread. Setup tasks (call(): memory registration,
// address insertion) run on the worker thread under ep_mu_.
#pragma once

#include <rdma/fabric.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "fabric/fabric_domain.h"
#include "fabric/imm_counters.h"
#include "fabric/op_state.h"

namespace moelink::fabric {

// One RDMA write (with optional immediate) or one send.
struct WorkRequest {
  enum class Kind { kWrite, kSend } kind = Kind::kWrite;
  Domain* domain = nullptr;
  fi_addr_t dest = FI_ADDR_UNSPEC;
  void* buf = nullptr;
  size_t len = 0;
  void* desc = nullptr;
  uint64_t remote_addr = 0;
  uint64_t remote_key = 0;
  bool has_imm = false;
  uint32_t imm = 0;
  std::shared_ptr<OpState> op;
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
    size_t max_message_bytes = 4096;
    int recv_buffers = 64;
    // Engine-wide count of user threads driving progress while waiting
    // (yield mode: the worker then sleeps between passes instead of
    // spinning). May be null. Outlives the worker.
    const std::atomic<int>* waiters = nullptr;
  };
  Worker(std::vector<Domain*> domains, ImmCounters& imms, MessageQueue& messages,
         const Options& options);
  ~Worker();  // stop() + release()
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Posts from the calling thread when the endpoints are free and nothing
  // is queued before it; otherwise queues for the worker.
  void submit(std::vector<WorkRequest>&& wrs);
  // One non-blocking progress pass from a user thread (posts queued work,
  // reads completions); false when the worker holds the endpoints or there
  // was nothing to do.
  bool progress();
  // Runs fn on the worker thread and waits; rethrows what fn threw.
  void call(const std::function<void()>& fn);
  // Stops the thread. Afterwards close the endpoints, then release().
  void stop();
  // Frees the contexts of operations that never completed and fails them.
  void release();

 private:
  struct Ctx;
  struct RecvSlab;
  void loop();
  void run_tasks();
  enum class PostResult { kPosted, kAgain, kFailed };
  PostResult try_post(WorkRequest& wr);
  // Posts what it can of pending_ (see worker.cc); returns how many.
  int post_pending(bool on_worker);
  // on_worker=false (user thread): completions of ops with a callback and
  // error entries are left to the worker (*wake set).
  int poll(Domain& d, bool on_worker, bool* wake);
  Ctx* get_ctx();
  void put_ctx(Ctx* c);
  void link(Ctx* c);
  void unlink(Ctx* c);
  bool on_worker_thread() const;
  void handle_error(Domain& d);
  void repost(Ctx* rc);
  void check_deadlines();
  void fail_op(const std::shared_ptr<OpState>& op, std::exception_ptr e);

  std::vector<Domain*> domains_;
  ImmCounters& imms_;
  MessageQueue& messages_;
  Options options_;

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<WorkRequest> incoming_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  // A user thread posted directly since the worker's last pass: it is
  // active (and will wait and poll), so an idle worker sleeps instead of
  // spinning against it for cores and ep_mu_.
  std::atomic<bool> user_posted_{false};

  // Under ep_mu_ (the worker, or a user thread in submit/progress).
  std::mutex ep_mu_;
  bool stopped_ = false;
  int last_post_error_ = 0;
  std::deque<WorkRequest> pending_;
  Ctx* inflight_ = nullptr;        // intrusive doubly linked list
  std::vector<Ctx*> free_ctxs_;    // pool of contexts
  std::vector<Ctx*> deferred_;     // completed on a user thread, callback pending
  // Worker-thread only.
  std::vector<std::unique_ptr<RecvSlab>> slabs_;
  Clock::time_point next_deadline_check_{};
  std::thread thread_;
  std::thread::id thread_id_;  // thread_'s id (thread_ itself changes at join)
};

}  // namespace moelink::fabric
