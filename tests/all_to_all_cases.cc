#include "all_to_all_cases.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <typeinfo>

#include "rank_harness.h"
#include "ref_dtype.h"

namespace moelink_test {

using moelink::DType;
using moelink::Tensor;

// ------------------------------------------------------------ host memory

namespace {

class HostMemoryOps : public MemoryOps {
 public:
  void* alloc(size_t bytes) override {
    void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void free(void* p) override { std::free(p); }
  void h2d(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);  // src may be null when empty
  }
  void d2h(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void fill(void* dst, uint8_t byte, size_t bytes) override { std::memset(dst, byte, bytes); }
  cudaStream_t stream() override { return nullptr; }
  void sync() override {}
  void other_work() override {
    // Something unrelated between the halves: touch a scratch buffer.
    scratch_.assign(1 << 16, static_cast<uint8_t>(scratch_.size()));
  }

 private:
  std::vector<uint8_t> scratch_;
};

}  // namespace

std::unique_ptr<MemoryOps> make_host_memory_ops() { return std::make_unique<HostMemoryOps>(); }

// ------------------------------------------------------------ case spec

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kWithNone: return "with_none";
    case Routing::kRepeated: return "repeated";
  }
  return "?";
}

moelink::Config CaseSpec::config(int rank) const {
  moelink::Config c;
  c.max_num_tokens = max_num_tokens;
  c.num_experts = num_experts;
  c.experts_per_token = experts_per_token;
  c.hidden_dim = hidden_dim;
  c.hidden_dim_scale = hidden_dim_scale;
  c.in_dtype = in_dtype;
  c.out_dtype = out_dtype;
  c.rank = rank;
  c.world_size = world_size;
  c.dp_size = dp_size;
  return c;
}

std::string CaseSpec::describe() const {
  std::ostringstream os;
  os << "[W=" << world_size << " dp=" << dp_size << " T=" << max_num_tokens;
  if (input_rows > 0) os << " rows=" << input_rows;
  os
     << " E=" << num_experts << " k=" << experts_per_token << " H=" << hidden_dim
     << " S=" << hidden_dim_scale << " in=" << moelink::dtype_name(in_dtype)
     << " out=" << moelink::dtype_name(out_dtype) << " y=" << moelink::dtype_name(y_dtype)
     << " idx=" << moelink::dtype_name(index_dtype) << " routing=" << routing_name(routing)
     << " seed=" << seed << (split ? " split" : "") << (accumulate ? " accumulate" : "")
     << (strided ? " strided" : "") << (padded ? " padded" : "") << (identity_expert ? " identity" : "")
     << " " << moelink::backend_name(backend);
  if (!fabric_provider.empty()) os << " provider=" << fabric_provider;
  if (max_private_tokens >= 0) os << " private=" << max_private_tokens;
  if (fabric_nics > 0) os << " nics=" << fabric_nics;
  if (node_size != 1) os << " node_size=" << node_size;
  if (gpu_direct >= 0) os << " gpu_direct=" << gpu_direct;
  os << "]";
  return os.str();
}

// ------------------------------------------------------------ inputs

namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t seed_of(uint64_t seed, int round, int group, int purpose) {
  return mix(mix(mix(seed) ^ (static_cast<uint64_t>(round) << 20)) ^
             (static_cast<uint64_t>(group) << 8) ^ static_cast<uint64_t>(purpose));
}

// A random token row. fp8 bytes keep the exponent field <= 10 (|x| <= 15),
// so 0x7F / 0xFF (NaN, and the poison) never occur; bf16 / fp16 values lie
// in [-4, 4], far from the poison patterns 0x7F7F / 0xFFFF.
void random_token(std::mt19937_64& rng, DType dtype, int64_t H, uint8_t* out) {
  if (dtype == DType::kFloat8E4M3) {
    for (int64_t h = 0; h < H; ++h) {
      const uint64_t r = rng();
      out[h] = static_cast<uint8_t>((r & 0x80) | ((r >> 8) % 0x58));
    }
    return;
  }
  std::uniform_real_distribution<double> u(-4.0, 4.0);
  for (int64_t h = 0; h < H; ++h) encode_element(dtype, u(rng), out, h);
}

// k distinct experts in [0, E) (k <= E), none equal to `avoid` when given.
void distinct_experts(std::mt19937_64& rng, int E, int k, int64_t* out, int64_t avoid = -1) {
  for (int i = 0; i < k; ++i) {
    int64_t e;
    bool dup;
    do {
      e = static_cast<int64_t>(rng() % E);
      dup = e == avoid;
      for (int j = 0; j < i; ++j) dup = dup || out[j] == e;
    } while (dup);
    out[i] = e;
  }
}

void route_token(const CaseSpec& s, std::mt19937_64& rng, int64_t hot, int64_t t, int64_t* idx) {
  const int E = s.num_experts, k = s.experts_per_token;
  switch (s.routing) {
    case Routing::kUniform: distinct_experts(rng, E, k, idx); break;
    case Routing::kSkewed:
      idx[0] = hot;
      if (k > 1) distinct_experts(rng, E, k - 1, idx + 1, hot);
      break;
    case Routing::kWithNone:
      distinct_experts(rng, E, k, idx);
      for (int i = 0; i < k; ++i)
        if (t % 5 == 3 || rng() % 10 < 3) idx[i] = -1;
      break;
    case Routing::kRepeated:
      distinct_experts(rng, E, k, idx);
      for (int i = 1; i < k; ++i)
        if (i == 1 || rng() % 2 == 0) idx[i] = idx[rng() % i];
      break;
  }
}

int64_t fresh_m(const CaseSpec& s, std::mt19937_64& rng, int round, int group, int G) {
  const int64_t R = s.rows();
  // Every case sees m == 0 and m == all rows at least once, for some group.
  if (round == 1 && group == G - 1) return 0;
  if (round == 2 && group == 0) return R;
  return static_cast<int64_t>(rng() % (R + 1));
}

// Drops (sets to -1) the routes that would overflow an expert's C rows; only
// repeated experts can get there.
void drop_overflowing_routes(const CaseSpec& s, std::vector<GroupInputs>& groups) {
  const int64_t C = s.max_num_tokens * static_cast<int64_t>(groups.size());
  const int k = s.experts_per_token;
  std::vector<int64_t> count(s.num_experts, 0);
  for (auto& g : groups) {
    const int64_t m = std::clamp<int64_t>(g.m, 0, s.rows());
    for (int64_t t = 0; t < m; ++t)
      for (int i = 0; i < k; ++i) {
        int64_t& e = g.indices[t * k + i];
        if (e < 0 || e >= s.num_experts) continue;
        if (count[e] == C)
          e = -1;
        else
          ++count[e];
      }
  }
}

void inject(const CaseSpec& s, std::vector<GroupInputs>& groups) {
  GroupInputs& g0 = groups[0];
  const int64_t R = s.rows();
  switch (s.inject) {
    case Inject::kNone: break;
    case Inject::kExpertIdE: g0.indices[0] = s.num_experts; break;
    case Inject::kExpertIdMinus5: g0.indices[0] = -5; break;
    // Past the input rows (by one when they are fewer than T: that clamp too).
    case Inject::kBoundMTooLarge: g0.m = R < s.max_num_tokens ? R + 1 : R + 5; break;
    case Inject::kBoundMNegative: g0.m = -3; break;
    case Inject::kExpertOverflow:
      for (auto& g : groups) {
        g.m = R;
        for (int64_t i = 0; i < R * s.experts_per_token; ++i) g.indices[i] = 0;
      }
      break;
  }
}

constexpr int kInjectRound = 1;

}  // namespace

std::vector<GroupInputs> generate_round_inputs(const CaseSpec& s, int round) {
  const int G = s.world_size / s.dp_size, k = s.experts_per_token, S = s.hidden_dim_scale;
  const int64_t T = s.max_num_tokens, H = s.hidden_dim;
  const size_t row = H * moelink::dtype_size(s.in_dtype);
  std::mt19937_64 round_rng(seed_of(s.seed, round, 0xFFFF, 0));
  const int64_t hot = static_cast<int64_t>(round_rng() % s.num_experts);
  std::vector<GroupInputs> groups(G);
  for (int g = 0; g < G; ++g) {
    std::mt19937_64 rng(seed_of(s.seed, round, g, 1));
    GroupInputs& in = groups[g];
    in.m = fresh_m(s, rng, round, g, G);
    in.rows = s.rows();
    if (round == kInjectRound && g == 0 &&
        (s.inject == Inject::kExpertIdE || s.inject == Inject::kExpertIdMinus5))
      in.m = std::max<int64_t>(in.m, 1);
    in.x.resize(T * row);
    for (int64_t t = 0; t < T; ++t) random_token(rng, s.in_dtype, H, in.x.data() + t * row);
    std::uniform_real_distribution<float> scale(0.25f, 2.0f), weight(-1.0f, 1.0f);
    in.scales.resize(T * S);
    for (auto& v : in.scales) v = scale(rng);
    in.indices.resize(T * k);
    for (int64_t t = 0; t < T; ++t) {
      // Rows t >= m carry valid-looking routes that must be ignored.
      if (t < in.m)
        route_token(s, rng, hot, t, in.indices.data() + t * k);
      else
        distinct_experts(rng, s.num_experts, k, in.indices.data() + t * k);
    }
    in.weights.resize(T * k);
    for (auto& w : in.weights) w = weight(rng);
  }
  drop_overflowing_routes(s, groups);
  if (round == kInjectRound) inject(s, groups);
  return groups;
}

// ------------------------------------------------------------ guarded buffers

GuardedBuffer::GuardedBuffer(MemoryOps& ops, size_t bytes) : ops_(ops), bytes_(bytes) {
  base_ = ops_.alloc(bytes + 2 * kGuard);
  ops_.fill(base_, kGuardByte, bytes + 2 * kGuard);
}

GuardedBuffer::~GuardedBuffer() { ops_.free(base_); }

std::string GuardedBuffer::check_guards(const char* name) const {
  std::vector<uint8_t> g(kGuard);
  const auto* base = static_cast<const uint8_t*>(base_);
  for (int side = 0; side < 2; ++side) {
    ops_.d2h(g.data(), base + (side ? kGuard + bytes_ : 0), kGuard);
    for (size_t i = 0; i < kGuard; ++i)
      if (g[i] != kGuardByte) {
        std::ostringstream os;
        os << name << ": out-of-bounds write " << (side ? "after the end, at byte +" : "before the start, at byte -")
           << (side ? i : kGuard - i) << " (0x" << std::hex << int(g[i]) << ")";
        return os.str();
      }
  }
  return {};
}

// ------------------------------------------------------------ CaseRunner

namespace {

size_t esize(DType t) { return moelink::dtype_size(t); }

Tensor make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape,
                   std::initializer_list<int64_t> stride) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  i = 0;
  for (int64_t s : stride) t.stride[i++] = s;
  return t;
}

}  // namespace

CaseRunner::CaseRunner(const CaseSpec& spec, int rank, moelink::Bootstrap& bootstrap,
                       MemoryOps& ops)
    : spec_(spec), rank_(rank), config_(spec.config(rank)), ops_(ops) {
  moelink::Options o;
  o.backend = spec.backend;
  o.timeout_s = spec.timeout_s;
  o.num_blocks = spec.num_blocks;
  o.fabric_provider = spec.fabric_provider;
  o.max_private_tokens = spec.max_private_tokens;
  o.fabric_nics = spec.fabric_nics;
  o.node_size = spec.node_size;
  o.gpu_direct = spec.gpu_direct;
  o.profile = spec.profile ? 1 : 0;
  o.debug = 0;
  a2a_ = moelink::AllToAll::create(config_, bootstrap, o);
  const int64_t T = spec_.rows(), S = config_.hidden_dim_scale;
  const int64_t k = config_.experts_per_token, L = config_.num_local_experts();
  const int64_t C = config_.expert_capacity();
  x_ = std::make_unique<GuardedBuffer>(ops_, T * pitch() * esize(spec_.in_dtype));
  x_scale_ = std::make_unique<GuardedBuffer>(ops_, T * S * 4);
  indices_ = std::make_unique<GuardedBuffer>(ops_, T * k * esize(spec_.index_dtype));
  weights_ = std::make_unique<GuardedBuffer>(ops_, T * k * 4);
  bound_m_ = std::make_unique<GuardedBuffer>(ops_, 4);
  out_counts_ = std::make_unique<GuardedBuffer>(ops_, L * 4);
  out_x_ = std::make_unique<GuardedBuffer>(ops_, L * expert_pitch() * esize(spec_.in_dtype));
  out_scale_ = std::make_unique<GuardedBuffer>(ops_, L * C * S * 4);
  expert_y_ = std::make_unique<GuardedBuffer>(ops_, L * expert_pitch() * esize(spec_.y_dtype));
  out_tokens_ = std::make_unique<GuardedBuffer>(ops_, T * pitch() * esize(spec_.out_dtype));
}

int64_t CaseRunner::pitch() const { return config_.hidden_dim + (spec_.padded ? 16 : 0); }

int64_t CaseRunner::expert_pitch() const {
  return config_.expert_capacity() * pitch() + (spec_.padded ? 32 : 0);
}

CaseRunner::~CaseRunner() = default;

Tensor CaseRunner::dp_x_tensor() const {
  const DType d = spec_.strided && spec_.in_dtype == DType::kFloat8E4M3 ? DType::kUInt8
                                                                          : spec_.in_dtype;
  return make_tensor(x_->data(), d, {spec_.rows(), config_.hidden_dim}, {pitch(), 1});
}

Tensor CaseRunner::dp_x_scale_tensor() const {
  const int64_t T = spec_.rows(), S = config_.hidden_dim_scale;
  if (S == 0) return Tensor{};
  return spec_.strided ? make_tensor(x_scale_->data(), DType::kFloat32, {T, S}, {1, T})
                       : make_tensor(x_scale_->data(), DType::kFloat32, {T, S}, {S, 1});
}

Tensor CaseRunner::indices_tensor() const {
  const int64_t T = spec_.rows(), k = config_.experts_per_token;
  return spec_.strided ? make_tensor(indices_->data(), spec_.index_dtype, {T, k}, {1, T})
                       : make_tensor(indices_->data(), spec_.index_dtype, {T, k}, {k, 1});
}

Tensor CaseRunner::weights_tensor() const {
  const int64_t T = spec_.rows(), k = config_.experts_per_token;
  return spec_.strided ? make_tensor(weights_->data(), DType::kFloat32, {T, k}, {1, T})
                       : make_tensor(weights_->data(), DType::kFloat32, {T, k}, {k, 1});
}

Tensor CaseRunner::bound_m_tensor() const {
  return Tensor::contiguous(bound_m_->data(), DType::kInt32, {1});
}

Tensor CaseRunner::out_counts_tensor() const {
  return Tensor::contiguous(out_counts_->data(), DType::kInt32, {config_.num_local_experts()});
}

Tensor CaseRunner::out_x_tensor() const {
  const DType d = spec_.strided && spec_.in_dtype == DType::kFloat8E4M3 ? DType::kUInt8
                                                                          : spec_.in_dtype;
  return make_tensor(out_x_->data(), d,
                     {config_.num_local_experts(), config_.expert_capacity(), config_.hidden_dim},
                     {expert_pitch(), pitch(), 1});
}

Tensor CaseRunner::out_scale_tensor() const {
  const int64_t L = config_.num_local_experts(), C = config_.expert_capacity();
  const int64_t S = config_.hidden_dim_scale;
  if (S == 0) return Tensor{};
  // Strided: each expert's [C, S] block column-major.
  return spec_.strided
             ? make_tensor(out_scale_->data(), DType::kFloat32, {L, C, S}, {C * S, 1, C})
             : make_tensor(out_scale_->data(), DType::kFloat32, {L, C, S}, {C * S, S, 1});
}

Tensor CaseRunner::expert_y_tensor() const {
  return make_tensor(expert_y_->data(), spec_.y_dtype,
                     {config_.num_local_experts(), config_.expert_capacity(), config_.hidden_dim},
                     {expert_pitch(), pitch(), 1});
}

Tensor CaseRunner::out_tokens_tensor() const {
  return make_tensor(out_tokens_->data(), spec_.out_dtype, {spec_.rows(), config_.hidden_dim},
                     {pitch(), 1});
}

bool CaseRunner::injects_this_round() const {
  return spec_.inject != Inject::kNone && round_ == kInjectRound;
}

void CaseRunner::write_inputs() {
  const GroupInputs& in = ref_->group(config_.dp_group());
  const int64_t T = spec_.rows(), S = config_.hidden_dim_scale;
  const int64_t k = config_.experts_per_token;
  {  // the first T (input) rows, at the row pitch
    const size_t row = config_.hidden_dim * esize(spec_.in_dtype);
    const size_t pitch_bytes = pitch() * esize(spec_.in_dtype);
    std::vector<uint8_t> x(x_->bytes(), 0x5A);
    for (int64_t t = 0; t < T; ++t) std::memcpy(x.data() + t * pitch_bytes, in.x.data() + t * row, row);
    ops_.h2d(x_->data(), x.data(), x.size());
  }
  // Scales, indices, weights: [T][n] row-major, or column-major when strided.
  auto layout = [&](int64_t t, int64_t i, int64_t n) { return spec_.strided ? i * T + t : t * n + i; };
  std::vector<float> scales(T * S);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s) scales[layout(t, s, S)] = in.scales[t * S + s];
  ops_.h2d(x_scale_->data(), scales.data(), scales.size() * 4);
  std::vector<uint8_t> idx(T * k * esize(spec_.index_dtype));
  std::vector<float> w(T * k);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = in.indices[t * k + i];
      const int64_t pos = layout(t, i, k);
      w[pos] = in.weights[t * k + i];
      if (spec_.index_dtype == DType::kInt64) {
        std::memcpy(idx.data() + pos * 8, &e, 8);
      } else if (spec_.index_dtype == DType::kInt32) {
        const auto v = static_cast<int32_t>(e);
        std::memcpy(idx.data() + pos * 4, &v, 4);
      } else {  // uint32: -1 -> 0xffffffff, -5 -> 0xfffffffb
        const auto v = static_cast<uint32_t>(e);
        std::memcpy(idx.data() + pos * 4, &v, 4);
      }
    }
  ops_.h2d(indices_->data(), idx.data(), idx.size());
  ops_.h2d(weights_->data(), w.data(), w.size() * 4);
  const auto m = static_cast<int32_t>(in.m);
  ops_.h2d(bound_m_->data(), &m, 4);
}

void CaseRunner::poison_outputs() {
  ops_.fill(out_counts_->data(), kPoisonCountByte, out_counts_->bytes());
  ops_.fill(out_x_->data(), kPoisonTokenByte, out_x_->bytes());
  std::vector<uint32_t> scale_poison(out_scale_->bytes() / 4, kPoisonScaleBits);
  ops_.h2d(out_scale_->data(), scale_poison.data(), out_scale_->bytes());
  ops_.fill(expert_y_->data(), kPoisonOutByte, expert_y_->bytes());
  out_before_.assign(out_tokens_->bytes(), kPoisonOutByte);
  if (spec_.accumulate) {
    // Finite previous values (every row, so rows t >= m are checked too).
    std::mt19937_64 rng(seed_of(spec_.seed, round_, rank_, 7));
    std::uniform_real_distribution<double> u(-2.0, 2.0);
    const size_t pitch_bytes = pitch() * esize(spec_.out_dtype);
    for (int64_t t = 0; t < spec_.rows(); ++t)
      for (int64_t h = 0; h < config_.hidden_dim; ++h)
        encode_element(spec_.out_dtype, u(rng), out_before_.data() + t * pitch_bytes, h);
  }
  ops_.h2d(out_tokens_->data(), out_before_.data(), out_before_.size());
}

void CaseRunner::prepare_round(int round) {
  round_ = round;
  ref_ = std::make_unique<Reference>(config_, generate_round_inputs(spec_, round));
  write_inputs();
  poison_outputs();
}

void CaseRunner::dispatch() {
  auto call = [&](bool send, bool recv) {
    a2a_->dispatch(out_counts_tensor(), out_x_tensor(), out_scale_tensor(), dp_x_tensor(),
                   dp_x_scale_tensor(), indices_tensor(), weights_tensor(), bound_m_tensor(),
                   ops_.stream(), send, recv);
  };
  if (spec_.split) {
    call(true, false);
    ops_.other_work();
    call(false, true);
  } else {
    call(true, true);
  }
}

void CaseRunner::combine() {
  auto call = [&](bool send, bool recv) {
    a2a_->combine(out_tokens_tensor(), indices_tensor(), weights_tensor(), expert_y_tensor(),
                  bound_m_tensor(), ops_.stream(), send, recv, spec_.accumulate);
  };
  if (spec_.split) {
    call(true, false);
    ops_.other_work();
    call(false, true);
  } else {
    call(true, true);
  }
}

void CaseRunner::check_errors(const char* phase) {
  ops_.sync();
  const bool dispatch_phase = std::string(phase) == "dispatch";
  const bool group0 = config_.dp_group() == 0;
  // What this round's injection must (after dispatch) or may (after combine)
  // make check() raise on this rank, and what the message must name.
  bool must = false, may = false;
  std::vector<std::string> parts{"rank " + std::to_string(rank_)};
  if (injects_this_round()) {
    switch (spec_.inject) {
      case Inject::kExpertIdE:
      case Inject::kExpertIdMinus5: {
        // Group 0's token 0 is sent (and its routes checked) by rank 0.
        must = dispatch_phase && rank_ == 0;
        may = must || (!dispatch_phase && group0);
        int64_t v = ref_->group(0).indices[0];
        if (spec_.index_dtype == DType::kUInt32) v = static_cast<uint32_t>(v);
        parts.push_back("indices");
        parts.push_back(std::to_string(v));
        break;
      }
      case Inject::kBoundMTooLarge:
      case Inject::kBoundMNegative:
        must = dispatch_phase && group0;
        may = group0;
        parts.push_back("bound_m");
        parts.push_back(std::to_string(ref_->group(0).m));
        break;
      case Inject::kExpertOverflow:
        // Expert 0 lives on rank 0, whose dispatch receive drops the excess.
        must = may = dispatch_phase && rank_ == 0;
        parts.push_back("local expert 0");
        parts.push_back(std::to_string(config_.expert_capacity()));
        break;
      case Inject::kNone: break;
    }
  }
  const std::string where = spec_.describe() + " round " + std::to_string(round_) + ", check() after " + phase;
  try {
    a2a_->check();
    RANK_CHECK(!must) << where << ": no InputError, expected one naming all of {"
                      << [&] {
                           std::string s;
                           for (auto& p : parts) s += "'" + p + "' ";
                           return s;
                         }() << "}";
  } catch (const moelink::InputError& e) {
    RANK_CHECK(may) << where << ": unexpected InputError: " << e.what();
    if (may) {
      for (const auto& p : parts) {
        RANK_CHECK(std::string(e.what()).find(p) != std::string::npos)
            << where << ": InputError message does not name '" << p << "': " << e.what();
      }
    }
    // Input errors are reported once.
    try {
      a2a_->check();
    } catch (const moelink::Error& again) {
      RANK_FAIL() << where << ": a second check() threw again (input errors are cleared once "
                  << "reported): " << again.what();
    }
  } catch (const moelink::Error& e) {
    RANK_FAIL() << where << ": unexpected " << typeid(e).name() << ": " << e.what();
  }
}

void CaseRunner::check_dispatch() {
  const int64_t L = config_.num_local_experts(), C = config_.expert_capacity();
  const int64_t S = config_.hidden_dim_scale;
  dispatched_.counts.resize(L);
  ops_.d2h(dispatched_.counts.data(), out_counts_->data(), L * 4);
  {  // gather the rows; the padding must still be poison
    const size_t es = esize(spec_.in_dtype), row = config_.hidden_dim * es;
    std::vector<uint8_t> raw(out_x_->bytes());
    ops_.d2h(raw.data(), out_x_->data(), raw.size());
    dispatched_.x.resize(L * C * row);
    for (int64_t j = 0; j < L; ++j)
      for (int64_t i = 0; i < C; ++i) {
        const uint8_t* src = raw.data() + (j * expert_pitch() + i * pitch()) * es;
        std::memcpy(dispatched_.x.data() + (j * C + i) * row, src, row);
      }
    for (int64_t j = 0; j < L && spec_.padded; ++j) {
      bool intact = true;
      for (int64_t i = 0; i < C; ++i)
        for (size_t b = row; b < pitch() * es; ++b)
          intact = intact && raw[(j * expert_pitch() + i * pitch()) * es + b] == kPoisonTokenByte;
      for (size_t b = C * pitch() * es; b < expert_pitch() * es; ++b)
        intact = intact && raw[j * expert_pitch() * es + b] == kPoisonTokenByte;
      RANK_CHECK(intact) << spec_.describe() << " round " << round_ << " dispatch: the padding of"
                         << " out_expert_x[" << j << "] was written";
    }
  }
  std::vector<uint32_t> raw(out_scale_->bytes() / 4);
  ops_.d2h(raw.data(), out_scale_->data(), out_scale_->bytes());
  dispatched_.scales.resize(L * C * S);
  const Tensor st = out_scale_tensor();
  for (int64_t j = 0; j < L; ++j)
    for (int64_t i = 0; i < C; ++i)
      for (int64_t s = 0; s < S; ++s)
        dispatched_.scales[(j * C + i) * S + s] =
            raw[j * st.stride[0] + i * st.stride[1] + s * st.stride[2]];
  for (const auto& p : ref_->check_dispatch(rank_, dispatched_))
    RANK_FAIL() << spec_.describe() << " round " << round_ << " dispatch: " << p;
}

void CaseRunner::write_expert_y() {
  const int64_t L = config_.num_local_experts(), C = config_.expert_capacity();
  const int64_t S = config_.hidden_dim_scale, H = config_.hidden_dim;
  const size_t xrow = H * esize(config_.in_dtype), yes = esize(spec_.y_dtype);
  std::vector<uint8_t> y(expert_y_->bytes(), kPoisonOutByte);  // rows >= count: NaN
  std::vector<float> scale(S);
  for (int64_t j = 0; j < L; ++j) {
    const int64_t n = std::clamp<int64_t>(dispatched_.counts[j], 0, C);
    for (int64_t i = 0; i < n; ++i) {
      if (S > 0) std::memcpy(scale.data(), dispatched_.scales.data() + (j * C + i) * S, S * 4);
      const auto v = expert_function(config_, spec_.y_dtype, spec_.identity_expert,
                                     static_cast<int>(rank_ * L + j),
                                     dispatched_.x.data() + (j * C + i) * xrow, scale.data());
      uint8_t* yrow = y.data() + (j * expert_pitch() + i * pitch()) * yes;
      for (int64_t h = 0; h < H; ++h) encode_element(spec_.y_dtype, v[h], yrow, h);
    }
  }
  ops_.h2d(expert_y_->data(), y.data(), y.size());
}

ExpertOutputFn CaseRunner::reference_y() const {
  const size_t row = config_.hidden_dim * esize(config_.in_dtype);
  const int64_t S = config_.hidden_dim_scale;
  return [this, row, S](int e, int g, int64_t t) {
    const GroupInputs& in = ref_->group(g);
    return expert_function(config_, spec_.y_dtype, spec_.identity_expert, e,
                           in.x.data() + t * row, in.scales.data() + t * S);
  };
}

void CaseRunner::check_combine() {
  std::vector<uint8_t> raw(out_tokens_->bytes());
  ops_.d2h(raw.data(), out_tokens_->data(), raw.size());
  // Dense [rows][H] copies for the reference; the padding must be unchanged.
  const size_t es = esize(spec_.out_dtype), row = config_.hidden_dim * es;
  const size_t pitch_bytes = pitch() * es;
  const int64_t R = spec_.rows();
  std::vector<uint8_t> before(R * row), after(R * row);
  bool padding_intact = true;
  for (int64_t t = 0; t < R; ++t) {
    std::memcpy(before.data() + t * row, out_before_.data() + t * pitch_bytes, row);
    std::memcpy(after.data() + t * row, raw.data() + t * pitch_bytes, row);
    padding_intact = padding_intact && std::memcmp(raw.data() + t * pitch_bytes + row,
                                                   out_before_.data() + t * pitch_bytes + row,
                                                   pitch_bytes - row) == 0;
  }
  RANK_CHECK(padding_intact) << spec_.describe() << " round " << round_
                             << " combine: the padding of out_tokens rows was written";
  for (const auto& p : ref_->check_combine(config_.dp_group(), reference_y(), before, after,
                                           spec_.accumulate))
    RANK_FAIL() << spec_.describe() << " round " << round_ << " combine: " << p;
}

void CaseRunner::check_guards() {
  const std::pair<const char*, GuardedBuffer*> buffers[] = {
      {"dp_x", x_.get()},
      {"dp_x_scale", x_scale_.get()},
      {"indices", indices_.get()},
      {"weights", weights_.get()},
      {"bound_m", bound_m_.get()},
      {"out_expert_num_tokens", out_counts_.get()},
      {"out_expert_x", out_x_.get()},
      {"out_expert_x_scale", out_scale_.get()},
      {"expert_y", expert_y_.get()},
      {"out_tokens", out_tokens_.get()},
  };
  for (const auto& [name, buf] : buffers) {
    const std::string problem = buf->check_guards(name);
    RANK_CHECK(problem.empty()) << spec_.describe() << " round " << round_ << ": " << problem;
  }
}

void CaseRunner::run_round(int round) {
  prepare_round(round);
  dispatch();
  check_errors("dispatch");
  check_dispatch();
  write_expert_y();
  combine();
  check_errors("combine");
  check_combine();
  check_guards();
}

void run_case_on_rank(const CaseSpec& spec, int rank, moelink::Bootstrap& bootstrap,
                      MemoryOps& ops) {
  CaseRunner runner(spec, rank, bootstrap, ops);
  for (int r = 0; r < spec.rounds; ++r) {
    const int before = failure_count();
    runner.run_round(r);
    // Stop together after a failing round (later rounds would mostly repeat
    // it); a rank that stopped alone would leave its peers waiting.
    const std::vector<char> failed =
        bootstrap.all_gather(std::vector<char>{static_cast<char>(failure_count() > before)});
    if (std::find(failed.begin(), failed.end(), 1) != failed.end()) break;
  }
}

void run_rank_exit_case(const CaseSpec& spec, int rank, int exiting_rank,
                        moelink::Bootstrap& bootstrap, MemoryOps& ops,
                        bool exit_before_combine) {
  CaseRunner runner(spec, rank, bootstrap, ops);
  runner.run_round(0);
  runner.prepare_round(1);
  if (exit_before_combine) {
    runner.dispatch();
    runner.check_errors("dispatch");
    runner.check_dispatch();
    runner.write_expert_y();
  }
  if (rank == exiting_rank) return;  // destroys its AllToAll and leaves
  const auto start = std::chrono::steady_clock::now();
  const std::string who = "rank " + std::to_string(exiting_rank);
  const char* phase = exit_before_combine ? "combine" : "dispatch";
  try {
    if (exit_before_combine)
      runner.combine();
    else
      runner.dispatch();
  } catch (const std::exception& e) {
    // The contract: the wait gives up, records the peer, and the call returns;
    // check() reports it.
    RANK_FAIL() << spec.describe() << ": " << phase << "() threw instead of returning and "
                << "leaving the timeout to check(): " << typeid(e).name() << ": " << e.what();
    return;
  }
  try {
    ops.sync();
    runner.all_to_all().check();
    RANK_FAIL() << spec.describe() << ": check() did not throw TimeoutError although "
                << who << " is gone";
  } catch (const moelink::TimeoutError& e) {
    RANK_CHECK(std::string(e.what()).find(who) != std::string::npos)
        << "TimeoutError does not name " << who << ": " << e.what();
    RANK_CHECK(std::string(e.what()).find(exit_before_combine ? "combine" : "dispatch") !=
               std::string::npos)
        << "TimeoutError does not name the phase (" << phase << "): " << e.what();
    // A timeout is final: check() keeps reporting it.
    try {
      runner.all_to_all().check();
      RANK_FAIL() << "a second check() after the timeout did not throw TimeoutError";
    } catch (const moelink::TimeoutError&) {
    } catch (const std::exception& again) {
      RANK_FAIL() << "a second check() after the timeout threw " << typeid(again).name() << ": "
                  << again.what();
    }
  } catch (const std::exception& e) {
    RANK_FAIL() << spec.describe() << ": expected TimeoutError naming " << who << " from check(), got "
                << typeid(e).name() << ": " << e.what();
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  RANK_CHECK(elapsed < spec.timeout_s + 10.0)
      << "the timeout took " << elapsed << " s with timeout_s = " << spec.timeout_s;
}

}  // namespace moelink_test
