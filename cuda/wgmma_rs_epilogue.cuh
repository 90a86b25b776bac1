// The end of one stream-K segment in the register-A wgmma kernels (cuda/nvfp4_gemm_wgmma.cu: 64 / 128-token tiles
// of 256 weight rows; cuda/nvfp4_gemm_wgmma_wide.cu: 256-token tiles of 128 rows): the partials and the fix-up of a
// tile shared by several CTAs, then the bf16 store. Both kernels hold their accumulators the same way -- per thread
// `kBlocks` m64 blocks of wgmma's FP32 layout, block h of warpgroup wg covering weight rows wg * 64 * kBlocks + 64 h
// .. + 63 of the tile -- so the slot layout and the store are one piece of code.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "streamk_schedule.cuh"

namespace qerl {
namespace wgmma_rs {

// acc[h][4 q + c] of thread (warp wl of warpgroup wg, lane) is weight row wg * 64 * kBlocks + 64 h + 16 wl + lane / 4
// + 8 (c / 2) of the tile and token m0 + 8 q + 2 (lane % 4) + c % 2. kThreads threads hold the tile (all of the
// CTA's, barrier __syncthreads). `active`: whether this warpgroup holds rows of the tile (the 64 / 128-token kernel's
// second 128-row half may not exist). Returns after the store (or after publishing a partial when another CTA of the
// tile stores it).
template <int kBlocks, int kAcc, int kThreads, int kSlotFloats>
__device__ __forceinline__ void finish_tile(float (&acc)[kBlocks][kAcc], const streamk::CtaRange& range, float* ws,
                                            int* counters, int& s_is_last, int tile, int my_first_tile, int row0,
                                            int m0, int M, int N, bool active, const float* gscale,
                                            const __nv_bfloat16* bias, __nv_bfloat16* out) {
  constexpr int NQ = kAcc / 4;  // float4 partials per m64 block per thread
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int wg = tid >> 7;
  const int wl = (tid >> 5) & 3;
  const int tok_lane = 2 * (lane & 3);
  // streamk::finish_segment written out: through the helper ptxas allocates these 255-register kernels differently
  // (16-24 more instructions, sass_census.py --against), and this is the code that was measured
  const int c_first = range.first_cta(tile);
  const int c_last = range.last_cta(tile);
  bool do_store = true;
  if (c_first != c_last) {
    do_store = streamk::fix_up_split_tile(
        counters, tile, c_first, c_last, tid == 0, s_is_last, [] { __syncthreads(); },
        [&] {
          float4* mine = streamk::partial_slot<kSlotFloats>(ws, blockIdx.x, range.my_slot(tile, my_first_tile));
          if (active) {
#pragma unroll
            for (int h = 0; h < kBlocks; ++h)
#pragma unroll
              for (int q = 0; q < NQ; ++q)
                if (m0 + 8 * q + tok_lane < M)
                  mine[(h * NQ + q) * kThreads + tid] =
                      make_float4(acc[h][4 * q], acc[h][4 * q + 1], acc[h][4 * q + 2], acc[h][4 * q + 3]);
          }
        },
        [&] {
          if (active) {
#pragma unroll
            for (int h = 0; h < kBlocks; ++h) {
#pragma unroll
              for (int q = 0; q < NQ; ++q)
                acc[h][4 * q] = acc[h][4 * q + 1] = acc[h][4 * q + 2] = acc[h][4 * q + 3] = 0.f;
              streamk::for_each_partial<kSlotFloats>(range, ws, tile, c_first, c_last, [&](const float4* slot) {
                const float4* part = slot + h * NQ * kThreads + tid;
#pragma unroll
                for (int q = 0; q < NQ; ++q) {
                  const float4 v =
                      (m0 + 8 * q + tok_lane < M) ? __ldcg(part + q * kThreads) : make_float4(0.f, 0.f, 0.f, 0.f);
                  acc[h][4 * q] += v.x;
                  acc[h][4 * q + 1] += v.y;
                  acc[h][4 * q + 2] += v.z;
                  acc[h][4 * q + 3] += v.w;
                }
              });
            }
          }
        });
  }
  if (!do_store || !active) return;
  // acc * (128 / global_scale) + bias -> bf16, rows < M and < N only
  const float alpha = __fdiv_rn(128.0f, __ldg(gscale));
#pragma unroll
  for (int h = 0; h < kBlocks; ++h) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int n = row0 + wg * 64 * kBlocks + h * 64 + wl * 16 + (lane >> 2) + 8 * rh;
      if (n >= N) continue;
      const float bv = bias != nullptr ? __bfloat162float(bias[n]) : 0.0f;
#pragma unroll
      for (int q = 0; q < NQ; ++q)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = m0 + 8 * q + tok_lane + e;
          if (m < M) out[size_t(m) * N + n] = __float2bfloat16_rn(acc[h][4 * q + 2 * rh + e] * alpha + bv);
        }
    }
  }
}

}  // namespace wgmma_rs
}  // namespace qerl
