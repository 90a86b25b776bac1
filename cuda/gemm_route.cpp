// The GEMM dispatch of the torch binding: which kernel qerl::nvfp4_gemm* runs for (M, N, K, mode) on the current
// device (the measured calibration table, else the rules), the grids and tiles each kernel asks for, the tuning knobs
// and benchmark hooks, and the split-K semaphores. No tensor math and no launches: cuda/qerl_torch.cpp runs what this
// picks. (One translation unit of the extension; cuda/gemm_route.h declares what the other uses.)
#include "gemm_route.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "binding_errors.h"
#include "qerl_nvfp4.h"

namespace qerl_binding {

static std::mutex g_mu;
static std::vector<at::Tensor> g_counters(64);
static int64_t g_gemm_max_m = -1;      // fused GEMM for M <= this (auto mode); -1: read env / default
static double g_split_penalty = -1;  // split-K heuristic: score penalty per extra split; -1: env / default
static double g_streamk_min_tiles = -1;  // auto stream-K when tiles >= this x CTAs; -1: env / default

static int64_t gemm_max_m() {
  if (g_gemm_max_m < 0) {
    const char* e = std::getenv("QERL_GEMM_MAX_M");
    g_gemm_max_m = e ? std::atoll(e) : 128;
  }
  return g_gemm_max_m;
}

static double split_penalty() {
  if (g_split_penalty < 0) {
    const char* e = std::getenv("QERL_SPLIT_PENALTY");
    g_split_penalty = e ? std::atof(e) : 0.05;  // best of {0, 0.004, 0.015, 0.05} on the H100 (NOTES.md)
  }
  return g_split_penalty;
}

// Auto mode runs the stream-K kernel where its 256-row tiles number at least this fraction of the CTAs it
// launches, or where each CTA's range is at least kStreamkMinStagesPerCta K stages long. Otherwise every tile
// is cut among many CTAs of a few stages each, and the pipeline fill plus the serial partial-sum fix-up
// dominate. Calibrated on the H200 over 80 GEMMs of five Qwen2.5 sizes, M = 33-128 (benchmarks/NOTES.md,
// "v5.7 outcome"): stream-K wins or ties at every shape with >= 0.27 tiles per CTA or >= 32 stages per CTA
// (1.0-1.7x split-K) and loses at the shapes with <= 0.21 tiles and <= 17 stages per CTA (0.57-0.98x).
constexpr int64_t kStreamkMinStagesPerCta = 24;
static double streamk_min_tiles() {
  if (g_streamk_min_tiles < 0) {
    const char* e = std::getenv("QERL_STREAMK_MIN_TILES_PER_CTA");
    g_streamk_min_tiles = e ? std::atof(e) : 0.25;
  }
  return g_streamk_min_tiles;
}

void init_workspace(int64_t device) {
  QCHECK(device >= 0 && device < 64, "qerl: device index out of range: ", device);
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_counters[device].defined()) return;
  QCHECK(at::cuda::currentStreamCaptureStatusMayInitCtx() == at::cuda::CaptureStatus::None,
              "qerl: the NVFP4 GEMM workspace must be created before CUDA graph capture; call "
              "verl_qerl.kernels.load_extension() (or run one eager forward) first");
  c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
  g_counters[device] = at::zeros({kCounterCap}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
}

int* counters_for(const at::Device& dev) {
  const int64_t idx = dev.index();
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_counters[idx].defined()) return g_counters[idx].data_ptr<int>();
  }
  init_workspace(idx);
  return g_counters[idx].data_ptr<int>();
}

int pick_block_m(int64_t m) {
  if (m <= 8) return 8;
  if (m <= 16) return 16;
  if (m <= 32) return 32;
  return 64;
}

// Split K over CTAs so that every SM gets the same work. The small-M kernel is bound by the SMs'
// instruction issue (ncu: ~1.8 IPC per SM), so the busiest SM sets the time: with C = tiles * S
// equal CTAs of ceil(stages / S) stages, it runs ceil(C / SMs) of them. Pick S maximizing that
// balance, minus a small per-split penalty for the partial sums (FP32 partials in L2 and the last
// CTA's reduction). E.g. 7B gate_up at M=1: 296 tiles -> S=4 (99.7% balanced) instead of S=1
// (3 vs 2 CTAs per SM: 75%, measured: SMs active 67% of the time).
int pick_splits(int64_t tiles, int64_t stages, int block_m, int sms) {
  (void)block_m;
  const double penalty = split_penalty();
  const int64_t max_s = std::min<int64_t>({stages, 32, kCounterCap / std::max<int64_t>(1, tiles)});
  int best = 1;
  double best_score = -1e30;
  for (int64_t s = 1; s <= std::max<int64_t>(1, max_s); ++s) {
    const int64_t per = (stages + s - 1) / s;
    const int64_t rounds = (tiles * s + sms - 1) / sms;
    const double balance = double(tiles * stages) / double(int64_t(sms) * rounds * per);
    const double score = balance - penalty * double(s - 1);
    if (score > best_score + 1e-9) {
      best_score = score;
      best = int(s);
    }
  }
  return best;
}

// Stream-K kernel (cuda/nvfp4_gemm_streamk.cu): resident CTAs per SM for block_m, cached per device
// (0 where the kernel does not apply: block_m other than 32 / 64, or too little shared memory per CTA).
static int streamk_ctas_per_sm(int block_m) {
  if (block_m != 32 && block_m != 64) return 0;
  static int cache[64][2];
  static bool known[64][2] = {};
  const int dev = at::cuda::current_device();
  const int b = block_m == 64 ? 1 : 0;
  if (dev < 0 || dev >= 64) return qerl_nvfp4_gemm_streamk_ctas_per_sm(block_m);
  std::lock_guard<std::mutex> lk(g_mu);
  if (!known[dev][b]) {
    cache[dev][b] = qerl_nvfp4_gemm_streamk_ctas_per_sm(block_m);
    known[dev][b] = true;
  }
  return cache[dev][b];
}

// CTAs requested from the stream-K kernel for (M, N) on the current device: SMs x resident CTAs per SM, or 0
// when the kernel does not apply to this shape / device (then split-K runs).
int64_t streamk_grid(int64_t m, int64_t n) {
  const int block_m = pick_block_m(m);
  const int per_sm = streamk_ctas_per_sm(block_m);
  if (per_sm <= 0 || qerl_nvfp4_gemm_streamk_tiles(int(m), int(n), block_m) > kCounterCap) return 0;
  return int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * per_sm;
}

// Output tiles (256 weight rows x block_m tokens) of the stream-K kernel for (M, N): its schedule's work items and
// the counters it uses (0 for block_m 8 / 16, where it never runs). Benchmarks record it next to streamk_grid.
int64_t streamk_tiles(int64_t m, int64_t n) { return qerl_nvfp4_gemm_streamk_tiles(int(m), int(n), pick_block_m(m)); }


// Auto's shape rule (see streamk_min_tiles): enough 256-row tiles for the CTAs, or long enough ranges.
static bool streamk_pays(int64_t m, int64_t n, int64_t k, int64_t grid) {
  if (grid <= 0) return false;
  const int64_t tiles = qerl_nvfp4_gemm_streamk_tiles(int(m), int(n), pick_block_m(m));
  const int64_t stages_per_cta = (tiles * (k / QERL_GEMM_BK) + grid - 1) / grid;
  return double(tiles) >= streamk_min_tiles() * double(grid) || stages_per_cta >= kStreamkMinStagesPerCta;
}

// The stream-K grid for (M, N, K) under `policy`, or 0: split-K runs.
int64_t streamk_launch_grid(int64_t m, int64_t n, int64_t k, StreamK policy) {
  if (policy == StreamK::kNever) return 0;
  const int64_t grid = streamk_grid(m, n);
  if (grid <= 0) return 0;
  return (policy == StreamK::kWhereItApplies || streamk_pays(m, n, k, grid)) ? grid : 0;
}


// From this M on the register-A kernel runs its wide token tiles (cuda/nvfp4_gemm_wgmma_wide.cu: half the decode per
// tensor cycle of the 128-token tiles); a benchmark hook moves it to time both tile widths side by side.
static std::atomic<int64_t> g_wgmma_wide_min_m{129};
// Whether the wide kernel fits its token tile to M (160 / 192 / 224 / 256, wide_block_t); a benchmark hook holds it
// at 256 to time both side by side.
static std::atomic<bool> g_wgmma_wide_fit{true};

int64_t set_wgmma_wide_min_m(int64_t m) {
  QCHECK(m >= 65, "qerl set_wgmma_wide_min_m: M must be >= 65 (64-token tiles serve M <= 64), got ", m);
  return g_wgmma_wide_min_m.exchange(m);
}

bool set_wgmma_wide_fit(bool on) { return g_wgmma_wide_fit.exchange(on); }

// The wide kernel's token tile for M: of 160, 192, 224 and 256 tokens the one whose ceil(M / T) tiles hold the fewest
// rows (the widest of equals): M = 129-160 -> 160, 161-192 -> 192, 193-224 -> 224, 225-256 -> 256, 257-320 -> 160,
// ... Every wgmma multiplies the tile's whole width, rows past M too, so the rows a tiling pads are tensor work thrown
// away (benchmarks/NOTES.md, "Twenty-first round"). With the benchmark knob off: 256 only.
static int wide_block_t(int64_t m) {
  if (!g_wgmma_wide_fit.load()) return 256;
  int best = 256;
  for (const int t : {224, 192, 160})
    if ((m + t - 1) / t * t < (m + best - 1) / best * best) best = t;
  return best;
}

// Hopper wgmma kernels: tokens per tile for M, and the CTAs a kernel requests on the current device (SMs x resident
// CTAs per SM), or 0 where it is unavailable (not an sm_90a build, not an sm_90 device).
int wgmma_block_t(int64_t m, Wgmma kind) {
  if (m <= 64) return 64;
  const bool reg_a = kind == Wgmma::kRegA || kind == Wgmma::kRegAWide;
  if (reg_a && m >= g_wgmma_wide_min_m.load()) return wide_block_t(m);
  return kind == Wgmma::kRegAWide ? QERL_WGMMA_WIDE_128 : 128;
}

// Resident CTAs per SM of kernel variant `variant` (< kVariants) on the current device: ask(), answered once per
// device and variant (an occupancy query per GEMM call would cost more than a small GEMM).
template <int kVariants, class Ask>
static int cached_ctas_per_sm(int variant, Ask&& ask) {
  static int cache[64][kVariants];
  static bool known[64][kVariants] = {};
  const int dev = at::cuda::current_device();
  if (dev < 0 || dev >= 64) return ask();
  std::lock_guard<std::mutex> lk(g_mu);
  if (!known[dev][variant]) {
    cache[dev][variant] = ask();
    known[dev][variant] = true;
  }
  return cache[dev][variant];
}

int64_t wgmma_grid(int64_t m, int64_t n, Wgmma kind) {
  if (kind == Wgmma::kNone) return 0;
  const int block_t = wgmma_block_t(m, kind);
  const int ki = kind == Wgmma::kSS ? 1 : 0;
  const int b = block_t == 256 ? 2 : block_t == 192 ? 3 : block_t == 128 ? 1 : block_t == QERL_WGMMA_WIDE_128 ? 4
              : block_t == 160 ? 5 : block_t == 224 ? 6 : 0;
  const int per_sm = cached_ctas_per_sm<14>(ki * 7 + b, [&] {
    return kind == Wgmma::kSS ? qerl_nvfp4_gemm_wgmma_ss_ctas_per_sm(block_t) : qerl_nvfp4_gemm_wgmma_ctas_per_sm(block_t);
  });
  const int tiles = kind == Wgmma::kSS ? qerl_nvfp4_gemm_wgmma_ss_tiles(int(m), int(n), block_t)
                                       : qerl_nvfp4_gemm_wgmma_tiles(int(m), int(n), block_t);
  if (per_sm <= 0 || tiles > kCounterCap) return 0;
  return int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * per_sm;
}

// The copy-engine decode kernel (cuda/nvfp4_gemm_decode_tma.cu) for M <= 16, plain (lora 0), with the LoRA epilogue
// (1) or with the LoRA shrink in its launch too (2, the linear kernel): the CTAs it requests on the current device
// (SMs x resident CTAs per SM), or 0 where it does not run (M > 16, not an sm_90a build or sm_90 device, more tiles
// than counters).
int64_t decode_tma_grid(int64_t m, int64_t n, int lora) {
  if (m > 16) return 0;
  const int block_m = pick_block_m(m);
  const int per_sm = cached_ctas_per_sm<6>((block_m == 16 ? 3 : 0) + lora, [&] {
    return qerl_nvfp4_gemm_decode_tma_ctas_per_sm(block_m, lora);
  });
  if (per_sm <= 0 || qerl_nvfp4_gemm_decode_tma_tiles(int(m), int(n), block_m) > kCounterCap) return 0;
  return int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * per_sm;
}

// ---- measured dispatch (auto mode on devices with a calibration table; benchmarks/kernel.py writes it)
//
// The GEMMs the op can run, by role (cuda/gemm_modes.h). Their names are the one list the table file, gemm_choice
// and the Python side share; ids are dense from 0 in the header's order, so a name's index is its id.
const std::vector<std::string>& gemm_kernel_names() {
  static const std::vector<std::string> names = {
#define QERL_GEMM_KERNEL_DEF(id, value, name, doc) name,
#include "gemm_modes.h"
  };
  return names;
}
constexpr bool kernel_ids_dense() {
  int64_t expect = 0;
  bool dense = true;
#define QERL_GEMM_KERNEL_DEF(id, value, name, doc) dense = dense && (value) == expect++;
#include "gemm_modes.h"
  return dense;
}
static_assert(kernel_ids_dense(), "cuda/gemm_modes.h: kernel ids must be 0, 1, 2, ... in order");
const std::string& kernel_name(GemmKernel k) { return gemm_kernel_names()[static_cast<size_t>(k)]; }

// (name, value) of every mode, in the header's order (the binding exports it; tests compare it with Python's parse).
std::vector<std::pair<std::string, int64_t>> gemm_modes() {
  return {
#define QERL_GEMM_MODE(id, value, name, doc) {name, value},
#include "gemm_modes.h"
  };
}

// The mode named by `mode`, or an error listing the valid ones.
GemmMode checked_mode(int64_t mode, const char* who) {
  switch (mode) {
#define QERL_GEMM_MODE(id, value, name, doc) case value:
#include "gemm_modes.h"
    return static_cast<GemmMode>(mode);
    default:
      break;
  }
  std::string known;
  for (const auto& [name, value] : gemm_modes()) known += msg(known.empty() ? "" : ", ", value, " ", name);
  QCHECK(false, who, ": unknown mode ", mode, " (", known, "; cuda/gemm_modes.h)");
  return GemmMode::Auto;
}

// One measured point: for an [n, k] weight at m tokens, `kernel` was the fastest (CUDA-graph time).
struct DispatchPoint {
  int64_t n, k, m, kernel;
};
static std::vector<DispatchPoint> g_table;  // empty: the rule-based dispatch below (sm_80 / sm_89, or no table loaded)

void set_dispatch_table(const std::vector<std::vector<int64_t>>& points) {
  std::vector<DispatchPoint> t;
  for (const auto& p : points) {
    QCHECK(p.size() == 4, "qerl set_dispatch_table: each point is [n, k, m, kernel id], got ", int64_t(p.size()),
           " values");
    QCHECK(p[0] > 0 && p[1] > 0 && p[2] > 0, "qerl set_dispatch_table: n, k, m must be positive, got [", p[0],
           ", ", p[1], ", ", p[2], "]");
    QCHECK(p[3] >= 0 && p[3] < int64_t(gemm_kernel_names().size()), "qerl set_dispatch_table: unknown kernel id ",
           p[3]);
    t.push_back({p[0], p[1], p[2], p[3]});
  }
  std::lock_guard<std::mutex> lk(g_mu);
  g_table = std::move(t);
}

// The measured kernel for (m, n, k), or -1 without a table: the point of the nearest measured weight shape
// (distance |ln n - ln n'| + |ln k - ln k'|), then of its nearest measured M (|ln m - ln m'|; a tie goes to the
// larger M). Nearest-point rather than thresholds: the table is the measurement, nothing is hand-set.
int64_t table_pick(int64_t m, int64_t n, int64_t k) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_table.empty()) return -1;
  const double lm = std::log(double(m)), ln = std::log(double(n)), lk2 = std::log(double(k));
  double best_shape = 1e300;
  int64_t bn = 0, bk = 0;
  for (const auto& p : g_table) {
    const double d = std::fabs(ln - std::log(double(p.n))) + std::fabs(lk2 - std::log(double(p.k)));
    if (d < best_shape - 1e-12) {
      best_shape = d;
      bn = p.n;
      bk = p.k;
    }
  }
  double best_m = 1e300;
  int64_t best_m_val = 0, kernel = -1;
  for (const auto& p : g_table) {
    if (p.n != bn || p.k != bk) continue;
    const double d = std::fabs(lm - std::log(double(p.m)));
    if (d < best_m - 1e-12 || (std::fabs(d - best_m) <= 1e-12 && p.m > best_m_val)) {
      best_m = d;
      best_m_val = p.m;
      kernel = p.kernel;
    }
  }
  return kernel;
}


// Auto with a calibration table (loaded by Python for the device it was measured on): the measured kernel, when it
// is available here; false when there is no table or the kernel does not run on this build / device.
static bool table_route(int64_t m, int64_t n, int64_t k, Route* r) {
  const int64_t id = table_pick(m, n, k);
  if (id < 0) return false;
  switch (static_cast<GemmKernel>(id)) {
    case GemmKernel::SplitK:
      *r = {true, StreamK::kNever, Wgmma::kNone};
      return true;
    case GemmKernel::StreamK:
      *r = {true, StreamK::kWhereItApplies, Wgmma::kNone};
      return true;
    case GemmKernel::WgmmaRS:
      *r = {true, StreamK::kNever, Wgmma::kRegA};
      return wgmma_grid(m, n, Wgmma::kRegA) > 0;
    case GemmKernel::WgmmaSS:
      *r = {true, StreamK::kNever, Wgmma::kSS};
      return wgmma_grid(m, n, Wgmma::kSS) > 0;
    case GemmKernel::WgmmaWide:
      *r = {true, StreamK::kNever, Wgmma::kRegAWide};
      return wgmma_grid(m, n, Wgmma::kRegAWide) > 0;
    case GemmKernel::DequantCublas:
      *r = {false, StreamK::kNever, Wgmma::kNone};
      return true;
    case GemmKernel::DecodeTma:
      *r = {true, StreamK::kNever, Wgmma::kNone, true};
      return decode_tma_grid(m, n) > 0;
  }
  return false;
}

Route route(int64_t m, int64_t n, int64_t k, at::ScalarType dtype, GemmMode mode) {
  const bool kernel_ok = dtype == at::kBFloat16 && k % QERL_GEMM_BK == 0;
  Route r{};
  if (mode == GemmMode::Auto && kernel_ok && table_route(m, n, k, &r)) return r;
  const bool by_m = kernel_ok && m <= gemm_max_m();  // the auto modes' fused-kernel range
  switch (mode) {
    case GemmMode::Auto:
      return {by_m, StreamK::kWherePays, Wgmma::kNone};
    case GemmMode::AutoStreamK:
      return {by_m, StreamK::kWhereItApplies, Wgmma::kNone};
    case GemmMode::AutoSplitK:
      return {by_m, StreamK::kNever, Wgmma::kNone};
    case GemmMode::SplitK:
      return {true, StreamK::kNever, Wgmma::kNone};
    case GemmMode::StreamK:
      return {true, StreamK::kWhereItApplies, Wgmma::kNone};
    case GemmMode::WgmmaRS:
      return {true, StreamK::kWhereItApplies, Wgmma::kRegA};
    case GemmMode::WgmmaSS:
      return {true, StreamK::kWhereItApplies, Wgmma::kSS};
    case GemmMode::WgmmaWide:
      return {true, StreamK::kWhereItApplies, Wgmma::kRegAWide};
    case GemmMode::DecodeTma:
      return {true, StreamK::kWhereItApplies, Wgmma::kNone, true};
    case GemmMode::DequantCublas:
      return {false, StreamK::kNever, Wgmma::kNone};
  }
  return {false, StreamK::kNever, Wgmma::kNone};
}

// Whether the route runs the split-K kernel with a LoRA epilogue for these sizes (what the in-launch shrink needs).
bool splitk_lora_runs(int64_t m, int64_t n, int64_t k, const Route& r) {
  return r.kernel && !(r.decode_tma && decode_tma_grid(m, n) > 0) && wgmma_grid(m, n, r.wgmma) == 0 &&
         streamk_launch_grid(m, n, k, r.policy) == 0 && pick_block_m(m) <= QERL_LORA_EPILOGUE_MAX_BLOCK_M;
}

// Whether the route runs the copy-engine decode kernel, and its launch takes an in-launch shrink of `ranks` columns
// (one m-tile, no more shrink units than its CTAs, counters to spare; cuda/nvfp4_gemm_decode_tma.cu).
bool decode_shrink_fits(int64_t m, int64_t n, int64_t k, const Route& r, int64_t ranks) {
  if (!r.kernel || !r.decode_tma || ranks <= 0 || ranks > 128) return false;
  const int64_t grid = decode_tma_grid(m, n, 2);
  if (grid <= 0 || decode_tma_grid(m, n) <= 0) return false;  // (the route's own rule: the plain kernel runs)
  const int block_m = pick_block_m(m);
  const int64_t counters = qerl_nvfp4_gemm_decode_tma_tiles(int(m), int(n), block_m) + 3 + (ranks + 31) / 32;
  return counters <= kCounterCap &&
         qerl_nvfp4_gemm_decode_tma_shrink_fits(int(m), int(n), int(k), int(grid), block_m, int(ranks)) != 0;
}

// Whether qerl::nvfp4_lora_linear runs the shrink inside the GEMM's launch for these sizes and `ranks` shrunk columns
// (n_slices x rank; with operands that fit it): the split-K kernel's, or the decode kernel's; tests and benchmarks
// ask (no launch).
bool lora_shrink_in_launch_runs(int64_t m, int64_t n, int64_t k, int64_t mode, int64_t ranks) {
  const Route r = route(m, n, k, at::kBFloat16, checked_mode(mode, "qerl lora_shrink_in_launch_runs"));
  return splitk_lora_runs(m, n, k, r) || decode_shrink_fits(m, n, k, r, ranks);
}

// Whether qerl::nvfp4_gemm_lora adds the LoRA term in a GEMM's epilogue (the split-K kernel's, or the decode
// kernel's where mode / table run it) for these sizes (with operands that fit it) rather than running
// qerl::lora_expand after the GEMM (tests and benchmarks ask; no launch).
bool lora_epilogue_runs(int64_t m, int64_t n, int64_t k, int64_t mode) {
  const Route r = route(m, n, k, at::kBFloat16, checked_mode(mode, "qerl lora_epilogue_runs"));
  if (r.kernel && r.decode_tma && decode_tma_grid(m, n) > 0) return true;  // block_m 8 and 16
  if (r.kernel && (r.wgmma == Wgmma::kRegA || r.wgmma == Wgmma::kRegAWide) && wgmma_grid(m, n, r.wgmma) > 0 &&
      wgmma_block_t(m, r.wgmma) != 128)
    return true;  // the register-A wgmma kernels (ranks <= 128): the 64-token tiles at 17-64 tokens, the wide kernel
                  // above (its 128-token tiles at 65-128 under wgmma_wide; wgmma_rs's 256-row 128-token kernel has no
                  // LoRA term)
  return splitk_lora_runs(m, n, k, r);
}

// What gemm_cuda runs for a [m, k] bf16 input, an [n, k] weight and `mode` on the current device: one of
// gemm_kernel_names() (benchmarks label their rows with it; no launch).
std::string gemm_choice(int64_t m, int64_t n, int64_t k, int64_t mode) {
  const Route r = route(m, n, k, at::kBFloat16, checked_mode(mode, "qerl gemm_choice"));
  if (!r.kernel) return kernel_name(GemmKernel::DequantCublas);
  if (r.decode_tma && decode_tma_grid(m, n) > 0) return kernel_name(GemmKernel::DecodeTma);
  if (wgmma_grid(m, n, r.wgmma) > 0)
    return kernel_name(r.wgmma == Wgmma::kSS                                           ? GemmKernel::WgmmaSS
                       : wgmma_block_t(m, r.wgmma) == QERL_WGMMA_WIDE_128 ? GemmKernel::WgmmaWide
                                                                           : GemmKernel::WgmmaRS);
  return kernel_name(streamk_launch_grid(m, n, k, r.policy) > 0 ? GemmKernel::StreamK : GemmKernel::SplitK);
}

void set_tuning(int64_t gemm_max_m_value, double penalty, double streamk_min_tiles_value) {
  if (gemm_max_m_value >= 0) g_gemm_max_m = gemm_max_m_value;
  if (penalty >= 0) g_split_penalty = penalty;
  if (streamk_min_tiles_value >= 0) g_streamk_min_tiles = streamk_min_tiles_value;
}

std::vector<double> get_tuning() {
  return {double(gemm_max_m()), split_penalty(), streamk_min_tiles(), double(kStreamkMinStagesPerCta)};
}

int64_t splits_for(int64_t m, int64_t n, int64_t k) {
  const int block_m = pick_block_m(m);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return pick_splits(((n + QERL_GEMM_BN - 1) / QERL_GEMM_BN) * ((m + block_m - 1) / block_m), k / QERL_GEMM_BK,
                     block_m, sms);
}

}  // namespace qerl_binding
