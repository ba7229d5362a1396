#include "reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "ref_dtype.h"

namespace moelink_test {

using moelink::DType;

namespace {

size_t elem_size(DType t) { return moelink::dtype_size(t); }

bool is_valid_expert(int64_t e, int num_experts) { return e >= 0 && e < num_experts; }

bool all_bytes_equal(const uint8_t* p, size_t n, uint8_t b) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != b) return false;
  return true;
}

std::string describe(const TokenRef& r) {
  return "(group " + std::to_string(r.group) + ", token " + std::to_string(r.token) + ")";
}

}  // namespace

std::vector<double> expert_function(const moelink::Config& c, DType y_dtype, bool identity,
                                    int expert, const uint8_t* x_row, const float* scale_row) {
  const int64_t H = c.hidden_dim;
  const int S = c.hidden_dim_scale;
  const double factor = identity ? 1.0 : 1.0 + 0.25 * (expert % 7);
  std::vector<double> y(H);
  for (int64_t h = 0; h < H; ++h) {
    double v = decode_element(c.in_dtype, x_row, h);
    if (S > 0) v *= static_cast<double>(scale_row[h * S / H]);
    y[h] = round_to_dtype(y_dtype, v * factor);
  }
  return y;
}

Reference::Reference(const moelink::Config& config, std::vector<GroupInputs> groups)
    : config_(config), groups_(std::move(groups)) {
  const int W = config_.world_size, L = config_.num_local_experts(), E = config_.num_experts;
  const int k = config_.experts_per_token;
  expected_.assign(static_cast<size_t>(W) * L, {});
  for (int g = 0; g < static_cast<int>(groups_.size()); ++g) {
    for (int64_t t = 0; t < m(g); ++t) {
      by_key_[token_key(g, t)].push_back({g, t});
      for (int i = 0; i < k; ++i) {
        const int64_t e = groups_[g].indices[t * k + i];
        if (is_valid_expert(e, E)) expected_[e].push_back({g, t});  // e == rank * L + j
      }
    }
  }
  for (auto& v : expected_) std::sort(v.begin(), v.end());
}

int64_t Reference::rows(int group) const {
  const int64_t r = groups_[group].rows;
  return r < 0 ? config_.max_num_tokens : std::min(r, config_.max_num_tokens);
}

int64_t Reference::m(int group) const { return std::clamp<int64_t>(groups_[group].m, 0, rows(group)); }

bool Reference::overflows(int expert) const {
  return static_cast<int64_t>(expected_[expert].size()) > config_.expert_capacity();
}

const std::vector<TokenRef>& Reference::expected_tokens(int rank, int local_expert) const {
  return expected_[static_cast<size_t>(rank) * config_.num_local_experts() + local_expert];
}

std::string Reference::token_key(int group, int64_t t) const {
  const size_t row = config_.hidden_dim * elem_size(config_.in_dtype);
  const size_t S = config_.hidden_dim_scale;
  std::string key(reinterpret_cast<const char*>(groups_[group].x.data() + t * row), row);
  key.append(reinterpret_cast<const char*>(groups_[group].scales.data() + t * S), S * 4);
  return key;
}

std::vector<std::string> Reference::check_dispatch(int rank, const DispatchResult& got,
                                                   size_t max_problems) const {
  const int L = config_.num_local_experts();
  const int64_t C = config_.expert_capacity();
  const size_t row = config_.hidden_dim * elem_size(config_.in_dtype);
  const size_t S = config_.hidden_dim_scale;
  std::vector<std::string> problems;
  auto report = [&](int j, const std::string& what) {
    if (problems.size() < max_problems)
      problems.push_back("rank " + std::to_string(rank) + ", local expert " + std::to_string(j) +
                         " (global " + std::to_string(rank * L + j) + "): " + what);
  };
  for (int j = 0; j < L; ++j) {
    const auto& want = expected_tokens(rank, j);
    const bool overflow = overflows(rank * L + j);
    const int64_t want_count = std::min<int64_t>(static_cast<int64_t>(want.size()), C);
    const int32_t count = got.counts[j];
    if (count != want_count)
      report(j, "out_expert_num_tokens = " + std::to_string(count) + ", expected " +
                    std::to_string(want_count) +
                    (overflow ? " (its capacity C; " + std::to_string(want.size()) +
                                    " routes were sent)"
                              : std::string()));
    std::map<TokenRef, int> remaining;
    for (const auto& r : want) ++remaining[r];
    const int64_t n = std::clamp<int64_t>(count, 0, C);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* xr = got.x.data() + (j * C + i) * row;
      const uint32_t* sr = got.scales.data() + (j * C + i) * S;
      std::string key(reinterpret_cast<const char*>(xr), row);
      key.append(reinterpret_cast<const char*>(sr), S * 4);
      auto it = by_key_.find(key);
      bool matched = false;
      if (it != by_key_.end()) {
        for (const auto& cand : it->second) {
          auto rem = remaining.find(cand);
          if (rem != remaining.end() && rem->second > 0) {
            --rem->second;
            matched = true;
            break;
          }
        }
        if (!matched)
          report(j, "row " + std::to_string(i) + " holds token " + describe(it->second[0]) +
                        ", which is not routed to this expert (or not that many times)");
      } else if (all_bytes_equal(xr, row, kPoisonTokenByte)) {
        report(j, "row " + std::to_string(i) + " < count was not written (still poison)");
      } else if (problems.size() < max_problems) {
        // Diagnose: a known token row with the wrong scales, or garbage.
        std::string what = "row " + std::to_string(i) + " matches no token t < m of any group";
        for (int g = 0; g < static_cast<int>(groups_.size()); ++g)
          for (int64_t t = 0; t < static_cast<int64_t>(groups_[g].x.size() / row); ++t)
            if (std::memcmp(groups_[g].x.data() + t * row, xr, row) == 0)
              what = "row " + std::to_string(i) + " holds the x of token " + describe({g, t}) +
                     (t >= m(g) ? " (t >= m: must not be sent)" : " but wrong scales");
        report(j, what);
      }
    }
    for (const auto& [tok, left] : remaining)
      if (left > 0 && !overflow)  // an overflowing expert drops some routes
        report(j, "token " + describe(tok) + " is missing (" + std::to_string(left) +
                      " route(s) not delivered)");
    for (int64_t i = n; i < C; ++i) {
      const uint8_t* xr = got.x.data() + (j * C + i) * row;
      const uint32_t* sr = got.scales.data() + (j * C + i) * S;
      bool ok = all_bytes_equal(xr, row, kPoisonTokenByte);
      for (size_t s = 0; s < S; ++s) ok = ok && sr[s] == kPoisonScaleBits;
      if (!ok) {
        report(j, "row " + std::to_string(i) + " >= count " + std::to_string(count) +
                      " was written (the contract leaves rows >= count untouched)");
        break;
      }
    }
  }
  return problems;
}

std::vector<double> Reference::expected_combine(int group, const ExpertOutputFn& y) const {
  const int64_t H = config_.hidden_dim;
  const int k = config_.experts_per_token;
  const GroupInputs& in = groups_[group];
  std::vector<double> out(static_cast<size_t>(m(group)) * H, 0.0);
  for (int64_t t = 0; t < m(group); ++t)
    for (int i = 0; i < k; ++i) {
      const int64_t e = in.indices[t * k + i];
      if (!is_valid_expert(e, config_.num_experts)) continue;
      const std::vector<double> yr = y(static_cast<int>(e), group, t);
      const double w = in.weights[t * k + i];
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += w * yr[h];
    }
  return out;
}

std::vector<std::string> Reference::check_combine(int group, const ExpertOutputFn& y,
                                                  const std::vector<uint8_t>& before,
                                                  const std::vector<uint8_t>& after,
                                                  bool accumulate, size_t max_problems) const {
  const int64_t H = config_.hidden_dim, T = rows(group);
  const int k = config_.experts_per_token;
  const DType out = config_.out_dtype;
  const size_t row = H * elem_size(out);
  const double u = unit_roundoff(out);
  // Below the smallest normal the format's spacing is absolute.
  const double abs_floor = out == DType::kFloat16 ? std::ldexp(1.0, -23) : std::ldexp(1.0, -130);
  const GroupInputs& in = groups_[group];
  std::vector<std::string> problems;
  auto report = [&](const std::string& what) {
    if (problems.size() < max_problems) problems.push_back(what);
  };
  const int64_t mg = m(group);
  for (int64_t t = 0; t < mg; ++t) {
    bool unspecified = false;
    for (int i = 0; i < k; ++i) {
      const int64_t e = in.indices[t * k + i];
      unspecified = unspecified || (is_valid_expert(e, config_.num_experts) && overflows(e));
    }
    if (unspecified) continue;
    std::vector<double> sum(H, 0.0), mag(H, 0.0);
    for (int i = 0; i < k; ++i) {
      const int64_t e = in.indices[t * k + i];
      if (!is_valid_expert(e, config_.num_experts)) continue;
      const std::vector<double> yr = y(static_cast<int>(e), group, t);
      const double w = in.weights[t * k + i];
      for (int64_t h = 0; h < H; ++h) {
        sum[h] += w * yr[h];
        mag[h] += std::fabs(w * yr[h]);
      }
    }
    int bad_in_row = 0;
    for (int64_t h = 0; h < H; ++h) {
      double want = sum[h], m_abs = mag[h];
      if (accumulate) {
        const double prev = decode_element(out, before.data() + t * row, h);
        want += prev;
        m_abs += std::fabs(prev);
      }
      const double got = decode_element(out, after.data() + t * row, h);
      const double tol = 2.0 * u * m_abs * (1.0 + 1.0 / 64) + abs_floor;
      if (!(std::fabs(got - want) <= tol)) {
        if (bad_in_row++ < 3) {
          std::ostringstream os;
          os.precision(9);
          os << "out_tokens[" << t << "][" << h << "] = " << got << ", expected " << want
             << " +- " << tol << " (group " << group << ", m = " << mg << ")";
          report(os.str());
        }
      }
    }
    if (bad_in_row > 3)
      report("out_tokens row " + std::to_string(t) + ": " + std::to_string(bad_in_row) +
             " of " + std::to_string(H) + " elements wrong");
  }
  for (int64_t t = mg; t < T; ++t)
    if (std::memcmp(before.data() + t * row, after.data() + t * row, row) != 0) {
      report("out_tokens row " + std::to_string(t) + " >= m = " + std::to_string(mg) +
             " was modified (rows t >= m must be left untouched)");
      break;
    }
  return problems;
}

}  // namespace moelink_test
