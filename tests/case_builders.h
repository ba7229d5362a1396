// Building blocks of the parameterized all-to-all test lists: a named case,
// a spec from a shape and dtypes for any backend, and `with` for tweaks.
#pragma once

#include <algorithm>
#include <ostream>
#include <string>

#include "all_to_all_cases.h"

namespace moelink_test {

struct NamedCase {
  std::string name;
  CaseSpec spec;
};
inline void PrintTo(const NamedCase& c, std::ostream* os) {
  *os << c.name << " " << c.spec.describe();
}
// For INSTANTIATE_TEST_SUITE_P: the case's name.
struct CaseName {
  template <typename Info>
  std::string operator()(const Info& i) const {
    return i.param.name;
  }
};

// A spec for `backend` with the given shape; fp8 gets H / 128 scales (at
// least 1); the rest default.
inline CaseSpec make_spec(moelink::Backend backend, int W, int dp, int64_t T, int E, int k,
                          int64_t H, moelink::DType in, moelink::DType out, moelink::DType y) {
  CaseSpec s;
  s.backend = backend;
  s.world_size = W;
  s.dp_size = dp;
  s.max_num_tokens = T;
  s.num_experts = E;
  s.experts_per_token = k;
  s.hidden_dim = H;
  s.in_dtype = in;
  s.hidden_dim_scale = in == moelink::DType::kFloat8E4M3
                           ? static_cast<int>(std::max<int64_t>(H / 128, 1))
                           : 0;
  s.out_dtype = out;
  s.y_dtype = y;
  return s;
}

template <typename F>
CaseSpec with(CaseSpec s, F f) {
  f(s);
  return s;
}

constexpr moelink::DType kFp8 = moelink::DType::kFloat8E4M3, kBf16 = moelink::DType::kBFloat16,
                         kFp16 = moelink::DType::kFloat16, kFp32 = moelink::DType::kFloat32;

}  // namespace moelink_test
