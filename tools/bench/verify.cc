#include "verify.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "numeric.h"

namespace moelink_bench {

void verify_counts(const std::string& who, int rank, const std::vector<int32_t>& got,
                   const std::vector<int32_t>& want) {
  int64_t sum_got = 0, sum_want = 0;
  for (size_t j = 0; j < want.size(); ++j) {
    sum_got += got[j];
    sum_want += want[j];
  }
  for (size_t j = 0; j < want.size(); ++j)
    if (got[j] != want[j]) {
      std::ostringstream os;
      os << who << ": rank " << rank << ": local expert " << j << " received " << got[j]
         << " rows, the routing sends it " << want[j] << " (total " << sum_got << " vs "
         << sum_want << ")";
      throw std::runtime_error(os.str());
    }
}

void verify_combine(const std::string& who, int rank, const Workload& w,
                    const std::vector<uint16_t>& got, const std::vector<float>& expected) {
  const bool bf16 = w.config.out_dtype == moelink::DType::kBFloat16;
  // Per rounding a relative error of 2^-8 (bf16); one rounding per expert
  // rank plus the final one, with a margin for the summation order.
  const double rel = (w.W + 3) * std::ldexp(1.0, -8);
  for (size_t i = 0; i < expected.size(); ++i) {
    const double g = out_to_float(got[i], bf16), e = expected[i];
    if (!(std::fabs(g - e) <= rel * std::fabs(e) + 1e-4)) {
      std::ostringstream os;
      os << who << ": rank " << rank << ": combine result wrong at token " << i / w.H
         << ", element " << i % w.H << ": got " << g << ", expected " << e
         << " (identity experts, routing set 0)";
      throw std::runtime_error(os.str());
    }
  }
}

}  // namespace moelink_bench
