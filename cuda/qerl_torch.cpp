// Thin torch binding of the NVFP4 kernels: registers the CUDA kernels of the qerl::* ops whose
// schemas, CPU fallbacks and fake impls are defined in Python (verl_qerl/kernels/ops.py). Which kernel
// an op runs, with which grid, is cuda/gemm_route.cpp's job; this file checks arguments and launches.
//
// Graph-capture rules kept here: no host syncs, no .item(), outputs and split-K workspaces come
// from the caching allocator (shape-determined sizes only); the split-K semaphores are a per-device
// buffer allocated once outside capture (init_workspace) and left zeroed by every launch.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "qerl_nvfp4.h"

#ifdef QERL_ANATOMY_STAMPS
extern "C" cudaError_t qerl_anatomy_read_wgmma(unsigned long long* host, int ctas, int reset);
extern "C" cudaError_t qerl_anatomy_read_wide(unsigned long long* host, int ctas, int reset);
#endif

#include "binding_errors.h"
#include "gemm_route.h"

namespace qerl_binding {
namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return QERL_BF16;
    case at::kHalf:
      return QERL_F16;
    case at::kFloat:
      return QERL_F32;
    default:
      QCHECK(false, "qerl: unsupported output dtype ", t, " (bfloat16, float16 or float32)");
      return QERL_BF16;
  }
}

void check_cuda(cudaError_t e, const char* what) {
  QCHECK(e == cudaSuccess, "qerl: ", what, " failed: ", cudaGetErrorString(e));
}

const uint8_t* scale_bytes(const at::Tensor& s) {
  QCHECK(s.scalar_type() == at::kByte || s.scalar_type() == at::kFloat8_e4m3fn,
              "qerl: block scale must be float8_e4m3fn or uint8, got ", s.scalar_type());
  return static_cast<const uint8_t*>(s.data_ptr());
}

void check_gscale(const at::Tensor& gs, const at::Tensor& like) {
  QCHECK(gs.is_cuda() && gs.device() == like.device(), "qerl: global_scale must be on ", like.device());
  QCHECK(gs.scalar_type() == at::kFloat && gs.numel() == 1, "qerl: global_scale must be fp32 with 1 element");
}

at::Tensor dequant_cuda(const at::Tensor& packed_in, const at::Tensor& scale_in, const at::Tensor& gs,
                        at::ScalarType dtype) {
  QCHECK(packed_in.is_cuda() && packed_in.scalar_type() == at::kByte && packed_in.dim() == 2,
              "qerl::nvfp4_dequant: packed must be CUDA uint8 [N, K/2]");
  const int64_t n = packed_in.size(0), k = packed_in.size(1) * 2;
  QCHECK(scale_in.dim() == 2 && scale_in.size(0) == n && scale_in.size(1) * 16 == k,
              "qerl::nvfp4_dequant: scale shape ", scale_in.sizes(), " does not match weight [", n, ", ", k, "]");
  check_gscale(gs, packed_in);
  c10::cuda::CUDAGuard g(packed_in.device());
  // 8-byte vector loads need contiguous, 8-byte aligned rows: copy a misaligned view.
  at::Tensor packed = packed_in.contiguous();
  if (reinterpret_cast<uintptr_t>(packed.data_ptr()) % 8 != 0) packed = packed.clone();
  at::Tensor scale = scale_in.contiguous();
  at::Tensor out = at::empty({n, k}, packed.options().dtype(dtype));
  check_cuda(qerl_nvfp4_dequant_launch(static_cast<const uint8_t*>(packed.data_ptr()), scale_bytes(scale),
                                       gs.data_ptr<float>(), out.data_ptr(), int(n), int(k), dtype_code(dtype),
                                       at::cuda::getCurrentCUDAStream()),
             "nvfp4_dequant launch");
  return out;
}

void check_repacked(const at::Tensor& qw, const at::Tensor& qs, int64_t n) {
  QCHECK(qw.is_cuda() && qw.scalar_type() == at::kByte && qw.dim() == 3 && qw.size(2) == 8192,
              "qerl: qweight must be CUDA uint8 [N_pad/128, K/128, 8192] (from verl_qerl.kernels.repack)");
  QCHECK(qs.is_cuda() && qs.scalar_type() == at::kByte && qs.dim() == 3 && qs.size(2) == 1024 &&
                  qs.size(0) == qw.size(0) && qs.size(1) == qw.size(1),
              "qerl: qscale must be CUDA uint8 [N_pad/128, K/128, 1024] matching qweight");
  QCHECK(qw.is_contiguous() && qs.is_contiguous(), "qerl: qweight/qscale must be contiguous");
  QCHECK(reinterpret_cast<uintptr_t>(qw.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(qs.data_ptr()) % 16 == 0,
              "qerl: qweight/qscale must be 16-byte aligned");
  QCHECK(n > 0 && n % 16 == 0 && n <= qw.size(0) * 128 && n > (qw.size(0) - 1) * 128,
              "qerl: n=", n, " does not fit qweight rows ", qw.size(0) * 128, " (n must be a multiple of 16)");
}

at::Tensor dequant_repacked_cuda(const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& gs, int64_t n,
                                 at::ScalarType dtype) {
  check_repacked(qw, qs, n);
  check_gscale(gs, qw);
  c10::cuda::CUDAGuard g(qw.device());
  const int64_t k = qw.size(1) * 128;
  at::Tensor out = at::empty({n, k}, qw.options().dtype(dtype));
  check_cuda(qerl_nvfp4_dequant_repacked_launch(static_cast<const uint8_t*>(qw.data_ptr()),
                                                static_cast<const uint8_t*>(qs.data_ptr()), gs.data_ptr<float>(),
                                                out.data_ptr(), int(n), int(k), dtype_code(dtype),
                                                at::cuda::getCurrentCUDAStream()),
             "nvfp4_dequant_repacked launch");
  return out;
}

// Large M: dequantize to the activations' dtype and let cuBLAS do the (compute-bound) GEMM.
at::Tensor dequant_cublas_cuda(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& gs,
                               const c10::optional<at::Tensor>& bias, int64_t n) {
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->to(x.scalar_type());
  at::Tensor w = dequant_repacked_cuda(qw, qs, gs, n, x.scalar_type());
  return at::linear(x, w, b);
}

// The fused GEMM the route picks (`decode_tma`: the copy-engine decode kernel first, where it runs). `lora`
// (qerl::nvfp4_gemm_lora): a LoRA expand for the kernel's epilogue; *lora_done tells whether it ran there (only the
// split-K, decode and register-A wgmma kernels at 64 / 192 / 256 tokens have one, and only for what their *_lora_supported accept): when false the caller adds
// the LoRA term itself. `pdl` (the ops' argument): the split-K and decode kernels go out as programmatic dependent
// launches on sm_90+ devices (cuda/qerl_nvfp4.h says what the caller promises); the other kernels ignore it.
at::Tensor gemm_kernel_cuda(const at::Tensor& x_in, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& gs,
                            const c10::optional<at::Tensor>& bias, int64_t n, int64_t splits_override,
                            StreamK policy = StreamK::kNever, Wgmma wgmma = Wgmma::kNone,
                            const QerlLoraEpilogue* lora = nullptr, bool* lora_done = nullptr,
                            bool decode_tma = false, bool pdl = false) {
  if (lora_done != nullptr) *lora_done = false;
  const int pdl_launch = pdl && at::cuda::getCurrentDeviceProperties()->major >= 9 ? 1 : 0;
  QCHECK(x_in.scalar_type() == at::kBFloat16, "qerl::nvfp4_gemm (kernel): x must be bfloat16, got ",
              x_in.scalar_type());
  const int64_t m = x_in.size(0), k = x_in.size(1);
  QCHECK(k % QERL_GEMM_BK == 0, "qerl::nvfp4_gemm (kernel): K=", k, " must be a multiple of ", QERL_GEMM_BK,
              " (shape x [", m, ", ", k, "], W [", n, ", ", k, "]); use mode auto or dequant_cublas for other shapes");
  at::Tensor x = x_in.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const void* bptr = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kBFloat16).contiguous();
    QCHECK(b.numel() == n && b.device() == x.device(), "qerl::nvfp4_gemm: bias must be [", n, "] on ",
                x.device());
    bptr = b.data_ptr();
  }
  // (its own name: the split-K path below declares with_lora in this scope). With lora_a (qerl::nvfp4_lora_linear,
  // which routed here after decode_shrink_runs) the decode kernel's launch computes the shrink too.
  const bool decode_shrink = decode_tma && lora != nullptr && lora->lora_a != nullptr;
  const bool decode_lora =
      decode_tma && lora != nullptr &&
      (decode_shrink || qerl_nvfp4_gemm_decode_tma_lora_supported(int(n), pick_block_m(m), lora));
  if (const int64_t grid = decode_tma ? decode_tma_grid(m, n, decode_shrink ? 2 : (decode_lora ? 1 : 0)) : 0;
      grid > 0) {
    const int block_m = pick_block_m(m);
    const QerlLoraEpilogue* ep = decode_lora ? lora : nullptr;
    QCHECK(!decode_shrink || qerl_nvfp4_gemm_decode_tma_lora_counters(int(m), int(n), block_m, ep) <= kCounterCap,
           "qerl::nvfp4_lora_linear: the decode kernel's in-launch shrink needs more counters than the ", kCounterCap,
           " held");
    const size_t wsf =
        qerl_nvfp4_gemm_decode_tma_lora_workspace_floats(int(m), int(n), int(k), int(grid), block_m, ep);
    at::Tensor dws;
    if (wsf > 0) dws = at::empty({int64_t(wsf)}, x.options().dtype(at::kFloat));
    check_cuda(qerl_nvfp4_gemm_decode_tma_launch(x.data_ptr(), qw.data_ptr(), qs.data_ptr(), gs.data_ptr<float>(),
                                                 bptr, out.data_ptr(), wsf > 0 ? dws.data_ptr<float>() : nullptr,
                                                 counters_for(x.device()), int(m), int(n), int(k), int(grid), block_m,
                                                 ep, pdl_launch, at::cuda::getCurrentCUDAStream()),
               decode_shrink ? "nvfp4_lora_linear (decode TMA) launch"
               : decode_lora ? "nvfp4_gemm_lora (decode TMA) launch"
                             : "nvfp4_gemm (decode TMA) launch");
    if (lora_done != nullptr) *lora_done = decode_lora;
    return out;
  }
  if (const int64_t grid = wgmma_grid(m, n, wgmma); grid > 0) {
    const int block_t = wgmma_block_t(m, wgmma);
    const bool ss = wgmma == Wgmma::kSS;
    const size_t wsf = ss ? qerl_nvfp4_gemm_wgmma_ss_workspace_floats(int(m), int(n), int(k), int(grid), block_t)
                          : qerl_nvfp4_gemm_wgmma_workspace_floats(int(m), int(n), int(k), int(grid), block_t);
    at::Tensor wws;
    if (wsf > 0) wws = at::empty({int64_t(wsf)}, x.options().dtype(at::kFloat));
    const bool wgmma_lora = !ss && lora != nullptr && qerl_nvfp4_gemm_wgmma_lora_supported(int(n), block_t, lora);
    if (wgmma_lora) {
      check_cuda(qerl_nvfp4_gemm_wgmma_lora_launch(x.data_ptr(), qw.data_ptr(), qs.data_ptr(), gs.data_ptr<float>(),
                                                   bptr, out.data_ptr(), wsf > 0 ? wws.data_ptr<float>() : nullptr,
                                                   counters_for(x.device()), int(m), int(n), int(k), int(grid),
                                                   block_t, lora, at::cuda::getCurrentCUDAStream()),
                 "nvfp4_gemm_lora (wgmma) launch");
      if (lora_done != nullptr) *lora_done = true;
      return out;
    }
    auto* launch = ss ? qerl_nvfp4_gemm_wgmma_ss_launch : qerl_nvfp4_gemm_wgmma_launch;
    check_cuda(launch(x.data_ptr(), qw.data_ptr(), qs.data_ptr(), gs.data_ptr<float>(), bptr, out.data_ptr(),
                      wsf > 0 ? wws.data_ptr<float>() : nullptr, counters_for(x.device()), int(m), int(n), int(k),
                      int(grid), block_t, at::cuda::getCurrentCUDAStream()),
               ss ? "nvfp4_gemm (wgmma SS) launch" : "nvfp4_gemm (wgmma) launch");
    return out;
  }
  const int block_m = pick_block_m(m);
  if (const int64_t grid = streamk_launch_grid(m, n, k, policy); grid > 0) {
    const size_t wsf = qerl_nvfp4_gemm_streamk_workspace_floats(int(m), int(n), int(k), int(grid), block_m);
    at::Tensor sws;
    if (wsf > 0) sws = at::empty({int64_t(wsf)}, x.options().dtype(at::kFloat));
    check_cuda(qerl_nvfp4_gemm_streamk_launch(x.data_ptr(), qw.data_ptr(), qs.data_ptr(), gs.data_ptr<float>(),
                                              bptr, out.data_ptr(), wsf > 0 ? sws.data_ptr<float>() : nullptr,
                                              counters_for(x.device()), int(m), int(n), int(k), int(grid),
                                              block_m, at::cuda::getCurrentCUDAStream()),
               "nvfp4_gemm (stream-K) launch");
    return out;
  }
  const int64_t n_tiles = (n + QERL_GEMM_BN - 1) / QERL_GEMM_BN;
  const int64_t m_tiles = (m + block_m - 1) / block_m;
  const int64_t stages = k / QERL_GEMM_BK;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const bool with_lora = lora != nullptr && qerl_nvfp4_gemm_lora_supported(int(n), block_m, lora) != 0;
  const bool in_launch_shrink = with_lora && lora->lora_a != nullptr;
  QCHECK(!in_launch_shrink || qerl_nvfp4_gemm_lora_counters(int(m), int(n), block_m, lora) <= kCounterCap,
         "qerl::nvfp4_lora_linear: the in-launch shrink needs more split-K counters than the ", kCounterCap, " held");
  // The in-launch shrink's CTA columns (one per 32 ranks; a CTA streams about one GEMM CTA's bytes: 32 bf16 A rows vs
  // 128 FP4 rows and their scales) count in the balance as tiles.
  const int64_t shrink_cols = in_launch_shrink ? qerl_nvfp4_gemm_lora_shrink_cols(lora) : 0;
  int splits = splits_override > 0 ? int(std::min<int64_t>(splits_override, stages))
                                   : pick_splits((n_tiles + shrink_cols) * m_tiles, stages, block_m, sms);
  if (n_tiles * m_tiles > kCounterCap) splits = 1;
  at::Tensor ws;
  int* counters = nullptr;
  if (splits > 1 || in_launch_shrink) {
    ws = at::empty({int64_t(qerl_nvfp4_gemm_lora_workspace_floats(int(m), int(n), splits, block_m,
                                                                  with_lora ? lora : nullptr))},
                   x.options().dtype(at::kFloat));
    counters = counters_for(x.device());
  }
  check_cuda(qerl_nvfp4_gemm_lora_launch(x.data_ptr(), qw.data_ptr(), qs.data_ptr(), gs.data_ptr<float>(), bptr,
                                         out.data_ptr(), ws.defined() ? ws.data_ptr<float>() : nullptr, counters,
                                         int(m), int(n), int(k), splits, block_m, with_lora ? lora : nullptr,
                                         pdl_launch, at::cuda::getCurrentCUDAStream()),
             in_launch_shrink ? "nvfp4_lora_linear launch" : (with_lora ? "nvfp4_gemm_lora launch" : "nvfp4_gemm launch"));
  if (lora_done != nullptr) *lora_done = with_lora;
  return out;
}

// The checks of qerl::nvfp4_gemm's arguments (also nvfp4_gemm_lora's); returns the mode.
GemmMode check_gemm_args(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& gs,
                         int64_t n, int64_t mode_value, int64_t splits, const char* who) {
  QCHECK(x.is_cuda() && x.dim() == 2, who, ": x must be a 2-D CUDA tensor [M, K]");
  check_repacked(qw, qs, n);
  check_gscale(gs, x);
  QCHECK(x.device() == qw.device(), who, ": x on ", x.device(), " but weight on ", qw.device());
  QCHECK(x.size(1) == qw.size(1) * 128, who, ": x has K=", x.size(1), " but the weight has K=", qw.size(1) * 128);
  const GemmMode mode = checked_mode(mode_value, who);
  QCHECK(splits >= 0 && (splits == 0 || mode == GemmMode::SplitK), who, ": splits=", splits,
         " (K-splits of the split-K kernel) needs mode ", static_cast<int64_t>(GemmMode::SplitK),
         " (splitk) and must be >= 0");
  return mode;
}

at::Tensor gemm_cuda(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& gs,
                     const c10::optional<at::Tensor>& bias, int64_t n, int64_t mode_value, int64_t splits, bool pdl) {
  const GemmMode mode = check_gemm_args(x, qw, qs, gs, n, mode_value, splits, "qerl::nvfp4_gemm");
  c10::cuda::CUDAGuard g(x.device());
  const Route r = route(x.size(0), n, x.size(1), x.scalar_type(), mode);
  if (r.kernel)
    return gemm_kernel_cuda(x, qw, qs, gs, bias, n, splits, r.policy, r.wgmma, nullptr, nullptr, r.decode_tma, pdl);
  return dequant_cublas_cuda(x, qw, qs, gs, bias, n);
}

// ---- qerl::nvfp4_gemm_lora: the GEMM plus a LoRA expand, in the epilogue where the split-K or decode kernel runs
//
// out = x @ W^T + bias + mask * expand(shrunk, lora_b) with expand[:, n] = shrunk[:, s(n) r : s(n) r + r] @
// lora_b[n, s(n) r : s(n) r + r] (s(n): the slice holding column n; slice_bounds = [0, end_0, .., n]). Wherever the
// route runs another GEMM, or the LoRA operands do not fit the epilogue (dtype, alignment, rank), the op runs that GEMM
// and then the expand: from kExpandCublasMinTokens tokens on cuBLAS called from here (lora_expand_native), below
// that qerl::lora_expand (verl_qerl/kernels/lora_expand.py, registered from Python: a Triton kernel) with the
// block-diagonal lora_b: the same numbers up to the one extra bf16 rounding of the base output.

// From this many tokens on the expand is `out.addmm_(shrunk * mask, lora_b^T)` (cuBLAS, launched from C++), what
// qerl::lora_expand's CUDA side runs from the same count (CUBLAS_MIN_TOKENS in verl_qerl/kernels/lora_expand.py;
// tests/test_lora_expand_gpu.py checks the two agree bit for bit). Why: the Python op costs ~96 us of host time per
// call (a 256-token 7B prefill is host-bound: 10.8 ms of ~57, benchmarks/NOTES.md "Eighth round"), and at prefill
// sizes cuBLAS's tensor-core GEMM is as fast as the Triton kernel on the device. Below it (decode, CUDA graphs: no
// host time) the Triton kernel is one launch where this is two.
constexpr int64_t kExpandCublasMinTokens = 128;
// ... except while a CUDA graph is being captured, up to this many tokens: a replay has no host work, and the Triton
// kernel is one launch where this route is two (TRITON_CAPTURED_MAX_TOKENS and expand_impl in lora_expand.py: the same
// rule, so the Python op, to which this hands the expand then, runs the same kernel).
constexpr int64_t kExpandTritonCapturedMaxTokens = 512;

bool stream_capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// An eager call from kExpandCublasMinTokens to kExpandTritonCapturedMaxTokens tokens goes through the Python op the
// first time per operand signature (it runs the same cuBLAS ops, and compiles the Triton kernel a capture of that
// shape will launch: lora_expand.py's _warm_for_capture); later calls skip the op's host time.
bool first_eager_call(const at::Tensor& out, const at::Tensor& shrunk, const at::Tensor& b_t, const at::Tensor& mask) {
  static std::mutex mu;
  static std::set<std::vector<int64_t>> seen;
  std::vector<int64_t> key = {out.size(0), out.size(1), shrunk.size(1), int64_t(out.scalar_type()),
                              out.stride(0), out.stride(1), shrunk.stride(0), shrunk.stride(1),
                              b_t.stride(0), b_t.stride(1), mask.dim() ? mask.stride(0) : 0,
                              int64_t(out.device().index())};
  std::lock_guard<std::mutex> lock(mu);
  return seen.insert(std::move(key)).second;
}

c10::optional<at::Tensor> lora_expand_native(at::Tensor& out, const at::Tensor& shrunk, const at::Tensor& b_t,
                                             const at::Tensor& mask) {
  const auto dt = out.scalar_type();
  if (out.dim() != 2 || out.size(0) < kExpandCublasMinTokens || (dt != at::kBFloat16 && dt != at::kHalf) ||
      shrunk.scalar_type() != dt || b_t.scalar_type() != dt || mask.numel() != out.size(0) ||
      (out.size(0) <= kExpandTritonCapturedMaxTokens && (stream_capturing() || first_eager_call(out, shrunk, b_t,
                                                                                                mask))))
    return c10::nullopt;
  return out.addmm_(shrunk * mask.reshape({-1, 1}).to(dt), b_t);
}

at::Tensor lora_expand_op(const at::Tensor& out, const at::Tensor& shrunk, const at::Tensor& b_t,
                          const at::Tensor& mask) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("qerl::lora_expand", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(out, shrunk, b_t, mask);
}

// Above this many tokens qerl::lora_shrink runs cuBLAS (`F.linear`, i.e. at::mm(x, a^T)) unless QERL_LORA_SHRINK is
// `triton` or shrink_triton_wins (TRITON_MAX_TOKENS, triton_wins and shrink_impl in verl_qerl/kernels/lora_shrink.py:
// the same rule), so from C++ the shrink calls at::mm itself there: the same kernel and numbers, without the Python op's ~23 us of host time per
// layer at a host-bound prefill (benchmarks/NOTES.md, "Eighth round").
constexpr int64_t kShrinkTritonMaxTokens = 16;

// triton_wins in verl_qerl/kernels/lora_shrink.py (the same numbers; measured there): where it holds above
// kShrinkTritonMaxTokens, the C++ side hands the shrink to the Python op, which runs the Triton kernel, so both
// routes keep running the same kernel.
bool shrink_triton_wins(int64_t t, int64_t r, int64_t k) {
  if (t <= kShrinkTritonMaxTokens) return true;
  return t <= 64 && k <= 4096 && t * r <= 4096;
}

// QERL_LORA_SHRINK: unset, empty or `auto` -> 'a'; `cublas` -> 'c'; anything else ('o': `triton`, or a value the
// Python op rejects with an error naming the variable) goes to the Python op.
char shrink_env_mode() {
  const char* e = std::getenv("QERL_LORA_SHRINK");
  if (e == nullptr) return 'a';
  std::string v(e);
  v.erase(0, v.find_first_not_of(" \t"));
  v.erase(v.find_last_not_of(" \t") + 1);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return v.empty() || v == "auto" ? 'a' : (v == "cublas" ? 'c' : 'o');
}

at::Tensor lora_shrink_op(const at::Tensor& x, const at::Tensor& a) {
  const char mode = shrink_env_mode();
  if (x.dim() == 2 && a.dim() == 2 && x.size(0) > kShrinkTritonMaxTokens && x.size(1) == a.size(1) &&
      x.scalar_type() == a.scalar_type() && x.device() == a.device() &&
      (mode == 'c' || (mode == 'a' && !shrink_triton_wins(x.size(0), a.size(0), x.size(1)))))
    return at::mm(x, a.t());
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("qerl::lora_shrink", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(x, a);
}

// Shapes and devices of the LoRA operands (errors name the tensor); returns the rank per slice. `shrunk` [M, S r]
// (qerl::nvfp4_gemm_lora) or, with `shrink_a`, A_cat [S r, K] (qerl::nvfp4_lora_linear).
int64_t check_lora_args(const at::Tensor& x, int64_t n, const at::Tensor& shrunk, const at::Tensor& lora_b,
                        const at::Tensor& mask, at::IntArrayRef bounds, bool shrink_a = false) {
  const char* who = shrink_a ? "qerl::nvfp4_lora_linear" : "qerl::nvfp4_gemm_lora";
  const int64_t slices = int64_t(bounds.size()) - 1;
  QCHECK(slices >= 1 && slices <= 3, who, ": slice_bounds must be [0, end of slice 0, ..., n] for 1 to 3 slices, got ",
         bounds);
  QCHECK(bounds[0] == 0 && bounds[slices] == n, who, ": slice_bounds ", bounds, " must start at 0 and end at n=", n);
  for (int64_t i = 0; i < slices; ++i)
    QCHECK(bounds[i] < bounds[i + 1], who, ": slice_bounds ", bounds, " must increase");
  QCHECK(lora_b.dim() == 2 && lora_b.size(0) == n && lora_b.size(1) > 0 && lora_b.size(1) % slices == 0, who,
         ": lora_b must be [n, slices * rank] = [", n, ", ", slices, " * rank], got ", lora_b.sizes());
  const int64_t rank = lora_b.size(1) / slices;
  if (shrink_a) {
    QCHECK(shrunk.dim() == 2 && shrunk.size(0) == lora_b.size(1) && shrunk.size(1) == x.size(1), who,
           ": lora_a must be [slices * rank, K] = [", lora_b.size(1), ", ", x.size(1), "], got ", shrunk.sizes());
  } else {
    QCHECK(shrunk.dim() == 2 && shrunk.size(0) == x.size(0) && shrunk.size(1) == lora_b.size(1), who,
           ": shrunk must be [M, slices * rank] = [", x.size(0), ", ", lora_b.size(1), "], got ", shrunk.sizes());
  }
  QCHECK(mask.numel() == x.size(0) && mask.dim() <= 2 && (mask.dim() < 2 || mask.size(1) == 1), who,
         ": mask must be [M] or [M, 1] with M=", x.size(0), ", got ", mask.sizes());
  for (const auto* t : {&shrunk, &lora_b, &mask}) {
    const char* name = t == &shrunk ? (shrink_a ? "lora_a" : "shrunk") : (t == &lora_b ? "lora_b" : "mask");
    QCHECK(t->device() == x.device(), who, ": ", name, " is on ", t->device(), ", x on ", x.device());
    QCHECK(at::isFloatingType(t->scalar_type()), who, ": ", name, " must be floating point, got ", t->scalar_type());
  }
  return rank;
}

// The epilogue description when the operands fit the kernel (bf16, unit column stride, 16-byte aligned rows).
// `shrunk`: the shrink's output, or with `shrink_a` A_cat for the in-launch shrink (ep->lora_a).
bool lora_epilogue_for(const at::Tensor& shrunk, const at::Tensor& lora_b, const at::Tensor& mask, int64_t rank,
                       at::IntArrayRef bounds, QerlLoraEpilogue* ep, bool shrink_a = false) {
  auto rows_ok = [](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 && t.stride(1) == 1 && t.stride(0) % 8 == 0 &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  if (!rows_ok(shrunk) || !rows_ok(lora_b) || mask.scalar_type() != at::kBFloat16) return false;
  if (rank > std::numeric_limits<int>::max() / 4 || shrunk.stride(0) > std::numeric_limits<int>::max() ||
      lora_b.stride(0) > std::numeric_limits<int>::max())
    return false;
  *ep = QerlLoraEpilogue{};
  (shrink_a ? ep->lora_a : ep->shrunk) = shrunk.data_ptr();
  (shrink_a ? ep->ld_a : ep->ld_shrunk) = int(shrunk.stride(0));
  ep->lora_b = lora_b.data_ptr();
  ep->mask = mask.data_ptr();
  ep->ld_b = int(lora_b.stride(0));
  ep->mask_stride = int(mask.dim() == 0 ? 0 : mask.stride(0));
  ep->rank = int(rank);
  ep->n_slices = int(bounds.size()) - 1;
  for (int i = 0; i < ep->n_slices; ++i) ep->slice_end[i] = int(bounds[i + 1]);
  return true;
}

at::Tensor gemm_lora_cuda(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& gs,
                          const c10::optional<at::Tensor>& bias, int64_t n, const at::Tensor& shrunk,
                          const at::Tensor& lora_b, const at::Tensor& mask, at::IntArrayRef slice_bounds,
                          int64_t mode_value, int64_t splits, bool pdl) {
  const GemmMode mode = check_gemm_args(x, qw, qs, gs, n, mode_value, splits, "qerl::nvfp4_gemm_lora");
  const int64_t rank = check_lora_args(x, n, shrunk, lora_b, mask, slice_bounds);
  c10::cuda::CUDAGuard g(x.device());
  const Route r = route(x.size(0), n, x.size(1), x.scalar_type(), mode);
  bool done = false;
  at::Tensor out;
  if (r.kernel) {
    QerlLoraEpilogue ep;
    const bool fits = lora_epilogue_for(shrunk, lora_b, mask, rank, slice_bounds, &ep);
    out = gemm_kernel_cuda(x, qw, qs, gs, bias, n, splits, r.policy, r.wgmma, fits ? &ep : nullptr, &done,
                           r.decode_tma, pdl);
  } else {
    out = dequant_cublas_cuda(x, qw, qs, gs, bias, n);
  }
  if (done) return out;
  if (auto y = lora_expand_native(out, shrunk, lora_b.t(), mask)) return *y;
  return lora_expand_op(out, shrunk, lora_b.t(), mask);
}

// ---- qerl::nvfp4_lora_linear: a whole LoRA linear layer, x @ W^T + bias + mask * expand(x @ lora_a^T, lora_b)
//
// Where the split-K kernel runs (decode M), or the copy-engine decode kernel (M <= 16 where the route runs it), one
// launch: the shrink's units ride in the GEMM's grid and the expand is in its epilogue (cuda/nvfp4_gemm.cu,
// cuda/nvfp4_gemm_decode_tma.cu, cuda/lora_shrink_in_launch.cuh); the shrink's FP32 sum is rounded to bf16 before the
// expand, as the separate shrink kernel stores it. Elsewhere (other kernels, larger M, operands the kernels do not
// take): qerl::lora_shrink (registered from Python, verl_qerl/kernels/lora_shrink.py), then qerl::nvfp4_gemm_lora's
// path; QERL_LORA_FUSED_EXPAND=expand makes vLLM's fast path take that pair everywhere (verl_qerl/vllm/
// lora_fast_path.py).
bool in_launch_shrink_runs(const at::Tensor& x, int64_t n, const at::Tensor& lora_a, const at::Tensor& lora_b,
                           const at::Tensor& mask, int64_t rank, at::IntArrayRef slice_bounds, const Route& r,
                           QerlLoraEpilogue* ep) {
  if (!splitk_lora_runs(x.size(0), n, x.size(1), r)) return false;
  if (!lora_epilogue_for(lora_a, lora_b, mask, rank, slice_bounds, ep, true)) return false;
  const int block_m = pick_block_m(x.size(0));
  return qerl_nvfp4_gemm_lora_supported(int(n), block_m, ep) != 0 &&
         qerl_nvfp4_gemm_lora_counters(int(x.size(0)), int(n), block_m, ep) <= kCounterCap;
}

// The same for the decode kernel's linear launch.
bool decode_shrink_runs(const at::Tensor& x, int64_t n, const at::Tensor& lora_a, const at::Tensor& lora_b,
                        const at::Tensor& mask, int64_t rank, at::IntArrayRef slice_bounds, const Route& r,
                        QerlLoraEpilogue* ep) {
  const int64_t m = x.size(0), k = x.size(1);
  if (!decode_shrink_fits(m, n, k, r, int64_t(slice_bounds.size() - 1) * rank)) return false;
  if (!lora_epilogue_for(lora_a, lora_b, mask, rank, slice_bounds, ep, true)) return false;
  return qerl_nvfp4_gemm_decode_tma_shrink_supported(int(m), int(n), int(k), int(decode_tma_grid(m, n, 2)),
                                                     pick_block_m(m), ep) != 0;
}

at::Tensor lora_linear_cuda(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& gs,
                            const c10::optional<at::Tensor>& bias, int64_t n, const at::Tensor& lora_a,
                            const at::Tensor& lora_b, const at::Tensor& mask, at::IntArrayRef slice_bounds,
                            int64_t mode_value, int64_t splits, bool pdl) {
  const GemmMode mode = check_gemm_args(x, qw, qs, gs, n, mode_value, splits, "qerl::nvfp4_lora_linear");
  const int64_t rank = check_lora_args(x, n, lora_a, lora_b, mask, slice_bounds, true);
  c10::cuda::CUDAGuard g(x.device());
  const Route r = route(x.size(0), n, x.size(1), x.scalar_type(), mode);
  QerlLoraEpilogue ep;
  if (x.size(0) > 0 && in_launch_shrink_runs(x, n, lora_a, lora_b, mask, rank, slice_bounds, r, &ep)) {
    bool done = false;
    at::Tensor out = gemm_kernel_cuda(x, qw, qs, gs, bias, n, splits, r.policy, r.wgmma, &ep, &done, false, pdl);
    QCHECK(done, "qerl::nvfp4_lora_linear: the split-K kernel did not take the in-launch shrink it was routed to");
    return out;
  }
  if (x.size(0) > 0 && decode_shrink_runs(x, n, lora_a, lora_b, mask, rank, slice_bounds, r, &ep)) {
    bool done = false;
    at::Tensor out = gemm_kernel_cuda(x, qw, qs, gs, bias, n, splits, r.policy, r.wgmma, &ep, &done, true, pdl);
    QCHECK(done, "qerl::nvfp4_lora_linear: the decode kernel did not take the in-launch shrink it was routed to");
    return out;
  }
  return gemm_lora_cuda(x, qw, qs, gs, bias, n, lora_shrink_op(x, lora_a), lora_b, mask, slice_bounds, mode_value,
                        splits, pdl);
}

#ifdef QERL_ANATOMY_STAMPS
// The per-CTA phase stamps (cuda/anatomy_stamps.cuh) of the last launch of a register-A wgmma kernel: "wide" (256-token
// tiles) or "wgmma" (64 / 128); `reset` zeroes the table instead. Only in the QERL_ANATOMY_STAMPS build.
at::Tensor anatomy_stamps(const std::string& kernel, int64_t ctas, bool reset) {
  QCHECK(kernel == "wide" || kernel == "wgmma", "qerl anatomy_stamps: kernel must be 'wide' or 'wgmma', got ", kernel);
  auto t = torch::zeros({ctas, 14}, torch::kInt64);
  auto* p = reinterpret_cast<unsigned long long*>(t.data_ptr<int64_t>());
  const cudaError_t e = kernel == "wide" ? qerl_anatomy_read_wide(p, int(ctas), reset ? 1 : 0)
                                         : qerl_anatomy_read_wgmma(p, int(ctas), reset ? 1 : 0);
  QCHECK(e == cudaSuccess, "qerl anatomy_stamps(", kernel, ", ", ctas, "): ", cudaGetErrorString(e));
  return t;
}
#endif

}  // namespace
}  // namespace qerl_binding

using namespace qerl_binding;  // the registrations below name the ops and hooks unqualified


TORCH_LIBRARY_IMPL(qerl, CUDA, m) {
  m.impl("nvfp4_gemm", &gemm_cuda);
  m.impl("nvfp4_gemm_lora", &gemm_lora_cuda);
  m.impl("nvfp4_lora_linear", &lora_linear_cuda);
  m.impl("nvfp4_dequant", &dequant_cuda);
  m.impl("nvfp4_dequant_repacked", &dequant_repacked_cuda);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "verl-qerl NVFP4 CUDA kernels (the qerl::* ops register on import)";
#ifdef QERL_ANATOMY_STAMPS
  m.def("anatomy_stamps", &anatomy_stamps, "per-CTA phase stamps of the last wgmma launch (anatomy build only)",
        py::arg("kernel"), py::arg("ctas"), py::arg("reset") = false);
#endif
  m.def("init_workspace", &init_workspace, "allocate the split-K semaphores of a device (outside capture)");
  m.def("set_tuning", &set_tuning, "set (gemm_max_m, split penalty, stream-K min tiles per CTA); negative keeps a value",
        pybind11::arg("gemm_max_m"), pybind11::arg("split_penalty"), pybind11::arg("streamk_min_tiles") = -1.0);
  m.def("set_wgmma_wide_min_m", &set_wgmma_wide_min_m,
        "M from which the register-A wgmma kernel runs its wide (192- / 256-token) tiles (default 129); returns the "
        "previous value");
  m.def("set_wgmma_wide_fit", &set_wgmma_wide_fit,
        "whether the wide wgmma kernel fits its token tile (160 / 192 / 224 / 256) to M (default true; false: 256 "
        "only); returns the previous value");
  m.def("get_tuning", &get_tuning,
        "(gemm_max_m, split penalty, stream-K min tiles per CTA, stream-K min stages per CTA (fixed))");
  m.def("gemm_choice", &gemm_choice, "what qerl::nvfp4_gemm runs for (M, N, K, mode): one of gemm_kernel_names()");
  m.def("lora_epilogue_runs", &lora_epilogue_runs,
        "whether qerl::nvfp4_gemm_lora adds the LoRA term in a GEMM's epilogue for (M, N, K, mode)");
  m.def("lora_shrink_in_launch_runs", &lora_shrink_in_launch_runs,
        "whether qerl::nvfp4_lora_linear runs the LoRA shrink inside the GEMM's launch (split-K or decode_tma) for "
        "(M, N, K, mode, ranks = n_slices x rank)",
        pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("mode"), pybind11::arg("ranks") = 32);
  m.def("gemm_modes", &gemm_modes, "the op's modes as (name, value) pairs (cuda/gemm_modes.h)");
  m.def("streamk_grid", &streamk_grid,
        "CTAs the stream-K kernel requests for (M, N) on the current device (0: split-K runs instead)");
  m.def("gemm_kernel_names", &gemm_kernel_names,
        "the GEMM kernels by id (the calibration table's kernel ids; gemm_choice's names)");
  m.def("set_dispatch_table", &set_dispatch_table,
        "auto mode's calibration: [[n, k, m, kernel id], ...] measured points (empty list: the rule-based dispatch)");
  m.def("table_pick", &table_pick, "the calibration table's kernel id for (M, N, K), -1 without a table");
  m.def("streamk_tiles", &streamk_tiles,
        "stream-K output tiles (256 rows x block_m tokens) for (M, N); 0 where block_m is 8 / 16 (split-K runs)");
  m.def("splits_for", &splits_for, "split-K count the heuristic picks for (M, N, K) on the current device");
}
