#include "experts/expert_reference.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "ref_dtype.h"

namespace moelink_test {

namespace {

// fp8_e4m3_to_double of every byte.
const std::vector<double>& e4m3_values() {
  static const std::vector<double> table = [] {
    std::vector<double> t(256);
    for (int b = 0; b < 256; ++b) t[b] = fp8_e4m3_to_double(static_cast<uint8_t>(b));
    return t;
  }();
  return table;
}

}  // namespace

RefRow ref_gemm_row(const uint8_t* x, const float* x_scale, const uint8_t* w,
                    const float* w_scale, int64_t n, int64_t k) {
  const std::vector<double>& e4m3 = e4m3_values();
  RefRow r{std::vector<double>(n), std::vector<double>(n)};
  std::vector<double> xd(k);
  for (int64_t i = 0; i < k; ++i) xd[i] = e4m3[x[i]] * x_scale[i / kGroup];
  const int64_t kb = k / kGroup;
  for (int64_t j = 0; j < n; ++j) {
    double acc = 0, abs_acc = 0;
    const uint8_t* wj = w + j * k;
    const float* sj = w_scale + (j / kGroup) * kb;
    for (int64_t i = 0; i < k; ++i) {
      const double t = xd[i] * e4m3[wj[i]] * sj[i / kGroup];
      acc += t;
      abs_acc += std::fabs(t);
    }
    r.y[j] = acc;
    r.abs_sum[j] = abs_acc;
  }
  return r;
}

double ref_silu_mul(double gate, double up) { return gate / (1.0 + std::exp(-gate)) * up; }

void ref_quantize_row(const double* v, int64_t cols, uint8_t* q, float* scale) {
  for (int64_t g = 0; g < cols / kGroup; ++g) {
    double amax = 0;
    for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[g * kGroup + i]));
    const float s = static_cast<float>(std::max(amax, 1e-10) / 448.0);
    scale[g] = s;
    for (int i = 0; i < kGroup; ++i)
      q[g * kGroup + i] = fp8_e4m3_bits_exact(round_to_e4m3_sat(v[g * kGroup + i] / s));
  }
}

namespace {

// Normal values with one in 64 an outlier eight times larger.
double activation(std::mt19937_64& rng, double sigma) {
  std::normal_distribution<double> nd(0.0, sigma);
  std::uniform_int_distribution<int> pick(0, 63);
  return nd(rng) * (pick(rng) == 0 ? 8.0 : 1.0);
}

}  // namespace

void random_fp8_rows(std::mt19937_64& rng, int64_t rows, int64_t cols, uint8_t* q, float* scale) {
  std::vector<double> v(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& e : v) e = activation(rng, 1.0);
    ref_quantize_row(v.data(), cols, q + r * cols, scale + r * (cols / kGroup));
  }
}

std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, double sigma) {
  std::vector<uint16_t> out(n);
  std::uniform_int_distribution<int> zero_group(0, 31);
  for (size_t i = 0; i < n; i += kGroup) {
    const bool zeros = zero_group(rng) == 0;  // a group of zeros now and then
    for (size_t j = i; j < std::min(n, i + kGroup); ++j)
      out[j] = bf16_bits_exact(round_to_bf16(zeros ? 0.0 : activation(rng, sigma)));
  }
  return out;
}

void random_block_weight(std::mt19937_64& rng, int64_t n, int64_t k, uint8_t* q, float* scale) {
  // A checkpoint's block holds normal-looking values scaled so that its
  // largest is near 448: draw the fp8 codes from a table of 2^16 such
  // codes (quantized normals of sigma 448 / 4; one 64-bit draw gives four
  // codes), and a scale per block around 0.05 / 112.
  static const std::vector<uint8_t> codes = [] {
    std::mt19937_64 g(12345);
    std::normal_distribution<double> nd(0.0, 448.0 / 4);
    std::vector<uint8_t> c(1 << 16);
    for (auto& e : c) e = fp8_e4m3_bits_exact(round_to_e4m3_sat(nd(g)));
    return c;
  }();
  const int64_t total = n * k;
  for (int64_t i = 0; i < total; i += 4) {
    uint64_t bits = rng();
    for (int64_t j = i; j < std::min(total, i + 4); ++j, bits >>= 16) q[j] = codes[bits & 0xffff];
  }
  std::uniform_real_distribution<double> around(0.5, 1.5);
  for (int64_t b = 0; b < (n / kGroup) * (k / kGroup); ++b)
    scale[b] = static_cast<float>(around(rng) * 0.05 / 112.0);
}

void GemmCheck::row(const uint16_t* y_bf16, const RefRow& ref, const std::string& where) {
  for (size_t j = 0; j < ref.y.size(); ++j) {
    const double got = bf16_to_double(y_bf16[j]), want = ref.y[j];
    const double tol = std::ldexp(std::fabs(want), -8) + acc_tol_ * ref.abs_sum[j] + 1e-30;
    const double d = got - want;
    err2_ += d * d;
    ref2_ += want * want;
    ++checked_;
    if (!(std::fabs(d) <= tol)) {  // NaN fails too
      if (bad_++ == 0) {
        std::ostringstream os;
        os << where << " column " << j << ": got " << got << ", expected " << want
           << " (tolerance " << tol << ")";
        first_bad_ = os.str();
      }
    }
  }
}

double GemmCheck::rel_l2() const { return ref2_ > 0 ? std::sqrt(err2_ / ref2_) : std::sqrt(err2_); }

std::string check_quantized_row(const double* v, int64_t cols, const uint8_t* q,
                                const float* scale, int64_t scale_stride) {
  for (int64_t g = 0; g < cols / kGroup; ++g) {
    double amax = 0;
    for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[g * kGroup + i]));
    const double want_scale = std::max(amax, 1e-10) / 448.0;
    const double s = scale[g * scale_stride];
    if (!(std::fabs(s - want_scale) <= 1e-6 * want_scale)) {
      std::ostringstream os;
      os << "group " << g << ": scale " << s << ", expected " << want_scale;
      return os.str();
    }
    for (int i = 0; i < kGroup; ++i) {
      const double t = v[g * kGroup + i] / s;  // the value before rounding, in scale units
      const double at = std::fabs(t);
      int e;
      std::frexp(at, &e);
      const double ulp = at < std::ldexp(1.0, -6) ? std::ldexp(1.0, -9) : std::ldexp(1.0, e - 1 - 3);
      const double got = fp8_e4m3_to_double(q[g * kGroup + i]);
      const double tol = 0.5 * ulp + 1e-5 * at + 1e-12;
      if (!(std::fabs(got - std::fmax(-448.0, std::fmin(448.0, t))) <= tol)) {
        std::ostringstream os;
        os << "group " << g << " element " << i << ": q = " << got << " (x scale " << s
           << "), expected " << t << " +- " << tol;
        return os.str();
      }
    }
  }
  return "";
}

}  // namespace moelink_test
