#include "attention_binding.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <string>

#include "moelink/attention.h"
#include "moelink/errors.h"
#include "tensor_convert.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moelink::python {
namespace {

AttentionDevice parse_device(const std::string& s) {
  if (s == "cuda" || s == "gpu") return AttentionDevice::kCUDA;
  if (s == "cpu") return AttentionDevice::kCPU;
  throw InvalidArgument("moelink: MLAAttention: device = '" + s + "' must be 'cuda' or 'cpu'");
}

class PyMLAAttention {
 public:
  PyMLAAttention(const MLAConfig& config, const std::string& device, int tp_size, int tp_rank,
                 int page_size, int64_t max_tokens, int max_requests, int max_pages_per_request,
                 int debug, const std::string& decode_kernel, const std::string& prefill_kernel,
                 const std::string& head_gemm, const PyMLAAttention* share_with) {
    MLAOptions o;
    o.device = parse_device(device);
    o.decode_kernel = parse_kernel<MLADecodeKernel>("MLAAttention", "decode_kernel", decode_kernel);
    o.prefill_kernel = parse_kernel<MLAPrefillKernel>("MLAAttention", "prefill_kernel", prefill_kernel);
    o.head_gemm = parse_head_gemm("MLAAttention", head_gemm);
    o.tp_size = tp_size;
    o.tp_rank = tp_rank;
    o.page_size = page_size;
    o.max_tokens = max_tokens;
    o.max_requests = max_requests;
    o.max_pages_per_request = max_pages_per_request;
    o.debug = debug;
    host_ = o.device == AttentionDevice::kCPU;
    nb::gil_scoped_release release;
    if (!host_) device_ = current_cuda_device();
    impl_ = MLAAttention::create(config, o, share_with != nullptr ? share_with->impl_.get() : nullptr);
  }

  ConvertContext context(const char* call, bool any_place) const {
    ConvertContext ctx;
    ctx.call = call;
    ctx.place = any_place ? Place::kAny : host_ ? Place::kHost : Place::kCuda;
    ctx.device_id = device_;
    return ctx;
  }

  void set_weights(nb::dict tensors) {
    ConvertContext ctx = context("MLAAttention.set_weights", true);
    MLAWeights w;
    struct Field {
      const char* name;
      Tensor* dst;
    } fields[] = {{"input_layernorm", &w.input_layernorm},
                  {"q_a_proj", &w.q_a_proj},
                  {"q_a_proj_scale", &w.q_a_proj_scale},
                  {"q_a_layernorm", &w.q_a_layernorm},
                  {"kv_a_proj_with_mqa", &w.kv_a_proj_with_mqa},
                  {"kv_a_proj_with_mqa_scale", &w.kv_a_proj_with_mqa_scale},
                  {"kv_a_layernorm", &w.kv_a_layernorm},
                  {"q_b_proj", &w.q_b_proj},
                  {"q_b_proj_scale", &w.q_b_proj_scale},
                  {"kv_b_proj", &w.kv_b_proj},
                  {"kv_b_proj_scale", &w.kv_b_proj_scale},
                  {"o_proj", &w.o_proj},
                  {"o_proj_scale", &w.o_proj_scale}};
    for (auto [key, value] : tensors) {
      const std::string k = nb::cast<std::string>(key);
      bool known = false;
      for (Field& f : fields)
        if (k == f.name) {
          *f.dst = to_tensor(ctx, value, f.name, false, true);
          known = true;
        }
      if (!known)
        throw InvalidArgument("moelink: MLAAttention.set_weights: unknown weight '" + k +
                              "' (expected Hugging Face's self_attn names: q_a_proj, "
                              "kv_a_proj_with_mqa, q_b_proj, kv_b_proj, o_proj with _scale, the "
                              "layernorms, input_layernorm)");
    }
    nb::gil_scoped_release release;
    impl_->set_weights(w);
  }

  void load_checkpoint(const std::string& dir, int layer) {
    nb::gil_scoped_release release;
    impl_->load_checkpoint(dir, layer);
  }

  void forward(nb::handle out, nb::handle x, nb::handle kv_cache, nb::handle q_start,
               nb::handle kv_len, nb::handle block_table, int num_requests, int num_decode,
               uintptr_t stream) {
    ConvertContext ctx = context("MLAAttention.forward", false);
    MLABatch b;
    b.num_requests = num_requests;
    b.num_decode = num_decode;
    Tensor t_out = to_tensor(ctx, out, "out", true), t_x = to_tensor(ctx, x, "x", false),
           t_cache = to_tensor(ctx, kv_cache, "kv_cache", true);
    b.q_start = to_tensor(ctx, q_start, "q_start", false);
    b.kv_len = to_tensor(ctx, kv_len, "kv_len", false, true);
    b.block_table = to_tensor(ctx, block_table, "block_table", false, true);
    nb::gil_scoped_release release;
    impl_->forward(t_out, t_x, b, t_cache, reinterpret_cast<cudaStream_t>(stream));
  }

  void check(uintptr_t stream) {
    nb::gil_scoped_release release;
    impl_->check(reinterpret_cast<cudaStream_t>(stream));
  }

  MLAAttention& impl() { return *impl_; }

 private:
  std::unique_ptr<MLAAttention> impl_;
  bool host_ = false;
  int device_ = -1;
};

}  // namespace

void bind_attention(nb::module_& m) {
  nb::class_<RopeScaling>(m, "RopeScaling", "Hugging Face's rope_scaling (YaRN) of DeepSeek-V3.")
      .def(nb::init<>())
      .def_rw("type", &RopeScaling::type)
      .def_rw("factor", &RopeScaling::factor)
      .def_rw("original_max_position_embeddings", &RopeScaling::original_max_position_embeddings)
      .def_rw("beta_fast", &RopeScaling::beta_fast)
      .def_rw("beta_slow", &RopeScaling::beta_slow)
      .def_rw("mscale", &RopeScaling::mscale)
      .def_rw("mscale_all_dim", &RopeScaling::mscale_all_dim);

  nb::class_<MLAConfig>(m, "MLAConfig", "MLA attention's architecture (config.json field names).")
      .def(nb::init<>())
      .def_rw("hidden_size", &MLAConfig::hidden_size)
      .def_rw("num_attention_heads", &MLAConfig::num_attention_heads)
      .def_rw("q_lora_rank", &MLAConfig::q_lora_rank)
      .def_rw("kv_lora_rank", &MLAConfig::kv_lora_rank)
      .def_rw("qk_nope_head_dim", &MLAConfig::qk_nope_head_dim)
      .def_rw("qk_rope_head_dim", &MLAConfig::qk_rope_head_dim)
      .def_rw("v_head_dim", &MLAConfig::v_head_dim)
      .def_rw("rms_norm_eps", &MLAConfig::rms_norm_eps)
      .def_rw("rope_theta", &MLAConfig::rope_theta)
      .def_rw("rope_scaling", &MLAConfig::rope_scaling)
      .def_rw("rope_interleave", &MLAConfig::rope_interleave)
      .def_prop_ro("cache_row", &MLAConfig::cache_row)
      .def("softmax_scale", &MLAConfig::softmax_scale)
      .def("cache_bytes_per_token", &MLAConfig::cache_bytes_per_token, "num_layers"_a)
      .def("validate", &MLAConfig::validate)
      .def("__repr__", &MLAConfig::to_string)
      .def_static("preset", &MLAConfig::preset, "name"_a)
      .def_static("from_hf_config_json", &MLAConfig::from_hf_config_json, "json_text"_a);

  nb::class_<PyMLAAttention>(m, "MLAAttention", "MLA attention (moelink.MLAAttention wraps this).")
      .def(nb::init<const MLAConfig&, const std::string&, int, int, int, int64_t, int, int, int,
                    const std::string&, const std::string&, const std::string&, const PyMLAAttention*>(),
           "config"_a, "device"_a, "tp_size"_a, "tp_rank"_a, "page_size"_a, "max_tokens"_a,
           "max_requests"_a, "max_pages_per_request"_a, "debug"_a, "decode_kernel"_a, "prefill_kernel"_a,
           "head_gemm"_a, "share_with"_a.none())
      .def("set_weights", &PyMLAAttention::set_weights, "tensors"_a)
      .def("load_checkpoint", &PyMLAAttention::load_checkpoint, "directory"_a, "layer_index"_a)
      .def("forward", &PyMLAAttention::forward, "out"_a, "x"_a, "kv_cache"_a, "q_start"_a,
           "kv_len"_a.none(), "block_table"_a.none(), "num_requests"_a, "num_decode"_a, "stream"_a)
      .def("check", &PyMLAAttention::check, "stream"_a)
      .def_prop_ro("local_heads", [](PyMLAAttention& a) { return a.impl().local_heads(); })
      .def_prop_ro("config", [](PyMLAAttention& a) { return a.impl().config(); });
}

}  // namespace moelink::python
