// Checks of call arguments and environment variables shared by the public
// API's front ends (AllToAll, Experts): every failure throws InvalidArgument
// naming the call, the field, the value seen and the rule.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "moelink/types.h"

namespace moelink::detail {

// Environment variables: unset or empty gives the fallback; anything else
// must parse and lie in range.
double env_double(const char* name, double fallback);  // > 0 seconds
int env_int(const char* name, int fallback, int lo, int hi);
bool env_flag(const char* name);  // set, non-empty and not "0"

std::string shape_str(const Tensor& t);  // "[2, 3]"

[[noreturn]] void bad(const char* call, const char* field, const std::string& what);

// A layer made with share_with (MoELayer, MLAAttention) needs the field that
// sized the scratch it takes to be the same as the other layer's: `call`
// ("MoELayer.create") refuses another value, naming both.
void require_same_as_shared(const char* call, const char* field, int64_t mine, int64_t theirs);

// Checks ndim, dtype and the trailing dimensions; returns shape[0]. With
// row_contiguous also stride 1 in the last dimension, a 16-byte aligned
// pointer and strides of multiples of 16 bytes.
int64_t check_tensor(const char* call, const char* field, const Tensor& t,
                     std::initializer_list<DType> dtypes, std::initializer_list<int64_t> tail,
                     bool row_contiguous);

// Rows of `t` start `align` bytes apart at least: stride 1 in the last
// dimension, pointer and other strides multiples of `align` bytes.
void check_rows_aligned(const char* call, const char* field, const Tensor& t, int align);

}  // namespace moelink::detail
