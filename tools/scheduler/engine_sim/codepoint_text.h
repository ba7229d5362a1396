// Token ids as text, one Unicode code point per token (U+0100 + id, skipping
// the surrogates), so a text-based router (sglang-router's cache-aware
// policy matches characters) sees exactly the token structure. The Python
// twin is moelink.scheduler.CodepointTokenizer.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace moelink::scheduler::sim {

inline constexpr uint32_t kCodepointBase = 0x100;

inline uint32_t token_to_codepoint(uint32_t t) {
  uint32_t cp = kCodepointBase + t;
  if (cp >= 0xD800) cp += 0x800;
  if (cp > 0x10FFFF) throw std::out_of_range("token id " + std::to_string(t) + " has no code point");
  return cp;
}

inline std::string tokens_to_text(const std::vector<uint32_t>& tokens, size_t from = 0) {
  std::string s;
  for (size_t i = from; i < tokens.size(); ++i) {
    const uint32_t cp = token_to_codepoint(tokens[i]);
    if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return s;
}

// Throws std::invalid_argument on malformed UTF-8, a code point below U+0100
// or a surrogate.
inline std::vector<uint32_t> text_to_tokens(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    uint32_t cp;
    int n;
    if (c < 0x80) {
      cp = c;
      n = 1;
    } else if ((c >> 5) == 6) {
      cp = c & 0x1F;
      n = 2;
    } else if ((c >> 4) == 14) {
      cp = c & 0x0F;
      n = 3;
    } else if ((c >> 3) == 30) {
      cp = c & 0x07;
      n = 4;
    } else {
      throw std::invalid_argument("text is not UTF-8 at byte " + std::to_string(i));
    }
    if (i + n > s.size()) throw std::invalid_argument("text ends inside a UTF-8 sequence");
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    if (cp < kCodepointBase)
      throw std::invalid_argument("text has U+" + std::to_string(cp) +
                                  ", which encodes no token (the codepoint text starts at U+0100)");
    if (cp >= 0xD800 && cp < 0xE000)
      throw std::invalid_argument("text has the surrogate " + std::to_string(cp) +
                                  ", which encodes no token");
    out.push_back(cp >= 0xE000 ? cp - 0x800 - kCodepointBase : cp - kCodepointBase);
    i += n;
  }
  return out;
}

}  // namespace moelink::scheduler::sim
