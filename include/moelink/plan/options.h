// moelink-plan: checks of the CLI's numeric values, one per option, so that every
// bad value is reported with the value, the allowed range and its unit.
#pragma once
#include <string>

namespace moelink::plan {

// Allowed integers of an option and their unit, e.g. {1, 65536, "requests per DP group"}.
struct IntRange {
  long long lo = 0, hi = 0;
  std::string unit;
  std::string str() const;  // "1 to 65,536 (requests per DP group)"
};

// Allowed real values of an option and their unit, e.g. {0, 1, "fraction of drafts accepted"}.
struct RealRange {
  double lo = 0, hi = 0;
  std::string unit;
  std::string str() const;  // "0 to 1 (fraction of drafts accepted)"
};

// "" when `text` is an integer inside `r`; else why not, naming the value and the
// range: "'abc' is not an integer; allowed: 1 to 65,536 (requests per DP group)".
// The caller prefixes the option ("--batch: ...").
std::string check_int(const std::string& text, const IntRange& r);
// As check_int for a finite real number.
std::string check_real(const std::string& text, const RealRange& r);

// 65536 -> "65,536": ranges and chart ticks print plain integers with separators.
std::string with_thousands(long long v);

}  // namespace moelink::plan
