// Model on the cpu backend (CI, and its sanitizer pass) and on the nvlink
// backend (the CUDA path; skipped without a GPU): a tiny random checkpoint
// written here, steps that must agree with each other (chunked prefill
// against one-shot, greedy against the logits), two expert-parallel ranks
// with DP attention (one rank without requests) against one rank, bad input
// reported without breaking the object, and the CUDA path against the CPU
// path. Against Hugging Face's model: tests/python/test_model.py.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "experts/expert_cases.h"  // fresh_seed
#include "moelink/errors.h"
#include "moelink/model.h"
#include "rank_harness.h"
#include "ref_dtype.h"
#include "safetensors_writer.h"
#include "staging.h"
#if defined(MOELINK_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "gpu_memory_ops.h"  // CUDA_OK
#endif

namespace moelink_test {
namespace {

using moelink::DType;
using moelink::Tensor;

constexpr int kVocab = 512, kHidden = 256, kLayers = 2;

// config.json and a bf16 checkpoint of transformers' names: one dense layer,
// one MoE layer of 16 experts (4 groups, top-4 in 2) with a shared expert;
// MLA with the real head dims and 4 heads (or `heads` and latent
// `kv_lora`: 128 and 512 are FlashInfer's MLA decode shape at DP attention).
// Weights of variance 1 / fan-in.
std::string write_tiny_model(uint64_t seed, int heads = 4, int kv_lora = 128) {
  char tmpl[] = "/tmp/moelink-model-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> norm(0.5, 1.5);
  std::map<std::string, StTensor> t;
  auto bf16 = [&](const std::string& name, std::vector<int64_t> shape, double scale, bool is_norm = false) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = bf16_bits_exact(round_to_bf16(is_norm ? norm(rng) : nd(rng) * scale));
    t[name] = st("BF16", std::move(shape), v.data(), v.size());
  };
  auto proj = [&](const std::string& name, int64_t n, int64_t k) { bf16(name, {n, k}, 1.0 / std::sqrt(k)); };
  bf16("model.embed_tokens.weight", {kVocab, kHidden}, 1.0);
  proj("lm_head.weight", kVocab, kHidden);
  bf16("model.norm.weight", {kHidden}, 0, true);
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".", a = p + "self_attn.", m = p + "mlp.";
    bf16(p + "input_layernorm.weight", {kHidden}, 0, true);
    bf16(p + "post_attention_layernorm.weight", {kHidden}, 0, true);
    proj(a + "q_a_proj.weight", 128, kHidden);
    bf16(a + "q_a_layernorm.weight", {128}, 0, true);
    proj(a + "kv_a_proj_with_mqa.weight", kv_lora + 64, kHidden);
    bf16(a + "kv_a_layernorm.weight", {kv_lora}, 0, true);
    proj(a + "q_b_proj.weight", heads * 192, 128);
    proj(a + "kv_b_proj.weight", heads * 256, kv_lora);
    proj(a + "o_proj.weight", kHidden, heads * 128);
    auto mlp = [&](const std::string& q, int64_t inter) {
      proj(q + "gate_proj.weight", inter, kHidden);
      proj(q + "up_proj.weight", inter, kHidden);
      proj(q + "down_proj.weight", kHidden, inter);
    };
    if (l == 0) {
      mlp(m, 512);
      continue;
    }
    proj(m + "gate.weight", 16, kHidden);
    std::vector<float> bias(16);
    for (auto& b : bias) b = static_cast<float>(0.05 * nd(rng));
    t[m + "gate.e_score_correction_bias"] = st("F32", {16}, bias.data(), bias.size());
    for (int e = 0; e < 16; ++e) mlp(m + "experts." + std::to_string(e) + ".", 128);
    mlp(m + "shared_experts.", 128);
  }
  write_safetensors(dir + "/model.safetensors", t);
  std::ofstream(dir + "/config.json") << R"({"model_type": "deepseek_v3", "vocab_size": 512,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 16,
    "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "norm_topk_prob": true, "routed_scaling_factor": 2.5, "num_attention_heads": )"
                                      << heads << R"(,
    "q_lora_rank": 128, "kv_lora_rank": )" << kv_lora << R"(, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6})";
  return dir;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

bool on_gpu(moelink::Backend b) { return b != moelink::Backend::kCPU; }

std::unique_ptr<moelink::Model> make_model(const std::string& dir, moelink::Bootstrap& boot,
                                           moelink::Backend backend,
                                           moelink::MLAPrefillKernel prefill = moelink::MLAPrefillKernel::kAuto,
                                           moelink::MoEOverlap overlap = moelink::MoEOverlap::kAuto,
                                           bool decode_graphs = false) {
  moelink::ModelOptions o;
  o.attention.prefill_kernel = prefill;
  o.moe.overlap = overlap;
  o.decode_graphs = decode_graphs;
  o.moe.max_tokens = 32;
  o.moe.all_to_all.backend = backend;
  o.attention.page_size = 16;
  o.attention.max_requests = 4;
  o.attention.max_pages_per_request = 4;
  o.num_pages = 16;
  auto m = moelink::Model::create(moelink::ModelConfig::from_hf_config_json(read_text(dir + "/config.json")), o, boot);
  m->load_checkpoint(dir);
  return m;
}

// One request's step; returns the logits of every row.
struct Step {
  std::vector<int32_t> ids, q_start, kv_len, table;
  int num_decode = 0;
};
// Runs the step with its tensors in the model's memory (gpu: staged into
// GPU 0's and back).
std::vector<float> run(moelink::Model& m, bool gpu, Step s, std::vector<int32_t>* next = nullptr) {
  const int64_t n = static_cast<int64_t>(s.ids.size()), B = static_cast<int64_t>(s.kv_len.size());
  const int64_t pages = B > 0 ? static_cast<int64_t>(s.table.size()) / B : 1;
  std::vector<float> logits(std::max<int64_t>(n, 1) * kVocab, NAN);
  std::vector<int32_t> out(std::max<int64_t>(B, 1), -7);
  const std::unique_ptr<MemoryOps> mem = gpu_memory_if(gpu);
  Staging st(mem.get());
  moelink::StepInput in;
  in.token_ids = Tensor::contiguous(st.put(s.ids), DType::kInt32, {n});
  in.batch.num_requests = static_cast<int>(B);
  in.batch.num_decode = s.num_decode;
  in.batch.q_start = Tensor::contiguous(st.put(s.q_start), DType::kInt32, {B + 1});
  if (B > 0) {
    in.batch.kv_len = Tensor::contiguous(st.put(s.kv_len), DType::kInt32, {B});
    in.batch.block_table = Tensor::contiguous(st.put(s.table), DType::kInt32, {B, pages});
  }
  moelink::StepOutput so;
  int32_t* dout = st.put(out);
  float* dlogits = st.put(logits);
  so.next_tokens = Tensor::contiguous(dout, DType::kInt32, {B});
  if (n > 0) so.logits = Tensor::contiguous(dlogits, DType::kFloat32, {n, kVocab});
  so.logits_every_row = true;
  m.step(in, so);
  m.check();
  st.get(out, dout);
  st.get(logits, dlogits);
  if (next) next->assign(out.begin(), out.begin() + B);
  logits.resize(n * kVocab);
  return logits;
}

// The engine's call: step_from_host on host tensors (the q_start the
// micro-batch split reads on the host), next tokens into `next`; the logits
// of every row unless `graphable` (a decode step a bucket's graph may run
// asks for none).
std::vector<float> run_from_host(moelink::Model& m, Step s, std::vector<int32_t>& next, bool graphable = false) {
  const int64_t n = static_cast<int64_t>(s.ids.size()), B = static_cast<int64_t>(s.kv_len.size());
  const int64_t pages = B > 0 ? static_cast<int64_t>(s.table.size()) / B : 1;
  std::vector<float> logits(std::max<int64_t>(n, 1) * kVocab, NAN);
  next.assign(std::max<int64_t>(B, 1), -7);
  moelink::StepInput in;
  in.token_ids = Tensor::contiguous(s.ids.data(), DType::kInt32, {n});
  in.batch.num_requests = static_cast<int>(B);
  in.batch.num_decode = s.num_decode;
  in.batch.q_start = Tensor::contiguous(s.q_start.data(), DType::kInt32, {B + 1});
  if (B > 0) {
    in.batch.kv_len = Tensor::contiguous(s.kv_len.data(), DType::kInt32, {B});
    in.batch.block_table = Tensor::contiguous(s.table.data(), DType::kInt32, {B, pages});
  }
  moelink::StepOutput so;
  so.next_tokens = Tensor::contiguous(next.data(), DType::kInt32, {B});
  if (n > 0 && !graphable) so.logits = Tensor::contiguous(logits.data(), DType::kFloat32, {n, kVocab});
  so.logits_every_row = true;
  m.step_from_host(in, so);
  m.check();
  next.resize(B);
  logits.resize(graphable ? 0 : n * kVocab);
  return logits;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e += (a[i] - b[i]) * (a[i] - b[i]);
    r += b[i] * b[i];
  }
  return std::sqrt(e / std::max(r, 1e-30));
}

std::vector<int32_t> tokens(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& v : t) v = static_cast<int32_t>(rng() % kVocab);
  return t;
}

// Each case on the cpu backend and on the nvlink backend (the CUDA path;
// ranks share GPU 0).
class ModelTest : public ::testing::TestWithParam<moelink::Backend> {
 protected:
  void SetUp() override {
    if (on_gpu(GetParam()) && probe_gpu_count() == 0)
      GTEST_SKIP() << "no GPU on this machine (or a build without CUDA): the CUDA path runs on "
                      "the H200 device machine (tools/gpu_check.sh)";
  }
  moelink::Backend backend() const { return GetParam(); }
  bool gpu() const { return on_gpu(GetParam()); }
};

// A 20-token prompt at once and in chunks of 8 and 12 on one prefill
// kernel; every row's logits. moelink's kernel keeps the softmax in fp32
// across chunks, so the logits agree to fp32 sums (bound 2e-3).
// FlashInfer's rounds each call's probabilities and output to bf16, which
// the chunk split changes (about 1 % in the attention, MLAAttentionTest);
// downstream, fp8 requantization and the tiny router's near-ties amplify
// that as they do CUDA against CPU (ModelCuda.MatchesTheCpuPath's criterion:
// median row below 10 %, at most a quarter of the rows above 25 %; one
// such check on an H100 gave 13 % overall).
void check_chunked_model_prefill(moelink::Backend backend, moelink::MLAPrefillKernel kernel, bool exact) {
  const std::string dir = write_tiny_model(fresh_seed());
  const bool gpu = on_gpu(backend);
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    auto m = make_model(dir, boot, backend, kernel);
    const std::vector<int32_t> ids = tokens(20, 1);
    const std::vector<float> whole = run(*m, gpu, {ids, {0, 20}, {20}, {0, 1}});
    std::vector<int32_t> first(ids.begin(), ids.begin() + 8), rest(ids.begin() + 8, ids.end());
    std::vector<float> parts = run(*m, gpu, {first, {0, 8}, {8}, {2, 3}});
    std::vector<int32_t> next;
    const std::vector<float> tail = run(*m, gpu, {rest, {0, 12}, {20}, {2, 3}}, &next);
    parts.insert(parts.end(), tail.begin(), tail.end());
    for (float v : parts) RANK_CHECK(std::isfinite(v)) << "a non-finite logit";
    if (exact) {
      RANK_CHECK(rel_l2(parts, whole) < 2e-3) << "chunked against one-shot: " << rel_l2(parts, whole);
    } else {
      std::vector<double> rows;
      for (int64_t r = 0; r < 20; ++r)
        rows.push_back(rel_l2(std::vector<float>(parts.begin() + r * kVocab, parts.begin() + (r + 1) * kVocab),
                              std::vector<float>(whole.begin() + r * kVocab, whole.begin() + (r + 1) * kVocab)));
      std::vector<double> sorted = rows;
      std::sort(sorted.begin(), sorted.end());
      const auto far = std::count_if(rows.begin(), rows.end(), [](double e) { return e > 0.25; });
      RANK_CHECK(sorted[10] < 0.10 && far <= 5)
          << "chunked against one-shot: median row " << sorted[10] << ", " << far << " rows above 25 %";
      std::printf("[ measured ] FlashInfer prefill, chunked against one-shot logits: relative L2 %.2e, "
                  "median row %.2e, %lld rows above 25 %%\n",
                  rel_l2(parts, whole), sorted[10], static_cast<long long>(far));
    }
    const float* last = &tail[(12 - 1) * kVocab];
    RANK_CHECK(next.size() == 1 && next[0] == std::max_element(last, last + kVocab) - last)
        << "greedy token " << next[0] << " is not the last row's argmax";
    // A decode step after it, on the same pages.
    const std::vector<float> d = run(*m, gpu, {{next[0]}, {0, 1}, {21}, {2, 3}, 1});
    for (float v : d) RANK_CHECK(std::isfinite(v));
  }, 120);
}

TEST_P(ModelTest, ChunkedPrefillEqualsOneShotAndGreedyIsTheArgmax) {
  using moelink::MLAPrefillKernel;
  if (!gpu()) return check_chunked_model_prefill(backend(), MLAPrefillKernel::kAuto, true);
  {
    SCOPED_TRACE("prefill_kernel = moelink");
    check_chunked_model_prefill(backend(), MLAPrefillKernel::kMoelink, true);
  }
  SCOPED_TRACE("prefill_kernel = auto (FlashInfer's where the build has it)");
  check_chunked_model_prefill(backend(), MLAPrefillKernel::kAuto, false);
}

TEST_P(ModelTest, TwoExpertParallelRanksWithDpAttentionAgreeWithOne) {
  const std::string dir = write_tiny_model(fresh_seed());
  const std::vector<int32_t> a = tokens(11, 2), b = tokens(5, 3);
  std::vector<float> one_a, one_b;
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    auto m = make_model(dir, boot, backend());
    std::vector<int32_t> both = a;
    both.insert(both.end(), b.begin(), b.end());
    const std::vector<float> l = run(*m, gpu(), {both, {0, 11, 16}, {11, 5}, {0, 1}});
    // Kept for the comparison in the parent: a file, as ranks are processes.
    std::ofstream(dir + "/one.bin", std::ios::binary).write(reinterpret_cast<const char*>(l.data()),
                                                          static_cast<std::streamsize>(l.size() * 4));
  }, 120);
  run_ranks(2, [&](int rank, moelink::Bootstrap& boot) {
    auto m = make_model(dir, boot, backend());
    std::vector<float> one(16 * kVocab);
    std::ifstream(dir + "/one.bin", std::ios::binary).read(reinterpret_cast<char*>(one.data()),
                                                          static_cast<std::streamsize>(one.size() * 4));
    // Rank 0 runs a, rank 1 runs b; then rank 0 decodes while rank 1 has
    // no request at all (it still takes part in the MoE layers).
    const std::vector<float> mine = rank == 0 ? run(*m, gpu(), {a, {0, 11}, {11}, {0}}) : run(*m, gpu(), {b, {0, 5}, {5}, {0}});
    const std::vector<float> want(one.begin() + (rank == 0 ? 0 : 11 * kVocab),
                                  one.begin() + (rank == 0 ? 11 : 16) * kVocab);
    // One rounding more in the combine (each rank's share in bf16), then
    // fp8 requantization downstream: a few percent (docs/model.md).
    RANK_CHECK(rel_l2(mine, want) < 0.08) << "rank " << rank << ": " << rel_l2(mine, want);
    if (rank == 0)
      run(*m, gpu(), {{a[0]}, {0, 1}, {12}, {0}, 1});
    else
      run(*m, gpu(), {{}, {0}, {}, {}});
  }, 120);
}

TEST_P(ModelTest, BadInputIsReportedAndTheModelStaysUsable) {
  const std::string dir = write_tiny_model(fresh_seed());
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    auto m = make_model(dir, boot, backend());
    std::vector<int32_t> ids = tokens(4, 4);
    ids[2] = kVocab + 5;
    expect_throw_naming<moelink::InputError>([&] { run(*m, gpu(), {ids, {0, 4}, {4}, {0}}); },
                                             {"token_ids[2] = 517", "vocab_size"});
    expect_throw_naming<moelink::InputError>([&] { run(*m, gpu(), {tokens(4, 5), {0, 4}, {4}, {99}}); },
                                             {"block_table[0][0] = 99"});
    // q_start past the tokens given: the whole step is skipped, nothing is
    // read or written past them (the sanitizer pass runs this too).
    expect_throw_naming<moelink::InputError>([&] { run(*m, gpu(), {tokens(4, 7), {0, 9}, {9}, {1}}); },
                                             {"q_start[1] = 9"});
    std::vector<int32_t> out(3);
    std::vector<int32_t> good = tokens(4, 6), q_start{0, 4}, kv_len{4}, table{1};
    moelink::StepInput in;
    in.token_ids = Tensor::contiguous(good.data(), DType::kInt32, {4});
    in.batch.num_requests = 1;
    in.batch.q_start = Tensor::contiguous(q_start.data(), DType::kInt32, {2});
    in.batch.kv_len = Tensor::contiguous(kv_len.data(), DType::kInt32, {1});
    in.batch.block_table = Tensor::contiguous(table.data(), DType::kInt32, {1, 1});
    moelink::StepOutput so;
    so.next_tokens = Tensor::contiguous(out.data(), DType::kInt32, {3});
    expect_throw_naming<moelink::InvalidArgument>([&] { m->step(in, so); }, {"next_tokens", "[1]"});
    const std::vector<float> l = run(*m, gpu(), {good, {0, 4}, {4}, {1}});
    for (float v : l) RANK_CHECK(std::isfinite(v));
  }, 120);
}

// step_from_host (the engine's call: host tensors whatever the backend)
// gives step()'s bits; the same step run twice writes the same cache rows.
TEST_P(ModelTest, StepFromHostEqualsStep) {
  const std::string dir = write_tiny_model(fresh_seed());
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    auto m = make_model(dir, boot, backend());
    Step s{tokens(10, 11), {0, 10}, {10}, {3}};
    std::vector<int32_t> next;
    const std::vector<float> want = run(*m, gpu(), s, &next);
    std::vector<float> logits(10 * kVocab, NAN);
    std::vector<int32_t> out(1, -7);
    moelink::StepInput in;
    in.token_ids = Tensor::contiguous(s.ids.data(), DType::kInt32, {10});
    in.batch.num_requests = 1;
    in.batch.q_start = Tensor::contiguous(s.q_start.data(), DType::kInt32, {2});
    in.batch.kv_len = Tensor::contiguous(s.kv_len.data(), DType::kInt32, {1});
    in.batch.block_table = Tensor::contiguous(s.table.data(), DType::kInt32, {1, 1});
    moelink::StepOutput so;
    so.next_tokens = Tensor::contiguous(out.data(), DType::kInt32, {1});
    so.logits = Tensor::contiguous(logits.data(), DType::kFloat32, {10, kVocab});
    so.logits_every_row = true;
    m->step_from_host(in, so);
    m->check();
    RANK_CHECK(logits == want) << "step_from_host's logits differ from step()'s";
    RANK_CHECK(out[0] == next[0]) << "next token " << out[0] << " against " << next[0];
    if (gpu()) {  // host tensors are copied as they lie: strided ones are refused
      std::vector<int32_t> every_other(20, 1);
      in.token_ids = Tensor::contiguous(every_other.data(), DType::kInt32, {10});
      in.token_ids.stride[0] = 2;
      expect_throw_naming<moelink::InvalidArgument>([&] { m->step_from_host(in, so); },
                                                    {"token_ids", "contiguous"});
      // and the model stays usable: the same step again gives the same logits.
      in.token_ids = Tensor::contiguous(s.ids.data(), DType::kInt32, {10});
      std::fill(logits.begin(), logits.end(), std::nanf(""));
      m->step_from_host(in, so);
      m->check();
      RANK_CHECK(logits == want) << "step_from_host after a refused call differs";
    }
  }, 120);
}

// The MoE layers' overlap modes on two expert-parallel ranks: dispatch-overlap
// reorders sends, receives and the shared expert; micro-batch splits each
// rank's requests into two micro-batches interleaved across attention and
// MoE (Model::two_batch_steps counts the steps that did). Rank 0 prefills
// 13 rows then decodes one request; rank 1 prefills three requests (6, 9
// and 1 rows) then decodes two of them with q_len 1 and 2 (a draft). On the
// CPU the sums per token keep their order: mode none's logits to fp32
// rounding. On the GPU a micro-batch's attention is another FlashInfer
// schedule for fewer requests (its split-KV partial sums in another order,
// a bf16 ulp here and there, amplified by the fp8 projections after it):
// the same bound as two ranks against one, and the greedy tokens where the
// logits leave a margin.
TEST_P(ModelTest, EveryOverlapModeGivesModeNonesTokens) {
  const std::string dir = write_tiny_model(fresh_seed());
  const std::vector<int32_t> a = tokens(13, 21), b = tokens(6, 22), c = tokens(9, 23), d = tokens(1, 24);
  auto cat = [](std::vector<int32_t> x, const std::vector<int32_t>& y) {
    x.insert(x.end(), y.begin(), y.end());
    return x;
  };
  const std::vector<std::vector<Step>> steps = {
      {{a, {0, 13}, {13}, {0}}, {{a[0]}, {0, 1}, {14}, {0}, 1}},
      {{cat(cat(b, c), d), {0, 6, 15, 16}, {6, 9, 1}, {1, 2, 3}},
       {{b[0], c[0], c[1]}, {0, 1, 3}, {7, 11}, {1, 2}, 2}}};
  const moelink::MoEOverlap modes[] = {moelink::MoEOverlap::kNone, moelink::MoEOverlap::kDispatchOverlap,
                                       moelink::MoEOverlap::kMicroBatch};
  for (moelink::MoEOverlap mode : modes) {
    run_ranks(2, [&](int rank, moelink::Bootstrap& boot) {
      auto m = make_model(dir, boot, backend(), moelink::MLAPrefillKernel::kAuto, mode);
      for (size_t k = 0; k < steps[rank].size(); ++k) {
        std::vector<int32_t> next;
        const std::vector<float> l = run_from_host(*m, steps[rank][k], next);
        const std::string file = dir + "/r" + std::to_string(rank) + "s" + std::to_string(k);
        if (mode == moelink::MoEOverlap::kNone) {  // the reference, for the modes after it
          std::ofstream f(file, std::ios::binary);
          f.write(reinterpret_cast<const char*>(l.data()), static_cast<std::streamsize>(l.size() * 4));
          f.write(reinterpret_cast<const char*>(next.data()), static_cast<std::streamsize>(next.size() * 4));
          continue;
        }
        std::vector<float> want(l.size());
        std::vector<int32_t> want_next(next.size());
        std::ifstream f(file, std::ios::binary);
        f.read(reinterpret_cast<char*>(want.data()), static_cast<std::streamsize>(want.size() * 4));
        f.read(reinterpret_cast<char*>(want_next.data()), static_cast<std::streamsize>(want_next.size() * 4));
        const double rel = rel_l2(l, want);
        const std::string where = std::string(moelink::moe_overlap_name(mode)) + ", rank " + std::to_string(rank) +
                                  ", step " + std::to_string(k);
        if (!gpu()) {
          RANK_CHECK(rel < 1e-6) << where << ": logits relative L2 " << rel;
          RANK_CHECK(next == want_next) << where << ": next tokens differ";
          continue;
        }
        std::printf("%s: logits relative L2 %.3e\n", where.c_str(), rel);
        RANK_CHECK(rel < 0.08) << where << ": logits relative L2 " << rel;
        // Each request's last row decides its token: equal where the
        // reference's top two logits are apart.
        const std::vector<int32_t>& q = steps[rank][k].q_start;
        for (size_t i = 0; i + 1 < q.size(); ++i) {
          const float* row = want.data() + static_cast<size_t>(q[i + 1] - 1) * kVocab;
          std::vector<float> top(row, row + kVocab);
          std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
          double rms = 0;
          for (float v : top) rms += double(v) * v;
          rms = std::sqrt(rms / kVocab);
          if (top[0] - top[1] > 0.3 * rms) {
            RANK_CHECK(next[i] == want_next[i]) << where << ": request " << i;
          }
        }
      }
      const int64_t want_two = mode == moelink::MoEOverlap::kMicroBatch ? 2 : 0;
      RANK_CHECK(m->two_batch_steps() == want_two)
          << moelink::moe_overlap_name(mode) << ", rank " << rank << ": two_batch_steps " << m->two_batch_steps();
    }, 180);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ModelTest, ::testing::Values(moelink::Backend::kCPU, moelink::Backend::kNVLink),
                         [](const auto& info) { return on_gpu(info.param) ? "Cuda" : "Cpu"; });

// The CUDA path against the CPU path on the same checkpoint and steps: the
// same arithmetic but for the order of fp32 sums, which moves a bf16 value
// an ulp now and then and, through the fp8 quantizations after it, an
// element of a projection's input by 1/16 (docs/model.md); greedy tokens
// are each path's own argmax.
TEST(ModelCuda, MatchesTheCpuPath) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const std::string dir = write_tiny_model(fresh_seed());
  const std::vector<int32_t> a = tokens(13, 8), b = tokens(6, 9);
  std::vector<int32_t> both = a;
  both.insert(both.end(), b.begin(), b.end());
  for (moelink::Backend backend : {moelink::Backend::kCPU, moelink::Backend::kNVLink}) {
    run_ranks(1, [&](int, moelink::Bootstrap& boot) {
      auto m = make_model(dir, boot, backend);
      const bool gpu = on_gpu(backend);
      std::vector<int32_t> next;
      std::vector<float> l = run(*m, gpu, {both, {0, 13, 19}, {13, 6}, {0, 1}}, &next);
      const std::vector<float> d = run(*m, gpu, {{next[0], next[1]}, {0, 1, 2}, {14, 7}, {0, 1}, 2});
      l.insert(l.end(), d.begin(), d.end());
      const std::string file = dir + (gpu ? "/cuda.bin" : "/cpu.bin");
      std::ofstream(file, std::ios::binary).write(reinterpret_cast<const char*>(l.data()),
                                                  static_cast<std::streamsize>(l.size() * 4));
    }, 120);
  }
  std::vector<float> cpu(21 * kVocab), cuda(21 * kVocab);
  std::ifstream(dir + "/cpu.bin", std::ios::binary).read(reinterpret_cast<char*>(cpu.data()), cpu.size() * 4);
  std::ifstream(dir + "/cuda.bin", std::ios::binary).read(reinterpret_cast<char*>(cuda.data()), cuda.size() * 4);
  // Each path is about 8 % from HF's model in fp32 (test_model.py: fp8
  // inputs to every projection, four or five a layer), and the two paths'
  // fp8 roundings part ways after the first reordered sum, so a typical row
  // differs by about as much (median row 5.4-6.0 % over four seeds on an
  // H200). This tiny model's router (biases 0.05 apart) has near-ties: a
  // token that goes to another expert on one path moves by tens of percent
  // (3-4 of the 21 rows above 25 %, which put the overall error at 10-31 %).
  // So: median row below 10 %, at most 6 rows above 25 %; a wrong layer or
  // kernel moves every row.
  std::vector<double> rows;
  for (int64_t r = 0; r < 21; ++r) {
    const std::vector<float> a(cuda.begin() + r * kVocab, cuda.begin() + (r + 1) * kVocab),
        b(cpu.begin() + r * kVocab, cpu.begin() + (r + 1) * kVocab);
    rows.push_back(rel_l2(a, b));
  }
  std::vector<double> sorted = rows;
  std::sort(sorted.begin(), sorted.end());
  const int64_t far = std::count_if(rows.begin(), rows.end(), [](double e) { return e > 0.25; });
  EXPECT_LT(sorted[10], 0.10) << "median row's relative L2, CUDA logits against CPU logits";
  EXPECT_LE(far, 6) << "rows more than 25 % off";
  std::printf("[ measured ] Model CUDA against CPU: logits relative L2 %.2e, median row %.2e, %lld rows "
              "above 25 %%\n", rel_l2(cuda, cpu), sorted[10], static_cast<long long>(far));
}


#if defined(MOELINK_WITH_CUDA)
// One decode step captured in a CUDA graph (fixed buffers: 3 requests, up
// to 2 rows each, drafts) and replayed with new tokens, lengths, pages and
// drafts gives what the same steps give eagerly on a second model: the
// model's step reads every count on the device.
TEST(ModelCuda, ADecodeStepReplayedInACudaGraphEqualsEagerSteps) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const std::string dir = write_tiny_model(fresh_seed());
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    auto eager = make_model(dir, boot, moelink::Backend::kNVLink);
    auto graphed = make_model(dir, boot, moelink::Backend::kNVLink);
    // Three prompts (their prefill eager on both; each within max_tokens =
    // 32 rows), pages 0-3, 4-7, 8-11.
    const std::vector<std::vector<int32_t>> prompts{tokens(20, 1), tokens(31, 2), tokens(7, 3)};
    for (int i = 0; i < 3; ++i)
      for (auto* m : {eager.get(), graphed.get()})
        run(*m, true, {prompts[i], {0, static_cast<int32_t>(prompts[i].size())},
                       {static_cast<int32_t>(prompts[i].size())}, {4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3}});
    GpuMemoryOps mem(0);
    const int B = 3, maxn = 6;
    std::vector<int32_t> ids(maxn), q_start(B + 1), kv_len(B), table(B * 4), drafts(B), next(B), acc(B);
    std::vector<float> logits(B * kVocab);
    Staging st(&mem);
    int32_t *d_ids = st.put(ids), *d_q = st.put(q_start), *d_kv = st.put(kv_len), *d_tab = st.put(table),
            *d_dr = st.put(drafts), *d_next = st.put(next), *d_acc = st.put(acc);
    float* d_logits = st.put(logits);
    moelink::StepInput in;
    in.token_ids = Tensor::contiguous(d_ids, DType::kInt32, {maxn});
    in.batch.num_requests = in.batch.num_decode = B;
    in.batch.q_start = Tensor::contiguous(d_q, DType::kInt32, {B + 1});
    in.batch.kv_len = Tensor::contiguous(d_kv, DType::kInt32, {B});
    in.batch.block_table = Tensor::contiguous(d_tab, DType::kInt32, {B, 4});
    in.num_drafts = Tensor::contiguous(d_dr, DType::kInt32, {B});
    moelink::StepOutput out;
    out.next_tokens = Tensor::contiguous(d_next, DType::kInt32, {B});
    out.accepted = Tensor::contiguous(d_acc, DType::kInt32, {B});
    out.logits = Tensor::contiguous(d_logits, DType::kFloat32, {B, kVocab});
    cudaStream_t s = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<int32_t> len{20, 31, 7};
    cudaGraphExec_t exec = nullptr;
    std::mt19937_64 rng(fresh_seed());
    for (int step = 0; step < 4; ++step) {
      // Each request one or two rows (a draft), a new token each.
      std::vector<int32_t> rows(B), step_ids;
      q_start = {0};
      for (int i = 0; i < B; ++i) {
        rows[i] = 1 + static_cast<int32_t>((step + i) % 2);
        drafts[i] = rows[i] - 1;
        for (int r = 0; r < rows[i]; ++r) step_ids.push_back(static_cast<int32_t>(rng() % kVocab));
        q_start.push_back(q_start.back() + rows[i]);
        kv_len[i] = len[i] + rows[i];
        for (int p = 0; p < 4; ++p) table[i * 4 + p] = 4 * i + p;
      }
      std::copy(step_ids.begin(), step_ids.end(), ids.begin());
      // Eager, on its own buffers of the step's true size.
      std::vector<int32_t> want_next, eager_drafts = drafts;
      std::vector<float> want_logits(B * kVocab);
      {
        Staging e(&mem);
        moelink::StepInput ein = in;
        moelink::StepOutput eout = out;
        std::vector<int32_t> nx(B), ac(B);
        ein.token_ids = Tensor::contiguous(e.put(step_ids), DType::kInt32, {q_start[B]});
        ein.batch.q_start = Tensor::contiguous(e.put(q_start), DType::kInt32, {B + 1});
        ein.batch.kv_len = Tensor::contiguous(e.put(kv_len), DType::kInt32, {B});
        ein.batch.block_table = Tensor::contiguous(e.put(table), DType::kInt32, {B, 4});
        ein.num_drafts = Tensor::contiguous(e.put(eager_drafts), DType::kInt32, {B});
        int32_t *enx = e.put(nx), *eac = e.put(ac);
        float* elg = e.put(want_logits);
        eout.next_tokens = Tensor::contiguous(enx, DType::kInt32, {B});
        eout.accepted = Tensor::contiguous(eac, DType::kInt32, {B});
        eout.logits = Tensor::contiguous(elg, DType::kFloat32, {B, kVocab});
        eager->step(ein, eout);
        eager->check();
        e.get(nx, enx);
        e.get(want_logits, elg);
        want_next = nx;
      }
      // The graph, captured at the first step: the prefills above took every
      // workspace past what a decode step needs, so nothing is allocated
      // while capturing.
      for (auto [host, dev] : {std::pair{&ids, d_ids}, {&q_start, d_q}, {&kv_len, d_kv}, {&table, d_tab},
                               {&drafts, d_dr}})
        CUDA_OK(cudaMemcpy(dev, host->data(), host->size() * 4, cudaMemcpyHostToDevice));
      if (exec == nullptr) {
        cudaGraph_t g = nullptr;
        CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        graphed->step(in, out, s);
        CUDA_OK(cudaStreamEndCapture(s, &g));
        CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
        CUDA_OK(cudaGraphDestroy(g));
      }
      CUDA_OK(cudaGraphLaunch(exec, s));
      CUDA_OK(cudaStreamSynchronize(s));
      graphed->check(s);
      st.get(next, d_next);
      st.get(logits, d_logits);
      RANK_CHECK(next == want_next) << "step " << step;
      RANK_CHECK(rel_l2(logits, want_logits) < 1e-6) << "step " << step << ": " << rel_l2(logits, want_logits);
      for (int i = 0; i < B; ++i) len[i] += 1;  // the accepted draft or not: the first row's KV stays
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaStreamDestroy(s));
  }, 180);
}

// ModelOptions.decode_graphs: step_from_host's decode-only steps through a
// bucket's graph (eager first, captured second, replayed after) give the
// tokens of the same steps without graphs, as the batch size, the
// lengths and the drafts change; a prefill between them runs eagerly.
// overlap: the graphed model's MoE mode (the plain one runs none): with
// micro-batch, buckets 2 and 4 run their MoE layers as two micro-batches
// inside the graph (each its own FlashInfer plan), bucket 1 as one.
void check_decode_graphs(int heads, int kv_lora, int max_tokens = 32,
                         moelink::MoEOverlap overlap = moelink::MoEOverlap::kAuto) {
  const std::string dir = write_tiny_model(fresh_seed(), heads, kv_lora);
  run_ranks(1, [&](int, moelink::Bootstrap& boot) {
    moelink::ModelOptions o;
    o.moe.max_tokens = max_tokens;
    o.moe.all_to_all.backend = moelink::Backend::kNVLink;
    o.attention.page_size = 16;
    o.attention.max_requests = 4;
    o.attention.max_pages_per_request = 4;
    o.num_pages = 16;
    const moelink::ModelConfig cfg = moelink::ModelConfig::from_hf_config_json(read_text(dir + "/config.json"));
    o.moe.overlap = overlap == moelink::MoEOverlap::kMicroBatch ? moelink::MoEOverlap::kNone : overlap;
    auto plain = moelink::Model::create(cfg, o, boot);
    o.decode_graphs = true;
    o.moe.overlap = overlap;
    auto graphed = moelink::Model::create(cfg, o, boot);
    plain->load_checkpoint(dir);
    graphed->load_checkpoint(dir);
    // Runs one step on both (host tensors); returns both next tokens.
    auto both = [&](std::vector<int32_t> ids, std::vector<int32_t> q_start, std::vector<int32_t> kv_len,
                    std::vector<int32_t> table, int num_decode, std::vector<int32_t> drafts) {
      const int B = static_cast<int>(kv_len.size());
      std::vector<std::vector<int32_t>> next(2, std::vector<int32_t>(B, -7)), acc(2, std::vector<int32_t>(B, -7));
      for (int k = 0; k < 2; ++k) {
        moelink::StepInput in;
        in.token_ids = Tensor::contiguous(ids.data(), DType::kInt32, {static_cast<int64_t>(ids.size())});
        in.batch.num_requests = B;
        in.batch.num_decode = num_decode;
        in.batch.q_start = Tensor::contiguous(q_start.data(), DType::kInt32, {B + 1});
        in.batch.kv_len = Tensor::contiguous(kv_len.data(), DType::kInt32, {B});
        in.batch.block_table = Tensor::contiguous(table.data(), DType::kInt32, {B, 4});
        if (!drafts.empty()) in.num_drafts = Tensor::contiguous(drafts.data(), DType::kInt32, {B});
        moelink::StepOutput out;
        out.next_tokens = Tensor::contiguous(next[k].data(), DType::kInt32, {B});
        out.accepted = Tensor::contiguous(acc[k].data(), DType::kInt32, {B});
        moelink::Model& m = k == 0 ? *plain : *graphed;
        m.step_from_host(in, out);
        m.check();
      }
      RANK_CHECK(next[0] == next[1]) << "next tokens, graphs against none";
      RANK_CHECK(acc[0] == acc[1]) << "accepted drafts, graphs against none";
      return next[0];
    };
    // A prompt into pages first_page .. + 3 (eager on both), in chunks of
    // at most max_tokens rows; the token after it.
    auto prefill = [&](const std::vector<int32_t>& prompt, int first_page) {
      const std::vector<int32_t> table{first_page, first_page + 1, first_page + 2, first_page + 3};
      int32_t next = -1;
      for (int c = 0; c < static_cast<int>(prompt.size()); c += max_tokens) {
        const int n = std::min<int>(max_tokens, static_cast<int>(prompt.size()) - c);
        next = both({prompt.begin() + c, prompt.begin() + c + n}, {0, n}, {c + n}, table, 0, {})[0];
      }
      return next;
    };
    // Prefill three requests, pages 0-3, 4-7, 8-11.
    std::vector<int32_t> len{9, 17, 4}, last(3);
    for (int i = 0; i < 3; ++i) last[i] = prefill(tokens(len[i], 10 + i), 4 * i);
    // Decode steps: three requests (bucket 4: eager, captured, replayed),
    // two (bucket 2), one, three again; drafts on some of the first five
    // where max_tokens holds two rows a request (else q_len 1 everywhere),
    // so buckets 4 and 2 then run one-row steps on graphs of their own
    // (bucket 2's captured and replayed last). Before the fourth,
    // a fourth request's prefill (eager): the replays after it must not run
    // on its attention plan.
    std::mt19937_64 rng(fresh_seed());
    const std::vector<std::vector<int>> batches{{0, 1, 2}, {0, 1, 2}, {0, 1, 2}, {2, 0}, {1}, {0, 1, 2}, {1, 2}, {2, 1}};
    int64_t two_before = 0, replays_before = 0;  // before the last step (a replay of bucket 2)
    for (size_t step = 0; step < batches.size(); ++step) {
      if (step == 3) prefill(tokens(5, 13), 12);
      if (step + 1 == batches.size()) {
        two_before = graphed->two_batch_steps();
        replays_before = graphed->decode_graph_stats().replays;
      }
      const std::vector<int>& reqs = batches[step];
      std::vector<int32_t> ids, q_start{0}, kv_len, table, drafts;
      for (int i : reqs) {
        const bool draft = (step + i) % 2 == 1 && step < 5 && max_tokens >= 2 * o.attention.max_requests;
        ids.push_back(last[i]);
        if (draft) ids.push_back(static_cast<int32_t>(rng() % kVocab));
        q_start.push_back(static_cast<int32_t>(ids.size()));
        kv_len.push_back(len[i] + 1 + (draft ? 1 : 0));
        for (int p = 0; p < 4; ++p) table.push_back(4 * i + p);
        drafts.push_back(draft ? 1 : 0);
      }
      const std::vector<int32_t> next = both(ids, q_start, kv_len, table, static_cast<int>(reqs.size()), drafts);
      for (size_t j = 0; j < reqs.size(); ++j) {
        last[reqs[j]] = next[j];
        len[reqs[j]] += 1;  // the draft (random) is almost never accepted; both models agree either way
      }
    }
    // Each (bucket, rows a request) graph ran its first step eagerly; two
    // were captured (bucket 4 with drafts, or one row a request, and bucket
    // 2's one-row graph); every decode step is one or the other (prefills
    // are not).
    const moelink::DecodeGraphStats gs = graphed->decode_graph_stats(), ps = plain->decode_graph_stats();
    RANK_CHECK(gs.captures == 2) << gs.captures;
    RANK_CHECK(gs.replays + gs.eager_steps == static_cast<int64_t>(batches.size()))
        << gs.replays << " + " << gs.eager_steps;
    RANK_CHECK(gs.eager_steps >= 3 && gs.replays >= 1) << gs.replays << " replays, " << gs.eager_steps << " eager";
    RANK_CHECK(ps.replays == 0 && ps.eager_steps == 0 && ps.captures == 0);
    // Every graphed step's host clock went to its host part or its wait.
    RANK_CHECK(gs.host_seconds > 0.0 && gs.wait_seconds > 0.0) << gs.host_seconds << " s, " << gs.wait_seconds << " s";
    RANK_CHECK(ps.host_seconds == 0.0 && ps.wait_seconds == 0.0);
    if (overlap == moelink::MoEOverlap::kMicroBatch) {  // the last step: a replay, in two micro-batches
      RANK_CHECK(gs.replays == replays_before + 1) << gs.replays << " replays, " << replays_before << " before";
      RANK_CHECK(graphed->two_batch_steps() == two_before + 1)
          << graphed->two_batch_steps() << " steps in two micro-batches, " << two_before << " before";
    }
  }, 180);
}

TEST(ModelCuda, DecodeGraphsGiveTheTokensOfEagerSteps) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  check_decode_graphs(4, 128);  // moelink's decode kernel
}

// 128 heads and latent 512: FlashInfer's MLA decode (in a build with its
// headers), re-planned before each replay; MTP's two query rows make two
// of its 128-row tiles per request.
TEST(ModelCuda, FlashInferDecodeGraphsGiveTheTokensOfEagerSteps) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  check_decode_graphs(128, 512);
}

// The MoE layers as two micro-batches across attention and MoE inside the
// decode graphs: the tokens of eager steps in mode none, on moelink's decode
// kernel and on FlashInfer's (a plan for the whole batch and one for each
// micro-batch, replanned before every replay).
TEST(ModelCuda, MicroBatchDecodeGraphsGiveTheTokensOfEagerSteps) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  check_decode_graphs(4, 128, 32, moelink::MoEOverlap::kMicroBatch);
}

TEST(ModelCuda, FlashInferMicroBatchDecodeGraphsGiveTheTokensOfEagerSteps) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  check_decode_graphs(128, 512, 32, moelink::MoEOverlap::kMicroBatch);
}

// max_tokens = max_requests (no drafts: one row a request): a bucket's
// graph holds no more rows than the model takes (it had two a request,
// refused as more than max_tokens: model_bench --q-lens 1 met it).
TEST(ModelCuda, DecodeGraphsWithOneRowPerRequestOfMaxTokens) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  check_decode_graphs(128, 512, 4);
}
#endif

}  // namespace
}  // namespace moelink_test
