// The LoRA shrink inside a GEMM's own launch (qerl::nvfp4_lora_linear at decode M): the pieces the split-K kernel
// (cuda/nvfp4_gemm.cu, LORA = kLoraShrinkInLaunch) and the copy-engine decode kernel (cuda/nvfp4_gemm_decode_tma.cu,
// nvfp4_gemm_decode_tma_linear_kernel) share.
//
// Why: a shrink kernel of its own costs 2.5-5 us per decode GEMM in a CUDA graph for < 1 us of work (benchmarks/
// NOTES.md, "Sixth round", "Seventh round"); a launch that already streams the activations can carry it.
//
// What both kernels do: the shrink x @ A_cat^T ([M, ranks], ranks = n_slices x rank) is cut into units of one
// "column" of QERL_LORA_SHRINK_RANKS_PER_CTA = 32 ranks over a K range. A unit is computed with mma.sync (32 A_cat
// rows as the MMA's A operand, the activations as B, FP32 accumulators) by 8 warps: warp w holds ranks 16 (w % 2) ..
// of the column and the k32 quarter w / 2 of each 128-K stage, and the four quarters are summed in quarter order
// (store_shrink_partial) into one FP32 partial [BM, 32] per unit in the workspace. Partials are summed in a fixed
// order after acq_rel arrival counters say they are all there, rounded once to bf16 (what the separate shrink kernel
// stores) into the workspace, and a ready flag is released; each output tile's storing CTA waits for the flag
// (wait_flag_acquire) before its LoRA epilogue stages the sum, and the last tile to have staged it zeroes the counters
// for the next launch (shrink_sum_read; CUDA graphs replay the launch). The kernels differ in who computes the units
// (split-K: extra CTA columns; decode: one unit in each of the lowest-indexed persistent CTAs) and in who sums.
//
// Against the separate shrink (Triton's `_lora_shrink_kernel`): the same products and one bf16 rounding of an FP32
// sum, in another summation order (the MMA's k16 steps, the quarters, the partials here; K blocks and Triton's
// in-block tree there), so a shrunk value can round to the neighbouring bf16.
#pragma once

#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"

namespace qerl {

// The GEMM kernels' LoRA template argument: no LoRA, the expand of a given `shrunk`, or the shrink in the launch too.
enum LoraMode { kNoLora = 0, kLoraShrunk = 1, kLoraShrinkInLaunch = 2 };

// The in-launch shrink's workspace, after the GEMM's own partials: per m-tile, `splits x cols` FP32 partials of
// BM x 32 (unit (split, col) at (split * cols + col) * BM * 32, row t at t * 32), then the bf16 sum [BM, ranks].
// cols: ceil(ranks / 32); ranks: n_slices * rank. (split: the split-K kernel's K-split; the decode kernel's stage.)
struct ShrinkPlan {
  __host__ __device__ static int cols_for(const QerlLoraEpilogue& p) {
    return (p.n_slices * p.rank + QERL_LORA_SHRINK_RANKS_PER_CTA - 1) / QERL_LORA_SHRINK_RANKS_PER_CTA;
  }
  __host__ __device__ static size_t partial_floats(int bm, int cols, int splits) {
    return size_t(splits) * cols * bm * QERL_LORA_SHRINK_RANKS_PER_CTA;
  }
  __host__ __device__ static size_t sum_floats(int bm, int ranks) { return (size_t(bm) * ranks / 2 + 3) / 4 * 4; }
  __host__ __device__ static size_t floats(int bm, int cols, int ranks, int splits, int m_tiles) {
    return size_t(m_tiles) * (partial_floats(bm, cols, splits) + sum_floats(bm, ranks));
  }
};

// ld.acquire.gpu of a flag another CTA of this launch sets with a release: spin until it is non-zero.
__device__ __forceinline__ void wait_flag_acquire(const int* flag) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  } while (v == 0);
}

// A unit's accumulators (warp w of 8: mma.sync C fragments of ranks 16 (w % 2) .. x BM tokens, k32 quarter w / 2)
// -> its FP32 partial [BM, 32] (row t at t * 32), unit `unit` of the partials at `parts` (ShrinkPlan's layout): the
// four quarters summed in quarter order through `red` (BM / 8 * 4 KB of free shared memory). `sync`: the barrier
// over the THREADS threads taking part.
template <int BM, int THREADS, class Sync>
__device__ __forceinline__ void store_shrink_partial(const float (&acc)[BM / 8][4], float* red, float* parts,
                                                     size_t unit, int tid, Sync&& sync) {
  constexpr int MT = BM / 8;
  constexpr int RPC = QERL_LORA_SHRINK_RANKS_PER_CTA;
  const int lane = tid & 31, warp = tid >> 5;
  // red[warp][mt][c][lane] -> part[t][rank]
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[((warp * MT + mt) * 4 + c) * 32 + lane] = acc[mt][c];
  sync();
  float* part = parts + unit * (BM * RPC);
  for (int e = tid; e < BM * RPC; e += THREADS) {
    const int t = e / RPC, rho = e % RPC;
    const int hh = rho >> 4, r_in = rho & 15, mt = t >> 3;
    const int c = ((r_in >> 3) << 1) | (t & 1);
    const int ln = ((r_in & 7) << 2) | ((t & 7) >> 1);
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) v += red[(((hh + 2 * q) * MT + mt) * 4 + c) * 32 + ln];
    part[e] = v;
  }
}

// After a tile's storing CTA staged the shrink's sum (its reads done, behind a barrier): counts the tile on
// sh_counters[2]; the last of `tiles` has every tile's reads behind it and zeroes sh_counters[0 .. 2] (the kernel's
// arrival counter or columns-summed count, the ready flag, this count) for the next launch. One thread.
__device__ __forceinline__ void shrink_sum_read(int* sh_counters, int tiles) {
  int prev;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(sh_counters + 2) : "memory");
  if (prev == tiles - 1) {
    sh_counters[0] = 0;
    sh_counters[1] = 0;
    sh_counters[2] = 0;
  }
}

}  // namespace qerl
