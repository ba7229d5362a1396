// The tests' reference for the expert kernels: plain loops in fp64 on the
// dequantized inputs, written from the definitions in moelink/experts.h and
// independent of src/ (the element formats come from ref_dtype.h). Also the
// tests' own block quantizer for inputs (weights in 128x128 blocks,
// activations in 1x128 groups) and the tolerance checks.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace moelink_test {

constexpr int kGroup = 128;

// One output row of a block-scaled GEMM: y[n] = sum_k x[k] x_scale[k/128]
// w[n][k] w_scale[n/128][k/128], and sum_k |each term| (what accumulation
// error scales with).
struct RefRow {
  std::vector<double> y, abs_sum;
};
RefRow ref_gemm_row(const uint8_t* x, const float* x_scale, const uint8_t* w,
                    const float* w_scale, int64_t n, int64_t k);

double ref_silu_mul(double gate, double up);

// The 1x128 quantization as experts.h defines it, on exact inputs:
// scale = max(amax, 1e-10) / 448 (rounded to fp32), q = e4m3(v / scale).
void ref_quantize_row(const double* v, int64_t cols, uint8_t* q, float* scale);

// ---------------------------------------------------------------- inputs

// fp8 activations of `rows` x `cols` (normal values with a few outliers),
// quantized per 1x128 group by ref_quantize_row.
void random_fp8_rows(std::mt19937_64& rng, int64_t rows, int64_t cols, uint8_t* q, float* scale);
// bf16 activations (bit patterns), normal with a few outliers and zero groups.
std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, double sigma);
// A weight [n, k] in 128x128 blocks: q fp8 [n, k], scale fp32 [n/128, k/128].
void random_block_weight(std::mt19937_64& rng, int64_t n, int64_t k, uint8_t* q, float* scale);

// ---------------------------------------------------------------- checks

// Accumulates how a kernel's bf16 row compares with a RefRow: every element
// within 2^-8 |ref| (bf16 rounding) + acc_tol * abs_sum (accumulation and,
// for forward(), the rare fp8 requantization flip), and the relative L2
// error over everything seen.
class GemmCheck {
 public:
  explicit GemmCheck(double acc_tol) : acc_tol_(acc_tol) {}
  void row(const uint16_t* y_bf16, const RefRow& ref, const std::string& where);
  double rel_l2() const;
  int64_t bad() const { return bad_; }
  const std::string& first_bad() const { return first_bad_; }
  int64_t checked() const { return checked_; }

 private:
  double acc_tol_;
  double err2_ = 0, ref2_ = 0;
  int64_t bad_ = 0, checked_ = 0;
  std::string first_bad_;
};

// A kernel's 1x128 quantization of values v against the definition: the
// scale within 1e-6 of max(amax, 1e-10)/448, every dequantized value within
// half an e4m3 ulp (+1e-5 relative for the kernel's fp32 arithmetic).
// Returns "" or what was wrong first.
std::string check_quantized_row(const double* v, int64_t cols, const uint8_t* q,
                                const float* scale, int64_t scale_stride);

}  // namespace moelink_test
