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
// The split is used where the tiles are few (at most half the CTAs) and each CTA's K range stays short (the partials
// of such tiles cost as much as their main loop under stream-K: benchmarks/NOTES.md, "Where the narrow GEMM's time
// goes at M = 256"); longer ranges keep stream-K, whose balance over all SMs then wins.
constexpr int kMaxStagesPerCta = 24;

#ifdef QERL_WGMMA_DEVICE
// The end of a tile split over the cluster (kCtas <= kMaxCtas): every CTA of the cluster holds the partial sums of its
// K range of the same tile in registers, acc[h][i] of thread t being weight row (t / 128) 64 kBlocks + 64 h +
// 16 ((t / 32) % 4) + (t % 32) / 4 + 8 ((i / 2) % 2) of the tile and token 8 (i / 4) + 2 (t % 4) + i % 2 (finish_tile's
// layout). Each CTA writes them to its own shared memory `smem` (the ring, free by now; kBlocks x kAcc x kThreads
// floats) as red[h kAcc + i][t]; one cluster barrier; then CTA rank r takes the r-th of s equal shares of the tile's
// elements, sums each over the s CTAs in rank order through distributed shared memory (the same order whichever CTA
// sums: deterministic), and stores it as bf16 with the scale and bias; a second barrier keeps every CTA's shared
// memory alive until the others have read it. The registers are free after the first write, so the sums need none
// of the accumulators'.
template <int kBlocks, int kAcc, int kThreads>
__device__ __forceinline__ void reduce_store(const float (&acc)[kBlocks][kAcc], uint8_t* smem, uint32_t smem_base,
                                             int row0, int m0, int M, int N, const float* gscale,
                                             const __nv_bfloat16* bias, __nv_bfloat16* out) {
  constexpr int ELEMS = kBlocks * kAcc * kThreads;
  const int tid = threadIdx.x;
  const int s = cluster_nctarank();
  const int rank = cluster_ctarank();
  float* red = reinterpret_cast<float*>(smem);  // [kBlocks kAcc][kThreads]: conflict-free per index
#pragma unroll
  for (int h = 0; h < kBlocks; ++h)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) red[(h * kAcc + i) * kThreads + tid] = acc[h][i];
  QERL_AN_SUB(0)
  cluster_sync();
  QERL_AN_SUB(1)
  uint32_t src[kMaxCtas];  // red of CTA r, as a shared::cluster address
#pragma unroll
  for (int r = 0; r < kMaxCtas; ++r) src[r] = mapa_cluster(smem_base, r < s ? r : 0);
  const float alpha = __fdiv_rn(128.0f, __ldg(gscale));
  const int hi = (rank + 1) * ELEMS / s;
  // kBatch elements per thread at a time, all their loads issued before the first sum: the distributed shared
  // memory's latency (hundreds of cycles) is paid once per batch, not once per element
  constexpr int kBatch = 8;
  for (int j0 = rank * ELEMS / s + tid; j0 < hi; j0 += kBatch * kThreads) {
    float v[kBatch][kMaxCtas];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int j = min(j0 + b * kThreads, hi - 1);  // past the share: a valid address, never stored
#pragma unroll
      for (int r = 0; r < kMaxCtas; ++r) v[b][r] = r < s ? ld_shared_cluster_f32(src[r] + uint32_t(j) * 4u) : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int j = j0 + b * kThreads;
      float sum = 0.0f;
#pragma unroll
      for (int r = 0; r < kMaxCtas; ++r)
        if (r < s) sum += v[b][r];
      const int i = j / kThreads, t = j % kThreads, lane = t & 31;
      const int h = kBlocks == 1 ? 0 : i / kAcc;  // (j < ELEMS: i < kBlocks kAcc)
      const int ii = kBlocks == 1 ? i : i % kAcc;
      const int n = row0 + (t >> 7) * 64 * kBlocks + 64 * h + 16 * ((t >> 5) & 3) + (lane >> 2) + 8 * ((ii >> 1) & 1);
      const int m = m0 + 8 * (ii >> 2) + 2 * (lane & 3) + (ii & 1);
      if (j < hi && n < N && m < M) {
        const float bv = bias != nullptr ? __bfloat162float(bias[n]) : 0.0f;
        out[size_t(m) * N + n] = __float2bfloat16_rn(sum * alpha + bv);
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
template <class Launcher>
int split(int tiles, int K, int grid, int* stages_per_cta, bool smaller_clusters = true) {
  const char* env = std::getenv("QERL_WGMMA_CLUSTER");
  if (env != nullptr && env[0] == '0') return 0;
  const int S = K / streamk::kStageK;
  if (tiles <= 0 || S < 2) return 0;
  const int s_max = std::min(kMaxCtas, std::min(grid / tiles, S));
  if (s_max < 2 || Launcher::prepare() != cudaSuccess) return 0;
  static int max_clusters[64][kMaxCtas + 1] = {};  // per device and s (benign race: the query is idempotent)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  for (int s0 = s_max; s0 >= 2; --s0) {
    const int per = (S + s0 - 1) / s0;
    if (per > kMaxStagesPerCta) return 0;  // a smaller s only lengthens the ranges
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
