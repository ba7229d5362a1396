// CUDA kernels of the model's own steps (model_kernels.h).
#include <cstring>

#include "model/cuda/model_kernels.h"
#include "model/draft_rules.h"
#include "model/sampling.h"
#include "nvlink/cuda_check.h"
#include "nvlink/reductions.cuh"

namespace moelink::detail::model {

namespace {

// The first error of a step (whichever block gets there first).
__device__ void record(ModelErrorRecord* e, int32_t code, int32_t field, int64_t row, double value,
                       int64_t limit) {
  if (atomicCAS(&e->code, 0, code) == 0) {
    e->field = field;
    e->row = row;
    e->value = value;
    e->limit = limit;
  }
}

__global__ void step_rows_kernel(const int32_t* q_start, int num_requests, int64_t n, int32_t* rows) {
  const int32_t last = q_start[num_requests];
  *rows = last >= 0 && last <= n ? last : 0;
}

__global__ void rebase_offsets_kernel(int32_t* dst, const int32_t* src, int first, int count) {
  const int32_t base = src[first];
  for (int i = threadIdx.x; i <= count; i += blockDim.x) dst[i] = src[first + i] - base;
}

__global__ void move_rows_kernel(uint16_t* part, int64_t part_stride, uint16_t* whole, int64_t whole_stride,
                                 int64_t D, const int32_t* first, const int32_t* count, bool into_part) {
  const int64_t r = blockIdx.x;
  if (r >= *count) return;
  uint16_t* p = part + r * part_stride;
  uint16_t* w = whole + (static_cast<int64_t>(*first) + r) * whole_stride;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    if (into_part)
      p[d] = w[d];
    else
      w[d] = p[d];
  }
}

__global__ void embed_kernel(uint16_t* h, int64_t h_stride, int64_t D, const int32_t* ids, int64_t ids_stride,
                             const uint16_t* table, int64_t vocab, const int32_t* rows, ModelErrorRecord* error) {
  const int64_t r = blockIdx.x;
  if (r >= *rows) return;
  const int32_t id = ids[r * ids_stride];
  uint16_t* out = h + r * h_stride;
  const bool bad = id < 0 || id >= vocab;
  if (bad && threadIdx.x == 0) record(error, 1, 0, r, id, vocab);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) out[d] = bad ? 0 : table[static_cast<int64_t>(id) * D + d];
}

__global__ void gather_rows_kernel(uint16_t* dst, const uint16_t* h, int64_t h_stride, int64_t D,
                                   const int32_t* rows, const int32_t* row_index, int64_t first, int32_t* valid) {
  const int64_t j = blockIdx.x;
  const int64_t r = row_index != nullptr ? row_index[j] : first + j;
  const bool ok = r >= 0 && r < *rows;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dst[j * D + d] = ok ? h[r * h_stride + d] : 0;
  if (threadIdx.x == 0) valid[j] = ok;
}

// Row j's values on kCopyChunks blocks, in units of Unit (float4 where the
// rows allow it), four loads in flight a thread (one at a time, the copy of
// a 129280-wide row took 180 us).
constexpr int kCopyChunks = 16;
template <class Unit>
__global__ void copy_valid_rows_kernel(Unit* dst, int64_t dst_stride, const Unit* src, int64_t V,
                                       const int32_t* valid) {
  const int64_t j = blockIdx.x;
  if (!valid[j]) return;
  const int64_t per_block = (V + kCopyChunks - 1) / kCopyChunks, begin = blockIdx.y * per_block,
                end = min(V, begin + per_block);
  for (int64_t v0 = begin + threadIdx.x; v0 < end; v0 += 4 * blockDim.x) {
    Unit u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (v0 + k * blockDim.x < end) u[k] = src[j * V + v0 + k * blockDim.x];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (v0 + k * blockDim.x < end) dst[j * dst_stride + v0 + k * blockDim.x] = u[k];
  }
}

// ------------------------------------------------------------------ sampling

// Sort keys (shuffles and atomics take unsigned long long).
using Key = unsigned long long;

// A key per vocabulary entry that orders as the host loop does: larger
// logit first, then the smaller index.
__device__ __forceinline__ Key key_of(const float* l, int64_t j) {
  const uint32_t u = __float_as_uint(l[j]);
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<Key>(ordered) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
}
__device__ __forceinline__ int32_t index_of(Key key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

// The largest key T such that pred(T) holds, for a predicate that holds at
// 0 and stops holding as T grows (bit by bit from the top).
template <class Pred>
__device__ Key largest_key(Pred pred) {
  Key t = 0;
  for (int bit = 63; bit >= 0; --bit) {
    const Key c = t | (Key{1} << bit);
    if (pred(c)) t = c;
  }
  return t;
}

__global__ void plan_samples_kernel(const int32_t* q_start, const int32_t* kv_len, const int32_t* num_drafts,
                                    int num_requests, int slots, const int32_t* rows, int32_t* row_index,
                                    int32_t* position, ModelErrorRecord* error) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num_requests) return;
  if (plan_request_samples(q_start, kv_len, num_drafts, i, slots, *rows, row_index, position).bad_drafts)
    record(error, 3, 0, i, num_drafts[i], max(0, min(slots - 1, q_start[i + 1] - q_start[i] - 1)));
}

// One block per slot: the top_k set (keys >= kth), its weights, the top_p
// cut (keys >= cut), the draw; each a block-wide bisection over keys.
__global__ void __launch_bounds__(1024) sample_kernel(SampleArgs a) {
  const int64_t j = blockIdx.x, i = j / a.slots_per_request;
  int32_t& tok = a.tokens[j * a.tokens_stride];
  if (a.row_index[j] < 0) {
    if (threadIdx.x == 0) tok = -1;
    return;
  }
  const float t = a.temperature ? a.temperature[i] : 0.0f;
  const int32_t k = a.top_k ? a.top_k[i] : 0;
  const float tp = a.top_p ? a.top_p[i] : 1.0f;
  if (!(t >= 0.0f) || k < 0 || !(tp > 0.0f && tp <= 1.0f)) {
    if (threadIdx.x == 0) {
      const int field = !(t >= 0.0f) ? 0 : k < 0 ? 1 : 2;
      record(a.error, 2, field, i, field == 0 ? t : field == 1 ? k : tp, 0);
      tok = -1;
    }
    return;
  }
  const float* l = a.logits + j * a.logits_stride;
  const int64_t V = a.vocab;
  __shared__ Key shared_keys[32];
  __shared__ double shared_sums[32];
  Key top = 0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) top = Max{}(top, key_of(l, j));
  top = block_reduce(top, Max{}, shared_keys);
  if (t == 0.0f) {  // greedy: the first largest
    if (threadIdx.x == 0) tok = index_of(top);
    return;
  }
  const float m = l[index_of(top)];
  auto count_from = [&](Key c) {
    Key n = 0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) n += key_of(l, j) >= c;
    return block_reduce(n, Sum{}, shared_keys);
  };
  const Key kth = k > 0 && k < V ? largest_key([&](Key c) { return count_from(c) >= static_cast<Key>(k); }) : 0;
  // Weights over the keys >= `from`, as the host loop computes them.
  auto mass_from = [&](Key from) {
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
      if (key_of(l, j) >= from) s += static_cast<double>(expf((l[j] - m) / t));
    return block_reduce(s, Sum{}, shared_sums);
  };
  const double sum = mass_from(kth);
  const Key cut = tp < 1.0f ? largest_key([&](Key c) { return mass_from(Max{}(c, kth)) / sum >= tp; })
                                 : kth;
  const double total = mass_from(cut);
  const double u = sample_uniform(a.seed ? a.seed[i] : 0, a.position[j]) * total;
  Key pick;
  if (total > u) {
    pick = largest_key([&](Key c) { return mass_from(Max{}(c, cut)) > u; });
  } else {  // rounding left u at the end: the cut set's last entry
    Key low = ~Key{0};
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const Key key = key_of(l, j);
      if (key >= cut) low = Min{}(low, key);
    }
    pick = block_reduce(low, Min{}, shared_keys);
  }
  if (threadIdx.x == 0) tok = index_of(pick);
}

__global__ void accept_drafts_kernel(AcceptArgs a) {
  const int i = blockIdx.x;
  const int32_t* slot_rows = a.row_index + i * a.slots;
  const int32_t* slot_tokens = a.samples + i * a.slots;
  const int32_t acc = accepted_drafts(slot_tokens, slot_rows, a.slots, a.ids, a.ids_stride);
  const int32_t first = slot_rows[0], last = a.q_start[i + 1] - 1;
  if (threadIdx.x == 0) {
    a.next_tokens[i * a.next_stride] = first < 0 ? -1 : slot_tokens[acc];
    if (a.accepted) a.accepted[i] = acc;
    if (a.mtp_tokens) a.draft_row[i] = first < 0 ? -1 : first + acc;
  }
  if (!a.mtp_tokens || first < 0) return;  // plan_samples kept its rows below rows
  const int32_t known = a.known_next && last == first ? a.known_next[i] : -1;
  for (int64_t r = a.q_start[i] + threadIdx.x; r <= last; r += blockDim.x)
    a.mtp_tokens[r] = mtp_input_token(r, first, last, a.ids, a.ids_stride, slot_tokens, known);
}

unsigned grid(int64_t n) { return static_cast<unsigned>(n > 0 ? n : 1); }

}  // namespace

void launch_step_rows(const int32_t* q_start, int num_requests, int64_t n, int32_t* rows, cudaStream_t stream) {
  step_rows_kernel<<<1, 1, 0, stream>>>(q_start, num_requests, n, rows);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_rebase_offsets(int32_t* dst, const int32_t* src, int first, int count, cudaStream_t stream) {
  rebase_offsets_kernel<<<1, 128, 0, stream>>>(dst, src, first, count);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_move_rows(uint16_t* part, int64_t part_stride, int64_t max_rows, uint16_t* whole, int64_t whole_stride,
                      int64_t D, const int32_t* first, const int32_t* count, bool into_part, cudaStream_t stream) {
  move_rows_kernel<<<grid(max_rows), 256, 0, stream>>>(part, part_stride, whole, whole_stride, D, first, count,
                                                       into_part);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_embed(uint16_t* h, int64_t h_stride, int64_t D, const int32_t* ids, int64_t ids_stride,
                  const uint16_t* table, int64_t vocab, const int32_t* rows, int64_t max_rows,
                  ModelErrorRecord* error, cudaStream_t stream) {
  if (max_rows == 0) return;
  embed_kernel<<<grid(max_rows), 256, 0, stream>>>(h, h_stride, D, ids, ids_stride, table, vocab, rows, error);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_gather_rows(uint16_t* dst, const uint16_t* h, int64_t h_stride, int64_t D, const int32_t* rows,
                        const int32_t* row_index, int64_t first, int64_t k, int32_t* valid, cudaStream_t stream) {
  if (k == 0) return;
  gather_rows_kernel<<<grid(k), 256, 0, stream>>>(dst, h, h_stride, D, rows, row_index, first, valid);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_copy_valid_rows(float* dst, int64_t dst_stride, const float* src, int64_t V, const int32_t* valid,
                            int64_t k, cudaStream_t stream) {
  if (k == 0) return;
  const dim3 blocks(grid(k), kCopyChunks);
  if (V % 4 == 0 && dst_stride % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src) % 16 == 0)
    copy_valid_rows_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<float4*>(dst), dst_stride / 4,
                                                        reinterpret_cast<const float4*>(src), V / 4, valid);
  else
    copy_valid_rows_kernel<<<blocks, 256, 0, stream>>>(dst, dst_stride, src, V, valid);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_plan_samples(const int32_t* q_start, const int32_t* kv_len, const int32_t* num_drafts,
                         int num_requests, int slots, const int32_t* rows, int32_t* row_index,
                         int32_t* position, ModelErrorRecord* error, cudaStream_t stream) {
  if (num_requests == 0) return;
  plan_samples_kernel<<<(num_requests + 127) / 128, 128, 0, stream>>>(q_start, kv_len, num_drafts, num_requests,
                                                                      slots, rows, row_index, position, error);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_sample(const SampleArgs& a, cudaStream_t stream) {
  if (a.slots == 0) return;
  sample_kernel<<<static_cast<unsigned>(a.slots), 1024, 0, stream>>>(a);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_accept_drafts(const AcceptArgs& a, cudaStream_t stream) {
  if (a.num_requests == 0) return;
  accept_drafts_kernel<<<a.num_requests, 256, 0, stream>>>(a);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail::model
