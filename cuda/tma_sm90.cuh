// Hopper TMA pieces shared by the register-A wgmma kernels (cuda/nvfp4_gemm_wgmma.cu, cuda/nvfp4_gemm_wgmma_wide.cu):
// the activations of a pipeline slot arrive as `cp.async.bulk.tensor` loads of a tensor map, issued by one thread
// and completing on an mbarrier with a transaction count; and the host side that encodes the map and prepares a
// kernel that takes one.
//
// Why (benchmarks/NOTES.md, v6.3 - v6.5): with per-thread cp.async, the activations' address arithmetic,
// predicates and copy issue were the largest share of the issue slots of the wgmma kernels' stage loop (ncu source
// counters); one TMA load per slot moves all of it to the copy engine. The map's 128-byte swizzle stores token row
// r at r * 128 with 16-byte chunk q at (q ^ r % 8) * 16 -- wgmma's K-major SWIZZLE_128B layout -- and zero-fills
// rows past M.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "nvfp4_common.cuh"
#include "streamk_schedule.cuh"
#include "wgmma_sm90.cuh"

namespace qerl {
namespace tma {

constexpr int kBoxK = 64;  // K elements per box row: 128 bytes, the swizzle span

#ifdef QERL_WGMMA_DEVICE
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// `n` barriers of one arrival each at bar0, bar0 + 8, ... (thread 0), made visible to the copy engine, then a CTA
// barrier; and the tensor map's descriptor prefetched.
__device__ __forceinline__ void init_slots(uint32_t bar0, int n, const CUtensorMap* map) {
  if (threadIdx.x == 0) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
    for (int i = 0; i < n; ++i) mbar_init(bar0 + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}

// Arrives on `bar` expecting `bytes` of copy transactions (the phase completes when they have landed).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_LOOP:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_LOOP;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The box at (k0, row0) of `map` -> shared memory at dst (1024-byte aligned), completing on `bar`.
__device__ __forceinline__ void load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int k0, int row0) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(k0), "r"(row0)
      : "memory");
}

// The box of `map` at (c0, c1) <- shared memory at src (1024-byte aligned, the map's swizzled layout), by the copy
// engine, as one bulk async-group of this thread (parts of the box outside the tensor are not written). The shared
// memory writes it reads must be made visible to the copy engine first (fence_proxy_async, then a barrier).
__device__ __forceinline__ void store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until every bulk store group of this thread has read its shared memory (the source may be overwritten then)...
__device__ __forceinline__ void store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// ... or has completed (its global writes done).
__device__ __forceinline__ void store_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned) by the copy engine, completing
// on `bar` (a plain bulk copy: no tensor map, for data already laid out as the shared memory wants it).
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
               : "memory");
}
#endif  // QERL_WGMMA_DEVICE

// ---- host

// The driver's tensor-map encoder, fetched once through the runtime (no link against libcuda); null if absent.
inline PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// x [M, K] bf16 (row stride ld elements, K when 0; 16-byte aligned) as a map of {kBoxK x box_rows} boxes with the
// 128-byte swizzle (rows past M read as zeros). Also the decode kernel's LoRA A_cat [ranks, K] (row stride ld_a).
inline cudaError_t encode_activations(CUtensorMap* map, const void* x, int M, int K, int box_rows, int ld = 0) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (ld == 0) ld = K;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || (size_t(ld) * 2) % 16 != 0 || ld < K) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(M)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kBoxK), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(x), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// out [M, N] bf16 (row stride N; 16-byte aligned, N % 8 == 0) as a map of {64 x box_rows} boxes (64 output columns =
// 128 bytes, the swizzle span) with the 128-byte swizzle: the wide kernel's tile leaves through it (store_2d). Parts
// of a box past M or N are not written.
inline cudaError_t encode_output(CUtensorMap* map, void* out, int M, int N, int box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0 || N % 8 != 0) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {cuuint64_t(N), cuuint64_t(M)};
  const cuuint64_t strides[1] = {cuuint64_t(N) * 2};
  const cuuint32_t box[2] = {64u, cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out, dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The stream-K kernels that take the activations as a tensor map: same arguments as streamk::KernelFn otherwise.
using KernelFn = void (*)(const CUtensorMap, const uint4*, const uint4*, const float*, const __nv_bfloat16*,
                          __nv_bfloat16*, float*, int*, int, int, int, int);

// kKernel (sm_90a only) with kThreads threads, kSmemBytes of dynamic shared memory, block_m = kBlockM tokens per
// tile (also the box's rows) and kTileRows weight rows per tile: the Launcher of streamk_schedule.cuh for a kernel
// whose first argument is the activations' tensor map. kKernel takes KernelFn's arguments, then any `extra` ones
// launch() is given (the decode kernel's LoRA epilogue).
template <auto kKernel, int kBlockM_, int kThreads_, int kSmemBytes_, int kTileRows_>
struct Launcher {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kRows = kTileRows_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kSmemBytes = kSmemBytes_;
  static constexpr auto kernel() { return kKernel; }
  static constexpr int kMinUnitsPerCta = 1;  // plain stream-K (streamk::EntryPoints asks)

  // cudaErrorNotSupported where the kernel cannot run: not built for sm_90a, not an sm_90 device, too little shared
  // memory per CTA, or no tensor-map encoder in the driver.
  static cudaError_t prepare() {
    if (!streamk::kBuiltForSm90a) return cudaErrorNotSupported;
    static bool done[64] = {};  // per device; benign race: the attribute calls are idempotent
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev >= 0 && dev < 64 && done[dev]) return cudaSuccess;
    int major = 0, minor = 0, optin = 0;
    if ((e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess) return e;
    if ((e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev)) != cudaSuccess) return e;
    if (major != 9 || minor != 0) return cudaErrorNotSupported;  // sm_90a code runs on sm_90 only
    if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess) return e;
    if (optin < kSmemBytes || encoder() == nullptr) return cudaErrorNotSupported;
    e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e != cudaSuccess) return e;
    if (dev >= 0 && dev < 64) done[dev] = true;
    return cudaSuccess;
  }

  static size_t workspace_floats(int M, int N, int K, int grid) {
    return streamk::workspace_floats(M, N, K, grid, kBlockM, 1, kRows);
  }

  static int tiles(int M, int N) { return streamk::output_tiles(M, N, kBlockM, kRows); }

  static int ctas_per_sm() {
    if (prepare() != cudaSuccess) return 0;
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kThreads, kSmemBytes) != cudaSuccess) return 0;
    return n;
  }

  // Checks the arguments (streamk::check_launch_args), encodes x's map and launches over the CTAs with a
  // non-empty range; `pdl`: as a programmatic dependent launch (launch_kernel, nvfp4_common.cuh).
  static cudaError_t launch(const void* x, const void* qweight, const void* qscale, const float* gscale,
                            const void* bias, void* out, float* ws, int* counters, int M, int N, int K, int grid,
                            cudaStream_t stream) {
    return launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream, false);
  }
  template <class... Extra>
  static cudaError_t launch(const void* x, const void* qweight, const void* qscale, const float* gscale,
                            const void* bias, void* out, float* ws, int* counters, int M, int N, int K, int grid,
                            cudaStream_t stream, bool pdl, const Extra&... extra) {
    cudaError_t e = streamk::check_launch_args(M, N, K, grid, counters, ws, workspace_floats(M, N, K, grid));
    if (e != cudaSuccess) return e;
    if ((e = prepare()) != cudaSuccess) return e;
    const streamk::Schedule s = streamk::make_schedule(M, N, K, grid, kBlockM, 1, kRows);
    if (s.ctas <= 0) return cudaErrorInvalidValue;
    CUtensorMap x_map;
    if ((e = encode_activations(&x_map, x, M, K, kBlockM)) != cudaSuccess) return e;
    e = launch_kernel(kKernel, dim3(s.ctas), dim3(kThreads), kSmemBytes, stream, pdl, x_map,
                      static_cast<const uint4*>(qweight), static_cast<const uint4*>(qscale), gscale,
                      static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(out), ws, counters, M, N,
                      K, s.units_per_cta, extra...);
    return e != cudaSuccess ? e : cudaGetLastError();
  }
};

}  // namespace tma
}  // namespace qerl
