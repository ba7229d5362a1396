"""moelink block hash v1 (include/moelink/scheduler/block_hash.h): the chained
64-bit hash naming a KV-cache block and, through its chain, its prefix."""

from __future__ import annotations

from typing import Iterable, List, Sequence

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
ROOT_BLOCK_HASH = 0x6D6F656C696E6B31  # "moelink1"


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one block of token ids whose predecessor's hash is
    `parent` (ROOT_BLOCK_HASH for a prompt's first block)."""
    x = parent ^ ((len(tokens) * _GOLDEN) & _MASK)
    for t in tokens:
        x = _splitmix64(x ^ (int(t) & 0xFFFFFFFF))
    return x


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
