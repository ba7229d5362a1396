#include "moelink/config.h"

#include <sstream>

#include "moelink/errors.h"

namespace moelink {

namespace {

[[noreturn]] void fail(const char* field, int64_t value, const std::string& rule) {
  std::ostringstream os;
  os << "moelink: invalid config: " << field << " = " << value << ": " << rule;
  throw InvalidArgument(os.str());
}

}  // namespace

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
    case DType::kUInt32: return "uint32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

Tensor Tensor::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

void Config::validate() const {
  if (world_size < 1) fail("world_size", world_size, "must be >= 1");
  if (rank < 0 || rank >= world_size)
    fail("rank", rank, "must be in [0, world_size = " + std::to_string(world_size) + ")");
  if (dp_size < 1 || world_size % dp_size != 0)
    fail("dp_size", dp_size,
         "must be >= 1 and divide world_size = " + std::to_string(world_size));
  if (max_num_tokens < 1 || max_num_tokens > (1 << 20))
    fail("max_num_tokens", max_num_tokens, "must be in [1, 1048576]");
  if (num_experts < 1 || num_experts > 65536)
    fail("num_experts", num_experts, "must be in [1, 65536]");
  if (num_experts % world_size != 0)
    fail("num_experts", num_experts,
         "must be divisible by world_size = " + std::to_string(world_size));
  if (experts_per_token < 1 || experts_per_token > 16)
    fail("experts_per_token", experts_per_token, "must be in [1, 16]");
  if (hidden_dim < 16 || hidden_dim % 16 != 0 || hidden_dim > (1 << 20))
    fail("hidden_dim", hidden_dim, "must be a multiple of 16 in [16, 1048576]");
  if (in_dtype != DType::kFloat8E4M3 && in_dtype != DType::kBFloat16 &&
      in_dtype != DType::kFloat16)
    fail("in_dtype", static_cast<int>(in_dtype),
         std::string("(") + std::string(dtype_name(in_dtype)) +
             ") must be float8_e4m3, bfloat16 or float16");
  if (out_dtype != DType::kBFloat16 && out_dtype != DType::kFloat16)
    fail("out_dtype", static_cast<int>(out_dtype),
         std::string("(") + std::string(dtype_name(out_dtype)) + ") must be bfloat16 or float16");
  if (in_dtype == DType::kFloat8E4M3) {
    if (hidden_dim_scale < 1 || hidden_dim_scale > hidden_dim)
      fail("hidden_dim_scale", hidden_dim_scale,
           "must be in [1, hidden_dim] when in_dtype is float8_e4m3");
  } else if (hidden_dim_scale != 0) {
    fail("hidden_dim_scale", hidden_dim_scale, "must be 0 when in_dtype is not float8_e4m3");
  }
}

std::string Config::to_string() const {
  std::ostringstream os;
  os << "Config(max_num_tokens=" << max_num_tokens << ", num_experts=" << num_experts
     << ", experts_per_token=" << experts_per_token << ", hidden_dim=" << hidden_dim
     << ", hidden_dim_scale=" << hidden_dim_scale << ", in_dtype=" << dtype_name(in_dtype)
     << ", out_dtype=" << dtype_name(out_dtype) << ", rank=" << rank
     << ", world_size=" << world_size << ", dp_size=" << dp_size << ")";
  return os.str();
}

}  // namespace moelink
