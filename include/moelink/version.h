// moelink's version: the one place it is written. CMake's project(), the
// Python package's metadata (pyproject.toml) and every tool's --version read
// it from here. Changes by version: CHANGELOG.md.
#pragma once

#define MOELINK_VERSION "0.2.0"

namespace moelink {
inline const char* version() { return MOELINK_VERSION; }
}  // namespace moelink
