// Where a MoELayer's memory lives and how its own small steps run: host
// loops for the host backends (cpu, internode-cpu), CUDA otherwise. The
// heavy steps (quantization, expert GEMMs, dispatch, combine) are Experts'
// and AllToAll's; these are the rest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/device_memory.h"
#include "layer/router.h"
#include "moelink/types.h"

namespace moelink::detail::layer {

// What the layer's own kernels saw wrong in their input, in the layer's
// memory (a `code` of 0 is none): so far only a bound_m outside [0, rows]
// of the caller's x when forward() stages it for a CUDA graph (eager calls
// have it reported by the Experts and the AllToAll that read it).
struct LayerErrorRecord {
  int32_t code;  // 1: bound_m out of range; the first writer wins
  int32_t reserved;
  int64_t value;  // bound_m
  int64_t limit;  // the rows of x
};

class LayerDevice : public DeviceMemory {
 public:
  // logits [rows, E] fp32 = x [rows, H] bf16 . gate[E, H]^T (gate bf16 or
  // fp32, as stored), for rows < min(m, rows) at least (m = bound_m[0]).
  // x_f32: scratch of rows * H floats for an fp32 gate.
  virtual void gate_logits(float* logits, const Tensor& x, const void* gate, DType gate_dtype,
                           int num_experts, const int32_t* bound_m, float* x_f32,
                           cudaStream_t stream) = 0;
  // router.h for rows < min(m, rows).
  virtual void route(const float* logits, const float* bias, const RouterParams& p,
                     const int32_t* bound_m, int64_t rows, int32_t* indices, float* weights,
                     cudaStream_t stream) = 0;
  // m = clamp(bound_m[0], 0, rows): m0 = min(m, half), m1 = m - m0.
  virtual void split_bound(const int32_t* bound_m, int64_t rows, int64_t half, int32_t* m0,
                           int32_t* m1, cudaStream_t stream) = 0;
  // The first m = clamp(bound_m[0], 0, rows) rows of src into dst: the
  // CUDA-graph staging copies. When bound_m_dst is non-null, m goes there
  // too, and a bound_m outside [0, rows] is recorded in `error`.
  virtual void copy_rows(void* dst, int64_t dst_stride_bytes, const void* src,
                         int64_t src_stride_bytes, int64_t row_bytes, const int32_t* bound_m,
                         int64_t rows, int32_t* bound_m_dst, LayerErrorRecord* error,
                         cudaStream_t stream) = 0;
  // Waits for the work on `stream`, returns the record and clears it (an
  // empty record inside a CUDA-graph capture).
  virtual LayerErrorRecord take_error(LayerErrorRecord* record, cudaStream_t stream) = 0;

  // CUDA graphs (GPU only; the host device throws InvalidArgument): what
  // `record` issues on the stream it is given becomes one executable graph.
  // The capture runs on a stream of the device's own, so that callers on
  // the legacy default stream (which cannot be captured) get graphs too.
  struct Graph;
  virtual std::shared_ptr<Graph> capture(const std::function<void(cudaStream_t)>& record) = 0;
  virtual void replay(Graph& g, cudaStream_t stream) = 0;

  // Stage timing (profile): marks the stream at stage boundaries; the
  // durations between consecutive marks of the last round, in microseconds.
  virtual void mark(int index, cudaStream_t stream) = 0;
  virtual double between(int first, int second) = 0;  // waits for the marks
  virtual void sync(cudaStream_t stream) = 0;
};

std::unique_ptr<LayerDevice> make_cpu_layer_device();
// Throws InvalidArgument in a build without CUDA.
std::unique_ptr<LayerDevice> make_cuda_layer_device();

}  // namespace moelink::detail::layer
