// CUDA kernels of the attention steps (attention_kernels.h). The decode and
// prefill attention here are plain warp-per-key online-softmax kernels: the
// contract's correctness on the GPU, the reference the faster kernels
// (FlashInfer's MLA, moelink's own decode kernel) are checked against.
#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "attention/cuda/attention_kernels.h"
#include "attention/rope.h"
#include "attention/step_plan.h"
#include "nvlink/bf16_bits.cuh"
#include "nvlink/cuda_check.h"
#include "nvlink/reductions.cuh"

namespace moelink::detail::attention {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Limits of the attention kernels' per-lane registers and shared memory:
// the latent (R) up to 512, the rotary dims up to 256, v_head_dim up to 256.
constexpr int kMaxLatent = 512, kMaxRope = 256, kMaxV = 256;

__device__ __forceinline__ float f32(uint16_t h) { return bf16_bits_to_f32(h); }
__device__ __forceinline__ uint16_t bf16(float v) { return f32_to_bf16_bits(v); }

// ------------------------------------------------------------------ plan

// One block of kPlanThreads: the rows' requests and positions; the first
// failing entry or request (in order, as the host loop finds it) is the one
// recorded. In parallel: q_start's entries a thread each, a request's
// pages a warp each (one thread walking them all took ~40 us at 128
// requests of 5000 tokens, in every layer); the recording itself runs the
// host loop's check on the first failure alone.
constexpr int kPlanThreads = 1024;
__global__ void __launch_bounds__(kPlanThreads)
    plan_step_kernel(const int32_t* q_start, const int32_t* kv_len, const int32_t* block_table,
                     int64_t block_stride, int num_requests, int num_decode, int64_t n, StepBounds bounds,
                     int local_heads, RowPlan plan, StepErrorRecord* error) {
  __shared__ int64_t rows;
  __shared__ int first_bad_entry, first_bad;
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) plan.request[r] = -1, plan.position[r] = 0;
  if (threadIdx.x == 0) first_bad_entry = first_bad = INT_MAX;
  __syncthreads();
  for (int j = threadIdx.x; j <= num_requests; j += blockDim.x) {
    int64_t value, limit;
    if (q_start_entry(q_start, j, num_decode, n, &value, &limit) != StepError::kOk) atomicMin(&first_bad_entry, j);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t value = 0, limit = 0;
    const int j = first_bad_entry;
    const StepError code = j == INT_MAX ? StepError::kOk : q_start_entry(q_start, j, num_decode, n, &value, &limit);
    if (code != StepError::kOk) record_step_error(error, code, q_start_entry_request(code, j), 0, value, limit);
    rows = code == StepError::kOk ? q_start[num_requests] : 0;
    *plan.rows = static_cast<int32_t>(rows);
  }
  __syncthreads();
  const int32_t decode_rows = rows > 0 ? q_start[num_decode] : 0;
  for (int h = threadIdx.x; h < local_heads; h += blockDim.x) plan.decode_rows[h] = decode_rows;
  if (rows == 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int i = warp; i < num_requests; i += warps) {  // uniform in the warp
    StepErrorRecord unused{};
    bool ok = request_length_ok(i, q_start, kv_len, bounds, &unused);
    if (ok) {
      const int32_t* block_row = block_table + i * block_stride;
      const int64_t pages = request_pages(kv_len[i], bounds);
      bool bad = false;
      for (int64_t p = lane; p < pages; p += 32) bad |= !page_id_ok(block_row[p], bounds);
      ok = !__any_sync(0xffffffffu, bad);
    }
    if (!ok) {
      if (lane == 0) atomicMin(&first_bad, i);
      continue;
    }
    const int32_t q0 = q_start[i], q_len = q_start[i + 1] - q0;
    for (int32_t j = lane; j < q_len; j += 32) {
      plan.request[q0 + j] = i;
      plan.position[q0 + j] = kv_len[i] - q_len + j;
    }
  }
  __syncthreads();
  const int i = first_bad;
  if (threadIdx.x == 0 && i != INT_MAX)
    request_ok(i, q_start, kv_len, block_table + i * block_stride, bounds, error);
}

// ------------------------------------------------------------------ norms, RoPE, cache rows

// Rotates `dims` bf16 values in place (rope.h's rotation).
__device__ void rope_bf16(uint16_t* p, int dims, int32_t pos, const RopeArgs& rope) {
  float v[kMaxRope];
  for (int d = 0; d < dims; ++d) v[d] = f32(p[d]);
  rope_rotate(v, dims, pos, rope.inv_freq, rope.attention_factor, rope.interleaved);
  for (int d = 0; d < dims; ++d) p[d] = bf16(v[d]);
}

// Grid-stride kernels over the step's rows, read on the device: the head
// copies on a fixed grid, whatever the rows their buffers could hold (a grid
// of max rows x heads blocks, most of them returning at once, took 20 us a
// call at one row); RoPE on one sized by the rows of q, capped.
constexpr unsigned kStrideBlocks = 512, kStrideThreads = 256;
constexpr int64_t kRopeMaxBlocks = 4096;

// One thread a (row, head, rotary pair) of the query rows the plan keeps.
__global__ void rope_q_kernel(uint16_t* q, int64_t q_stride, int heads, int head_dim, int rope_dims,
                              RowPlan plan, int64_t max_rows, RopeArgs rope) {
  const int half = rope_dims / 2;
  const int64_t per_row = int64_t{heads} * half, items = min(static_cast<int64_t>(*plan.rows), max_rows) * per_row;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < items;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / per_row;
    if (plan.request[r] < 0) continue;
    const int h = static_cast<int>(t % per_row / half), i = static_cast<int>(t % half);
    int a, b;
    rope_pair(i, rope_dims, rope.interleaved, &a, &b);
    uint16_t* p = q + r * q_stride + static_cast<int64_t>(h) * head_dim + (head_dim - rope_dims);
    float x = f32(p[a]), y = f32(p[b]);
    rope_rotate_pair(&x, &y, i, plan.position[r], rope.inv_freq, rope.attention_factor);
    p[a] = bf16(x);
    p[b] = bf16(y);
  }
}

__global__ void append_kv_kernel(uint16_t* cache, int page_size, const uint16_t* latent,
                                 int64_t latent_stride, int R, const uint16_t* kpe, int64_t kpe_stride,
                                 int Dr, const int32_t* block_table, int64_t block_stride, RowPlan plan,
                                 RopeArgs rope) {
  const int64_t r = blockIdx.x;
  if (r >= *plan.rows) return;
  const int32_t i = plan.request[r];
  if (i < 0) return;
  const int32_t pos = plan.position[r];
  const int64_t page = block_table[i * block_stride + pos / page_size];
  uint16_t* row = cache + (page * page_size + pos % page_size) * (R + Dr);
  for (int d = threadIdx.x; d < R; d += blockDim.x) row[d] = latent[r * latent_stride + d];
  for (int d = threadIdx.x; d < Dr; d += blockDim.x) row[R + d] = kpe[r * kpe_stride + d];
  __syncthreads();
  if (threadIdx.x == 0) rope_bf16(row + R, Dr, pos, rope);
}

// Rows r < min(*rows, max_rows) of `heads` blocks of `width` values each, element (r, h, c)
// at r * row + h * head + c on either side, in units of Unit (16-byte
// vectors of 8 bf16 where everything is aligned to them, else single
// values); four units in flight a thread.
struct HeadRows {
  int64_t row, head;  // strides, in units
};
template <class Unit>
__global__ void copy_head_rows_kernel(Unit* dst, HeadRows d, const Unit* src, HeadRows s, int heads,
                                      int64_t width, const int32_t* rows, int64_t max_rows) {
  const int64_t per_row = heads * width, items = min(static_cast<int64_t>(*rows), max_rows) * per_row,
                stride = int64_t{gridDim.x} * blockDim.x;
  auto at = [&](int64_t t, const HeadRows& o) {
    return t / per_row * o.row + t % per_row / width * o.head + t % width;
  };
  for (int64_t t0 = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t0 < items; t0 += 4 * stride) {
    Unit v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (t0 + k * stride < items) v[k] = src[at(t0 + k * stride, s)];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (t0 + k * stride < items) dst[at(t0 + k * stride, d)] = v[k];
  }
}

void launch_copy_head_rows(uint16_t* dst, HeadRows d, const uint16_t* src, HeadRows s, int heads, int64_t width,
                           const int32_t* rows, int64_t max_rows, cudaStream_t stream) {
  auto fits = [](const void* p, const HeadRows& o) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && o.row % 8 == 0 && o.head % 8 == 0;
  };
  if (width % 8 == 0 && fits(dst, d) && fits(src, s)) {
    copy_head_rows_kernel<<<kStrideBlocks, kStrideThreads, 0, stream>>>(
        reinterpret_cast<uint4*>(dst), HeadRows{d.row / 8, d.head / 8}, reinterpret_cast<const uint4*>(src),
        HeadRows{s.row / 8, s.head / 8}, heads, width / 8, rows, max_rows);
  } else {
    copy_head_rows_kernel<<<kStrideBlocks, kStrideThreads, 0, stream>>>(dst, d, src, s, heads, width, rows,
                                                                         max_rows);
  }
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

// ------------------------------------------------------------------ online softmax

// One warp's running softmax over the keys it saw: max, sum and the
// weighted values, kPerLane of them on each lane (value d = lane + 32 k).
template <int kPerLane>
struct WarpSoftmax {
  float max = -INFINITY, sum = 0.0f, acc[kPerLane] = {};
  // Folds in a key of `score` whose values are v[lane + 32 k], k < per_lane.
  __device__ void add(float score, const uint16_t* v, int per_lane) {
    const float m = fmaxf(max, score), carry = expf(max - m), p = expf(score - m);
    sum = sum * carry + p;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (k < per_lane) acc[k] = acc[k] * carry + p * f32(v[(threadIdx.x & 31) + 32 * k]);
    max = m;
  }
};

// The block's warps' states merged: (max, sum) in `stats`, the values in
// `values` [width] (shared memory, fp32), all normalized to the common max.
template <int kPerLane>
__device__ void merge_warps(const WarpSoftmax<kPerLane>& w, int width, float* shared_acc,
                            float* shared_stats, float* block_max, float* block_sum, float* values) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int k = 0; k < kPerLane && lane + 32 * k < width; ++k) shared_acc[warp * width + lane + 32 * k] = w.acc[k];
  if (lane == 0) shared_stats[2 * warp] = w.max, shared_stats[2 * warp + 1] = w.sum;
  __syncthreads();
  float m = -INFINITY;
  for (int i = 0; i < kWarps; ++i) m = fmaxf(m, shared_stats[2 * i]);
  float s = 0.0f;
  for (int i = 0; i < kWarps; ++i)
    if (shared_stats[2 * i] > -INFINITY) s += shared_stats[2 * i + 1] * expf(shared_stats[2 * i] - m);
  for (int d = threadIdx.x; d < width; d += blockDim.x) {
    float v = 0.0f;
    for (int i = 0; i < kWarps; ++i)
      if (shared_stats[2 * i] > -INFINITY) v += shared_acc[i * width + d] * expf(shared_stats[2 * i] - m);
    values[d] = v;
  }
  *block_max = m;
  *block_sum = s;
  __syncthreads();
}

// Decode: block (row, head); warp w takes keys w, w + 4, ...; scores over
// the latent and the rotary dims of each cache row, values the latent.
__global__ void decode_attention_kernel(uint16_t* out_latent, const uint16_t* q_latent, int64_t Nd,
                                        int R, const uint16_t* q, int64_t q_stride, int head_dim,
                                        int nope_dims, const uint16_t* cache, int page_size, int Dr,
                                        const int32_t* block_table, int64_t block_stride, RowPlan plan,
                                        float scale) {
  const int64_t r = blockIdx.x, h = blockIdx.y;
  if (r >= plan.decode_rows[0]) return;
  uint16_t* out = out_latent + (h * Nd + r) * R;
  const int32_t i = plan.request[r];
  if (i < 0) {
    for (int d = threadIdx.x; d < R; d += blockDim.x) out[d] = 0;
    return;
  }
  __shared__ float qs[kMaxLatent + kMaxRope];
  __shared__ float shared_acc[kWarps * kMaxLatent];
  __shared__ float shared_stats[2 * kWarps];
  __shared__ float values[kMaxLatent];
  const int Dc = R + Dr;
  for (int d = threadIdx.x; d < R; d += blockDim.x) qs[d] = f32(q_latent[(h * Nd + r) * R + d]);
  for (int d = threadIdx.x; d < Dr; d += blockDim.x) qs[R + d] = f32(q[r * q_stride + h * head_dim + nope_dims + d]);
  __syncthreads();
  const int64_t keys = plan.position[r] + 1;
  const int32_t* block_row = block_table + i * block_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  WarpSoftmax<kMaxLatent / 32> w;
  for (int64_t s = warp; s < keys; s += kWarps) {
    const uint16_t* k = cache + (static_cast<int64_t>(block_row[s / page_size]) * page_size + s % page_size) * Dc;
    float dot = 0.0f;
    for (int d = lane; d < Dc; d += 32) dot += qs[d] * f32(k[d]);
    w.add(warp_sum(dot) * scale, k, R / 32);
  }
  float m, sum;
  merge_warps(w, R, shared_acc, shared_stats, &m, &sum, values);
  for (int d = threadIdx.x; d < R; d += blockDim.x) out[d] = bf16(values[d] / sum);
}

// Prefill: block (query row, head) over one chunk of keys, folded into the
// request's running softmax in global memory.
__global__ void prefill_chunk_kernel(PrefillSoftmax st, const uint16_t* q, int64_t q_stride,
                                     int64_t q_row0, int64_t q_pos0, const uint16_t* kv,
                                     int64_t kv_stride, const uint16_t* k_pe, int64_t kpe_stride,
                                     int64_t keys, int64_t k_pos0, int nope_dims, int rope_dims,
                                     float scale) {
  const int64_t j = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t visible = min(keys, q_pos0 + j - k_pos0 + 1);  // causal
  if (visible <= 0) return;
  const int head_dim = nope_dims + rope_dims, v_dims = st.v_dims, kv_head = nope_dims + v_dims;
  __shared__ float qs[kMaxLatent];
  __shared__ float shared_acc[kWarps * kMaxV];
  __shared__ float shared_stats[2 * kWarps];
  __shared__ float values[kMaxV];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
    qs[d] = f32(q[(q_row0 + j) * q_stride + static_cast<int64_t>(h) * head_dim + d]);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  WarpSoftmax<kMaxV / 32> w;
  for (int64_t s = warp; s < visible; s += kWarps) {
    const uint16_t* k = kv + s * kv_stride + static_cast<int64_t>(h) * kv_head;
    const uint16_t* kr = k_pe + s * kpe_stride;
    float dot = 0.0f;
    for (int d = lane; d < head_dim; d += 32) dot += qs[d] * (d < nope_dims ? f32(k[d]) : f32(kr[d - nope_dims]));
    w.add(warp_sum(dot) * scale, k + nope_dims, v_dims / 32);
  }
  float m, sum;
  merge_warps(w, v_dims, shared_acc, shared_stats, &m, &sum, values);
  const int64_t at = j * st.heads + h;
  const float old_max = st.max[at], new_max = fmaxf(old_max, m);
  const float keep = expf(old_max - new_max), add = expf(m - new_max);
  __syncthreads();  // every thread has read the old max
  for (int d = threadIdx.x; d < v_dims; d += blockDim.x)
    st.acc[at * v_dims + d] = st.acc[at * v_dims + d] * keep + values[d] * add;
  if (threadIdx.x == 0) {
    st.sum[at] = st.sum[at] * keep + sum * add;
    st.max[at] = new_max;
  }
}

__global__ void prefill_begin_kernel(PrefillSoftmax st) {
  const int64_t n = st.rows * st.heads;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * st.v_dims;
       i += int64_t{gridDim.x} * blockDim.x) {
    st.acc[i] = 0.0f;
    if (i < n) st.max[i] = -INFINITY, st.sum[i] = 0.0f;
  }
}

__global__ void prefill_finish_kernel(PrefillSoftmax st, uint16_t* out, int64_t out_stride, int64_t row0) {
  const int64_t j = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t at = j * st.heads + h;
  const float sum = st.sum[at];
  uint16_t* o = out + (row0 + j) * out_stride + static_cast<int64_t>(h) * st.v_dims;
  for (int d = threadIdx.x; d < st.v_dims; d += blockDim.x)
    o[d] = bf16(sum > 0.0f ? st.acc[at * st.v_dims + d] / sum : 0.0f);
}

// Block (key, head): the head's nope dims from kv, then the shared rope dims.
__global__ void assemble_keys_kernel(uint16_t* k, const uint16_t* kv, int64_t kv_stride, const uint16_t* k_pe,
                                     int64_t kpe_stride, int nope_dims, int rope_dims, int v_dims) {
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, heads = gridDim.y, head_dim = nope_dims + rope_dims;
  uint16_t* dst = k + (s * heads + h) * head_dim;
  const uint16_t* nope = kv + s * kv_stride + static_cast<int64_t>(h) * (nope_dims + v_dims);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
    dst[d] = d < nope_dims ? nope[d] : k_pe[s * kpe_stride + d - nope_dims];
}

// Block (row, head): one call's normalized output and log2-sum-exp folded
// into the running softmax (the state's max and sum in natural-log units).
__global__ void prefill_merge_kernel(PrefillSoftmax st, int64_t row0, const uint16_t* o, const float* lse) {
  const int64_t j = blockIdx.x;
  const int h = blockIdx.y;
  const float l = lse[j * st.heads + h] * 0.69314718f;  // log2 -> ln
  if (!(l > -INFINITY)) return;  // the row saw no key in this call
  const int64_t at = (row0 + j) * st.heads + h;
  const float old_max = st.max[at], new_max = fmaxf(old_max, l);
  const float keep = expf(old_max - new_max), add = expf(l - new_max);
  const uint16_t* src = o + (j * st.heads + h) * st.v_dims;
  for (int d = threadIdx.x; d < st.v_dims; d += blockDim.x)
    st.acc[at * st.v_dims + d] = st.acc[at * st.v_dims + d] * keep + f32(src[d]) * add;
  __syncthreads();  // every thread has read the old max
  if (threadIdx.x == 0) {
    st.sum[at] = st.sum[at] * keep + add;
    st.max[at] = new_max;
  }
}

__global__ void gather_kv_kernel(uint16_t* latent, int64_t latent_stride, int R, uint16_t* k_pe,
                                 int64_t kpe_stride, int Dr, const uint16_t* cache,
                                 const int32_t* block_row, int page_size, int64_t first) {
  const int64_t s = blockIdx.x, p = first + s;
  const uint16_t* row = cache + (static_cast<int64_t>(block_row[p / page_size]) * page_size + p % page_size) * (R + Dr);
  for (int d = threadIdx.x; d < R; d += blockDim.x) latent[s * latent_stride + d] = row[d];
  for (int d = threadIdx.x; d < Dr; d += blockDim.x) k_pe[s * kpe_stride + d] = row[R + d];
}

__global__ void set_count_kernel(int32_t* dst, int32_t value) { *dst = value; }

unsigned grid_rows(int64_t rows) { return static_cast<unsigned>(rows > 0 ? rows : 1); }

}  // namespace

void launch_plan_step(const MLABatch& b, int64_t n, const StepBounds& bounds, int local_heads,
                      const RowPlan& plan, StepErrorRecord* error, cudaStream_t stream) {
  plan_step_kernel<<<1, kPlanThreads, 0, stream>>>(
      static_cast<const int32_t*>(b.q_start.data), static_cast<const int32_t*>(b.kv_len.data),
      static_cast<const int32_t*>(b.block_table.data), b.block_table.stride[0], b.num_requests,
      b.num_decode, n, bounds, local_heads, plan, error);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_rope_q(uint16_t* q, int64_t q_stride, int heads, int head_dim, int rope_dims,
                   const RowPlan& plan, int64_t max_rows, const RopeArgs& rope, cudaStream_t stream) {
  if (max_rows == 0) return;
  // A thread a pair of the rows q holds, up to kRopeMaxBlocks (a prefill
  // chunk of 4096 rows: 16 pairs a thread).
  const int64_t threads = max_rows * heads * (rope_dims / 2);
  const unsigned blocks = static_cast<unsigned>(
      std::min<int64_t>(std::max<int64_t>((threads + kStrideThreads - 1) / kStrideThreads, 1), kRopeMaxBlocks));
  rope_q_kernel<<<blocks, kStrideThreads, 0, stream>>>(q, q_stride, heads, head_dim, rope_dims, plan, max_rows,
                                                       rope);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_append_kv(uint16_t* cache, int page_size, const uint16_t* latent, int64_t latent_stride,
                      int R, const uint16_t* kpe, int64_t kpe_stride, int Dr,
                      const int32_t* block_table, int64_t block_stride, const RowPlan& plan,
                      int64_t max_rows, const RopeArgs& rope, cudaStream_t stream) {
  if (max_rows == 0) return;
  append_kv_kernel<<<grid_rows(max_rows), 128, 0, stream>>>(cache, page_size, latent, latent_stride, R, kpe,
                                                            kpe_stride, Dr, block_table, block_stride,
                                                            plan, rope);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_split_heads(uint16_t* dst, int64_t dst_head_stride, int64_t dst_row_stride, int64_t Nd,
                        int64_t width, const uint16_t* src, int64_t src_stride, int heads, int64_t head_stride,
                        int64_t offset, const int32_t* rows, cudaStream_t stream) {
  if (Nd == 0 || heads == 0) return;
  launch_copy_head_rows(dst, {dst_row_stride, dst_head_stride}, src + offset, {src_stride, head_stride}, heads,
                        width, rows, Nd, stream);
}

void launch_merge_heads(uint16_t* dst, int64_t dst_stride, const uint16_t* src, int64_t Nd,
                        int64_t width, int heads, const int32_t* rows, cudaStream_t stream) {
  if (Nd == 0 || heads == 0) return;
  launch_copy_head_rows(dst, {dst_stride, width}, src, {width, Nd * width}, heads, width, rows, Nd, stream);
}

void launch_decode_attention(uint16_t* out_latent, const uint16_t* q_latent, int64_t Nd, int R,
                             const uint16_t* q, int64_t q_stride, int head_dim, int nope_dims,
                             const uint16_t* cache, int page_size, int Dr,
                             const int32_t* block_table, int64_t block_stride, const RowPlan& plan,
                             int heads, float scale, cudaStream_t stream) {
  if (R > kMaxLatent || R % 32 != 0 || Dr > kMaxRope)
    throw InvalidArgument("moelink: MLAAttention (cuda): kv_lora_rank = " + std::to_string(R) +
                          " and qk_rope_head_dim = " + std::to_string(Dr) +
                          " must be at most 512 (a multiple of 32) and 256 for the decode kernel");
  if (Nd == 0 || heads == 0) return;
  decode_attention_kernel<<<dim3(grid_rows(Nd), heads), kThreads, 0, stream>>>(
      out_latent, q_latent, Nd, R, q, q_stride, head_dim, nope_dims, cache, page_size, Dr, block_table,
      block_stride, plan, scale);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_prefill_begin(const PrefillSoftmax& s, cudaStream_t stream) {
  if (s.rows == 0) return;
  prefill_begin_kernel<<<256, 256, 0, stream>>>(s);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_gather_kv(uint16_t* latent, int64_t latent_stride, int R, uint16_t* k_pe, int64_t kpe_stride,
                      int Dr, const uint16_t* cache, const int32_t* block_row, int page_size,
                      int64_t first, int64_t count, cudaStream_t stream) {
  if (count == 0) return;
  gather_kv_kernel<<<grid_rows(count), 128, 0, stream>>>(latent, latent_stride, R, k_pe, kpe_stride, Dr,
                                                         cache, block_row, page_size, first);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_prefill_chunk(const PrefillSoftmax& s, const uint16_t* q, int64_t q_stride, int64_t q_row0,
                          int64_t q_pos0, const uint16_t* kv, int64_t kv_stride, const uint16_t* k_pe,
                          int64_t kpe_stride, int64_t keys, int64_t k_pos0, int nope_dims,
                          int rope_dims, float scale, cudaStream_t stream) {
  if (nope_dims + rope_dims > kMaxLatent || s.v_dims > kMaxV || s.v_dims % 32 != 0)
    throw InvalidArgument("moelink: MLAAttention (cuda): qk_nope_head_dim + qk_rope_head_dim = " +
                          std::to_string(nope_dims + rope_dims) + " and v_head_dim = " +
                          std::to_string(s.v_dims) +
                          " must be at most 512 and 256 (a multiple of 32) for the prefill kernel");
  if (s.rows == 0 || keys == 0) return;
  prefill_chunk_kernel<<<dim3(grid_rows(s.rows), s.heads), kThreads, 0, stream>>>(
      s, q, q_stride, q_row0, q_pos0, kv, kv_stride, k_pe, kpe_stride, keys, k_pos0, nope_dims, rope_dims,
      scale);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_prefill_finish(const PrefillSoftmax& s, uint16_t* out, int64_t out_stride, int64_t row0,
                           cudaStream_t stream) {
  if (s.rows == 0) return;
  prefill_finish_kernel<<<dim3(grid_rows(s.rows), s.heads), 128, 0, stream>>>(s, out, out_stride, row0);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_assemble_keys(uint16_t* k, const uint16_t* kv, int64_t kv_stride, const uint16_t* k_pe,
                          int64_t kpe_stride, int64_t keys, int heads, int nope_dims, int rope_dims,
                          int v_dims, cudaStream_t stream) {
  if (keys == 0 || heads == 0) return;
  assemble_keys_kernel<<<dim3(grid_rows(keys), heads), 64, 0, stream>>>(k, kv, kv_stride, k_pe, kpe_stride,
                                                                       nope_dims, rope_dims, v_dims);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_prefill_merge(const PrefillSoftmax& s, int64_t row0, const uint16_t* o, const float* lse,
                          int64_t rows, cudaStream_t stream) {
  if (rows == 0 || s.heads == 0) return;
  prefill_merge_kernel<<<dim3(grid_rows(rows), s.heads), 128, 0, stream>>>(s, row0, o, lse);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

void launch_set_count(int32_t* dst, int32_t value, cudaStream_t stream) {
  set_count_kernel<<<1, 1, 0, stream>>>(dst, value);
  MOELINK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moelink::detail::attention
