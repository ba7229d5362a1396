// The worker thread of one NIC group: it alone posts work requests to and
// polls the completion queues of its domains. User threads hand it work
// through submit() (work requests) and call() (setup tasks such as memory
// registration, which must not race with posting).
#pragma once

#include <rdma/fabric.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_set>
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
  };
  Worker(std::vector<Domain*> domains, ImmCounters& imms, MessageQueue& messages,
         const Options& options);
  ~Worker();  // stop() + release()
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void submit(std::vector<WorkRequest>&& wrs);
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
  bool post(WorkRequest& wr);  // false: -FI_EAGAIN, retry later
  int poll(Domain& d);
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

  // Worker-thread only.
  std::deque<WorkRequest> pending_;
  std::unordered_set<Ctx*> inflight_;
  std::vector<std::unique_ptr<RecvSlab>> slabs_;
  Clock::time_point next_deadline_check_{};
  std::thread thread_;
};

}  // namespace moelink::fabric
