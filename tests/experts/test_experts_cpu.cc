// The expert kernels on ExpertDevice::kCPU (host memory; runs everywhere,
// CI and ASan included), and the argument checks of the public Experts,
// which both devices share.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "experts/expert_cases.h"
#include "moelink/errors.h"

namespace moelink_test {
namespace {

using moelink::DType;
using moelink::ExpertConfig;
using moelink::ExpertDevice;
using moelink::Experts;
using moelink::Tensor;

class CpuExperts : public ::testing::TestWithParam<ExpertCase> {
 protected:
  std::unique_ptr<MemoryOps> ops_ = make_host_memory_ops();
};

TEST_P(CpuExperts, GroupedGemmMatchesReference) { run_grouped_gemm_case(ExpertDevice::kCPU, *ops_, GetParam()); }
TEST_P(CpuExperts, SiluMulQuantMatchesReference) { run_silu_mul_quant_case(ExpertDevice::kCPU, *ops_, GetParam()); }
TEST_P(CpuExperts, ForwardMatchesReference) { run_forward_case(ExpertDevice::kCPU, *ops_, GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CpuExperts, ::testing::ValuesIn(expert_cases()),
                         [](const auto& info) { return info.param.name(); });

TEST(CpuExpertsDense, QuantizeMatchesReference) {
  auto ops = make_host_memory_ops();
  run_quantize_case(ExpertDevice::kCPU, *ops, 37, 7168, -1);
  run_quantize_case(ExpertDevice::kCPU, *ops, 16, 256, 5);
  run_quantize_case(ExpertDevice::kCPU, *ops, 9, 384, 0);
  run_quantize_case(ExpertDevice::kCPU, *ops, 1, 128, 1);
}

TEST(CpuExpertsDense, GemmMatchesReference) {
  auto ops = make_host_memory_ops();
  run_gemm_case(ExpertDevice::kCPU, *ops, 5, 256, 384, -1);
  run_gemm_case(ExpertDevice::kCPU, *ops, 33, 384, 256, 17);
  run_gemm_case(ExpertDevice::kCPU, *ops, 4, 128, 128, 0);
#if !defined(MOELINK_EXPERTS_SMALL_SHAPES_ONLY)
  run_gemm_case(ExpertDevice::kCPU, *ops, 2, 2 * 2048, 7168, 1);  // DeepSeek-V3's shared expert, m = 1
#endif
}

TEST(CpuExpertsErrors, CountsOutOfRangeAreClampedAndReported) {
  auto ops = make_host_memory_ops();
  run_out_of_range_case(ExpertDevice::kCPU, *ops);
}

// ------------------------------------------------------------ argument checks

// Host tensors for one grouped_gemm / forward call whose fields a test
// breaks one at a time.
struct Args {
  static constexpr int L = 2, C = 4, H = 256, I = 128;
  std::vector<uint8_t> x = std::vector<uint8_t>(L * C * H), w13 = std::vector<uint8_t>(L * 2 * I * H),
                       w2 = std::vector<uint8_t>(L * H * I);
  std::vector<float> xs = std::vector<float>(L * C * H / 128), w13s = std::vector<float>(L * 2 * I / 128 * H / 128),
                     w2s = std::vector<float>(L * H / 128 * I / 128);
  std::vector<uint16_t> y = std::vector<uint16_t>(L * C * H);
  std::vector<int32_t> count = std::vector<int32_t>(L, 1);
  Tensor ty = Tensor::contiguous(y.data(), DType::kBFloat16, {L, C, H});
  Tensor tcount = Tensor::contiguous(count.data(), DType::kInt32, {L});
  Tensor tx = Tensor::contiguous(x.data(), DType::kFloat8E4M3, {L, C, H});
  Tensor txs = Tensor::contiguous(xs.data(), DType::kFloat32, {L, C, H / 128});
  Tensor tw13 = Tensor::contiguous(w13.data(), DType::kFloat8E4M3, {L, 2 * I, H});
  Tensor tw13s = Tensor::contiguous(w13s.data(), DType::kFloat32, {L, 2 * I / 128, H / 128});
  Tensor tw2 = Tensor::contiguous(w2.data(), DType::kFloat8E4M3, {L, H, I});
  Tensor tw2s = Tensor::contiguous(w2s.data(), DType::kFloat32, {L, H / 128, I / 128});
};

std::unique_ptr<Experts> cpu_experts() {
  ExpertConfig c;
  c.num_experts = Args::L;
  c.max_rows = Args::C;
  c.hidden_dim = Args::H;
  c.intermediate_dim = Args::I;
  c.device = ExpertDevice::kCPU;
  c.debug = 0;
  return Experts::create(c);
}

// Runs `call` and expects an InvalidArgument whose message holds every one
// of `words`.
template <class F>
void expect_invalid(F call, std::initializer_list<const char*> words) {
  try {
    call();
    ADD_FAILURE() << "no InvalidArgument; expected one naming " << *words.begin();
  } catch (const moelink::InvalidArgument& e) {
    for (const char* w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(ExpertsArguments, ConfigFieldsAreNamed) {
  ExpertConfig c;
  c.num_experts = 4, c.max_rows = 8, c.hidden_dim = 7168, c.intermediate_dim = 2048;
  c.device = ExpertDevice::kCPU;
  auto with = [&](auto change) {
    ExpertConfig b = c;
    change(b);
    return [b] { Experts::create(b); };
  };
  expect_invalid(with([](ExpertConfig& b) { b.hidden_dim = 7000; }), {"hidden_dim = 7000", "multiple of 128"});
  expect_invalid(with([](ExpertConfig& b) { b.intermediate_dim = 0; }), {"intermediate_dim = 0"});
  expect_invalid(with([](ExpertConfig& b) { b.num_experts = 0; }), {"num_experts = 0", "[1, 65535]"});
  expect_invalid(with([](ExpertConfig& b) { b.max_rows = -1; }), {"max_rows = -1"});
  expect_invalid(with([](ExpertConfig& b) { b.expected_rows = -2; }), {"expected_rows = -2"});
  EXPECT_NO_THROW(with([](ExpertConfig&) {})());
}

TEST(ExpertsArguments, GroupedGemmFieldsAreNamed) {
  auto ex = cpu_experts();
  const Args a;
  auto gg = [&](Tensor y, Tensor count, Tensor x, Tensor xs, Tensor w, Tensor ws) {
    return [=, &ex] { ex->grouped_gemm(y, count, x, xs, w, ws); };
  };
  EXPECT_NO_THROW(gg(Tensor::contiguous(a.ty.data, DType::kBFloat16, {2, 4, 256}), a.tcount, a.tx, a.txs,
                     a.tw13, a.tw13s)());
  // K not a multiple of 128.
  Tensor x = a.tx;
  x.shape[2] = 200;
  expect_invalid(gg(a.ty, a.tcount, x, a.txs, a.tw13, a.tw13s), {"x", "(K) = 200", "multiple of 128"});
  // N not a multiple of 128.
  Tensor w = a.tw13;
  w.shape[1] = 192;
  expect_invalid(gg(a.ty, a.tcount, a.tx, a.txs, w, a.tw13s), {"w has shape [2, 192, 256]", "(N) = 192"});
  // dtypes.
  Tensor xb = a.tx;
  xb.dtype = DType::kBFloat16;
  expect_invalid(gg(a.ty, a.tcount, xb, a.txs, a.tw13, a.tw13s), {"x has dtype bfloat16", "float8_e4m3"});
  Tensor yf = a.ty;
  yf.dtype = DType::kFloat16;
  expect_invalid(gg(yf, a.tcount, a.tx, a.txs, a.tw13, a.tw13s), {"y has dtype float16"});
  Tensor c64 = a.tcount;
  c64.dtype = DType::kInt64;
  expect_invalid(gg(a.ty, c64, a.tx, a.txs, a.tw13, a.tw13s), {"count has dtype int64", "int32"});
  // Shapes that disagree.
  Tensor ys = a.ty;
  ys.shape[2] = 128;
  expect_invalid(gg(ys, a.tcount, a.tx, a.txs, a.tw13, a.tw13s), {"y has shape [2, 4, 128]", "must be 256"});
  Tensor xss = a.txs;
  xss.shape[2] = 3;
  expect_invalid(gg(a.ty, a.tcount, a.tx, xss, a.tw13, a.tw13s), {"x_scale has shape [2, 4, 3]"});
  Tensor wss = a.tw13s;
  wss.shape[1] = 1;
  expect_invalid(gg(a.ty, a.tcount, a.tx, a.txs, a.tw13, wss), {"w_scale has shape [2, 1, 2]"});
  Tensor c3 = a.tcount;
  c3.shape[0] = 3;
  expect_invalid(gg(a.ty, c3, a.tx, a.txs, a.tw13, a.tw13s), {"count has shape [3]", "expected [2]"});
  Tensor xl = a.tx;
  xl.shape[0] = 3;
  expect_invalid(gg(a.ty, a.tcount, xl, a.txs, a.tw13, a.tw13s), {"x has shape [3, 4, 256]", "num_experts"});
  // Scales must be packed rows; fp8 rows contiguous.
  Tensor xst = a.txs;
  std::swap(xst.stride[1], xst.stride[2]);
  expect_invalid(gg(a.ty, a.tcount, a.tx, xst, a.tw13, a.tw13s), {"x_scale must have packed rows"});
  Tensor xt = a.tx;
  xt.stride[2] = 2;
  expect_invalid(gg(a.ty, a.tcount, xt, a.txs, a.tw13, a.tw13s), {"x must have stride 1"});
  Tensor missing;
  expect_invalid(gg(a.ty, a.tcount, a.tx, a.txs, missing, a.tw13s), {"w is missing"});
}

TEST(ExpertsArguments, ForwardAndQuantCallsNameTheirFields) {
  auto ex = cpu_experts();
  Args a;
  auto fwd = [&](Tensor w13, Tensor w2, Tensor x) {
    return [=, &ex] { ex->forward(a.ty, a.tcount, x, a.txs, w13, a.tw13s, w2, a.tw2s); };
  };
  EXPECT_NO_THROW(fwd(a.tw13, a.tw2, a.tx)());
  Tensor w13 = a.tw13;
  w13.shape[1] = 128;
  expect_invalid(fwd(w13, a.tw2, a.tx), {"Experts.forward", "w13 has shape [2, 128, 256]", "must be 256"});
  Tensor w2 = a.tw2;
  w2.shape[2] = 256;
  expect_invalid(fwd(a.tw13, w2, a.tx), {"w2 has shape [2, 256, 256]", "must be 128"});
  Tensor x = a.tx;
  x.shape[1] = 5;  // more rows than max_rows
  expect_invalid(fwd(a.tw13, a.tw2, x), {"expert_x has shape [2, 5, 256]", "max_rows"});
  // A call's expected_rows below 0; 0 and values above the config's are
  // allowed (they count as the config's), and the object stays usable.
  expect_invalid([&] { ex->forward(a.ty, a.tcount, a.tx, a.txs, a.tw13, a.tw13s, a.tw2, a.tw2s, nullptr, -1); },
                 {"Experts.forward", "expected_rows = -1", ">= 0"});
  expect_invalid([&] { ex->grouped_gemm(Tensor::contiguous(a.ty.data, DType::kBFloat16, {2, 4, 256}), a.tcount,
                                        a.tx, a.txs, a.tw13, a.tw13s, nullptr, -7); },
                 {"Experts.grouped_gemm", "expected_rows = -7"});
  for (int64_t rows : {0, 1, 3, 1 << 20})
    EXPECT_NO_THROW(ex->forward(a.ty, a.tcount, a.tx, a.txs, a.tw13, a.tw13s, a.tw2, a.tw2s, nullptr, rows));

  // silu_mul_quant: 2I not a multiple of 256; quantize: K not a multiple of 128.
  std::vector<uint16_t> gu(2 * 4 * 384);
  std::vector<uint8_t> q(2 * 4 * 192);
  std::vector<float> s(2 * 4 * 2);
  expect_invalid([&] {
    ex->silu_mul_quant(Tensor::contiguous(q.data(), DType::kFloat8E4M3, {2, 4, 192}),
                       Tensor::contiguous(s.data(), DType::kFloat32, {2, 4, 1}),
                       Tensor::contiguous(gu.data(), DType::kBFloat16, {2, 4, 384}), a.tcount);
  }, {"gate_up", "(2I) = 384", "multiple of 256"});
  expect_invalid([&] {
    ex->quantize(Tensor::contiguous(q.data(), DType::kFloat8E4M3, {4, 192}),
                 Tensor::contiguous(s.data(), DType::kFloat32, {4, 1}),
                 Tensor::contiguous(gu.data(), DType::kBFloat16, {4, 192}));
  }, {"Experts.quantize", "x", "(K) = 192"});
  int64_t bm[1] = {1};
  expect_invalid([&] {
    ex->quantize(Tensor::contiguous(q.data(), DType::kFloat8E4M3, {4, 128}),
                 Tensor::contiguous(s.data(), DType::kFloat32, {4, 1}),
                 Tensor::contiguous(gu.data(), DType::kBFloat16, {4, 128}),
                 Tensor::contiguous(bm, DType::kInt64, {1}));
  }, {"bound_m", "one-element int32"});
}

}  // namespace
}  // namespace moelink_test
