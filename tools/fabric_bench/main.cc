// moelink-fabric-bench: the TransferEngine's overhead over the same
// operations written directly on libfabric, measured in the same run.
//
// For each provider and peer count N it forks N+1 processes (rank 0 sends,
// ranks 1..N receive; addresses exchanged through make_tcp_bootstrap). Each
// process runs the ops (scatter + barrier, paged write, ping-pong) first with
// one implementation, then the other (the order alternates per round), each
// with its own endpoint and the same buffers, the same completion semantics
// and the same polling policy. Rank 0 reports its measurements to the parent
// through a pipe; the parent prints a table and writes JSON.
#include <fcntl.h>
#include <sched.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <rdma/fabric.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "git_commit.h"
#include "moelink/bootstrap.h"
#include "moelink/transfer_engine.h"
#include "cpu_cost.h"
#include "ops.h"
#include "transports.h"
#include "moelink/version.h"

namespace moelink_fabric_bench {

using json = nlohmann::ordered_json;

void verify(const std::string& op, int rank, const Layout& l, const Buffers& buf,
            const RunOptions& o) {
  auto fail = [&](size_t at) {
    throw std::runtime_error("verification of " + op + " failed on rank " + std::to_string(rank) +
                             " at byte " + std::to_string(at));
  };
  if (op == "scatter" && rank > 0) {
    for (size_t j = 0; j < l.scatter_bytes; ++j)
      if (buf.dst[j] != pattern(0, (rank - 1) * l.scatter_bytes + j)) fail(j);
  } else if (op == "paged" && rank > 0) {
    for (size_t i = 0; i < l.pages; ++i)
      for (size_t j = 0; j < l.page_bytes; ++j)
        if (buf.dst[l.dst_pages[i] * l.page_stride + j] !=
            pattern(0, l.src_pages[i] * l.page_stride + j))
          fail(l.dst_pages[i] * l.page_stride + j);
  } else if (op == "pingpong" && rank <= 1) {
    for (size_t j = 0; j < o.pingpong_bytes; ++j)
      if (buf.dst[j] != pattern(1 - rank, j)) fail(j);
  }
}

namespace {

json stats(std::vector<double> v) {
  json j;
  if (v.empty()) return j;
  std::sort(v.begin(), v.end());
  auto pct = [&](double p) {
    const double x = p * static_cast<double>(v.size() - 1);
    const size_t i = static_cast<size_t>(x);
    const double f = x - static_cast<double>(i);
    return i + 1 < v.size() ? v[i] * (1 - f) + v[i + 1] * f : v[i];
  };
  double sum = 0;
  for (double x : v) sum += x;
  j["p50"] = pct(0.5);
  j["p90"] = pct(0.9);
  j["mean"] = sum / static_cast<double>(v.size());
  j["min"] = v.front();
  j["max"] = v.back();
  j["samples"] = v.size();
  return j;
}

// Writes per iteration and payload bytes per iteration of one op.
void per_iteration(const std::string& op, int n, const RunOptions& o, double& writes,
                   double& bytes) {
  if (op == "scatter") {
    writes = 2.0 * n;  // N slices + N barrier writes
    bytes = static_cast<double>(n) * o.scatter_bytes;
  } else if (op == "paged") {
    writes = static_cast<double>(n) * o.pages;
    bytes = static_cast<double>(n) * o.pages * o.page_bytes;
  } else {
    writes = 2;  // ping + pong
    bytes = 2.0 * o.pingpong_bytes;
  }
}

json impl_json(const std::string& op, int n, const RunOptions& o, const OpSamples& s) {
  json j;
  j["latency_us"] = stats(s.lat_us);
  double writes = 0, bytes = 0;
  per_iteration(op, n, o, writes, bytes);
  if (!s.rate_s.empty()) {
    const double t = median(s.rate_s);
    json r;
    r["iterations"] = o.rate_iters;
    r["window"] = o.window;
    r["seconds_per_round"] = s.rate_s;
    r["seconds_median"] = t;
    r["ops_per_s"] = o.rate_iters / t;
    r["writes_per_s"] = o.rate_iters * writes / t;
    r["bytes_per_s"] = o.rate_iters * bytes / t;
    j["rate"] = r;
  } else if (!s.lat_us.empty()) {  // ping-pong: one round trip at a time
    const double p50 = j["latency_us"]["p50"].get<double>();
    json r;
    r["round_trips_per_s"] = 1e6 / p50;
    r["writes_per_s"] = 2e6 / p50;
    j["rate"] = r;
  }
  return j;
}

// What rank 0 sends to the parent for one (provider, N) run.
json rank0_report(int n, const RunOptions& o, const std::map<std::string, OpSamples>* res,
                  const std::string names[2], const bool hmem[2]) {
  json run;
  run["provider_name_raw"] = names[0];
  run["provider_name_engine"] = names[1];
  run["fi_hmem_raw"] = hmem[0];
  run["fi_hmem_engine"] = hmem[1];
  run["peers"] = n;
  json ops = json::array();
  for (const auto& op : o.ops) {
    json e;
    e["op"] = op;
    if (op == "scatter") e["bytes_per_peer"] = o.scatter_bytes;
    if (op == "paged") {
      e["pages_per_peer"] = o.pages;
      e["page_bytes"] = o.page_bytes;
    }
    if (op == "pingpong") e["bytes"] = o.pingpong_bytes;
    const json raw = impl_json(op, n, o, res[0].at(op));
    const json eng = impl_json(op, n, o, res[1].at(op));
    e["engine"] = eng;
    e["raw"] = raw;
    json ratio;
    ratio["latency_p50"] = eng["latency_us"]["p50"].get<double>() / raw["latency_us"]["p50"].get<double>();
    ratio["latency_p90"] = eng["latency_us"]["p90"].get<double>() / raw["latency_us"]["p90"].get<double>();
    if (eng["rate"].contains("seconds_median"))
      ratio["rate_time"] = eng["rate"]["seconds_median"].get<double>() /
                           raw["rate"]["seconds_median"].get<double>();
    // Engine / raw of each round (both ran in it, one after the other): how
    // far one cell moves within a run, beside the ratio of the whole run.
    const auto per_round = [](const std::vector<double>& e, const std::vector<double>& w) {
      json a = json::array();
      for (size_t i = 0; i < std::min(e.size(), w.size()); ++i) a.push_back(e[i] / w[i]);
      return a;
    };
    const OpSamples& se = res[1].at(op);
    const OpSamples& sr = res[0].at(op);
    ratio["latency_p50_per_round"] = per_round(se.lat_p50_per_round, sr.lat_p50_per_round);
    if (!se.rate_s.empty()) ratio["rate_time_per_round"] = per_round(se.rate_s, sr.rate_s);
    e["engine_over_raw"] = ratio;
    ops.push_back(e);
  }
  run["ops"] = ops;
  return run;
}

// A child's report to the parent, through its pipe.
void write_all(int fd, const std::string& s) {
  for (size_t off = 0; off < s.size();) {
    const ssize_t w = ::write(fd, s.data() + off, s.size() - off);
    if (w <= 0) throw std::runtime_error("writing the report to the parent failed");
    off += static_cast<size_t>(w);
  }
}

// Indices into the process's CPU set for rank r's thread and its engine
// worker under --pin. Rank r's thread on CPU r, its worker on CPU world + r.
// With fewer CPUs than threads (8 peers on 16 CPUs: 18 threads) the
// workers past the end share the CPUs of the workers of ranks 2, 3, ...
// (asleep while their rank polls), never the CPUs of ranks 0 and 1 or of
// their workers: rank 0 is the sender every op times, rank 1 its
// ping-pong partner. (Wrapping round to CPU 0 put peer 7's worker beside
// the sender.) Too few CPUs even for that: modulo the CPU set.
struct PinnedCpus {
  size_t thread, worker;
};
PinnedCpus pinned_cpus(int rank, int world, size_t ncpu, bool worker_on_rank_cpu) {
  const size_t r = static_cast<size_t>(rank), w = static_cast<size_t>(world);
  PinnedCpus at{r % ncpu, 0};
  if (worker_on_rank_cpu) {
    at.worker = at.thread;
  } else if (w + r < ncpu) {
    at.worker = w + r;
  } else if (w + 2 < ncpu) {
    at.worker = w + 2 + (w + r - ncpu) % (ncpu - w - 2);
  } else {
    at.worker = (w + r) % ncpu;
  }
  return at;
}

void rank_main(int rank, int world, int port, const RunOptions& o, const std::string& provider,
               int fd) {
  auto b = moelink::make_tcp_bootstrap(rank, world, "127.0.0.1", port, 60.0);
  const int n = world - 1;
  const Layout l = Layout::make(n, o.scatter_bytes, o.pages, o.page_bytes, o.pingpong_bytes);
  Buffers buf;
  buf.src.resize(l.src_bytes);
  buf.dst.resize(l.dst_bytes);
  for (size_t i = 0; i < buf.src.size(); ++i) buf.src[i] = pattern(rank, i);
  int worker_cpu = -1;
  if (o.pin) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
      throw std::runtime_error("--pin: sched_getaffinity failed");
    std::vector<int> cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    const PinnedCpus at = pinned_cpus(rank, world, cpus.size(), o.worker_on_rank_cpu);
    cpu_set_t mine;
    CPU_ZERO(&mine);
    CPU_SET(cpus[at.thread], &mine);
    if (sched_setaffinity(0, sizeof(mine), &mine) != 0)
      throw std::runtime_error("--pin: sched_setaffinity failed");
    worker_cpu = cpus[at.worker];
  }
  std::map<std::string, OpSamples> res[2];  // 0 raw, 1 engine
  std::string names[2];
  bool hmem[2] = {false, false};
  for (int round = 0; round < o.rounds; ++round) {
    for (int k = 0; k < 2; ++k) {
      const int impl = round % 2 == 0 ? k : 1 - k;  // raw first in even rounds
      if (impl == 0) {
        RawTransport t(*b, buf, l, provider, o.yield_when_idle);
        names[0] = t.provider_name();
        hmem[0] = t.hmem();
        run_ops(t, *b, o, l, buf, res[0]);
      } else {
        EngineTransport t(*b, buf, l, provider, o.yield_when_idle, worker_cpu);
        names[1] = t.provider_name();
        hmem[1] = t.hmem();
        run_ops(t, *b, o, l, buf, res[1]);
      }
      b->barrier();
    }
  }
  if (rank == 0) write_all(fd, rank0_report(n, o, res, names, hmem).dump());
}

int pick_free_port() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (s < 0 || bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error("no free TCP port on 127.0.0.1");
  close(s);
  return ntohs(a.sin_port);
}

// Forks a child that runs body(write end of the pipe fds) and exits (1,
// after printing "moelink-fabric-bench: <who>: <error>", if it threw); the
// child dies with the parent. Returns its pid (-1 if fork failed). The
// caller flushes stdio before, and reads fds[0].
pid_t fork_child(const int fds[2], const std::string& who, const std::function<void(int)>& body) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  close(fds[0]);
  int rc = 0;
  try {
    body(fds[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelink-fabric-bench: %s: %s\n", who.c_str(), e.what());
    rc = 1;
  }
  std::fflush(nullptr);
  _exit(rc);
}

// measure_cpu_cost in a child (the parent never initializes libfabric),
// its JSON back through a pipe; throws with the child's failure.
json cpu_cost_in_child(const std::string& provider, int iters, int reps) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  std::fflush(nullptr);
  const pid_t pid = fork_child(fds, "cpu cost (" + provider + ")", [&](int fd) {
    write_all(fd, measure_cpu_cost(provider, iters, reps).dump());
  });
  close(fds[1]);
  std::string out;
  char chunk[4096];
  ssize_t got;
  while ((got = ::read(fds[0], chunk, sizeof(chunk))) > 0) out.append(chunk, got);
  close(fds[0]);
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0 || out.empty())
    throw std::runtime_error("the cpu-cost child failed");
  return json::parse(out);
}

// Asked in a child: the parent never initializes libfabric (it forks).
bool provider_available(const std::string& provider) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    bool ok = false;
    try {
      ok = moelink::fabric::provider_available(provider);
    } catch (...) {
    }
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

void remove_shm_files_of(pid_t pid) {
  const std::string prefix = std::to_string(pid) + ":";
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator("/dev/shm", ec))
    if (f.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(f.path(), ec);
}

// Forks the N+1 ranks of one run and returns rank 0's report; throws with
// what went wrong (a rank's exit status, a timeout).
json run_config(const std::string& provider, int peers, const RunOptions& o, int timeout_s) {
  const int world = peers + 1;
  const int port = pick_free_port();
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const std::string who = "rank " + std::to_string(r) + " (" + provider + ", " +
                            std::to_string(peers) + " peers)";
    const pid_t pid =
        fork_child(fds, who, [&](int fd) { rank_main(r, world, port, o, provider, fd); });
    if (pid < 0) throw std::runtime_error("fork failed");
    pids.push_back(pid);
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  std::string report;
  std::string error;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  size_t alive = pids.size();
  std::vector<bool> done(pids.size(), false);
  while (alive > 0) {
    pollfd p{fds[0], POLLIN, 0};
    ::poll(&p, 1, 20);
    char chunk[4096];
    ssize_t got;
    while ((got = ::read(fds[0], chunk, sizeof(chunk))) > 0) report.append(chunk, got);
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) != pids[i]) continue;
      done[i] = true;
      --alive;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && error.empty())
        error = "rank " + std::to_string(i) +
                (WIFSIGNALED(status) ? " killed by signal " + std::to_string(WTERMSIG(status))
                                     : " exited with " + std::to_string(WEXITSTATUS(status)));
    }
    const bool late = std::chrono::steady_clock::now() > deadline;
    if (late && error.empty()) error = "timed out after " + std::to_string(timeout_s) + " s";
    if (!error.empty())
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) kill(pids[i], SIGKILL);
  }
  ssize_t got;
  char chunk[4096];
  while ((got = ::read(fds[0], chunk, sizeof(chunk))) > 0) report.append(chunk, got);
  close(fds[0]);
  for (pid_t pid : pids) remove_shm_files_of(pid);
  if (!error.empty()) throw std::runtime_error(error);
  return json::parse(report);
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789-_=.,/:+@%") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

json machine_json() {
  json m;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  m["host"] = host;
  utsname u{};
  if (uname(&u) == 0) {
    m["os"] = std::string(u.sysname) + " " + u.release;
    m["arch"] = u.machine;
  }
  m["cpus_online"] = sysconf(_SC_NPROCESSORS_ONLN);
  std::ifstream cpu("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpu, line))
    if (line.rfind("model name", 0) == 0) {
      m["cpu_model"] = line.substr(line.find(':') + 2);
      break;
    }
  return m;
}

// The build-time commit; when the build recorded none, $MOELINK_GIT_COMMIT,
// else `git rev-parse HEAD` in the source tree now (noted as such).
void git_json(json& doc) {
  std::string commit = MOELINK_BENCH_GIT_COMMIT, source = "build";
  bool dirty = MOELINK_BENCH_GIT_DIRTY != 0;
  if (commit == "unknown") {
    source = "none";
    if (const char* env = std::getenv("MOELINK_GIT_COMMIT")) {
      commit = env;
      source = "env MOELINK_GIT_COMMIT";
    } else if (FILE* p = popen("git -C '" MOELINK_FABRIC_BENCH_SOURCE_DIR
                               "' rev-parse HEAD 2>/dev/null", "r")) {
      char buf[128] = {0};
      std::string out = fgets(buf, sizeof(buf), p) ? buf : "";
      pclose(p);
      while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
      if (out.size() == 40 && out.find_first_not_of("0123456789abcdef") == std::string::npos) {
        commit = out;
        source = "git rev-parse at run time";
        FILE* q = popen("git -C '" MOELINK_FABRIC_BENCH_SOURCE_DIR
                        "' status --porcelain --untracked-files=no 2>/dev/null", "r");
        dirty = q && fgets(buf, sizeof(buf), q) != nullptr;
        if (q) pclose(q);
      }
    }
  }
  // A commit passed in wins: the device tool's copy of the tree carries a
  // stale .git, so what the build recorded is not the tree's commit.
  if (const char* env = std::getenv("MOELINK_GIT_COMMIT"); env && *env && source == "build" &&
                                                           commit.rfind(env, 0) != 0) {
    source = "env MOELINK_GIT_COMMIT (the build recorded " + commit + (dirty ? ", dirty)" : ")");
    commit = env;
    dirty = false;
  }
  doc["git_commit"] = commit;
  doc["git_dirty"] = dirty;
  doc["git_commit_from"] = source;
}

std::string fmt(double v, int prec = 1) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(prec);
  os << v;
  return os.str();
}

// " [lo-hi]": the range of a cell's per-round ratios (empty for one round).
std::string round_range(const json& r, const char* key) {
  if (!r.contains(key) || r[key].size() < 2) return "";
  const auto v = r[key].get<std::vector<double>>();
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return " [" + fmt(*lo, 2) + "-" + fmt(*hi, 2) + "]";
}

void print_run(const std::string& provider, const json& run, double threshold) {
  for (const auto& e : run["ops"]) {
    const std::string op = e["op"];
    std::string size = op == "scatter"   ? std::to_string(e["bytes_per_peer"].get<size_t>()) + " B/peer"
                       : op == "paged"   ? std::to_string(e["pages_per_peer"].get<size_t>()) + " x " +
                                             std::to_string(e["page_bytes"].get<size_t>()) + " B/peer"
                                         : std::to_string(e["bytes"].get<size_t>()) + " B";
    const auto& eng = e["engine"];
    const auto& raw = e["raw"];
    const auto& r = e["engine_over_raw"];
    std::printf("%-4s %d peers  %-8s %-18s lat p50 %8s / %8s us (x%.2f%s)  p90 %8s / %8s us (x%.2f)",
                provider.c_str(), run["peers"].get<int>(), op.c_str(), size.c_str(),
                fmt(eng["latency_us"]["p50"]).c_str(), fmt(raw["latency_us"]["p50"]).c_str(),
                r["latency_p50"].get<double>(), round_range(r, "latency_p50_per_round").c_str(),
                fmt(eng["latency_us"]["p90"]).c_str(), fmt(raw["latency_us"]["p90"]).c_str(),
                r["latency_p90"].get<double>());
    if (r.contains("rate_time"))
      std::printf("  rate %8s / %8s kwrites/s %7s / %7s MB/s (time x%.2f%s)",
                  fmt(eng["rate"]["writes_per_s"].get<double>() / 1e3).c_str(),
                  fmt(raw["rate"]["writes_per_s"].get<double>() / 1e3).c_str(),
                  fmt(eng["rate"]["bytes_per_s"].get<double>() / 1e6).c_str(),
                  fmt(raw["rate"]["bytes_per_s"].get<double>() / 1e6).c_str(),
                  r["rate_time"].get<double>(), round_range(r, "rate_time_per_round").c_str());
    bool over = r["latency_p50"].get<double>() > 1 + threshold;
    if (r.contains("rate_time")) over = over || r["rate_time"].get<double>() > 1 + threshold;
    std::printf("%s\n", over ? "  OVER" : "");
  }
  std::fflush(stdout);
}

}  // namespace
}  // namespace moelink_fabric_bench

int main(int argc, char** argv) {
  using namespace moelink_fabric_bench;
  CLI::App app{
      "moelink-fabric-bench: TransferEngine overhead vs the same operations written directly on "
      "libfabric, in the same run (engine / raw)"};
  app.set_version_flag("--version", std::string("moelink-fabric-bench ") + moelink::version());
  RunOptions o;
  std::vector<std::string> providers{"shm", "tcp"};
  std::vector<int> peers{2, 4, 8};
  std::string json_path;
  int timeout_s = 120;
  bool busy_poll = false, skip_unavailable = false;
  double threshold = 0.10;
  app.add_option("--provider", providers, "libfabric providers (shm, tcp, efa)")->delimiter(',');
  app.add_option("--peers", peers, "peer counts; each run forks 1 sender + N peers")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  app.add_option("--ops", o.ops, "ops: scatter, paged, pingpong")
      ->delimiter(',')
      ->check(CLI::IsMember({"scatter", "paged", "pingpong"}));
  app.add_option("--scatter-bytes", o.scatter_bytes, "scatter: bytes per peer (S)");
  app.add_option("--pages", o.pages, "paged write: pages per peer (P)")->check(CLI::Range(1, 4096));
  app.add_option("--page-bytes", o.page_bytes, "paged write: bytes per page (B)");
  app.add_option("--pingpong-bytes", o.pingpong_bytes, "ping-pong: bytes per write");
  app.add_option("--lat-iters", o.lat_iters, "timed latency iterations per round")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--rate-iters", o.rate_iters, "iterations of the message-rate stream per round")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", o.warmup, "untimed iterations before each op")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--window", o.window, "message rate: iterations in flight")
      ->check(CLI::Range(1, 256));
  app.add_option("--rounds", o.rounds, "rounds; each runs raw and engine (order alternates)")
      ->check(CLI::Range(1, 100));
  app.add_flag("--busy-poll", busy_poll,
               "busy-poll (engine yield_when_idle=false, raw loop without sleeps)");
  int cost_iters = 20000;
  app.add_option("--cpu-cost-iters", cost_iters,
                 "per provider, the engine's software cost per write on one thread (two endpoints "
                 "in one process) vs raw libfabric: iterations per repetition (0: skip)")
      ->check(CLI::Range(0, 10000000));
  CLI::Option* pin = app.add_flag(
      "--pin", o.pin, "pin rank r to CPU r and its engine worker to CPU N+1+r (past the CPU set: beside the "
      "workers of ranks 2, 3, ...)");
  app.add_flag("--pin-worker-with-rank", o.worker_on_rank_cpu,
               "with --pin: the engine worker on its rank's CPU (the CPUs the raw loop uses; "
               "stalls busy-polling threads, see docs/transfer_engine.md)")
      ->needs(pin);
  app.add_option("--json", json_path, "write the results as JSON to this file");
  app.add_option("--timeout", timeout_s, "seconds per (provider, peers) run before it is killed");
  app.add_option("--threshold", threshold, "overhead flagged OVER above this (0.10 = 10%)");
  app.add_flag("--skip-unavailable", skip_unavailable,
               "skip unavailable providers (exit 77 when none ran) instead of failing");
  CLI11_PARSE(app, argc, argv);
  o.yield_when_idle = !busy_poll;

  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + shell_quote(argv[i]);
  if (std::find(providers.begin(), providers.end(), "tcp") != providers.end())
    setenv("FI_TCP_IFACE", "lo", 0);  // before any fork: every rank sees it

  json doc;
  doc["tool"] = "moelink-fabric-bench";
  doc["date"] = utc_now();
  doc["machine"] = machine_json();
  git_json(doc);
  doc["command"] = command;
  doc["libfabric_runtime"] = std::to_string(FI_MAJOR(fi_version())) + "." +
                             std::to_string(FI_MINOR(fi_version()));
  const char* iface = std::getenv("FI_TCP_IFACE");
  doc["env"]["FI_TCP_IFACE"] = iface ? iface : "";
  json jo;
  jo["ops"] = o.ops;
  jo["scatter_bytes"] = o.scatter_bytes;
  jo["pages"] = o.pages;
  jo["page_bytes"] = o.page_bytes;
  jo["page_stride"] = 2 * o.page_bytes;
  jo["pingpong_bytes"] = o.pingpong_bytes;
  jo["lat_iters"] = o.lat_iters;
  jo["rate_iters"] = o.rate_iters;
  jo["warmup"] = o.warmup;
  jo["window"] = o.window;
  jo["rounds"] = o.rounds;
  jo["num_domains"] = 1;
  jo["pin"] = !o.pin ? "not pinned"
              : o.worker_on_rank_cpu
                  ? "rank r's thread and its engine worker on CPU r, modulo the process's CPU set"
                  : "rank r's thread on CPU r, its engine worker on CPU (N+1)+r; workers past the "
                    "process's CPU set share the CPUs of the workers of ranks 2, 3, ... (never "
                    "those of ranks 0 and 1 or their workers)";
  doc["options"] = jo;
  const std::string polling =
      o.yield_when_idle
          ? "yield-when-idle: engine EngineOptions::yield_when_idle=true (waiters sleep up to "
            "50 us per poll once 200 polls and 100 us found nothing, the worker after 200 idle "
            "polls; the worker sleeps while a user thread waits and polls); raw loop does as the "
            "waiters (200 idle polls and 100 us, then sleep_for(50 us) per poll)"
          : "busy-poll: engine yield_when_idle=false (waiters never sleep; the worker sleeps "
            "while a user thread waits and polls), raw loop never sleeps";
  doc["polling"] = polling;
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  doc["note"] =
      "Each run forks 1 sender + N peers on this machine (" + std::to_string(cpus) +
      " CPUs online): with more processes than cores the numbers include scheduling and "
      "sleep/wake-up noise. Latency = one iteration at a time, from the first post to local "
      "completion of every write and one zero-byte ack (immediate) from each peer; rate = "
      "rate_iters iterations with at most `window` in flight, then the acks. Ratios are "
      "engine/raw (>1: engine slower).";
  std::printf("moelink-fabric-bench: engine / raw (same run); %s\n%s\n", polling.c_str(),
              doc["note"].get<std::string>().c_str());

  json runs = json::array();
  int failures = 0, ran = 0;
  for (const auto& prov : providers) {
    if (!provider_available(prov)) {
      std::printf("%s: provider unavailable%s\n", prov.c_str(),
                  skip_unavailable ? " (skipped)" : "");
      json r;
      r["provider"] = prov;
      r["skipped"] = "provider unavailable";
      runs.push_back(r);
      if (!skip_unavailable) ++failures;
      continue;
    }
    for (int n : peers) {
      json r;
      const auto t0 = std::chrono::steady_clock::now();
      try {
        r = run_config(prov, n, o, timeout_s);
        ++ran;
      } catch (const std::exception& e) {
        std::printf("%s %d peers: FAILED: %s\n", prov.c_str(), n, e.what());
        r["peers"] = n;
        r["error"] = e.what();
        ++failures;
      }
      r["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      json out;
      out["provider"] = prov;
      for (auto it = r.begin(); it != r.end(); ++it) out[it.key()] = it.value();
      if (out.contains("ops")) print_run(prov, out, threshold);
      runs.push_back(out);
    }
  }
  doc["runs"] = runs;
  // One number per provider and overall: the median over cells of the
  // engine / raw ratios (latency p50 and rate time), which is how the
  // comparison is read; single cells move with the machine's noise.
  {
    json summary = json::object();
    std::vector<double> all;
    for (const auto& prov : providers) {
      std::vector<double> cells;
      for (const auto& run : runs) {
        if (run["provider"] != prov || !run.contains("ops")) continue;
        for (const auto& e : run["ops"]) {
          const auto& r = e["engine_over_raw"];
          cells.push_back(r["latency_p50"].get<double>());
          if (r.contains("rate_time")) cells.push_back(r["rate_time"].get<double>());
        }
      }
      if (cells.empty()) continue;
      all.insert(all.end(), cells.begin(), cells.end());
      summary[prov] = {{"median_engine_over_raw", median(cells)}, {"cells", cells.size()}};
      std::printf("%-4s median engine / raw over %zu cells: x%.3f\n", prov.c_str(), cells.size(),
                  median(cells));
    }
    if (!all.empty()) {
      summary["all"] = {{"median_engine_over_raw", median(all)}, {"cells", all.size()}};
      std::printf("all  median engine / raw over %zu cells: x%.3f (target <= %.2f)\n", all.size(),
                  median(all), 1 + threshold);
    }
    doc["summary"] = summary;
  }
  // The software cost, free of scheduling noise (one process, one thread).
  if (cost_iters > 0) {
    json costs = json::object();
    for (const auto& prov : providers) {
      if (!provider_available(prov)) continue;
      try {
        json c = cpu_cost_in_child(prov, cost_iters, 3);
        std::printf(
            "%-4s cpu cost per 8-byte write, one thread: post %.3f / %.3f us (%+.3f), round "
            "%.3f / %.3f us (%+.3f)  (engine / raw)\n",
            prov.c_str(), c["engine"]["post_us_p50"].get<double>(),
            c["raw"]["post_us_p50"].get<double>(), c["engine_minus_raw_us"]["post"].get<double>(),
            c["engine"]["round_us_p50"].get<double>(), c["raw"]["round_us_p50"].get<double>(),
            c["engine_minus_raw_us"]["round"].get<double>());
        std::printf("%-4s cpu cost per write of a paged-write stream (2 threads): %.3f / %.3f us "
                    "(x%.2f)  (engine / raw)\n",
                    prov.c_str(), c["engine"]["stream_us_per_write_p50"].get<double>(),
                    c["raw"]["stream_us_per_write_p50"].get<double>(),
                    c["engine_over_raw"]["stream"].get<double>());
        costs[prov] = c;
      } catch (const std::exception& e) {
        std::printf("%s cpu cost: FAILED: %s\n", prov.c_str(), e.what());
        costs[prov]["error"] = e.what();
        ++failures;
      }
    }
    doc["cpu_cost"] = costs;
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << doc.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "moelink-fabric-bench: cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (failures) return 1;
  if (ran == 0) return 77;
  return 0;
}
