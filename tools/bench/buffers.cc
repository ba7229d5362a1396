#include "buffers.h"

namespace moelink_bench {

using moelink::DType;
using moelink::Tensor;

Buffers make_buffers(Platform& pl, const Workload& w) {
  const moelink::Config& c = w.config;
  const int64_t T = w.T, H = w.H, S = w.S, k = w.k, L = w.L, C = c.expert_capacity();
  Buffers b;
  b.x_mem = Mem(pl, w.x.size());
  pl.upload(b.x_mem.get(), w.x.data(), w.x.size());
  b.dp_x = Tensor::contiguous(b.x_mem.get(), c.in_dtype, {T, H});
  if (S > 0) {
    b.scale_mem = Mem(pl, w.scales.size() * 4);
    pl.upload(b.scale_mem.get(), w.scales.data(), w.scales.size() * 4);
    b.dp_x_scale = Tensor::contiguous(b.scale_mem.get(), DType::kFloat32, {T, S});
  }
  for (const RoutingSet& rs : w.pool) {
    RoutingTensors r;
    r.indices_mem = Mem(pl, rs.indices.size() * 4);
    r.weights_mem = Mem(pl, rs.weights.size() * 4);
    r.bound_mem = Mem(pl, 4);
    pl.upload(r.indices_mem.get(), rs.indices.data(), rs.indices.size() * 4);
    pl.upload(r.weights_mem.get(), rs.weights.data(), rs.weights.size() * 4);
    const int32_t m = static_cast<int32_t>(T);  // every token is valid
    pl.upload(r.bound_mem.get(), &m, 4);
    r.indices = Tensor::contiguous(r.indices_mem.get(), DType::kInt32, {T, k});
    r.weights = Tensor::contiguous(r.weights_mem.get(), DType::kFloat32, {T, k});
    r.bound_m = Tensor::contiguous(r.bound_mem.get(), DType::kInt32, {1});
    b.pool.push_back(std::move(r));
  }
  b.counts_mem = Mem(pl, L * 4);
  b.out_expert_num_tokens = Tensor::contiguous(b.counts_mem.get(), DType::kInt32, {L});
  b.ex_mem = Mem(pl, static_cast<size_t>(L * C * H) * w.in_bytes);
  b.out_expert_x = Tensor::contiguous(b.ex_mem.get(), c.in_dtype, {L, C, H});
  if (S > 0) {
    b.ex_scale_mem = Mem(pl, static_cast<size_t>(L * C * S) * 4);
    b.out_expert_x_scale = Tensor::contiguous(b.ex_scale_mem.get(), DType::kFloat32, {L, C, S});
  }
  b.y_mem = Mem(pl, static_cast<size_t>(L * C * H) * 2);
  b.expert_y = Tensor::contiguous(b.y_mem.get(), DType::kBFloat16, {L, C, H});
  b.out_mem = Mem(pl, static_cast<size_t>(T * H) * w.out_bytes);
  b.out_tokens = Tensor::contiguous(b.out_mem.get(), c.out_dtype, {T, H});
  return b;
}

IdentityExperts identity_of(const Buffers& b, const Workload& w, const int32_t* counts) {
  IdentityExperts e;
  e.x = b.out_expert_x.data;
  e.scales = static_cast<const float*>(b.out_expert_x_scale.data);
  e.counts = counts;
  e.y = static_cast<uint16_t*>(b.expert_y.data);
  e.L = w.L;
  e.S = w.S;
  e.C = w.config.expert_capacity();
  e.H = w.H;
  e.in_dtype = w.config.in_dtype;
  return e;
}

}  // namespace moelink_bench
