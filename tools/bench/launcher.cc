#include "launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace moelink_bench {

namespace {

// Asks the kernel for an unused port on 127.0.0.1. The socket is closed
// before rank 0 binds the port again; the window is tiny, and a collision
// shows up as a bootstrap error rather than a hang.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    int e = errno;
    ::close(fd);
    throw std::runtime_error(std::string("bind/getsockname on 127.0.0.1: ") + std::strerror(e));
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

int guarded(int rank, const std::function<int()>& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelink-bench: rank %d failed: %s\n", rank, e.what());
  } catch (...) {
    std::fprintf(stderr, "moelink-bench: rank %d failed with an unknown exception\n", rank);
  }
  return 1;
}

}  // namespace

int run_forked(int nproc, const RankBody& body) {
  const int port = free_port();
  const pid_t parent = ::getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < nproc; ++rank) {
    pid_t pid = ::fork();
    if (pid < 0) {
      std::fprintf(stderr, "moelink-bench: fork failed: %s\n", std::strerror(errno));
      for (pid_t c : children) ::kill(c, SIGTERM);
      for (pid_t c : children) ::waitpid(c, nullptr, 0);
      return 1;
    }
    if (pid == 0) {
      // A rank must not outlive the launcher (Ctrl-C, a crash): the kernel
      // kills it when the parent dies. Re-check the parent in case it died
      // before prctl took effect.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      int rc = guarded(rank, [&] {
        auto bootstrap = moelink::make_tcp_bootstrap(rank, nproc, "127.0.0.1", port);
        return body(*bootstrap, rank);
      });
      std::fflush(stdout);
      std::fflush(stderr);
      // _exit: skip the parent's atexit handlers and static destructors,
      // which belong to the parent.
      ::_exit(rc);
    }
    children.push_back(pid);
  }
  int result = 0;
  size_t remaining = children.size();
  while (remaining > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    int rank = -1;
    for (size_t i = 0; i < children.size(); ++i)
      if (children[i] == pid) {
        rank = static_cast<int>(i);
        children[i] = -1;
      }
    if (rank < 0) continue;
    --remaining;
    int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (rc != 0 && result == 0) {
      result = rc;
      if (WIFSIGNALED(status))
        std::fprintf(stderr, "moelink-bench: rank %d killed by signal %d\n", rank,
                     WTERMSIG(status));
      // The survivors would only wait for the dead peer until their timeout.
      for (pid_t c : children)
        if (c > 0) ::kill(c, SIGTERM);
    }
  }
  return result;
}

int run_from_env(const RankBody& body) {
  const char* r = std::getenv("RANK");
  int rank = r ? std::atoi(r) : -1;
  return guarded(rank, [&] {
    auto bootstrap = moelink::make_env_bootstrap();
    return body(*bootstrap, moelink::env_local_rank(bootstrap->rank()));
  });
}

}  // namespace moelink_bench
