// moelink-bench: see bench/README.md. Parses the options (no CUDA call, so
// --nproc can fork safely afterwards) and runs the ranks.
#include "bench.h"
#include "launcher.h"
#include "options.h"

int main(int argc, char** argv) {
  moelink_bench::BenchOptions o;
  int rc = 0;
  if (!moelink_bench::parse_options(argc, argv, o, rc)) return rc;
  auto body = [&o](moelink::Bootstrap& boot, int local_rank) {
    return moelink_bench::run_rank(o, boot, local_rank);
  };
  return o.nproc > 0 ? moelink_bench::run_forked(o.nproc, body)
                     : moelink_bench::run_from_env(body);
}
