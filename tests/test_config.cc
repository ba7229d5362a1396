// Config rules, AllToAll::create option checks, argument-shape checks of
// dispatch/combine and call-order checks: all raise InvalidArgument naming the
// field (and, for Config, its value). AllToAll calls run on the CPU backend
// with one rank.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moelink/moelink.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

using moelink::Config;
using moelink::DType;
using moelink::InvalidArgument;
using moelink::Tensor;

Config valid_config() {
  Config c;
  c.max_num_tokens = 16;
  c.num_experts = 8;
  c.experts_per_token = 2;
  c.hidden_dim = 256;
  c.hidden_dim_scale = 0;
  c.in_dtype = DType::kBFloat16;
  c.out_dtype = DType::kBFloat16;
  c.rank = 0;
  c.world_size = 1;
  c.dp_size = 1;
  return c;
}

// ------------------------------------------------------------ Config rules

struct ConfigRule {
  std::string name;
  std::function<void(Config&)> mutate;
  std::vector<std::string> message_parts;  // e.g. {"num_experts = 10"}
};

void PrintTo(const ConfigRule& r, std::ostream* os) { *os << r.name; }

class ConfigRuleTest : public testing::TestWithParam<ConfigRule> {};

TEST_P(ConfigRuleTest, ValidateThrowsInvalidArgumentNamingFieldAndValue) {
  Config c = valid_config();
  GetParam().mutate(c);
  try {
    c.validate();
    ADD_FAILURE() << "validate() accepted " << c.to_string();
  } catch (const InvalidArgument& e) {
    for (const auto& p : GetParam().message_parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message lacks '" << p << "': " << e.what();
  }
}

const ConfigRule kConfigRules[] = {
    {"WorldSizeZero", [](Config& c) { c.world_size = 0; }, {"world_size = 0"}},
    {"WorldSizeNegative", [](Config& c) { c.world_size = -2; }, {"world_size = -2"}},
    {"RankNegative", [](Config& c) { c.rank = -1; }, {"rank = -1"}},
    {"RankEqualsWorldSize",
     [](Config& c) {
       c.world_size = 4;
       c.rank = 4;
     },
     {"rank = 4"}},
    {"DpSizeZero", [](Config& c) { c.dp_size = 0; }, {"dp_size = 0"}},
    {"DpSizeNotDividingWorldSize",
     [](Config& c) {
       c.world_size = 4;
       c.dp_size = 3;
     },
     {"dp_size = 3"}},
    {"MaxNumTokensZero", [](Config& c) { c.max_num_tokens = 0; }, {"max_num_tokens = 0"}},
    {"MaxNumTokensTooLarge", [](Config& c) { c.max_num_tokens = 1048577; },
     {"max_num_tokens = 1048577"}},
    {"NumExpertsZero", [](Config& c) { c.num_experts = 0; }, {"num_experts = 0"}},
    {"NumExpertsTooLarge", [](Config& c) { c.num_experts = 65537; }, {"num_experts = 65537"}},
    {"NumExpertsNotDivisibleByWorldSize",
     [](Config& c) {
       c.world_size = 4;
       c.num_experts = 10;
     },
     {"num_experts = 10"}},
    {"ExpertsPerTokenZero", [](Config& c) { c.experts_per_token = 0; },
     {"experts_per_token = 0"}},
    {"ExpertsPerTokenSeventeen", [](Config& c) { c.experts_per_token = 17; },
     {"experts_per_token = 17"}},
    {"HiddenDimZero", [](Config& c) { c.hidden_dim = 0; }, {"hidden_dim = 0"}},
    {"HiddenDimNotMultipleOf16", [](Config& c) { c.hidden_dim = 100; }, {"hidden_dim = 100"}},
    {"HiddenDimTooLarge", [](Config& c) { c.hidden_dim = 1048576 + 16; },
     {"hidden_dim = 1048592"}},
    {"InDtypeFloat32", [](Config& c) { c.in_dtype = DType::kFloat32; },
     {"in_dtype", "float32"}},
    {"InDtypeInt32", [](Config& c) { c.in_dtype = DType::kInt32; }, {"in_dtype", "int32"}},
    {"OutDtypeFloat8", [](Config& c) { c.out_dtype = DType::kFloat8E4M3; },
     {"out_dtype", "float8_e4m3"}},
    {"OutDtypeFloat32", [](Config& c) { c.out_dtype = DType::kFloat32; },
     {"out_dtype", "float32"}},
    {"Fp8WithoutScales",
     [](Config& c) {
       c.in_dtype = DType::kFloat8E4M3;
       c.hidden_dim_scale = 0;
     },
     {"hidden_dim_scale = 0"}},
    {"Fp8WithMoreScalesThanHidden",
     [](Config& c) {
       c.in_dtype = DType::kFloat8E4M3;
       c.hidden_dim_scale = 257;
     },
     {"hidden_dim_scale = 257"}},
    {"Bf16WithScales", [](Config& c) { c.hidden_dim_scale = 2; }, {"hidden_dim_scale = 2"}},
};

INSTANTIATE_TEST_SUITE_P(Rules, ConfigRuleTest, testing::ValuesIn(kConfigRules),
                         [](const testing::TestParamInfo<ConfigRule>& i) { return i.param.name; });

TEST(Config, ValidConfigsPass) {
  Config c = valid_config();
  EXPECT_NO_THROW(c.validate());
  // DeepSeek-like: fp8 with 1x128 block scales, 8 ranks in DP groups of 2.
  c.in_dtype = DType::kFloat8E4M3;
  c.hidden_dim = 7168;
  c.hidden_dim_scale = 56;
  c.num_experts = 256;
  c.experts_per_token = 8;
  c.max_num_tokens = 128;
  c.world_size = 8;
  c.rank = 7;
  c.dp_size = 2;
  c.out_dtype = DType::kFloat16;
  EXPECT_NO_THROW(c.validate()) << c.to_string();
  // Every bound at its limit.
  Config b = valid_config();
  b.max_num_tokens = 1048576;
  b.num_experts = 65536;
  b.experts_per_token = 16;
  b.hidden_dim = 16;
  EXPECT_NO_THROW(b.validate()) << b.to_string();
  b.hidden_dim = 1048576;
  b.max_num_tokens = 1;
  b.num_experts = 1;
  b.experts_per_token = 1;
  EXPECT_NO_THROW(b.validate()) << b.to_string();
}

// ------------------------------------------------------------ create()

moelink::Options cpu_options() {
  moelink::Options o;
  o.backend = moelink::Backend::kCPU;
  o.timeout_s = 10;
  o.debug = 0;
  return o;
}

TEST(Create, RejectsInvalidConfigNamingTheField) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    Config c = valid_config();
    c.num_experts = 0;
    expect_throw_naming<InvalidArgument>(
        [&] { moelink::AllToAll::create(c, bs, cpu_options()); }, {"num_experts = 0"}, "create");
  }, 60);
}

TEST(Create, RejectsConfigDisagreeingWithBootstrap) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    Config c = valid_config();
    c.world_size = 2;
    c.num_experts = 8;
    expect_throw_naming<InvalidArgument>(
        [&] { moelink::AllToAll::create(c, bs, cpu_options()); }, {"world_size", "bootstrap"},
        "create with world_size 2 on a 1-rank bootstrap");
  }, 60);
}

TEST(Create, RejectsNumBlocksOutOfRange) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    for (int nb : {-1, 1025}) {
      moelink::Options o = cpu_options();
      o.num_blocks = nb;
      expect_throw_naming<InvalidArgument>(
          [&] { moelink::AllToAll::create(valid_config(), bs, o); },
          {"num_blocks", std::to_string(nb)}, "create");
    }
  }, 60);
}

TEST(Create, RejectsInternodeOptionsOutOfRange) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    for (int nics : {-1, 65}) {
      moelink::Options o = cpu_options();
      o.fabric_nics = nics;
      expect_throw_naming<InvalidArgument>(
          [&] { moelink::AllToAll::create(valid_config(), bs, o); },
          {"fabric_nics", std::to_string(nics)}, "create");
    }
    for (int gd : {2, 7}) {
      moelink::Options o = cpu_options();
      o.gpu_direct = gd;
      expect_throw_naming<InvalidArgument>(
          [&] { moelink::AllToAll::create(valid_config(), bs, o); },
          {"gpu_direct", std::to_string(gd)}, "create");
    }
    // max_private_tokens may not exceed max_num_tokens.
    moelink::Options o = cpu_options();
    o.max_private_tokens = static_cast<int>(valid_config().max_num_tokens) + 1;
    expect_throw_naming<InvalidArgument>(
        [&] { moelink::AllToAll::create(valid_config(), bs, o); },
        {"max_private_tokens", std::to_string(o.max_private_tokens)}, "create");
  }, 60);
}

TEST(Create, RejectsBadFabricNicsEnvironment) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    setenv("MOELINK_FABRIC_NICS", "zero", 1);
    expect_throw_naming<InvalidArgument>(
        [&] { moelink::AllToAll::create(valid_config(), bs, cpu_options()); },
        {"MOELINK_FABRIC_NICS", "zero"}, "create");
    unsetenv("MOELINK_FABRIC_NICS");
  }, 60);
}

TEST(Create, RejectsBadNodeSizeAndGpuDirectEnvironment) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    for (const auto& [name, value] : {std::pair{"MOELINK_NODE_SIZE", "-2"},
                                      std::pair{"MOELINK_GPU_DIRECT", "yes"}}) {
      setenv(name, value, 1);
      expect_throw_naming<InvalidArgument>(
          [&] { moelink::AllToAll::create(valid_config(), bs, cpu_options()); }, {name, value},
          "create");
      unsetenv(name);
    }
  }, 60);
}

#if !defined(MOELINK_WITH_CUDA)
TEST(Create, NvlinkBackendUnavailableWithoutCuda) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    moelink::Options o = cpu_options();
    o.backend = moelink::Backend::kNVLink;
    try {
      moelink::AllToAll::create(valid_config(), bs, o);
      RANK_FAIL() << "create(kNVLink) succeeded in a build without CUDA";
    } catch (const InvalidArgument&) {
    }
  }, 60);
}
#endif

TEST(Create, CpuBackendReportsItsConfigAndBuffer) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    auto a2a = moelink::AllToAll::create(valid_config(), bs, cpu_options());
    RANK_CHECK(a2a->backend() == moelink::Backend::kCPU);
    RANK_CHECK(a2a->config().num_experts == 8);
    RANK_CHECK(a2a->buffer_bytes() > 0);
  }, 60);
}

// ------------------------------------------------------------ call arguments

// Host buffers and valid tensors for one rank of an fp8 config (S = 2).
struct CallArgs {
  Config c;
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> storage;
  Tensor counts, out_x, out_scale, x, x_scale, indices, weights, bound_m;
  Tensor out_tokens, expert_y;

  void* alloc(size_t bytes) {
    storage.emplace_back(static_cast<uint8_t*>(std::aligned_alloc(256, (bytes + 255) / 256 * 256)),
                         &std::free);
    std::memset(storage.back().get(), 0, bytes);
    return storage.back().get();
  }

  CallArgs() {
    c = valid_config();
    c.max_num_tokens = 8;
    c.num_experts = 4;
    c.hidden_dim = 128;
    c.in_dtype = DType::kFloat8E4M3;
    c.hidden_dim_scale = 2;
    const int64_t T = 8, H = 128, S = 2, k = 2, L = 4, C = 8;
    counts = Tensor::contiguous(alloc(L * 4), DType::kInt32, {L});
    out_x = Tensor::contiguous(alloc(L * C * H), DType::kFloat8E4M3, {L, C, H});
    out_scale = Tensor::contiguous(alloc(L * C * S * 4), DType::kFloat32, {L, C, S});
    x = Tensor::contiguous(alloc(T * H), DType::kFloat8E4M3, {T, H});
    x_scale = Tensor::contiguous(alloc(T * S * 4), DType::kFloat32, {T, S});
    indices = Tensor::contiguous(alloc(T * k * 4), DType::kInt32, {T, k});
    auto* idx = static_cast<int32_t*>(indices.data);
    for (int i = 0; i < T * k; ++i) idx[i] = i % 4;
    weights = Tensor::contiguous(alloc(T * k * 4), DType::kFloat32, {T, k});
    bound_m = Tensor::contiguous(alloc(4), DType::kInt32, {1});
    *static_cast<int32_t*>(bound_m.data) = 5;
    out_tokens = Tensor::contiguous(alloc(T * H * 2), DType::kBFloat16, {T, H});
    expert_y = Tensor::contiguous(alloc(L * C * H * 2), DType::kBFloat16, {L, C, H});
  }

  void dispatch(moelink::AllToAll& a, bool send = true, bool recv = true) const {
    a.dispatch(counts, out_x, out_scale, x, x_scale, indices, weights, bound_m, nullptr, send,
               recv);
  }
  void combine(moelink::AllToAll& a, bool send = true, bool recv = true) const {
    a.combine(out_tokens, indices, weights, expert_y, bound_m, nullptr, send, recv);
  }
};

struct ArgError {
  std::string name;
  bool in_combine;  // the bad argument goes to combine (after a good dispatch)
  std::function<void(CallArgs&)> mutate;
  std::vector<std::string> message_parts;
};

void PrintTo(const ArgError& r, std::ostream* os) { *os << r.name; }

class ArgumentErrorTest : public testing::TestWithParam<ArgError> {};

// The bad call throws InvalidArgument naming the field; it changes no state:
// the same step with good arguments then works.
TEST_P(ArgumentErrorTest, ThrowsInvalidArgumentNamingTheField) {
  const ArgError p = GetParam();
  run_ranks(1, [&](int, moelink::Bootstrap& bs) {
    CallArgs good;
    auto a2a = moelink::AllToAll::create(good.c, bs, cpu_options());
    CallArgs bad;
    p.mutate(bad);
    if (p.in_combine) good.dispatch(*a2a);
    try {
      if (p.in_combine)
        bad.combine(*a2a);
      else
        bad.dispatch(*a2a);
      RANK_FAIL() << p.name << ": the call did not throw";
    } catch (const InvalidArgument& e) {
      for (const auto& part : p.message_parts)
        RANK_CHECK(std::string(e.what()).find(part) != std::string::npos)
            << p.name << ": message lacks '" << part << "': " << e.what();
    }
    if (!p.in_combine) good.dispatch(*a2a);
    good.combine(*a2a);
    a2a->check();
  }, 60);
}

void reshape(Tensor& t, std::initializer_list<int64_t> shape) {
  Tensor n = Tensor::contiguous(t.data, t.dtype, shape);
  t = n;
}

const ArgError kArgErrors[] = {
    {"DpXMissing", false, [](CallArgs& a) { a.x.data = nullptr; }, {"dp_x", "missing"}},
    {"DpXWrongDtype", false, [](CallArgs& a) { a.x.dtype = DType::kBFloat16; },
     {"dp_x", "bfloat16"}},
    {"DpXWrongHidden", false, [](CallArgs& a) { reshape(a.x, {8, 64}); }, {"dp_x", "shape"}},
    {"DpXTooManyRows", false, [](CallArgs& a) { reshape(a.x, {9, 128}); }, {"dp_x", "9"}},
    {"DpXZeroRows", false, [](CallArgs& a) { reshape(a.x, {0, 128}); }, {"dp_x", "0"}},
    {"DpXThreeDims", false, [](CallArgs& a) { reshape(a.x, {1, 8, 128}); },
     {"dp_x", "dimensions"}},
    {"DpXMisaligned", false,
     [](CallArgs& a) { a.x.data = static_cast<uint8_t*>(a.x.data) + 1; }, {"dp_x", "aligned"}},
    {"DpXStridedLastDim", false, [](CallArgs& a) { a.x.stride[1] = 2; }, {"dp_x", "stride"}},
    {"DpXScaleMissing", false, [](CallArgs& a) { a.x_scale.data = nullptr; },
     {"dp_x_scale", "missing"}},
    {"DpXScaleWrongDtype", false, [](CallArgs& a) { a.x_scale.dtype = DType::kFloat16; },
     {"dp_x_scale", "float16"}},
    {"DpXScaleWrongWidth", false, [](CallArgs& a) { reshape(a.x_scale, {8, 3}); },
     {"dp_x_scale", "shape"}},
    {"IndicesMissing", false, [](CallArgs& a) { a.indices.data = nullptr; },
     {"indices", "missing"}},
    {"IndicesFloat32", false, [](CallArgs& a) { a.indices.dtype = DType::kFloat32; },
     {"indices", "float32"}},
    {"IndicesWrongTopK", false, [](CallArgs& a) { reshape(a.indices, {8, 3}); },
     {"indices", "shape"}},
    {"WeightsMissing", false, [](CallArgs& a) { a.weights.data = nullptr; },
     {"weights", "missing"}},
    {"WeightsBf16", false, [](CallArgs& a) { a.weights.dtype = DType::kBFloat16; },
     {"weights", "bfloat16"}},
    {"BoundMMissing", false, [](CallArgs& a) { a.bound_m.data = nullptr; },
     {"bound_m", "missing"}},
    {"BoundMInt64", false, [](CallArgs& a) { a.bound_m.dtype = DType::kInt64; },
     {"bound_m", "int64"}},
    {"BoundMTwoElements", false, [](CallArgs& a) { reshape(a.bound_m, {2}); },
     {"bound_m", "[2]"}},
    {"OutCountsWrongLength", false, [](CallArgs& a) { reshape(a.counts, {5}); },
     {"out_expert_num_tokens"}},
    {"OutCountsInt64", false, [](CallArgs& a) { a.counts.dtype = DType::kInt64; },
     {"out_expert_num_tokens", "int64"}},
    {"OutCountsMissing", false, [](CallArgs& a) { a.counts.data = nullptr; },
     {"out_expert_num_tokens", "missing"}},
    {"OutXWrongExperts", false, [](CallArgs& a) { reshape(a.out_x, {3, 8, 128}); },
     {"out_expert_x", "[3, 8, 128]"}},
    {"OutXWrongCapacity", false, [](CallArgs& a) { reshape(a.out_x, {4, 7, 128}); },
     {"out_expert_x", "shape"}},
    {"OutXWrongDtype", false, [](CallArgs& a) { a.out_x.dtype = DType::kBFloat16; },
     {"out_expert_x", "bfloat16"}},
    {"OutXScaleMissing", false, [](CallArgs& a) { a.out_scale.data = nullptr; },
     {"out_expert_x_scale", "missing"}},
    {"OutXScaleWrongShape", false, [](CallArgs& a) { reshape(a.out_scale, {4, 8, 1}); },
     {"out_expert_x_scale", "shape"}},
    {"OutTokensWrongDtype", true, [](CallArgs& a) { a.out_tokens.dtype = DType::kFloat16; },
     {"out_tokens", "float16"}},
    {"OutTokensWrongHidden", true, [](CallArgs& a) { reshape(a.out_tokens, {8, 112}); },
     {"out_tokens", "shape"}},
    {"OutTokensMissing", true, [](CallArgs& a) { a.out_tokens.data = nullptr; },
     {"out_tokens", "missing"}},
    {"ExpertYInt32", true, [](CallArgs& a) { a.expert_y.dtype = DType::kInt32; },
     {"expert_y", "int32"}},
    {"ExpertYWrongCapacity", true, [](CallArgs& a) { reshape(a.expert_y, {4, 16, 128}); },
     {"expert_y", "shape"}},
    {"ExpertYMissing", true, [](CallArgs& a) { a.expert_y.data = nullptr; },
     {"expert_y", "missing"}},
    {"CombineIndicesMissing", true, [](CallArgs& a) { a.indices.data = nullptr; },
     {"indices", "missing"}},
    {"CombineWeightsWrongTopK", true, [](CallArgs& a) { reshape(a.weights, {8, 1}); },
     {"weights", "shape"}},
    {"CombineBoundMFloat", true, [](CallArgs& a) { a.bound_m.dtype = DType::kFloat32; },
     {"bound_m", "float32"}},
};

INSTANTIATE_TEST_SUITE_P(Args, ArgumentErrorTest, testing::ValuesIn(kArgErrors),
                         [](const testing::TestParamInfo<ArgError>& i) { return i.param.name; });

TEST(CallArguments, NeitherSendNorRecvIsRejected) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    CallArgs a;
    auto a2a = moelink::AllToAll::create(a.c, bs, cpu_options());
    expect_throw_naming<InvalidArgument>([&] { a.dispatch(*a2a, false, false); },
                                         {"dispatch", "do_send", "do_recv"}, "dispatch");
    a.dispatch(*a2a);
    expect_throw_naming<InvalidArgument>([&] { a.combine(*a2a, false, false); },
                                         {"combine", "do_send", "do_recv"}, "combine");
    a.combine(*a2a);
  }, 60);
}

// ------------------------------------------------------------ call order

TEST(CallOrder, CombineBeforeDispatchIsRejected) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    CallArgs a;
    auto a2a = moelink::AllToAll::create(a.c, bs, cpu_options());
    expect_throw_naming<InvalidArgument>([&] { a.combine(*a2a); },
                                         {"call order", "combine", "dispatch send half"},
                                         "combine first");
    a.dispatch(*a2a);  // the rejected call changed nothing
    a.combine(*a2a);
  }, 60);
}

TEST(CallOrder, DispatchReceiveBeforeSendIsRejected) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    CallArgs a;
    auto a2a = moelink::AllToAll::create(a.c, bs, cpu_options());
    expect_throw_naming<InvalidArgument>([&] { a.dispatch(*a2a, false, true); },
                                         {"call order", "dispatch receive half"}, "recv first");
    a.dispatch(*a2a);
    a.combine(*a2a);
  }, 60);
}

TEST(CallOrder, TwoDispatchSendsAreRejected) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    CallArgs a;
    auto a2a = moelink::AllToAll::create(a.c, bs, cpu_options());
    a.dispatch(*a2a, true, false);
    expect_throw_naming<InvalidArgument>([&] { a.dispatch(*a2a, true, false); },
                                         {"call order", "dispatch receive half"},
                                         "second send half");
    a.dispatch(*a2a, false, true);
    a.combine(*a2a, true, false);
    a.combine(*a2a, false, true);
    a2a->check();
  }, 60);
}

TEST(CallOrder, TwoDispatchesWithoutCombineAreRejected) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    CallArgs a;
    auto a2a = moelink::AllToAll::create(a.c, bs, cpu_options());
    a.dispatch(*a2a);
    expect_throw_naming<InvalidArgument>([&] { a.dispatch(*a2a); },
                                         {"call order", "combine send half"}, "second dispatch");
    a.combine(*a2a);
    a.dispatch(*a2a);  // the next round is fine
    a.combine(*a2a);
    a2a->check();
  }, 60);
}

TEST(CallOrder, CombineReceiveBeforeSendIsRejected) {
  run_ranks(1, [](int, moelink::Bootstrap& bs) {
    CallArgs a;
    auto a2a = moelink::AllToAll::create(a.c, bs, cpu_options());
    a.dispatch(*a2a);
    expect_throw_naming<InvalidArgument>([&] { a.combine(*a2a, false, true); },
                                         {"call order", "combine send half"}, "combine recv first");
    a.combine(*a2a);
    a2a->check();
  }, 60);
}

}  // namespace
}  // namespace moelink_test
