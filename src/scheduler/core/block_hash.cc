#include "moelink/scheduler/block_hash.h"

#include <xxhash.h>

#include <bit>
#include <stdexcept>

static_assert(std::endian::native == std::endian::little,
              "moelink block hash v1 hashes tokens as little-endian bytes");

namespace moelink::scheduler {

uint64_t block_hash(uint64_t parent, std::span<const uint32_t> tokens) {
  return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), parent);
}

void prompt_block_hashes(std::span<const uint32_t> tokens, uint32_t block_size,
                         std::vector<uint64_t>& out) {
  if (block_size == 0) throw std::invalid_argument("block_size must be > 0");
  out.clear();
  const size_t blocks = tokens.size() / block_size;
  out.reserve(blocks);
  uint64_t h = kRootBlockHash;
  for (size_t b = 0; b < blocks; ++b) {
    h = block_hash(h, tokens.subspan(b * block_size, block_size));
    out.push_back(h);
  }
}

std::vector<uint64_t> prompt_block_hashes(std::span<const uint32_t> tokens, uint32_t block_size) {
  std::vector<uint64_t> out;
  prompt_block_hashes(tokens, block_size, out);
  return out;
}

}  // namespace moelink::scheduler
