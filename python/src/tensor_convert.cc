#include "tensor_convert.h"

#include <nanobind/stl/string.h>

#include <string>

#include "moelink/errors.h"

#if defined(MOELINK_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace moelink::python {

namespace {

namespace dl = nb::dlpack;

const char* device_name(int device_type) {
  switch (device_type) {
    case 1: return "cpu";
    case 2: return "cuda";
    case 3: return "cuda_host (pinned)";
    case 4: return "opencl";
    case 7: return "vulkan";
    case 8: return "metal";
    case 10: return "rocm";
    case 13: return "cuda_managed";
    case 14: return "oneapi";
    default: return "unknown";
  }
}

std::string dlpack_dtype_str(const dl::dtype& dt) {
  const char* code = "?";
  switch (static_cast<dl::dtype_code>(dt.code)) {
    case dl::dtype_code::Int: code = "int"; break;
    case dl::dtype_code::UInt: code = "uint"; break;
    case dl::dtype_code::Float: code = "float"; break;
    case dl::dtype_code::Bfloat: code = "bfloat"; break;
    case dl::dtype_code::Complex: code = "complex"; break;
    case dl::dtype_code::Bool: code = "bool"; break;
    case dl::dtype_code::Float8_E4M3FN: code = "float8_e4m3fn"; break;
    case dl::dtype_code::Float8_E5M2: code = "float8_e5m2"; break;
    default: code = "dlpack code "; break;
  }
  std::string s = code;
  if (s == "dlpack code ") s += std::to_string(dt.code) + " bits ";
  if (s.rfind("float8", 0) != 0) s += std::to_string(dt.bits);
  if (dt.lanes != 1) s += "x" + std::to_string(dt.lanes);
  return s;
}

// str(h) as Python computes it (nb::str(accessor) only borrows).
std::string py_str(nb::handle h) {
  nb::object s = nb::steal(PyObject_Str(h.ptr()));
  if (!s.is_valid()) throw nb::python_error();
  return nb::cast<std::string>(s);
}

[[noreturn]] void bad(const ConvertContext& ctx, const char* name, const std::string& what) {
  throw InvalidArgument("moelink: " + ctx.call + ": " + name + " " + what);
}

// Name of the element type of an array-like object as its framework spells
// it, without a "torch." prefix; empty when it has no dtype.
std::string framework_dtype_name(nb::handle obj) {
  if (!nb::hasattr(obj, "dtype")) return {};
  std::string s = py_str(obj.attr("dtype"));
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  return s;
}

bool is_torch_tensor(nb::handle obj) {
  nb::handle tp = obj.type();
  if (!nb::hasattr(tp, "__module__")) return false;
  std::string mod = py_str(tp.attr("__module__"));
  return mod.rfind("torch", 0) == 0;
}

// numpy (ml_dtypes) and older torch versions cannot export float8 (and numpy
// bfloat16) through DLPack. Reinterpret those as raw unsigned integers of the
// same width; the caller then restores the real DType.
nb::object raw_view(nb::handle obj, int bits) {
  if (is_torch_tensor(obj)) {
    nb::module_ torch = nb::module_::import_("torch");
    return obj.attr("view")(torch.attr(bits == 8 ? "uint8" : "int16"));
  }
  return obj.attr("view")(bits == 8 ? "uint8" : "uint16");
}

template <typename Array>
Tensor fill(const ConvertContext& ctx, const Array& a, const char* name, DType* override_dtype) {
  Tensor t;
  const int ndim = static_cast<int>(a.ndim());
  if (ndim > 3)
    bad(ctx, name, "has " + std::to_string(ndim) + " dimensions; moelink takes at most 3");
  const int dev = a.device_type();
  if (ctx.place == Place::kAny) {
    const bool host = dev == nb::device::cpu::value || dev == nb::device::cuda_host::value;
    if (!host && dev != nb::device::cuda::value)
      bad(ctx, name, std::string("is on device ") + device_name(dev) + ", expected host or CUDA memory");
    if (!host && ctx.device_id >= 0 && a.device_id() != ctx.device_id)
      bad(ctx, name, "is on cuda:" + std::to_string(a.device_id()) + ", but this object was created on cuda:" +
                         std::to_string(ctx.device_id));
  } else if (ctx.place == Place::kCuda) {
    if (dev != nb::device::cuda::value)
      bad(ctx, name,
          std::string("is on device ") + device_name(dev) +
              ", but the nvlink backend needs CUDA device tensors");
    if (ctx.device_id >= 0 && a.device_id() != ctx.device_id)
      bad(ctx, name,
          "is on cuda:" + std::to_string(a.device_id()) + ", but this AllToAll was created on cuda:" +
              std::to_string(ctx.device_id));
  } else {
    if (dev != nb::device::cpu::value && dev != nb::device::cuda_host::value)
      bad(ctx, name,
          std::string("is on device ") + device_name(dev) +
              ", but the cpu backend needs host (CPU) tensors");
  }
  const dl::dtype dt = a.dtype();
  if (override_dtype != nullptr) {
    t.dtype = *override_dtype;
  } else if (!dtype_from_dlpack(dt, &t.dtype)) {
    bad(ctx, name,
        "has dtype " + dlpack_dtype_str(dt) +
            ", which moelink does not take (float8_e4m3fn or uint8, bfloat16, float16, "
            "float32, int32, uint32, int64)");
  }
  t.ndim = ndim;
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  for (int i = 0; i < ndim; ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.stride[i] = static_cast<int64_t>(a.stride(i));
  }
  return t;
}

template <typename Array>
bool import_array(nb::handle obj, Array& out) {
  // No conversion: a copy would silently detach outputs from the caller's
  // tensors.
  return nb::try_cast(obj, out, false);
}

template <typename Array>
Tensor convert(ConvertContext& ctx, nb::handle obj, const char* name, std::vector<Array>& keep) {
  Array a;
  if (import_array(obj, a)) {
    keep.push_back(a);
    return fill(ctx, a, name, nullptr);
  }
  // Fallback for fp8 / bf16 that the framework cannot export.
  std::string dname = framework_dtype_name(obj);
  DType real;
  int bits = 0;
  if (dname == "float8_e4m3fn" || dname == "float8_e4m3") {
    real = DType::kFloat8E4M3;
    bits = 8;
  } else if (dname == "bfloat16") {
    real = DType::kBFloat16;
    bits = 16;
  }
  if (bits != 0 && nb::hasattr(obj, "view")) {
    nb::object view;
    try {
      view = raw_view(obj, bits);
    } catch (nb::python_error&) {
      view = nb::object();
    }
    if (view.is_valid() && import_array(view, a)) {
      ctx.holder.views.push_back(view);
      keep.push_back(a);
      return fill(ctx, a, name, &real);
    }
  }
  if (!dname.empty())
    bad(ctx, name,
        "(a " + py_str(obj.type().attr("__name__")) + " of dtype " +
            dname +
            ") could not be read through DLPack or the buffer protocol (unsupported dtype, "
            "a read-only array passed as an output, or a torch tensor that requires grad: "
            "detach it)");
  throw nb::type_error(("moelink: " + ctx.call + ": " + name +
                        " must be a tensor or array (DLPack or buffer protocol), got " +
                        py_str(obj.type().attr("__name__")))
                           .c_str());
}

}  // namespace

bool dtype_from_dlpack(const dl::dtype& dt, DType* out) {
  if (dt.lanes != 1) return false;
  switch (static_cast<dl::dtype_code>(dt.code)) {
    case dl::dtype_code::Float:
      if (dt.bits == 16) *out = DType::kFloat16;
      else if (dt.bits == 32) *out = DType::kFloat32;
      else return false;
      return true;
    case dl::dtype_code::Bfloat:
      if (dt.bits != 16) return false;
      *out = DType::kBFloat16;
      return true;
    case dl::dtype_code::Int:
      if (dt.bits == 32) *out = DType::kInt32;
      else if (dt.bits == 64) *out = DType::kInt64;
      else return false;
      return true;
    case dl::dtype_code::UInt:
      if (dt.bits == 8) *out = DType::kUInt8;
      else if (dt.bits == 32) *out = DType::kUInt32;
      else return false;
      return true;
    case dl::dtype_code::Float8_E4M3FN:
      if (dt.bits != 8) return false;
      *out = DType::kFloat8E4M3;
      return true;
    default: return false;
  }
}

Tensor to_tensor(ConvertContext& ctx, nb::handle obj, const char* name, bool writable,
                 bool optional) {
  if (obj.is_none()) {
    if (optional) return Tensor{};
    throw nb::type_error(
        ("moelink: " + ctx.call + ": " + name + " is None, but a tensor is required").c_str());
  }
  if (writable) return convert(ctx, obj, name, ctx.holder.rw);
  return convert(ctx, obj, name, ctx.holder.ro);
}

int current_cuda_device() {
#if defined(MOELINK_WITH_CUDA)
  int d = -1;
  cudaError_t e = cudaGetDevice(&d);
  if (e != cudaSuccess)
    throw SystemError(std::string("moelink: cudaGetDevice failed: ") + cudaGetErrorString(e));
  return d;
#else
  return -1;
#endif
}

}  // namespace moelink::python
