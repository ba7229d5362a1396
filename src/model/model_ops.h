// The model's own steps between its parts (MLAAttention, MoELayer, the dense
// MLP's Experts): embedding, residual add with RMSNorm, lm_head, sampling;
// host loops (cpu_model_ops.cc) or CUDA kernels. Rows r < rows[0] only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/device_memory.h"
#include "moelink/types.h"

namespace moelink::detail::model {

// What the model's steps saw wrong in their input (a token id outside the
// vocabulary, sampling parameters out of range); the first one is kept.
struct ModelErrorRecord {
  // 1: token_ids[row] = value outside [0, limit); 2: sampling field of
  // request row; 3: num_drafts[row] = value outside [0, limit].
  int32_t code;
  int32_t field;  // code 2: 0 temperature, 1 top_k, 2 top_p
  int64_t row;
  double value;
  int64_t limit;
};

class ModelOps : public DeviceMemory {
 public:
  // dst = src (bytes), in stream order.
  virtual void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) = 0;
  // Waits for the work on `stream`.
  virtual void sync(cudaStream_t stream) = 0;

  // rows[0] = q_start[B] when it lies in [0, n], else 0: the rows every
  // step of the model touches (MLAAttention reports a bad q_start itself).
  virtual void step_rows(const int32_t* q_start, int num_requests, int64_t n, int32_t* rows,
                         cudaStream_t stream) = 0;
  // dst[i] = src[first + i] - src[first] for i in [0, count]: the q_start
  // of requests first .. first + count - 1 alone (a micro-batch's).
  virtual void rebase_offsets(int32_t* dst, const int32_t* src, int first, int count, cudaStream_t stream) = 0;
  // Rows [0, count[0]) of `part` and rows [first[0], first[0] + count[0]) of
  // `whole` (bf16 [*, D], each its own row stride; at most part's rows):
  // into_part, part's = whole's; else whole's = part's. A micro-batch's rows
  // into buffers of its own and back, the offset and count read where the
  // step runs (a graph replays them for new ones).
  virtual void move_rows(const Tensor& part, const Tensor& whole, const int32_t* first, const int32_t* count,
                         bool into_part, cudaStream_t stream) = 0;
  // h [*, D] bf16 = table [V, D] bf16 rows of token_ids [*] (a bad id gives
  // a zero row and an error).
  virtual void embed(const Tensor& h, const Tensor& token_ids, const uint16_t* table, int64_t vocab,
                     const int32_t* rows, ModelErrorRecord* error, cudaStream_t stream) = 0;
  // h += x (bf16, rounded once); normed = bf16(rmsnorm(h) * weight).
  // x undefined: the norm alone; weight null: the add alone.
  virtual void add_rms_norm(const Tensor& h, const Tensor& x, const Tensor& normed, const float* weight,
                            float eps, const int32_t* rows, cudaStream_t stream) = 0;
  // out [*, N] bf16 = x [*, K] bf16 . W^T (W [N, K] bf16, fp32
  // accumulation, rounded once) for rows r < rows (the MTP module's eh_proj).
  virtual void linear(const Tensor& out, const Tensor& x, const uint16_t* weight, const int32_t* rows,
                      cudaStream_t stream) = 0;
  // logits [k, V] fp32 = h[row_index[j]] . W^T (W [V, D] bf16, fp32
  // accumulation); row_index null: every row r < rows (k = logits' rows).
  // A row_index[j] outside [0, rows) leaves logits row j as it was.
  virtual void lm_head(const Tensor& logits, const Tensor& h, const uint16_t* weight, int64_t vocab,
                       const int32_t* rows, const int32_t* row_index, cudaStream_t stream) = 0;

  // The rows a step samples: request i's last num_drafts[i] + 1 rows
  // (num_drafts null: 0), slots_per_request slots each (slot s of request i
  // at j = i * slots_per_request + s): row_index[j] (-1 past them, for an
  // empty request or one whose rows pass `rows`) and position[j] (the row's position in its sequence,
  // kv_len[i] - q_end + row). A num_drafts[i] outside [0, min(slots - 1,
  // q_len - 1)] is recorded (code 3) and read as 0.
  virtual void plan_samples(const int32_t* q_start, const int32_t* kv_len, const int32_t* num_drafts,
                            int num_requests, int slots_per_request, const int32_t* rows, int32_t* row_index,
                            int32_t* position, ModelErrorRecord* error, cudaStream_t stream) = 0;
  // tokens [k] int32 from logits [k, V] (sampling.h's rule at position[j];
  // -1 where row_index[j] < 0); slot j belongs to request j /
  // slots_per_request, whose params apply (undefined: greedy).
  virtual void sample(const Tensor& tokens, const Tensor& logits, const Tensor& temperature,
                      const Tensor& top_k, const Tensor& top_p, const Tensor& seed, const int32_t* row_index,
                      const int32_t* position, int slots_per_request, ModelErrorRecord* error,
                      cudaStream_t stream) = 0;
  // Draft verification (plan_samples' slots, with their sampled tokens):
  // request i accepts its drafts while the token sampled before each equals
  // it (token_ids of its draft rows); next_tokens[i] = the sample after the
  // last accepted one; accepted[i] = how many (null: not written). With
  // mtp_tokens: the token that follows each row r < rows, the MTP module's
  // input (the next row's token id within a request's rows before its
  // samples, the sampled ones from there, known_next[i] >= 0 in place of
  // the last row's sample where given), and draft_row[i] = the row whose
  // MTP output proposes request i's next draft (-1 for an empty request).
  virtual void accept_drafts(const int32_t* samples, const int32_t* row_index, int slots_per_request,
                             const Tensor& token_ids, const int32_t* q_start, const int32_t* known_next,
                             int num_requests, int32_t* next_tokens, int64_t next_stride, int32_t* accepted, int32_t* mtp_tokens,
                             int32_t* draft_row, cudaStream_t stream) = 0;
  virtual ModelErrorRecord take_error(ModelErrorRecord* record, cudaStream_t stream) = 0;
  // Runs `check`, which reads the step's error records (the model's and its
  // layers'): on the GPU with the records gathered in one copy and one wait
  // first (nvlink/error_record_batch.h); on the host as it is.
  virtual void run_check(cudaStream_t stream, const std::function<void()>& check) = 0;

  // CUDA graphs (GPU only; the host ops throw InvalidArgument): what
  // `record` issues on the stream it is given (one of the ops' own) becomes
  // one executable graph, replayed on any stream.
  struct Graph;
  virtual std::shared_ptr<Graph> capture(const std::function<void(cudaStream_t)>& record) = 0;
  virtual void replay(Graph& g, cudaStream_t stream) = 0;
};

std::unique_ptr<ModelOps> make_cpu_model_ops();
// Throws InvalidArgument in a build without CUDA.
std::unique_ptr<ModelOps> make_cuda_model_ops();

}  // namespace moelink::detail::model
