// The public Experts: argument checks (each naming the call, the tensor, the
// value and the rule), forward() composed from the kernels, debug checks and
// error reports; the kernels live in cpu_experts.cc and cuda/.
#include "moelink/experts.h"

#include <algorithm>
#include <sstream>

#include "core/arg_checks.h"
#include "experts/experts_impl.h"
#include "experts/fp8_group_quant.h"
#include "moelink/errors.h"

namespace moelink {

using detail::bad;
using detail::check_rows_aligned;
using detail::check_tensor;
using detail::shape_str;
using detail::experts::ExpertErrorCode;
using detail::experts::ExpertErrorRecord;
using detail::experts::ExpertOp;
using detail::experts::kQuantGroup;

const char* expert_device_name(ExpertDevice d) {
  return d == ExpertDevice::kCPU ? "cpu" : "cuda";
}

namespace {

constexpr int64_t kMaxRows = int64_t{1} << 24;
constexpr int kMaxExperts = 65535;

const char* op_name(ExpertOp op) {
  switch (op) {
    case ExpertOp::kGroupedGemm: return "Experts.grouped_gemm";
    case ExpertOp::kSiluMulQuant: return "Experts.silu_mul_quant";
    case ExpertOp::kQuantize: return "Experts.quantize";
    case ExpertOp::kGemm: return "Experts.gemm";
    case ExpertOp::kForward: return "Experts.forward";
  }
  return "Experts";
}

const std::initializer_list<DType> kFp8 = {DType::kFloat8E4M3, DType::kUInt8};

// A dimension that must be a positive multiple of 128 (K or N).
int64_t check_multiple_of_128(const char* call, const char* field, const Tensor& t, int dim,
                              const char* name) {
  const int64_t v = t.shape[dim];
  if (v <= 0 || v % kQuantGroup != 0)
    bad(call, field,
        "has shape " + shape_str(t) + ": dimension " + std::to_string(dim) + " (" + name +
            ") = " + std::to_string(v) + " must be a positive multiple of 128");
  return v;
}

// Scales read by the GEMM: rows of K/128 floats, packed (CUTLASS derives the
// layout from the problem shape).
void check_packed_scale_rows(const char* call, const char* field, const Tensor& t) {
  const int last = t.ndim - 1;
  if (t.stride[last] != 1 || (t.shape[last - 1] > 1 && t.stride[last - 1] != t.shape[last]))
    bad(call, field,
        "must have packed rows (strides [..., " + std::to_string(t.shape[last]) +
            ", 1]), got strides " + [&] {
              std::ostringstream os;
              os << "[";
              for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.stride[i];
              os << "]";
              return os.str();
            }());
}

void check_count(const char* call, const char* field, const Tensor& t, int64_t groups) {
  check_tensor(call, field, t, {DType::kInt32}, {}, false);
  if (t.shape[0] != groups)
    bad(call, field, "has shape " + shape_str(t) + ", expected [" + std::to_string(groups) +
                         "] (num_experts)");
  if (groups > 1 && t.stride[0] != 1)
    bad(call, field, "must be contiguous (stride 1), got stride " + std::to_string(t.stride[0]));
}

void check_optional_bound_m(const char* call, const Tensor& t) {
  if (!t.defined()) return;
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  if (n != 1 || t.dtype != DType::kInt32)
    bad(call, "bound_m",
        "must be a one-element int32 tensor (or absent), got dtype " +
            std::string(dtype_name(t.dtype)) + " shape " + shape_str(t));
}

void check_rows(const char* call, const char* field, int64_t rows) {
  if (rows < 1 || rows > kMaxRows)
    bad(call, field, "has " + std::to_string(rows) + " rows, expected 1.." + std::to_string(kMaxRows));
}

struct GemmDims {
  int64_t rows, n, k;
};

// What the caller calls the five GEMM operands (forward() has its own names).
struct GemmFields {
  const char *y = "y", *x = "x", *x_scale = "x_scale", *w = "w", *w_scale = "w_scale";
};

// The checks grouped_gemm and gemm share: `lead` leading dimensions ({L} or
// {}) in front of y [rows, N], x [rows, K], x_scale [rows, K/128], w [N, K],
// w_scale [N/128, K/128].
GemmDims check_gemm(const char* call, const Tensor& y, const Tensor& x, const Tensor& x_scale,
                    const Tensor& w, const Tensor& w_scale, bool grouped, int64_t groups,
                    const GemmFields& f = {}) {
  const int d = grouped ? 1 : 0;  // index of the rows dimension
  auto lead_ok = [&](const char* field, const Tensor& t) {
    if (grouped && t.shape[0] != groups)
      bad(call, field, "has shape " + shape_str(t) + ": dimension 0 must be " +
                           std::to_string(groups) + " (num_experts)");
  };
  if (grouped) {
    check_tensor(call, f.x, x, kFp8, {x.shape[1], x.shape[2]}, false);
  } else {
    check_tensor(call, f.x, x, kFp8, {x.shape[1]}, false);
  }
  lead_ok(f.x, x);
  GemmDims g{x.shape[d], 0, check_multiple_of_128(call, f.x, x, d + 1, "K")};
  check_rows(call, "x", g.rows);
  if (grouped) {
    check_tensor(call, f.w, w, kFp8, {w.shape[1], g.k}, false);
  } else {
    check_tensor(call, f.w, w, kFp8, {g.k}, false);
  }
  lead_ok(f.w, w);
  g.n = check_multiple_of_128(call, f.w, w, d, "N");
  const int64_t kb = g.k / kQuantGroup, nb = g.n / kQuantGroup;
  if (grouped) {
    check_tensor(call, f.y, y, {DType::kBFloat16}, {g.rows, g.n}, false);
    check_tensor(call, f.x_scale, x_scale, {DType::kFloat32}, {g.rows, kb}, false);
    check_tensor(call, f.w_scale, w_scale, {DType::kFloat32}, {nb, kb}, false);
  } else {
    check_tensor(call, f.y, y, {DType::kBFloat16}, {g.n}, false);
    check_tensor(call, f.x_scale, x_scale, {DType::kFloat32}, {kb}, false);
    check_tensor(call, f.w_scale, w_scale, {DType::kFloat32}, {kb}, false);
    if (y.shape[0] != g.rows)
      bad(call, f.y, "has shape " + shape_str(y) + ", expected [" + std::to_string(g.rows) +
                         ", " + std::to_string(g.n) + "] (x's rows, w's rows)");
    if (x_scale.shape[0] != g.rows)
      bad(call, f.x_scale, "has shape " + shape_str(x_scale) + ", expected [" +
                               std::to_string(g.rows) + ", " + std::to_string(kb) + "]");
    if (w_scale.shape[0] != nb)
      bad(call, f.w_scale, "has shape " + shape_str(w_scale) + ", expected [" +
                               std::to_string(nb) + ", " + std::to_string(kb) + "]");
  }
  lead_ok(f.y, y);
  lead_ok(f.x_scale, x_scale);
  lead_ok(f.w_scale, w_scale);
  check_packed_scale_rows(call, f.x_scale, x_scale);
  check_packed_scale_rows(call, f.w_scale, w_scale);
  // TMA reads x and w and writes y: 16-byte aligned rows.
  check_rows_aligned(call, f.x, x, 16);
  check_rows_aligned(call, f.w, w, 16);
  check_rows_aligned(call, f.y, y, 16);
  return g;
}

// The checks silu_mul_quant and quantize share: src rows of `in_cols` bf16
// values, out_q rows of `out_cols` fp8, out_scale rows of out_cols/128.
void check_group_quant(const char* call, const char* src_field, const Tensor& src,
                       const Tensor& out_q, const Tensor& out_scale, int64_t out_cols) {
  const int last = src.ndim - 1;
  check_rows_aligned(call, src_field, src, 16);
  if (out_q.ndim != src.ndim)
    bad(call, "out_q", "has " + std::to_string(out_q.ndim) + " dimensions, expected " +
                           std::to_string(src.ndim));
  for (int i = 0; i < last; ++i)
    if (out_q.shape[i] != src.shape[i] || out_scale.shape[i] != src.shape[i])
      bad(call, out_q.shape[i] != src.shape[i] ? "out_q" : "out_scale",
          "has shape " + shape_str(out_q.shape[i] != src.shape[i] ? out_q : out_scale) +
              ": dimension " + std::to_string(i) + " must match " + src_field + " " +
              shape_str(src));
  if (out_q.shape[last] != out_cols)
    bad(call, "out_q", "has shape " + shape_str(out_q) + ": dimension " + std::to_string(last) +
                           " must be " + std::to_string(out_cols));
  if (out_scale.shape[last] != out_cols / kQuantGroup)
    bad(call, "out_scale", "has shape " + shape_str(out_scale) + ": dimension " +
                               std::to_string(last) + " must be " +
                               std::to_string(out_cols / kQuantGroup) + " (one scale per 128)");
  check_rows_aligned(call, "out_q", out_q, 8);
}

}  // namespace

void ExpertConfig::validate() const {
  auto fail = [](const char* field, int64_t v, const std::string& rule) {
    throw InvalidArgument("moelink: ExpertConfig." + std::string(field) + " = " +
                          std::to_string(v) + " " + rule);
  };
  if (num_experts < 1 || num_experts > kMaxExperts)
    fail("num_experts", num_experts, "must be in [1, 65535]");
  if (max_rows < 1 || max_rows > kMaxRows) fail("max_rows", max_rows, "must be in [1, 2^24]");
  if (hidden_dim <= 0 || hidden_dim % kQuantGroup != 0)
    fail("hidden_dim", hidden_dim, "must be a positive multiple of 128");
  if (intermediate_dim <= 0 || intermediate_dim % kQuantGroup != 0)
    fail("intermediate_dim", intermediate_dim, "must be a positive multiple of 128");
  if (expected_rows < 0 || expected_rows > kMaxRows)
    fail("expected_rows", expected_rows, "must be in [0, 2^24] (0 = max_rows)");
  if (device != ExpertDevice::kCUDA && device != ExpertDevice::kCPU)
    fail("device", static_cast<int>(device), "must be ExpertDevice::kCUDA or kCPU");
}

std::string ExpertConfig::to_string() const {
  std::ostringstream os;
  os << "ExpertConfig(num_experts=" << num_experts << ", max_rows=" << max_rows
     << ", hidden_dim=" << hidden_dim << ", intermediate_dim=" << intermediate_dim
     << ", device=" << expert_device_name(device) << ", expected_rows=" << expected_rows << ")";
  return os.str();
}

std::unique_ptr<Experts> Experts::create(const ExpertConfig& config) {
  config.validate();
  ExpertConfig c = config;
  if (c.debug < 0) c.debug = detail::env_flag("MOELINK_DEBUG") ? 1 : 0;
  if (c.expected_rows == 0) c.expected_rows = c.max_rows;
  std::unique_ptr<detail::ExpertsImpl> impl = c.device == ExpertDevice::kCPU
                                                  ? detail::make_cpu_experts(c)
                                                  : detail::make_cuda_experts(c);
  auto e = std::unique_ptr<Experts>(new Experts(std::move(impl)));
  e->config_ = c;
  return e;
}

Experts::Experts(std::unique_ptr<detail::ExpertsImpl> impl) : impl_(std::move(impl)) {}

// A call's expected_rows: 0 and values above the config's are the config's.
int64_t Experts::call_expected_rows(const char* call, int64_t expected_rows) const {
  if (expected_rows < 0)
    bad(call, "expected_rows", "= " + std::to_string(expected_rows) + " must be >= 0 (0: the config's " +
                                   std::to_string(config_.expected_rows) + ")");
  return expected_rows == 0 ? config_.expected_rows : std::min(expected_rows, config_.expected_rows);
}
Experts::~Experts() = default;

const ExpertConfig& Experts::config() const { return config_; }
size_t Experts::workspace_bytes() const { return impl_->workspace_bytes(); }

void Experts::grouped_gemm(const Tensor& y, const Tensor& count, const Tensor& x,
                           const Tensor& x_scale, const Tensor& w, const Tensor& w_scale,
                           cudaStream_t stream, int64_t expected_rows) {
  const char* call = "Experts.grouped_gemm";
  check_count(call, "count", count, config_.num_experts);
  check_gemm(call, y, x, x_scale, w, w_scale, true, config_.num_experts);
  impl_->grouped_gemm(y, count, x, x_scale, w, w_scale, ExpertOp::kGroupedGemm,
                      call_expected_rows(call, expected_rows), stream);
  if (config_.debug) check(stream);
}

void Experts::silu_mul_quant(const Tensor& out_q, const Tensor& out_scale, const Tensor& gate_up,
                             const Tensor& count, cudaStream_t stream) {
  const char* call = "Experts.silu_mul_quant";
  const int64_t L = config_.num_experts;
  check_count(call, "count", count, L);
  check_tensor(call, "gate_up", gate_up, {DType::kBFloat16}, {gate_up.shape[1], gate_up.shape[2]},
               false);
  if (gate_up.shape[0] != L)
    bad(call, "gate_up", "has shape " + shape_str(gate_up) + ": dimension 0 must be " +
                             std::to_string(L) + " (num_experts)");
  check_rows(call, "gate_up", gate_up.shape[1]);
  const int64_t two_i = gate_up.shape[2];
  if (two_i <= 0 || two_i % (2 * kQuantGroup) != 0)
    bad(call, "gate_up", "has shape " + shape_str(gate_up) + ": dimension 2 (2I) = " +
                             std::to_string(two_i) + " must be a positive multiple of 256");
  check_tensor(call, "out_q", out_q, kFp8, {out_q.shape[1], out_q.shape[2]}, false);
  check_tensor(call, "out_scale", out_scale, {DType::kFloat32}, {out_scale.shape[1], out_scale.shape[2]},
               false);
  check_group_quant(call, "gate_up", gate_up, out_q, out_scale, two_i / 2);
  impl_->silu_mul_quant(out_q, out_scale, gate_up, count, ExpertOp::kSiluMulQuant, stream);
  if (config_.debug) check(stream);
}

void Experts::quantize(const Tensor& out_q, const Tensor& out_scale, const Tensor& x,
                       const Tensor& bound_m, cudaStream_t stream) {
  const char* call = "Experts.quantize";
  check_tensor(call, "x", x, {DType::kBFloat16}, {x.shape[1]}, false);
  check_rows(call, "x", x.shape[0]);
  const int64_t k = check_multiple_of_128(call, "x", x, 1, "K");
  check_tensor(call, "out_q", out_q, kFp8, {out_q.shape[1]}, false);
  check_tensor(call, "out_scale", out_scale, {DType::kFloat32}, {out_scale.shape[1]}, false);
  check_group_quant(call, "x", x, out_q, out_scale, k);
  check_optional_bound_m(call, bound_m);
  impl_->quantize(out_q, out_scale, x, bound_m, stream);
  if (config_.debug) check(stream);
}

void Experts::gemm(const Tensor& y, const Tensor& x, const Tensor& x_scale, const Tensor& w,
                   const Tensor& w_scale, const Tensor& bound_m, cudaStream_t stream) {
  const char* call = "Experts.gemm";
  check_gemm(call, y, x, x_scale, w, w_scale, false, 1);
  check_optional_bound_m(call, bound_m);
  impl_->gemm(y, x, x_scale, w, w_scale, bound_m, stream);
  if (config_.debug) check(stream);
}

void Experts::forward(const Tensor& expert_y, const Tensor& expert_num_tokens,
                      const Tensor& expert_x, const Tensor& expert_x_scale, const Tensor& w13,
                      const Tensor& w13_scale, const Tensor& w2, const Tensor& w2_scale,
                      cudaStream_t stream, int64_t expected_rows) {
  const char* call = "Experts.forward";
  const int64_t rows_hint = call_expected_rows(call, expected_rows);
  const int64_t L = config_.num_experts, H = config_.hidden_dim, I = config_.intermediate_dim;
  check_count(call, "expert_num_tokens", expert_num_tokens, L);
  check_tensor(call, "expert_x", expert_x, kFp8, {expert_x.shape[1], H}, true);
  const int64_t C = expert_x.shape[1];
  if (expert_x.shape[0] != L || C < 1 || C > config_.max_rows)
    bad(call, "expert_x", "has shape " + shape_str(expert_x) + ", expected [" +
                              std::to_string(L) + ", C, " + std::to_string(H) + "] with 1 <= C <= " +
                              std::to_string(config_.max_rows) + " (max_rows)");
  // The weights' shapes against the config, before the GEMM checks (whose
  // messages know only N and K).
  auto check_weight = [&](const char* field, const Tensor& t, int64_t n, int64_t k) {
    check_tensor(call, field, t, kFp8, {n, k}, true);
    if (t.shape[0] != L)
      bad(call, field, "has shape " + shape_str(t) + ": dimension 0 must be " +
                           std::to_string(L) + " (num_experts)");
  };
  check_weight("w13", w13, 2 * I, H);
  check_weight("w2", w2, H, I);
  // Unused by the first GEMM's checks, but named here: expert_y.
  check_tensor(call, "expert_y", expert_y, {DType::kBFloat16}, {C, H}, true);
  if (expert_y.shape[0] != L)
    bad(call, "expert_y", "has shape " + shape_str(expert_y) + ", expected [" +
                              std::to_string(L) + ", " + std::to_string(C) + ", " +
                              std::to_string(H) + "]");

  const detail::ExpertWorkspace& ws = impl_->workspace();
  // The workspace viewed with C rows per expert (its own rows are max_rows).
  auto rows_view = [C](Tensor t) {
    t.shape[1] = C;
    return t;
  };
  const Tensor gate_up = rows_view(ws.gate_up), act_q = rows_view(ws.act_q),
               act_scale = rows_view(ws.act_scale);
  check_gemm(call, gate_up, expert_x, expert_x_scale, w13, w13_scale, true, L,
             {"workspace", "expert_x", "expert_x_scale", "w13", "w13_scale"});
  check_gemm(call, expert_y, act_q, act_scale, w2, w2_scale, true, L,
             {"expert_y", "workspace", "workspace", "w2", "w2_scale"});
  impl_->forward(expert_y, expert_num_tokens, expert_x, expert_x_scale, w13, w13_scale, w2, w2_scale,
                 gate_up, act_q, act_scale, rows_hint, stream);
  if (config_.debug) check(stream);
}

void Experts::check(cudaStream_t stream) {
  const ExpertErrorRecord e = impl_->take_error(stream);
  if (static_cast<ExpertErrorCode>(e.code) == ExpertErrorCode::kOk) return;
  const ExpertOp op = static_cast<ExpertOp>(e.op);
  std::ostringstream os;
  os << "moelink: " << op_name(op) << ": ";
  if (op == ExpertOp::kQuantize || op == ExpertOp::kGemm)
    os << "bound_m = " << e.value << " is outside [0, " << e.limit << "] (the rows x has)";
  else
    os << "expert_num_tokens[" << e.expert << "] = " << e.value << " is outside [0, " << e.limit
       << "] (the rows each expert's tensors have)";
  os << "; it was clamped, nothing was written out of bounds";
  throw InputError(os.str());
}

}  // namespace moelink
