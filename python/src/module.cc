// moelink._C: the nanobind extension module. The friendly layer (process
// groups, stream discovery, torch/numpy dtype objects) is in moelink/*.py;
// this file binds the C++ API one to one and converts tensors.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/trampoline.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "attention_binding.h"
#include "experts_binding.h"
#include "fabric_binding.h"
#include "layer_binding.h"
#include "model_binding.h"
#if defined(MOELINK_WITH_ENGINE)
#include "engine_binding.h"
#endif
#include "moelink/moelink.h"
#include "tensor_convert.h"

#if defined(MOELINK_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace moelink::python {
namespace {

// ------------------------------------------------------------------ errors

PyObject* g_error = nullptr;             // moelink.Error(RuntimeError)
PyObject* g_invalid_argument = nullptr;  // moelink.InvalidArgument(Error, ValueError)
PyObject* g_input_error = nullptr;       // moelink.InputError(Error)
PyObject* g_timeout_error = nullptr;     // moelink.TimeoutError(Error, builtins.TimeoutError)
PyObject* g_system_error = nullptr;      // moelink.SystemError(Error)

PyObject* new_exception(nb::module_& m, const char* name, const char* doc, nb::handle bases) {
  std::string qual = std::string("moelink.") + name;
  PyObject* tp = PyErr_NewExceptionWithDoc(qual.c_str(), doc, bases.ptr(), nullptr);
  if (tp == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(tp);  // the module holds the reference for good
  return tp;
}

void register_errors(nb::module_& m) {
  nb::module_ builtins = nb::module_::import_("builtins");
  g_error = new_exception(m, "Error", "Base class of every moelink error.",
                          nb::make_tuple(builtins.attr("RuntimeError")));
  g_invalid_argument = new_exception(
      m, "InvalidArgument",
      "A configuration field or call argument (shape, dtype, stride, device, call order) is "
      "invalid. Also a ValueError.",
      nb::make_tuple(nb::handle(g_error), builtins.attr("ValueError")));
  g_input_error = new_exception(
      m, "InputError",
      "The backend saw bad input while running (an expert id outside [0, num_experts), "
      "bound_m > max_num_tokens, more routes to an expert than it has rows). Raised by "
      "AllToAll.check(); the offending routes were dropped.",
      nb::make_tuple(nb::handle(g_error)));
  g_timeout_error = new_exception(
      m, "TimeoutError",
      "A peer did not arrive within the timeout. The AllToAll is unusable afterwards. Also a "
      "builtins.TimeoutError.",
      nb::make_tuple(nb::handle(g_error), builtins.attr("TimeoutError")));
  g_system_error = new_exception(m, "SystemError",
                                 "A CUDA, shared-memory or socket call failed.",
                                 nb::make_tuple(nb::handle(g_error)));

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(g_invalid_argument, e.what());
    } catch (const InputError& e) {
      PyErr_SetString(g_input_error, e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(g_timeout_error, e.what());
    } catch (const SystemError& e) {
      PyErr_SetString(g_system_error, e.what());
    } catch (const Error& e) {
      PyErr_SetString(g_error, e.what());
    }
  });
}

// ------------------------------------------------------------------ dtypes

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool dtype_from_name(std::string s, DType* out) {
  s = lower(s);
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "float8_e4m3" || s == "float8_e4m3fn" || s == "fp8" || s == "e4m3" ||
      s == "fp8_e4m3" || s == "float8")
    *out = DType::kFloat8E4M3;
  else if (s == "bfloat16" || s == "bf16")
    *out = DType::kBFloat16;
  else if (s == "float16" || s == "fp16" || s == "half")
    *out = DType::kFloat16;
  else if (s == "float32" || s == "fp32" || s == "float")
    *out = DType::kFloat32;
  else if (s == "int32")
    *out = DType::kInt32;
  else if (s == "uint32")
    *out = DType::kUInt32;
  else if (s == "int64")
    *out = DType::kInt64;
  else if (s == "uint8")
    *out = DType::kUInt8;
  else
    return false;
  return true;
}

// A dtype given as a string, a torch dtype, a numpy dtype or scalar type.
DType parse_dtype(nb::handle h, const char* field) {
  std::string name;
  if (nb::isinstance<nb::str>(h)) {
    name = nb::cast<std::string>(h);
  } else {
    // moelink/_dtypes.py knows torch and numpy (ml_dtypes) without importing
    // either unless the object comes from it.
    nb::object r = nb::module_::import_("moelink._dtypes").attr("dtype_name")(h);
    if (r.is_none())
      throw InvalidArgument(std::string("moelink: Config.") + field + ": " +
                            nb::cast<std::string>(nb::repr(h)) +
                            " is not a dtype; use a string such as 'bfloat16', 'float16' or "
                            "'float8_e4m3', or a torch / numpy dtype");
    name = nb::cast<std::string>(r);
  }
  DType d;
  if (!dtype_from_name(name, &d))
    throw InvalidArgument(std::string("moelink: Config.") + field + ": unknown dtype '" + name +
                          "'; expected 'float8_e4m3' ('fp8'), 'bfloat16' ('bf16') or "
                          "'float16' ('fp16')");
  return d;
}

// ------------------------------------------------------------------ bootstrap

// Lets Python classes implement moelink::Bootstrap:
//   rank() -> int, world_size() -> int, all_gather(data: bytes) -> bytes
// where all_gather returns the world_size contributions concatenated in rank
// order. Called from C++ with the GIL released; the trampoline takes it back.
class PyBootstrap : public Bootstrap {
 public:
  NB_TRAMPOLINE(Bootstrap);

  int rank() const override { NB_OVERRIDE_PURE(rank); }
  int world_size() const override { NB_OVERRIDE_PURE(world_size); }

  void all_gather(const void* in, void* out, size_t bytes) override {
    constexpr uint64_t hash = nb::detail::str_hash("all_gather");
    nb::detail::ticket ticket(nb_trampoline, "all_gather", hash, true);
    const int ws = world_size_locked();
    nb::bytes data(in, bytes);
    nb::object r = nb_trampoline.base().attr(ticket.key)(data);
    Py_buffer view;
    if (PyObject_GetBuffer(r.ptr(), &view, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      throw InvalidArgument(
          "moelink: Bootstrap.all_gather (Python) must return bytes, got " +
          nb::cast<std::string>(r.type().attr("__name__")));
    }
    const size_t want = bytes * static_cast<size_t>(ws);
    if (static_cast<size_t>(view.len) != want) {
      size_t got = static_cast<size_t>(view.len);
      PyBuffer_Release(&view);
      throw InvalidArgument("moelink: Bootstrap.all_gather (Python) returned " +
                            std::to_string(got) + " bytes, expected world_size * " +
                            std::to_string(bytes) + " = " + std::to_string(want));
    }
    if (want > 0) std::memcpy(out, view.buf, want);
    PyBuffer_Release(&view);
  }

  void barrier() override {
    constexpr uint64_t hash = nb::detail::str_hash("barrier");
    {
      nb::detail::ticket ticket(nb_trampoline, "barrier", hash, false);
      if (ticket.key.is_valid()) {
        nb_trampoline.base().attr(ticket.key)();
        return;
      }
    }
    Bootstrap::barrier();
  }

 private:
  // world_size() through Python while the GIL is already held.
  int world_size_locked() const {
    return nb::cast<int>(nb_trampoline.base().attr("world_size")());
  }
};

// A C++ bootstrap owned by a Python object (TcpBootstrap, EnvBootstrap).
class OwningBootstrap : public Bootstrap {
 public:
  explicit OwningBootstrap(std::unique_ptr<Bootstrap> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void all_gather(const void* in, void* out, size_t bytes) override {
    inner_->all_gather(in, out, bytes);
  }
  void barrier() override { inner_->barrier(); }

 private:
  std::unique_ptr<Bootstrap> inner_;
};

class TcpBootstrap : public OwningBootstrap {
 public:
  TcpBootstrap(int rank, int world_size, const std::string& host, int port, double timeout_s)
      : OwningBootstrap(make_tcp_bootstrap(rank, world_size, host, port, timeout_s)) {}
};

class EnvBootstrap : public OwningBootstrap {
 public:
  explicit EnvBootstrap(double timeout_s) : OwningBootstrap(make_env_bootstrap(timeout_s)) {}
};

// ------------------------------------------------------------------ all-to-all

Backend parse_backend(const std::string& s) {
  std::string l = lower(s);
  if (l == "cpu") return Backend::kCPU;
  if (l == "nvlink" || l == "cuda" || l == "gpu") return Backend::kNVLink;
  if (l == "nvshmem") return Backend::kNVSHMEM;
  if (l == "internode") return Backend::kInternode;
  if (l == "internode-cpu" || l == "internode_cpu") return Backend::kInternodeCPU;
  throw InvalidArgument("moelink: AllToAll: backend = '" + s +
                        "' must be 'nvlink', 'cpu', 'nvshmem', 'internode' or 'internode-cpu'");
}

class PyAllToAll {
 public:
  PyAllToAll(const Config& config, Bootstrap& bootstrap, const std::string& backend,
             int num_blocks, double timeout_s, int debug, const std::string& fabric_provider,
             int max_private_tokens, int profile, int fabric_nics, int node_size,
             int gpu_direct) {
    Options o;
    o.backend = parse_backend(backend);
    o.num_blocks = num_blocks;
    o.timeout_s = timeout_s;
    o.debug = debug;
    o.fabric_provider = fabric_provider;
    o.max_private_tokens = max_private_tokens;
    o.profile = profile;
    o.fabric_nics = fabric_nics;
    o.node_size = node_size;
    o.gpu_direct = gpu_direct;
    nb::gil_scoped_release release;
    if (!backend_uses_host_memory(o.backend)) {
#if defined(MOELINK_WITH_CUDA)
      device_ = current_cuda_device();
#endif
    }
    impl_ = AllToAll::create(config, bootstrap, o);
  }

  AllToAll& impl() {
    if (!impl_) throw InvalidArgument("moelink: AllToAll is closed");
    return *impl_;
  }

  ConvertContext context(const char* call) {
    ConvertContext ctx;
    ctx.call = call;
    ctx.place = backend_uses_host_memory(impl().backend()) ? Place::kHost : Place::kCuda;
    ctx.device_id = device_;
    return ctx;
  }

  void dispatch(nb::handle out_expert_num_tokens, nb::handle out_expert_x,
                nb::handle out_expert_x_scale, nb::handle dp_x, nb::handle dp_x_scale,
                nb::handle indices, nb::handle weights, nb::handle bound_m, bool do_send,
                bool do_recv, uintptr_t stream) {
    ConvertContext ctx = context("dispatch");
    // Scales may be None: the C++ checks name a missing one when
    // hidden_dim_scale > 0 and ignore them otherwise.
    Tensor t_num = to_tensor(ctx, out_expert_num_tokens, "out_expert_num_tokens", true);
    Tensor t_x = to_tensor(ctx, out_expert_x, "out_expert_x", true);
    Tensor t_xs = to_tensor(ctx, out_expert_x_scale, "out_expert_x_scale", true, true);
    Tensor t_dp = to_tensor(ctx, dp_x, "dp_x", false);
    Tensor t_dps = to_tensor(ctx, dp_x_scale, "dp_x_scale", false, true);
    Tensor t_idx = to_tensor(ctx, indices, "indices", false);
    Tensor t_w = to_tensor(ctx, weights, "weights", false);
    Tensor t_m = to_tensor(ctx, bound_m, "bound_m", false);
    AllToAll& a = impl();
    nb::gil_scoped_release release;
    a.dispatch(t_num, t_x, t_xs, t_dp, t_dps, t_idx, t_w, t_m,
               reinterpret_cast<cudaStream_t>(stream), do_send, do_recv);
  }

  void combine(nb::handle out_tokens, nb::handle indices, nb::handle weights,
               nb::handle expert_y, nb::handle bound_m, bool do_send, bool do_recv,
               bool accumulate, uintptr_t stream) {
    ConvertContext ctx = context("combine");
    Tensor t_out = to_tensor(ctx, out_tokens, "out_tokens", true);
    Tensor t_idx = to_tensor(ctx, indices, "indices", false);
    Tensor t_w = to_tensor(ctx, weights, "weights", false);
    Tensor t_y = to_tensor(ctx, expert_y, "expert_y", false);
    Tensor t_m = to_tensor(ctx, bound_m, "bound_m", false);
    AllToAll& a = impl();
    nb::gil_scoped_release release;
    a.combine(t_out, t_idx, t_w, t_y, t_m, reinterpret_cast<cudaStream_t>(stream), do_send,
              do_recv, accumulate);
  }

  void check() {
    AllToAll& a = impl();
    nb::gil_scoped_release release;
    a.check();
  }

  void close() {
    std::unique_ptr<AllToAll> p = std::move(impl_);
    nb::gil_scoped_release release;
    p.reset();
  }

  bool closed() const { return !impl_; }
  int device() const { return device_; }

 private:
  std::unique_ptr<AllToAll> impl_;
  int device_ = -1;
};

// ------------------------------------------------------------------ config

// The pickled state of a Config: its fields in declaration order, dtypes as
// their canonical names.
constexpr size_t kConfigStateSize = 10;

nb::tuple config_state(const Config& c) {
  return nb::make_tuple(c.max_num_tokens, c.num_experts, c.experts_per_token, c.hidden_dim,
                        c.hidden_dim_scale, std::string(dtype_name(c.in_dtype)),
                        std::string(dtype_name(c.out_dtype)), c.rank, c.world_size, c.dp_size);
}

bool same_config(const Config& a, const Config& b) {
  return a.max_num_tokens == b.max_num_tokens && a.num_experts == b.num_experts &&
         a.experts_per_token == b.experts_per_token && a.hidden_dim == b.hidden_dim &&
         a.hidden_dim_scale == b.hidden_dim_scale && a.in_dtype == b.in_dtype &&
         a.out_dtype == b.out_dtype && a.rank == b.rank && a.world_size == b.world_size &&
         a.dp_size == b.dp_size;
}

Config config_from_state(nb::handle state) {
  // nb::tuple's operator[] does not check bounds: check the shape first.
  if (!nb::isinstance<nb::tuple>(state) || nb::len(state) != kConfigStateSize)
    throw nb::type_error(("moelink: Config.__setstate__: expected a tuple of " +
                          std::to_string(kConfigStateSize) + " fields, got " +
                          nb::cast<std::string>(nb::repr(state)))
                             .c_str());
  nb::tuple t = nb::borrow<nb::tuple>(state);
  Config cfg;
  cfg.max_num_tokens = nb::cast<int64_t>(t[0]);
  cfg.num_experts = nb::cast<int>(t[1]);
  cfg.experts_per_token = nb::cast<int>(t[2]);
  cfg.hidden_dim = nb::cast<int64_t>(t[3]);
  cfg.hidden_dim_scale = nb::cast<int>(t[4]);
  cfg.in_dtype = parse_dtype(t[5], "in_dtype");
  cfg.out_dtype = parse_dtype(t[6], "out_dtype");
  cfg.rank = nb::cast<int>(t[7]);
  cfg.world_size = nb::cast<int>(t[8]);
  cfg.dp_size = nb::cast<int>(t[9]);
  return cfg;
}

void bind_config(nb::module_& m) {
  nb::class_<Config>(m, "Config",
                     "MoE shape and parallel layout of an AllToAll. Every field is a keyword "
                     "argument; dtypes are strings ('float8_e4m3'/'fp8', 'bfloat16'/'bf16', "
                     "'float16'/'fp16') or torch / numpy dtype objects.")
      .def(
          "__init__",
          [](Config* c, int64_t max_num_tokens, int num_experts, int experts_per_token,
             int64_t hidden_dim, int hidden_dim_scale, nb::handle in_dtype, nb::handle out_dtype,
             int rank, int world_size, int dp_size) {
            Config cfg;
            cfg.max_num_tokens = max_num_tokens;
            cfg.num_experts = num_experts;
            cfg.experts_per_token = experts_per_token;
            cfg.hidden_dim = hidden_dim;
            cfg.hidden_dim_scale = hidden_dim_scale;
            cfg.in_dtype = parse_dtype(in_dtype, "in_dtype");
            cfg.out_dtype = parse_dtype(out_dtype, "out_dtype");
            cfg.rank = rank;
            cfg.world_size = world_size;
            cfg.dp_size = dp_size;
            new (c) Config(cfg);
          },
          nb::kw_only(), "max_num_tokens"_a = 0, "num_experts"_a = 0, "experts_per_token"_a = 0,
          "hidden_dim"_a = 0, "hidden_dim_scale"_a = 0, "in_dtype"_a.none() = "bfloat16",
          "out_dtype"_a.none() = "bfloat16", "rank"_a = 0, "world_size"_a = 1, "dp_size"_a = 1)
      .def_rw("max_num_tokens", &Config::max_num_tokens)
      .def_rw("num_experts", &Config::num_experts)
      .def_rw("experts_per_token", &Config::experts_per_token)
      .def_rw("hidden_dim", &Config::hidden_dim)
      .def_rw("hidden_dim_scale", &Config::hidden_dim_scale)
      .def_prop_rw(
          "in_dtype", [](const Config& c) { return std::string(dtype_name(c.in_dtype)); },
          [](Config& c, nb::handle v) { c.in_dtype = parse_dtype(v, "in_dtype"); })
      .def_prop_rw(
          "out_dtype", [](const Config& c) { return std::string(dtype_name(c.out_dtype)); },
          [](Config& c, nb::handle v) { c.out_dtype = parse_dtype(v, "out_dtype"); })
      .def_rw("rank", &Config::rank)
      .def_rw("world_size", &Config::world_size)
      .def_rw("dp_size", &Config::dp_size)
      .def_prop_ro("num_local_experts", &Config::num_local_experts)
      .def_prop_ro("num_dp_groups", &Config::num_dp_groups)
      .def_prop_ro("dp_group", &Config::dp_group)
      .def_prop_ro("expert_capacity", &Config::expert_capacity)
      .def("validate", &Config::validate,
           "Raises ValueError naming the first field that breaks a rule.")
      .def("__repr__", &Config::to_string)
      // NotImplemented for other types (Python then falls back to identity:
      // `config == None` and `config == 3` are False, not a TypeError).
      .def(
          "__eq__",
          [](const Config& a, nb::handle b) -> nb::object {
            Config* o = nullptr;
            if (!nb::try_cast(b, o, false) || o == nullptr)
              return nb::borrow(Py_NotImplemented);
            return nb::bool_(same_config(a, *o));
          },
          "other"_a.none())
      .def("__copy__", [](const Config& c) { return Config(c); })
      .def("__deepcopy__", [](const Config& c, nb::handle) { return Config(c); }, "memo"_a)
      // Pickling (protocol >= 2): copyreg.__newobj__(Config) makes an
      // uninitialized instance, nanobind runs __setstate__ as its constructor.
      .def("__getstate__", [](const Config& c) { return config_state(c); })
      .def("__setstate__", [](Config& c, nb::handle state) {
        new (&c) Config(config_from_state(state));
      });
}

// ------------------------------------------------------------------ module

void bind_bootstrap(nb::module_& m) {
  nb::class_<Bootstrap, PyBootstrap>(
      m, "Bootstrap",
      "Setup-time collective. Subclass it in Python and define rank(), world_size() and "
      "all_gather(data: bytes) -> bytes (the world_size contributions concatenated in rank "
      "order); call super().__init__() first.")
      .def(nb::init<>())
      .def("rank", &Bootstrap::rank)
      .def("world_size", &Bootstrap::world_size)
      .def(
          "all_gather",
          [](Bootstrap& b, nb::bytes data) {
            std::string in(data.c_str(), data.size());
            std::string out;
            {
              nb::gil_scoped_release release;
              out.resize(in.size() * static_cast<size_t>(b.world_size()));
              b.all_gather(in.data(), out.data(), in.size());
            }
            return nb::bytes(out.data(), out.size());
          },
          "data"_a)
      .def("barrier", &Bootstrap::barrier, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<TcpBootstrap, Bootstrap>(
      m, "TcpBootstrap",
      "TCP rendezvous: rank 0 listens on host:port, the others connect. Blocks until every "
      "rank arrived (moelink.TimeoutError naming the missing ranks after timeout_s).")
      .def(nb::init<int, int, const std::string&, int, double>(), "rank"_a, "world_size"_a,
           "host"_a = "127.0.0.1", "port"_a = 29500, "timeout_s"_a = 60.0,
           nb::call_guard<nb::gil_scoped_release>());

  nb::class_<EnvBootstrap, Bootstrap>(
      m, "EnvBootstrap",
      "TCP rendezvous configured from torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR "
      "(default 127.0.0.1), MASTER_PORT (default 29500).")
      .def(nb::init<double>(), "timeout_s"_a = 60.0, nb::call_guard<nb::gil_scoped_release>());

  m.def("env_local_rank", &env_local_rank, "fallback"_a = 0,
        "LOCAL_RANK from the environment, else `fallback`.");
}

void bind_all_to_all(nb::module_& m) {
  nb::class_<PyAllToAll>(m, "AllToAll",
                         "Low-level binding; use moelink.AllToAll, which resolves the "
                         "bootstrap and the CUDA stream.")
      .def(nb::init<const Config&, Bootstrap&, const std::string&, int, double, int,
                    const std::string&, int, int, int, int, int>(),
           "config"_a, "bootstrap"_a, "backend"_a = "nvlink", "num_blocks"_a = 0,
           "timeout_s"_a = -1.0, "debug"_a = -1, "fabric_provider"_a = "",
           "max_private_tokens"_a = -1, "profile"_a = -1, "fabric_nics"_a = 0, "node_size"_a = -1,
           "gpu_direct"_a = -1,
           nb::keep_alive<1, 3>())
      .def("dispatch", &PyAllToAll::dispatch, "out_expert_num_tokens"_a, "out_expert_x"_a,
           "out_expert_x_scale"_a.none(), "dp_x"_a, "dp_x_scale"_a.none(), "indices"_a,
           "weights"_a, "bound_m"_a, "do_send"_a = true, "do_recv"_a = true, "stream"_a = 0)
      .def("combine", &PyAllToAll::combine, "out_tokens"_a, "indices"_a, "weights"_a,
           "expert_y"_a, "bound_m"_a, "do_send"_a = true, "do_recv"_a = true,
           "accumulate"_a = false, "stream"_a = 0)
      .def("check", &PyAllToAll::check)
      .def("reset_call_order", [](PyAllToAll& a) { a.impl().reset_call_order(); })
      .def("phase_times",
           [](PyAllToAll& a) {
             CallTimes t;
             {
               nb::gil_scoped_release release;
               t = a.impl().phase_times();
             }
             auto phases = [](const PhaseTimes& p) {
               nb::dict d;
               d["pack_us"] = p.pack_us;
               d["post_us"] = p.post_us;
               d["wire_us"] = p.wire_us;
               d["unpack_us"] = p.unpack_us;
               return d;
             };
             nb::dict d;
             d["dispatch"] = phases(t.dispatch);
             d["combine"] = phases(t.combine);
             return d;
           })
      .def("close", &PyAllToAll::close)
      .def_prop_ro("closed", &PyAllToAll::closed)
      .def_prop_ro("device", &PyAllToAll::device,
                   "CUDA device the nvlink backend was created on (-1 for cpu)")
      .def_prop_ro("config", [](PyAllToAll& a) { return a.impl().config(); })
      .def_prop_ro("backend", [](PyAllToAll& a) { return backend_name(a.impl().backend()); })
      .def_prop_ro("buffer_bytes", [](PyAllToAll& a) { return a.impl().buffer_bytes(); });
}

}  // namespace
}  // namespace moelink::python

NB_MODULE(_C, m) {
  using namespace moelink::python;
  m.doc() = "moelink C++ bindings (use the moelink package)";
  m.attr("version") = moelink::version();
#if defined(NDEBUG)
  // Objects still referenced from __main__ at interpreter exit (an AllToAll
  // over a Python Bootstrap subclass, say) outlive this module's teardown;
  // nanobind would report them as leaks. Debug builds keep the check.
  nb::set_leak_warnings(false);
#endif
  register_errors(m);
  bind_config(m);
  bind_bootstrap(m);
  bind_all_to_all(m);
  bind_experts(m);
  bind_attention(m);
  bind_moe_layer(m);
  bind_model(m);
#if defined(MOELINK_WITH_ENGINE)
  bind_engine(m);
#endif
  m.attr("with_engine") = nb::bool_(
#if defined(MOELINK_WITH_ENGINE)
      true
#else
      false
#endif
  );
  bind_fabric(m);

#if defined(MOELINK_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
#if defined(MOELINK_WITH_FABRIC)
  m.attr("with_fabric") = true;
#else
  m.attr("with_fabric") = false;
#endif
  m.def("cuda_get_device", []() {
#if defined(MOELINK_WITH_CUDA)
    return current_cuda_device();
#else
    throw moelink::InvalidArgument("moelink was built without CUDA");
#endif
  });
  m.def(
      "cuda_set_device",
      [](int d) {
#if defined(MOELINK_WITH_CUDA)
        cudaError_t e = cudaSetDevice(d);
        if (e != cudaSuccess)
          throw moelink::SystemError(std::string("moelink: cudaSetDevice(") +
                                     std::to_string(d) + ") failed: " + cudaGetErrorString(e));
#else
        (void)d;
        throw moelink::InvalidArgument("moelink was built without CUDA");
#endif
      },
      "device"_a);
}
