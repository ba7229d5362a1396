// RecordBatch (nvlink/error_record_batch.h), what Model.check reads its
// layers' error records through: the records a check read once are
// gathered in one copy before the next check and read from there, with the
// values the device holds (set, then cleared by their reader, a second
// reader in the same check seeing them cleared); records read on another
// stream, or too large to gather, are read one by one and give their own
// values too. Without a GPU: skipped.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>

#include "rank_harness.h"  // probe_gpu_count, run_ranks, RANK_CHECK
#if defined(MOELINK_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "gpu_memory_ops.h"  // CUDA_OK
#include "nvlink/cuda_check.h"
#include "nvlink/error_record_batch.h"
#endif

namespace moelink_test {
namespace {

#if defined(MOELINK_WITH_CUDA)

struct SmallRecord {
  int32_t code, value;
};
struct LargeRecord {  // more than RecordBatch gathers: read alone
  int32_t code, pad[31];
};

template <class R>
int32_t take(cudaStream_t s, R* r) {
  return moelink::detail::take_device_record(s, r, [](const R&) { return true; }).code;
}

template <class R>
void set_code(R* r, int32_t code, cudaStream_t s) {
  CUDA_OK(cudaMemcpyAsync(&r->code, &code, 4, cudaMemcpyHostToDevice, s));
  CUDA_OK(cudaStreamSynchronize(s));
}

TEST(GpuErrorRecords, ABatchReadsWhatTheDeviceHoldsAfterLearningItsRecords) {
  if (probe_gpu_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  run_ranks(1, [&](int, moelink::Bootstrap&) {
    CUDA_OK(cudaSetDevice(0));
    cudaStream_t stream, other;
    CUDA_OK(cudaStreamCreate(&stream));
    CUDA_OK(cudaStreamCreate(&other));
    auto device = [](size_t bytes) {
      void* p = nullptr;
      CUDA_OK(cudaMalloc(&p, bytes));
      return p;
    };
    auto* a = static_cast<SmallRecord*>(device(sizeof(SmallRecord)));
    auto* b = static_cast<SmallRecord*>(device(sizeof(SmallRecord)));
    auto* c = static_cast<SmallRecord*>(device(sizeof(SmallRecord)));
    auto* big = static_cast<LargeRecord*>(device(sizeof(LargeRecord)));
    for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c)})
      CUDA_OK(cudaMemset(p, 0, sizeof(SmallRecord)));
    CUDA_OK(cudaMemset(big, 0, sizeof(LargeRecord)));
    moelink::detail::RecordBatch batch;
    int32_t got[5] = {};
    // a and b twice (a shared object's record, as the layers' GEMMs), c on
    // another stream, big too large to gather.
    auto check = [&] {
      got[0] = take(stream, a);
      got[1] = take(stream, b);
      got[2] = take(stream, a);
      got[3] = take(other, c);
      got[4] = take(stream, big);
    };
    for (int round = 0; round < 4; ++round) {
      // Round 0 learns (every value read alone); later rounds gather a and b.
      const int32_t code = 10 + round;
      set_code(a, code, stream);
      set_code(c, code + 100, stream);
      set_code(big, code + 200, stream);
      if (round == 2) set_code(b, 7, stream);
      batch.run(stream, check);
      RANK_CHECK(got[0] == code) << "round " << round << ": a read " << got[0];
      RANK_CHECK(got[2] == 0) << "round " << round << ": a's second reader saw " << got[2] << ", not it cleared";
      RANK_CHECK(got[1] == (round == 2 ? 7 : 0)) << "round " << round << ": b read " << got[1];
      RANK_CHECK(got[3] == code + 100 && got[4] == code + 200) << "round " << round;
      RANK_CHECK(batch.size() == 2) << "learned " << batch.size() << " records, expected a and b";
      SmallRecord back{};
      CUDA_OK(cudaMemcpy(&back, a, sizeof(back), cudaMemcpyDeviceToHost));
      RANK_CHECK(back.code == 0) << "round " << round << ": a was not cleared on the device";
    }
    // An exception from the check leaves the batch usable and inactive.
    bool threw = false;
    try {
      batch.run(stream, [&] { throw std::runtime_error("a check's error"); });
    } catch (const std::runtime_error&) {
      threw = true;
    }
    RANK_CHECK(threw && moelink::detail::active_record_source == nullptr);
    set_code(a, 3, stream);
    batch.run(stream, check);
    RANK_CHECK(got[0] == 3);
    for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c), static_cast<void*>(big)})
      CUDA_OK(cudaFree(p));
    CUDA_OK(cudaStreamDestroy(stream));
    CUDA_OK(cudaStreamDestroy(other));
  }, 60);
}

#endif

}  // namespace
}  // namespace moelink_test
