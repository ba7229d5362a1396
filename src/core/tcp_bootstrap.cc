// TCP rendezvous for the setup-time Bootstrap collectives.
//
// Star topology: rank 0 listens on host:port and keeps one connection per
// peer; every collective is "all ranks send to rank 0, rank 0 answers
// everyone". That is O(world_size) messages through rank 0, which is fine for
// the few small exchanges at setup (shared memory names, IPC handles) and
// keeps the failure cases simple: a missing or dead rank is always noticed by
// rank 0, and rank 0's absence by everyone else.
//
// Every socket is non-blocking and every wait goes through poll() with the
// deadline of the current operation, so nothing here can hang past
// timeout_s.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "moelink/bootstrap.h"
#include "moelink/errors.h"

namespace moelink {

// Default barrier: an all_gather of one byte, which no rank can leave before
// every rank has entered it.
void Bootstrap::barrier() {
  char in = 0;
  std::vector<char> out(static_cast<size_t>(world_size()));
  all_gather(&in, out.data(), 1);
}

// Convenience overload. Like the raw all_gather, every rank must pass the same
// number of bytes (the TCP bootstrap checks this and throws InvalidArgument on
// every rank when they differ; other implementations may not).
std::vector<char> Bootstrap::all_gather(const std::vector<char>& in) {
  std::vector<char> out(in.size() * static_cast<size_t>(world_size()));
  all_gather(in.data(), out.data(), in.size());
  return out;
}

std::vector<std::vector<char>> Bootstrap::all_gather_blobs(const std::vector<char>& in) {
  const uint64_t n = in.size();
  std::vector<uint64_t> sizes(world_size());
  all_gather(&n, sizes.data(), sizeof(n));
  uint64_t max = 0;
  for (uint64_t s : sizes) max = std::max(max, s);
  std::vector<char> padded(max);
  if (n > 0) std::memcpy(padded.data(), in.data(), n);
  std::vector<char> all(max * world_size());
  all_gather(padded.data(), all.data(), max);
  std::vector<std::vector<char>> out;
  for (int r = 0; r < world_size(); ++r)
    out.emplace_back(all.begin() + r * max, all.begin() + r * max + sizes[r]);
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x6d6f656c696e6b31ULL;  // "moelink1"

// Numbers in messages are in host byte order: every rank runs on the same
// node, so all share one architecture.
struct Hello {
  uint64_t magic;
  uint32_t rank;
  uint32_t world_size;
};
struct HelloAck {
  uint64_t magic;
  uint32_t ok;          // 1: accepted; 0: rejected (see world_size)
  uint32_t world_size;  // rank 0's world_size
};
// Rank 0's answer to an all_gather: a status header, then (when ok) the
// concatenated contributions.
struct GatherReply {
  uint64_t ok;
  uint64_t bad_rank;  // when !ok: a rank whose size differed from rank 0's
  uint64_t bad_bytes;
  uint64_t root_bytes;
};

std::string errno_str(int err) { return std::strerror(err); }

std::string seconds_str(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

// "2, 3"; -1 stands for a process that connected but has not said who it is.
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks)
    s += (s.empty() ? "" : ", ") + (r < 0 ? std::string("(unidentified)") : std::to_string(r));
  return s;
}

// Milliseconds until `deadline`, rounded up, for poll(); 0 once it passed.
int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, std::numeric_limits<int>::max()));
}

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void set_nonblocking(int fd) {
  int fl = ::fcntl(fd, F_GETFL, 0);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
    throw SystemError("moelink: bootstrap: fcntl(O_NONBLOCK): " + errno_str(errno));
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // best effort: latency only
}

struct AddrInfoList {
  addrinfo* head = nullptr;
  ~AddrInfoList() {
    if (head) ::freeaddrinfo(head);
  }
};

// Resolves host:port. Returns getaddrinfo's code: callers with a deadline
// retry EAI_AGAIN (a temporary DNS failure).
int resolve(const std::string& host, int port, bool passive, AddrInfoList& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string service = std::to_string(port);
  return ::getaddrinfo(host.c_str(), service.c_str(), &hints, &out.head);
}

[[noreturn]] void throw_gai(const std::string& host, int port, int rc) {
  throw SystemError("moelink: bootstrap: getaddrinfo(" + host + ":" + std::to_string(port) +
                    "): " + (rc == EAI_SYSTEM ? errno_str(errno) : ::gai_strerror(rc)));
}

// One pending send or receive of a fixed-size buffer on one peer's socket.
struct Transfer {
  int fd;
  int peer;  // rank at the other end, for error messages
  char* buf;
  size_t len;
  bool send;
  size_t done = 0;
  bool finished() const { return done == len; }
};

// Advances one transfer as far as the socket allows. Returns false when the
// peer closed the connection.
bool step(Transfer& t, std::string* why) {
  while (!t.finished()) {
    ssize_t n = t.send ? ::send(t.fd, t.buf + t.done, t.len - t.done, MSG_NOSIGNAL)
                       : ::recv(t.fd, t.buf + t.done, t.len - t.done, 0);
    if (n > 0) {
      t.done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0 && !t.send) {
      *why = "closed the connection";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    // A peer that exits with unread data in its socket resets the
    // connection instead of closing it: the same story for the user.
    *why = errno == ECONNRESET || errno == EPIPE
               ? "closed the connection (" + errno_str(errno) + ")"
               : "failed the connection: " + errno_str(errno);
    return false;
  }
  return true;
}

// Runs all transfers concurrently (so that no rank's large message can block
// another's) until all are done, `stop_early` says so, or the deadline passes.
template <typename StopEarly>
void run_transfers(std::vector<Transfer>& ts, Clock::time_point deadline, const std::string& what,
                   double timeout_s, StopEarly stop_early) {
  for (; !stop_early();) {
    std::vector<pollfd> fds;
    std::vector<Transfer*> pending;
    for (Transfer& t : ts) {
      if (t.finished()) continue;
      fds.push_back({t.fd, static_cast<short>(t.send ? POLLOUT : POLLIN), 0});
      pending.push_back(&t);
    }
    if (pending.empty()) return;
    int left = ms_left(deadline);
    if (left == 0) {
      std::vector<int> late;
      for (Transfer* t : pending) late.push_back(t->peer);
      std::sort(late.begin(), late.end());
      late.erase(std::unique(late.begin(), late.end()), late.end());
      throw TimeoutError("moelink: bootstrap: " + what + ": rank(s) " + rank_list(late) +
                         " did not take part within " + seconds_str(timeout_s) +
                         " s (stalled, or not in the same collective?)");
    }
    int rc = ::poll(fds.data(), fds.size(), left);
    if (rc < 0 && errno != EINTR)
      throw SystemError("moelink: bootstrap: poll: " + errno_str(errno));
    for (size_t i = 0; rc > 0 && i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      std::string why;
      if (!step(*pending[i], &why))
        throw SystemError("moelink: bootstrap: " + what + ": rank " +
                          std::to_string(pending[i]->peer) + " " + why +
                          " in the middle of a collective (did it exit or crash?)");
    }
  }
}

void run_transfers(std::vector<Transfer>& ts, Clock::time_point deadline, const std::string& what,
                   double timeout_s) {
  run_transfers(ts, deadline, what, timeout_s, [] { return false; });
}

class TcpBootstrap final : public Bootstrap {
 public:
  TcpBootstrap(int rank, int world_size, std::string host, int port, double timeout_s)
      : rank_(rank), world_size_(world_size), host_(std::move(host)), port_(port),
        timeout_s_(timeout_s) {
    if (world_size_ == 1) return;  // nothing to talk to
    if (rank_ == 0)
      accept_peers();
    else
      connect_to_root();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  void all_gather(const void* in, void* out, size_t bytes) override {
    if (world_size_ == 1) {
      if (bytes) std::memmove(out, in, bytes);
      return;
    }
    if (broken_)
      throw SystemError("moelink: bootstrap: unusable after an earlier failure on rank " +
                        std::to_string(rank_));
    broken_ = true;  // until this collective completes
    const auto deadline = Clock::now() + to_duration(timeout_s_);
    if (rank_ == 0)
      gather_at_root(in, out, bytes, deadline);
    else
      gather_at_peer(in, out, bytes, deadline);
    broken_ = false;
  }

 private:
  static Clock::duration to_duration(double s) {
    s = std::min(s, 1e9);  // "forever" without overflowing the clock
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }
  std::string where() const { return host_ + ":" + std::to_string(port_); }

  // ---------------------------------------------------------------- setup

  Fd listen_socket() {
    AddrInfoList ai;
    if (int rc = resolve(host_, port_, true, ai)) throw_gai(host_, port_, rc);
    std::string last = "no usable address";
    for (addrinfo* p = ai.head; p; p = p->ai_next) {
      Fd fd(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol));
      if (fd.get() < 0) {
        last = "socket: " + errno_str(errno);
        continue;
      }
      int one = 1;
      // Lets a new job reuse the port while the previous job's sockets sit in
      // TIME_WAIT.
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd.get(), p->ai_addr, p->ai_addrlen) < 0) {
        last = "bind: " + errno_str(errno);
        continue;
      }
      if (::listen(fd.get(), std::max(world_size_, 128)) < 0) {
        last = "listen: " + errno_str(errno);
        continue;
      }
      set_nonblocking(fd.get());
      return fd;
    }
    throw SystemError("moelink: bootstrap: rank 0 cannot listen on " + where() + ": " + last);
  }

  void accept_peers() {
    const auto deadline = Clock::now() + to_duration(timeout_s_);
    Fd listener = listen_socket();
    peers_.resize(static_cast<size_t>(world_size_));
    int connected = 0;
    while (connected < world_size_ - 1) {
      pollfd pfd{listener.get(), POLLIN, 0};
      int left = ms_left(deadline);
      if (left == 0) throw_missing_peers();
      int rc = ::poll(&pfd, 1, left);
      if (rc < 0 && errno != EINTR)
        throw SystemError("moelink: bootstrap: poll: " + errno_str(errno));
      if (rc <= 0) continue;
      Fd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (conn.get() < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
          continue;
        throw SystemError("moelink: bootstrap: accept on " + where() + ": " + errno_str(errno));
      }
      set_nodelay(conn.get());
      int peer = handshake_at_root(conn, deadline);
      peers_[static_cast<size_t>(peer)] = std::move(conn);
      ++connected;
    }
  }

  [[noreturn]] void throw_missing_peers() const {
    std::vector<int> missing;
    for (int r = 1; r < world_size_; ++r)
      if (peers_[static_cast<size_t>(r)].get() < 0) missing.push_back(r);
    throw TimeoutError("moelink: bootstrap: rank(s) " + rank_list(missing) +
                       " did not connect to " + where() + " within " + seconds_str(timeout_s_) +
                       " s");
  }

  // Reads the peer's Hello, answers it, and returns the peer's rank. Rejected
  // peers learn why from the answer, so both sides fail with the same story.
  int handshake_at_root(Fd& conn, Clock::time_point deadline) {
    Hello h{};
    std::vector<Transfer> rx{{conn.get(), -1, reinterpret_cast<char*>(&h), sizeof(h), false}};
    run_transfers(rx, deadline, "handshake with a connecting rank", timeout_s_);
    std::string problem;
    if (h.magic != kMagic)
      problem = "a connection to " + where() +
                " did not speak the moelink bootstrap protocol (another program on this port?)";
    else if (h.world_size != static_cast<uint32_t>(world_size_))
      problem = "rank " + std::to_string(h.rank) + " has world_size " +
                std::to_string(h.world_size) + " but rank 0 has " + std::to_string(world_size_);
    else if (h.rank == 0 || h.rank >= static_cast<uint32_t>(world_size_))
      problem = "a peer claims rank " + std::to_string(h.rank) + ", outside [1, " +
                std::to_string(world_size_) + ")";
    else if (peers_[h.rank].get() >= 0)
      problem = "two processes claim rank " + std::to_string(h.rank);
    HelloAck ack{kMagic, problem.empty() ? 1u : 0u, static_cast<uint32_t>(world_size_)};
    std::vector<Transfer> tx{{conn.get(), static_cast<int>(h.rank),
                              reinterpret_cast<char*>(&ack), sizeof(ack), true}};
    if (h.magic == kMagic) run_transfers(tx, deadline, "handshake", timeout_s_);
    if (!problem.empty()) throw InvalidArgument("moelink: bootstrap: " + problem);
    return static_cast<int>(h.rank);
  }

  // Tries one non-blocking connect. Returns the connected socket, or an
  // invalid Fd with `*err` set to the errno of a failure worth retrying (the
  // root may not be listening yet).
  Fd try_connect(const addrinfo* p, Clock::time_point deadline, int* err) {
    Fd fd(::socket(p->ai_family, p->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, p->ai_protocol));
    if (fd.get() < 0) throw SystemError("moelink: bootstrap: socket: " + errno_str(errno));
    if (::connect(fd.get(), p->ai_addr, p->ai_addrlen) == 0) return fd;
    if (errno != EINPROGRESS) {
      *err = errno;
      return Fd();
    }
    pollfd pfd{fd.get(), POLLOUT, 0};
    int rc;
    do rc = ::poll(&pfd, 1, ms_left(deadline));
    while (rc < 0 && errno == EINTR);
    if (rc == 0) {
      *err = ETIMEDOUT;
      return Fd();
    }
    int soerr = 0;
    socklen_t len = sizeof(soerr);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
      *err = soerr;
      return Fd();
    }
    return fd;
  }

  static bool retryable(int err) {
    return err == ECONNREFUSED || err == ECONNRESET || err == ETIMEDOUT || err == EHOSTUNREACH ||
           err == ENETUNREACH || err == EAGAIN || err == EINTR || err == ECONNABORTED;
  }

  void connect_to_root() {
    const auto deadline = Clock::now() + to_duration(timeout_s_);
    std::string last = "not attempted";
    for (;;) {
      AddrInfoList ai;
      int rc = resolve(host_, port_, false, ai);
      if (rc != 0 && rc != EAI_AGAIN) throw_gai(host_, port_, rc);
      if (rc == EAI_AGAIN) last = ::gai_strerror(rc);
      for (addrinfo* p = rc == 0 ? ai.head : nullptr; p; p = p->ai_next) {
        int err = 0;
        Fd fd = try_connect(p, deadline, &err);
        if (fd.get() >= 0) {
          set_nodelay(fd.get());
          handshake_at_peer(fd, deadline);
          root_ = std::move(fd);
          return;
        }
        if (!retryable(err))
          throw SystemError("moelink: bootstrap: rank " + std::to_string(rank_) +
                            " cannot connect to rank 0 at " + where() + ": " + errno_str(err));
        last = errno_str(err);
      }
      if (Clock::now() >= deadline)
        throw TimeoutError("moelink: bootstrap: rank " + std::to_string(rank_) +
                           " could not connect to rank 0 at " + where() + " within " +
                           seconds_str(timeout_s_) + " s (last error: " + last + ")");
      // Rank 0 is probably not listening yet; ask again shortly.
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, ms_left(deadline))));
    }
  }

  void handshake_at_peer(Fd& fd, Clock::time_point deadline) {
    Hello h{kMagic, static_cast<uint32_t>(rank_), static_cast<uint32_t>(world_size_)};
    HelloAck ack{};
    std::vector<Transfer> ts{{fd.get(), 0, reinterpret_cast<char*>(&h), sizeof(h), true},
                             {fd.get(), 0, reinterpret_cast<char*>(&ack), sizeof(ack), false}};
    run_transfers(ts, deadline, "handshake", timeout_s_);
    if (ack.magic != kMagic)
      throw InvalidArgument("moelink: bootstrap: the process listening on " + where() +
                            " is not a moelink rank 0");
    if (ack.world_size != static_cast<uint32_t>(world_size_))
      throw InvalidArgument("moelink: bootstrap: rank " + std::to_string(rank_) +
                            " has world_size " + std::to_string(world_size_) +
                            " but rank 0 has " + std::to_string(ack.world_size));
    if (!ack.ok)
      throw InvalidArgument("moelink: bootstrap: rank 0 rejected rank " + std::to_string(rank_) +
                            " (is another process using the same rank?)");
  }

  // ---------------------------------------------------------------- all_gather

  void gather_at_root(const void* in, void* out, size_t bytes, Clock::time_point deadline) {
    const auto W = static_cast<size_t>(world_size_);
    std::vector<uint64_t> sizes(W, 0);
    std::vector<Transfer> ts;
    for (int r = 1; r < world_size_; ++r)
      ts.push_back({peers_[r].get(), r, reinterpret_cast<char*>(&sizes[r]), 8, false});
    run_transfers(ts, deadline, "all_gather", timeout_s_);

    GatherReply head{1, 0, 0, bytes};
    for (int r = 1; r < world_size_ && head.ok; ++r)
      if (sizes[r] != bytes) head = {0, static_cast<uint64_t>(r), sizes[r], bytes};

    // The answer is the header followed (when the sizes agree) by every
    // contribution in rank order; the peers' payloads are received straight
    // into their places in it.
    std::vector<char> reply(sizeof(head) + (head.ok ? W * bytes : 0));
    std::memcpy(reply.data(), &head, sizeof(head));
    char* gathered = reply.data() + sizeof(head);
    if (head.ok) {
      if (bytes) std::memcpy(gathered, in, bytes);
      ts.clear();
      for (int r = 1; r < world_size_; ++r)
        ts.push_back({peers_[r].get(), r, gathered + r * bytes, bytes, false});
      run_transfers(ts, deadline, "all_gather", timeout_s_);
    }
    ts.clear();
    for (int r = 1; r < world_size_; ++r)
      ts.push_back({peers_[r].get(), r, reply.data(), reply.size(), true});
    run_transfers(ts, deadline, "all_gather", timeout_s_);
    if (!head.ok) throw_size_mismatch(head);
    if (bytes) std::memcpy(out, gathered, W * bytes);
  }

  void gather_at_peer(const void* in, void* out, size_t bytes, Clock::time_point deadline) {
    // One message (size, then payload), sent while the answer's header is
    // already being received: on a size mismatch rank 0 answers without
    // reading the payload, and this rank must not block sending it.
    std::vector<char> msg(8 + bytes);
    const uint64_t size = bytes;
    std::memcpy(msg.data(), &size, 8);
    if (bytes) std::memcpy(msg.data() + 8, in, bytes);
    GatherReply head{};
    std::vector<Transfer> ts{
        {root_.get(), 0, msg.data(), msg.size(), true},
        {root_.get(), 0, reinterpret_cast<char*>(&head), sizeof(head), false}};
    run_transfers(ts, deadline, "all_gather", timeout_s_,
                  [&] { return ts[1].finished() && !head.ok; });
    if (!head.ok) throw_size_mismatch(head);
    ts = {{root_.get(), 0, static_cast<char*>(out), bytes * static_cast<size_t>(world_size_),
           false}};
    run_transfers(ts, deadline, "all_gather", timeout_s_);
  }

  [[noreturn]] static void throw_size_mismatch(const GatherReply& r) {
    throw InvalidArgument("moelink: bootstrap: all_gather: rank " + std::to_string(r.bad_rank) +
                          " contributed " + std::to_string(r.bad_bytes) +
                          " bytes but rank 0 contributed " + std::to_string(r.root_bytes) +
                          "; every rank must pass the same size");
  }

  int rank_;
  int world_size_;
  std::string host_;
  int port_;
  double timeout_s_;
  bool broken_ = false;
  std::vector<Fd> peers_;  // rank 0: connection to each peer (index = rank)
  Fd root_;                // other ranks: connection to rank 0
};

void check_setup_args(int rank, int world_size, int port, double timeout_s) {
  auto fail = [](const std::string& what) {
    throw InvalidArgument("moelink: make_tcp_bootstrap: " + what);
  };
  if (world_size < 1) fail("world_size = " + std::to_string(world_size) + " must be >= 1");
  if (rank < 0 || rank >= world_size)
    fail("rank = " + std::to_string(rank) + " must be in [0, world_size = " +
         std::to_string(world_size) + ")");
  if (port < 1 || port > 65535) fail("port = " + std::to_string(port) + " must be in [1, 65535]");
  if (!(timeout_s > 0)) fail("timeout_s = " + seconds_str(timeout_s) + " must be positive");
}

// Strict integer parsing of an environment variable: the whole value must be
// a base-10 integer in [lo, hi].
int env_int(const char* name, const char* value, long lo, long hi) {
  errno = 0;
  char* end = nullptr;
  // strtol alone would accept leading blanks and a '+'.
  const bool starts_ok = (value[0] >= '0' && value[0] <= '9') || value[0] == '-';
  long v = std::strtol(value, &end, 10);
  if (!starts_ok || end == value || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    throw InvalidArgument(std::string("moelink: environment variable ") + name + " = '" + value +
                          "' must be an integer in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]");
  return static_cast<int>(v);
}

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int required_env_int(const char* name, long lo, long hi) {
  const char* v = env_or_null(name);
  if (v == nullptr)
    throw InvalidArgument(std::string("moelink: environment variable ") + name +
                          " is not set (make_env_bootstrap needs RANK and WORLD_SIZE)");
  return env_int(name, v, lo, hi);
}

}  // namespace

std::unique_ptr<Bootstrap> make_tcp_bootstrap(int rank, int world_size, const std::string& host,
                                              int port, double timeout_s) {
  check_setup_args(rank, world_size, port, timeout_s);
  return std::make_unique<TcpBootstrap>(rank, world_size, host, port, timeout_s);
}

std::unique_ptr<Bootstrap> make_env_bootstrap(double timeout_s) {
  const int world_size = required_env_int("WORLD_SIZE", 1, std::numeric_limits<int>::max());
  const int rank = required_env_int("RANK", 0, world_size - 1);
  const char* addr = env_or_null("MASTER_ADDR");
  const char* port = env_or_null("MASTER_PORT");
  return make_tcp_bootstrap(rank, world_size, addr ? addr : "127.0.0.1",
                            port ? env_int("MASTER_PORT", port, 1, 65535) : 29500, timeout_s);
}

int env_local_rank(int fallback) {
  const char* v = env_or_null("LOCAL_RANK");
  return v ? env_int("LOCAL_RANK", v, 0, std::numeric_limits<int>::max()) : fallback;
}

}  // namespace moelink
