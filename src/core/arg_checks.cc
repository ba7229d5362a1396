// Argument and environment checks shared by the public front ends.
#include "core/arg_checks.h"

#include <cstdlib>
#include <sstream>

#include "moelink/errors.h"

namespace moelink::detail {

double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  double d = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(d > 0))
    throw InvalidArgument(std::string("moelink: environment variable ") + name + " = '" + v +
                          "' must be a positive number of seconds");
  return d;
}

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < lo || n > hi)
    throw InvalidArgument(std::string("moelink: environment variable ") + name + " = '" + v +
                          "' must be an integer in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]");
  return static_cast<int>(n);
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.shape[i];
  os << "]";
  return os.str();
}

[[noreturn]] void bad(const char* call, const char* field, const std::string& what) {
  throw InvalidArgument(std::string("moelink: ") + call + ": " + field + " " + what);
}

void require_same_as_shared(const char* call, const char* field, int64_t mine, int64_t theirs) {
  if (mine != theirs)
    throw InvalidArgument(std::string("moelink: ") + call + ": share_with has " + field + " = " +
                          std::to_string(theirs) + ", this layer " + std::to_string(mine) +
                          " (layers share scratch only with the same shapes and options)");
}

// Checks ndim, dtype and the trailing dimensions; returns shape[0].
int64_t check_tensor(const char* call, const char* field, const Tensor& t,
                     std::initializer_list<DType> dtypes, std::initializer_list<int64_t> tail,
                     bool row_contiguous) {
  if (!t.defined()) bad(call, field, "is missing (null data pointer)");
  const int ndim = static_cast<int>(tail.size()) + 1;
  if (t.ndim != ndim)
    bad(call, field,
        "has " + std::to_string(t.ndim) + " dimensions " + shape_str(t) + ", expected " +
            std::to_string(ndim));
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok |= d == t.dtype;
  if (!dtype_ok) {
    std::string allowed;
    for (DType d : dtypes) allowed += (allowed.empty() ? "" : " or ") + std::string(dtype_name(d));
    bad(call, field, "has dtype " + std::string(dtype_name(t.dtype)) + ", expected " + allowed);
  }
  int i = 1;
  for (int64_t want : tail) {
    if (t.shape[i] != want)
      bad(call, field,
          "has shape " + shape_str(t) + ": dimension " + std::to_string(i) + " must be " +
              std::to_string(want));
    ++i;
  }
  if (t.shape[0] < 0) bad(call, field, "has negative shape " + shape_str(t));
  if (row_contiguous) check_rows_aligned(call, field, t, 16);
  return t.shape[0];
}

void check_rows_aligned(const char* call, const char* field, const Tensor& t, int align) {
  const int ndim = t.ndim;
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  if (t.stride[ndim - 1] != 1)
    bad(call, field, "must have stride 1 in its last dimension, got " +
                         std::to_string(t.stride[ndim - 1]));
  const std::string a = std::to_string(align);
  if (reinterpret_cast<uintptr_t>(t.data) % align != 0)
    bad(call, field, "data pointer must be " + a + "-byte aligned");
  for (int d = 0; d < ndim - 1; ++d)
    if ((t.stride[d] * es) % align != 0)
      bad(call, field,
          "stride " + std::to_string(t.stride[d]) + " of dimension " + std::to_string(d) +
              " must be a multiple of " + a + " bytes");
}

}  // namespace moelink::detail
