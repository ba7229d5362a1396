#include "layer_binding.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <string>

#include "moelink/errors.h"
#include "moelink/moe_layer.h"
#include "tensor_convert.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moelink::python {
namespace {

Backend backend_from(const std::string& s) {
  if (s == "cpu") return Backend::kCPU;
  if (s == "nvlink") return Backend::kNVLink;
  if (s == "nvshmem") return Backend::kNVSHMEM;
  if (s == "internode") return Backend::kInternode;
  if (s == "internode-cpu") return Backend::kInternodeCPU;
  throw InvalidArgument("moelink: MoELayer: backend = '" + s +
                        "' must be 'nvlink', 'cpu', 'nvshmem', 'internode' or 'internode-cpu'");
}

MoEOverlap overlap_from(const std::string& s) {
  for (MoEOverlap m : {MoEOverlap::kAuto, MoEOverlap::kNone, MoEOverlap::kDispatchOverlap,
                       MoEOverlap::kMicroBatch})
    if (s == moe_overlap_name(m)) return m;
  throw InvalidArgument("moelink: MoELayer: overlap = '" + s +
                        "' must be 'auto', 'none', 'dispatch-overlap' or 'micro-batch'");
}

}  // namespace

MoELayerOptions moe_layer_options(int64_t max_tokens, const std::string& backend,
                                  const std::string& overlap, int64_t micro_batch_min_tokens,
                                  bool cuda_graphs, int dp_size, double timeout_s, int debug,
                                  int profile) {
  MoELayerOptions o;
  o.max_tokens = max_tokens;
  o.overlap = overlap_from(overlap);
  o.micro_batch_min_tokens = micro_batch_min_tokens;
  o.cuda_graphs = cuda_graphs;
  o.dp_size = dp_size;
  o.all_to_all.backend = backend_from(backend);
  o.all_to_all.timeout_s = timeout_s;
  o.all_to_all.debug = debug;
  o.all_to_all.profile = profile;
  return o;
}

namespace {

class PyMoELayer {
 public:
  PyMoELayer(const MoEModelConfig& model, Bootstrap& boot, int64_t max_tokens,
             const std::string& backend, const std::string& overlap, int64_t micro_batch_min_tokens,
             bool cuda_graphs, int dp_size, double timeout_s, int debug, int profile,
             const PyMoELayer* share_with) {
    const MoELayerOptions o = moe_layer_options(max_tokens, backend, overlap, micro_batch_min_tokens,
                                                cuda_graphs, dp_size, timeout_s, debug, profile);
    host_ = backend_uses_host_memory(o.all_to_all.backend);
    nb::gil_scoped_release release;
    if (!host_) device_ = current_cuda_device();
    impl_ = MoELayer::create(model, o, boot, share_with != nullptr ? share_with->impl_.get() : nullptr);
  }

  ConvertContext context(const char* call) const {
    ConvertContext ctx;
    ctx.call = call;
    ctx.place = host_ ? Place::kHost : Place::kAny;
    ctx.device_id = device_;
    return ctx;
  }

  void set_weights(nb::handle gate, nb::handle gate_bias, nb::handle w13, nb::handle w13_scale,
                   nb::handle w2, nb::handle w2_scale, nb::handle shared_w13,
                   nb::handle shared_w13_scale, nb::handle shared_w2, nb::handle shared_w2_scale) {
    ConvertContext ctx = context("MoELayer.set_weights");
    MoEWeights w;
    w.gate = to_tensor(ctx, gate, "gate", false);
    w.gate_bias = to_tensor(ctx, gate_bias, "gate_bias", false, true);
    w.w13 = to_tensor(ctx, w13, "w13", false);
    w.w13_scale = to_tensor(ctx, w13_scale, "w13_scale", false, true);
    w.w2 = to_tensor(ctx, w2, "w2", false);
    w.w2_scale = to_tensor(ctx, w2_scale, "w2_scale", false, true);
    w.shared_w13 = to_tensor(ctx, shared_w13, "shared_w13", false, true);
    w.shared_w13_scale = to_tensor(ctx, shared_w13_scale, "shared_w13_scale", false, true);
    w.shared_w2 = to_tensor(ctx, shared_w2, "shared_w2", false, true);
    w.shared_w2_scale = to_tensor(ctx, shared_w2_scale, "shared_w2_scale", false, true);
    nb::gil_scoped_release release;
    impl_->set_weights(w);
  }

  void load_checkpoint(const std::string& dir, int layer) {
    nb::gil_scoped_release release;
    impl_->load_checkpoint(dir, layer);
  }

  void forward(nb::handle out, nb::handle x, nb::handle bound_m, uintptr_t stream, int64_t num_tokens) {
    ConvertContext ctx = context("MoELayer.forward");
    ctx.place = host_ ? Place::kHost : Place::kCuda;
    Tensor t_out = to_tensor(ctx, out, "out", true), t_x = to_tensor(ctx, x, "x", false),
           t_m = to_tensor(ctx, bound_m, "bound_m", false);
    nb::gil_scoped_release release;
    impl_->forward(t_out, t_x, t_m, reinterpret_cast<cudaStream_t>(stream), num_tokens);
  }

  void stage_begin(int part, nb::handle out, nb::handle x, nb::handle bound_m, uintptr_t stream) {
    ConvertContext ctx = context("MoELayer.stage_begin");
    ctx.place = host_ ? Place::kHost : Place::kCuda;
    Tensor t_out = to_tensor(ctx, out, "out", true), t_x = to_tensor(ctx, x, "x", false),
           t_m = to_tensor(ctx, bound_m, "bound_m", false);
    nb::gil_scoped_release release;
    impl_->stage_begin(part, t_out, t_x, t_m, reinterpret_cast<cudaStream_t>(stream));
  }
  void stage_middle(int part, uintptr_t stream) {
    nb::gil_scoped_release release;
    impl_->stage_middle(part, reinterpret_cast<cudaStream_t>(stream));
  }
  void stage_end(int part, uintptr_t stream) {
    nb::gil_scoped_release release;
    impl_->stage_end(part, reinterpret_cast<cudaStream_t>(stream));
  }

  void route(nb::handle indices, nb::handle weights, nb::handle x, nb::handle bound_m, uintptr_t stream) {
    ConvertContext ctx = context("MoELayer.route");
    ctx.place = host_ ? Place::kHost : Place::kCuda;
    Tensor t_i = to_tensor(ctx, indices, "indices", true), t_w = to_tensor(ctx, weights, "weights", true),
           t_x = to_tensor(ctx, x, "x", false), t_m = to_tensor(ctx, bound_m, "bound_m", false);
    nb::gil_scoped_release release;
    impl_->route(t_i, t_w, t_x, t_m, reinterpret_cast<cudaStream_t>(stream));
  }

  void check(uintptr_t stream) {
    nb::gil_scoped_release release;
    impl_->check(reinterpret_cast<cudaStream_t>(stream));
  }

  nb::dict stage_times() {
    MoEStageTimes t;
    {
      nb::gil_scoped_release release;
      t = impl_->stage_times();
    }
    nb::dict d;
    d["quantize_us"] = t.quantize_us;
    d["router_us"] = t.router_us;
    d["dispatch_send_us"] = t.dispatch_send_us;
    d["shared_expert_us"] = t.shared_expert_us;
    d["dispatch_recv_us"] = t.dispatch_recv_us;
    d["gemm1_us"] = t.gemm1_us;
    d["silu_mul_us"] = t.silu_mul_us;
    d["gemm2_us"] = t.gemm2_us;
    d["combine_send_us"] = t.combine_send_us;
    d["combine_recv_us"] = t.combine_recv_us;
    d["total_us"] = t.total_us;
    return d;
  }

  MoELayer& impl() { return *impl_; }

 private:
  std::unique_ptr<MoELayer> impl_;
  bool host_ = false;
  int device_ = -1;
};

}  // namespace

void bind_moe_layer(nb::module_& m) {
  nb::class_<MoEModelConfig>(m, "MoEModelConfig",
                             "A MoE layer's architecture (Hugging Face config.json field names).")
      .def(nb::init<>())
      .def_rw("name", &MoEModelConfig::name)
      .def_rw("hidden_size", &MoEModelConfig::hidden_size)
      .def_rw("moe_intermediate_size", &MoEModelConfig::moe_intermediate_size)
      .def_rw("n_routed_experts", &MoEModelConfig::n_routed_experts)
      .def_rw("n_shared_experts", &MoEModelConfig::n_shared_experts)
      .def_rw("num_experts_per_tok", &MoEModelConfig::num_experts_per_tok)
      .def_rw("n_group", &MoEModelConfig::n_group)
      .def_rw("topk_group", &MoEModelConfig::topk_group)
      .def_prop_rw(
          "scoring_func",
          [](const MoEModelConfig& c) { return c.scoring == ScoringFunction::kSigmoid ? "sigmoid" : "softmax"; },
          [](MoEModelConfig& c, const std::string& s) {
            if (s != "sigmoid" && s != "softmax")
              throw InvalidArgument("moelink: MoEModelConfig.scoring_func = '" + s +
                                    "' must be 'sigmoid' or 'softmax'");
            c.scoring = s == "sigmoid" ? ScoringFunction::kSigmoid : ScoringFunction::kSoftmax;
          })
      .def_rw("score_correction_bias", &MoEModelConfig::score_correction_bias)
      .def_rw("norm_topk_prob", &MoEModelConfig::norm_topk_prob)
      .def_rw("routed_scaling_factor", &MoEModelConfig::routed_scaling_factor)
      .def_rw("checkpoint_naming", &MoEModelConfig::checkpoint_naming)
      .def("validate", &MoEModelConfig::validate)
      .def("__repr__", &MoEModelConfig::to_string)
      .def_static("preset", &MoEModelConfig::preset, "name"_a)
      .def_static("from_hf_config_json", &MoEModelConfig::from_hf_config_json, "json_text"_a);

  nb::class_<PyMoELayer>(m, "MoELayer", "A MoE layer (moelink.MoELayer wraps this).")
      .def(nb::init<const MoEModelConfig&, Bootstrap&, int64_t, const std::string&, const std::string&,
                    int64_t, bool, int, double, int, int, const PyMoELayer*>(),
           "model"_a, "bootstrap"_a, "max_tokens"_a, "backend"_a, "overlap"_a,
           "micro_batch_min_tokens"_a, "cuda_graphs"_a, "dp_size"_a, "timeout_s"_a, "debug"_a,
           "profile"_a, "share_with"_a.none())
      .def("set_weights", &PyMoELayer::set_weights, "gate"_a, "gate_bias"_a.none(), "w13"_a,
           "w13_scale"_a.none(), "w2"_a, "w2_scale"_a.none(), "shared_w13"_a.none(),
           "shared_w13_scale"_a.none(), "shared_w2"_a.none(), "shared_w2_scale"_a.none())
      .def("load_checkpoint", &PyMoELayer::load_checkpoint, "directory"_a, "layer_index"_a)
      .def("forward", &PyMoELayer::forward, "out"_a, "x"_a, "bound_m"_a, "stream"_a, "num_tokens"_a)
      .def("route", &PyMoELayer::route, "indices"_a, "weights"_a, "x"_a, "bound_m"_a, "stream"_a)
      .def("stage_begin", &PyMoELayer::stage_begin, "part"_a, "out"_a, "x"_a, "bound_m"_a, "stream"_a)
      .def("stage_middle", &PyMoELayer::stage_middle, "part"_a, "stream"_a)
      .def("stage_end", &PyMoELayer::stage_end, "part"_a, "stream"_a)
      .def("check", &PyMoELayer::check, "stream"_a)
      .def("stage_times", &PyMoELayer::stage_times)
      .def("overlap_for",
           [](PyMoELayer& l, int64_t n) { return std::string(moe_overlap_name(l.impl().overlap_for(n))); },
           "num_tokens"_a)
      .def_prop_ro("num_local_experts", [](PyMoELayer& l) { return l.impl().num_local_experts(); })
      .def_prop_ro("rank", [](PyMoELayer& l) { return l.impl().rank(); })
      .def_prop_ro("world_size", [](PyMoELayer& l) { return l.impl().world_size(); })
      .def_prop_ro("model", [](PyMoELayer& l) { return l.impl().model(); });
}

}  // namespace moelink::python
