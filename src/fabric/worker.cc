// The worker loop: take new work, post what the provider accepts (-FI_EAGAIN
// keeps it queued), read completions, fail operations past their deadline,
// and sleep briefly when idle (yield mode).
//
// Completion classification (never by length): an entry with FI_REMOTE_WRITE
// is a peer's write carrying an immediate (counted; under FI_RX_CQ_DATA it
// consumed a posted receive, which is reposted); an entry with FI_RECV is a
// two-sided message; anything else is one of our own work requests, found
// through its context.
#include "fabric/worker.h"

#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <cstring>
#include <future>

namespace moelink::fabric {

namespace {
constexpr std::chrono::microseconds kHelpedSleep{1000};
}  // namespace

struct Worker::Ctx {
  fi_context2 fi;  // first: libfabric's FI_CONTEXT2 space
  bool is_recv = false;
  // in-flight list links (own work requests)
  Ctx* prev = nullptr;
  Ctx* next = nullptr;
  // own work requests
  WorkRequest wr;
  // receive buffers
  Domain* domain = nullptr;
  char* buf = nullptr;
  void* desc = nullptr;
};

struct Worker::RecvSlab {
  Domain* domain = nullptr;
  std::vector<char> memory;
  Domain::Mr mr;
  std::vector<Ctx> ctxs;
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

Worker::Worker(std::vector<Domain*> domains, ImmCounters& imms, MessageQueue& messages,
               const Options& options)
    : domains_(std::move(domains)), imms_(imms), messages_(messages), options_(options) {
  // Receive buffers, posted before the thread starts (nothing else touches
  // the endpoints yet).
  for (Domain* d : domains_) {
    auto slab = std::make_unique<RecvSlab>();
    slab->domain = d;
    const size_t n = static_cast<size_t>(options_.recv_buffers);
    slab->memory.resize(n * options_.max_message_bytes);
    slab->mr = d->register_memory(slab->memory.data(), slab->memory.size(), MemoryKind::kHost, 0);
    slab->ctxs.resize(n);
    for (size_t i = 0; i < n; ++i) {
      Ctx& c = slab->ctxs[i];
      c.is_recv = true;
      c.domain = d;
      c.buf = slab->memory.data() + i * options_.max_message_bytes;
      c.desc = slab->mr.desc;
    }
    slabs_.push_back(std::move(slab));
    for (auto& c : slabs_.back()->ctxs) repost(&c);
  }
  thread_ = std::thread([this] { loop(); });
  thread_id_ = thread_.get_id();
}

Worker::~Worker() {
  stop();
  release();
  for (Ctx* c : free_ctxs_) delete c;
}

bool Worker::on_worker_thread() const { return std::this_thread::get_id() == thread_id_; }

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

void Worker::link(Ctx* c) {
  c->prev = nullptr;
  c->next = inflight_;
  if (inflight_) inflight_->prev = c;
  inflight_ = c;
}

void Worker::unlink(Ctx* c) {
  if (c->prev)
    c->prev->next = c->next;
  else
    inflight_ = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = c->next = nullptr;
}

void Worker::repost(Ctx* c) {
  for (;;) {
    const ssize_t rc =
        fi_recv(c->domain->ep(), c->buf, options_.max_message_bytes, c->desc, FI_ADDR_UNSPEC, &c->fi);
    if (rc == 0) return;
    if (rc != -FI_EAGAIN) check_fi(static_cast<int>(rc), "TransferEngine: fi_recv");
    fi_cq_data_entry e[1];
    (void)fi_cq_read(c->domain->cq(), e, 0);  // progress
  }
}

void Worker::submit(std::vector<WorkRequest>&& wrs) {
  // Direct posting needs the endpoints (ep_mu_) and nothing queued before
  // this submission (incoming_, pending_), so that work requests are posted
  // in submission order. The worker thread itself (a callback submitting)
  // always queues.
  std::unique_lock<std::mutex> ep(ep_mu_, std::defer_lock);
  if (!on_worker_thread()) (void)ep.try_lock();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) {
      for (auto& wr : wrs)
        wr.op->fail(std::make_exception_ptr(FabricError("TransferEngine " + wr.op->what() +
                                                        ": the engine is shutting down")));
      return;
    }
    if (!ep.owns_lock() || stopped_ || !incoming_.empty() || !pending_.empty()) {
      for (auto& wr : wrs) incoming_.push_back(std::move(wr));
      if (ep.owns_lock()) ep.unlock();
      wake_.notify_one();
      return;
    }
  }
  size_t i = 0;
  for (; i < wrs.size(); ++i) {
    if (wrs[i].op->done()) continue;  // failed meanwhile
    // Not posted (busy provider or an error): the worker retries and, on a
    // hard error, fails the op on its thread (where callbacks run).
    if (try_post(wrs[i]) != PostResult::kPosted) break;
  }
  const bool queued = i < wrs.size();
  for (; i < wrs.size(); ++i) pending_.push_back(std::move(wrs[i]));
  ep.unlock();
  user_posted_.store(true, std::memory_order_relaxed);
  // Completions are read by a waiter (progress) or by the worker's next pass
  // (at most one idle sleep away); queued work needs the worker now.
  if (queued) wake_.notify_one();
}

bool Worker::progress() {
  if (on_worker_thread()) return false;
  std::unique_lock<std::mutex> ep(ep_mu_, std::try_to_lock);
  if (!ep.owns_lock() || stopped_) return false;
  int work = 0;
  bool wake = false;
  {  // work queued while the endpoints were busy: post it from here too
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      pending_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
  }
  work += post_pending(false);
  for (Domain* d : domains_) work += poll(*d, false, &wake);
  if (!pending_.empty() || !deferred_.empty()) wake = true;
  ep.unlock();
  if (wake) wake_.notify_one();
  return work > 0;
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
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> ep(ep_mu_);  // waits for a user thread posting or polling
  stopped_ = true;
}

void Worker::release() {
  const auto closed = std::make_exception_ptr(
      FabricError("TransferEngine: the engine was destroyed before the operation completed"));
  std::lock_guard<std::mutex> ep(ep_mu_);
  deferred_.clear();  // still in the in-flight list
  while (inflight_) {
    Ctx* c = inflight_;
    unlink(c);
    c->wr.op->fail(closed);
    put_ctx(c);
  }
  for (auto& wr : pending_) wr.op->fail(closed);
  pending_.clear();
  std::deque<WorkRequest> incoming;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_);
  }
  for (auto& wr : incoming) wr.op->fail(closed);
  for (auto& s : slabs_) Domain::close_mr(s->mr);
  slabs_.clear();
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
  }
  for (auto& t : tasks) t();
}

Worker::PostResult Worker::try_post(WorkRequest& wr) {
  Ctx* c = get_ctx();
  c->wr = wr;
  ssize_t rc;
  if (wr.kind == WorkRequest::Kind::kWrite) {
    // WR template: one local iov, one remote iov, the immediate as CQ data.
    iovec iov{wr.buf, wr.len};
    fi_rma_iov riov{wr.remote_addr, wr.len, wr.remote_key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &wr.desc;
    msg.iov_count = 1;
    msg.addr = wr.dest;
    msg.rma_iov = &riov;
    msg.rma_iov_count = 1;
    msg.context = &c->fi;
    msg.data = wr.imm;
    rc = fi_writemsg(wr.domain->ep(), &msg, FI_COMPLETION | (wr.has_imm ? FI_REMOTE_CQ_DATA : 0));
  } else {
    rc = fi_send(wr.domain->ep(), wr.buf, wr.len, wr.desc, wr.dest, &c->fi);
  }
  if (rc == 0) {
    link(c);
    return PostResult::kPosted;
  }
  put_ctx(c);
  if (rc == -FI_EAGAIN) return PostResult::kAgain;
  last_post_error_ = static_cast<int>(-rc);
  return PostResult::kFailed;
}

// Queued work requests go out in order, except that one the provider
// refuses for now (-FI_EAGAIN) holds back only the later ones to the same
// destination: a peer that stopped answering (tcp reconnecting to a process
// that is gone) must not delay the writes to every other peer, which would
// then time out waiting for this rank and blame it. On the worker a hard
// posting error fails the op; a user thread leaves that to the worker.
int Worker::post_pending(bool on_worker) {
  int posted = 0;
  std::vector<std::pair<const Domain*, fi_addr_t>> held;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->op->done()) {  // failed meanwhile
      it = pending_.erase(it);
      continue;
    }
    const std::pair<const Domain*, fi_addr_t> dest{it->domain, it->dest};
    if (std::find(held.begin(), held.end(), dest) != held.end()) {
      ++it;
      continue;
    }
    const PostResult r = try_post(*it);
    if (r == PostResult::kPosted) {
      it = pending_.erase(it);
      ++posted;
    } else if (r == PostResult::kFailed && on_worker) {
      fail_op(it->op, std::make_exception_ptr(FabricError(
                          "TransferEngine " + it->op->what() + ": posting failed on domain " +
                          std::to_string(it->domain->index()) + ": " +
                          fi_strerror(last_post_error_))));
      it = pending_.erase(it);
    } else {
      held.push_back(dest);
      ++it;
    }
  }
  return posted;
}

void Worker::fail_op(const std::shared_ptr<OpState>& op, std::exception_ptr e) { op->fail(e); }

void Worker::handle_error(Domain& d) {
  fi_cq_err_entry err{};
  if (fi_cq_readerr(d.cq(), &err, 0) <= 0) return;
  if (!err.op_context) return;  // a peer's write that failed on our side
  if (err.flags & FI_REMOTE_WRITE) {  // under FI_RX_CQ_DATA it used a receive
    if (d.rx_cq_data()) repost(reinterpret_cast<Ctx*>(err.op_context));
    return;
  }
  Ctx* c = reinterpret_cast<Ctx*>(err.op_context);
  if (c->is_recv) {
    if (err.err != FI_ECANCELED) repost(c);
    return;
  }
  char buf[256] = {0};
  const char* detail = fi_cq_strerror(d.cq(), err.prov_errno, err.err_data, buf, sizeof(buf));
  unlink(c);
  c->wr.op->fail(std::make_exception_ptr(FabricError(
      "TransferEngine " + c->wr.op->what() + ": completion error on domain " +
      std::to_string(d.index()) + ": " + fi_strerror(err.err) + " (" +
      (detail ? detail : "") + ")")));
  put_ctx(c);
}

int Worker::poll(Domain& d, bool on_worker, bool* wake) {
  fi_cq_data_entry entries[32];
  const ssize_t n = fi_cq_read(d.cq(), entries, 32);
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    if (!on_worker) {  // error entries are the worker's (they may run callbacks)
      *wake = true;
      return 0;
    }
    handle_error(d);
    return 1;
  }
  if (n < 0) return 0;
  for (ssize_t i = 0; i < n; ++i) {
    const fi_cq_data_entry& e = entries[i];
    if (e.flags & FI_REMOTE_WRITE) {
      if (e.flags & FI_REMOTE_CQ_DATA) imms_.add(static_cast<uint32_t>(e.data));
      if (d.rx_cq_data() && e.op_context) repost(reinterpret_cast<Ctx*>(e.op_context));
      continue;
    }
    Ctx* c = reinterpret_cast<Ctx*>(e.op_context);
    if (!c) continue;
    if (e.flags & FI_RECV) {
      Message m;
      m.data.assign(c->buf, c->buf + e.len);
      messages_.push(std::move(m));
      repost(c);
      continue;
    }
    if (!on_worker && c->wr.op->has_callback()) {  // the callback runs on the worker
      deferred_.push_back(c);
      *wake = true;
      continue;
    }
    unlink(c);
    c->wr.op->complete_one();
    put_ctx(c);
  }
  return static_cast<int>(n);
}

void Worker::check_deadlines() {
  const auto now = Clock::now();
  if (now < next_deadline_check_) return;
  next_deadline_check_ = now + std::chrono::milliseconds(2);
  for (Ctx* c = inflight_; c; c = c->next) {
    const auto& op = c->wr.op;
    if (!op->done() && now > op->deadline())
      op->fail(std::make_exception_ptr(TimeoutError(
          "TransferEngine " + op->what() +
          ": not complete within the engine timeout (the peer is unreachable or gone)")));
  }
  // Queued work of failed or expired operations is dropped.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!it->op->done() && now > it->op->deadline())
      it->op->fail(std::make_exception_ptr(TimeoutError(
          "TransferEngine " + it->op->what() +
          ": could not be posted within the engine timeout (the provider stayed busy)")));
    it = it->op->done() ? pending_.erase(it) : it + 1;
  }
}

void Worker::loop() {
  int idle = 0;
  bool queued = false;  // pending_ or deferred_ non-empty at the end of the last pass
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) break;
      // While a user thread waits it polls the same completion queues and
      // wakes the worker for what is the worker's (callbacks, errors, queued
      // work), so the worker sleeps longer then (fewer wake-ups competing
      // for the cores). Cost: after the last waiter returns, a completion
      // nobody waits for may be seen up to kHelpedSleep late.
      const bool waiting = options_.waiters && options_.waiters->load(std::memory_order_relaxed) > 0;
      const bool helped = user_posted_.exchange(false, std::memory_order_relaxed) || waiting;
      if (options_.yield_when_idle && (idle > 200 || helped) && incoming_.empty() &&
          tasks_.empty() && !queued)
        wake_.wait_for(lock, waiting ? kHelpedSleep : kIdleSleep);
    }
    std::lock_guard<std::mutex> ep(ep_mu_);
    run_tasks();
    int work = 0;
    for (Ctx* c : deferred_) {  // completed while a user thread polled
      unlink(c);
      c->wr.op->complete_one();
      put_ctx(c);
      ++work;
    }
    deferred_.clear();
    work += post_pending(true);
    bool unused = false;
    for (Domain* d : domains_) work += poll(*d, true, &unused);
    check_deadlines();
    queued = !pending_.empty() || !deferred_.empty();
    idle = work ? 0 : idle + 1;
  }
}

}  // namespace moelink::fabric
