// Runs one test body on several ranks, each in its own forked process, and
// reports their failures in the parent's GoogleTest run.
//
// Inside a rank process, record failures with RANK_CHECK(cond) << "details"
// (or RANK_FAIL() << ...). GoogleTest's own EXPECT_* / ADD_FAILURE also work
// there: a listener installed in the child forwards their messages. Outside
// a rank process the macros fall back to ADD_FAILURE.
#pragma once

#include <functional>
#include <initializer_list>
#include <typeinfo>
#include <sstream>
#include <string>

#include "moelink/bootstrap.h"

namespace moelink_test {

// Forks `world_size` processes; process r builds
// make_tcp_bootstrap(r, world_size, "127.0.0.1", <free port>,
// bootstrap_timeout_s) and runs body(r, bootstrap). An uncaught exception, a
// recorded failure, a crash or a nonzero exit fails the calling test; the
// ranks are killed when they take longer than timeout_s in total.
void run_ranks(int world_size, const std::function<void(int rank, moelink::Bootstrap&)>& body,
               int timeout_s, double bootstrap_timeout_s = 30.0);

// Same, without a bootstrap: body(r, port) gets the free port to use.
void run_processes(int count, const std::function<void(int index, int port)>& body,
                   int timeout_s);

// A TCP port on 127.0.0.1 that was free a moment ago.
int pick_free_port();

// Number of CUDA devices, asked in a forked child so that this process never
// initializes CUDA (forked ranks must not inherit a CUDA context). 0 when the
// build has no CUDA or the query fails. Cached.
int probe_gpu_count();

// True inside a process started by run_ranks / run_processes.
bool in_rank_process();
int current_rank();

// Records one failure of the current rank (or ADD_FAILURE outside one).
void record_failure(const char* file, int line, const std::string& message);
// Failures recorded by this process so far.
int failure_count();

class FailureMessage {
 public:
  FailureMessage(const char* file, int line, const char* condition)
      : file_(file), line_(line) {
    if (condition) os_ << "check failed: " << condition << ": ";
  }
  ~FailureMessage() { record_failure(file_, line_, os_.str()); }
  template <typename T>
  FailureMessage& operator<<(const T& v) {
    os_ << v;
    return *this;
  }

 private:
  const char* file_;
  int line_;
  std::ostringstream os_;
};

}  // namespace moelink_test

#define RANK_CHECK(cond)   \
  switch (0)               \
  case 0:                  \
  default:                 \
    if (cond) {            \
    } else                 \
      ::moelink_test::FailureMessage(__FILE__, __LINE__, #cond)

#define RANK_FAIL() ::moelink_test::FailureMessage(__FILE__, __LINE__, nullptr)

namespace moelink_test {

// Runs fn, which must throw exactly `Expected` (or a subclass) whose message
// contains every one of `parts`; records a failure otherwise. Works inside
// and outside rank processes.
template <typename Expected, typename Fn>
void expect_throw_naming(Fn&& fn, std::initializer_list<std::string> parts,
                         const std::string& context = "") {
  try {
    fn();
  } catch (const Expected& e) {
    const std::string what = e.what();
    for (const auto& p : parts)
      RANK_CHECK(what.find(p) != std::string::npos)
          << context << ": message does not name '" << p << "': " << what;
    return;
  } catch (const std::exception& e) {
    RANK_FAIL() << context << ": threw the wrong exception type (" << typeid(e).name()
                << "): " << e.what();
    return;
  }
  std::string want;
  for (const auto& p : parts) want += " '" + p + "'";
  RANK_FAIL() << context << ": did not throw; expected an exception naming" << want;
}

}  // namespace moelink_test
