// moelink block hash v1: how the scheduler names a KV-cache block.
//
// A prompt is cut into blocks of block_size tokens (the last, partial block is
// never cached). Block i's hash chains block i-1's hash with block i's tokens,
// so one hash names the whole prefix up to and including that block:
//
//   h(-1) = kRootBlockHash
//   h(i)  = XXH3_64bits_withSeed(tokens[i*bs .. (i+1)*bs) as little-endian
//                                uint32 bytes, seed = h(i-1))
//
// XXH3 (xxHash >= 0.8, whose XXH3 output is frozen) hashes a 16-token block
// in a few nanoseconds, so hashing a prompt costs little next to matching it.
// The Python engine client (moelink.scheduler.block_hash, the xxhash
// package) computes the same values; tests/scheduler and tests/python pin a
// few so the two cannot drift apart.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace moelink::scheduler {

inline constexpr uint64_t kRootBlockHash = 0x6D6F656C696E6B31ull;  // "moelink1"

// Steele, Lea and Flood's 64-bit finalizer (a good mix for small keys; the
// engine simulator derives its output tokens with it).
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The hash of one block whose predecessor's hash is `parent` (kRootBlockHash
// for a prompt's first block).
uint64_t block_hash(uint64_t parent, std::span<const uint32_t> tokens);

// The chained hashes of every full block of `tokens` (tokens.size() /
// block_size of them). block_size must be > 0.
std::vector<uint64_t> prompt_block_hashes(std::span<const uint32_t> tokens, uint32_t block_size);
void prompt_block_hashes(std::span<const uint32_t> tokens, uint32_t block_size,
                         std::vector<uint64_t>& out);

}  // namespace moelink::scheduler
