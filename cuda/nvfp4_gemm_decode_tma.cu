// FP4 x BF16 GEMM for decode batches (M <= 16 tokens per tile) on Hopper's copy engine: the split-K kernel's math
// (cuda/nvfp4_gemm.cu: mma.sync with the decoded weight as A, tokens as B) fed by a producer warp through a deep
// mbarrier ring, over a persistent stream-K schedule. sm_90a only (the QERL_WGMMA_DEVICE rule of wgmma_sm90.cuh;
// the launcher reports cudaErrorNotSupported elsewhere).
//
// Why (benchmarks/NOTES.md, "Final profile of the decode kernel", "The split count at M <= 16"): the split-K kernel
// moves 7B gate_up's 76 MB at 2.2 TB/s where cuBLAS streams BF16 at 3.7-3.9 TB/s. It is not issue-bound (~20 us
// of issue for a 74 us layer); its warps wait at the per-stage CTA barrier of the cp.async ring and on the data, and
// its grid runs 296 tiles on 264 slots (a second, nearly empty wave). Here:
//  * CTA = 8 consumer warps + 1 producer warp, 3 CTAs per SM (2 with the LoRA epilogue at BM = 16). Consumer warp w
//    computes as in split-K: rows [32 (w % 4), +32) of the 128-row tile (2 n16 blocks), k64 half w / 4 of every
//    128-K stage, BM / 8 n8 token tiles; the two k halves are summed through shared memory at the end of a segment.
//  * Ring of STAGES slots. Per slot: the stage's activations as two TMA boxes of 64 K x BM tokens (128-byte
//    swizzle, rows past M zero-filled), its 8 KB of weights and 1 KB of scales (each one contiguous run of the
//    repacked layout: one bulk copy each), all completing on the slot's `full` mbarrier. One producer thread walks the
//    CTA's whole unit range without stopping at tile boundaries; consumer warps release a slot by one arrival each
//    on its `empty` mbarrier. No CTA-wide barrier in the main loop, and the ring keeps streaming while the consumers
//    sum, fix up and store a finished segment.
//  * Persistent stream-K over (128-row tile x BM tokens, 128-K stage) units (cuda/streamk_schedule.cuh): every CTA
//    gets the same number of stages whatever the tile count, partial tiles are combined in CTA order (deterministic).
//  * Epilogue as split-K: acc * (128 / global_scale) + bias -> bf16, rows < M and < N only; with LORA the tile's LoRA
//    term (cuda/lora_epilogue.cuh) is added in FP32 before the rounding: the k-half-1 warps, idle once the halves are
//    summed, stage the tile's rows of `shrunk` and build the term in the LoRA region while the others wait.
//  * Programmatic dependent launch (`pdl`): the producer issues the first unit's weight and scale copies, then waits
//    for the prior grid (wait_prior_grid, nvfp4_common.cuh), then its activation boxes and the rest.
// Measured (NOTES, "v7"): about split-K's speed at M = 1 and on the small GEMMs (whose persistent fix-up costs 1-3
// us), 1.06-1.20x split-K on the wide ones at M = 8-16, where the shipped table runs it. The barrier and the wave were
// not the bound: with its decode and MMAs switched off its copies alone move only ~2.8 TB/s.
#include "lora_epilogue.cuh"
#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"
#include "streamk_schedule.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace qerl {
namespace {

constexpr int DT_ROWS = QERL_GEMM_BN;  // weight rows per tile: one 128-row tile of the repacked layout
constexpr int DT_BK = QERL_GEMM_BK;    // K per stage
constexpr int DT_CONSUMERS = 8;        // consumer warps
constexpr int DT_THREADS = (DT_CONSUMERS + 1) * 32;
constexpr int DT_W_BYTES = (DT_ROWS / 16) * (DT_BK / 64) * 512;  // 8 KB
constexpr int DT_S_BYTES = (DT_ROWS / 16) * (DT_BK / 64) * 64;   // 1 KB
static_assert(DT_BK == 2 * tma::kBoxK, "a stage is two 64-K activation boxes");

template <int BM, bool LORA>
struct DtCfg {
  static constexpr int MT = BM / 8;                         // n8 token tiles
  static constexpr int X_HALF_BYTES = BM * tma::kBoxK * 2;  // one 64-K box: BM rows of 128 bytes
  static constexpr int W_OFF = 2 * X_HALF_BYTES;            // in a slot: activations (1024-aligned), weights, scales
  static constexpr int S_OFF = W_OFF + DT_W_BYTES;
  static constexpr int SLOT_BYTES = ((S_OFF + DT_S_BYTES + 1023) / 1024) * 1024;
  // CTAs per SM: 3 for the plain kernel (6 warps per scheduler: 32.3 vs 34.2 us at 2 on 7B gate_up, M = 1;
  // benchmarks/NOTES.md, v7) and for the LoRA epilogue at block_m 8; 2 with it at block_m 16 (its LoRA region does
  // not fit three CTAs beside a 4-slot ring). The ring takes what shared memory is left: ~9 KB of weight bytes per
  // slot.
  static constexpr int CTAS_PER_SM = (LORA && BM == 16) ? 2 : 3;
  static constexpr int STAGES = (LORA && BM == 16) ? 6 : (BM == 8 ? 5 : 4);
  static constexpr int RED_BYTES = 2 * MT * 4 * 128 * 4;  // the k-half sum: 2 n16 blocks x MT x 4 floats x 128 threads
  // LoRA region: the tile's LoRA term, then its rows of `shrunk` (up to LORA_MAX_RANKS columns each)
  static constexpr int LORA_MAX_RANKS = 128;
  static constexpr int LT_BYTES = LORA ? lora_tile_bytes<BM, DT_ROWS>() : 0;
  static constexpr int SHRUNK_BYTES = LORA ? BM * LORA_MAX_RANKS * 2 : 0;
  static constexpr int SMEM_BYTES = STAGES * SLOT_BYTES + RED_BYTES + LT_BYTES + SHRUNK_BYTES + 1024;  // + alignment
  static_assert(BM == 8 || BM == 16, "decode kernel: block_m 8 or 16");
  static_assert(X_HALF_BYTES % 1024 == 0, "swizzled boxes stay 1024-byte aligned");
  static_assert(CTAS_PER_SM * (SMEM_BYTES + 2048) <= 228 * 1024, "CTAS_PER_SM CTAs per SM");
};

#ifdef QERL_WGMMA_DEVICE
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// The consumer warps' barrier (named barrier 1; the producer warp never joins it).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(DT_CONSUMERS * 32) : "memory");
}
#endif  // QERL_WGMMA_DEVICE

template <int BM, bool LORA>
__global__ void __launch_bounds__(DT_THREADS, DtCfg<BM, LORA>::CTAS_PER_SM)
    nvfp4_gemm_decode_tma_kernel(const __grid_constant__ CUtensorMap x_map, const uint4* __restrict__ qw,
                                 const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                 const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                 float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                 int units_per_cta, const QerlLoraEpilogue lora) {
#ifdef QERL_WGMMA_DEVICE
  using C = DtCfg<BM, LORA>;
  constexpr int MT = C::MT;
  constexpr int STAGES = C::STAGES;
  constexpr int W_VEC = DT_W_BYTES / 16;  // uint4 per tile-stage of weights: 512
  constexpr int S_VEC = DT_S_BYTES / 16;  // 64
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int s_is_last;
  __shared__ __align__(8) uint64_t full_bar[STAGES];   // a slot's copies landed (transaction count)
  __shared__ __align__(8) uint64_t empty_bar[STAGES];  // every consumer warp is done with a slot

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int S = K / DT_BK;
  const int n_tiles = (N + DT_ROWS - 1) / DT_ROWS;
  const int m_tiles = (M + BM - 1) / BM;
  const streamk::CtaRange range(n_tiles * m_tiles * S, S, units_per_cta);
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem_base - smem_u32(smem_raw));
  float* red = reinterpret_cast<float*>(smem + STAGES * C::SLOT_BYTES);
  float* lt = reinterpret_cast<float*>(smem + STAGES * C::SLOT_BYTES + C::RED_BYTES);
  __nv_bfloat16* s_sm =
      reinterpret_cast<__nv_bfloat16*>(smem + STAGES * C::SLOT_BYTES + C::RED_BYTES + C::LT_BYTES);
  const uint32_t full0 = smem_u32(&full_bar[0]);
  const uint32_t empty0 = smem_u32(&empty_bar[0]);

  if (tid == 0) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&x_map)) : "memory");
    for (int i = 0; i < STAGES; ++i) {
      tma::mbar_init(full0 + 8 * i, 1);
      tma::mbar_init(empty0 + 8 * i, DT_CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the producer and the consumers go their own ways

  if (warp == DT_CONSUMERS) {
    // ---- producer: one thread issues every copy of this CTA's range, unit after unit
    if (lane == 0) {
      const int n_units = range.end - range.begin;
      // Unit i's copies into its slot: the two activation boxes (`acts`), the weights and scales (`weights`).
      auto copy_unit = [&](int i, bool acts, bool weights) {
        const int slot = i % STAGES;
        const int u = range.begin + i;
        const int tile = u / S;
        const int st = u - tile * S;
        const int mtile = tile / n_tiles;
        const int ntile = tile - mtile * n_tiles;
        const uint32_t base = smem_base + slot * C::SLOT_BYTES;
        const uint32_t bar = full0 + 8 * slot;
        const size_t blk = size_t(ntile) * S + st;  // the tile-stage's block of the repacked layout
        if (acts) {
          tma::load_2d(base, &x_map, bar, st * DT_BK, mtile * BM);
          tma::load_2d(base + C::X_HALF_BYTES, &x_map, bar, st * DT_BK + tma::kBoxK, mtile * BM);
        }
        if (weights) {
          tma::bulk_copy(base + C::W_OFF, qw + blk * W_VEC, DT_W_BYTES, bar);
          tma::bulk_copy(base + C::S_OFF, qs + blk * S_VEC, DT_S_BYTES, bar);
        }
      };
      auto expect_unit = [&](int i) {  // the slot's bytes, all of its copies
        tma::mbar_expect_tx(full0 + 8 * (i % STAGES), 2 * C::X_HALF_BYTES + DT_W_BYTES + DT_S_BYTES);
      };
      // Unit 0's weights and scales stream before the wait for the prior grid (PDL; a no-op without it), its
      // activations after. Only unit 0's: a CTA's copies complete roughly in issue order, so more weights ahead of
      // the first activation boxes delay the first slot (a whole first pass of them measured 7B gate_up at M = 1
      // 33.4 -> 34.8 us, PDL off; NOTES "Sixth round").
      if (n_units > 0) {
        expect_unit(0);
        copy_unit(0, false, true);
      }
      wait_prior_grid();
      if (n_units > 0) copy_unit(0, true, false);
      for (int i = 1; i < n_units; ++i) {
        if (i >= STAGES) tma::mbar_wait(empty0 + 8 * (i % STAGES), ((i / STAGES) + 1) & 1);  // its last use ended
        expect_unit(i);
        copy_unit(i, true, true);
      }
    }
    return;
  }
  wait_prior_grid();  // the consumers touch the workspace, counters, shrunk and out: after the prior grid

  // ---- consumers
  const int wn = warp & 3;        // 32-row group of the tile
  const int kh = warp >> 2;       // k64 half of each stage
  const int rt = wn * 32 + lane;  // index among the 128 threads holding one output fragment set
  const int my_first_tile = range.first_tile();
  // ldmatrix source of this lane in a slot's k64 half kh (swizzled box: token row r at r * 128, 16-byte chunk q at
  // (q ^ r % 8) * 16): row (lane / 16) * 8 + lane % 8 of each 16-row pair (lane % 8 for MT = 1), chunk
  // 2 j + lane / 8 % 2
  const int xrow = (MT == 1 ? 0 : (lane >> 4) * 8) + (lane & 7);
  const uint32_t x_lane = kh * C::X_HALF_BYTES + xrow * 128;
  const int xq = (lane >> 3) & 1;
  const int xsw = lane & 7;  // = xrow % 8

  int g = 0;  // stages this CTA's consumers have taken from the ring: slot g % STAGES, phase parity (g / STAGES) % 2
  for (int u = range.begin; u < range.end;) {
    const streamk::Segment seg = range.segment_at(u);
    const int tile = seg.tile;
    const int mtile = tile / n_tiles;
    const int ntile = tile - mtile * n_tiles;
    const int m0 = mtile * BM;
    const int nb0 = ntile * (DT_ROWS / 16);
    if constexpr (LORA) {
      // the tile's B rows into L2 while its stages stream (one CTA per tile: the one holding its first stage)
      if (kh == 1 && seg.kb == 0) lora_prefetch_b<DT_ROWS, 128>(lora, nb0 * 16, N, rt);
    }

    float acc[2][MT][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < MT; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;

    for (int it = 0; it < seg.count(); ++it, ++g) {
      const int slot = g % STAGES;
      tma::mbar_wait(full0 + 8 * slot, (g / STAGES) & 1);
      const uint8_t* base = smem + slot * C::SLOT_BYTES;
      const uint4* wsm = reinterpret_cast<const uint4*>(base + C::W_OFF);
      const uint2* ssm = reinterpret_cast<const uint2*>(base + C::S_OFF);
      const uint32_t xa = smem_base + slot * C::SLOT_BYTES + x_lane;
      uint4 wv[2];
      uint2 sv[2];
      load_warp_blocks(wsm, ssm, wn, kh, lane, wv, sv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t xaddr = xa + uint32_t(((2 * j + xq) ^ xsw) * 16);
        uint32_t b[MT][2];
        if constexpr (MT == 1) {
          asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                       : "=r"(b[0][0]), "=r"(b[0][1])
                       : "r"(xaddr));
        } else {
          ldmatrix_x4_u32(b[0][0], b[0][1], b[1][0], b[1][1], xaddr);
        }
        mma_k16_step(wv, sv, j, b, acc);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * slot);  // this warp is done with the slot
    }

    // ---- the two k halves: kh = 0 ends with the totals (red is the consumers' own buffer: the ring keeps filling)
    sum_k_halves(acc, red, kh, rt, [] { consumers_sync(); });

    // ---- CTAs sharing this tile combine their partials in CTA order; one of them stores it
    const bool do_store = streamk::finish_segment(
        range, counters, tile, tid == 0, s_is_last, [] { consumers_sync(); },
        [&] {
          if (kh == 0)
            store_partial(acc, streamk::partial_slot<BM * DT_ROWS>(ws, blockIdx.x, range.my_slot(tile, my_first_tile)),
                          m0, lane, rt, M);
        },
        [&](int c_first, int c_last) {
          if (kh != 0) return;
          float4 sum[2][MT];
#pragma unroll
          for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sum[nb][mt] = make_float4(0.f, 0.f, 0.f, 0.f);
          streamk::for_each_partial<BM * DT_ROWS>(range, ws, tile, c_first, c_last, [&](const float4* part) {
            float4 v[2][MT];
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
              for (int mt = 0; mt < MT; ++mt)
                v[nb][mt] = (m0 + mt * 8 + (lane & 3) * 2 < M) ? __ldcg(part + (nb * MT + mt) * 128 + rt)
                                                               : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                sum[nb][mt].x += v[nb][mt].x;
                sum[nb][mt].y += v[nb][mt].y;
                sum[nb][mt].z += v[nb][mt].z;
                sum[nb][mt].w += v[nb][mt].w;
              }
          });
#pragma unroll
          for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              acc[nb][mt][0] = sum[nb][mt].x;
              acc[nb][mt][1] = sum[nb][mt].y;
              acc[nb][mt][2] = sum[nb][mt].z;
              acc[nb][mt][3] = sum[nb][mt].w;
            }
        });
    if constexpr (LORA) {
      if (do_store) {  // uniform over the consumers (a whole tile, or the shared last-arrival flag)
        if (kh == 1) lora_stage_shrunk<BM, DT_ROWS>(s_sm, lora, m0, M, rt);
        consumers_sync();
        if (kh == 1) lora_tile<BM, DT_ROWS>(lt, s_sm, lora, nb0 * 16, m0, M, N, rt);
        consumers_sync();
        if (kh == 0)
          store_bf16(acc, out, bias, __fdiv_rn(128.0f, __ldg(gscale)), nb0 + wn * 2, m0, lane, M, N,
                     LoraTile<DT_ROWS>{lt, nb0 * 16});
      }
    } else {
      if (do_store && kh == 0)
        store_bf16(acc, out, bias, __fdiv_rn(128.0f, __ldg(gscale)), nb0 + wn * 2, m0, lane, M, N);
    }
    consumers_sync();  // red, the LoRA region and s_is_last are reused by the next segment
    u = range.after(seg);
  }
#else
  __trap();  // not built for sm_90a: the launcher never starts this kernel (ctas_per_sm = 0)
#endif
}

template <int BM, bool LORA>
using DtLauncher =
    tma::Launcher<nvfp4_gemm_decode_tma_kernel<BM, LORA>, BM, DT_THREADS, DtCfg<BM, LORA>::SMEM_BYTES, DT_ROWS>;

template <int BM>
cudaError_t launch(const void* x, const void* qweight, const void* qscale, const float* gscale, const void* bias,
                   void* out, float* ws, int* counters, int M, int N, int K, int grid, const QerlLoraEpilogue* lora,
                   bool pdl, cudaStream_t stream) {
  if (lora == nullptr)
    return DtLauncher<BM, false>::launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream,
                                         pdl, QerlLoraEpilogue{});
  QerlLoraEpilogue norm{};
  if (!lora_valid(*lora, N, DtCfg<BM, true>::LORA_MAX_RANKS, &norm)) return cudaErrorInvalidValue;
  return DtLauncher<BM, true>::launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream,
                                      pdl, norm);
}

}  // namespace
}  // namespace qerl

// The C API (qerl_nvfp4.h): block_m 8 or 16; `lora` null for the plain GEMM.
extern "C" cudaError_t qerl_nvfp4_gemm_decode_tma_launch(const void* x, const void* qweight, const void* qscale,
                                                         const float* global_scale, const void* bias, void* out,
                                                         float* workspace, int* counters, int M, int N, int K,
                                                         int grid, int block_m, const QerlLoraEpilogue* lora,
                                                         int pdl, cudaStream_t stream) {
  if (block_m == 8)
    return qerl::launch<8>(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, grid, lora,
                           pdl != 0, stream);
  if (block_m == 16)
    return qerl::launch<16>(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, grid, lora,
                            pdl != 0, stream);
  return cudaErrorInvalidValue;
}

extern "C" int qerl_nvfp4_gemm_decode_tma_lora_supported(int N, int block_m, const QerlLoraEpilogue* lora) {
  QerlLoraEpilogue norm{};
  return lora != nullptr && N > 0 && (block_m == 8 || block_m == 16) &&
                 qerl::lora_valid(*lora, N, qerl::DtCfg<16, true>::LORA_MAX_RANKS, &norm)
             ? 1
             : 0;
}

// The schedule's answers are the same with and without the LoRA epilogue (its ring depth does not enter them).
extern "C" size_t qerl_nvfp4_gemm_decode_tma_workspace_floats(int M, int N, int K, int grid, int block_m) {
  if (block_m == 8) return qerl::DtLauncher<8, false>::workspace_floats(M, N, K, grid);
  if (block_m == 16) return qerl::DtLauncher<16, false>::workspace_floats(M, N, K, grid);
  return 0;
}

extern "C" int qerl_nvfp4_gemm_decode_tma_tiles(int M, int N, int block_m) {
  if (block_m == 8) return qerl::DtLauncher<8, false>::tiles(M, N);
  if (block_m == 16) return qerl::DtLauncher<16, false>::tiles(M, N);
  return 0;
}

// Resident CTAs per SM of the plain kernel (lora = 0) or the one with the LoRA epilogue (lora = 1).
extern "C" int qerl_nvfp4_gemm_decode_tma_ctas_per_sm(int block_m, int lora) {
  if (block_m == 8) return lora ? qerl::DtLauncher<8, true>::ctas_per_sm() : qerl::DtLauncher<8, false>::ctas_per_sm();
  if (block_m == 16)
    return lora ? qerl::DtLauncher<16, true>::ctas_per_sm() : qerl::DtLauncher<16, false>::ctas_per_sm();
  return 0;
}
