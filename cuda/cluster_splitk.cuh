// The cluster split-K of the register-A wgmma kernels (cuda/nvfp4_gemm_wgmma_wide.cu; cuda/nvfp4_gemm_wgmma.cu's 64-
// and 128-token tiles): where the output tiles are few, one tile per thread-block cluster of s CTAs, CTA rank r
// running the tile's K stages [r per, (r + 1) per), and the s partial sums reduced on chip through distributed shared
// memory instead of stream-K's FP32 partials through L2 and its fix-up (benchmarks/NOTES.md, "v6.9"). One
// definition of the device reduction (finish_tile's accumulator layout, cuda/wgmma_rs_epilogue.cuh) and of the host
// rule that picks s.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdlib>

#include "anatomy_stamps.cuh"
#include "streamk_schedule.cuh"
#include "wgmma_sm90.cuh"

namespace qerl {
namespace cluster_splitk {

constexpr int kMaxCtas = 8;  // the portable cluster size limit (the largest split)
// The split is used where the tiles are few (at most half the CTAs) and each CTA's K range stays short enough (the
// partials of such tiles cost as much as their main loop under stream-K: benchmarks/NOTES.md, "Where the narrow
// GEMM's time goes at M = 256"); longer ranges keep stream-K, whose balance over all SMs then wins. 64: with the
// token-major sums the split's end costs ~5 us, and up to ~54 stages per rank it beats stream-K (7B down at M = 256,
// 37 stages per rank: 62 -> 55 us), at 72-108 it lost 2-4 % (NOTES "Nineteenth round"; 24 before).
constexpr int kMaxStagesPerCta = 64;

// The shared-memory layout of a tile's FP32 sums in reduce_store: token-major, red[token][row] with a row pitch of
// kRows + 4 floats. Token-major so that a token's weight rows -- contiguous in `out` -- are contiguous here too: the
// sums are read as 16-byte vectors and leave as 8-byte bf16 stores; the 16 bytes of padding put the 8 rows x 4 token
// pairs of one accumulator register's warp-wide write on 32 different banks.
template <int kBlocks, int kAcc, int kThreads>
struct ReduceLayout {
  static constexpr int kRows = (kThreads / 128) * 64 * kBlocks;  // weight rows of the tile
  static constexpr int kTokens = 2 * kAcc;                       // tokens of the tile
  static constexpr int kPitch = kRows + 4;                       // floats per token row
  static constexpr int kBytes = kTokens * kPitch * 4;            // the kernel's ring must hold this much
  static constexpr int kQuads = kRows / 4;                       // 16-byte row groups per token
};

#ifdef QERL_WGMMA_DEVICE
__device__ __forceinline__ float4 ld_shared_cluster_f32x4(uint32_t cluster_addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr)
               : "memory");
  return v;
}

// The end of a tile split over the cluster (kCtas <= kMaxCtas): every CTA of the cluster holds the partial sums of its
// K range of the same tile in registers, acc[h][i] of thread t being weight row (t / 128) 64 kBlocks + 64 h +
// 16 ((t / 32) % 4) + (t % 32) / 4 + 8 ((i / 2) % 2) of the tile and token 8 (i / 4) + 2 (t % 4) + i % 2 (finish_tile's
// layout). Each CTA writes them to its own shared memory `smem` (the ring, free by now) in ReduceLayout; one cluster
// barrier; then CTA rank r takes the r-th of s shares of the tile's tokens below M, sums each 4-row group over the s
// CTAs in rank order through distributed shared memory (16-byte loads; the same order whichever CTA sums:
// deterministic, and the same FP32 operations as a sum per element), and stores it as bf16 with the scale and bias;
// a second barrier keeps every CTA's shared memory alive until the others have read it. The registers are free after
// the first write, so the sums need none of the accumulators'. (The first version read single floats in the
// accumulator order and stored single bf16s: 7-9 us of a 20-27 us GEMM at M = 128-256, benchmarks/NOTES.md
// "Nineteenth round".)
template <int kBlocks, int kAcc, int kThreads>
__device__ __forceinline__ void reduce_store(const float (&acc)[kBlocks][kAcc], uint8_t* smem, uint32_t smem_base,
                                             int row0, int m0, int M, int N, const float* gscale,
                                             const __nv_bfloat16* bias, __nv_bfloat16* out) {
  using L = ReduceLayout<kBlocks, kAcc, kThreads>;
  // threadIdx.x read here (volatile): index math derived from it is not hoisted above the main loop, where ptxas
  // would keep it live beside the accumulators (with this layout's indices it serialized the kernels' wgmmas, C7515)
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  const int lane = tid & 31;
  const int s = cluster_nctarank();
  const int rank = cluster_ctarank();
  float* red = reinterpret_cast<float*>(smem);
  {
    const int row = (tid >> 7) * 64 * kBlocks + 16 * ((tid >> 5) & 3) + (lane >> 2);
    const int tok = 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < kBlocks; ++h)
#pragma unroll
      for (int i = 0; i < kAcc; ++i)
        red[(8 * (i >> 2) + tok + (i & 1)) * L::kPitch + row + 64 * h + 8 * ((i >> 1) & 1)] = acc[h][i];
  }
  QERL_AN_SUB(0)
  cluster_sync();
  QERL_AN_SUB(1)
  uint32_t src[kMaxCtas];  // red of CTA r, as a shared::cluster address
#pragma unroll
  for (int r = 0; r < kMaxCtas; ++r) src[r] = mapa_cluster(smem_base, r < s ? r : 0);
  const float alpha = __fdiv_rn(128.0f, __ldg(gscale));
  const int tokens = min(L::kTokens, M - m0);  // token rows past M are never stored
  const int t_lo = rank * tokens / s;
  const int quads = ((rank + 1) * tokens / s - t_lo) * L::kQuads;  // this CTA's share, in 4-row groups
  const bool vec_store = (N & 3) == 0 && (reinterpret_cast<uintptr_t>(out) & 7) == 0;  // CTA-uniform
  // kBatch groups per thread at a time, all their loads issued before the first sum: the distributed shared memory's
  // latency (hundreds of cycles) is paid once per batch, not once per group
  constexpr int kBatch = 4;
  for (int c0 = tid; c0 < quads; c0 += kBatch * kThreads) {
    float4 v[kBatch][kMaxCtas];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int c = min(c0 + b * kThreads, quads - 1);  // past the share: a valid address, never stored
      const uint32_t off = uint32_t(((t_lo + c / L::kQuads) * L::kPitch + 4 * (c % L::kQuads)) * 4);
#pragma unroll
      for (int r = 0; r < kMaxCtas; ++r)
        v[b][r] = r < s ? ld_shared_cluster_f32x4(src[r] + off) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int c = c0 + b * kThreads;
      const int n = row0 + 4 * (c % L::kQuads);
      const int m = m0 + t_lo + c / L::kQuads;
      if (c >= quads || n >= N) continue;
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < kMaxCtas; ++r)
        if (r < s) {
          sum[0] += v[b][r].x;
          sum[1] += v[b][r].y;
          sum[2] += v[b][r].z;
          sum[3] += v[b][r].w;
        }
      alignas(8) __nv_bfloat16 o[4];  // (read as one 8-byte value below)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float bv = bias != nullptr && n + e < N ? __bfloat162float(bias[n + e]) : 0.0f;
        o[e] = __float2bfloat16_rn(sum[e] * alpha + bv);
      }
      __nv_bfloat16* dst = out + size_t(m) * N + n;
      if (vec_store) {
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(o);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (n + e < N) dst[e] = o[e];
      }
    }
  }
  QERL_AN_SUB(2)
  cluster_sync();
}
#endif  // QERL_WGMMA_DEVICE

// (host) The launch configuration of a cluster kernel: `tiles` clusters of s CTAs (*attr: the cluster dimension,
// owned by the caller like *cfg).
inline void config(cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attr, int s, int tiles, int threads, int smem_bytes,
                   cudaStream_t stream) {
  *attr = {};
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = unsigned(s);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  *cfg = {};
  cfg->gridDim = dim3(unsigned(s * tiles));
  cfg->blockDim = dim3(unsigned(threads));
  cfg->dynamicSmemBytes = size_t(smem_bytes);
  cfg->stream = stream;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
}

// (host) The cluster size s for a launch of the cluster kernel `Launcher::kernel()` over `tiles` output tiles of K / 128
// stages with `grid` CTAs requested (0: stream-K instead); *stages_per_cta the K stages of each rank. The largest s <=
// min(8, grid / tiles, stages) (then as few ranks as that range length needs) whose clusters are all resident at once
// (cudaOccupancyMaxActiveClusters, asked once per device and s: clusters live inside one GPC, so 40 tiles x 3 CTAs
// may not fit where 120 CTAs would); 0 where a rank would run more than kMaxStagesPerCta stages, where the kernel
// cannot run (Launcher::prepare), or where no s >= 2 fits. With `smaller_clusters` false only that largest s is
// tried: the wide kernel's rule, because its clusters of 2 lost to stream-K where 3 did not fit (32B o at M = 256 on
// an H200: 39.2 vs 35.6 us, NOTES "Outcome of the cluster candidate"), while the 64- / 128-token kernels gain from
// them. QERL_WGMMA_CLUSTER=0 turns it off (timing stream-K on the same shapes).
// QERL_WGMMA_CLUSTER_MAX_STAGES=n moves kMaxStagesPerCta (a benchmark hook: where should the split take over).
inline int max_stages_per_cta() {
  const char* env = std::getenv("QERL_WGMMA_CLUSTER_MAX_STAGES");
  const int v = env != nullptr ? std::atoi(env) : 0;
  return v > 0 ? v : kMaxStagesPerCta;
}

template <class Launcher>
int split(int tiles, int K, int grid, int* stages_per_cta, bool smaller_clusters = true) {
  const char* env = std::getenv("QERL_WGMMA_CLUSTER");
  if (env != nullptr && env[0] == '0') return 0;
  const int max_per = max_stages_per_cta();
  const int S = K / streamk::kStageK;
  if (tiles <= 0 || S < 2) return 0;
  const int s_max = std::min(kMaxCtas, std::min(grid / tiles, S));
  if (s_max < 2 || Launcher::prepare() != cudaSuccess) return 0;
  static int max_clusters[64][kMaxCtas + 1] = {};  // per device and s (benign race: the query is idempotent)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  for (int s0 = s_max; s0 >= 2; --s0) {
    const int per = (S + s0 - 1) / s0;
    if (per > max_per) return 0;  // a smaller s only lengthens the ranges
    const int s = (S + per - 1) / per;     // no rank without a stage
    if (s < 2) return 0;
    int* cached = dev >= 0 && dev < 64 ? &max_clusters[dev][s] : nullptr;
    int n = cached != nullptr ? *cached : 0;
    if (n == 0) {
      cudaLaunchConfig_t cfg;
      cudaLaunchAttribute attr;
      config(&cfg, &attr, s, tiles, Launcher::kThreads, Launcher::kSmemBytes, nullptr);
      if (cudaOccupancyMaxActiveClusters(&n, Launcher::kernel(), &cfg) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        return 0;
      }
      if (cached != nullptr) *cached = n;
    }
    if (tiles <= n) {
      *stages_per_cta = per;
      return s;
    }
    if (!smaller_clusters) return 0;
  }
  return 0;
}

}  // namespace cluster_splitk
}  // namespace qerl
