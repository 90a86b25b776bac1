// The end of one stream-K segment in the register-A wgmma kernels (cuda/nvfp4_gemm_wgmma.cu: 64 / 128-token tiles
// of 256 weight rows; cuda/nvfp4_gemm_wgmma_wide.cu: 256-token tiles of 128 rows): the partials and the fix-up of a
// tile shared by several CTAs, then the bf16 store. Both kernels hold their accumulators the same way -- per thread
// `kBlocks` m64 blocks of wgmma's FP32 layout, block h of warpgroup wg covering weight rows wg * 64 * kBlocks + 64 h
// .. + 63 of the tile -- so the slot layout and the store are one piece of code.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "nvfp4_common.cuh"
#include "streamk_schedule.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace qerl {
namespace wgmma_rs {

// The tile's bf16 store, staged through shared memory (the ring, free at a segment's end). Why (benchmarks/NOTES.md,
// "Twelfth round"): stored straight from the accumulators every element is its own 2-byte store with its own address
// and bounds check (~12 instructions each, 128 per thread per tile) and a warp's store covers four half-used sectors:
// 13.5 % of the wide kernel's warp samples at M = 256 (H100 source profile). Staged, each thread writes its values as
// bf16 with 16 `stmatrix .trans` (the accumulator layout is the mma fragment layout; transposed, a stored row is 8
// weight rows of one token, the output's order), and the tile leaves in 16-byte coalesced stores.
//   The staged tile: kStoreTokens token rows of kStoreRows weight rows; a row's pitch has 16 bytes of padding so that
// the 8 token rows one matrix writes land on 8 different 16-byte bank groups.
template <int kBlocks, int kAcc, int kThreads>
struct StagedStore {
  static constexpr int kTokens = 2 * kAcc;                       // 8 tokens per accumulator quad
  static constexpr int kRows = (kThreads / 128) * 64 * kBlocks;  // weight rows of the tile
  static constexpr int kPitch = kRows * 2 + 16;                  // bytes per staged token row
  static constexpr int kBytes = kTokens * kPitch;                // the kernel's ring must hold this much
  static_assert(kAcc % 8 == 0, "stmatrix .x4 takes two 8-token groups of both row halves");
};

#ifdef QERL_WGMMA_DEVICE
// Four 8x8 bf16 matrices to shared memory, each transposed: register i of lane l holds row l / 4, columns 2 (l % 4),
// +1 of matrix i (the mma fragment layout); lanes 8 i .. 8 i + 7 give the addresses of the stored rows of matrix i,
// stored row j being column j of the fragment (16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Every thread's acc * alpha + bias as bf16 into shared memory with `stmatrix .trans` (16 per m64 block): the part
// both staged stores share. The stored row of token row t (of the tile) and the 8 tile rows (output columns) col ..
// col + 7 is at row_base(col, t % 8) + t * kTokenStride.
template <int kBlocks, int kAcc, int kTokenStride, class RowBase>
__device__ __forceinline__ void stage_bf16(const float (&acc)[kBlocks][kAcc], int lane, int wg, int wl, int row0,
                                           float alpha, int N, const __nv_bfloat16* bias, RowBase&& row_base) {
  const int mi = lane >> 3;  // the matrix whose stored row this lane addresses: row half mi % 2, token group mi / 2
  const int mj = lane & 7;   // ... and which of its 8 token rows
#pragma unroll
  for (int h = 0; h < kBlocks; ++h) {
    const int n_blk = wg * 64 * kBlocks + h * 64 + wl * 16;  // this warp's 16 rows of block h, in the tile
    float bv[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int n = row0 + n_blk + (lane >> 2) + 8 * rh;
      bv[rh] = bias != nullptr && n < N ? __bfloat162float(bias[n]) : 0.0f;
    }
    const uint32_t row_addr = row_base(n_blk + 8 * (mi & 1), mj);  // + a token row's offset below
#pragma unroll
    for (int p = 0; p < kAcc / 8; ++p) {  // token groups 2 p, 2 p + 1
      uint32_t r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rh = i & 1;
        const int q = 2 * p + (i >> 1);
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc[h][4 * q + 2 * rh] * alpha + bv[rh],
                                                       acc[h][4 * q + 2 * rh + 1] * alpha + bv[rh]);
        r[i] = *reinterpret_cast<const uint32_t*>(&v);
      }
      stmatrix_x4_trans(row_addr + uint32_t((8 * (2 * p + (mi >> 1)) + mj) * kTokenStride), r);
    }
  }
}

// acc * alpha + bias -> bf16 into `stage` (StagedStore's layout; every thread of the CTA calls this: it holds a
// barrier), then out[m, n] for m < M, n < N in 16-byte pieces. Needs N % 8 == 0 and a 16-byte aligned `out` (the
// caller checks; through the op both always hold: the layout takes N % 16 == 0 and the op allocates `out`, so the
// scalar store behind the check is a guard for other callers). The same FP32 operations and rounding as the direct
// store: the same bits.
template <int kBlocks, int kAcc, int kThreads>
__device__ __forceinline__ void store_tile_staged(const float (&acc)[kBlocks][kAcc], uint8_t* stage, int row0, int m0,
                                                  int M, int N, bool active, float alpha,
                                                  const __nv_bfloat16* bias, __nv_bfloat16* out) {
  using S = StagedStore<kBlocks, kAcc, kThreads>;
  // threadIdx.x read here (volatile): index math derived from it is not hoisted into the kernel's prologue and kept
  // live across the main loop (in the 255-register kernels ptxas spilled such values)
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  const int lane = tid & 31;
  const int wg = tid >> 7;
  const int wl = (tid >> 5) & 3;
  if (active) {
    const uint32_t base = smem_u32(stage);
    stage_bf16<kBlocks, kAcc, S::kPitch>(acc, lane, wg, wl, row0, alpha, N, bias, [&](int col, int mj) {
      return base + uint32_t(col * 2);
    });
  }
  __syncthreads();
  QERL_AN_SUB(3)
  constexpr int kChunks = S::kRows / 8;  // 16-byte pieces per token row
#pragma unroll 4
  for (int c = tid; c < S::kTokens * kChunks; c += kThreads) {
    const int t = c / kChunks;
    const int n = row0 + 8 * (c % kChunks);
    if (m0 + t < M && n < N)
      *reinterpret_cast<uint4*>(out + size_t(m0 + t) * N + n) =
          *reinterpret_cast<const uint4*>(stage + t * S::kPitch + 2 * (c % kChunks) * 8);
  }
  QERL_AN_SUB(4)
}

// The same bf16 tile through the copy engine (`out_map`: tma::encode_output with 64-column boxes of the tile's
// tokens): each thread writes its values with `stmatrix .trans` into `stage` (1024-byte aligned, kRows / 64 boxes of
// kTokens x 128 bytes in the map's 128-byte swizzle: token r's 16-byte chunk q at r * 128 + (q ^ r % 8) * 16, which
// also spreads one matrix's 8 rows over all banks), then thread 0 issues one tensor store per 64 columns and commits
// them as one bulk group; rows past M and columns past N are not written by the copy engine. No thread copies the
// tile to global memory: the CTA goes on at once (NOTES "Nineteenth round": the staged copy took ~3 us per 64 KB
// tile in the wide kernel's stream-K ends). The caller keeps `stage` unwritten until thread 0's
// tma::store_wait_read() and has thread 0 call tma::store_wait() before the kernel ends. Same FP32 operations and
// rounding as store_tile_staged: the same bits.
template <int kBlocks, int kAcc, int kThreads>
struct TmaStore {
  static constexpr int kTokens = 2 * kAcc;
  static constexpr int kRows = (kThreads / 128) * 64 * kBlocks;
  static constexpr int kBoxBytes = kTokens * 128;  // one 64-column box
  static constexpr int kBytes = (kRows / 64) * kBoxBytes;
  static_assert(kTokens <= 256, "a tensor-map box has at most 256 rows");
};

template <int kBlocks, int kAcc, int kThreads>
__device__ __forceinline__ void store_tile_tma(const float (&acc)[kBlocks][kAcc], uint8_t* stage, int row0, int m0,
                                               bool active, float alpha, int N, const __nv_bfloat16* bias,
                                               const CUtensorMap* out_map) {
  using S = TmaStore<kBlocks, kAcc, kThreads>;
  int tid;  // (read here, volatile: see store_tile_staged)
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  const int lane = tid & 31;
  const int wg = tid >> 7;
  const int wl = (tid >> 5) & 3;
  const uint32_t base = smem_u32(stage);
  if (active) {  // token r's 16-byte chunk q of a 64-column box at r * 128 + (q ^ r % 8) * 16 (r % 8 == mj)
    stage_bf16<kBlocks, kAcc, 128>(acc, lane, wg, wl, row0, alpha, N, bias, [&](int col, int mj) {
      return base + uint32_t((col >> 6) * S::kBoxBytes) + uint32_t(((col & 63) >> 3) ^ mj) * 16;
    });
  }
  fence_proxy_async();  // this thread's shared-memory writes, read next by the copy engine
  __syncthreads();
  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < S::kRows / 64; ++b)
      if (row0 + 64 * b < N) tma::store_2d(out_map, base + uint32_t(b * S::kBoxBytes), row0 + 64 * b, m0);
    tma::store_commit();
  }
}
#endif  // QERL_WGMMA_DEVICE

// acc[h][4 q + c] of thread (warp wl of warpgroup wg, lane) is weight row wg * 64 * kBlocks + 64 h + 16 wl + lane / 4
// + 8 (c / 2) of the tile and token m0 + 8 q + 2 (lane % 4) + c % 2. kThreads threads hold the tile (all of the
// CTA's, barrier __syncthreads). `active`: whether this warpgroup holds rows of the tile (the 64 / 128-token kernel's
// second 128-row half may not exist). `stage`: StagedStore<kBlocks, kAcc, kThreads>::kBytes of shared memory free
// until the caller's next barrier (the ring), for the staged store; with `out_map` (not null) the tile leaves by the
// copy engine instead (store_tile_tma: `stage` then needs TmaStore's bytes, 1024-byte aligned, and the caller's
// waits). Returns after the store (or after publishing a partial when another CTA of the tile stores it).
template <int kBlocks, int kAcc, int kThreads, int kSlotFloats, bool kOrdered = false>
__device__ __forceinline__ void finish_tile(float (&acc)[kBlocks][kAcc], const streamk::CtaRange& range, float* ws,
                                            int* counters, int& s_is_last, int tile, int my_first_tile, int row0,
                                            int m0, int M, int N, bool active, const float* gscale,
                                            const __nv_bfloat16* bias, __nv_bfloat16* out, uint8_t* stage,
                                            const CUtensorMap* out_map = nullptr, bool descending = false) {
  constexpr int NQ = kAcc / 4;  // float4 partials per m64 block per thread
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int wg = tid >> 7;
  const int wl = (tid >> 5) & 3;
  const int tok_lane = 2 * (lane & 3);
  // the split tile's fix-up counted at arrival (streamk::fix_up_arrive_first): with two CTAs on the tile the second
  // to arrive adds the first's partial to its own accumulators and stores, writing none of its own
  const int c_first = range.first_cta(tile);
  const int c_last = range.last_cta(tile);
  // acc[h] += block h of the partial in `slot` (rows past M: never written, read as zeros)
  auto add_block = [&](const float4* slot, int h) {
    const float4* part = slot + h * NQ * kThreads + tid;
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const float4 v = (m0 + 8 * q + tok_lane < M) ? __ldcg(part + q * kThreads) : make_float4(0.f, 0.f, 0.f, 0.f);
      acc[h][4 * q] += v.x;
      acc[h][4 * q + 1] += v.y;
      acc[h][4 * q + 2] += v.z;
      acc[h][4 * q + 3] += v.w;
    }
  };
  bool do_store = true;
  if (c_first != c_last) {
    const int n = c_last - c_first + 1;
    // this CTA's place in the sum's order: ascending CTAs, or descending where the kernel runs a range's first tile
    // last (the K-aligned order), so that the CTA that usually arrives last comes first and sums in place
    // (kOrdered false: the 64- / 128-token kernels, 255 registers tight, keep the ascending from-zero sum for three or
    // more CTAs, written as place 2 so that the last arrival writes its own partial; their code stays as measured)
    const int pos = !kOrdered ? (n > 2 ? 2 : 0) : descending ? c_last - int(blockIdx.x) : int(blockIdx.x) - c_first;
    do_store = streamk::fix_up_arrive_first(
        counters, tile, n, pos, tid == 0, s_is_last, [] { __syncthreads(); },
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
          if (!active) return;
          if (n == 2) {  // two segments: acc += the other's partial (the same bits in either order)
            const int other = c_first + c_last - int(blockIdx.x);
            const float4* slot = streamk::partial_slot<kSlotFloats>(ws, other, range.slot_of(tile, other));
#pragma unroll
            for (int h = 0; h < kBlocks; ++h) add_block(slot, h);
            return;
          }
          if constexpr (!kOrdered) {  // every partial from zero, in CTA order (its own was written)
#pragma unroll
            for (int h = 0; h < kBlocks; ++h) {
#pragma unroll
              for (int q = 0; q < NQ; ++q)
                acc[h][4 * q] = acc[h][4 * q + 1] = acc[h][4 * q + 2] = acc[h][4 * q + 3] = 0.f;
              streamk::for_each_partial<kSlotFloats>(range, ws, tile, c_first, c_last,
                                                     [&](const float4* slot) { add_block(slot, h); });
            }
            return;
          }
          // more: where this CTA is first or second in the order its sums stay in place and the others follow in
          // order; else its own partial was written too and every partial is summed from zero, in the order
          if (pos >= 2) {
#pragma unroll
            for (int h = 0; h < kBlocks; ++h)
#pragma unroll
              for (int q = 0; q < kAcc; ++q) acc[h][q] = 0.f;
          }
          const int skip = pos < 2 ? pos : -1;
#pragma unroll 1
          for (int i = 0; i < n; ++i) {
            if (i == skip) continue;
            const int c = descending ? c_last - i : c_first + i;
            const float4* slot = streamk::partial_slot<kSlotFloats>(ws, c, range.slot_of(tile, c));
#pragma unroll
            for (int h = 0; h < kBlocks; ++h) add_block(slot, h);
          }
        });
  }
  if (!do_store) return;
  // acc * (128 / global_scale) + bias -> bf16, rows < M and < N only
  const float alpha = __fdiv_rn(128.0f, __ldg(gscale));
#ifdef QERL_WGMMA_DEVICE
  if (out_map != nullptr) {  // CTA-uniform (the launcher encoded the map: N % 8 == 0, `out` 16-byte aligned)
    store_tile_tma<kBlocks, kAcc, kThreads>(acc, stage, row0, m0, active, alpha, N, bias, out_map);
    return;
  }
  if ((N & 7) == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0) {  // CTA-uniform
    store_tile_staged<kBlocks, kAcc, kThreads>(acc, stage, row0, m0, M, N, active, alpha, bias, out);
    return;
  }
#endif
  if (!active) return;
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
