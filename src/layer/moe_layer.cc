// MoELayer: the stages of a MoE layer on one stream, in the order of the
// chosen overlap mode (seed article 002):
//
//   quantize x (1x128 fp8) -> router (gate GEMM, fused top-k)
//   none:             shared expert -> dispatch -> experts -> combine (+= shared)
//   dispatch-overlap: dispatch send -> shared expert -> dispatch recv -> experts -> combine
//   micro-batch:      rows split in two halves a and b, each with its own AllToAll:
//                     send(a) send(b) shared recv(a) experts(a) csend(a) recv(b)
//                     experts(b) csend(b) crecv(a) crecv(b)
//
// The shared expert writes its output into `out` first; combine adds the
// routed experts' sum to it (accumulate). Everything reads m on the device.
#include "moelink/moe_layer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/arg_checks.h"
#include "core/error_collector.h"
#include "core/float_convert.h"
#include "core/tensor_views.h"
#include "layer/block_quant.h"
#include "layer/checkpoint.h"
#include "layer/layer_device.h"
#include "moelink/errors.h"
#include "moelink/experts.h"

namespace moelink {
namespace detail {

using layer::LayerDevice;

namespace {

constexpr int64_t kMaxTokens = 65536;

using Buffer = OwnedBuffer;

// [L, C', cols] view of an [L, C, cols] buffer (C' <= C rows per expert).
Tensor first_rows_per_expert(Tensor t, int64_t rows) {
  t.shape[1] = rows;
  return t;
}

}  // namespace

// What a forward() needs besides the layer's weights: the AllToAlls, the
// expert kernels with their workspaces, the activations between the stages.
// Nothing in it lives from one forward() to the next, so layers that run
// one after another on one stream (a model's) share one (about 0.3 GB a
// DeepSeek-V3 layer at an EP8 rank's 256 tokens, 58 times over).
struct MoELayerScratch {
  static constexpr int64_t kSmallSharedRows = 32;
  std::unique_ptr<LayerDevice> dev;  // allocates the buffers below (so it goes last)
  std::unique_ptr<AllToAll> a2a, mb[2];
  // The shared expert; shared_small for calls of at most kSmallSharedRows
  // rows when max_tokens is larger (GPU backends).
  std::unique_ptr<Experts> experts, shared, shared_small;
  OwnedBuffer xq, xs, logits, indices, weights, counts, ex_x, ex_xs, ex_y, bounds, x_f32, x_static, out_static;
  // The layer (MoELayerImpl) holding each micro-batch's stages between
  // stage_begin and stage_end, null when free; its next stage (1 middle, 2 end).
  const void* stage_owner[2] = {nullptr, nullptr};
  int stage_next[2] = {0, 0};
};

class MoELayerImpl {
 public:
  MoELayerImpl(const MoEModelConfig& model, const MoELayerOptions& options, Bootstrap& boot,
               const MoELayerImpl* share_with)
      : model_(model), options_(options), router_(layer::router_params(model)) {
    model_.validate();
    if (options_.max_tokens < 1 || options_.max_tokens > kMaxTokens)
      throw InvalidArgument("moelink: MoELayerOptions.max_tokens = " +
                            std::to_string(options_.max_tokens) + " must be in [1, 65536]");
    if (options_.micro_batch_min_tokens < 2)
      throw InvalidArgument("moelink: MoELayerOptions.micro_batch_min_tokens = " +
                            std::to_string(options_.micro_batch_min_tokens) + " must be >= 2");
    if (options_.overlap == MoEOverlap::kMicroBatch && options_.max_tokens < 2)
      throw InvalidArgument("moelink: MoELayerOptions.overlap = micro-batch needs max_tokens >= 2, "
                            "got " + std::to_string(options_.max_tokens));
    const bool host = backend_uses_host_memory(options_.all_to_all.backend);
    if (options_.cuda_graphs && host)
      throw InvalidArgument(std::string("moelink: MoELayerOptions.cuda_graphs needs a GPU backend, "
                                        "got ") + backend_name(options_.all_to_all.backend));
    dev_ = host ? layer::make_cpu_layer_device() : layer::make_cuda_layer_device();
    rank_ = boot.rank();
    world_ = boot.world_size();
    if (model_.n_routed_experts % world_ != 0)
      throw InvalidArgument("moelink: MoELayer: n_routed_experts = " +
                            std::to_string(model_.n_routed_experts) +
                            " must be divisible by the world size " + std::to_string(world_));
    L_ = model_.n_routed_experts / world_;
    const int64_t T = options_.max_tokens, H = model_.hidden_size, E = model_.n_routed_experts,
                  k = model_.num_experts_per_tok;

    // The AllToAlls: one of T tokens unless the layer only ever micro-batches,
    // two of ceil(T / 2) when it may. `auto` micro-batches only where the
    // exchange may cross nodes (moe_auto_micro_batches).
    const bool full = options_.overlap != MoEOverlap::kMicroBatch;
    const bool micro = T >= 2 && (options_.overlap == MoEOverlap::kMicroBatch ||
                                  (options_.overlap == MoEOverlap::kAuto &&
                                   moe_auto_micro_batches(options_.all_to_all.backend, world_) &&
                                   T >= options_.micro_batch_min_tokens));
    half_ = (T + 1) / 2;
    allocate_weights();
    error_ = Buffer(*dev_, sizeof(layer::LayerErrorRecord));
    if (share_with != nullptr) {
      check_shareable(*share_with);
      s_ = share_with->s_;
      G_ = share_with->G_;
      C_ = share_with->C_;
      return;
    }
    s_ = std::make_shared<MoELayerScratch>();
    s_->dev = host ? layer::make_cpu_layer_device() : layer::make_cuda_layer_device();
    auto make_a2a = [&](int64_t tokens) {
      Config c;
      c.max_num_tokens = tokens;
      c.num_experts = model_.n_routed_experts;
      c.experts_per_token = model_.num_experts_per_tok;
      c.hidden_dim = H;
      c.hidden_dim_scale = static_cast<int>(H / 128);
      c.in_dtype = DType::kFloat8E4M3;
      c.out_dtype = DType::kBFloat16;
      c.rank = rank_;
      c.world_size = world_;
      c.dp_size = options_.dp_size;
      return AllToAll::create(c, boot, options_.all_to_all);
    };
    if (full) s_->a2a = make_a2a(T);
    if (micro) {
      s_->mb[0] = make_a2a(half_);
      s_->mb[1] = make_a2a(half_);
    }
    const AllToAll& any = full ? *s_->a2a : *s_->mb[0];
    G_ = any.config().num_dp_groups();
    // Rows per expert: a micro-batch's receive takes rows [part * half G,
    // (part + 1) * half G) and counts of its own, so the second one neither
    // adds to the first's counts (overflowing a capacity of half G) nor
    // computes the first's rows again.
    C_ = std::max(full ? T * G_ : 0, micro ? 2 * half_ * G_ : 0);

    ExpertConfig ec;
    ec.num_experts = L_;
    ec.max_rows = C_;
    ec.hidden_dim = static_cast<int>(H);
    ec.intermediate_dim = model_.moe_intermediate_size;
    ec.device = host ? ExpertDevice::kCPU : ExpertDevice::kCUDA;
    // Rows an expert gets on average at max_tokens: the GEMMs it makes
    // (each call names its own: experts()).
    ec.expected_rows = std::min<int64_t>(C_, expected_expert_rows(T));
    s_->experts = Experts::create(ec);
    if (model_.n_shared_experts > 0) {
      ExpertConfig sc = ec;
      sc.num_experts = 1;
      sc.max_rows = T;
      sc.intermediate_dim = model_.shared_intermediate_size();
      sc.expected_rows = T;
      s_->shared = Experts::create(sc);
      if (T > kSmallSharedRows && !host) {
        // Decode-sized calls get their own: weight-major tiles split over K
        // (docs/experts.md), where T's tiles would leave most SMs idle.
        sc.max_rows = sc.expected_rows = kSmallSharedRows;
        s_->shared_small = Experts::create(sc);
      }
    }

    // Workspaces.
    LayerDevice& sd = *s_->dev;
    s_->xq = Buffer(sd, T * H);
    s_->xs = Buffer(sd, T * (H / 128) * 4);
    s_->logits = Buffer(sd, T * E * 4);
    s_->indices = Buffer(sd, T * k * 4);
    s_->weights = Buffer(sd, T * k * 4);
    s_->counts = Buffer(sd, 2 * L_ * 4);  // one set per micro-batch
    s_->ex_x = Buffer(sd, L_ * C_ * H);
    s_->ex_xs = Buffer(sd, L_ * C_ * (H / 128) * 4);
    s_->ex_y = Buffer(sd, L_ * C_ * H * 2);
    s_->bounds = Buffer(sd, 4 * 4);  // m of the two micro-batches, the staged m
    if (options_.cuda_graphs) {
      s_->x_static = Buffer(sd, T * H * 2);
      s_->out_static = Buffer(sd, T * H * 2);
    }
  }

  // The weights' memory (the gate as fp32 at most).
  void allocate_weights() {
    LayerDevice& d = *dev_;
    const int64_t E = model_.n_routed_experts, H = model_.hidden_size, I = model_.moe_intermediate_size,
                  Is = model_.shared_intermediate_size();
    gate_ = Buffer(d, E * H * 4);
    bias_ = Buffer(d, E * 4);
    w13_ = Buffer(d, L_ * 2 * I * H);
    w13s_ = Buffer(d, L_ * (2 * I / 128) * (H / 128) * 4);
    w2_ = Buffer(d, L_ * H * I);
    w2s_ = Buffer(d, L_ * (H / 128) * (I / 128) * 4);
    if (Is > 0) {
      sw13_ = Buffer(d, 2 * Is * H);
      sw13s_ = Buffer(d, (2 * Is / 128) * (H / 128) * 4);
      sw2_ = Buffer(d, H * Is);
      sw2s_ = Buffer(d, (H / 128) * (Is / 128) * 4);
    }
  }

  // share_with's scratch fits this layer: the same shapes, tokens, modes
  // and ranks (what sized its AllToAlls, expert kernels and buffers).
  void check_shareable(const MoELayerImpl& o) const {
    auto same = [](const char* field, int64_t mine, int64_t theirs) {
      require_same_as_shared("MoELayer.create", field, mine, theirs);
    };
    same("hidden_size", model_.hidden_size, o.model_.hidden_size);
    same("n_routed_experts", model_.n_routed_experts, o.model_.n_routed_experts);
    same("num_experts_per_tok", model_.num_experts_per_tok, o.model_.num_experts_per_tok);
    same("moe_intermediate_size", model_.moe_intermediate_size, o.model_.moe_intermediate_size);
    same("n_shared_experts", model_.n_shared_experts, o.model_.n_shared_experts);
    same("max_tokens", options_.max_tokens, o.options_.max_tokens);
    same("overlap", static_cast<int>(options_.overlap), static_cast<int>(o.options_.overlap));
    same("micro_batch_min_tokens", options_.micro_batch_min_tokens, o.options_.micro_batch_min_tokens);
    same("cuda_graphs", options_.cuda_graphs, o.options_.cuda_graphs);
    same("dp_size", options_.dp_size, o.options_.dp_size);
    same("all_to_all.backend", static_cast<int>(options_.all_to_all.backend),
         static_cast<int>(o.options_.all_to_all.backend));
    same("rank", rank_, o.rank_);
    same("world size", world_, o.world_);
  }

  // ------------------------------------------------------------ weights

  void set_weights(const MoEWeights& w) {
    const char* call = "MoELayer.set_weights";
    const int64_t E = model_.n_routed_experts, H = model_.hidden_size, I = model_.moe_intermediate_size,
                  Is = model_.shared_intermediate_size();
    check_tensor(call, "gate", w.gate, {DType::kBFloat16, DType::kFloat32}, {H}, false);
    if (w.gate.shape[0] != E) bad(call, "gate", "has shape " + shape_str(w.gate) + ", expected [" + std::to_string(E) + ", " + std::to_string(H) + "]");
    require_packed(call, "gate", w.gate);
    gate_dtype_ = w.gate.dtype;
    dev_->copy_in(gate_.get(), w.gate.data, E * H * dtype_size(w.gate.dtype));
    // An fp32 gate multiplies an fp32 copy of x: its buffer exists from
    // here, so that no forward() (a CUDA-graph capture above all) allocates.
    if (gate_dtype_ == DType::kFloat32 && !s_->x_f32.get())
      s_->x_f32 = Buffer(*s_->dev, options_.max_tokens * H * 4);
    if (model_.score_correction_bias) {
      check_tensor(call, "gate_bias", w.gate_bias, {DType::kFloat32}, {}, false);
      if (w.gate_bias.shape[0] != E) bad(call, "gate_bias", "has shape " + shape_str(w.gate_bias) + ", expected [" + std::to_string(E) + "] (e_score_correction_bias)");
      require_packed(call, "gate_bias", w.gate_bias);
      dev_->copy_in(bias_.get(), w.gate_bias.data, E * 4);
    } else if (w.gate_bias.defined()) {
      bad(call, "gate_bias", "is given, but " + model_.name + " has no e_score_correction_bias");
    }
    copy_projection(call, "w13", "w13_scale", w.w13, w.w13_scale, {L_, 2 * I, H}, w13_, w13s_);
    copy_projection(call, "w2", "w2_scale", w.w2, w.w2_scale, {L_, H, I}, w2_, w2s_);
    if (Is > 0) {
      copy_projection(call, "shared_w13", "shared_w13_scale", w.shared_w13, w.shared_w13_scale,
                      {2 * Is, H}, sw13_, sw13s_);
      copy_projection(call, "shared_w2", "shared_w2_scale", w.shared_w2, w.shared_w2_scale, {H, Is},
                      sw2_, sw2s_);
    } else if (w.shared_w13.defined() || w.shared_w2.defined()) {
      bad(call, "shared_w13", "is given, but " + model_.name + " has no shared experts");
    }
    has_weights_ = true;
  }

  void load_checkpoint(const std::string& dir, int layer_index) {
    if (layer_index < 0)
      throw InvalidArgument("moelink: MoELayer.load_checkpoint: layer_index = " +
                            std::to_string(layer_index) + " must be >= 0");
    const layer::SafetensorsDir files(dir);
    layer::HostLayerWeights w = layer::read_layer_weights(files, model_, layer_index, rank_, L_);
    set_weights(w.view(model_, L_));
  }

  // ------------------------------------------------------------ calls

  // A layer destroyed between a micro-batch's stage_begin and stage_end
  // frees the part for the layers it shares its scratch with.
  ~MoELayerImpl() {
    for (int part = 0; part < 2; ++part)
      if (s_ && s_->stage_owner[part] == this) {
        release(part);
        s_->mb[part]->reset_call_order();
      }
  }

  MoEOverlap overlap_for(int64_t tokens) const {
    if (options_.overlap != MoEOverlap::kAuto) return options_.overlap;
    return s_->mb[0] && tokens >= options_.micro_batch_min_tokens ? MoEOverlap::kMicroBatch
                                                               : MoEOverlap::kDispatchOverlap;
  }

  void forward(const Tensor& out, const Tensor& x, const Tensor& bound_m, cudaStream_t stream,
               int64_t num_tokens) {
    const char* call = "MoELayer.forward";
    const int64_t rows = check_io(call, out, x, bound_m);
    if (s_->stage_owner[0] != nullptr || s_->stage_owner[1] != nullptr)
      throw InvalidArgument("moelink: MoELayer.forward: micro-batch " +
                            std::to_string(s_->stage_owner[0] != nullptr ? 0 : 1) +
                            " of a layer on this scratch is between stage_begin and stage_end");
    if (num_tokens < 0 || num_tokens > options_.max_tokens)
      throw InvalidArgument("moelink: MoELayer.forward: num_tokens = " + std::to_string(num_tokens) +
                            " must be in [0, " + std::to_string(options_.max_tokens) +
                            "] (max_tokens; 0 = unknown)");
    // The mode from num_tokens itself (the same on every rank when the
    // caller passes one value, whatever each rank's rows); the graph bucket
    // from what x holds.
    const int64_t tokens = num_tokens > 0 ? std::min(num_tokens, rows) : rows;
    const MoEOverlap mode = overlap_for(num_tokens > 0 ? num_tokens : rows);
    if (!options_.cuda_graphs) {
      run(out, x, bound_m, tokens, mode, stream, profile());
      return;
    }
    // A captured graph per (bucket, mode) on the staging buffers: x's first
    // m rows in, the layer, out's first m rows back.
    int64_t bucket = 1;
    while (bucket < tokens) bucket *= 2;
    bucket = std::min(bucket, options_.max_tokens);
    const int64_t H = model_.hidden_size;
    const Tensor xs = Tensor::contiguous(s_->x_static.get(), DType::kBFloat16, {bucket, H});
    const Tensor os = Tensor::contiguous(s_->out_static.get(), DType::kBFloat16, {bucket, H});
    int32_t* staged_m = s_->bounds.as<int32_t>() + 2;
    const Tensor sm = Tensor::contiguous(staged_m, DType::kInt32, {1});
    // The graph runs on `bucket` rows, which may be more than x has: the
    // staging copy checks bound_m against x's own rows (eager calls have
    // the kernels that read it do so) and hands the graph m clamped.
    dev_->copy_rows(s_->x_static.get(), H * 2, x.data, x.stride[0] * 2, H * 2,
                    static_cast<const int32_t*>(bound_m.data), std::min(rows, bucket), staged_m,
                    error_record(), stream);
    auto key = std::make_pair(bucket, static_cast<int>(mode));
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      std::shared_ptr<LayerDevice::Graph> graph;
      try {
        graph = dev_->capture([&](cudaStream_t s) { run(os, xs, sm, bucket, mode, s, false); });
      } catch (...) {
        // Nothing captured ever ran: the AllToAlls go back to expecting a
        // dispatch, so the next call starts fresh.
        for (AllToAll* a : {s_->a2a.get(), s_->mb[0].get(), s_->mb[1].get()})
          if (a != nullptr) a->reset_call_order();
        throw;
      }
      it = graphs_.emplace(key, std::move(graph)).first;
    }
    dev_->replay(*it->second, stream);
    dev_->copy_rows(out.data, out.stride[0] * 2, s_->out_static.get(), H * 2, H * 2,
                    static_cast<const int32_t*>(bound_m.data), std::min(rows, bucket), nullptr,
                    nullptr, stream);
  }

  // ------------------------------------------------------------ stages

  void stage_begin(int part, const Tensor& out, const Tensor& x, const Tensor& bound_m, cudaStream_t stream) {
    const char* call = "MoELayer.stage_begin";
    check_part(call, part);
    if (s_->stage_owner[part] != nullptr)
      throw InvalidArgument(std::string("moelink: ") + call + ": micro-batch " + std::to_string(part) +
                            " is held " + (s_->stage_owner[part] == this ? "by this layer" : "by another layer "
                            "on this scratch") + " (its stage_end has not run)");
    const int64_t rows = check_io(call, out, x, bound_m);
    const int64_t cap = part == 0 ? half_ : options_.max_tokens - half_;
    if (rows > cap)
      bad(call, "x", "has " + std::to_string(rows) + " rows; micro-batch " + std::to_string(part) +
                         " takes at most " + std::to_string(cap) + " (of max_tokens " +
                         std::to_string(options_.max_tokens) + ")");
    require_weights(call);
    const int64_t T = options_.max_tokens, H = model_.hidden_size, k = model_.num_experts_per_tok;
    const int64_t row0 = part * half_;
    // The part's rows of the layer's quantized tokens, indices and weights.
    const Tensor xq = Tensor::contiguous(s_->xq.get(), DType::kFloat8E4M3, {T, H});
    const Tensor xs = Tensor::contiguous(s_->xs.get(), DType::kFloat32, {T, H / 128});
    const Tensor xv = rows_of(x, 0, rows);
    const Batch b{s_->mb[part].get(), row0, rows, bound_m, part};
    hold(part, b, rows_of(out, 0, rows), 1);
    stage_guard(part, [&] {
      s_->experts->quantize(rows_of(xq, row0, rows), rows_of(xs, row0, rows), xv, bound_m, stream);
      route_into(xv, bound_m, rows, s_->indices.as<int32_t>() + row0 * k, s_->weights.as<float>() + row0 * k,
                 stream);
      dispatch(b, xq, xs, true, false, stream);
      if (s_->shared != nullptr)
        run_shared(stage_out_[part], rows_of(xq, row0, rows), rows_of(xs, row0, rows), bound_m, stream);
    });
  }

  void stage_middle(int part, cudaStream_t stream) {
    expect_stage("MoELayer.stage_middle", part, 1);
    const int64_t T = options_.max_tokens, H = model_.hidden_size;
    const Tensor xq = Tensor::contiguous(s_->xq.get(), DType::kFloat8E4M3, {T, H});
    const Tensor xs = Tensor::contiguous(s_->xs.get(), DType::kFloat32, {T, H / 128});
    const Batch& b = stage_batch_[part];
    stage_guard(part, [&] {
      dispatch(b, xq, xs, false, true, stream);
      experts<void (*)(Stage)>(b, stream, nullptr);
      combine(b, stage_out_[part], true, false, s_->shared != nullptr, stream);
    });
    s_->stage_next[part] = 2;
  }

  void stage_end(int part, cudaStream_t stream) {
    expect_stage("MoELayer.stage_end", part, 2);
    stage_guard(part, [&] {
      combine(stage_batch_[part], stage_out_[part], false, true, s_->shared != nullptr, stream);
    });
    release(part);
  }

  void route(const Tensor& indices, const Tensor& weights, const Tensor& x, const Tensor& bound_m,
             cudaStream_t stream) {
    const char* call = "MoELayer.route";
    const int64_t k = model_.num_experts_per_tok;
    const int64_t rows = check_tensor(call, "x", x, {DType::kBFloat16}, {model_.hidden_size}, true);
    check_rows_limit(call, "x", rows);
    check_bound(call, bound_m);
    check_tensor(call, "indices", indices, {DType::kInt32}, {k}, false);
    check_tensor(call, "weights", weights, {DType::kFloat32}, {k}, false);
    if (indices.shape[0] != rows || weights.shape[0] != rows)
      bad(call, indices.shape[0] != rows ? "indices" : "weights",
          "must have the rows x has (" + std::to_string(rows) + ")");
    require_packed(call, "indices", indices);
    require_packed(call, "weights", weights);
    require_weights(call);
    route_into(x, bound_m, rows, static_cast<int32_t*>(indices.data), static_cast<float*>(weights.data),
               stream);
  }

  // Drains every part (each clears what it reports), so that no error
  // outlives the check() after the call that caused it: the first is
  // thrown as its own type, the others named in its message.
  void check(cudaStream_t stream) {
    ErrorCollector errors;
    errors.take([&] { check_own(stream); });
    if (s_->a2a) errors.take([&] { s_->a2a->check(); });
    for (auto& m : s_->mb)
      if (m) errors.take([&] { m->check(); });
    errors.take([&] { s_->experts->check(stream); });
    if (s_->shared) errors.take([&] { s_->shared->check(stream); });
    if (s_->shared_small) errors.take([&] { s_->shared_small->check(stream); });
    errors.raise();
  }

  MoEStageTimes stage_times() {
    MoEStageTimes t;
    if (!timed_) return t;
    auto d = [&](Stage a, Stage b) { return dev_->between(static_cast<int>(a), static_cast<int>(b)); };
    t.total_us = d(kStart, kDone);
    if (timed_mode_ == MoEOverlap::kMicroBatch) return t;  // the stages interleave: total only
    t.quantize_us = d(kStart, kQuantized);
    t.router_us = d(kQuantized, kRouted);
    if (timed_mode_ == MoEOverlap::kNone) {
      t.shared_expert_us = d(kRouted, kShared);
      t.dispatch_send_us = d(kShared, kDispatchSent);
      t.dispatch_recv_us = d(kDispatchSent, kDispatchReceived);
    } else {
      t.dispatch_send_us = d(kRouted, kDispatchSent);
      t.shared_expert_us = d(kDispatchSent, kShared);
      t.dispatch_recv_us = d(kShared, kDispatchReceived);
    }
    t.gemm1_us = d(kDispatchReceived, kGemm1);
    t.silu_mul_us = d(kGemm1, kSiluMul);
    t.gemm2_us = d(kSiluMul, kGemm2);
    t.combine_send_us = d(kGemm2, kCombineSent);
    t.combine_recv_us = d(kCombineSent, kDone);
    return t;
  }

  const MoEModelConfig& model() const { return model_; }
  const MoELayerOptions& options() const { return options_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int num_local_experts() const { return L_; }

 private:
  // Stage boundaries of a timed forward (the order depends on the mode).
  enum Stage {
    kStart, kQuantized, kRouted, kDispatchSent, kShared, kDispatchReceived, kGemm1, kSiluMul,
    kGemm2, kCombineSent, kDone
  };

  layer::LayerErrorRecord* error_record() const {
    return error_.as<layer::LayerErrorRecord>();
  }
  // What the layer's own kernels flagged (the CUDA-graph staging of bound_m).
  void check_own(cudaStream_t stream) {
    const layer::LayerErrorRecord e = dev_->take_error(error_record(), stream);
    if (e.code == 0) return;
    throw InputError("moelink: rank " + std::to_string(rank_) + ", MoELayer.forward: bound_m = " +
                     std::to_string(e.value) + " is outside [0, " + std::to_string(e.limit) +
                     "] (the rows x has); it was clamped, nothing was read or written out of "
                     "bounds");
  }

  bool profile() const {
    return options_.all_to_all.profile > 0 ||
           (options_.all_to_all.profile < 0 && env_flag("MOELINK_PROFILE"));
  }

  // One forward on `rows` rows of x and out, m = bound_m[0] <= rows. With
  // `timed`, the stream is marked at every stage boundary (stage_times()).
  void run(const Tensor& out, const Tensor& x, const Tensor& bound_m, int64_t rows, MoEOverlap mode,
           cudaStream_t stream, bool timed) {
    require_weights("MoELayer.forward");
    const int32_t* m = static_cast<const int32_t*>(bound_m.data);
    const int64_t H = model_.hidden_size;
    timed_ = timed;
    timed_mode_ = mode;
    auto mark = [&](Stage s) {
      if (timed_) dev_->mark(static_cast<int>(s), stream);
    };
    const Tensor xv = rows_of(x, 0, rows), outv = rows_of(out, 0, rows);
    const Tensor xq = Tensor::contiguous(s_->xq.get(), DType::kFloat8E4M3, {rows, H});
    const Tensor xs = Tensor::contiguous(s_->xs.get(), DType::kFloat32, {rows, H / 128});
    mark(kStart);
    s_->experts->quantize(xq, xs, xv, bound_m, stream);
    mark(kQuantized);
    route_into(xv, bound_m, rows, s_->indices.as<int32_t>(), s_->weights.as<float>(), stream);
    mark(kRouted);
    const bool shared = s_->shared != nullptr;
    auto shared_expert = [&] {
      if (shared) run_shared(outv, xq, xs, bound_m, stream);
    };
    if (mode == MoEOverlap::kMicroBatch) {
      int32_t* m01 = s_->bounds.as<int32_t>();
      dev_->split_bound(m, rows, half_, m01, m01 + 1, stream);
      const int64_t h = std::min(half_, rows);
      const Batch a{s_->mb[0].get(), 0, h, Tensor::contiguous(m01, DType::kInt32, {1}), 0};
      // With rows <= half (one token, say) the second half is empty, but it
      // still takes part in its AllToAll's collective calls (the peers may
      // have tokens): m1 = 0 on a one-row view of row 0 that nothing reads
      // or writes, since an AllToAll takes 1..T rows.
      const Tensor m1 = Tensor::contiguous(m01 + 1, DType::kInt32, {1});
      const Batch b = rows > h ? Batch{s_->mb[1].get(), h, rows - h, m1, 1}
                               : Batch{s_->mb[1].get(), 0, 1, m1, 1};
      dispatch(a, xq, xs, true, false, stream);
      dispatch(b, xq, xs, true, false, stream);
      shared_expert();
      dispatch(a, xq, xs, false, true, stream);
      experts<decltype(mark)>(a, stream, nullptr);
      const Tensor out_a = rows_of(outv, a.row0, a.rows), out_b = rows_of(outv, b.row0, b.rows);
      combine(a, out_a, true, false, shared, stream);
      dispatch(b, xq, xs, false, true, stream);
      experts<decltype(mark)>(b, stream, nullptr);
      combine(b, out_b, true, false, shared, stream);
      combine(a, out_a, false, true, shared, stream);
      combine(b, out_b, false, true, shared, stream);
      mark(kDone);
      return;
    }
    const Batch all{s_->a2a.get(), 0, rows, bound_m, 0};
    if (mode == MoEOverlap::kNone) {
      shared_expert();
      mark(kShared);
      dispatch(all, xq, xs, true, false, stream);
      mark(kDispatchSent);
    } else {
      dispatch(all, xq, xs, true, false, stream);
      mark(kDispatchSent);
      shared_expert();
      mark(kShared);
    }
    dispatch(all, xq, xs, false, true, stream);
    mark(kDispatchReceived);
    experts(all, stream, timed_ ? &mark : nullptr);
    combine(all, outv, true, false, shared, stream);
    mark(kCombineSent);
    combine(all, outv, false, true, shared, stream);
    mark(kDone);
  }

  // Rows [row0, row0 + rows) of the layer's tokens on one AllToAll, m on the device.
  struct Batch {
    AllToAll* a2a;
    int64_t row0, rows;
    Tensor bound_m;
    int part;  // the second micro-batch: 1 (its own counts and expert rows)
  };

  int64_t batch_capacity(const Batch& b) const { return b.a2a->config().expert_capacity(); }
  // Rows a local expert holds on average when every rank sends `rows`
  // tokens: rows x G x top-k / E, at least 1. It picks the expert GEMMs'
  // tiles per call, so that a decode step of 128 tokens runs the tiles of
  // 128 tokens whatever max_tokens is (a 4096-token budget's tiles took 20 %
  // more of the layer's time).
  int64_t expected_expert_rows(int64_t rows) const {
    const int64_t k = model_.num_experts_per_tok, E = model_.n_routed_experts;
    return std::max<int64_t>(1, (rows * G_ * k + E - 1) / E);
  }
  Tensor batch_counts(const Batch& b) const {
    return Tensor::contiguous(s_->counts.as<int32_t>() + b.part * L_, DType::kInt32, {L_});
  }
  // [L, capacity, cols] of an expert buffer: the batch's rows of each expert.
  Tensor batch_rows(const Buffer& buf, DType t, int64_t cols, const Batch& b) const {
    Tensor v = expert_tensor(buf, t, cols, batch_capacity(b));
    v.data = static_cast<char*>(v.data) + b.part * half_ * G_ * cols * static_cast<int64_t>(dtype_size(t));
    return v;
  }

  void dispatch(const Batch& b, const Tensor& xq, const Tensor& xs, bool send, bool recv,
                cudaStream_t stream) {
    const int64_t H = model_.hidden_size;
    b.a2a->dispatch(batch_counts(b), batch_rows(s_->ex_x, DType::kFloat8E4M3, H, b),
                    batch_rows(s_->ex_xs, DType::kFloat32, H / 128, b), rows_of(xq, b.row0, b.rows),
                    rows_of(xs, b.row0, b.rows), rows_of(indices_tensor(), b.row0, b.rows),
                    rows_of(weights_tensor(), b.row0, b.rows), b.bound_m, stream, send, recv);
  }

  // The routed experts on what the dispatch delivered. Timed, it runs
  // forward()'s three steps itself (on buffers of its own) to mark between
  // them; otherwise Experts::forward.
  template <class Mark>
  void experts(const Batch& b, cudaStream_t stream, const Mark* mark) {
    const int64_t H = model_.hidden_size, I = model_.moe_intermediate_size, C = batch_capacity(b);
    const Tensor y = batch_rows(s_->ex_y, DType::kBFloat16, H, b), count = batch_counts(b),
                 x = batch_rows(s_->ex_x, DType::kFloat8E4M3, H, b),
                 xs = batch_rows(s_->ex_xs, DType::kFloat32, H / 128, b);
    const int64_t hint = expected_expert_rows(b.rows);
    if (mark == nullptr) {
      s_->experts->forward(y, count, x, xs, w13(), w13_scale(), w2(), w2_scale(), stream, hint);
      return;
    }
    if (!profile_gu_.get()) {
      profile_gu_ = Buffer(*dev_, L_ * C_ * 2 * I * 2);
      profile_act_ = Buffer(*dev_, L_ * C_ * I);
      profile_acts_ = Buffer(*dev_, L_ * C_ * (I / 128) * 4);
    }
    const Tensor gu = expert_tensor(profile_gu_, DType::kBFloat16, 2 * I, C),
                 act = expert_tensor(profile_act_, DType::kFloat8E4M3, I, C),
                 acts = expert_tensor(profile_acts_, DType::kFloat32, I / 128, C);
    s_->experts->grouped_gemm(gu, count, x, xs, w13(), w13_scale(), stream, hint);
    (*mark)(kGemm1);
    s_->experts->silu_mul_quant(act, acts, gu, count, stream);
    (*mark)(kSiluMul);
    s_->experts->grouped_gemm(y, count, act, acts, w2(), w2_scale(), stream, hint);
    (*mark)(kGemm2);
  }

  // out: the batch's own rows (the caller's view).
  void combine(const Batch& b, const Tensor& out, bool send, bool recv, bool accumulate,
               cudaStream_t stream) {
    const int64_t H = model_.hidden_size;
    b.a2a->combine(out, rows_of(indices_tensor(), b.row0, b.rows),
                   rows_of(weights_tensor(), b.row0, b.rows), batch_rows(s_->ex_y, DType::kBFloat16, H, b),
                   b.bound_m, stream, send, recv, accumulate);
  }

  // out[t] = shared expert(x[t]) for t < m: an Experts of one expert whose
  // count is m itself.
  void run_shared(const Tensor& out, const Tensor& xq, const Tensor& xs, const Tensor& bound_m,
                  cudaStream_t stream) {
    const int64_t H = model_.hidden_size, Is = model_.shared_intermediate_size();
    Experts& shared = s_->shared_small && out.shape[0] <= kSmallSharedRows ? *s_->shared_small : *s_->shared;
    shared.forward(as_single_expert(out), bound_m, as_single_expert(xq), as_single_expert(xs),
                     Tensor::contiguous(sw13_.get(), DType::kFloat8E4M3, {1, 2 * Is, H}),
                     Tensor::contiguous(sw13s_.get(), DType::kFloat32, {1, 2 * Is / 128, H / 128}),
                     Tensor::contiguous(sw2_.get(), DType::kFloat8E4M3, {1, H, Is}),
                     Tensor::contiguous(sw2s_.get(), DType::kFloat32, {1, H / 128, Is / 128}), stream,
                     out.shape[0]);
  }

  void route_into(const Tensor& x, const Tensor& bound_m, int64_t rows, int32_t* indices,
                  float* weights, cudaStream_t stream) {
    const int32_t* m = static_cast<const int32_t*>(bound_m.data);
    dev_->gate_logits(s_->logits.as<float>(), x, gate_.get(), gate_dtype_, model_.n_routed_experts, m,
                      s_->x_f32.as<float>(), stream);
    dev_->route(s_->logits.as<float>(), model_.score_correction_bias ? bias_.as<float>() : nullptr,
                router_, m, rows, indices, weights, stream);
  }

  // [L, C, cols] over an expert buffer of C_ rows per expert.
  Tensor expert_tensor(const Buffer& buf, DType t, int64_t cols, int64_t rows) const {
    return first_rows_per_expert(Tensor::contiguous(buf.get(), t, {L_, C_, cols}), rows);
  }
  Tensor indices_tensor() const {
    return Tensor::contiguous(s_->indices.get(), DType::kInt32,
                              {options_.max_tokens, model_.num_experts_per_tok});
  }
  Tensor weights_tensor() const {
    return Tensor::contiguous(s_->weights.get(), DType::kFloat32,
                              {options_.max_tokens, model_.num_experts_per_tok});
  }
  Tensor w13() const {
    return Tensor::contiguous(w13_.get(), DType::kFloat8E4M3,
                              {L_, 2 * model_.moe_intermediate_size, model_.hidden_size});
  }
  Tensor w13_scale() const {
    return Tensor::contiguous(w13s_.get(), DType::kFloat32,
                              {L_, 2 * model_.moe_intermediate_size / 128, model_.hidden_size / 128});
  }
  Tensor w2() const {
    return Tensor::contiguous(w2_.get(), DType::kFloat8E4M3,
                              {L_, model_.hidden_size, model_.moe_intermediate_size});
  }
  Tensor w2_scale() const {
    return Tensor::contiguous(w2s_.get(), DType::kFloat32,
                              {L_, model_.hidden_size / 128, model_.moe_intermediate_size / 128});
  }

  // ------------------------------------------------------------ checks

  void check_part(const char* call, int part) const {
    if (part != 0 && part != 1)
      throw InvalidArgument(std::string("moelink: ") + call + ": part = " + std::to_string(part) +
                            " must be 0 or 1 (the micro-batch)");
    if (!s_->mb[0])
      throw InvalidArgument(std::string("moelink: ") + call + ": this layer has no micro-batch AllToAlls "
                            "(MoELayerOptions.overlap = " + moe_overlap_name(options_.overlap) +
                            ", world size " + std::to_string(world_) + ", max_tokens " +
                            std::to_string(options_.max_tokens) + "): create it with overlap micro-batch, "
                            "or auto on a backend whose exchange may cross nodes (nvshmem, internode) with "
                            "world size > 1 and max_tokens >= micro_batch_min_tokens");
  }
  void expect_stage(const char* call, int part, int next) const {
    check_part(call, part);
    static const char* names[] = {"stage_begin", "stage_middle", "stage_end"};
    if (s_->stage_owner[part] != this || s_->stage_next[part] != next) {
      const bool mine = s_->stage_owner[part] == this;
      throw InvalidArgument(std::string("moelink: ") + call + ": micro-batch " + std::to_string(part) +
                            (s_->stage_owner[part] == nullptr ? " was not begun by this layer (stage_begin first)"
                             : !mine ? " is held by another layer on this scratch"
                                     : std::string(" expects ") + names[s_->stage_next[part]] + " next"));
    }
  }
  void hold(int part, const Batch& b, const Tensor& out, int next) {
    s_->stage_owner[part] = this;
    s_->stage_next[part] = next;
    stage_batch_[part] = b;
    stage_out_[part] = out;
  }
  void release(int part) {
    s_->stage_owner[part] = nullptr;
    s_->stage_next[part] = 0;
  }
  // A stage that throws ends its micro-batch: the part is free again and its
  // AllToAll expects a dispatch, as for a new call.
  template <class F>
  void stage_guard(int part, F&& f) {
    try {
      f();
    } catch (...) {
      release(part);
      s_->mb[part]->reset_call_order();
      throw;
    }
  }

  void require_weights(const char* call) const {
    if (!has_weights_)
      throw InvalidArgument(std::string("moelink: ") + call +
                            ": no weights yet (call set_weights or load_checkpoint first)");
  }

  static void require_packed(const char* call, const char* field, const Tensor& t) {
    int64_t expect = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (t.shape[d] > 1 && t.stride[d] != expect)
        bad(call, field, "must be contiguous (packed rows), got shape " + shape_str(t));
      expect *= t.shape[d];
    }
  }

  void check_rows_limit(const char* call, const char* field, int64_t rows) const {
    if (rows < 1 || rows > options_.max_tokens)
      bad(call, field, "has " + std::to_string(rows) + " rows, expected 1.." +
                           std::to_string(options_.max_tokens) + " (max_tokens)");
  }

  static void check_bound(const char* call, const Tensor& t) {
    int64_t n = 1;
    for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
    if (!t.defined() || n != 1 || t.dtype != DType::kInt32)
      bad(call, "bound_m", "must be a one-element int32 tensor, got dtype " +
                               std::string(dtype_name(t.dtype)) + " shape " + shape_str(t));
  }

  int64_t check_io(const char* call, const Tensor& out, const Tensor& x, const Tensor& bound_m) const {
    const int64_t H = model_.hidden_size;
    const int64_t rows = check_tensor(call, "x", x, {DType::kBFloat16}, {H}, true);
    check_rows_limit(call, "x", rows);
    if (check_tensor(call, "out", out, {DType::kBFloat16}, {H}, true) != rows)
      bad(call, "out", "has shape " + shape_str(out) + ", expected [" + std::to_string(rows) + ", " +
                           std::to_string(H) + "] (x's rows)");
    check_bound(call, bound_m);
    return rows;
  }

  // One projection (fp8 with scales, or bf16 / fp32 quantized here) into
  // layer memory.
  void copy_projection(const char* call, const char* field, const char* scale_field, const Tensor& w,
                       const Tensor& scale, std::initializer_list<int64_t> shape, Buffer& dst,
                       Buffer& dst_scale) {
    const std::vector<int64_t> dims(shape);
    const int nd = static_cast<int>(dims.size());
    if (!w.defined()) bad(call, field, "is missing (null data pointer)");
    bool shape_ok = w.ndim == nd;
    for (int i = 0; shape_ok && i < nd; ++i) shape_ok = w.shape[i] == dims[i];
    if (!shape_ok) {
      std::string want = "[";
      for (int i = 0; i < nd; ++i) want += (i ? ", " : "") + std::to_string(dims[i]);
      bad(call, field, "has shape " + shape_str(w) + ", expected " + want + "]");
    }
    require_packed(call, field, w);
    int64_t count = 1;
    for (int64_t v : dims) count *= v;
    const int64_t rows = dims[nd - 2], cols = dims[nd - 1], mats = count / (rows * cols);
    const int64_t scales = mats * (rows / 128) * (cols / 128);
    if (w.dtype == DType::kFloat8E4M3 || w.dtype == DType::kUInt8) {
      if (!scale.defined()) bad(call, scale_field, "is missing: fp8 weights need their 128x128 block scales");
      int64_t n = 1;
      for (int i = 0; i < scale.ndim; ++i) n *= scale.shape[i];
      if (scale.dtype != DType::kFloat32 || n != scales || scale.ndim != nd)
        bad(call, scale_field, "must be fp32 of " + std::to_string(scales) +
                                   " elements (one per 128x128 block of " + field + "), got dtype " +
                                   std::string(dtype_name(scale.dtype)) + " shape " + shape_str(scale));
      require_packed(call, scale_field, scale);
      dev_->copy_in(dst.get(), w.data, count);
      dev_->copy_in(dst_scale.get(), scale.data, scales * 4);
      return;
    }
    if (w.dtype != DType::kBFloat16 && w.dtype != DType::kFloat32)
      bad(call, field, "has dtype " + std::string(dtype_name(w.dtype)) +
                           ", expected float8_e4m3 (with scales), bfloat16 or float32");
    if (scale.defined()) bad(call, scale_field, "must be absent for " + std::string(dtype_name(w.dtype)) + " weights (they are quantized here)");
    // Quantize on the host, one matrix at a time.
    const size_t es = dtype_size(w.dtype);
    std::vector<char> raw(count * es);
    dev_->copy_out(raw.data(), w.data, raw.size());
    std::vector<float> f(rows * cols);
    std::vector<uint8_t> q(count);
    std::vector<float> s(scales);
    for (int64_t mi = 0; mi < mats; ++mi) {
      for (int64_t i = 0; i < rows * cols; ++i) {
        const char* p = raw.data() + (mi * rows * cols + i) * es;
        if (es == 4) {
          std::memcpy(&f[i], p, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, p, 2);
          f[i] = bf16_to_f32(h);
        }
      }
      layer::quantize_weight_blocks(f.data(), rows, cols, q.data() + mi * rows * cols,
                                    s.data() + mi * (rows / 128) * (cols / 128));
    }
    dev_->copy_in(dst.get(), q.data(), count);
    dev_->copy_in(dst_scale.get(), s.data(), scales * 4);
  }

  MoEModelConfig model_;
  MoELayerOptions options_;
  layer::RouterParams router_;
  std::unique_ptr<LayerDevice> dev_;
  int rank_ = 0, world_ = 1, L_ = 0;
  int64_t G_ = 1, C_ = 0, half_ = 0;
  // The micro-batches this layer holds between stage_begin and stage_end.
  Batch stage_batch_[2];
  Tensor stage_out_[2];
  // The AllToAlls, expert kernels and buffers, perhaps shared with other
  // layers (MoELayer::create's share_with).
  std::shared_ptr<MoELayerScratch> s_;
  static constexpr int64_t kSmallSharedRows = MoELayerScratch::kSmallSharedRows;
  Buffer error_;
  Buffer gate_, bias_, w13_, w13s_, w2_, w2s_, sw13_, sw13s_, sw2_, sw2s_;
  DType gate_dtype_ = DType::kBFloat16;
  Buffer profile_gu_, profile_act_, profile_acts_;  // experts' intermediates when timed
  bool has_weights_ = false;
  bool timed_ = false;
  MoEOverlap timed_mode_ = MoEOverlap::kNone;
  std::map<std::pair<int64_t, int>, std::shared_ptr<LayerDevice::Graph>> graphs_;
};

}  // namespace detail

std::unique_ptr<MoELayer> MoELayer::create(const MoEModelConfig& model, const MoELayerOptions& options,
                                           Bootstrap& bootstrap, const MoELayer* share_with) {
  return std::unique_ptr<MoELayer>(new MoELayer(std::make_unique<detail::MoELayerImpl>(
      model, options, bootstrap, share_with != nullptr ? share_with->impl_.get() : nullptr)));
}

MoELayer::MoELayer(std::unique_ptr<detail::MoELayerImpl> impl) : impl_(std::move(impl)) {}
MoELayer::~MoELayer() = default;

const MoEModelConfig& MoELayer::model() const { return impl_->model(); }
const MoELayerOptions& MoELayer::options() const { return impl_->options(); }
int MoELayer::rank() const { return impl_->rank(); }
int MoELayer::world_size() const { return impl_->world_size(); }
int MoELayer::num_local_experts() const { return impl_->num_local_experts(); }
void MoELayer::set_weights(const MoEWeights& w) { impl_->set_weights(w); }
void MoELayer::load_checkpoint(const std::string& directory, int layer_index) {
  impl_->load_checkpoint(directory, layer_index);
}
void MoELayer::forward(const Tensor& out, const Tensor& x, const Tensor& bound_m, cudaStream_t stream,
                       int64_t num_tokens) {
  impl_->forward(out, x, bound_m, stream, num_tokens);
}
void MoELayer::stage_begin(int part, const Tensor& out, const Tensor& x, const Tensor& bound_m,
                           cudaStream_t stream) {
  impl_->stage_begin(part, out, x, bound_m, stream);
}
void MoELayer::stage_middle(int part, cudaStream_t stream) { impl_->stage_middle(part, stream); }
void MoELayer::stage_end(int part, cudaStream_t stream) { impl_->stage_end(part, stream); }
void MoELayer::route(const Tensor& indices, const Tensor& weights, const Tensor& x,
                     const Tensor& bound_m, cudaStream_t stream) {
  impl_->route(indices, weights, x, bound_m, stream);
}
MoEOverlap MoELayer::overlap_for(int64_t num_tokens) const { return impl_->overlap_for(num_tokens); }
void MoELayer::check(cudaStream_t stream) { impl_->check(stream); }
MoEStageTimes MoELayer::stage_times() { return impl_->stage_times(); }

}  // namespace moelink
