#include "moelink/plan/options.h"

#include <cerrno>
#include <charconv>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace moelink::plan {
namespace {
std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}
// %g without an exponent for the ranges used here (0..1e7).
std::string real_str(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return with_thousands((long long)v);
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}
std::string out_of_range(const std::string& value, const std::string& allowed) {
  return value + " is out of range; allowed: " + allowed;
}
}  // namespace

std::string with_thousands(long long v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (v < 0 ? "-" : "") + out;
}

std::string IntRange::str() const { return with_thousands(lo) + " to " + with_thousands(hi) + " (" + unit + ")"; }
std::string RealRange::str() const { return real_str(lo) + " to " + real_str(hi) + " (" + unit + ")"; }

std::string check_int(const std::string& text, const IntRange& r) {
  const std::string t = trim(text);
  const char* b = t.data() + (t.size() > 1 && t[0] == '+' && std::isdigit((unsigned char)t[1]) ? 1 : 0);
  const char* e = t.data() + t.size();
  long long v = 0;
  const auto [end, ec] = std::from_chars(b, e, v);
  if (t.empty() || end != e || (ec != std::errc() && ec != std::errc::result_out_of_range))
    return "'" + text + "' is not an integer; allowed: " + r.str();
  if (ec == std::errc::result_out_of_range || v < r.lo || v > r.hi) return out_of_range(t, r.str());
  return "";
}

std::string check_real(const std::string& text, const RealRange& r) {
  const std::string t = trim(text);
  char* end = nullptr;
  errno = 0;
  const double v = t.empty() ? 0 : std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || std::isnan(v))
    return "'" + text + "' is not a number; allowed: " + r.str();
  if (!std::isfinite(v) || v < r.lo || v > r.hi) return out_of_range(t, r.str());
  return "";
}

}  // namespace moelink::plan
