// LayerDevice for the host backends: host memory, plain loops.
#include <algorithm>
#include <chrono>
#include <vector>
#include <cstdlib>
#include <cstring>

#include "core/float_convert.h"
#include "layer/layer_device.h"
#include "moelink/errors.h"

namespace moelink::detail::layer {
namespace {

int64_t bounded_rows(const int32_t* bound_m, int64_t rows) {
  return std::clamp<int64_t>(*bound_m, 0, rows);
}

class CpuLayerDevice final : public HostMemory<LayerDevice> {
 public:

  void gate_logits(float* logits, const Tensor& x, const void* gate, DType gate_dtype,
                   int num_experts, const int32_t* bound_m, float*, cudaStream_t) override {
    const int64_t rows = bounded_rows(bound_m, x.shape[0]), H = x.shape[1];
    const auto* xb = static_cast<const uint16_t*>(x.data);
    for (int64_t t = 0; t < rows; ++t) {
      const uint16_t* xr = xb + t * x.stride[0];
      for (int e = 0; e < num_experts; ++e) {
        double acc = 0;
        if (gate_dtype == DType::kFloat32) {
          const float* g = static_cast<const float*>(gate) + static_cast<int64_t>(e) * H;
          for (int64_t h = 0; h < H; ++h) acc += static_cast<double>(bf16_to_f32(xr[h])) * g[h];
        } else {
          const uint16_t* g = static_cast<const uint16_t*>(gate) + static_cast<int64_t>(e) * H;
          for (int64_t h = 0; h < H; ++h)
            acc += static_cast<double>(bf16_to_f32(xr[h])) * bf16_to_f32(g[h]);
        }
        logits[t * num_experts + e] = static_cast<float>(acc);
      }
    }
  }

  void route(const float* logits, const float* bias, const RouterParams& p, const int32_t* bound_m,
             int64_t rows, int32_t* indices, float* weights, cudaStream_t) override {
    route_cpu(logits, p.num_experts, bias, p, bounded_rows(bound_m, rows), indices, p.top_k,
              weights, p.top_k);
  }

  void split_bound(const int32_t* bound_m, int64_t rows, int64_t half, int32_t* m0, int32_t* m1,
                   cudaStream_t) override {
    const int64_t m = bounded_rows(bound_m, rows), first = std::min(m, half);
    *m0 = static_cast<int32_t>(first);
    *m1 = static_cast<int32_t>(m - first);
  }

  void copy_rows(void* dst, int64_t dst_stride_bytes, const void* src, int64_t src_stride_bytes,
                 int64_t row_bytes, const int32_t* bound_m, int64_t rows, int32_t* bound_m_dst,
                 LayerErrorRecord* error, cudaStream_t) override {
    const int64_t m = bounded_rows(bound_m, rows);
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dst_stride_bytes,
                  static_cast<const char*>(src) + r * src_stride_bytes, row_bytes);
    if (bound_m_dst == nullptr) return;
    *bound_m_dst = static_cast<int32_t>(m);
    if (m != *bound_m && error->code == 0) *error = {1, 0, *bound_m, rows};
  }
  LayerErrorRecord take_error(LayerErrorRecord* record, cudaStream_t) override {
    const LayerErrorRecord e = *record;
    *record = {};
    return e;
  }

  std::shared_ptr<Graph> capture(const std::function<void(cudaStream_t)>&) override {
    throw InvalidArgument("moelink: MoELayer: cuda_graphs needs a GPU backend");
  }
  void replay(Graph&, cudaStream_t) override {
    throw InvalidArgument("moelink: MoELayer: cuda_graphs needs a GPU backend");
  }

  void mark(int index, cudaStream_t) override {
    if (index >= static_cast<int>(marks_.size())) marks_.resize(index + 1);
    marks_[index] = std::chrono::steady_clock::now();
  }
  double between(int first, int second) override {
    if (first < 0 || second >= static_cast<int>(marks_.size())) return 0;
    return std::chrono::duration<double, std::micro>(marks_[second] - marks_[first]).count();
  }
  void sync(cudaStream_t) override {}

 private:
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

}  // namespace

std::unique_ptr<LayerDevice> make_cpu_layer_device() { return std::make_unique<CpuLayerDevice>(); }

}  // namespace moelink::detail::layer
