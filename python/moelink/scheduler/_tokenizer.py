"""A reversible toy tokenizer: one Unicode code point per token id (U+0100 +
id, skipping the surrogates). moelink-engine-sim's HTTP front end decodes
it, so text-based routers (sglang-router matches characters) see exactly the
token structure of a trace. tools/scheduler/engine_sim/codepoint_text.h is
its C++ twin."""

from __future__ import annotations

from typing import Iterable, List

_BASE = 0x100


class CodepointTokenizer:
    def encode(self, text: str) -> List[int]:
        out = []
        for ch in text:
            cp = ord(ch)
            if cp < _BASE:
                raise ValueError(f"U+{cp:04X} encodes no token (the code point text starts at U+0100)")
            if 0xD800 <= cp < 0xE000:
                raise ValueError(f"U+{cp:04X} is a surrogate and encodes no token")
            out.append(cp - 0x800 - _BASE if cp >= 0xE000 else cp - _BASE)
        return out

    def decode(self, tokens: Iterable[int]) -> str:
        chars = []
        for t in tokens:
            cp = _BASE + int(t)
            if cp >= 0xD800:
                cp += 0x800
            if cp > 0x10FFFF:
                raise ValueError(f"token id {t} has no code point")
            chars.append(chr(cp))
        return "".join(chars)
