#include "layer/checkpoint.h"

#include <cstring>
#include <sstream>

#include "core/float_convert.h"
#include "layer/block_quant.h"
#include "moelink/errors.h"

namespace moelink::detail::layer {
namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

// Tensor lookups with the messages a user needs: which call, which tensor,
// which file, what was expected.
class Reader {
 public:
  Reader(const SafetensorsDir& dir, std::string caller) : dir_(dir), caller_(std::move(caller)) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument("moelink: " + caller_ + ": " + what);
  }

  const SafetensorEntry& entry(const std::string& name, const std::vector<int64_t>& shape) const {
    const SafetensorEntry* e = dir_.find(name);
    if (e == nullptr) {
      std::string files;
      for (const std::string& f : dir_.files()) files += (files.empty() ? "" : ", ") + f;
      fail("tensor " + name + " is in none of the files of " + dir_.directory() + " (" + files + ")");
    }
    if (e->shape != shape)
      fail("tensor " + name + " in " + e->file + " has shape " + shape_text(e->shape) +
           ", expected " + shape_text(shape));
    return *e;
  }

  bool has(const std::string& name) const { return dir_.find(name) != nullptr; }

  // A weight as floats (BF16, F16, F32) or null when it is fp8 (F8_E4M3).
  bool is_fp8(const SafetensorEntry& e, const std::string& name) const {
    if (e.dtype == "F8_E4M3") return true;
    if (e.dtype == "BF16" || e.dtype == "F16" || e.dtype == "F32") return false;
    fail("tensor " + name + " in " + e.file + " has dtype " + e.dtype +
         ", expected F8_E4M3 (with weight_scale_inv), BF16, F16 or F32");
  }

  std::vector<float> floats(const SafetensorEntry& e) const {
    std::vector<char> raw(e.bytes);
    dir_.read(e, raw.data());
    return decode(e, raw);
  }

  static std::vector<float> decode(const SafetensorEntry& e, const std::vector<char>& raw) {
    const size_t n = e.dtype == "F32" ? raw.size() / 4 : raw.size() / 2;
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) {
      if (e.dtype == "F32") {
        std::memcpy(&out[i], raw.data() + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, raw.data() + 2 * i, 2);
        out[i] = e.dtype == "BF16" ? bf16_to_f32(h) : f16_to_f32(h);
      }
    }
    return out;
  }

  void read(const SafetensorEntry& e, void* out) const { dir_.read(e, out); }

  // Elements [first, first + count) of a BF16 / F16 / F32 tensor as floats.
  std::vector<float> floats(const SafetensorEntry& e, int64_t first, int64_t count) const {
    const int64_t es = e.dtype == "F32" ? 4 : 2;
    std::vector<char> raw(static_cast<size_t>(count * es));
    dir_.read(e, static_cast<uint64_t>(first * es), raw.size(), raw.data());
    return decode(e, raw);
  }

 private:
  const SafetensorsDir& dir_;
  const std::string caller_;
};

// One projection [n, k] of the checkpoint into q (fp8, n * k bytes) and
// scale ([n/128, k/128]): copied when fp8, quantized otherwise.
void read_projection(const Reader& r, const std::string& name, int64_t n, int64_t k, uint8_t* q,
                     float* scale) {
  const SafetensorEntry& e = r.entry(name + ".weight", {n, k});
  if (r.is_fp8(e, name + ".weight")) {
    r.read(e, q);
    const SafetensorEntry& s = r.entry(name + ".weight_scale_inv", {n / 128, k / 128});
    if (s.dtype != "F32")
      r.fail("tensor " + name + ".weight_scale_inv in " + s.file + " has dtype " + s.dtype +
             ", expected F32");
    r.read(s, scale);
  } else {
    const std::vector<float> w = r.floats(e);
    quantize_weight_blocks(w.data(), n, k, q, scale);
  }
}

// gate_proj, up_proj and down_proj under `prefix` as fp8 blocks.
HostMlpWeights read_mlp(const Reader& r, const std::string& prefix, int64_t I, int64_t H) {
  const int64_t proj = I * H, scales = (I / 128) * (H / 128);
  HostMlpWeights m;
  m.w13.resize(static_cast<size_t>(2 * proj));
  m.w13_scale.resize(static_cast<size_t>(2 * scales));
  m.w2.resize(static_cast<size_t>(proj));
  m.w2_scale.resize(static_cast<size_t>(scales));
  read_projection(r, prefix + "gate_proj", I, H, m.w13.data(), m.w13_scale.data());
  read_projection(r, prefix + "up_proj", I, H, m.w13.data() + proj, m.w13_scale.data() + scales);
  read_projection(r, prefix + "down_proj", H, I, m.w2.data(), m.w2_scale.data());
  return m;
}

}  // namespace

MoEWeights HostLayerWeights::view(const MoEModelConfig& m, int L) {
  const int64_t E = m.n_routed_experts, H = m.hidden_size, I = m.moe_intermediate_size,
                Is = m.shared_intermediate_size();
  MoEWeights w;
  w.gate = Tensor::contiguous(gate.data(), gate_dtype, {E, H});
  if (!gate_bias.empty()) w.gate_bias = Tensor::contiguous(gate_bias.data(), DType::kFloat32, {E});
  w.w13 = Tensor::contiguous(w13.data(), DType::kFloat8E4M3, {L, 2 * I, H});
  w.w13_scale = Tensor::contiguous(w13_scale.data(), DType::kFloat32, {L, 2 * I / 128, H / 128});
  w.w2 = Tensor::contiguous(w2.data(), DType::kFloat8E4M3, {L, H, I});
  w.w2_scale = Tensor::contiguous(w2_scale.data(), DType::kFloat32, {L, H / 128, I / 128});
  if (Is > 0) {
    w.shared_w13 = Tensor::contiguous(shared_w13.data(), DType::kFloat8E4M3, {2 * Is, H});
    w.shared_w13_scale = Tensor::contiguous(shared_w13_scale.data(), DType::kFloat32, {2 * Is / 128, H / 128});
    w.shared_w2 = Tensor::contiguous(shared_w2.data(), DType::kFloat8E4M3, {H, Is});
    w.shared_w2_scale = Tensor::contiguous(shared_w2_scale.data(), DType::kFloat32, {H / 128, Is / 128});
  }
  return w;
}

HostLayerWeights read_layer_weights(const SafetensorsDir& dir, const MoEModelConfig& m, int layer,
                                    int rank, int L) {
  const Reader r(dir, "MoELayer.load_checkpoint");
  const bool mixtral = m.checkpoint_naming == "mixtral";
  const std::string prefix =
      "model.layers." + std::to_string(layer) + (mixtral ? ".block_sparse_moe." : ".mlp.");
  const char* gate_name = mixtral ? "w1" : "gate_proj";
  const char* up_name = mixtral ? "w3" : "up_proj";
  const char* down_name = mixtral ? "w2" : "down_proj";
  const int64_t E = m.n_routed_experts, H = m.hidden_size, I = m.moe_intermediate_size,
                Is = m.shared_intermediate_size();
  HostLayerWeights w;

  // Router: kept as stored (bf16 or fp32; fp16 widened to fp32).
  const SafetensorEntry& g = r.entry(prefix + "gate.weight", {E, H});
  if (g.dtype == "BF16") {
    w.gate.resize(g.bytes);
    r.read(g, w.gate.data());
    w.gate_dtype = DType::kBFloat16;
  } else if (g.dtype == "F32" || g.dtype == "F16") {
    const std::vector<float> f = r.floats(g);
    w.gate.resize(f.size() * 4);
    std::memcpy(w.gate.data(), f.data(), w.gate.size());
    w.gate_dtype = DType::kFloat32;
  } else {
    r.fail("tensor " + prefix + "gate.weight in " + g.file + " has dtype " + g.dtype +
           ", expected BF16, F16 or F32");
  }
  if (m.score_correction_bias) {
    const SafetensorEntry& b = r.entry(prefix + "gate.e_score_correction_bias", {E});
    w.gate_bias = r.floats(b);
  }

  // This rank's experts: w13 = [gate_proj; up_proj], w2 = down_proj.
  w.w13.resize(static_cast<size_t>(L * 2 * I * H));
  w.w13_scale.resize(static_cast<size_t>(L * (2 * I / 128) * (H / 128)));
  w.w2.resize(static_cast<size_t>(L * H * I));
  w.w2_scale.resize(static_cast<size_t>(L * (H / 128) * (I / 128)));
  const int64_t proj = I * H, proj_scales = (I / 128) * (H / 128);
  // transformers' in-memory layout, when a checkpoint keeps it: the experts
  // stacked as experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I].
  if (!mixtral && !r.has(prefix + "experts.0." + gate_name + ".weight") &&
      r.has(prefix + "experts.gate_up_proj")) {
    const SafetensorEntry& gu = r.entry(prefix + "experts.gate_up_proj", {E, 2 * I, H});
    const SafetensorEntry& dn = r.entry(prefix + "experts.down_proj", {E, H, I});
    for (const SafetensorEntry* e : {&gu, &dn})
      if (r.is_fp8(*e, prefix + "experts (stacked)"))
        r.fail("tensor " + prefix + "experts.gate_up_proj / down_proj in " + e->file +
               " is fp8 without per-expert scales; stacked experts are read as BF16, F16 or F32");
    for (int j = 0; j < L; ++j) {
      const int64_t e = static_cast<int64_t>(rank) * L + j;
      const std::vector<float> a = r.floats(gu, e * 2 * proj, 2 * proj);
      quantize_weight_blocks(a.data(), 2 * I, H, w.w13.data() + j * 2 * proj,
                             w.w13_scale.data() + j * 2 * proj_scales);
      const std::vector<float> b = r.floats(dn, e * proj, proj);
      quantize_weight_blocks(b.data(), H, I, w.w2.data() + j * proj, w.w2_scale.data() + j * proj_scales);
    }
  } else {
    for (int j = 0; j < L; ++j) {
      const std::string e = prefix + "experts." + std::to_string(rank * L + j) + ".";
      uint8_t* q13 = w.w13.data() + j * 2 * proj;
      float* s13 = w.w13_scale.data() + j * 2 * proj_scales;
      read_projection(r, e + gate_name, I, H, q13, s13);
      read_projection(r, e + up_name, I, H, q13 + proj, s13 + proj_scales);
      read_projection(r, e + down_name, H, I, w.w2.data() + j * proj, w.w2_scale.data() + j * proj_scales);
    }
  }

  if (Is > 0) {
    HostMlpWeights s = read_mlp(r, prefix + "shared_experts.", Is, H);
    w.shared_w13 = std::move(s.w13);
    w.shared_w13_scale = std::move(s.w13_scale);
    w.shared_w2 = std::move(s.w2);
    w.shared_w2_scale = std::move(s.w2_scale);
  }
  return w;
}

HostMlpWeights read_mlp_weights(const SafetensorsDir& dir, const std::string& prefix, int64_t I,
                                int64_t H, const std::string& caller) {
  return read_mlp(Reader(dir, caller), prefix, I, H);
}

std::vector<float> read_float_tensor(const SafetensorsDir& dir, const std::string& name,
                                     const std::vector<int64_t>& shape, const std::string& caller) {
  const Reader r(dir, caller);
  const SafetensorEntry& e = r.entry(name, shape);
  if (e.dtype != "BF16" && e.dtype != "F16" && e.dtype != "F32")
    r.fail("tensor " + name + " in " + e.file + " has dtype " + e.dtype + ", expected BF16, F16 or F32");
  return r.floats(e);
}

}  // namespace moelink::detail::layer
