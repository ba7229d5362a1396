"""moelink block hash v1 (include/moelink/scheduler/block_hash.h): the chained
64-bit hash naming a KV-cache block and, through its chain, its prefix:
XXH3-64 of the block's tokens (little-endian uint32 bytes), seeded with the
previous block's hash."""

from __future__ import annotations

import struct
from typing import Iterable, List, Sequence

import xxhash

_MASK = (1 << 64) - 1
ROOT_BLOCK_HASH = 0x6D6F656C696E6B31  # "moelink1"


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one block of token ids whose predecessor's hash is
    `parent` (ROOT_BLOCK_HASH for a prompt's first block)."""
    data = struct.pack(f"<{len(tokens)}I", *tokens)
    return xxhash.xxh3_64_intdigest(data, seed=parent & _MASK)


def prompt_block_hashes(tokens: Iterable[int], block_size: int) -> List[int]:
    """The chained hashes of every full block of `tokens` (a trailing partial
    block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size {block_size} must be > 0")
    toks = list(tokens)
    out: List[int] = []
    h = ROOT_BLOCK_HASH
    for b in range(len(toks) // block_size):
        h = block_hash(h, toks[b * block_size:(b + 1) * block_size])
        out.append(h)
    return out


def splitmix64(x: int) -> int:
    """Steele, Lea and Flood's 64-bit finalizer (moelink-engine-sim derives its
    output tokens with it: token i = 1000 + splitmix64(prompt_hash + i) % 30000)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)
