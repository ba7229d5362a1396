#include "experts_binding.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <string>

#include "moelink/errors.h"
#include "moelink/experts.h"
#include "tensor_convert.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moelink::python {
namespace {

ExpertDevice parse_expert_device(const std::string& s) {
  if (s == "cuda" || s == "gpu") return ExpertDevice::kCUDA;
  if (s == "cpu") return ExpertDevice::kCPU;
  throw InvalidArgument("moelink: Experts: device = '" + s + "' must be 'cuda' or 'cpu'");
}

class PyExperts {
 public:
  PyExperts(int num_experts, int64_t max_rows, int hidden_dim, int intermediate_dim,
            const std::string& device, int64_t expected_rows, int debug) {
    ExpertConfig c;
    c.num_experts = num_experts;
    c.max_rows = max_rows;
    c.hidden_dim = hidden_dim;
    c.intermediate_dim = intermediate_dim;
    c.device = parse_expert_device(device);
    c.expected_rows = expected_rows;
    c.debug = debug;
    nb::gil_scoped_release release;
    if (c.device == ExpertDevice::kCUDA) device_ = current_cuda_device();
    impl_ = Experts::create(c);
  }

  ConvertContext context(const char* call) const {
    ConvertContext ctx;
    ctx.call = call;
    ctx.place = impl_->config().device == ExpertDevice::kCPU ? Place::kHost : Place::kCuda;
    ctx.device_id = device_;
    return ctx;
  }

  void forward(nb::handle y, nb::handle count, nb::handle x, nb::handle xs, nb::handle w13,
               nb::handle w13s, nb::handle w2, nb::handle w2s, uintptr_t stream, int64_t expected_rows) {
    ConvertContext ctx = context("Experts.forward");
    Tensor t_y = to_tensor(ctx, y, "expert_y", true), t_c = to_tensor(ctx, count, "expert_num_tokens", false),
           t_x = to_tensor(ctx, x, "expert_x", false), t_xs = to_tensor(ctx, xs, "expert_x_scale", false),
           t_w13 = to_tensor(ctx, w13, "w13", false), t_w13s = to_tensor(ctx, w13s, "w13_scale", false),
           t_w2 = to_tensor(ctx, w2, "w2", false), t_w2s = to_tensor(ctx, w2s, "w2_scale", false);
    nb::gil_scoped_release release;
    impl_->forward(t_y, t_c, t_x, t_xs, t_w13, t_w13s, t_w2, t_w2s,
                   reinterpret_cast<cudaStream_t>(stream), expected_rows);
  }

  void grouped_gemm(nb::handle y, nb::handle count, nb::handle x, nb::handle xs, nb::handle w,
                    nb::handle ws, uintptr_t stream, int64_t expected_rows) {
    ConvertContext ctx = context("Experts.grouped_gemm");
    Tensor t_y = to_tensor(ctx, y, "y", true), t_c = to_tensor(ctx, count, "count", false),
           t_x = to_tensor(ctx, x, "x", false), t_xs = to_tensor(ctx, xs, "x_scale", false),
           t_w = to_tensor(ctx, w, "w", false), t_ws = to_tensor(ctx, ws, "w_scale", false);
    nb::gil_scoped_release release;
    impl_->grouped_gemm(t_y, t_c, t_x, t_xs, t_w, t_ws, reinterpret_cast<cudaStream_t>(stream),
                        expected_rows);
  }

  void silu_mul_quant(nb::handle q, nb::handle s, nb::handle gu, nb::handle count, uintptr_t stream) {
    ConvertContext ctx = context("Experts.silu_mul_quant");
    Tensor t_q = to_tensor(ctx, q, "out_q", true), t_s = to_tensor(ctx, s, "out_scale", true),
           t_gu = to_tensor(ctx, gu, "gate_up", false), t_c = to_tensor(ctx, count, "count", false);
    nb::gil_scoped_release release;
    impl_->silu_mul_quant(t_q, t_s, t_gu, t_c, reinterpret_cast<cudaStream_t>(stream));
  }

  void quantize(nb::handle q, nb::handle s, nb::handle x, nb::handle bound_m, uintptr_t stream) {
    ConvertContext ctx = context("Experts.quantize");
    Tensor t_q = to_tensor(ctx, q, "out_q", true), t_s = to_tensor(ctx, s, "out_scale", true),
           t_x = to_tensor(ctx, x, "x", false), t_m = to_tensor(ctx, bound_m, "bound_m", false, true);
    nb::gil_scoped_release release;
    impl_->quantize(t_q, t_s, t_x, t_m, reinterpret_cast<cudaStream_t>(stream));
  }

  void gemm(nb::handle y, nb::handle x, nb::handle xs, nb::handle w, nb::handle ws,
            nb::handle bound_m, uintptr_t stream) {
    ConvertContext ctx = context("Experts.gemm");
    Tensor t_y = to_tensor(ctx, y, "y", true), t_x = to_tensor(ctx, x, "x", false),
           t_xs = to_tensor(ctx, xs, "x_scale", false), t_w = to_tensor(ctx, w, "w", false),
           t_ws = to_tensor(ctx, ws, "w_scale", false),
           t_m = to_tensor(ctx, bound_m, "bound_m", false, true);
    nb::gil_scoped_release release;
    impl_->gemm(t_y, t_x, t_xs, t_w, t_ws, t_m, reinterpret_cast<cudaStream_t>(stream));
  }

  void check(uintptr_t stream) {
    nb::gil_scoped_release release;
    impl_->check(reinterpret_cast<cudaStream_t>(stream));
  }

  Experts& impl() { return *impl_; }
  int device() const { return device_; }

 private:
  std::unique_ptr<Experts> impl_;
  int device_ = -1;
};

}  // namespace

void bind_experts(nb::module_& m) {
  nb::class_<PyExperts>(m, "Experts", "The expert kernels (moelink.Experts wraps this).")
      .def(nb::init<int, int64_t, int, int, const std::string&, int64_t, int>(), "num_experts"_a,
           "max_rows"_a, "hidden_dim"_a, "intermediate_dim"_a, "device"_a, "expected_rows"_a,
           "debug"_a)
      .def("forward", &PyExperts::forward, "expert_y"_a, "expert_num_tokens"_a, "expert_x"_a,
           "expert_x_scale"_a, "w13"_a, "w13_scale"_a, "w2"_a, "w2_scale"_a, "stream"_a,
           "expected_rows"_a = 0)
      .def("grouped_gemm", &PyExperts::grouped_gemm, "y"_a, "count"_a, "x"_a, "x_scale"_a, "w"_a,
           "w_scale"_a, "stream"_a, "expected_rows"_a = 0)
      .def("silu_mul_quant", &PyExperts::silu_mul_quant, "out_q"_a, "out_scale"_a, "gate_up"_a,
           "count"_a, "stream"_a)
      .def("quantize", &PyExperts::quantize, "out_q"_a, "out_scale"_a, "x"_a, "bound_m"_a.none(),
           "stream"_a)
      .def("gemm", &PyExperts::gemm, "y"_a, "x"_a, "x_scale"_a, "w"_a, "w_scale"_a,
           "bound_m"_a.none(), "stream"_a)
      .def("check", &PyExperts::check, "stream"_a)
      .def_prop_ro("workspace_bytes", [](PyExperts& e) { return e.impl().workspace_bytes(); })
      .def_prop_ro("device", &PyExperts::device)
      .def_prop_ro("config", [](PyExperts& e) { return e.impl().config().to_string(); });
}

}  // namespace moelink::python
