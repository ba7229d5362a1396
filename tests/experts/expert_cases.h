// The expert kernels' test cases, run the same way on ExpertDevice::kCPU
// (host memory) and kCUDA (device memory, tests/gpu_memory_ops.h): fresh
// random inputs each run (the seed is in the failure message), outputs
// poisoned first, every result compared with the fp64 reference
// (expert_reference.h), rows past a count checked untouched.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "all_to_all_cases.h"  // MemoryOps
#include "moelink/experts.h"

namespace moelink_test {

struct ExpertShape {
  const char* name;
  int num_experts;  // L
  int64_t rows;     // C
  int hidden;       // H
  int intermediate; // I
};
// A small shape (H 256, I 128), DeepSeek-V3 (H 7168, I 2048) and
// Qwen3-235B-A22B (H 4096, I 1536), with few experts and rows so that the
// fp64 reference stays fast.
ExpertShape small_shape();
ExpertShape deepseek_shape();
ExpertShape qwen3_shape();

enum class CountPattern {
  kUniform,  // every expert C/2 rows
  kFull,     // every expert C rows
  kSkewed,   // one expert C rows, the others 0
  kZero,     // every expert 0 rows
  kOne,      // every expert 1 row (m = 1)
  kTop8,     // counts of a top-8 routing of C tokens over 8 ranks' experts, popular experts skewed
  kRandom,   // uniform in [0, C]
};
const char* count_pattern_name(CountPattern p);
std::vector<int32_t> make_counts(CountPattern p, int num_experts, int64_t rows, std::mt19937_64& rng);

struct ExpertCase {
  ExpertShape shape;
  CountPattern counts;
  int64_t expected_rows = 0;  // ExpertConfig.expected_rows (GPU tile choice)
  int64_t call_rows = 0;      // forward() / grouped_gemm()'s expected_rows (the call's tiles)
  std::string name() const;
};
// Shapes x count patterns: every pattern on the small shape, the decode
// ones on DeepSeek-V3 and Qwen3 (not in the sanitizer build, where
// MOELINK_EXPERTS_SMALL_SHAPES_ONLY keeps the CPU loops affordable).
std::vector<ExpertCase> expert_cases();

// A fresh seed, and the trace line naming it.
uint64_t fresh_seed();

void run_grouped_gemm_case(moelink::ExpertDevice device, MemoryOps& ops, const ExpertCase& c);
// One Experts object through grouped_gemm calls with one count pattern
// after another (few tiles, then many, none, ...): nothing a call leaves in
// the object (argument arrays, the tile scheduler's counter) may change the
// next call's result.
void run_grouped_gemm_reuse_case(moelink::ExpertDevice device, MemoryOps& ops, const ExpertShape& s,
                                 int64_t expected_rows);
void run_silu_mul_quant_case(moelink::ExpertDevice device, MemoryOps& ops, const ExpertCase& c);
void run_forward_case(moelink::ExpertDevice device, MemoryOps& ops, const ExpertCase& c);
// Issue 32 item 4: forward() with one row per expert, over `seeds` fresh
// seeds, for each ExpertConfig.expected_rows in `tiles` (CUDA), on the same
// inputs: GEMM1 must hold bf16 precision for every tile and no tile's
// median forward() error may exceed another's by 1.5x. Prints the
// distribution per tile.
void run_forward_precision_sweep(MemoryOps& ops, const ExpertShape& s,
                                 const std::vector<int64_t>& tiles, int seeds);
// quantize of x [M, K]; m < 0: no bound_m (all M rows).
void run_quantize_case(moelink::ExpertDevice device, MemoryOps& ops, int64_t M, int64_t K, int64_t m);
// gemm: y [M, N] = x [M, K] . w [N, K]^T; m < 0: no bound_m.
void run_gemm_case(moelink::ExpertDevice device, MemoryOps& ops, int64_t M, int64_t N, int64_t K,
                   int64_t m);
// Counts above C and below 0, bound_m above M: clamped, nothing written past
// the tensors (guard bytes checked), check() throws InputError naming the
// call, the expert and the value, once.
void run_out_of_range_case(moelink::ExpertDevice device, MemoryOps& ops);

}  // namespace moelink_test
