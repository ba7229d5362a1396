#include "moelink/scheduler/block_hash.h"

#include <stdexcept>

namespace moelink::scheduler {

uint64_t block_hash(uint64_t parent, std::span<const uint32_t> tokens) {
  uint64_t x = parent ^ (static_cast<uint64_t>(tokens.size()) * 0x9E3779B97F4A7C15ull);
  for (uint32_t t : tokens) x = splitmix64(x ^ t);
  return x;
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
