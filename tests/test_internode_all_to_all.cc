// The inter-node protocol (src/internode) with CPU loops (kInternodeCPU):
// forked ranks, each with its own TransferEngine over libfabric's shm or tcp
// provider, checked by the shared driver against tests/reference.h. Covers
// >= 4 ranks, DP groups, skewed / empty / -1 routings, every private-token
// split (all private, none private, in between), split calls, bad input, and
// a rank that leaves mid-dispatch or mid-combine.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "all_to_all_cases.h"
#include "case_builders.h"
#include "fabric_test_util.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

using moelink::DType;

constexpr int kCaseTimeoutS = 300;

CaseSpec node(const char* provider, int W, int dp, int64_t T, int E, int k, int64_t H, DType in,
              DType out, DType y) {
  CaseSpec s = make_spec(moelink::Backend::kInternodeCPU, W, dp, T, E, k, H, in, out, y);
  s.fabric_provider = provider;
  return s;
}

#define REQUIRE_PROVIDER(p)                                                       \
  do {                                                                            \
    if (!fabric_provider_available(p))                                            \
      GTEST_SKIP() << "libfabric provider '" << (p) << "' is not available here"; \
  } while (0)

void run_node_case(const CaseSpec& spec) {
  run_ranks(
      spec.world_size,
      [&](int rank, moelink::Bootstrap& bs) {
        auto ops = make_host_memory_ops();
        run_case_on_rank(spec, rank, bs, *ops);
      },
      kCaseTimeoutS);
}

class InternodeCpu : public testing::TestWithParam<NamedCase> {};

TEST_P(InternodeCpu, DispatchAndCombineMatchReference) {
  REQUIRE_PROVIDER(GetParam().spec.fabric_provider);
  run_node_case(GetParam().spec);
}

std::vector<NamedCase> shm_cases() {
  const char* p = "shm";
  std::vector<NamedCase> v;
  v.push_back({"W4_Bf16_K4_E16", node(p, 4, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16)});
  v.push_back(
      {"W4_Dp2_Fp8_K8_E32_Uint32", with(node(p, 4, 2, 32, 32, 8, 512, kFp8, kFp16, kBf16),
                                        [](CaseSpec& s) { s.index_dtype = DType::kUInt32; })});
  v.push_back({"W4_Dp4_Fp16_K3_E12", node(p, 4, 4, 20, 12, 3, 128, kFp16, kBf16, kBf16)});
  v.push_back({"W5_Fp16_K2_E10_Int32", with(node(p, 5, 1, 24, 10, 2, 128, kFp16, kFp16, kFp32),
                                            [](CaseSpec& s) { s.index_dtype = DType::kInt32; })});
  v.push_back({"W8_Bf16_K8_E64", node(p, 8, 1, 16, 64, 8, 128, kBf16, kBf16, kBf16)});
  v.push_back(
      {"W4_DeepSeekLike_Fp8_H7168_E256_K8", node(p, 4, 1, 16, 256, 8, 7168, kFp8, kBf16, kBf16)});
  v.push_back({"W1_Bf16_K2_E8", node(p, 1, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16)});
  v.push_back({"W2_Dp2_Bf16_K8_E8_YFp16", node(p, 2, 2, 16, 8, 8, 256, kBf16, kBf16, kFp16)});
  // Routings: one hot expert (the other ranks receive nothing), -1 routes,
  // experts repeated within a token.
  v.push_back({"W4_Skewed_K1_EmptyRanks", with(node(p, 4, 1, 32, 8, 1, 128, kBf16, kBf16, kBf16),
                                               [](CaseSpec& s) { s.routing = Routing::kSkewed; })});
  v.push_back({"W4_Dp2_Skewed_K4", with(node(p, 4, 2, 32, 16, 4, 128, kFp8, kBf16, kBf16),
                                        [](CaseSpec& s) { s.routing = Routing::kSkewed; })});
  v.push_back({"W4_WithNone_Int32",
               with(node(p, 4, 1, 32, 16, 4, 128, kBf16, kFp16, kBf16), [](CaseSpec& s) {
                 s.routing = Routing::kWithNone;
                 s.index_dtype = DType::kInt32;
               })});
  v.push_back({"W4_Repeated_K8_E8", with(node(p, 4, 1, 16, 8, 8, 128, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.routing = Routing::kRepeated; })});
  // Private tokens: none (all through the shared area), one, all.
  for (int priv : {0, 1, 32})
    v.push_back({"W4_Dp2_Private" + std::to_string(priv),
                 with(node(p, 4, 2, 32, 16, 4, 128, kBf16, kBf16, kBf16), [&](CaseSpec& s) {
                   s.max_private_tokens = priv;
                   s.routing = Routing::kSkewed;
                 })});
  // Two NICs per rank (two domains of the provider): peers sharded over them.
  v.push_back({"W4_Dp2_TwoNics", with(node(p, 4, 2, 32, 16, 4, 128, kFp8, kBf16, kBf16),
                                      [](CaseSpec& s) {
                                        s.fabric_nics = 2;
                                        s.max_private_tokens = 2;
                                      })});
  v.push_back({"W5_ThreeNics", with(node(p, 5, 1, 16, 10, 3, 128, kBf16, kBf16, kBf16),
                                    [](CaseSpec& s) { s.fabric_nics = 3; })});
  // Call modes.
  v.push_back({"W4_Dp2_Split_Accumulate_Strided_Padded",
               with(node(p, 4, 2, 16, 8, 2, 128, kBf16, kFp16, kBf16), [](CaseSpec& s) {
                 s.split = true;
                 s.accumulate = true;
                 s.strided = true;
                 s.padded = true;
                 s.input_rows = 12;
               })});
  v.push_back({"W4_ManyRounds_Private2",
               with(node(p, 4, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.rounds = 12;
                 s.max_private_tokens = 2;
               })});
  for (uint64_t seed : {21, 22, 23})
    v.push_back({"W4_Dp2_Seed" + std::to_string(seed),
                 with(node(p, 4, 2, 32, 16, 4, 128, kBf16, kBf16, kBf16), [&](CaseSpec& s) {
                   s.seed = seed;
                   s.max_private_tokens = 3;
                 })});
  // Node peers (Options.node_size): their tokens and rows go through the
  // node's shared memory, only the other nodes' through the engine.
  const auto nodes = [&](const std::string& name, int node_size, CaseSpec s,
                         const std::function<void(CaseSpec&)>& f = {}) {
    s.node_size = node_size;
    if (f) f(s);
    v.push_back({name, s});
  };
  nodes("Nodes2_W4_Bf16_K4_E16", 2, node(p, 4, 1, 32, 16, 4, 256, kBf16, kBf16, kBf16));
  nodes("Nodes2_W4_Dp2_Fp8_K8_E32", 2, node(p, 4, 2, 32, 32, 8, 512, kFp8, kFp16, kBf16));
  nodes("Nodes4_W4_AllLocal_Dp2", 4, node(p, 4, 2, 32, 16, 4, 128, kBf16, kBf16, kBf16));
  nodes("NodesByHost_W4", 0, node(p, 4, 1, 32, 16, 4, 128, kFp16, kBf16, kFp32));
  nodes("Nodes3_W6_K3_E12", 3, node(p, 6, 1, 24, 12, 3, 128, kBf16, kFp16, kBf16));
  // DP groups across nodes: a combine row reaches some replicas directly and
  // the others through the engine.
  nodes("Nodes2_W4_Dp4_GroupSpansNodes", 2, node(p, 4, 4, 20, 12, 3, 128, kFp16, kBf16, kBf16));
  nodes("Nodes2_W6_Dp3_Skewed", 2, node(p, 6, 3, 18, 12, 4, 128, kBf16, kBf16, kBf16),
        [](CaseSpec& s) { s.routing = Routing::kSkewed; });
  nodes("Nodes4_W8_Dp2_K8_E64", 4, node(p, 8, 2, 16, 64, 8, 128, kBf16, kBf16, kBf16));
  nodes("Nodes2_W4_Dp2_Skewed_Private0", 2, node(p, 4, 2, 32, 16, 4, 128, kFp8, kBf16, kBf16),
        [](CaseSpec& s) {
          s.routing = Routing::kSkewed;
          s.max_private_tokens = 0;
        });
  nodes("Nodes2_W4_WithNone_Private1", 2, node(p, 4, 1, 32, 16, 4, 128, kBf16, kBf16, kBf16),
        [](CaseSpec& s) {
          s.routing = Routing::kWithNone;
          s.max_private_tokens = 1;
        });
  nodes("Nodes2_W4_Repeated_K8_E8", 2, node(p, 4, 1, 16, 8, 8, 128, kBf16, kBf16, kBf16),
        [](CaseSpec& s) { s.routing = Routing::kRepeated; });
  nodes("Nodes2_W4_Dp2_Split_Accumulate_Strided_Padded", 2,
        node(p, 4, 2, 16, 8, 2, 128, kBf16, kFp16, kBf16), [](CaseSpec& s) {
          s.split = true;
          s.accumulate = true;
          s.strided = true;
          s.padded = true;
          s.input_rows = 12;
        });
  nodes("Nodes2_W4_ManyRounds_TwoNics", 2, node(p, 4, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
        [](CaseSpec& s) {
          s.rounds = 12;
          s.fabric_nics = 2;
          s.max_private_tokens = 2;
        });
  for (uint64_t seed : {31, 32})
    nodes("Nodes2_W4_Dp2_Seed" + std::to_string(seed), 2,
          node(p, 4, 2, 32, 16, 4, 128, kBf16, kBf16, kBf16), [&](CaseSpec& s) { s.seed = seed; });
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shm, InternodeCpu, testing::ValuesIn(shm_cases()), CaseName());

// tcp connects lazily (75-170 ms per peer on first use): fewer, longer cases.
std::vector<NamedCase> tcp_cases() {
  const char* p = "tcp";
  std::vector<NamedCase> v;
  v.push_back({"W4_Dp2_Fp8_K8_E32", node(p, 4, 2, 32, 32, 8, 512, kFp8, kBf16, kBf16)});
  v.push_back({"W4_WithNone_Private1",
               with(node(p, 4, 1, 32, 16, 4, 128, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.routing = Routing::kWithNone;
                 s.max_private_tokens = 1;
               })});
  v.push_back(
      {"W4_Skewed_Split", with(node(p, 4, 1, 32, 8, 2, 128, kBf16, kBf16, kBf16), [](CaseSpec& s) {
         s.routing = Routing::kSkewed;
         s.split = true;
       })});
  v.push_back({"Nodes2_W4_Dp2", with(node(p, 4, 2, 32, 16, 4, 128, kBf16, kBf16, kBf16),
                                     [](CaseSpec& s) { s.node_size = 2; })});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Tcp, InternodeCpu, testing::ValuesIn(tcp_cases()), CaseName());

// ------------------------------------------------------------ bad input

std::vector<NamedCase> input_error_cases() {
  const char* p = "shm";
  std::vector<NamedCase> v;
  v.push_back({"ExpertIdEqualsE_W4", with(node(p, 4, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                                          [](CaseSpec& s) { s.inject = Inject::kExpertIdE; })});
  v.push_back({"ExpertIdMinus5_Uint32_W4Dp2",
               with(node(p, 4, 2, 16, 8, 2, 128, kBf16, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertIdMinus5;
                 s.index_dtype = DType::kUInt32;
               })});
  v.push_back(
      {"BoundMTooLarge_W4Dp2", with(node(p, 4, 2, 16, 8, 2, 128, kFp8, kBf16, kBf16),
                                    [](CaseSpec& s) { s.inject = Inject::kBoundMTooLarge; })});
  v.push_back({"BoundMNegative_W4", with(node(p, 4, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                                         [](CaseSpec& s) { s.inject = Inject::kBoundMNegative; })});
  v.push_back({"ExpertOverflow_W4Dp2_K4",
               with(node(p, 4, 2, 16, 8, 4, 256, kFp8, kBf16, kBf16), [](CaseSpec& s) {
                 s.inject = Inject::kExpertOverflow;
                 s.max_private_tokens = 4;
               })});
  return v;
}

class InternodeCpuInputError : public testing::TestWithParam<NamedCase> {};

TEST_P(InternodeCpuInputError, CheckThrowsInputErrorAndOutputsStayInBounds) {
  REQUIRE_PROVIDER(GetParam().spec.fabric_provider);
  run_node_case(GetParam().spec);
}

INSTANTIATE_TEST_SUITE_P(BadInput, InternodeCpuInputError, testing::ValuesIn(input_error_cases()),
                         CaseName());

// ------------------------------------------------------------ a rank leaves

void run_rank_exit(const CaseSpec& spec, int exiting_rank, bool before_combine) {
  run_ranks(
      spec.world_size,
      [&](int rank, moelink::Bootstrap& bs) {
        auto ops = make_host_memory_ops();
        run_rank_exit_case(spec, rank, exiting_rank, bs, *ops, before_combine);
      },
      120);
}

struct ExitCase {
  const char* provider;
  int world_size, dp_size, exiting_rank;
  bool before_combine;
  int node_size = 1;
};

class InternodeCpuRankExit : public testing::TestWithParam<ExitCase> {};

TEST_P(InternodeCpuRankExit, TheRankIsNamedInTimeoutError) {
  const ExitCase& c = GetParam();
  REQUIRE_PROVIDER(c.provider);
  run_rank_exit(with(node(c.provider, c.world_size, c.dp_size, 16, 8, 2, 128, kBf16, kBf16, kBf16),
                     [&](CaseSpec& s) {
                       s.timeout_s = 3;
                       s.node_size = c.node_size;
                     }),
                c.exiting_rank, c.before_combine);
}

INSTANTIATE_TEST_SUITE_P(
    Exit, InternodeCpuRankExit,
    testing::Values(ExitCase{"shm", 4, 1, 3, false}, ExitCase{"shm", 4, 2, 0, false},
                    ExitCase{"shm", 4, 2, 2, true}, ExitCase{"tcp", 4, 1, 1, false},
                    ExitCase{"tcp", 4, 1, 2, true},
                    // A node peer leaves: its node mate and the other node
                    // both name it.
                    ExitCase{"shm", 4, 1, 1, false, 2}, ExitCase{"shm", 4, 2, 2, true, 2}),
    [](const testing::TestParamInfo<ExitCase>& i) {
      return std::string(i.param.provider) + "_W" + std::to_string(i.param.world_size) + "_Dp" +
             std::to_string(i.param.dp_size) + "_Rank" + std::to_string(i.param.exiting_rank) +
             (i.param.before_combine ? "_BeforeCombine" : "_BeforeDispatch") +
             (i.param.node_size > 1 ? "_Nodes" + std::to_string(i.param.node_size) : "");
    });

// ------------------------------------------------------------ node_size

// A node_size that does not divide the world fails create on every rank
// with the field and the rule; so do ranks that disagree.
TEST(InternodeCpuNodeSize, InvalidOrDisagreeingNodeSizeIsRefused) {
  REQUIRE_PROVIDER("shm");
  struct Bad {
    int dp, node_size;
  };
  for (const Bad b : {Bad{1, 3}, Bad{2, 8}}) {
    const CaseSpec spec = node("shm", 4, b.dp, 16, 8, 2, 128, kBf16, kBf16, kBf16);
    run_ranks(
        4,
        [&](int rank, moelink::Bootstrap& bs) {
          moelink::Options o;
          o.backend = moelink::Backend::kInternodeCPU;
          o.fabric_provider = "shm";
          o.node_size = b.node_size;
          try {
            moelink::AllToAll::create(spec.config(rank), bs, o);
            RANK_CHECK(false) << "node_size " << b.node_size << " with dp " << b.dp
                              << " was accepted";
          } catch (const moelink::InvalidArgument& e) {
            const std::string what = e.what();
            RANK_CHECK(what.find("node_size = " + std::to_string(b.node_size)) !=
                           std::string::npos &&
                       what.find("world_size = 4") != std::string::npos)
                << what;
          }
        },
        60);
  }
  const CaseSpec spec = node("shm", 4, 1, 16, 8, 2, 128, kBf16, kBf16, kBf16);
  run_ranks(
      4,
      [&](int rank, moelink::Bootstrap& bs) {
        moelink::Options o;
        o.backend = moelink::Backend::kInternodeCPU;
        o.fabric_provider = "shm";
        o.node_size = rank == 2 ? 2 : 4;
        try {
          moelink::AllToAll::create(spec.config(rank), bs, o);
          RANK_CHECK(false) << "ranks disagreeing on node_size were accepted";
        } catch (const moelink::InvalidArgument& e) {
          RANK_CHECK(std::string(e.what()).find("node_size") != std::string::npos) << e.what();
        }
      },
      60);
}

// ------------------------------------------------------------ phase times

TEST(InternodeCpuProfile, PhaseTimesCoverEveryPhaseOnlyWhenProfiling) {
  REQUIRE_PROVIDER("shm");
  for (bool profile : {true, false}) {
    const CaseSpec spec = with(node("shm", 4, 1, 32, 16, 4, 1024, kBf16, kBf16, kBf16),
                               [&](CaseSpec& s) { s.profile = profile; });
    run_ranks(
        4,
        [&](int rank, moelink::Bootstrap& bs) {
          auto ops = make_host_memory_ops();
          CaseRunner runner(spec, rank, bs, *ops);
          runner.run_round(0);
          const moelink::CallTimes t = runner.all_to_all().phase_times();
          for (const auto& [name, p] :
               {std::pair{"dispatch", t.dispatch}, std::pair{"combine", t.combine}}) {
            const double parts[] = {p.pack_us, p.post_us, p.wire_us, p.unpack_us};
            for (double v : parts) {
              if (profile)
                RANK_CHECK(v > 0 && v < 30e6) << name << ": a phase took " << v << " us";
              else
                RANK_CHECK(v == 0) << name << ": phase time " << v << " without profiling";
            }
          }
        },
        120);
  }
}

}  // namespace
}  // namespace moelink_test
