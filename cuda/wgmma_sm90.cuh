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

// The operand lists of one m64nN wgmma's N / 2 FP32 accumulators (N = 64 .. 256 in steps of 32): the PTX register
// lists "{%0, .., %<N/2 - 1>}" (built from groups of 16) and the matching "+f" constraints of d[0 .. N/2 - 1]
// (operands 0 .. N/2 - 1 of the asm statement).
#define QERL_WGMMA_REGS_G0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define QERL_WGMMA_REGS_G1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define QERL_WGMMA_REGS_G2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define QERL_WGMMA_REGS_G3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QERL_WGMMA_REGS_G4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define QERL_WGMMA_REGS_G5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define QERL_WGMMA_REGS_G6 \
  "%96, %97, %98, %99, %100, %101, %102, %103, "\
  "%104, %105, %106, %107, %108, %109, %110, %111"
#define QERL_WGMMA_REGS_G7 \
  "%112, %113, %114, %115, %116, %117, %118, %119, "\
  "%120, %121, %122, %123, %124, %125, %126, %127"
#define QERL_WGMMA_R32 QERL_WGMMA_REGS_G0 "," QERL_WGMMA_REGS_G1
#define QERL_WGMMA_R64 QERL_WGMMA_R32 "," QERL_WGMMA_REGS_G2 "," QERL_WGMMA_REGS_G3
#define QERL_WGMMA_R80 QERL_WGMMA_R64 "," QERL_WGMMA_REGS_G4
#define QERL_WGMMA_R96 QERL_WGMMA_R80 "," QERL_WGMMA_REGS_G5
#define QERL_WGMMA_R112 QERL_WGMMA_R96 "," QERL_WGMMA_REGS_G6
#define QERL_WGMMA_R128 QERL_WGMMA_R112 "," QERL_WGMMA_REGS_G7
#define QERL_WGMMA_D32_PTX "{" QERL_WGMMA_R32 "}"
#define QERL_WGMMA_D64_PTX "{" QERL_WGMMA_R64 "}"
#define QERL_WGMMA_D80_PTX "{" QERL_WGMMA_R80 "}"
#define QERL_WGMMA_D96_PTX "{" QERL_WGMMA_R96 "}"
#define QERL_WGMMA_D112_PTX "{" QERL_WGMMA_R112 "}"
#define QERL_WGMMA_D128_PTX "{" QERL_WGMMA_R128 "}"
#define QERL_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define QERL_F16(d, i) QERL_F4(d, i), QERL_F4(d, i + 4), QERL_F4(d, i + 8), QERL_F4(d, i + 12)
#define QERL_F64(d, i) QERL_F16(d, i), QERL_F16(d, i + 16), QERL_F16(d, i + 32), QERL_F16(d, i + 48)
#define QERL_WGMMA_D32_OPS(d) QERL_F16(d, 0), QERL_F16(d, 16)
#define QERL_WGMMA_D64_OPS(d) QERL_F64(d, 0)
#define QERL_WGMMA_D80_OPS(d) QERL_F64(d, 0), QERL_F16(d, 64)
#define QERL_WGMMA_D96_OPS(d) QERL_F64(d, 0), QERL_F16(d, 64), QERL_F16(d, 80)
#define QERL_WGMMA_D112_OPS(d) QERL_F64(d, 0), QERL_F16(d, 64), QERL_F16(d, 80), QERL_F16(d, 96)
#define QERL_WGMMA_D128_OPS(d) QERL_F64(d, 0), QERL_F64(d, 64)

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

// D[64 x N] += A[64 x 16] (registers, bf16) x B[16 x N] (shared memory, bf16, K-major), FP32 accumulators:
// wgmma_m64n<N>k16_rs for the token widths N the register-A kernels use (64 / 128: cuda/nvfp4_gemm_wgmma.cu;
// 128 / 160 / 192 / 224 / 256: cuda/nvfp4_gemm_wgmma_wide.cu). Operands after the N / 2 accumulators: A's four
// registers, the B descriptor, the scale-d predicate (1: accumulate).
#define QERL_WGMMA_RS(N, ACC, D_PTX, D_OPS, A0, A1, A2, A3, DESC, PRED)                                            \
  __device__ __forceinline__ void wgmma_m64n##N##k16_rs(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PRED ", 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 " D_PTX ", {%" #A0 ", %" #A1 ", %" #A2  \
                 ", %" #A3 "}, %" #DESC ", p, 1, 1, 0;\n}\n"                                                        \
                 : D_OPS(d)                                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));                               \
  }
QERL_WGMMA_RS(64, 32, QERL_WGMMA_D32_PTX, QERL_WGMMA_D32_OPS, 32, 33, 34, 35, 36, 37)
QERL_WGMMA_RS(128, 64, QERL_WGMMA_D64_PTX, QERL_WGMMA_D64_OPS, 64, 65, 66, 67, 68, 69)
QERL_WGMMA_RS(160, 80, QERL_WGMMA_D80_PTX, QERL_WGMMA_D80_OPS, 80, 81, 82, 83, 84, 85)
QERL_WGMMA_RS(192, 96, QERL_WGMMA_D96_PTX, QERL_WGMMA_D96_OPS, 96, 97, 98, 99, 100, 101)
QERL_WGMMA_RS(224, 112, QERL_WGMMA_D112_PTX, QERL_WGMMA_D112_OPS, 112, 113, 114, 115, 116, 117)
QERL_WGMMA_RS(256, 128, QERL_WGMMA_D128_PTX, QERL_WGMMA_D128_OPS, 128, 129, 130, 131, 132, 133)
#undef QERL_WGMMA_RS

// The m64nNk16 register-A wgmma of a kernel's N-token tile.
template <int N>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  static_assert(N == 64 || N == 128 || N == 160 || N == 192 || N == 224 || N == 256,
                "register-A wgmma: N = 64, 128, 160, 192, 224 or 256 tokens");
  if constexpr (N == 64)
    wgmma_m64n64k16_rs(d, a, desc);
  else if constexpr (N == 128)
    wgmma_m64n128k16_rs(d, a, desc);
  else if constexpr (N == 160)
    wgmma_m64n160k16_rs(d, a, desc);
  else if constexpr (N == 192)
    wgmma_m64n192k16_rs(d, a, desc);
  else if constexpr (N == 224)
    wgmma_m64n224k16_rs(d, a, desc);
  else
    wgmma_m64n256k16_rs(d, a, desc);
}

// Thread-block clusters (the cluster split-K of cuda/nvfp4_gemm_wgmma_wide.cu): this CTA's rank in its cluster, the
// cluster's size and index, the cluster-wide barrier (release / acquire: shared-memory writes before it are visible
// to every CTA of the cluster after it), and float loads from any CTA's shared memory (distributed shared memory).
__device__ __forceinline__ int cluster_ctarank() {
  int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ int cluster_nctarank() {
  int r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ int cluster_id_x() {
  int r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The shared::cluster address of CTA `rank`'s copy of this CTA's shared address `addr` (addresses of one CTA's
// window are contiguous: mapa(a + d) == mapa(a) + d).
__device__ __forceinline__ uint32_t mapa_cluster(uint32_t addr, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}
__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t cluster_addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(cluster_addr) : "memory");
  return v;
}
#endif  // QERL_WGMMA_DEVICE

}  // namespace qerl
