// What the torch binding's two translation units share: the op's modes and GEMM kernels (cuda/gemm_modes.h), the
// route a mode takes, and the dispatch functions cuda/gemm_route.cpp defines for cuda/qerl_torch.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// The op's modes and the GEMM paths it runs, from their one definition (cuda/gemm_modes.h, also parsed by Python).
enum class GemmMode : int64_t {
#define QERL_GEMM_MODE(id, value, name, doc) id = value,
#include "gemm_modes.h"
};
enum class GemmKernel : int64_t {
#define QERL_GEMM_KERNEL_DEF(id, value, name, doc) id = value,
#include "gemm_modes.h"
};

namespace qerl_binding {

// Split-K / stream-K semaphores per device (one int per output tile of a launch).
constexpr int64_t kCounterCap = 1 << 14;

// Which mma.sync fused kernel a mode may run: split-K only, stream-K where it applies and pays (tile count, auto), or stream-K
// wherever it applies (block_m 32 / 64 on a device that grants its ring).
enum class StreamK { kNever, kWherePays, kWhereItApplies };

// Which Hopper wgmma kernel a route runs: none, register-A (cuda/nvfp4_gemm_wgmma.cu and its wide-token kernel), the
// same with the wide kernel's 128-token tiles at M = 65-128 (`wgmma_wide`), or both operands in shared memory
// (cuda/nvfp4_gemm_wgmma_ss.cu).
enum class Wgmma { kNone, kRegA, kSS, kRegAWide };

// What a mode runs (cuda/gemm_modes.h): the fused kernel or dequantize + cuBLAS, and which fused kernel may run.
struct Route {
  bool kernel;     // fused kernel (else dequant + cuBLAS)
  StreamK policy;  // which mma.sync fused kernel may run
  Wgmma wgmma;     // a Hopper wgmma kernel, where it is available (else `policy` decides)
  bool decode_tma = false;  // the copy-engine decode kernel at M <= 16, where it is available (before `wgmma`)
};

// ---- the split-K semaphores (a per-device buffer allocated once outside capture, left zeroed by every launch)
void init_workspace(int64_t device);
int* counters_for(const at::Device& dev);

// ---- tiles and grids on the current device (0: the kernel does not run for this shape / build / device)
int pick_block_m(int64_t m);
int pick_splits(int64_t tiles, int64_t stages, int block_m, int sms);
int64_t streamk_grid(int64_t m, int64_t n);
int64_t streamk_tiles(int64_t m, int64_t n);
int64_t streamk_launch_grid(int64_t m, int64_t n, int64_t k, StreamK policy);
int wgmma_block_t(int64_t m, Wgmma kind);
int64_t wgmma_grid(int64_t m, int64_t n, Wgmma kind = Wgmma::kRegA);
int64_t decode_tma_grid(int64_t m, int64_t n, int lora = 0);

// ---- benchmark hooks and tuning
int64_t set_wgmma_wide_min_m(int64_t m);
bool set_wgmma_wide_fit(bool on);
void set_tuning(int64_t gemm_max_m_value, double penalty, double streamk_min_tiles_value);
std::vector<double> get_tuning();
int64_t splits_for(int64_t m, int64_t n, int64_t k);

// ---- modes, kernels and the measured dispatch
const std::vector<std::string>& gemm_kernel_names();
const std::string& kernel_name(GemmKernel k);
std::vector<std::pair<std::string, int64_t>> gemm_modes();
GemmMode checked_mode(int64_t mode, const char* who);
void set_dispatch_table(const std::vector<std::vector<int64_t>>& points);
int64_t table_pick(int64_t m, int64_t n, int64_t k);
Route route(int64_t m, int64_t n, int64_t k, at::ScalarType dtype, GemmMode mode);
std::string gemm_choice(int64_t m, int64_t n, int64_t k, int64_t mode);

// ---- where the LoRA term runs
bool splitk_lora_runs(int64_t m, int64_t n, int64_t k, const Route& r);
bool decode_shrink_fits(int64_t m, int64_t n, int64_t k, const Route& r, int64_t ranks);
bool lora_shrink_in_launch_runs(int64_t m, int64_t n, int64_t k, int64_t mode, int64_t ranks);
bool lora_epilogue_runs(int64_t m, int64_t n, int64_t k, int64_t mode);

}  // namespace qerl_binding
