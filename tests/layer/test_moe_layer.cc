// MoELayer: the whole layer on the cpu backend (CI) and the nvlink backend
// (GPU; ranks share the machine's GPUs), every overlap mode, against the
// fp64 reference; the router alone; CUDA-graph replays; checkpoints in
// DeepSeek-V3's fp8 layout and in bf16; configs and argument errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "all_to_all_cases.h"
#include "experts/expert_cases.h"
#include "experts/expert_reference.h"
#include "layer/layer_cases.h"
#include "layer/layer_reference.h"
#include "moelink/errors.h"
#include "rank_harness.h"
#include "safetensors_writer.h"
#include "ref_dtype.h"
#if defined(MOELINK_WITH_CUDA)
#include "gpu_memory_ops.h"  // CUDA_OK
#include "moelink/experts.h"
#endif

namespace moelink_test {
namespace {

using moelink::Backend;
using moelink::DType;
using moelink::MoEModelConfig;
using moelink::MoEOverlap;
using moelink::Tensor;

constexpr const char* kNoGpu =
    "no CUDA GPU on this machine: the GPU MoE layer tests run on the H200 device machine "
    "(tools/gpu_check.sh)";

class CpuMoELayer : public ::testing::TestWithParam<LayerCase> {};
TEST_P(CpuMoELayer, MatchesReference) { run_layer_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cases, CpuMoELayer, ::testing::ValuesIn(layer_cases(Backend::kCPU)),
                         [](const auto& info) { return info.param.name; });

#if defined(MOELINK_WITH_CUDA)
class GpuMoELayer : public ::testing::TestWithParam<LayerCase> {};
TEST_P(GpuMoELayer, MatchesReference) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << kNoGpu;
  run_layer_case(GetParam());
}
std::vector<LayerCase> gpu_layer_cases() {
  std::vector<LayerCase> cases = layer_cases(Backend::kNVLink);
  // CUDA graphs: a bucket captured once and replayed with new tokens and m;
  // and two layers on one scratch, each with its graphs (captured on the
  // shared staging buffers and AllToAlls), replayed alternately.
  for (bool shared : {false, true})
    for (MoEOverlap mode : {MoEOverlap::kDispatchOverlap, MoEOverlap::kMicroBatch}) {
      LayerCase c;
      c.model = deepseek_like_model();
      c.backend = Backend::kNVLink;
      c.world = 2;
      c.overlap = mode;
      c.cuda_graphs = true;
      c.rounds = 4;
      c.shared_scratch = shared;
      if (shared) c.max_tokens = 8, c.ms = {3, 8, 1, 0, 5};
      c.name = std::string("DeepSeekLike_W2_Graphs_") + moelink::moe_overlap_name(mode) +
               (shared ? "_SharedScratch" : "");
      for (char& ch : c.name)
        if (ch == '-') ch = '_';
      cases.push_back(c);
    }
  // Graphs with 0-3 tokens after bad calls, in every mode, with the router
  // weight in fp32 (its staging buffer once was allocated inside the
  // capture) and in bf16; an eager fp32 router too.
  for (int world : {1, 2})
    for (MoEOverlap mode : {MoEOverlap::kNone, MoEOverlap::kDispatchOverlap, MoEOverlap::kMicroBatch})
      for (bool fp32_gate : {false, true}) {
        LayerCase c;
        c.model = deepseek_like_model();
        c.backend = Backend::kNVLink;
        c.world = world;
        c.overlap = mode;
        c.cuda_graphs = true;
        c.max_tokens = 8;
        c.ms = {1, 0, 2, 3, 1, 8};
        c.bad_calls = true;
        c.fp32_gate = fp32_gate;
        c.name = "DeepSeekLike_W" + std::to_string(world) + "_Graphs_" +
                 moelink::moe_overlap_name(mode) + (fp32_gate ? "_Fp32Gate" : "_Bf16Gate") +
                 "_FewRowsAfterBadCalls";
        for (char& ch : c.name)
          if (ch == '-') ch = '_';
        cases.push_back(c);
      }
  {
    LayerCase c;
    c.model = deepseek_like_model();
    c.backend = Backend::kNVLink;
    c.world = 2;
    c.overlap = MoEOverlap::kMicroBatch;
    c.fp32_gate = true;
    c.name = "DeepSeekLike_W2_MicroBatch_Fp32Gate";
    cases.push_back(c);
  }
  // T = 64 with num_tokens = m: calls of <= 32 rows take the decode-sized
  // shared expert (split over K), larger ones the T-row one.
  for (bool graphs : {false, true}) {
    LayerCase c;
    c.model = deepseek_like_model();
    c.backend = Backend::kNVLink;
    c.world = 1;
    c.max_tokens = 64;
    c.overlap = MoEOverlap::kDispatchOverlap;
    c.cuda_graphs = graphs;
    c.num_tokens_is_m = true;
    c.rounds = 6;
    c.name = graphs ? "DeepSeekLike_W1_T64_ExactTokens_Graphs" : "DeepSeekLike_W1_T64_ExactTokens";
    cases.push_back(c);
  }
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Cases, GpuMoELayer, ::testing::ValuesIn(gpu_layer_cases()),
                         [](const auto& info) { return info.param.name; });

// Engines capture graphs while other objects come and go: an Experts, a
// MoELayer (with a captured graph of its own) and an AllToAll destroyed
// while another stream of the process captures, in each capture mode that
// forbids unsafe calls, must leave that capture valid and its graph right.
TEST(GpuCaptureSafety, ObjectsDestroyedDuringAnotherStreamsCapture) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << kNoGpu;
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    CUDA_OK(cudaSetDevice(0));
    const MoEModelConfig m = deepseek_like_model();
    LayerWeights w = random_layer_weights(m, fresh_seed());
    constexpr size_t kBytes = 1 << 16;
    void* buf = nullptr;
    CUDA_OK(cudaMalloc(&buf, kBytes));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (cudaStreamCaptureMode mode : {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal}) {
      const std::string when = mode == cudaStreamCaptureModeGlobal ? "global mode" : "thread-local mode";
      moelink::ExpertConfig ec;
      ec.num_experts = 4;
      ec.max_rows = 32;
      ec.hidden_dim = 256;
      ec.intermediate_dim = 128;
      auto experts = moelink::Experts::create(ec);
      moelink::MoELayerOptions o;
      o.max_tokens = 8;
      o.cuda_graphs = true;
      o.all_to_all.backend = Backend::kNVLink;
      auto layer = moelink::MoELayer::create(m, o, boot);
      layer->set_weights(w.view(m, 0, layer->num_local_experts()));
      GpuMemoryOps ops(0);
      void* dx = ops.alloc(8 * m.hidden_size * 2);
      void* dout = ops.alloc(8 * m.hidden_size * 2);
      void* dm = ops.alloc(4);
      const int32_t mm = 5;
      ops.fill(dx, 0x3C, 8 * m.hidden_size * 2);
      ops.h2d(dm, &mm, 4);
      layer->forward(Tensor::contiguous(dout, DType::kBFloat16, {8, m.hidden_size}),
                     Tensor::contiguous(dx, DType::kBFloat16, {8, m.hidden_size}),
                     Tensor::contiguous(dm, DType::kInt32, {1}), ops.stream());
      layer->check(ops.stream());
      moelink::Config ac;
      ac.max_num_tokens = 8;
      ac.num_experts = 8;
      ac.experts_per_token = 2;
      ac.hidden_dim = 256;
      ac.in_dtype = DType::kBFloat16;
      ac.out_dtype = DType::kBFloat16;
      auto a2a = moelink::AllToAll::create(ac, boot);
      CUDA_OK(cudaDeviceSynchronize());

      // Each object goes inside a capture of its own, so that a failure
      // names the object whose release broke it.
      auto destroyed_during_capture = [&](const char* what, const std::function<void()>& destroy) {
        CUDA_OK(cudaStreamBeginCapture(s, mode));
        CUDA_OK(cudaMemsetAsync(buf, 0x11, kBytes / 2, s));
        destroy();
        const cudaError_t second = cudaMemsetAsync(static_cast<char*>(buf) + kBytes / 2, 0x22, kBytes / 2, s);
        cudaGraph_t graph = nullptr;
        const cudaError_t ended = cudaStreamEndCapture(s, &graph);
        RANK_CHECK(second == cudaSuccess && ended == cudaSuccess)
            << when << ": destroying " << what << " broke the capture: " << cudaGetErrorString(second)
            << " / " << cudaGetErrorString(ended);
        if (second != cudaSuccess || ended != cudaSuccess) {
          if (graph) cudaGraphDestroy(graph);
          (void)cudaGetLastError();
          return;
        }
        cudaGraphExec_t exec = nullptr;
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaMemset(buf, 0, kBytes));
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        std::vector<uint8_t> host(kBytes);
        CUDA_OK(cudaMemcpy(host.data(), buf, kBytes, cudaMemcpyDeviceToHost));
        RANK_CHECK(host[0] == 0x11 && host[kBytes / 2 - 1] == 0x11 && host[kBytes / 2] == 0x22 &&
                   host[kBytes - 1] == 0x22)
            << when << ", " << what << ": the graph did not do what was captured";
        RANK_CHECK(cudaGetLastError() == cudaSuccess) << when << ", " << what << ": an error was left behind";
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      };
      destroyed_during_capture("an Experts", [&] { experts.reset(); });
      destroyed_during_capture("a MoELayer", [&] { layer.reset(); });
      destroyed_during_capture("an AllToAll", [&] { a2a.reset(); });
      ops.free(dx);
      ops.free(dout);
      ops.free(dm);
    }
    cudaStreamDestroy(s);
    cudaFree(buf);
  }, 120);
}
#endif

// ------------------------------------------------------------ router

// route() against the reference: the same experts (as a set) for every
// token not within 1e-4 of a tie, weights within 1e-5.
void check_router(const MoEModelConfig& m) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    moelink::MoELayerOptions o;
    o.max_tokens = 64;
    o.all_to_all.backend = Backend::kCPU;
    auto layer = moelink::MoELayer::create(m, o, boot);
    LayerWeights w = random_layer_weights(m, seed);
    layer->set_weights(w.view(m, 0, layer->num_local_experts()));
    const int64_t T = 64, H = m.hidden_size, k = m.num_experts_per_tok;
    std::mt19937_64 rng(seed + 1);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<uint16_t> x(T * H);
    for (auto& v : x) v = bf16_bits_exact(round_to_bf16(nd(rng)));
    std::vector<int32_t> idx(T * k, -7);
    std::vector<float> wt(T * k, -7.0f);
    int32_t mm = 60;
    layer->route(Tensor::contiguous(idx.data(), DType::kInt32, {T, k}),
                 Tensor::contiguous(wt.data(), DType::kFloat32, {T, k}),
                 Tensor::contiguous(x.data(), DType::kBFloat16, {T, H}),
                 Tensor::contiguous(&mm, DType::kInt32, {1}));
    int compared = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (t >= mm) {
        RANK_CHECK(idx[t * k] == -7 && wt[t * k] == -7.0f) << "row " << t << " >= m written";
        continue;
      }
      const RefRoute r = ref_route(m, w, &x[t * H]);
      if (r.margin < 1e-4) continue;
      ++compared;
      for (int i = 0; i < k; ++i) {
        const auto at = std::find(r.experts.begin(), r.experts.end(), idx[t * k + i]);
        RANK_CHECK(at != r.experts.end()) << "token " << t << " routed to expert " << idx[t * k + i];
        if (at == r.experts.end()) continue;
        const double want = r.weights[at - r.experts.begin()];
        RANK_CHECK(std::fabs(wt[t * k + i] - want) <= 1e-5 * std::max(1.0, std::fabs(want)))
            << "token " << t << " expert " << idx[t * k + i] << " weight " << wt[t * k + i]
            << ", expected " << want;
      }
    }
    RANK_CHECK(compared >= 40) << "only " << compared << " tokens away from ties";
  }, 120);
}

TEST(MoELayerRouter, GroupLimitedSigmoidWithBias) { check_router(deepseek_like_model()); }
TEST(MoELayerRouter, SoftmaxTopK) { check_router(mixtral_like_model()); }
TEST(MoELayerRouter, SoftmaxRenormalized) { check_router(qwen_like_model()); }
TEST(MoELayerRouter, DeepSeekV3Shape) {
  MoEModelConfig m = MoEModelConfig::deepseek_v3();
  m.hidden_size = 512;  // the router's shape is E = 256, 8 groups of 32, top-4 groups, top-8
  m.moe_intermediate_size = 128;
  check_router(m);
}

// ------------------------------------------------------------ configs

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `auto` micro-batches only where the exchange may cross nodes, and there
// from micro_batch_min_tokens: on one node (the cpu backend here, like
// nvlink) it stays dispatch-overlap at any size and world.
TEST(MoELayerOverlap, AutoStaysDispatchOverlapOnOneNode) {
  for (int world : {1, 2}) {
    run_ranks(world, [&](int, moelink::Bootstrap& boot) {
      moelink::MoELayerOptions o;
      o.max_tokens = 64;
      o.micro_batch_min_tokens = 16;
      o.all_to_all.backend = Backend::kCPU;
      auto layer = moelink::MoELayer::create(deepseek_like_model(), o, boot);
      for (int64_t tokens : {1, 15, 16, 64})
        RANK_CHECK(layer->overlap_for(tokens) == MoEOverlap::kDispatchOverlap)
            << "world " << world << ", " << tokens << " tokens";
    }, 60);
  }
}

TEST(MoELayerOverlap, AutoMicroBatchesOnlyWhereTheExchangeMayCrossNodes) {
  for (Backend b : {Backend::kNVLink, Backend::kCPU}) {
    EXPECT_FALSE(moelink::moe_auto_micro_batches(b, 1));
    EXPECT_FALSE(moelink::moe_auto_micro_batches(b, 8));
  }
  for (Backend b : {Backend::kNVSHMEM, Backend::kInternode, Backend::kInternodeCPU}) {
    EXPECT_FALSE(moelink::moe_auto_micro_batches(b, 1)) << static_cast<int>(b);
    EXPECT_TRUE(moelink::moe_auto_micro_batches(b, 2)) << static_cast<int>(b);
    EXPECT_TRUE(moelink::moe_auto_micro_batches(b, 16)) << static_cast<int>(b);
  }
}

TEST(MoEModelConfig, PresetsMatchTheirConfigJson) {
  const std::pair<const char*, MoEModelConfig> presets[] = {
      {"deepseek-v3", MoEModelConfig::deepseek_v3()},
      {"deepseek-r1", MoEModelConfig::preset("deepseek-r1")},
      {"kimi-k2", MoEModelConfig::kimi_k2()},
      {"qwen3-235b-a22b", MoEModelConfig::qwen3_235b_a22b()},
      {"mixtral-8x7b", MoEModelConfig::mixtral_8x7b()}};
  for (const auto& [file, p] : presets) {
    SCOPED_TRACE(file);
    const std::string text = read_file(std::string(MOELINK_PROFILES_DIR) + "/models/" + file + ".json");
    ASSERT_FALSE(text.empty());
    const MoEModelConfig j = MoEModelConfig::from_hf_config_json(text);
    EXPECT_EQ(j.hidden_size, p.hidden_size);
    EXPECT_EQ(j.moe_intermediate_size, p.moe_intermediate_size);
    EXPECT_EQ(j.n_routed_experts, p.n_routed_experts);
    EXPECT_EQ(j.n_shared_experts, p.n_shared_experts);
    EXPECT_EQ(j.num_experts_per_tok, p.num_experts_per_tok);
    EXPECT_EQ(j.n_group, p.n_group);
    EXPECT_EQ(j.topk_group, p.topk_group);
    EXPECT_EQ(j.scoring, p.scoring);
    EXPECT_EQ(j.score_correction_bias, p.score_correction_bias);
    EXPECT_EQ(j.norm_topk_prob, p.norm_topk_prob);
    EXPECT_FLOAT_EQ(j.routed_scaling_factor, p.routed_scaling_factor);
    EXPECT_EQ(j.checkpoint_naming, p.checkpoint_naming);
  }
}

template <class F>
void expect_invalid(F call, std::initializer_list<const char*> words) {
  try {
    call();
    ADD_FAILURE() << "no InvalidArgument; expected one naming " << *words.begin();
  } catch (const moelink::InvalidArgument& e) {
    for (const char* w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(MoEModelConfig, BadFieldsAreNamed) {
  auto with = [](auto change) {
    MoEModelConfig m = deepseek_like_model();
    change(m);
    return [m] { m.validate(); };
  };
  expect_invalid(with([](MoEModelConfig& m) { m.hidden_size = 200; }), {"hidden_size = 200"});
  expect_invalid(with([](MoEModelConfig& m) { m.n_group = 3; }), {"n_group = 3", "divide"});
  expect_invalid(with([](MoEModelConfig& m) { m.topk_group = 5; }), {"topk_group = 5"});
  expect_invalid(with([](MoEModelConfig& m) { m.num_experts_per_tok = 17; }), {"num_experts_per_tok = 17"});
  expect_invalid(with([](MoEModelConfig& m) { m.topk_group = 1; m.num_experts_per_tok = 5; }),
                 {"topk_group = 1", "fewer experts"});
  expect_invalid([] { MoEModelConfig::preset("gpt-5"); }, {"unknown model 'gpt-5'"});
  expect_invalid([] { MoEModelConfig::from_hf_config_json("{\"hidden_size\": 256}"); },
                 {"moe_intermediate_size"});
  expect_invalid([] { MoEModelConfig::from_hf_config_json("not json"); }, {"not valid JSON"});
}

// ------------------------------------------------------------ checkpoints

// A safetensors file of named tensors (dtype string, shape, bytes).
// The test model's layer `layer` in DeepSeek-V3's layout, fp8 with
// weight_scale_inv (fp8 = true) or bf16 (dequantized), split over two files
// with an index.
std::string write_checkpoint(const MoEModelConfig& m, LayerWeights& w, int layer, bool fp8) {
  char tmpl[] = "/tmp/moelink-ckpt-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const int64_t E = m.n_routed_experts, H = m.hidden_size, I = m.moe_intermediate_size,
                Is = m.shared_intermediate_size();
  const std::string p = "model.layers." + std::to_string(layer) + ".mlp.";
  std::map<std::string, StTensor> a, b;
  a[p + "gate.weight"] = st("BF16", {E, H}, w.gate.data(), w.gate.size());
  if (!w.gate_bias.empty()) a[p + "gate.e_score_correction_bias"] = st("F32", {E}, w.gate_bias.data(), E);
  auto put = [&](std::map<std::string, StTensor>& file, const std::string& name, const uint8_t* q,
                 const float* s, int64_t n, int64_t k) {
    if (fp8) {
      file[name + ".weight"] = st("F8_E4M3", {n, k}, q, n * k);
      file[name + ".weight_scale_inv"] = st("F32", {n / 128, k / 128}, s, (n / 128) * (k / 128));
      return;
    }
    std::vector<uint16_t> bf(n * k);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c)
        bf[r * k + c] = bf16_bits_exact(round_to_bf16(fp8_e4m3_to_double(q[r * k + c]) *
                                                      s[(r / 128) * (k / 128) + c / 128]));
    file[name + ".weight"] = st("BF16", {n, k}, bf.data(), bf.size());
  };
  for (int64_t e = 0; e < E; ++e) {
    auto& file = e < E / 2 ? a : b;
    const std::string x = p + "experts." + std::to_string(e) + ".";
    const int64_t s13 = (2 * I / 128) * (H / 128), s2 = (H / 128) * (I / 128);
    put(file, x + "gate_proj", &w.w13[e * 2 * I * H], &w.w13_scale[e * s13], I, H);
    put(file, x + "up_proj", &w.w13[e * 2 * I * H + I * H], &w.w13_scale[e * s13 + s13 / 2], I, H);
    put(file, x + "down_proj", &w.w2[e * H * I], &w.w2_scale[e * s2], H, I);
  }
  if (Is > 0) {
    const int64_t s13 = (2 * Is / 128) * (H / 128);
    put(b, p + "shared_experts.gate_proj", w.shared_w13.data(), w.shared_w13_scale.data(), Is, H);
    put(b, p + "shared_experts.up_proj", w.shared_w13.data() + Is * H, w.shared_w13_scale.data() + s13 / 2, Is, H);
    put(b, p + "shared_experts.down_proj", w.shared_w2.data(), w.shared_w2_scale.data(), H, Is);
  }
  write_safetensors(dir + "/model-00001-of-00002.safetensors", a);
  write_safetensors(dir + "/model-00002-of-00002.safetensors", b);
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  for (const auto& [n, t] : a) index["weight_map"][n] = "model-00001-of-00002.safetensors";
  for (const auto& [n, t] : b) index["weight_map"][n] = "model-00002-of-00002.safetensors";
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  return dir;
}

// Output of a world-2 cpu-backend layer on fixed tokens, weights from
// `load` (set_weights or load_checkpoint), rank 0's rows.
std::vector<uint16_t> layer_output(const MoEModelConfig& m,
                                   const std::function<void(moelink::MoELayer&, int rank)>& load,
                                   uint64_t seed) {
  const int64_t T = 8, H = m.hidden_size;
  char tmpl[] = "/tmp/moelink-out-XXXXXX";
  const int fd = mkstemp(tmpl);
  ::close(fd);
  const std::string path = tmpl;
  run_ranks(2, [&](int rank, moelink::Bootstrap& boot) {
    moelink::MoELayerOptions o;
    o.max_tokens = T;
    o.all_to_all.backend = Backend::kCPU;
    auto layer = moelink::MoELayer::create(m, o, boot);
    load(*layer, rank);
    std::mt19937_64 rng(seed + rank);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<uint16_t> x(T * H), out(T * H, 0);
    for (auto& v : x) v = bf16_bits_exact(round_to_bf16(nd(rng)));
    int32_t mm = static_cast<int32_t>(T);
    layer->forward(Tensor::contiguous(out.data(), DType::kBFloat16, {T, H}),
                   Tensor::contiguous(x.data(), DType::kBFloat16, {T, H}),
                   Tensor::contiguous(&mm, DType::kInt32, {1}));
    if (rank == 0) std::ofstream(path, std::ios::binary).write(reinterpret_cast<char*>(out.data()), out.size() * 2);
  }, 120);
  std::vector<uint16_t> out(T * H);
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(out.data()), out.size() * 2);
  std::remove(path.c_str());
  return out;
}

// Block scales made powers of two and each block's largest element 448:
// q * scale is then exact in bf16, and quantizing it again (amax / 448)
// gives back the same scale and codes, so a bf16 checkpoint of these
// weights must load to the very same fp8 weights.
void make_exactly_requantizable(std::vector<uint8_t>& q, std::vector<float>& s, int64_t mats,
                                int64_t n, int64_t k) {
  for (int64_t mi = 0; mi < mats; ++mi)
    for (int64_t bn = 0; bn < n / 128; ++bn)
      for (int64_t bk = 0; bk < k / 128; ++bk) {
        float& sc = s[(mi * (n / 128) + bn) * (k / 128) + bk];
        sc = std::ldexp(1.0f, static_cast<int>(std::lround(std::log2(sc))));
        q[mi * n * k + (bn * 128) * k + bk * 128] = 0x7E;  // +448
      }
}

TEST(MoELayerCheckpoint, Fp8AndBf16CheckpointsGiveTheOutputsOfSetWeights) {
  const MoEModelConfig m = deepseek_like_model();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  LayerWeights w = random_layer_weights(m, seed);
  const int64_t E = m.n_routed_experts, H = m.hidden_size, I = m.moe_intermediate_size,
                Is = m.shared_intermediate_size();
  make_exactly_requantizable(w.w13, w.w13_scale, E, 2 * I, H);
  make_exactly_requantizable(w.w2, w.w2_scale, E, H, I);
  make_exactly_requantizable(w.shared_w13, w.shared_w13_scale, 1, 2 * Is, H);
  make_exactly_requantizable(w.shared_w2, w.shared_w2_scale, 1, H, Is);
  const std::string fp8_dir = write_checkpoint(m, w, 3, true), bf16_dir = write_checkpoint(m, w, 3, false);
  const auto direct = layer_output(m, [&](moelink::MoELayer& l, int rank) {
    l.set_weights(w.view(m, rank, l.num_local_experts()));
  }, seed);
  const auto from_fp8 = layer_output(m, [&](moelink::MoELayer& l, int) { l.load_checkpoint(fp8_dir, 3); }, seed);
  const auto from_bf16 = layer_output(m, [&](moelink::MoELayer& l, int) { l.load_checkpoint(bf16_dir, 3); }, seed);
  EXPECT_EQ(direct, from_fp8) << "the fp8 checkpoint must load the very weights set_weights got";
  EXPECT_EQ(direct, from_bf16) << "the bf16 checkpoint, quantized on load, must give the same weights";
  EXPECT_TRUE(std::any_of(direct.begin(), direct.end(), [](uint16_t v) { return (v & 0x7fff) != 0; }));
}

TEST(MoELayerCheckpoint, ErrorsNameTheTensorAndTheFile) {
  const MoEModelConfig m = deepseek_like_model();
  LayerWeights w = random_layer_weights(m, 7);
  const std::string dir = write_checkpoint(m, w, 0, true);
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    moelink::MoELayerOptions o;
    o.max_tokens = 4;
    o.all_to_all.backend = Backend::kCPU;
    auto layer = moelink::MoELayer::create(m, o, boot);
    auto expect = [&](const std::function<void()>& f, const std::vector<std::string>& words) {
      try {
        f();
        RANK_FAIL() << "no error; expected one naming " << words[0];
      } catch (const moelink::InvalidArgument& e) {
        for (const auto& word : words)
          RANK_CHECK(std::string(e.what()).find(word) != std::string::npos) << e.what();
      }
    };
    // Layer 5 does not exist: the first tensor asked for is named.
    expect([&] { layer->load_checkpoint(dir, 5); },
           {"model.layers.5.mlp.gate.weight", "is in none of the files", "model-00001-of-00002.safetensors"});
    expect([&] { layer->load_checkpoint("/nonexistent/ckpt", 0); }, {"/nonexistent/ckpt"});
    // A model whose experts are larger than the checkpoint's.
    MoEModelConfig bigger = m;
    bigger.moe_intermediate_size = 256;
    auto layer2 = moelink::MoELayer::create(bigger, o, boot);
    expect([&] { layer2->load_checkpoint(dir, 0); },
           {"model.layers.0.mlp.experts.0.gate_proj.weight", "has shape [128, 256]", "expected [256, 256]",
            "model-00001-of-00002.safetensors"});
  }, 120);
  // A wrong dtype: the bias as BF16.
  std::map<std::string, StTensor> t;
  const int64_t E = m.n_routed_experts, H = m.hidden_size;
  t["model.layers.0.mlp.gate.weight"] = st("I32", {E, H / 2}, w.gate.data(), w.gate.size() / 2);
  char tmpl[] = "/tmp/moelink-ckpt-XXXXXX";
  const std::string bad_dir = mkdtemp(tmpl);
  write_safetensors(bad_dir + "/model.safetensors", t);
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    moelink::MoELayerOptions o;
    o.max_tokens = 4;
    o.all_to_all.backend = Backend::kCPU;
    auto layer = moelink::MoELayer::create(m, o, boot);
    try {
      layer->load_checkpoint(bad_dir, 0);
      RANK_FAIL() << "no error for an I32 gate of the wrong shape";
    } catch (const moelink::InvalidArgument& e) {
      RANK_CHECK(std::string(e.what()).find("model.layers.0.mlp.gate.weight") != std::string::npos &&
                 std::string(e.what()).find("model.safetensors") != std::string::npos)
          << e.what();
    }
  }, 60);
}

// ------------------------------------------------------------ arguments

TEST(MoELayerArguments, BadCallsAreNamed) {
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    const MoEModelConfig m = deepseek_like_model();
    moelink::MoELayerOptions o;
    o.max_tokens = 4;
    o.all_to_all.backend = Backend::kCPU;
    auto layer = moelink::MoELayer::create(m, o, boot);
    const int64_t H = m.hidden_size;
    std::vector<uint16_t> x(8 * H), out(8 * H);
    int32_t mm = 4;
    auto check_throws = [&](const std::function<void()>& f, const char* word) {
      try {
        f();
        RANK_FAIL() << "no InvalidArgument; expected one naming " << word;
      } catch (const moelink::InvalidArgument& e) {
        RANK_CHECK(std::string(e.what()).find(word) != std::string::npos) << e.what();
      }
    };
    const Tensor tx = Tensor::contiguous(x.data(), DType::kBFloat16, {4, H}),
                 tout = Tensor::contiguous(out.data(), DType::kBFloat16, {4, H}),
                 tm = Tensor::contiguous(&mm, DType::kInt32, {1});
    check_throws([&] { layer->forward(tout, tx, tm); }, "no weights yet");
    LayerWeights w = random_layer_weights(m, 3);
    moelink::MoEWeights v = w.view(m, 0, layer->num_local_experts());
    v.w13_scale = Tensor{};
    check_throws([&] { layer->set_weights(v); }, "w13_scale is missing");
    v = w.view(m, 0, layer->num_local_experts());
    v.gate.shape[0] = 15;
    check_throws([&] { layer->set_weights(v); }, "gate has shape [15, 256]");
    layer->set_weights(w.view(m, 0, layer->num_local_experts()));
    check_throws([&] { layer->forward(tout, Tensor::contiguous(x.data(), DType::kBFloat16, {8, H}), tm); },
                 "max_tokens");
    check_throws([&] { layer->forward(Tensor::contiguous(out.data(), DType::kBFloat16, {3, H}), tx, tm); },
                 "out has shape [3, 256]");
    check_throws([&] { layer->forward(tout, tx, tm, nullptr, 9); }, "num_tokens = 9");
    moelink::MoELayerOptions g = o;
    g.cuda_graphs = true;
    check_throws([&] { moelink::MoELayer::create(m, g, boot); }, "cuda_graphs needs a GPU backend");
    // share_with of other shapes or options: refused naming the field; the
    // layer it names still runs.
    moelink::MoELayerOptions more = o;
    more.max_tokens = 8;
    check_throws([&] { moelink::MoELayer::create(m, more, boot, layer.get()); },
                 "share_with has max_tokens = 4, this layer 8");
    MoEModelConfig wider = m;
    wider.moe_intermediate_size *= 2;
    check_throws([&] { moelink::MoELayer::create(wider, o, boot, layer.get()); }, "moe_intermediate_size");
    check_throws([&] { moelink::MoELayer::create(mixtral_like_model(), o, boot, layer.get()); },
                 "n_routed_experts");
    layer->forward(tout, tx, tm);
    layer->check();
  }, 60);
}

// The stage calls out of order, on a part another layer holds, or on a
// layer without micro-batch AllToAlls: refused naming the part and what was
// expected, and the layers stay usable; a micro-batch run in stages gives
// forward()'s bits; a layer destroyed while holding a part frees it.
TEST(MoELayerStages, CallsOutOfOrderAreRefusedAndTheLayersStayUsable) {
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    const MoEModelConfig m = deepseek_like_model();
    moelink::MoELayerOptions o;
    o.max_tokens = 8;
    o.overlap = MoEOverlap::kMicroBatch;
    o.all_to_all.backend = Backend::kCPU;
    auto a = moelink::MoELayer::create(m, o, boot);
    auto b = moelink::MoELayer::create(m, o, boot, a.get());
    LayerWeights w = random_layer_weights(m, fresh_seed());
    a->set_weights(w.view(m, 0, a->num_local_experts()));
    b->set_weights(w.view(m, 0, b->num_local_experts()));
    const int64_t H = m.hidden_size;
    std::vector<uint16_t> x(8 * H), staged(8 * H, 0x7F7F), whole(8 * H, 0x7F7F);
    std::mt19937_64 rng(fresh_seed());
    std::normal_distribution<double> nd(0.0, 1.0);
    for (auto& v : x) v = bf16_bits_exact(round_to_bf16(nd(rng)));
    int32_t mm = 3;
    auto rows = [&](std::vector<uint16_t>& v, int64_t n) {
      return Tensor::contiguous(v.data(), DType::kBFloat16, {n, H});
    };
    const Tensor tm = Tensor::contiguous(&mm, DType::kInt32, {1});
    using moelink::InvalidArgument;
    expect_throw_naming<InvalidArgument>([&] { a->stage_middle(0); }, {"micro-batch 0", "stage_begin first"});
    expect_throw_naming<InvalidArgument>([&] { a->stage_begin(2, rows(staged, 3), rows(x, 3), tm); },
                                         {"part = 2", "0 or 1"});
    expect_throw_naming<InvalidArgument>([&] { a->stage_begin(1, rows(staged, 5), rows(x, 5), tm); },
                                         {"x has 5 rows", "micro-batch 1 takes at most 4"});
    a->stage_begin(0, rows(staged, 3), rows(x, 3), tm);
    expect_throw_naming<InvalidArgument>([&] { b->stage_begin(0, rows(whole, 3), rows(x, 3), tm); },
                                         {"micro-batch 0", "another layer"});
    expect_throw_naming<InvalidArgument>([&] { a->stage_begin(0, rows(whole, 3), rows(x, 3), tm); },
                                         {"micro-batch 0", "by this layer"});
    expect_throw_naming<InvalidArgument>([&] { b->forward(rows(whole, 3), rows(x, 3), tm); },
                                         {"between stage_begin and stage_end"});
    expect_throw_naming<InvalidArgument>([&] { a->stage_end(0); }, {"expects stage_middle next"});
    expect_throw_naming<InvalidArgument>([&] { b->stage_middle(0); }, {"held by another layer"});
    a->stage_middle(0);
    a->stage_end(0);
    a->check();
    b->forward(rows(whole, 3), rows(x, 3), tm);
    b->check();
    RANK_CHECK(staged == whole) << "the micro-batch in stages differs from forward()'s output";
    const std::vector<uint16_t> want = whole;
    // A layer destroyed between its stages frees the part for the others.
    b->stage_begin(1, rows(whole, 3), rows(x, 3), tm);
    b.reset();
    std::fill(staged.begin(), staged.end(), 0x7F7F);
    a->stage_begin(1, rows(staged, 3), rows(x, 3), tm);
    a->stage_middle(1);
    a->stage_end(1);
    a->check();
    RANK_CHECK(staged == want) << "micro-batch 1 after the other layer went differs";
    // No micro-batch AllToAlls: refused naming the overlap.
    o.overlap = MoEOverlap::kNone;
    auto plain = moelink::MoELayer::create(m, o, boot);
    plain->set_weights(w.view(m, 0, plain->num_local_experts()));
    expect_throw_naming<InvalidArgument>([&] { plain->stage_begin(0, rows(staged, 3), rows(x, 3), tm); },
                                         {"no micro-batch AllToAlls", "overlap = none"});
    plain->forward(rows(staged, 3), rows(x, 3), tm);
    plain->check();
  }, 60);
}

}  // namespace
}  // namespace moelink_test
