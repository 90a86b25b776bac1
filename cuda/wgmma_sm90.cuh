// Hopper (sm_90a) warpgroup-MMA pieces shared by the two wgmma GEMM kernels (nvfp4_gemm_wgmma.cu: A from registers;
// nvfp4_gemm_wgmma_ss.cu: both operands in shared memory): the device-code switch, the wgmma group fence / commit /
// wait, the accumulator register fence, the async-proxy fence, and the fixed fields of the shared-memory matrix
// descriptor of the 128-byte-swizzled K-major layout both kernels store their wgmma operands in. The wgmma
// instructions themselves (one shape per kernel) stay with their kernel.
#pragma once

#include <stdint.h>

// The wgmma kernels' device code exists in the sm_90a pass only; in every other pass the kernels compile to a trap
// (their launchers report cudaErrorNotSupported there, so it never runs).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QERL_WGMMA_DEVICE 1
#endif

namespace qerl {

// Matrix descriptor, fixed fields: 128-byte swizzle (bits 62-63 = 1), SBO = 1024 B (the next 8 rows) at bits 32-45,
// LBO = 16 B (unused by K-major swizzled layouts) at bits 16-29. The start address (bits 0-13, address >> 4) is
// added per operand and k16 step.
constexpr uint64_t kWgmmaDescSwizzle128 = (uint64_t(1) << 62) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 16);

#ifdef QERL_WGMMA_DEVICE
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Orders the compiler's uses of an accumulator after a wgmma wait (the asm above does not name the registers).
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async seen landed) visible to the tensor
// core's async proxy, which the wgmmas read through.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif  // QERL_WGMMA_DEVICE

}  // namespace qerl
