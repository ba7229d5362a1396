// The CUDA sampling kernel against the host loop on the same logits: every
// rule of sampling.h (greedy's first largest, top_k with ties broken by the
// smaller index, top_p's smallest set, temperature, the counter-based draw)
// must pick the same token; bad parameters reported the same way. And
// draft_rules.h's plan / accept / MTP inputs on both, against a batch
// worked out by hand. The residual add and RMSNorm kernel against the host
// loop. And the device memory the CUDA ops grow (lm_head's buffers)
// staying valid for the graphs captured on it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/float_convert.h"
#include "experts/expert_cases.h"  // fresh_seed
#include "model/model_ops.h"
#include "rank_harness.h"  // probe_gpu_count, run_ranks, RANK_CHECK
#include "staging.h"
#if defined(MOELINK_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "gpu_memory_ops.h"  // CUDA_OK
#include "nvlink/cuda_memory.h"
#endif

namespace moelink_test {
namespace {

using moelink::DType;
using moelink::Tensor;
using moelink::detail::model::ModelErrorRecord;
using moelink::detail::model::ModelOps;

struct Requests {
  std::vector<float> logits, temperature, top_p;
  std::vector<int32_t> top_k, q_start, kv_len;
  std::vector<int64_t> seed;
};

// Runs ops.sample on the requests (staged into the ops' memory); returns
// the tokens and the error record.
std::vector<int32_t> sample(ModelOps& ops, MemoryOps* gpu, Requests r, int64_t V, ModelErrorRecord* e) {
  const int B = static_cast<int>(r.kv_len.size());
  Staging st(gpu);
  std::vector<int32_t> out(B, -7);
  std::vector<uint8_t> record(sizeof(ModelErrorRecord), 0);
  int32_t* dout = st.put(out);
  auto* derr = reinterpret_cast<ModelErrorRecord*>(st.put(record));
  // Each request's last row and its position, as the model plans them.
  std::vector<int32_t> rows{r.q_start[B]}, slot_rows(B, -7), positions(B, -7);
  int32_t* drow = st.put(slot_rows);
  int32_t* dpos = st.put(positions);
  ops.plan_samples(st.put(r.q_start), st.put(r.kv_len), nullptr, B, 1, st.put(rows), drow, dpos, derr, nullptr);
  ops.sample(Tensor::contiguous(dout, DType::kInt32, {B}),
             Tensor::contiguous(st.put(r.logits), DType::kFloat32, {B, V}),
             Tensor::contiguous(st.put(r.temperature), DType::kFloat32, {B}),
             Tensor::contiguous(st.put(r.top_k), DType::kInt32, {B}),
             Tensor::contiguous(st.put(r.top_p), DType::kFloat32, {B}),
             Tensor::contiguous(st.put(r.seed), DType::kInt64, {B}), drow, dpos, 1, derr, nullptr);
  *e = ops.take_error(derr, nullptr);
  st.get(out, dout);
  return out;
}

// The CUDA kernel against the host loop on 48 requests at each vocabulary size.
void check_sampling(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto cpu = moelink::detail::model::make_cpu_model_ops();
  auto cuda = moelink::detail::model::make_cuda_model_ops();
  const std::unique_ptr<MemoryOps> gpu = gpu_memory_if(true);
  for (int64_t V : {7, 1000, 129280}) {
    SCOPED_TRACE("vocab " + std::to_string(V));
    const int B = 48;
    Requests r;
    std::normal_distribution<float> nd(0.0f, 3.0f);
    r.logits.resize(static_cast<size_t>(B) * V);
    for (auto& v : r.logits) v = nd(rng);
    r.q_start.push_back(0);
    for (int i = 0; i < B; ++i) {
      // Ties: request i % 4 == 1 has its largest logits repeated.
      if (i % 4 == 1)
        for (int64_t j = 0; j < std::min<int64_t>(V, 5); ++j) r.logits[i * V + j * (V / 5 + 1) % V] = 9.0f;
      r.temperature.push_back(i % 6 == 0 ? 0.0f : std::uniform_real_distribution<float>(0.2f, 2.0f)(rng));
      r.top_k.push_back(i % 3 == 0 ? 0 : static_cast<int32_t>(1 + rng() % std::min<int64_t>(V, 50)));
      r.top_p.push_back(i % 5 == 0 ? 1.0f : std::uniform_real_distribution<float>(0.05f, 0.99f)(rng));
      r.seed.push_back(static_cast<int64_t>(rng() % 1000));
      r.kv_len.push_back(static_cast<int32_t>(1 + rng() % 5000));
      r.q_start.push_back(r.q_start.back() + (i == 7 ? 0 : 1));  // request 7 is empty
    }
    ModelErrorRecord e_cpu{}, e_cuda{};
    const std::vector<int32_t> want = sample(*cpu, nullptr, r, V, &e_cpu);
    const std::vector<int32_t> got = sample(*cuda, gpu.get(), r, V, &e_cuda);
    RANK_CHECK(e_cpu.code == 0);
    RANK_CHECK(e_cuda.code == 0);
    for (int i = 0; i < B; ++i)
      RANK_CHECK(got[i] == want[i]) << "request " << i << " (temperature " << r.temperature[i] << ", top_k "
                                 << r.top_k[i] << ", top_p " << r.top_p[i] << ")";
    RANK_CHECK(got[7] == -1) << "the empty request";
    // A bad parameter: the request gets -1 and the record names it.
    Requests bad = r;
    bad.top_p[3] = 1.5f;
    const std::vector<int32_t> b = sample(*cuda, gpu.get(), bad, V, &e_cuda);
    RANK_CHECK(b[3] == -1);
    RANK_CHECK(e_cuda.code == 2);
    RANK_CHECK(e_cuda.field == 2);
    RANK_CHECK(e_cuda.row == 3);
    RANK_CHECK(b[4] == want[4]) << "a good request beside the bad one";
  }
}

// Five requests: a decode verifying a draft (accepted, then rejected), a
// plain decode, an empty request, one asking for two drafts (refused: read
// as none), a prefill chunk whose next prompt token is known.
void check_draft_rules(ModelOps& ops, MemoryOps* gpu) {
  const int B = 5, slots = 2;
  // (Not const: a host Staging uses them in place.)
  std::vector<int32_t> ids{10, 20, 30, 40, 41, 42, 50, 51, 52, 53}, q_start{0, 2, 3, 3, 6, 10},
      kv_len{10, 5, 0, 7, 4}, drafts{1, 0, 0, 2, 0}, known{-1, -1, -1, -1, 77}, rows{10};
  const std::vector<int32_t> want_rows{0, 1, 2, -1, -1, -1, 5, -1, 9, -1}, want_pos{8, 9, 4, -1, -1, -1, 6, -1, 3, -1};
  for (const bool accept : {true, false}) {
    Staging st(gpu);
    std::vector<uint8_t> record(sizeof(ModelErrorRecord), 0);
    auto* derr = reinterpret_cast<ModelErrorRecord*>(st.put(record));
    std::vector<int32_t> row_index(B * slots, -7), position(B * slots, -7);
    int32_t* drow = st.put(row_index);
    int32_t* dpos = st.put(position);
    const int32_t* dq = st.put(q_start);
    ops.plan_samples(dq, st.put(kv_len), st.put(drafts), B, slots, st.put(rows), drow, dpos, derr, nullptr);
    // The samples as if the model drew them: request 0 agrees with its draft (20) or not.
    std::vector<int32_t> samples{accept ? 20 : 21, 99, 31, -1, -1, -1, 43, -1, 60, -1};
    std::vector<int32_t> next(B, -7), accepted(B, -7), mtp(10, -7), draft_row(B, -7);
    int32_t *dnext = st.put(next), *dacc = st.put(accepted), *dmtp = st.put(mtp), *ddraft = st.put(draft_row);
    ops.accept_drafts(st.put(samples), drow, slots, Tensor::contiguous(st.put(ids), DType::kInt32, {10}), dq,
                      st.put(known), B, dnext, 1, dacc, dmtp, ddraft, nullptr);
    const ModelErrorRecord e = ops.take_error(derr, nullptr);
    st.get(row_index, drow);
    st.get(position, dpos);
    st.get(next, dnext);
    st.get(accepted, dacc);
    st.get(mtp, dmtp);
    st.get(draft_row, ddraft);
    RANK_CHECK(row_index == want_rows);
    RANK_CHECK(position == want_pos);
    RANK_CHECK(e.code == 3 && e.row == 3 && e.value == 2 && e.limit == 1) << "code " << e.code << " row " << e.row;
    RANK_CHECK(next == (std::vector<int32_t>{accept ? 99 : 21, 31, -1, 43, 60}));
    RANK_CHECK(accepted == (std::vector<int32_t>{accept ? 1 : 0, 0, 0, 0, 0}));
    RANK_CHECK(draft_row == (std::vector<int32_t>{accept ? 1 : 0, 2, -1, 5, 9}));
    // The token after each row: the next row's id before the sampled rows,
    // the samples from there, the known prompt token at a chunk's end.
    RANK_CHECK(mtp == (std::vector<int32_t>{accept ? 20 : 21, 99, 31, 41, 42, 43, 51, 52, 53, 77}));
  }
}

TEST(DraftRules, PlanAcceptAndMtpInputsByHand) {
  auto cpu = moelink::detail::model::make_cpu_model_ops();
  check_draft_rules(*cpu, nullptr);
  if (probe_gpu_count() == 0) GTEST_SKIP() << "the CUDA ops need a GPU (the host loops passed)";
  run_ranks(1, [&](int, moelink::Bootstrap&) {
    auto cuda = moelink::detail::model::make_cuda_model_ops();
    const std::unique_ptr<MemoryOps> gpu = gpu_memory_if(true);
    check_draft_rules(*cuda, gpu.get());
  }, 120);
}

TEST(SamplingCuda, PicksTheHostLoopsToken) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // In a forked rank: the test process itself never initializes CUDA, so
  // the model tests' forked ranks after this one can.
  run_ranks(1, [&](int, moelink::Bootstrap&) { check_sampling(seed); }, 120);
}


// ModelOps::add_rms_norm (the residual stream's add and norm, and through
// the same kernel the attention's norms) on the GPU against the host loop
// (core/rms_norm.h): the rounded sums bit for bit, the normed rows within
// one bf16 ulp (the sum of squares is reduced in another order); rows past
// the device-read bound untouched. Widths through the vector kernel
// (7168, 1536, 512: DeepSeek-V3's) and the scalar one (516: not a multiple
// of 8; 8200: past the registers' 8192).
void check_add_rms_norm(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto cpu = moelink::detail::model::make_cpu_model_ops();
  auto cuda = moelink::detail::model::make_cuda_model_ops();
  const std::unique_ptr<MemoryOps> gpu = gpu_memory_if(true);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const int64_t M = 19;
  for (int64_t cols : {7168, 1536, 512, 516, 8200}) {
    for (int32_t bound : {0, 1, 3, 17}) {
      for (int mode = 0; mode < 3; ++mode) {  // 0: add and norm, 1: the norm alone, 2: the add alone
        SCOPED_TRACE("cols " + std::to_string(cols) + " rows " + std::to_string(bound) + " mode " +
                     std::to_string(mode));
        std::vector<uint16_t> h(M * cols), x(M * cols), poison(M * cols, 0x7fc1);
        for (auto& v : h) v = moelink::detail::f32_to_bf16(nd(rng));
        for (auto& v : x) v = moelink::detail::f32_to_bf16(nd(rng));
        std::vector<float> w(cols);
        for (auto& v : w) v = 1.0f + 0.25f * nd(rng);
        std::vector<int32_t> rows{bound};
        auto run = [&](ModelOps& ops, MemoryOps* mem, std::vector<uint16_t>& h_out, std::vector<uint16_t>& n_out) {
          Staging st(mem);
          std::vector<uint16_t> hh = h, xx = x, nn = poison;
          std::vector<float> ww = w;
          uint16_t *dh = st.put(hh), *dn = st.put(nn);
          const Tensor th = Tensor::contiguous(dh, DType::kBFloat16, {M, cols});
          const Tensor tx = mode == 1 ? Tensor{} : Tensor::contiguous(st.put(xx), DType::kBFloat16, {M, cols});
          const Tensor tn = mode == 2 ? Tensor{} : Tensor::contiguous(dn, DType::kBFloat16, {M, cols});
          ops.add_rms_norm(th, tx, tn, mode == 2 ? nullptr : st.put(ww), 1e-6f, st.put(rows), nullptr);
#if defined(MOELINK_WITH_CUDA)
          // The op ran on the legacy stream; the staging copies run on a
          // non-blocking one, which does not wait for it.
          if (mem != nullptr) CUDA_OK(cudaDeviceSynchronize());
#endif
          st.get(hh, dh);
          st.get(nn, dn);
          h_out = hh;
          n_out = nn;
        };
        std::vector<uint16_t> want_h, want_n, got_h, got_n;
        run(*cpu, nullptr, want_h, want_n);
        run(*cuda, gpu.get(), got_h, got_n);
        RANK_CHECK(got_h == want_h) << "the residual stream (sums bit for bit, rows past the bound as they were)";
        int64_t off = 0;
        for (int64_t i = 0; i < M * cols; ++i) {
          const int d = std::abs(static_cast<int>(got_n[i]) - static_cast<int>(want_n[i]));
          if (i / cols >= bound || mode == 2) off += got_n[i] != 0x7fc1;  // untouched
          else off += d > 1;  // same sign: bf16 bit patterns one apart are one ulp apart
        }
        RANK_CHECK(off == 0) << off << " normed values off (beyond one ulp, or written past the bound)";
      }
    }
  }
}

TEST(ModelOpsCuda, AddRmsNormMatchesTheHostLoop) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  run_ranks(1, [&](int, moelink::Bootstrap&) { check_add_rms_norm(seed); }, 120);
}

#if defined(MOELINK_WITH_CUDA)
// GrowingDeviceBuffer (the model's lm_head, the expert GEMMs' split-K
// buffers, FlashInfer's prefill): a graph captured on the memory of a
// small call and replayed after a larger call grew it still writes that
// memory, which must still be this buffer's (it was freed once: the model's
// decode graphs wrote freed memory on an H100).
TEST(GpuMemory, GrowingBufferKeepsWhatCapturedGraphsWrite) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  // In a forked rank, as SamplingCuda: the test process stays without CUDA.
  run_ranks(1, [&](int, moelink::Bootstrap&) {
    CUDA_OK(cudaSetDevice(0));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    moelink::detail::GrowingDeviceBuffer buf;
    void* small = buf.get(256);
    RANK_CHECK(buf.get(100) == small) << "a smaller size reuses the memory";
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    CUDA_OK(cudaMemsetAsync(small, 0x5A, 256, stream));
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    void* large = buf.get(size_t{64} << 20);
    RANK_CHECK(large != small && buf.bytes() == (size_t{64} << 20));
    cudaPointerAttributes attr{};
    CUDA_OK(cudaPointerGetAttributes(&attr, small));
    RANK_CHECK(attr.type == cudaMemoryTypeDevice) << "the outgrown memory was freed under the captured graph";
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<unsigned char> back(256);
    CUDA_OK(cudaMemcpy(back.data(), small, back.size(), cudaMemcpyDeviceToHost));
    RANK_CHECK(std::all_of(back.begin(), back.end(), [](unsigned char b) { return b == 0x5A; }))
        << "the replay's writes did not land in the buffer's outgrown memory";
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
  }, 60);
}

#endif

}  // namespace
}  // namespace moelink_test
