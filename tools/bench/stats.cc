#include "stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moelink_bench {

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

Stat summarize(moelink::Bootstrap& b, const std::vector<double>& us) {
  Stat s;
  s.n = us.size();
  s.p50 = percentile(us, 0.5);
  s.p90 = percentile(us, 0.9);
  s.mean = us.empty() ? std::nan("") : std::accumulate(us.begin(), us.end(), 0.0) / us.size();
  s.rank_p50.resize(b.world_size());
  b.all_gather(&s.p50, s.rank_p50.data(), sizeof(double));
  return s;
}

}  // namespace moelink_bench
