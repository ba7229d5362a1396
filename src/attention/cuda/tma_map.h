// Host side of the TMA copies (tma.cuh): tensor maps over row-major bf16
// matrices in device memory, made through the CUDA driver's
// cuTensorMapEncodeTiled (looked up through the runtime: libmoelink does
// not link libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace moelink::detail::attention {

// A map over `rows` rows of `cols` bf16 (row stride `row_bytes`, a
// multiple of 16; base 16-byte aligned) whose box is 64 columns (128 bytes)
// x `box_rows` rows (1-256), landing in shared memory in the 128-byte
// swizzle of wgmma's K-major tiles (16-byte piece c of a box row r at c ^
// (r % 8); the destination aligned to 1024 bytes). Throws SystemError
// naming the argument the driver refused.
CUtensorMap bf16_swizzled_row_map(const void* base, uint64_t cols, uint64_t rows, uint64_t row_bytes,
                                  uint32_t box_rows);

}  // namespace moelink::detail::attention
