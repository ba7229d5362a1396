// Keeps the most recent latency samples and answers percentiles over them.
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

namespace moelink::scheduler {

class LatencyRecorder {
 public:
  explicit LatencyRecorder(size_t window = 1 << 16) : samples_(window) {}
  void add(double v) {
    samples_[next_ % samples_.size()] = v;
    ++next_;
  }
  size_t count() const { return next_; }
  // p in [0, 1]; 0 when there are no samples.
  double percentile(double p) const {
    const size_t n = std::min(next_, samples_.size());
    if (n == 0) return 0;
    std::vector<double> s(samples_.begin(), samples_.begin() + static_cast<std::ptrdiff_t>(n));
    const size_t k = std::min(n - 1, static_cast<size_t>(p * static_cast<double>(n - 1) + 0.5));
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(k), s.end());
    return s[k];
  }
  double max() const {
    const size_t n = std::min(next_, samples_.size());
    return n == 0 ? 0 : *std::max_element(samples_.begin(), samples_.begin() + static_cast<std::ptrdiff_t>(n));
  }

 private:
  std::vector<double> samples_;
  size_t next_ = 0;
};

}  // namespace moelink::scheduler
