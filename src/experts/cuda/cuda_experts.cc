// ExpertDevice::kCUDA: owns the workspace, the error record and the GEMM
// objects (one CUTLASS kernel each, created on first use), and turns the
// checked Tensor views into the kernels' argument blocks.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "experts/cuda/block_scaled_gemm.h"
#include "experts/cuda/dense_stream_k_gemm.h"
#include "experts/cuda/device_buffer.h"
#include "experts/cuda/quant_kernels.h"
#include "experts/experts_impl.h"
#include "experts/fp8_group_quant.h"
#include "nvlink/cuda_check.h"
#include "nvlink/cuda_memory.h"

namespace moelink::detail {
namespace {

using experts::BlockScaledGemm;
using experts::ExpertErrorRecord;
using experts::ExpertOp;
using experts::GemmOperands;
using experts::GemmTiles;
using experts::GroupQuantArgs;
using experts::GroupQuantInput;
using experts::kQuantGroup;

// The tiles for a GEMM expected to have `rows` rows per group, from
// experts_bench.py --tiles on an H200 (bench/results, docs/experts.md):
// swapped operands (128 weight rows x 32 token rows) up to 32 rows, where a
// tile's wgmma would otherwise be mostly padding; 64-row ping-pong tiles up
// to 64; 128-row cooperative tiles up to 128; above, where a group has two
// or more row tiles, the same in clusters of 2 sharing each weight tile.
GemmTiles tiles_for_rows(int64_t rows) {
  if (rows <= 32) return GemmTiles::kSwap128N32;
  if (rows <= 64) return GemmTiles::kRows64;
  return rows <= 128 ? GemmTiles::kRows128 : GemmTiles::kRows128C2;
}

// MOELINK_EXPERTS_TILES=<name> forces one tile configuration for every GEMM
// (tuning: experts_bench.py --tiles); unset, the rows decide.
bool forced_tiles(GemmTiles* out) {
  const char* v = std::getenv("MOELINK_EXPERTS_TILES");
  if (v == nullptr || *v == '\0') return false;
  if (!experts::gemm_tiles_from_name(v, out) || !experts::gemm_tiles_built(*out)) {
    std::string built;
    for (GemmTiles t : experts::kAllGemmTiles)
      if (experts::gemm_tiles_built(t)) built += (built.empty() ? "" : ", ") + std::string(experts::gemm_tiles_name(t));
    throw InvalidArgument(std::string("moelink: environment variable MOELINK_EXPERTS_TILES = '") + v +
                          "' must name tiles this build has: " + built);
  }
  return true;
}

// MOELINK_EXPERTS_SPLIT_K: unset or "auto", experts::split_k_for decides
// for the GEMMs that may split (CudaExperts::split_for); 1 never splits; 2
// to 8 split every such GEMM whose K/128 that count divides (tuning:
// experts_bench.py --split-k, attention_bench.py's qkv_a).
int forced_split_k() {
  const char* v = std::getenv("MOELINK_EXPERTS_SPLIT_K");
  if (v == nullptr || *v == '\0' || std::string(v) == "auto") return 0;
  const std::string s(v);
  if (s.size() != 1 || s[0] < '1' || s[0] > '0' + experts::kMaxSplitK)
    throw InvalidArgument("moelink: environment variable MOELINK_EXPERTS_SPLIT_K = '" + s +
                          "' must be auto or 1 to " + std::to_string(experts::kMaxSplitK));
  return s[0] - '0';
}

// MOELINK_EXPERTS_STREAM_K, for the dense GEMM called without bound_m
// (CudaExperts::run_dense_stream_k): unset or "auto", split over K in one
// kernel where experts::dense_split_for says so (more than 64 rows, few
// tiles: DeepSeek-V3's qkv_a at 65-256 tokens); "off" never; "streamk"
// CUTLASS's stream-K decomposition where auto would split; 2 to 16 that
// many K slices for every such GEMM (tuning: dense_gemm_bench.py --stream-k).
struct DenseStreamKSetting {
  bool off = false, stream_k = false;
  int splits = 0;  // forced; 0: auto
};
DenseStreamKSetting dense_stream_k_setting() {
  const char* v = std::getenv("MOELINK_EXPERTS_STREAM_K");
  DenseStreamKSetting s;
  if (v == nullptr || *v == '\0' || std::string(v) == "auto") return s;
  const std::string t(v);
  if (t == "off") s.off = true;
  else if (t == "streamk") s.stream_k = true;
  else {
    const int n = t.size() <= 2 && t.find_first_not_of("0123456789") == std::string::npos ? std::stoi(t) : 0;
    if (n < 2 || n > 16)
      throw InvalidArgument("moelink: environment variable MOELINK_EXPERTS_STREAM_K = '" + t +
                            "' must be auto, off, streamk or a split count 2 to 16");
    s.splits = n;
  }
  return s;
}

// A setting with two values, read when an Experts is created: true for
// `on`, false for `off`, `fallback` when unset or empty.
bool env_switch(const char* name, const char* on, const char* off, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const std::string s(v);
  if (s != on && s != off)
    throw InvalidArgument(std::string("moelink: environment variable ") + name + " = '" + s +
                          "' must be " + on + " or " + off);
  return s == on;
}

class CudaExperts final : public ExpertsImpl {
 public:
  explicit CudaExperts(const ExpertConfig& c) : config_(c) {
    int device = 0;
    MOELINK_CUDA_CHECK(cudaGetDevice(&device));
    MOELINK_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
    forced_ = forced_tiles(&forced_tiles_);
    split_forced_ = forced_split_k();
    dense_stream_k_ = dense_stream_k_setting();
    // MOELINK_EXPERTS_PDL=0: plain stream order instead of programmatic
    // dependent launch (programmatic_launch.cuh). MOELINK_EXPERTS_GEMM_CTAS=all:
    // one GEMM CTA per SM instead of experts::balanced_ctas.
    // MOELINK_EXPERTS_DYNAMIC_TILES=0: CUTLASS's fixed tile order instead of
    // DynamicGroupScheduler's (experts::GemmGrid). MOELINK_EXPERTS_RASTER=m:
    // tiles numbered down M first for every GEMM, not along N for groups of
    // many row tiles (experts::raster_along_n_for). For A/B runs.
    programmatic_ = env_switch("MOELINK_EXPERTS_PDL", "1", "0", true);
    balanced_ = env_switch("MOELINK_EXPERTS_GEMM_CTAS", "balanced", "all", true);
    dynamic_ = env_switch("MOELINK_EXPERTS_DYNAMIC_TILES", "1", "0", true);
    raster_auto_ = env_switch("MOELINK_EXPERTS_RASTER", "auto", "m", true);
    // MOELINK_EXPERTS_ARGUMENT_KERNELS=2: forward() writes each GEMM's
    // arguments right before it (the second after SiLU-mul), not both in
    // one launch before the first GEMM.
    arguments_together_ = env_switch("MOELINK_EXPERTS_ARGUMENT_KERNELS", "1", "2", true);
    const int64_t L = c.num_experts, C = c.max_rows, H = c.hidden_dim, I = c.intermediate_dim;
    // forward()'s GEMMs for every row class a call may name (the first
    // refuses a GPU other than Hopper, before anything else is allocated):
    // whole, GEMM2 also as forward()'s own object, and where their tiles are
    // few (a handful of experts with a handful of rows, e.g. a shared
    // expert), split over K. The GEMM objects and split buffers exist from
    // here, so that a capture allocates nothing.
    for (int64_t rows = 1;; rows *= 2) {
      const RowClass rc = row_class(rows);
      for (int64_t n : {2 * I, H}) gemm_for(rc.tiles, L, rc.rows, n, 1);
      if (arguments_together_) gemm_for(rc.tiles, L, rc.rows, H, 1, kForwardGemm2);
      reserve_split(L, C, 2 * I, H, rc.split_gate_up);
      reserve_split(L, C, H, I, rc.split_down);
      gemm_for(rc.tiles, L, rc.rows, 2 * I, rc.split_gate_up);
      gemm_for(rc.tiles, L, rc.rows, H, rc.split_down);
      if (rc.rows >= c.expected_rows) break;
    }
    const size_t gate_up = static_cast<size_t>(L * C * 2 * I) * 2;
    const size_t act_q = static_cast<size_t>(L * C * I);
    const size_t act_scale = static_cast<size_t>(L * C * (I / kQuantGroup)) * 4;
    workspace_bytes_ = gate_up + act_q + act_scale;
    workspace_ = experts::device_alloc(workspace_bytes_);
    char* p = static_cast<char*>(workspace_.get());
    ws_.gate_up = Tensor::contiguous(p, DType::kBFloat16, {L, C, 2 * I});
    ws_.act_q = Tensor::contiguous(p + gate_up, DType::kFloat8E4M3, {L, C, I});
    ws_.act_scale = Tensor::contiguous(p + gate_up + act_q, DType::kFloat32, {L, C, I / kQuantGroup});
    error_buffer_ = experts::device_alloc(sizeof(ExpertErrorRecord), true);
    error_ = static_cast<ExpertErrorRecord*>(error_buffer_.get());
  }

  void grouped_gemm(const Tensor& y, const Tensor& count, const Tensor& x, const Tensor& x_scale,
                    const Tensor& w, const Tensor& w_scale, ExpertOp op, int64_t expected_rows,
                    cudaStream_t stream) override {
    GemmOperands o = operands(y, x, x_scale, w, w_scale, op);
    o.counts = static_cast<const int32_t*>(count.data);
    const RowClass rc = row_class(expected_rows);
    const int split = o.n == 2 * config_.intermediate_dim && o.k == config_.hidden_dim ? rc.split_gate_up
                      : o.n == config_.hidden_dim && o.k == config_.intermediate_dim ? rc.split_down
                                                                                       : 1;
    run_gemm(o, rc.tiles, config_.num_experts, rc.rows, split, stream);
  }

  void forward(const Tensor& y, const Tensor& count, const Tensor& x, const Tensor& x_scale,
               const Tensor& w13, const Tensor& w13_scale, const Tensor& w2, const Tensor& w2_scale,
               const Tensor& gate_up, const Tensor& act_q, const Tensor& act_scale,
               int64_t expected_rows, cudaStream_t stream) override {
    const RowClass rc = row_class(expected_rows);
    if (!arguments_together_ || rc.split_gate_up > 1 || rc.split_down > 1) {
      ExpertsImpl::forward(y, count, x, x_scale, w13, w13_scale, w2, w2_scale, gate_up, act_q,
                           act_scale, expected_rows, stream);
      return;
    }
    // Both GEMMs' arguments in one launch before GEMM1 (they depend only on
    // the counts), so that GEMM2 follows SiLU-mul directly. GEMM2 has an
    // object of its own: GEMM1's may be the same (tiles, experts, grid).
    GemmOperands o1 = operands(gate_up, x, x_scale, w13, w13_scale, ExpertOp::kForward);
    GemmOperands o2 = operands(y, act_q, act_scale, w2, w2_scale, ExpertOp::kForward);
    o1.counts = o2.counts = static_cast<const int32_t*>(count.data);
    const int L = static_cast<int>(config_.num_experts);
    BlockScaledGemm& g1 = gemm_for(rc.tiles, L, rc.rows, o1.n, 1);
    BlockScaledGemm& g2 = gemm_for(rc.tiles, L, rc.rows, o2.n, 1, kForwardGemm2);
    g1.write_arguments(o1, error_, stream, programmatic_, &g2, &o2);
    g1.launch(stream, programmatic_);
    silu_mul_quant(act_q, act_scale, gate_up, count, ExpertOp::kForward, stream);
    g2.launch(stream, programmatic_);
  }

  void gemm(const Tensor& y, const Tensor& x, const Tensor& x_scale, const Tensor& w,
            const Tensor& w_scale, const Tensor& bound_m, cudaStream_t stream) override {
    GemmOperands o = operands(as_one_group(y), as_one_group(x), as_one_group(x_scale),
                              as_one_group(w), as_one_group(w_scale), ExpertOp::kGemm);
    o.counts = static_cast<const int32_t*>(bound_m.data);  // null: all M rows
    if (o.counts == nullptr && run_dense_stream_k(o, x.shape[0], stream)) return;
    const GemmTiles t = tiles(x.shape[0]);
    const int split = split_for(t, 1, x.shape[0], o.n, o.k);
    reserve_split(1, o.capacity, o.n, o.k, split);  // the first call of a shape allocates, as gemm_for does
    run_gemm(o, t, 1, x.shape[0], split, stream);
  }

  void silu_mul_quant(const Tensor& out_q, const Tensor& out_scale, const Tensor& gate_up,
                      const Tensor& count, ExpertOp op, cudaStream_t stream) override {
    GroupQuantArgs a = quant_args(out_q, out_scale, gate_up, op);
    a.up_offset = gate_up.shape[2] / 2;
    a.quant_groups_per_row = static_cast<int32_t>(a.up_offset / kQuantGroup);
    a.counts = static_cast<const int32_t*>(count.data);
    experts::launch_group_quant(a, GroupQuantInput::kSiluMul, sm_count_, error_, stream, programmatic_);
  }

  void quantize(const Tensor& out_q, const Tensor& out_scale, const Tensor& x,
                const Tensor& bound_m, cudaStream_t stream) override {
    GroupQuantArgs a =
        quant_args(as_one_group(out_q), as_one_group(out_scale), as_one_group(x), ExpertOp::kQuantize);
    a.quant_groups_per_row = static_cast<int32_t>(x.shape[1] / kQuantGroup);
    a.counts = static_cast<const int32_t*>(bound_m.data);
    experts::launch_group_quant(a, GroupQuantInput::kPlain, sm_count_, error_, stream, programmatic_);
  }

  const ExpertWorkspace& workspace() const override { return ws_; }
  size_t workspace_bytes() const override { return workspace_bytes_; }

  ExpertErrorRecord take_error(cudaStream_t stream) override {
    return take_device_record(stream, error_, [](const ExpertErrorRecord&) { return true; });
  }

 private:
  GemmTiles tiles(int64_t rows) const { return forced_ ? forced_tiles_ : tiles_for_rows(rows); }

  // The grouped GEMMs' setup for a call whose experts are expected to hold
  // about `expected_rows` rows: those rows rounded up to a power of two and
  // at most the config's expected_rows (the constructor made the GEMM
  // objects of each such class), their tiles and forward()'s K splits.
  struct RowClass {
    int64_t rows;
    GemmTiles tiles;
    int split_gate_up, split_down;
  };
  RowClass row_class(int64_t expected_rows) const {
    int64_t rows = 1;
    while (rows < expected_rows) rows *= 2;
    rows = std::min(rows, config_.expected_rows);
    const GemmTiles t = tiles(rows);
    const int64_t L = config_.num_experts, C = config_.max_rows, H = config_.hidden_dim,
                  I = config_.intermediate_dim;
    // A split's partial sums cover every row up to the capacity (the counts
    // are on the device): a class below the config's splits only where
    // that stays small (the shared expert of a 4096-token layer would
    // otherwise hold 470 MB for calls its small twin takes).
    auto split = [&](int64_t n, int64_t k) {
      const int s = split_for(t, L, rows, n, k);
      return rows < config_.expected_rows && partial_bytes(L, C, n, s) > kSmallClassSplitBytes ? 1 : s;
    };
    return {rows, t, split(2 * I, H), split(H, I)};
  }
  static constexpr size_t kSmallClassSplitBytes = size_t{64} << 20;

  // K slices for a GEMM of `groups` groups of about `rows` rows and n x k
  // weights on `tiles`: the swapped-operand tiles (one row tile a group)
  // where their weight tiles are few (experts::split_k_for); a dense GEMM's
  // row tiles only under a forced count (one group, its rows known to the
  // host: qkv_a's 17 weight tiles at 33-256 tokens fill a quarter of the
  // SMs, but split they measured no better: docs/experts.md); grouped GEMMs
  // on row tiles stay whole.
  int split_for(GemmTiles tiles, int64_t groups, int64_t rows, int64_t n, int64_t k) const {
    const bool swap = tiles == GemmTiles::kSwap128N32;
    if (!swap && (groups != 1 || split_forced_ == 0)) return 1;
    const int64_t k_blocks = k / kQuantGroup;
    if (split_forced_ > 0) return k_blocks % split_forced_ == 0 ? split_forced_ : 1;
    return experts::split_k_for(experts::gemm_tile_count(tiles, groups, rows, n), k_blocks, sm_count_);
  }

  static size_t partial_bytes(int64_t groups, int64_t rows, int64_t n, int split) {
    return static_cast<size_t>(split * groups * rows * n) * 4;
  }
  static size_t x_scale_split_bytes(int64_t groups, int64_t rows, int64_t k) {
    return static_cast<size_t>(groups * rows * (k / kQuantGroup)) * 4;
  }
  static size_t w_scale_split_bytes(int64_t groups, int64_t n, int64_t k) {
    return static_cast<size_t>(groups * (n / kQuantGroup) * (k / kQuantGroup)) * 4;
  }
  bool split_fits(int64_t groups, int64_t rows, int64_t n, int64_t k, int split) const {
    return split <= 1 || (partial_bytes(groups, rows, n, split) <= partial_.bytes() &&
                          x_scale_split_bytes(groups, rows, k) <= x_scale_split_.bytes() &&
                          w_scale_split_bytes(groups, n, k) <= w_scale_split_.bytes());
  }
  // Grows the split buffers to hold a split GEMM of these dimensions (what
  // they outgrow stays for the graphs captured on it: GrowingDeviceBuffer).
  void reserve_split(int64_t groups, int64_t rows, int64_t n, int64_t k, int split) {
    if (split <= 1) return;
    partial_.get(partial_bytes(groups, rows, n, split));
    x_scale_split_.get(x_scale_split_bytes(groups, rows, k));
    w_scale_split_.get(w_scale_split_bytes(groups, n, k));
  }

  // GEMM objects of the same key but different use: forward()'s GEMM2,
  // whose arguments are written before GEMM1 runs, has its own.
  static constexpr int kAnyGemm = 0, kForwardGemm2 = 1;

  // The GEMM object for `groups` groups of about `rows` rows and n columns
  // on `tiles`, split over K into `split` slices (the split-K kernel with
  // split x groups groups) or whole, created on first use. Its grid is
  // balanced for the tiles those rows give (MOELINK_EXPERTS_GEMM_CTAS), its
  // tile order along N for groups of many row tiles (MOELINK_EXPERTS_RASTER).
  BlockScaledGemm& gemm_for(GemmTiles tiles, int groups, int64_t rows, int64_t n, int split,
                            int use = kAnyGemm) {
    if (split > 1) tiles = experts::split_k_tiles(tiles), groups *= split;
    const int ctas = balanced_ ? experts::balanced_ctas(experts::gemm_tile_count(tiles, groups, rows, n),
                                                        sm_count_, experts::gemm_tile_extent(tiles).cluster)
                               : 0;
    const bool along_n = raster_auto_ && experts::raster_along_n_for(tiles, rows, sm_count_);
    if (split <= 1) return gemm_object(tiles, groups, ctas, along_n, use);
    const std::tuple<int, int, int> key{static_cast<int>(tiles), groups, ctas};
    auto it = split_gemms_.find(key);
    if (it == split_gemms_.end())
      it = split_gemms_.emplace(key, experts::make_split_k_gemm(tiles, groups, {ctas, dynamic_, false})).first;
    return *it->second;
  }

  // The GEMM, split over K into `split` slices (packed scales, fp32
  // partial sums, their sum) or whole: whole also when the split buffers,
  // sized for forward()'s GEMMs, do not fit this call (grouped_gemm on
  // larger tensors than forward takes).
  void run_gemm(GemmOperands o, GemmTiles tiles, int groups, int64_t rows, int split,
                cudaStream_t stream) {
    if (!split_fits(groups, o.capacity, o.n, o.k, split)) split = 1;
    BlockScaledGemm& gemm = gemm_for(tiles, groups, rows, o.n, split);
    if (split <= 1) {
      gemm.run(o, error_, stream, programmatic_);
      return;
    }
    o.split_k = split;
    o.groups = groups;
    o.partial = static_cast<float*>(partial_.data());
    o.x_scale_split = static_cast<float*>(x_scale_split_.data());
    o.w_scale_split = static_cast<float*>(w_scale_split_.data());
    gemm.run(o, error_, stream, programmatic_);
    experts::launch_split_reduce(o, stream, programmatic_);
  }

  // The dense GEMM of m rows as one kernel whose CTAs share its tiles' K
  // ranges (dense_stream_k_gemm.h), where its tiles are few
  // (MOELINK_EXPERTS_STREAM_K). Only for a call without bound_m: the kernel
  // writes all m rows. False: the tiled kernels run it.
  bool run_dense_stream_k(const GemmOperands& o, int64_t m, cudaStream_t stream) {
    if (dense_stream_k_.off || m < 1) return false;
    const int auto_splits = experts::dense_split_for(m, o.n, o.k, sm_count_);
    experts::DenseSchedule s;
    if (dense_stream_k_.splits > 0) s.splits = dense_stream_k_.splits;
    else if (auto_splits <= 1) return false;
    else s.splits = dense_stream_k_.stream_k ? 0 : auto_splits;
    if (!dense_gemm_) dense_gemm_ = experts::make_dense_stream_k_gemm();
    const experts::DenseGemmArgs a{o.x, o.x_row_stride, o.x_scale, o.w, o.w_row_stride, o.w_scale,
                                   o.y, o.y_row_stride, m, o.n, o.k};
    dense_gemm_->run(a, s, dense_workspace(a, s, stream), stream, programmatic_);
    return true;
  }

  // The stream-K workspace of the calls laid out like `a` under `s` (their
  // locks must not overlap another layout's partial tiles), zeroed on the
  // call's stream when first made: the first call of a layout allocates,
  // as gemm_for's first call of a shape does.
  void* dense_workspace(const experts::DenseGemmArgs& a, experts::DenseSchedule s, cudaStream_t stream) {
    const std::tuple<int64_t, int, int, int> key{(a.m + 127) / 128, a.n, a.k, s.splits};
    auto it = dense_workspaces_.find(key);
    if (it == dense_workspaces_.end()) {
      const size_t bytes = std::max<size_t>(dense_gemm_->workspace_bytes(a, s), 128);
      experts::DeviceBuffer b = experts::device_alloc(bytes);
      MOELINK_CUDA_CHECK(cudaMemsetAsync(b.get(), 0, bytes, stream));
      it = dense_workspaces_.emplace(key, std::move(b)).first;
    }
    return it->second.get();
  }

  BlockScaledGemm& gemm_object(GemmTiles tiles, int groups, int ctas, bool along_n, int use) {
    const std::tuple<int, int, int, bool, int> key{static_cast<int>(tiles), groups, ctas, along_n, use};
    auto it = gemms_.find(key);
    if (it == gemms_.end())
      it = gemms_.emplace(key, experts::make_block_scaled_gemm(tiles, groups, {ctas, dynamic_, along_n})).first;
    return *it->second;
  }

  // y, x, x_scale, w, w_scale as [groups, rows, cols] views.
  static GemmOperands operands(const Tensor& y, const Tensor& x, const Tensor& x_scale,
                               const Tensor& w, const Tensor& w_scale, ExpertOp op) {
    GemmOperands o{};
    o.x = x.data;
    o.x_group_stride = x.stride[0];
    o.x_row_stride = x.stride[1];
    o.x_scale = static_cast<const float*>(x_scale.data);
    o.x_scale_group_stride = x_scale.stride[0];
    o.w = w.data;
    o.w_group_stride = w.stride[0];
    o.w_row_stride = w.stride[1];
    o.w_scale = static_cast<const float*>(w_scale.data);
    o.w_scale_group_stride = w_scale.stride[0];
    o.y = y.data;
    o.y_group_stride = y.stride[0];
    o.y_row_stride = y.stride[1];
    o.capacity = x.shape[1];
    o.n = static_cast<int32_t>(w.shape[1]);
    o.k = static_cast<int32_t>(w.shape[2]);
    o.op = op;
    return o;
  }

  static GroupQuantArgs quant_args(const Tensor& q, const Tensor& s, const Tensor& src,
                                   ExpertOp op) {
    GroupQuantArgs a{};
    a.src = static_cast<const uint16_t*>(src.data);
    a.src_group_stride = src.stride[0];
    a.src_row_stride = src.stride[1];
    a.q = static_cast<uint8_t*>(q.data);
    a.q_group_stride = q.stride[0];
    a.q_row_stride = q.stride[1];
    a.scale = static_cast<float*>(s.data);
    a.scale_s0 = s.stride[0];
    a.scale_s1 = s.stride[1];
    a.scale_s2 = s.stride[2];
    a.capacity = src.shape[1];
    a.groups = static_cast<int32_t>(src.shape[0]);
    a.op = op;
    return a;
  }

  ExpertConfig config_;
  bool forced_ = false;
  GemmTiles forced_tiles_ = GemmTiles::kRows64;
  int sm_count_ = 0;
  int split_forced_ = 0;                      // MOELINK_EXPERTS_SPLIT_K; 0: auto
  DenseStreamKSetting dense_stream_k_;        // MOELINK_EXPERTS_STREAM_K
  std::unique_ptr<experts::DenseStreamKGemm> dense_gemm_;  // created on first use
  // by row tiles, n, k, splits (dense_workspace)
  std::map<std::tuple<int64_t, int, int, int>, experts::DeviceBuffer> dense_workspaces_;
  bool programmatic_ = true;                  // MOELINK_EXPERTS_PDL
  bool balanced_ = true;                      // MOELINK_EXPERTS_GEMM_CTAS
  bool dynamic_ = true;                       // MOELINK_EXPERTS_DYNAMIC_TILES
  bool raster_auto_ = true;                   // MOELINK_EXPERTS_RASTER
  bool arguments_together_ = true;            // MOELINK_EXPERTS_ARGUMENT_KERNELS
  GrowingDeviceBuffer partial_, x_scale_split_, w_scale_split_;  // split GEMMs' (GemmOperands)
  std::map<std::tuple<int, int, int>, std::unique_ptr<BlockScaledGemm>> split_gemms_;  // by tiles, groups, CTAs
  experts::DeviceBuffer workspace_, error_buffer_;
  size_t workspace_bytes_ = 0;
  ExpertWorkspace ws_;
  ExpertErrorRecord* error_ = nullptr;
  // by tiles, groups, CTAs, tile order, use
  std::map<std::tuple<int, int, int, bool, int>, std::unique_ptr<BlockScaledGemm>> gemms_;
};

}  // namespace

std::unique_ptr<ExpertsImpl> make_cuda_experts(const ExpertConfig& config) {
  return std::make_unique<CudaExperts>(config);
}

}  // namespace moelink::detail
