// The expert kernels as plain loops on host tensors (ExpertDevice::kCPU):
// what the cpu backend runs, and what CI runs. Same arithmetic as the CUDA
// kernels: per-128 partial sums in fp32 scaled by the two block scales and
// accumulated in fp32, one rounding to bf16; the group quantization of
// fp8_group_quant.h with the same fp8 rounding (core/float_convert.h).
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "core/float_convert.h"
#include "core/layout.h"
#include "experts/experts_impl.h"
#include "experts/fp8_group_quant.h"

namespace moelink::detail {
namespace {

using experts::ExpertErrorRecord;
using experts::ExpertOp;
using experts::kQuantGroup;

// Element (i, j[, k]) of a host tensor.
template <class T>
T* at(const Tensor& t, int64_t i, int64_t j, int64_t k = 0) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) +
                              (i * t.stride[0] + j * t.stride[1] + k * t.stride[2]) *
                                  static_cast<int64_t>(dtype_size(t.dtype)));
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = e4m3_to_f32(static_cast<uint8_t>(b));
    return t;
  }();
  return table;
}

class CpuExperts final : public ExpertsImpl {
 public:
  explicit CpuExperts(const ExpertConfig& c) : config_(c) {
    const int64_t L = c.num_experts, C = c.max_rows, I = c.intermediate_dim;
    gate_up_.resize(static_cast<size_t>(L * C * 2 * I));
    act_q_.resize(static_cast<size_t>(L * C * I));
    act_scale_.resize(static_cast<size_t>(L * C * (I / kQuantGroup)));
    ws_.gate_up = tensor3(gate_up_.data(), DType::kBFloat16, L, C, 2 * I);
    ws_.act_q = tensor3(act_q_.data(), DType::kFloat8E4M3, L, C, I);
    ws_.act_scale = tensor3(act_scale_.data(), DType::kFloat32, L, C, I / kQuantGroup);
  }

  void grouped_gemm(const Tensor& y, const Tensor& count, const Tensor& x, const Tensor& x_scale,
                    const Tensor& w, const Tensor& w_scale, ExpertOp op, int64_t,
                    cudaStream_t) override {
    const int64_t C = x.shape[1];
    for (int64_t g = 0; g < x.shape[0]; ++g)
      gemm_group(y, x, x_scale, w, w_scale, g, rows_of(count, g, C, op));
  }

  void silu_mul_quant(const Tensor& out_q, const Tensor& out_scale, const Tensor& gate_up,
                      const Tensor& count, ExpertOp op, cudaStream_t) override {
    const int64_t C = gate_up.shape[1], I = gate_up.shape[2] / 2;
    for (int64_t g = 0; g < gate_up.shape[0]; ++g) {
      const int64_t rows = rows_of(count, g, C, op);
      for (int64_t r = 0; r < rows; ++r)
        quantize_row(out_q, out_scale, g, r, I, [&](int64_t i) {
          return experts::silu_mul(bf16_to_f32(*at<uint16_t>(gate_up, g, r, i)),
                                   bf16_to_f32(*at<uint16_t>(gate_up, g, r, I + i)));
        });
    }
  }

  void quantize(const Tensor& out_q, const Tensor& out_scale, const Tensor& x,
                const Tensor& bound_m, cudaStream_t) override {
    const Tensor q = as_one_group(out_q), s = as_one_group(out_scale), src = as_one_group(x);
    const int64_t rows = dense_rows(bound_m, x.shape[0], ExpertOp::kQuantize);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(q, s, 0, r, x.shape[1],
                   [&](int64_t i) { return bf16_to_f32(*at<uint16_t>(src, 0, r, i)); });
  }

  void gemm(const Tensor& y, const Tensor& x, const Tensor& x_scale, const Tensor& w,
            const Tensor& w_scale, const Tensor& bound_m, cudaStream_t) override {
    gemm_group(as_one_group(y), as_one_group(x), as_one_group(x_scale), as_one_group(w),
               as_one_group(w_scale), 0, dense_rows(bound_m, x.shape[0], ExpertOp::kGemm));
  }

  const ExpertWorkspace& workspace() const override { return ws_; }
  size_t workspace_bytes() const override {
    return gate_up_.size() * 2 + act_q_.size() + act_scale_.size() * 4;
  }
  ExpertErrorRecord take_error(cudaStream_t) override {
    ExpertErrorRecord e = error_;
    error_ = ExpertErrorRecord{};
    return e;
  }

 private:
  static Tensor tensor3(void* data, DType t, int64_t a, int64_t b, int64_t c) {
    return Tensor::contiguous(data, t, {a, b, c});
  }

  void record(ExpertOp op, int64_t group, int64_t seen, int64_t limit) {
    if (error_.code != 0) return;
    error_.code = static_cast<int32_t>(experts::ExpertErrorCode::kCountOutOfRange);
    error_.op = static_cast<int32_t>(op);
    error_.expert = static_cast<int32_t>(group);
    error_.value = seen;
    error_.limit = limit;
  }

  int64_t rows_of(const Tensor& count, int64_t g, int64_t limit, ExpertOp op) {
    const int32_t seen = *at<int32_t>(count, g, 0);
    bool bad = false;
    const int64_t rows = clamp_m(seen, limit, &bad);
    if (bad) record(op, g, seen, limit);
    return rows;
  }

  int64_t dense_rows(const Tensor& bound_m, int64_t limit, ExpertOp op) {
    if (!bound_m.defined()) return limit;
    const int32_t seen = *static_cast<const int32_t*>(bound_m.data);
    bool bad = false;
    const int64_t rows = clamp_m(seen, limit, &bad);
    if (bad) record(op, 0, seen, limit);
    return rows;
  }

  // Row r of group g, `cols` values from value(i), quantized in 1x128 groups.
  template <class Value>
  static void quantize_row(const Tensor& q, const Tensor& s, int64_t g, int64_t r, int64_t cols,
                           Value value) {
    float v[kQuantGroup];
    for (int64_t j = 0; j < cols / kQuantGroup; ++j) {
      float amax = 0.0f;
      for (int i = 0; i < kQuantGroup; ++i) {
        v[i] = value(j * kQuantGroup + i);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float scale = experts::group_scale(amax), inv = 1.0f / scale;
      for (int i = 0; i < kQuantGroup; ++i)
        *at<uint8_t>(q, g, r, j * kQuantGroup + i) = f32_to_e4m3(v[i] * inv);
      *at<float>(s, g, r, j) = scale;
    }
  }

  // y[g][r] for r < rows: sum over 128-blocks of K of the block's fp32 dot
  // product times x_scale * w_scale. fp8 rows are contiguous (checked).
  static void gemm_group(const Tensor& y, const Tensor& x, const Tensor& x_scale, const Tensor& w,
                         const Tensor& w_scale, int64_t g, int64_t rows) {
    if (rows == 0) return;
    const auto& e4m3 = e4m3_table();
    const int64_t N = w.shape[1], K = w.shape[2], kb = K / kQuantGroup;
    std::vector<float> wf(static_cast<size_t>(N * K)), xf(static_cast<size_t>(K));
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wrow = at<uint8_t>(w, g, n);
      for (int64_t k = 0; k < K; ++k) wf[n * K + k] = e4m3[wrow[k]];
    }
    std::vector<float> ws(static_cast<size_t>((N / kQuantGroup) * kb));
    for (int64_t nb = 0; nb < N / kQuantGroup; ++nb)
      for (int64_t b = 0; b < kb; ++b) ws[nb * kb + b] = *at<float>(w_scale, g, nb, b);
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* xrow = at<uint8_t>(x, g, r);
      for (int64_t k = 0; k < K; ++k) xf[k] = e4m3[xrow[k]];
      const float* xs = at<float>(x_scale, g, r);  // packed rows (checked)
      uint16_t* yrow = at<uint16_t>(y, g, r);
      for (int64_t n = 0; n < N; ++n) {
        const float* wn = &wf[n * K];
        const float* wsn = &ws[(n / kQuantGroup) * kb];
        float acc = 0.0f;
        for (int64_t b = 0; b < kb; ++b) {
          // Eight running sums (vectorized), added at the end of the block.
          float lanes[8] = {};
          const float* xp = &xf[b * kQuantGroup];
          const float* wp = wn + b * kQuantGroup;
          for (int i = 0; i < kQuantGroup; i += 8)
            for (int j = 0; j < 8; ++j) lanes[j] += xp[i + j] * wp[i + j];
          const float part = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                             ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
          acc += part * (xs[b] * wsn[b]);
        }
        yrow[n] = f32_to_bf16(acc);
      }
    }
  }

  ExpertConfig config_;
  std::vector<uint16_t> gate_up_;
  std::vector<uint8_t> act_q_;
  std::vector<float> act_scale_;
  ExpertWorkspace ws_;
  ExpertErrorRecord error_{};
};

}  // namespace

std::unique_ptr<ExpertsImpl> make_cpu_experts(const ExpertConfig& config) {
  return std::make_unique<CpuExperts>(config);
}

}  // namespace moelink::detail
