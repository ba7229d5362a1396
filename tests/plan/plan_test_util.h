// Shared helpers of the planner tests: the profile tree of the source checkout
// and runs of the built moelink-plan.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "moelink/plan/profiles.h"
#include "moelink/plan/step.h"

namespace moelink::plan::test {
inline ProfileStore store() { return ProfileStore(std::string(MOELINK_SOURCE_DIR) + "/profiles"); }
inline PlanInput input(const std::string& model, const std::string& gpu, const std::string& net, Layout l,
                       int batch, OverlapMode ov = OverlapMode::kDispatchOverlap) {
  auto s = store();
  PlanInput in{s.model(model), s.gpu(gpu), s.network(net), l, {}};
  in.work.batch = batch;
  in.work.overlap = ov;
  return in;
}

// A fresh scratch directory under the system temp dir, unique per process and call.
inline std::filesystem::path scratch_dir(const std::string& what) {
  static std::atomic<int> n{0};
  auto d = std::filesystem::temp_directory_path() /
           ("moelink_plan_" + what + "_" + std::to_string(getpid()) + "_" + std::to_string(n++));
  std::filesystem::create_directories(d);
  return d;
}

struct CliRun {
  int rc;
  std::string out;  // stdout (and stderr, for run())
  std::string err;  // stderr, for run_split()
};

inline CliRun run_command(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out, ""};
}

inline std::string plan_cmd(const std::string& args) {
  return std::string(MOELINK_PLAN_EXE) + " --profiles-dir " + MOELINK_SOURCE_DIR + "/profiles " + args;
}

// moelink-plan with the source tree's profiles; stdout and stderr together.
inline CliRun run(const std::string& args) { return run_command(plan_cmd(args) + " 2>&1"); }

// As run(), with stderr apart (to check that stdout carries only CSV/JSON).
inline CliRun run_split(const std::string& args) {
  const auto dir = scratch_dir("stderr");
  const auto err_path = dir / "stderr.txt";
  CliRun r = run_command(plan_cmd(args) + " 2>" + err_path.string());
  std::ifstream f(err_path);
  std::stringstream ss;
  ss << f.rdbuf();
  r.err = ss.str();
  std::filesystem::remove_all(dir);
  return r;
}
}  // namespace moelink::plan::test
