// One independent reference of the dispatch/combine contract
// (include/moelink/all_to_all.h), used by every CPU and GPU test. It shares
// no code with src/: it reads the public Config only.
//
// Dispatch: for rank r and local expert j (global id e = r * L + j), the
// expected rows are the multiset of routes (group g, token t < m_g, slot i)
// with indices_g[t][i] == e: every DP group counted once, an expert repeated
// in a token's top-k counted once per slot, -1 and ids outside [0, E)
// dropped. Combine: on every rank of group g, out[t] = sum over valid slots i
// of weights[t][i] * y(e_i, g, t) (+ the previous out[t] when accumulating).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "moelink/config.h"
#include "moelink/types.h"

namespace moelink_test {

// Poison written into every output before each call. No generated token,
// scale or value has these bit patterns (see all_to_all_cases.cc).
constexpr uint8_t kPoisonTokenByte = 0x7F;        // fp8 NaN; bf16 0x7F7F = 3.4e38; fp16 NaN
constexpr uint32_t kPoisonScaleBits = 0x7fc00001;  // an fp32 NaN with a payload
constexpr uint8_t kPoisonOutByte = 0xFF;          // NaN in bf16 / fp16 / fp32
constexpr uint8_t kPoisonCountByte = 0xFF;        // counts read -1 until written

// One DP group's inputs, as every replica of the group passes them.
struct GroupInputs {
  int64_t m = 0;                 // bound_m as passed (clamped by the reference)
  int64_t rows = -1;             // rows of the input tensors; -1: max_num_tokens
  std::vector<uint8_t> x;        // [T][H * sizeof(in_dtype)]
  std::vector<float> scales;     // [T][S]
  std::vector<int64_t> indices;  // [T][k]; -1 = no route, other out-of-range ids = bad
  std::vector<float> weights;    // [T][k]
};

struct TokenRef {
  int group = 0;
  int64_t token = 0;
  bool operator<(const TokenRef& o) const {
    return group != o.group ? group < o.group : token < o.token;
  }
  bool operator==(const TokenRef& o) const { return group == o.group && token == o.token; }
};

// y(global expert, group, token): the expert's output row for that token, as
// the values the test stored in expert_y (already rounded to its dtype).
using ExpertOutputFn = std::function<std::vector<double>(int expert, int group, int64_t token)>;

// How the tests' expert "computes": y[h] = dequant(x)[h] * factor(e), rounded
// to y_dtype. dequant(x)[h] = x[h] * scale[h * S / H] (x[h] when S == 0).
// `identity` uses factor 1 (so y == x when y_dtype == in_dtype).
std::vector<double> expert_function(const moelink::Config& c, moelink::DType y_dtype,
                                    bool identity, int expert, const uint8_t* x_row,
                                    const float* scale_row);

// What one rank's dispatch wrote, copied to the host. Scales are gathered into
// a dense [L][C][S] array of fp32 bit patterns (whatever the strides were).
struct DispatchResult {
  std::vector<int32_t> counts;     // [L]
  std::vector<uint8_t> x;          // [L][C][H * sizeof(in_dtype)]
  std::vector<uint32_t> scales;    // [L][C][S]
};

class Reference {
 public:
  Reference(const moelink::Config& config, std::vector<GroupInputs> groups);

  const moelink::Config& config() const { return config_; }
  // m of group g after the contract's clamp to [0, min(T, input rows)].
  int64_t m(int group) const;
  // Rows of group g's input tensors (and out_tokens).
  int64_t rows(int group) const;
  // True when more routes go to global expert e than it has rows (C): the
  // backend drops the excess (which ones is unspecified) and flags it.
  bool overflows(int expert) const;
  const GroupInputs& group(int g) const { return groups_[g]; }
  // Sorted multiset of tokens routed to local expert j of `rank`.
  const std::vector<TokenRef>& expected_tokens(int rank, int local_expert) const;

  // Compares a rank's dispatch outputs with the contract. Returns the
  // problems found (empty: all good), at most `max_problems` of them. An
  // overflowing expert must hold exactly C rows, each one of its routes.
  std::vector<std::string> check_dispatch(int rank, const DispatchResult& got,
                                          size_t max_problems = 20) const;

  // Expected out[t][h] (t < m of the group) in double, without accumulation.
  std::vector<double> expected_combine(int group, const ExpertOutputFn& y) const;

  // Compares a rank's combine output with the contract: rows t < m within
  // 2 unit roundoffs of out_dtype of sum_i |w_i * y_i[h]| (+ |before[t][h]|
  // when accumulating), rows t >= m bitwise equal to `before`. Tokens with a
  // route to an overflowing expert are not checked (their sum is unspecified).
  std::vector<std::string> check_combine(int group, const ExpertOutputFn& y,
                                         const std::vector<uint8_t>& before,
                                         const std::vector<uint8_t>& after, bool accumulate,
                                         size_t max_problems = 20) const;

 private:
  std::string token_key(int group, int64_t t) const;

  moelink::Config config_;
  std::vector<GroupInputs> groups_;
  // expected_[rank * L + j]: sorted tokens routed to that expert.
  std::vector<std::vector<TokenRef>> expected_;
  // Bytes of (token row, scale row) -> tokens with those bytes (t < m).
  std::unordered_map<std::string, std::vector<TokenRef>> by_key_;
};

}  // namespace moelink_test
