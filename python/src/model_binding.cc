#include "model_binding.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <string>

#include "attention_binding.h"
#include "layer_binding.h"
#include "moelink/errors.h"
#include "moelink/model.h"
#include "tensor_convert.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moelink::python {
namespace {

class PyModel {
 public:
  PyModel(const ModelConfig& config, Bootstrap& boot, int64_t max_tokens, const std::string& backend,
          const std::string& overlap, int dp_size, double timeout_s, int debug, int num_layers,
          int64_t num_pages, int page_size, int max_requests, int max_pages_per_request, int tp_size,
          int tp_rank, bool mtp, bool decode_graphs, const std::string& decode_kernel,
          const std::string& prefill_kernel, const std::string& head_gemm) {
    ModelOptions o;
    o.num_layers = num_layers;
    o.mtp = mtp;
    o.decode_graphs = decode_graphs;
    o.moe = moe_layer_options(max_tokens, backend, overlap, 32, false, dp_size, timeout_s, debug, -1);
    o.attention.page_size = page_size;
    o.attention.max_requests = max_requests;
    o.attention.max_pages_per_request = max_pages_per_request;
    o.attention.tp_size = tp_size;
    o.attention.tp_rank = tp_rank;
    o.attention.debug = debug;
    o.attention.decode_kernel = parse_kernel<MLADecodeKernel>("Model", "decode_kernel", decode_kernel);
    o.attention.prefill_kernel = parse_kernel<MLAPrefillKernel>("Model", "prefill_kernel", prefill_kernel);
    o.attention.head_gemm = parse_head_gemm("Model", head_gemm);
    o.num_pages = num_pages;
    host_ = backend_uses_host_memory(o.moe.all_to_all.backend);
    nb::gil_scoped_release release;
    if (!host_) device_ = current_cuda_device();
    impl_ = Model::create(config, o, boot);
  }

  void load_checkpoint(const std::string& dir) {
    nb::gil_scoped_release release;
    impl_->load_checkpoint(dir);
  }

  void step(nb::handle token_ids, nb::handle q_start, nb::handle kv_len, nb::handle block_table,
            int num_requests, int num_decode, nb::handle next_tokens, nb::handle logits,
            bool logits_every_row, nb::handle temperature, nb::handle top_k, nb::handle top_p,
            nb::handle seed, nb::handle num_drafts, nb::handle known_next, nb::handle accepted,
            nb::handle draft_tokens, nb::handle draft_logits, uintptr_t stream, bool from_host) {
    ConvertContext ctx;
    ctx.call = from_host ? "Model.step_from_host" : "Model.step";
    ctx.place = host_ || from_host ? Place::kHost : Place::kCuda;
    ctx.device_id = device_;
    StepInput in;
    in.token_ids = to_tensor(ctx, token_ids, "token_ids", false);
    in.batch.num_requests = num_requests;
    in.batch.num_decode = num_decode;
    in.batch.q_start = to_tensor(ctx, q_start, "q_start", false);
    in.batch.kv_len = to_tensor(ctx, kv_len, "kv_len", false, true);
    in.batch.block_table = to_tensor(ctx, block_table, "block_table", false, true);
    in.sampling.temperature = to_tensor(ctx, temperature, "temperature", false, true);
    in.sampling.top_k = to_tensor(ctx, top_k, "top_k", false, true);
    in.sampling.top_p = to_tensor(ctx, top_p, "top_p", false, true);
    in.sampling.seed = to_tensor(ctx, seed, "seed", false, true);
    in.num_drafts = to_tensor(ctx, num_drafts, "num_drafts", false, true);
    in.known_next = to_tensor(ctx, known_next, "known_next", false, true);
    StepOutput out;
    out.accepted = to_tensor(ctx, accepted, "accepted", true, true);
    out.draft_tokens = to_tensor(ctx, draft_tokens, "draft_tokens", true, true);
    out.draft_logits = to_tensor(ctx, draft_logits, "draft_logits", true, true);
    out.next_tokens = to_tensor(ctx, next_tokens, "next_tokens", true);
    out.logits = to_tensor(ctx, logits, "logits", true, true);
    out.logits_every_row = logits_every_row;
    nb::gil_scoped_release release;
    if (from_host)
      impl_->step_from_host(in, out, reinterpret_cast<cudaStream_t>(stream));
    else
      impl_->step(in, out, reinterpret_cast<cudaStream_t>(stream));
  }

  void check(uintptr_t stream) {
    nb::gil_scoped_release release;
    impl_->check(reinterpret_cast<cudaStream_t>(stream));
  }

  Model& impl() { return *impl_; }
  bool on_host() const { return host_; }
  int device() const { return device_; }

 private:
  std::unique_ptr<Model> impl_;
  bool host_ = true;
  int device_ = -1;
};

}  // namespace

Model& unwrap_model(nb::handle model) { return nb::cast<PyModel&>(model).impl(); }

void bind_model(nb::module_& m) {
  nb::class_<ModelConfig>(m, "ModelConfig", "A DeepSeek-V3-family model's architecture.")
      .def(nb::init<>())
      .def_rw("attention", &ModelConfig::attention)
      .def_rw("moe", &ModelConfig::moe)
      .def_rw("vocab_size", &ModelConfig::vocab_size)
      .def_rw("num_hidden_layers", &ModelConfig::num_hidden_layers)
      .def_rw("first_k_dense_replace", &ModelConfig::first_k_dense_replace)
      .def_rw("intermediate_size", &ModelConfig::intermediate_size)
      .def_rw("rms_norm_eps", &ModelConfig::rms_norm_eps)
      .def_rw("num_nextn_predict_layers", &ModelConfig::num_nextn_predict_layers)
      .def_rw("tie_word_embeddings", &ModelConfig::tie_word_embeddings)
      .def("validate", &ModelConfig::validate)
      .def_static("preset", &ModelConfig::preset, "name"_a)
      .def_static("from_hf_config_json", &ModelConfig::from_hf_config_json, "json_text"_a);

  nb::class_<PyModel>(m, "Model", "A DeepSeek-V3-family model (moelink.Model wraps this).")
      .def(nb::init<const ModelConfig&, Bootstrap&, int64_t, const std::string&, const std::string&, int,
                    double, int, int, int64_t, int, int, int, int, int, bool, bool, const std::string&,
                    const std::string&, const std::string&>(),
           "config"_a, "bootstrap"_a, "max_tokens"_a, "backend"_a, "overlap"_a, "dp_size"_a,
           "timeout_s"_a, "debug"_a, "num_layers"_a, "num_pages"_a, "page_size"_a, "max_requests"_a,
           "max_pages_per_request"_a, "tp_size"_a, "tp_rank"_a, "mtp"_a, "decode_graphs"_a,
           "decode_kernel"_a, "prefill_kernel"_a, "head_gemm"_a)
      .def("load_checkpoint", &PyModel::load_checkpoint, "directory"_a)
      .def("step", &PyModel::step, "token_ids"_a, "q_start"_a, "kv_len"_a.none(),
           "block_table"_a.none(), "num_requests"_a, "num_decode"_a, "next_tokens"_a,
           "logits"_a.none(), "logits_every_row"_a, "temperature"_a.none(), "top_k"_a.none(),
           "top_p"_a.none(), "seed"_a.none(), "num_drafts"_a.none(), "known_next"_a.none(),
           "accepted"_a.none(), "draft_tokens"_a.none(), "draft_logits"_a.none(), "stream"_a,
           "from_host"_a = false)
      .def("check", &PyModel::check, "stream"_a)
      .def(
          "kv_cache_region",
          [](nb::handle self) -> nb::object {
            PyModel& p = nb::cast<PyModel&>(self);
            const Tensor t = p.impl().kv_cache_region();
            const size_t n = static_cast<size_t>(t.shape[0]);
            // A view kept alive by the model: numpy on the host, torch on a GPU.
            if (p.on_host()) return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(t.data, {n}, self));
            return nb::cast(nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>>(
                t.data, {n}, self, {}, nb::dtype<uint8_t>(), nb::device::cuda::value, p.device()));
          })
      .def_prop_ro("num_layers", [](PyModel& p) { return p.impl().num_layers(); })
      .def_prop_ro("two_batch_steps", [](PyModel& p) { return p.impl().two_batch_steps(); })
      .def_prop_ro("decode_graph_stats",
                   [](PyModel& p) {
                     const DecodeGraphStats s = p.impl().decode_graph_stats();
                     nb::dict d;
                     d["replays"] = s.replays;
                     d["eager_steps"] = s.eager_steps;
                     d["captures"] = s.captures;
                     d["host_seconds"] = s.host_seconds;
                     d["wait_seconds"] = s.wait_seconds;
                     return d;
                   })
      .def_prop_ro("config", [](PyModel& p) { return p.impl().config(); });
}

}  // namespace moelink::python
