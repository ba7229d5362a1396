#include "layer/layer_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "all_to_all_cases.h"  // MemoryOps
#include "experts/expert_cases.h"  // fresh_seed
#include "layer/layer_reference.h"
#include "rank_harness.h"
#include "ref_dtype.h"
#if defined(MOELINK_WITH_CUDA)
#include "gpu_cases.h"  // device_of
#include "gpu_memory_ops.h"
#endif

namespace moelink_test {

using moelink::Backend;
using moelink::DType;
using moelink::MoEModelConfig;
using moelink::MoEOverlap;
using moelink::Tensor;

MoEModelConfig deepseek_like_model() {
  MoEModelConfig m;
  m.name = "DeepSeekLike";
  m.hidden_size = 256;
  m.moe_intermediate_size = 128;
  m.n_routed_experts = 16;
  m.n_shared_experts = 1;
  m.num_experts_per_tok = 4;
  m.n_group = 4;
  m.topk_group = 2;
  m.scoring = moelink::ScoringFunction::kSigmoid;
  m.score_correction_bias = true;
  m.norm_topk_prob = true;
  m.routed_scaling_factor = 2.5f;
  return m;
}

MoEModelConfig mixtral_like_model() {
  MoEModelConfig m;
  m.name = "MixtralLike";
  m.hidden_size = 256;
  m.moe_intermediate_size = 256;
  m.n_routed_experts = 8;
  m.num_experts_per_tok = 2;
  m.scoring = moelink::ScoringFunction::kSoftmax;
  m.norm_topk_prob = true;
  m.checkpoint_naming = "mixtral";
  return m;
}

MoEModelConfig qwen_like_model() {
  MoEModelConfig m;
  m.name = "QwenLike";
  m.hidden_size = 256;
  m.moe_intermediate_size = 128;
  m.n_routed_experts = 16;
  m.num_experts_per_tok = 4;
  m.scoring = moelink::ScoringFunction::kSoftmax;
  m.norm_topk_prob = true;
  return m;
}

std::vector<LayerCase> layer_cases(Backend backend) {
  std::vector<LayerCase> cases;
  const std::pair<MoEOverlap, const char*> modes[] = {{MoEOverlap::kNone, "None"},
                                                      {MoEOverlap::kDispatchOverlap, "DispatchOverlap"},
                                                      {MoEOverlap::kMicroBatch, "MicroBatch"},
                                                      {MoEOverlap::kAuto, "Auto"}};
  for (const MoEModelConfig& m : {deepseek_like_model(), mixtral_like_model(), qwen_like_model()})
    for (int world : {1, 2, 4})
      for (const auto& [mode, mode_name] : modes) {
        LayerCase c;
        c.name = m.name + "_W" + std::to_string(world) + "_" + mode_name;
        c.model = m;
        c.backend = backend;
        c.world = world;
        c.overlap = mode;
        cases.push_back(c);
      }
  // Every token routed to expert 0: each micro-batch's receive must count
  // only its own routes (it once added the second's to the first's).
  for (int world : {1, 2}) {
    LayerCase hot;
    hot.name = "DeepSeekLike_W" + std::to_string(world) + "_MicroBatch_OneHotExpert";
    hot.model = deepseek_like_model();
    hot.backend = backend;
    hot.world = world;
    hot.overlap = MoEOverlap::kMicroBatch;
    hot.one_hot_expert = true;
    cases.push_back(hot);
  }
  // Batches of 0-3 tokens in every mode, each call after a refused one and
  // a flagged one: the layer (and its AllToAlls) must stay usable and
  // check() must report each call's errors once.
  for (int world : {1, 2})
    for (const auto& [mode, mode_name] : modes) {
      LayerCase c;
      c.name = "DeepSeekLike_W" + std::to_string(world) + "_" + mode_name + "_FewRowsAfterBadCalls";
      c.model = deepseek_like_model();
      c.backend = backend;
      c.world = world;
      c.overlap = mode;
      c.max_tokens = 8;
      c.ms = {1, 0, 2, 3, 1};
      c.bad_calls = true;
      cases.push_back(c);
    }
  LayerCase dp;
  dp.name = "DeepSeekLike_W4_Dp2_MicroBatch";
  dp.model = deepseek_like_model();
  dp.backend = backend;
  dp.world = 4;
  dp.dp_size = 2;
  dp.overlap = MoEOverlap::kMicroBatch;
  cases.push_back(dp);
  // The layer in stages (two micro-batches interleaved by the caller): 1
  // and 2 ranks, empty, one-token and odd micro-batches; and two layers on
  // one scratch, each in stages.
  for (int world : {1, 2})
    for (bool shared : {false, true}) {
      LayerCase c;
      c.name = "DeepSeekLike_W" + std::to_string(world) + "_Stages" + (shared ? "_SharedScratch" : "");
      c.model = deepseek_like_model();
      c.backend = backend;
      c.world = world;
      c.overlap = MoEOverlap::kMicroBatch;
      c.max_tokens = 9;
      c.ms = {9, 0, 1, 2, 5, 6};
      c.shared_scratch = shared;
      c.stages = true;
      cases.push_back(c);
    }
  {
    LayerCase c;  // the stages on another model, at more tokens than micro_batch_min_tokens
    c.name = "MixtralLike_W2_Stages";
    c.model = mixtral_like_model();
    c.backend = backend;
    c.overlap = MoEOverlap::kMicroBatch;
    c.max_tokens = 40;
    c.stages = true;
    c.rounds = 3;
    cases.push_back(c);
  }
  // Two layers on one scratch (a model's MoE layers), every mode, 2 ranks.
  for (const auto& [mode, mode_name] : modes) {
    LayerCase c;
    c.name = "DeepSeekLike_W2_" + std::string(mode_name) + "_SharedScratch";
    c.model = deepseek_like_model();
    c.backend = backend;
    c.overlap = mode;
    c.shared_scratch = true;
    c.rounds = 3;
    cases.push_back(c);
  }
  return cases;
}

namespace {

std::unique_ptr<MemoryOps> memory_for(Backend b, int rank) {
  if (moelink::backend_uses_host_memory(b)) return make_host_memory_ops();
#if defined(MOELINK_WITH_CUDA)
  return std::make_unique<GpuMemoryOps>(device_of(rank));
#else
  (void)rank;
  throw std::runtime_error("a GPU backend in a build without CUDA");
#endif
}

// Rows checked per round and how they compared.
struct RowStats {
  double err2 = 0, ref2 = 0, worst_row = 0;
  int rows = 0, near_ties = 0;
};

}  // namespace

void run_layer_case(const LayerCase& c) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  run_ranks(
      c.world,
      [&](int rank, moelink::Bootstrap& boot) {
        const MoEModelConfig& m = c.model;
        std::unique_ptr<MemoryOps> ops = memory_for(c.backend, rank);
        moelink::MoELayerOptions o;
        o.max_tokens = c.max_tokens;
        o.overlap = c.overlap;
        o.cuda_graphs = c.cuda_graphs;
        o.all_to_all.backend = c.backend;
        o.dp_size = c.dp_size;
        auto layer = moelink::MoELayer::create(m, o, boot);
        LayerWeights w = random_layer_weights(m, seed);
        if (c.one_hot_expert) w.gate_bias.at(0) += 10.0f;
        moelink::MoEWeights view = w.view(m, rank, layer->num_local_experts());
        std::vector<float> gate_f32(w.gate.size());
        if (c.fp32_gate) {
          for (size_t i = 0; i < w.gate.size(); ++i) gate_f32[i] = static_cast<float>(bf16_to_double(w.gate[i]));
          view.gate = Tensor::contiguous(gate_f32.data(), DType::kFloat32, {m.n_routed_experts, m.hidden_size});
        }
        layer->set_weights(view);
        // A second layer on the first's scratch (AllToAlls, expert kernels,
        // workspaces) with weights of its own, called after it each round.
        std::unique_ptr<moelink::MoELayer> second;
        LayerWeights w2;
        if (c.shared_scratch) {
          second = moelink::MoELayer::create(m, o, boot, layer.get());
          w2 = random_layer_weights(m, seed ^ 0x5BD1E995u);
          second->set_weights(w2.view(m, rank, second->num_local_experts()));
        }
        const int64_t T = c.max_tokens, H = m.hidden_size;
        void* dx = ops->alloc(T * H * 2);
        void* dout = ops->alloc(T * H * 2);
        void* dm = ops->alloc(4);
        void* dm1 = ops->alloc(4);  // stages: micro-batch 1's m
        RowStats st;
        const int group = rank / c.dp_size;  // the ranks of a DP group hold the same tokens
        const int rounds = c.ms.empty() ? c.rounds : static_cast<int>(c.ms.size());
        for (int round = 0; round < rounds; ++round) {
          std::mt19937_64 rng(seed ^ (0x9E3779B97F4A7C15ull * (group + 1)) ^ (round + 1));
          std::normal_distribution<double> nd(0.0, 1.0);
          int32_t mm = round == 0 ? static_cast<int32_t>(T) - group % 3
                                  : std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(T))(rng);
          if (!c.ms.empty()) mm = c.ms[(round + group) % c.ms.size()];
          const int64_t rows = c.ms.empty() ? T : std::max<int32_t>(mm, 1);
          std::vector<uint16_t> x(T * H);
          for (auto& v : x) v = bf16_bits_exact(round_to_bf16(nd(rng)));
          ops->h2d(dx, x.data(), x.size() * 2);
          const Tensor tx = Tensor::contiguous(dx, DType::kBFloat16, {rows, H}),
                       tout = Tensor::contiguous(dout, DType::kBFloat16, {rows, H}),
                       tm = Tensor::contiguous(dm, DType::kInt32, {1});
          const int64_t num_tokens = c.num_tokens_is_m ? mm : T;
          if (c.bad_calls) {
            const std::string when = "round " + std::to_string(round);
            // Refused on the host before anything runs (on every rank alike).
            expect_throw_naming<moelink::InvalidArgument>(
                [&] {
                  layer->forward(Tensor::contiguous(dout, DType::kFloat16, {rows, H}), tx, tm,
                                 ops->stream(), num_tokens);
                },
                {"out"}, when + ", fp16 out");
            // Runs clamped; its own check() reports it, and no later one does.
            const int32_t past = static_cast<int32_t>(rows) + 3;
            ops->h2d(dm, &past, 4);
            layer->forward(tout, tx, tm, ops->stream(), num_tokens);
            expect_throw_naming<moelink::InputError>([&] { layer->check(ops->stream()); },
                                                     {"bound_m = " + std::to_string(past)},
                                                     when + ", bound_m past x's rows");
          }
          ops->h2d(dm, &mm, 4);
          for (int which = 0; which < (second ? 2 : 1); ++which) {
          moelink::MoELayer& lay = which == 0 ? *layer : *second;
          const LayerWeights& lw = which == 0 ? w : w2;
          ops->fill(dout, 0x7F, T * H * 2);
          if (c.stages) {
            // Part 0: rows [0, m0), part 1: rows [m0, m); an empty part
            // gets a one-row view that nothing may write (rows >= m stay
            // poisoned: checked below).
            const int64_t half = (T + 1) / 2;
            const int32_t m0 = static_cast<int32_t>(std::min<int64_t>(mm, half)), m1 = mm - m0;
            ops->h2d(dm, &m0, 4);
            ops->h2d(dm1, &m1, 4);
            auto view = [&](void* base, int64_t row0, int64_t n) {
              return Tensor::contiguous(static_cast<char*>(base) + row0 * H * 2, DType::kBFloat16, {n, H});
            };
            const int64_t r0 = std::max<int64_t>(m0, 1), r1 = std::max<int64_t>(m1, 1);
            const Tensor x0 = view(dx, 0, r0), o0 = view(dout, 0, r0), x1 = view(dx, m0, r1),
                         o1 = view(dout, m0, r1);
            const Tensor b0 = Tensor::contiguous(dm, DType::kInt32, {1}),
                         b1 = Tensor::contiguous(dm1, DType::kInt32, {1});
            cudaStream_t s = ops->stream();
            if (round % 2 == 0) {  // the seed's order: both sends, then each half's middle and end
              lay.stage_begin(0, o0, x0, b0, s);
              lay.stage_begin(1, o1, x1, b1, s);
              lay.stage_middle(0, s);
              lay.stage_middle(1, s);
              lay.stage_end(0, s);
              lay.stage_end(1, s);
            } else {  // part 1 first and whole, part 0 around it
              lay.stage_begin(1, o1, x1, b1, s);
              lay.stage_begin(0, o0, x0, b0, s);
              lay.stage_middle(1, s);
              lay.stage_end(1, s);
              lay.stage_middle(0, s);
              lay.stage_end(0, s);
            }
          } else {
            lay.forward(tout, tx, tm, ops->stream(), num_tokens);
          }
          lay.check(ops->stream());
          std::vector<uint16_t> out(T * H);
          ops->d2h(out.data(), dout, out.size() * 2);
          for (int64_t t = 0; t < T; ++t) {
            const uint16_t* row = &out[t * H];
            if (t >= mm) {
              RANK_CHECK(std::all_of(row, row + H, [](uint16_t v) { return v == 0x7F7F; }))
                  << "layer " << which << ", round " << round << " row " << t << " >= m = " << mm
                  << " was written";
              continue;
            }
            const RefRoute r = ref_route(m, lw, &x[t * H]);
            if (r.margin < 1e-4) {  // the kernels' fp32 may choose the other expert
              ++st.near_ties;
              continue;
            }
            const std::vector<double> ref = ref_layer_row(m, lw, &x[t * H], r);
            double e2 = 0, r2 = 0;
            for (int64_t h = 0; h < H; ++h) {
              const double d = bf16_to_double(row[h]) - ref[h];
              e2 += d * d;
              r2 += ref[h] * ref[h];
            }
            st.err2 += e2;
            st.ref2 += r2;
            st.worst_row = std::max(st.worst_row, std::sqrt(e2 / std::max(r2, 1e-30)));
            ++st.rows;
          }
          }
        }
        // The layer's fp8 data flow, reproduced by the reference, leaves bf16
        // roundings (expert outputs, the combine's per-rank partial sums) and,
        // rarely, an intermediate element requantized one fp8 step the other
        // way: about 0.5 % relative L2 over many rows, up to several percent
        // on one row. A wrong expert or weight is off by tens of percent.
        RANK_CHECK(st.rows > 0 || c.rounds == 0) << "no row was compared";
        if (st.ref2 > 0)
          RANK_CHECK(std::sqrt(st.err2 / st.ref2) < 3e-2)
              << "relative L2 error " << std::sqrt(st.err2 / st.ref2) << " over " << st.rows << " rows";
        RANK_CHECK(st.worst_row < 0.2) << "worst row's relative L2 error " << st.worst_row;
        RANK_CHECK(st.near_ties <= st.rows / 4 + 2) << st.near_ties << " near-tie tokens of " << st.rows;
        ops->free(dx);
        ops->free(dout);
        ops->free(dm);
        ops->free(dm1);
      },
      300);
}

}  // namespace moelink_test
