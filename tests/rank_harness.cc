#include "rank_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <typeinfo>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/errors.h"

#if defined(MOELINK_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace moelink_test {

namespace {

// State of a rank process (set right after fork).
int g_rank = -1;
int g_report_fd = -1;
int g_failures = 0;
constexpr int kMaxRecordedFailures = 100;

void write_all(int fd, const std::string& s) {
  const char* p = s.data();
  size_t left = s.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

void write_report(const std::string& text) {
  ++g_failures;
  if (g_failures <= kMaxRecordedFailures) {
    write_all(g_report_fd, text + "\n");
  } else if (g_failures == kMaxRecordedFailures + 1) {
    write_all(g_report_fd, "(further failures of this rank not shown)\n");
  }
}

// Forwards GoogleTest failures raised inside a rank process (EXPECT_*,
// ADD_FAILURE) to the report file, since the child's test results are lost.
class ForwardFailures : public testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::ostringstream os;
    os << (r.file_name() ? r.file_name() : "?") << ":" << r.line_number() << ": "
       << r.message();
    write_report(os.str());
  }
};

void become_rank_process(int rank, int report_fd, pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(97);  // the parent died before prctl
  g_rank = rank;
  g_report_fd = report_fd;
  g_failures = 0;
  auto& listeners = testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new ForwardFailures);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Child {
  int index = 0;
  pid_t pid = -1;
  std::string report_path;
  bool done = false;
  int status = 0;
};

// Forks `count` children running fn(index); waits for all of them with a
// deadline and reports failures through ADD_FAILURE.
void fork_and_wait(int count, const std::function<void(int index)>& fn, int timeout_s) {
  std::vector<Child> children(count);
  const pid_t parent = getpid();
  std::fflush(nullptr);
  for (int i = 0; i < count; ++i) {
    char path[] = "/tmp/moelink_test_rankXXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) throw std::runtime_error("mkstemp failed: " + std::string(strerror(errno)));
    children[i].index = i;
    children[i].report_path = path;
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed: " + std::string(strerror(errno)));
    if (pid == 0) {
      become_rank_process(i, fd, parent);
      try {
        fn(i);
      } catch (const std::exception& e) {
        write_report(std::string("uncaught exception ") + typeid(e).name() + ": " + e.what());
      } catch (...) {
        write_report("uncaught non-std exception");
      }
      std::fflush(nullptr);
      _exit(g_failures > 0 ? 1 : 0);
    }
    ::close(fd);
    children[i].pid = pid;
  }

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int running = count;
  bool timed_out = false;
  while (running > 0) {
    for (auto& c : children) {
      if (c.done) continue;
      pid_t r = waitpid(c.pid, &c.status, WNOHANG);
      if (r == c.pid) {
        c.done = true;
        --running;
      }
    }
    if (running == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (timed_out) {
    for (auto& c : children)
      if (!c.done) kill(c.pid, SIGKILL);
    for (auto& c : children)
      if (!c.done) waitpid(c.pid, &c.status, 0);
  }

  for (auto& c : children) {
    const std::string report = read_file(c.report_path);
    ::unlink(c.report_path.c_str());
    std::ostringstream what;
    if (!c.done) {
      what << "did not finish within " << timeout_s << " s (killed)";
    } else if (WIFSIGNALED(c.status)) {
      what << "died of signal " << WTERMSIG(c.status) << " (" << strsignal(WTERMSIG(c.status))
           << ")";
    } else if (WIFEXITED(c.status) && WEXITSTATUS(c.status) != 0) {
      what << "exited with status " << WEXITSTATUS(c.status);
    } else if (!report.empty()) {
      what << "reported failures";
    } else {
      continue;
    }
    ADD_FAILURE() << "rank " << c.index << " " << what.str()
                  << (report.empty() ? std::string() : ":\n" + report);
  }
}

}  // namespace

bool in_rank_process() { return g_rank >= 0; }
int current_rank() { return g_rank; }
int failure_count() { return g_failures; }

void record_failure(const char* file, int line, const std::string& message) {
  if (!in_rank_process()) {
    ++g_failures;
    ADD_FAILURE_AT(file, line) << message;
    return;
  }
  std::ostringstream os;
  os << file << ":" << line << ": " << message;
  write_report(os.str());
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket failed: " + std::string(strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    throw std::runtime_error("bind failed: " + std::string(strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

void run_processes(int count, const std::function<void(int index, int port)>& body,
                   int timeout_s) {
  const int port = pick_free_port();
  fork_and_wait(count, [&](int i) { body(i, port); }, timeout_s);
}

void run_ranks(int world_size, const std::function<void(int rank, moelink::Bootstrap&)>& body,
               int timeout_s, double bootstrap_timeout_s) {
  const int port = pick_free_port();
  fork_and_wait(
      world_size,
      [&](int rank) {
        auto bootstrap =
            moelink::make_tcp_bootstrap(rank, world_size, "127.0.0.1", port, bootstrap_timeout_s);
        body(rank, *bootstrap);
      },
      timeout_s);
}

int probe_gpu_count() {
#if defined(MOELINK_WITH_CUDA)
  static int cached = -1;
  if (cached >= 0) return cached;
  int fds[2];
  if (pipe(fds) != 0) return cached = 0;
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid < 0) return cached = 0;
  if (pid == 0) {
    ::close(fds[0]);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    write_all(fds[1], std::string(reinterpret_cast<const char*>(&n), sizeof(n)));
    _exit(0);
  }
  ::close(fds[1]);
  int n = 0;
  pollfd p{fds[0], POLLIN, 0};
  if (poll(&p, 1, 120000) == 1 && ::read(fds[0], &n, sizeof(n)) != sizeof(n)) n = 0;
  ::close(fds[0]);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return cached = n;
#else
  return 0;
#endif
}

}  // namespace moelink_test
