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
//  * The linear kernel (nvfp4_gemm_decode_tma_linear_kernel, qerl::nvfp4_lora_linear) computes the LoRA shrink in
//    the launch too (cuda/lora_shrink_in_launch.cuh), where it was a Triton launch of its own (~2.5 us of the 7B
//    gate_up layer's 37.3 at M = 1; NOTES "Would a LoRA-aware route pay?"): the shrink's units (32 ranks x one
//    128-K stage: 8 KB of A_cat, ~1/20 of a CTA's weight bytes) go one each to the lowest-indexed CTAs as their
//    first ring slot, A_cat by TMA from a second tensor map into the slot's weight area; every 32-rank column's last
//    unit sums the column, the last column releases a flag, and each tile's storing CTA waits for it before its LoRA
//    term (on the decode shapes at the end of its range, or after a whole tile's stages: the flag is long up by
//    then; the storer's idle k-half-1 warps wait and stage the sum while the others read the tile's partials).
//    Forward progress: a unit waits on nothing, the units sit on the lowest block indices (dispatched first), and the
//    host keeps them <= the launch's CTAs, a grid the GPU holds at once (SMs x resident CTAs per SM).
//  * Programmatic dependent launch (`pdl`): the producer issues the first unit's weight and scale copies (the
//    linear kernel's shrink CTAs: their unit's A_cat boxes), then waits for the prior grid (wait_prior_grid,
//    nvfp4_common.cuh), then its activation boxes and the rest.
// Measured (NOTES, "v7"): about split-K's speed at M = 1 and on the small GEMMs (whose persistent fix-up costs 1-3
// us), 1.06-1.20x split-K on the wide ones at M = 8-16, where the shipped table runs it. The barrier and the wave were
// not the bound: with its decode and MMAs switched off its copies alone move only ~2.8 TB/s.
#include "lora_epilogue.cuh"
#include "lora_shrink_in_launch.cuh"
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

// The linear kernel's in-launch shrink (cuda/lora_shrink_in_launch.cuh): unit j is column j % cols (32 ranks) of
// stage j / cols (128 K), computed by CTA j -- the lowest block indices, dispatched first -- in its first ring slot,
// ahead of its GEMM units; the host keeps units <= CTAs (one each) and M <= block_m (one m-tile, rows from 0). Its
// partial is unit j of ShrinkPlan's layout (splits = the K stages), after the stream-K partials. Counters after the
// stream-K tiles' own: [0] columns summed, [1] ready (the bf16 sum is written), [2] tiles done reading it (zeroing
// [0 .. 2]: shrink_sum_read), [3 + c] units of column c arrived (zeroed by the column's last one).
struct DtShrink {
  enum Counter : int { kColsSummed = 0, kReady = 1, kArrived = 3 };
  static constexpr int kRows = QERL_LORA_SHRINK_RANKS_PER_CTA;  // A rows of a unit
  static constexpr int kABoxBytes = kRows * tma::kBoxK * 2;     // a unit's 64-K box of A: 4 KB
  __host__ __device__ static int units(int ranks, int K) { return (ranks + kRows - 1) / kRows * (K / DT_BK); }
  __host__ __device__ static int counters(int ranks) { return kArrived + (ranks + kRows - 1) / kRows; }
};
static_assert(2 * DtShrink::kABoxBytes <= DT_W_BYTES + DT_S_BYTES, "a shrink unit's A rows fit a slot's weight area");

#ifdef QERL_WGMMA_DEVICE
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// The consumer warps' barrier (named barrier 1; the producer warp never joins it).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(DT_CONSUMERS * 32) : "memory");
}

// The MMA's B fragments (tokens as n) of one k16 step of a slot's activations (swizzled 64-K boxes: token row r at
// r * 128, 16-byte chunk q at (q ^ r % 8) * 16): `xaddr` is this lane's ldmatrix row, token (lane / 16) * 8 + lane % 8
// (lane % 8 for MT = 1), chunk 2 j + lane / 8 % 2 of the step j.
template <int MT>
__device__ __forceinline__ void x_fragments(uint32_t (&b)[MT][2], uint32_t xaddr) {
  if constexpr (MT == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b[0][0]), "=r"(b[0][1])
                 : "r"(xaddr));
  } else {
    ldmatrix_x4_u32(b[0][0], b[0][1], b[1][0], b[1][1], xaddr);
  }
}

// The in-launch shrink's partials: after the stream-K partials, 2 slots of block_m x 128 floats per CTA where a range
// ends inside a tile (streamk::workspace_floats of this launch).
__device__ __forceinline__ float* dt_shrink_partials(float* ws, int units_per_cta, int stages, int bm) {
  return units_per_cta % stages == 0 ? ws : ws + size_t(2) * gridDim.x * bm * DT_ROWS;
}

// The last unit of shrink column `col` to arrive: the column's FP32 sum over the S stages' partials for token rows
// t < rows, rounded to bf16 into `sum` [rows, ranks] (row t at t * ranks). The order is fixed by (rows, S): the stages
// in `chunks` runs of `per` consecutive stages (chunks: the threads each float4 of the column's rows gets, 256 /
// (8 rows), at most S), each run summed in stage order, then the runs in run order; so the same bits every run,
// whichever CTA sums. `red`: 4 KB of free shared memory. Consumer threads (all 256 call it).
template <int BM>
__device__ __forceinline__ void dt_shrink_column_sum(const float* parts, __nv_bfloat16* sum, float* red, int cols,
                                                     int col, int ranks, int S, int rows, int tid) {
  constexpr int RPC = DtShrink::kRows;
  constexpr int THREADS = DT_CONSUMERS * 32;
  const int quads = rows * (RPC / 4);  // float4s of the column's rows
  const int chunks = min(S, THREADS / quads);
  const int per = (S + chunks - 1) / chunks;
  float4* red4 = reinterpret_cast<float4*>(red);
  if (tid < quads * chunks) {
    const int q = tid % quads, c = tid / quads;
    const float4* p = reinterpret_cast<const float4*>(parts + size_t(col) * (BM * RPC)) + q;
    const size_t stride = size_t(cols) * (BM * RPC / 4);  // float4s from one stage's partial to the next
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    const int s_end = min(S, (c + 1) * per);
#pragma unroll 4
    for (int st = c * per; st < s_end; ++st) {
      const float4 w = __ldcg(p + st * stride);
      v.x += w.x;
      v.y += w.y;
      v.z += w.z;
      v.w += w.w;
    }
    red4[c * quads + q] = v;
  }
  consumers_sync();
  if (tid < quads) {
    float4 v = red4[tid];
    for (int c = 1; c < chunks; ++c) {
      const float4 w = red4[c * quads + tid];
      v.x += w.x;
      v.y += w.y;
      v.z += w.z;
      v.w += w.w;
    }
    const int t = tid / (RPC / 4), r = col * RPC + 4 * (tid % (RPC / 4));
    if (r < ranks) {  // ranks is a multiple of 8: a float4 of ranks is all in or all out
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
      *reinterpret_cast<uint2*>(sum + size_t(t) * ranks + r) =
          make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
    }
  }
}

// CTA j's unit of the in-launch shrink, ring position 0 (`slot`, its barriers in phase 0): the producer put the unit's
// 32 A rows of its stage in the slot's weight area (two swizzled 64-K boxes like the activations', rows past the
// ranks zero-filled) and the stage's activations where a GEMM unit has them. Consumer warp w: ranks 16 (w % 2) .. of
// the column, the k32 quarter w / 2 (k64 half w / 4, k16 steps 2 (w / 2 % 2) ..). The partial goes to unit j of
// `parts`; the column's last unit to arrive sums it into the bf16 sum behind the partials, and the last column
// summed releases the ready flag. Consumer threads (all 256 call it).
template <int BM>
__device__ __forceinline__ void dt_shrink_unit(uint32_t slot, uint32_t full_bar, uint32_t empty_bar, float* red,
                                               float* parts, int* sh_counters, const QerlLoraEpilogue& lora, int M,
                                               int S, int tid, int& flag) {
  using C = DtCfg<BM, true>;
  constexpr int MT = C::MT;
  const int lane = tid & 31, warp = tid >> 5;
  const int ranks = lora.n_slices * lora.rank;
  const int cols = (ranks + DtShrink::kRows - 1) / DtShrink::kRows;
  const int j = blockIdx.x;
  const int col = j % cols;
  const int half = warp >> 2;                                             // k64 half: which box
  const int arow = (warp & 1) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;  // A fragment rows: ldmatrix x4 row of lane
  const uint32_t a_lane = slot + C::W_OFF + half * DtShrink::kABoxBytes + arow * 128;
  const int xrow = (MT == 1 ? 0 : (lane >> 4) * 8) + (lane & 7);
  const uint32_t x_lane = slot + half * C::X_HALF_BYTES + xrow * 128;
  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[mt][c] = 0.0f;
  tma::mbar_wait(full_bar, 0);
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    const int step = 2 * ((warp >> 1) & 1) + jj;  // k16 step of the half
    uint32_t af[4];
    ldmatrix_x4_u32(af[0], af[1], af[2], af[3], a_lane + uint32_t(((2 * step + (lane >> 4)) ^ (arow & 7)) * 16));
    uint32_t b[MT][2];
    x_fragments(b, x_lane + uint32_t(((2 * step + ((lane >> 3) & 1)) ^ (lane & 7)) * 16));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mma_bf16(acc[mt], af, b[mt]);
  }
  __syncwarp();
  if (lane == 0) mbar_arrive(empty_bar);  // the slot goes back to the producer
  store_shrink_partial<BM, DT_CONSUMERS * 32>(acc, red, parts, size_t(j), tid, [] { consumers_sync(); });
  if (!arrive_last(sh_counters, DtShrink::kArrived + col, S, tid == 0, flag, [] { consumers_sync(); })) return;
  // the column's last unit: arrive_last acquired every unit's partial of it
  __nv_bfloat16* sum = reinterpret_cast<__nv_bfloat16*>(parts + ShrinkPlan::partial_floats(BM, cols, S));
  dt_shrink_column_sum<BM>(parts, sum, red, cols, col, ranks, S, M, tid);
  consumers_sync();  // the column's bf16 stores before thread 0's release
  if (tid == 0) {
    sh_counters[DtShrink::kArrived + col] = 0;  // every unit of the column arrived: zero for the next launch
    int prev;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                 : "=r"(prev)
                 : "l"(sh_counters + DtShrink::kColsSummed)
                 : "memory");
    if (prev == cols - 1)  // the last column: its acq_rel acquired the others', so this release covers every column
      asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(sh_counters + DtShrink::kReady), "r"(1) : "memory");
  }
}

// A storing CTA's k-half-1 threads (c = 0 .. 127): once the in-launch shrink's ready flag is up, its bf16 sum (rows
// 0 .. M - 1: one m-tile) into the LoRA region's shrunk rows, as lora_stage_shrunk stages a given `shrunk`.
template <int BM>
__device__ __forceinline__ void dt_stage_shrink_sum(__nv_bfloat16* s_sm, const QerlLoraEpilogue& lora, float* ws,
                                                    const int* sh_counters, int units_per_cta, int S, int M, int c) {
  wait_flag_acquire(sh_counters + DtShrink::kReady);
  QerlLoraEpilogue ep = lora;
  ep.ld_shrunk = lora.n_slices * lora.rank;
  ep.shrunk = dt_shrink_partials(ws, units_per_cta, S, BM) +
              ShrinkPlan::partial_floats(BM, (ep.ld_shrunk + DtShrink::kRows - 1) / DtShrink::kRows, S);
  lora_stage_shrunk<BM, DT_ROWS, true>(s_sm, ep, 0, M, c);
}

// The kernels' body: MODE kNoLora (the plain GEMM), kLoraShrunk (the LoRA expand of a given `shrunk`) or
// kLoraShrinkInLaunch (the shrink in this launch too, from the A_cat tensor map `a_map`).
template <int BM, int MODE>
__device__ __forceinline__ void decode_tma_body(const CUtensorMap& x_map, const uint4* __restrict__ qw,
                                                const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                                const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                                float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                                int units_per_cta, const QerlLoraEpilogue& lora,
                                                const CUtensorMap* a_map) {
  constexpr bool LORA = MODE != kNoLora;
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
    if constexpr (MODE == kLoraShrinkInLaunch)
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(a_map)) : "memory");
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
      // The linear kernel's CTAs j < the shrink's units take unit j first (ring position 0): their GEMM unit i is at
      // ring position i + 1 (pre = 1; 0 everywhere else).
      const bool shrink_here =
          MODE == kLoraShrinkInLaunch && int(blockIdx.x) < DtShrink::units(lora.n_slices * lora.rank, K);
      const int pre = shrink_here ? 1 : 0;
      // The copies of ring position i's unit into its slot: the two activation boxes (`acts`), the weights and scales
      // (`weights`).
      auto copy_unit = [&](int i, bool acts, bool weights) {
        const int slot = i % STAGES;
        const int u = range.begin + i - pre;
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
      if constexpr (MODE == kLoraShrinkInLaunch) {
        if (shrink_here) {  // the same rule for the shrink unit: its A boxes (an adapter weight) before the wait
          const int cols = (lora.n_slices * lora.rank + DtShrink::kRows - 1) / DtShrink::kRows;
          const int k0 = int(blockIdx.x) / cols * DT_BK, r0 = int(blockIdx.x) % cols * DtShrink::kRows;
          tma::mbar_expect_tx(full0, 2 * C::X_HALF_BYTES + 2 * DtShrink::kABoxBytes);
          tma::load_2d(smem_base + C::W_OFF, a_map, full0, k0, r0);
          tma::load_2d(smem_base + C::W_OFF + DtShrink::kABoxBytes, a_map, full0, k0 + tma::kBoxK, r0);
          wait_prior_grid();
          tma::load_2d(smem_base, &x_map, full0, k0, 0);
          tma::load_2d(smem_base + C::X_HALF_BYTES, &x_map, full0, k0 + tma::kBoxK, 0);
          if (n_units > 0) {
            expect_unit(1);
            copy_unit(1, true, true);
          }
        }
      }
      if (pre == 0) {
        if (n_units > 0) {
          expect_unit(0);
          copy_unit(0, false, true);
        }
        wait_prior_grid();
        if (n_units > 0) copy_unit(0, true, false);
      }
      for (int i = 1 + pre; i < n_units + pre; ++i) {
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
  if constexpr (MODE == kLoraShrinkInLaunch) {
    if (int(blockIdx.x) < DtShrink::units(lora.n_slices * lora.rank, K)) {
      dt_shrink_unit<BM>(smem_base, full0, empty0, red, dt_shrink_partials(ws, units_per_cta, S, BM),
                         counters + n_tiles * m_tiles, lora, M, S, tid, s_is_last);
      g = 1;
      consumers_sync();  // red is the k-half sum's from here on
    }
  }
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
        uint32_t b[MT][2];
        x_fragments(b, xa + uint32_t(((2 * j + xq) ^ xsw) * 16));
        mma_k16_step(wv, sv, j, b, acc);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * slot);  // this warp is done with the slot
    }

    // ---- the two k halves: kh = 0 ends with the totals (red is the consumers' own buffer: the ring keeps filling)
    sum_k_halves(acc, red, kh, rt, [] { consumers_sync(); });

    // ---- CTAs sharing this tile combine their partials in CTA order; one of them stores it
    [[maybe_unused]] bool staged = false;  // (linear kernel) the k-half-1 threads staged the shrink's sum already
    const bool do_store = streamk::finish_segment(
        range, counters, tile, tid == 0, s_is_last, [] { consumers_sync(); },
        [&] {
          if (kh == 0)
            store_partial(acc, streamk::partial_slot<BM * DT_ROWS>(ws, blockIdx.x, range.my_slot(tile, my_first_tile)),
                          m0, lane, rt, M);
        },
        [&](int c_first, int c_last) {
          if constexpr (MODE == kLoraShrinkInLaunch) {
            // the storing CTA: its idle k-half-1 threads fetch the shrink's sum while the others read the partials
            if (kh == 1) {
              dt_stage_shrink_sum<BM>(s_sm, lora, ws, counters + n_tiles * m_tiles, units_per_cta, S, M, rt);
              staged = true;
            }
          }
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
        if constexpr (MODE == kLoraShrinkInLaunch) {
          // the in-launch shrink's bf16 sum, unless the fix-up staged it (a whole tile has no fix-up)
          if (kh == 1 && !staged)
            dt_stage_shrink_sum<BM>(s_sm, lora, ws, counters + n_tiles * m_tiles, units_per_cta, S, M, rt);
          consumers_sync();
          if (tid == 0) shrink_sum_read(counters + n_tiles * m_tiles, n_tiles * m_tiles);
        } else {
          if (kh == 1) lora_stage_shrunk<BM, DT_ROWS>(s_sm, lora, m0, M, rt);
          consumers_sync();
        }
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
  decode_tma_body<BM, LORA ? kLoraShrunk : kNoLora>(x_map, qw, qs, gscale, bias, out, ws, counters, M, N, K,
                                                    units_per_cta, lora, nullptr);
#else
  __trap();  // not built for sm_90a: the launcher never starts this kernel (ctas_per_sm = 0)
#endif
}

// The same GEMM with the LoRA expand of the shrink this launch computes (qerl::nvfp4_lora_linear): `lora` with
// lora_a set (`shrunk` is not read), `a_map` A_cat [ranks, K] as boxes of 64 K x 32 rows (128-byte swizzle).
template <int BM>
__global__ void __launch_bounds__(DT_THREADS, DtCfg<BM, true>::CTAS_PER_SM)
    nvfp4_gemm_decode_tma_linear_kernel(const __grid_constant__ CUtensorMap x_map, const uint4* __restrict__ qw,
                                        const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                        const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                        float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                        int units_per_cta, const QerlLoraEpilogue lora,
                                        const __grid_constant__ CUtensorMap a_map) {
#ifdef QERL_WGMMA_DEVICE
  decode_tma_body<BM, kLoraShrinkInLaunch>(x_map, qw, qs, gscale, bias, out, ws, counters, M, N, K, units_per_cta,
                                           lora, &a_map);
#else
  __trap();  // not built for sm_90a: the launcher never starts this kernel (ctas_per_sm = 0)
#endif
}

// (instantiated here, ahead of the other kernels: their SASS keeps its internal labels, sass_census.py --against)
template __global__ void nvfp4_gemm_decode_tma_linear_kernel<8>(const __grid_constant__ CUtensorMap, const uint4*,
                                                               const uint4*, const float*, const __nv_bfloat16*,
                                                               __nv_bfloat16*, float*, int*, int, int, int, int,
                                                               const QerlLoraEpilogue,
                                                               const __grid_constant__ CUtensorMap);
template __global__ void nvfp4_gemm_decode_tma_linear_kernel<16>(const __grid_constant__ CUtensorMap, const uint4*,
                                                                const uint4*, const float*, const __nv_bfloat16*,
                                                                __nv_bfloat16*, float*, int*, int, int, int, int,
                                                                const QerlLoraEpilogue,
                                                                const __grid_constant__ CUtensorMap);

template <int BM, bool LORA>
using DtLauncher =
    tma::Launcher<nvfp4_gemm_decode_tma_kernel<BM, LORA>, BM, DT_THREADS, DtCfg<BM, LORA>::SMEM_BYTES, DT_ROWS>;
template <int BM>
using DtLinearLauncher =
    tma::Launcher<nvfp4_gemm_decode_tma_linear_kernel<BM>, BM, DT_THREADS, DtCfg<BM, true>::SMEM_BYTES, DT_ROWS>;

// Whether the linear kernel's launch takes an in-launch shrink of `ranks` columns: one m-tile (M <= block_m), 1 to
// LORA_MAX_RANKS ranks, and no more shrink units than the launch's CTAs (each computes at most one, before any
// wait: with in-order dispatch of the lowest block indices and a grid the GPU holds at once, the ready flag the
// tiles wait for is always set; NOTES "decode-tma-shrink").
bool shrink_fits(int M, int N, int K, int grid, int block_m, int ranks) {
  if (M <= 0 || M > block_m || N <= 0 || K <= 0 || K % DT_BK != 0 || ranks <= 0 ||
      ranks > DtCfg<16, true>::LORA_MAX_RANKS)
    return false;
  const streamk::Schedule s = streamk::make_schedule(M, N, K, grid, block_m, 1, DT_ROWS);
  return s.ctas > 0 && DtShrink::units(ranks, K) <= s.ctas;
}

template <int BM>
cudaError_t launch(const void* x, const void* qweight, const void* qscale, const float* gscale, const void* bias,
                   void* out, float* ws, int* counters, int M, int N, int K, int grid, const QerlLoraEpilogue* lora,
                   bool pdl, cudaStream_t stream) {
  if (lora == nullptr)
    return DtLauncher<BM, false>::launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream,
                                         pdl, QerlLoraEpilogue{});
  QerlLoraEpilogue norm{};
  if (lora->lora_a == nullptr) {  // the expand of the given `shrunk`
    if (!lora_valid(*lora, N, DtCfg<BM, true>::LORA_MAX_RANKS, &norm)) return cudaErrorInvalidValue;
    return DtLauncher<BM, true>::launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream,
                                        pdl, norm);
  }
  // the shrink in this launch too
  const int ranks = lora->n_slices * lora->rank;
  if (!lora_valid(*lora, N, DtCfg<BM, true>::LORA_MAX_RANKS, &norm, true) || lora->ld_a < K || ws == nullptr ||
      !shrink_fits(M, N, K, grid, BM, ranks))
    return cudaErrorInvalidValue;
  CUtensorMap a_map;
  const cudaError_t e = tma::encode_activations(&a_map, lora->lora_a, ranks, K, DtShrink::kRows, lora->ld_a);
  if (e != cudaSuccess) return e;
  return DtLinearLauncher<BM>::launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream, pdl,
                                      norm, a_map);
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

extern "C" int qerl_nvfp4_gemm_decode_tma_shrink_fits(int M, int N, int K, int grid, int block_m, int ranks) {
  return (block_m == 8 || block_m == 16) && qerl::shrink_fits(M, N, K, grid, block_m, ranks) ? 1 : 0;
}

extern "C" int qerl_nvfp4_gemm_decode_tma_shrink_supported(int M, int N, int K, int grid, int block_m,
                                                          const QerlLoraEpilogue* lora) {
  QerlLoraEpilogue norm{};
  return lora != nullptr && lora->lora_a != nullptr && lora->ld_a >= K &&
                 qerl::lora_valid(*lora, N, qerl::DtCfg<16, true>::LORA_MAX_RANKS, &norm, true) &&
                 qerl_nvfp4_gemm_decode_tma_shrink_fits(M, N, K, grid, block_m, lora->n_slices * lora->rank)
             ? 1
             : 0;
}

// The schedule's answers are the same with and without the LoRA epilogue (its ring depth does not enter them).
extern "C" size_t qerl_nvfp4_gemm_decode_tma_workspace_floats(int M, int N, int K, int grid, int block_m) {
  if (block_m == 8) return qerl::DtLauncher<8, false>::workspace_floats(M, N, K, grid);
  if (block_m == 16) return qerl::DtLauncher<16, false>::workspace_floats(M, N, K, grid);
  return 0;
}

// With lora->lora_a set, the linear kernel's in-launch shrink after those: its partials and bf16 sum (ShrinkPlan,
// one m-tile, a split per K stage) and DtShrink's counters after the tiles'.
extern "C" size_t qerl_nvfp4_gemm_decode_tma_lora_workspace_floats(int M, int N, int K, int grid, int block_m,
                                                                  const QerlLoraEpilogue* lora) {
  if (block_m != 8 && block_m != 16) return 0;
  size_t f = qerl_nvfp4_gemm_decode_tma_workspace_floats(M, N, K, grid, block_m);
  if (lora != nullptr && lora->lora_a != nullptr && K > 0) {
    const int ranks = lora->n_slices * lora->rank;
    f += qerl::ShrinkPlan::floats(block_m, qerl::ShrinkPlan::cols_for(*lora), ranks, K / QERL_GEMM_BK, 1);
  }
  return f;
}

extern "C" int qerl_nvfp4_gemm_decode_tma_lora_counters(int M, int N, int block_m, const QerlLoraEpilogue* lora) {
  const int tiles = qerl_nvfp4_gemm_decode_tma_tiles(M, N, block_m);
  return tiles + (tiles > 0 && lora != nullptr && lora->lora_a != nullptr
                      ? qerl::DtShrink::counters(lora->n_slices * lora->rank)
                      : 0);
}

extern "C" int qerl_nvfp4_gemm_decode_tma_tiles(int M, int N, int block_m) {
  if (block_m == 8) return qerl::DtLauncher<8, false>::tiles(M, N);
  if (block_m == 16) return qerl::DtLauncher<16, false>::tiles(M, N);
  return 0;
}

// Resident CTAs per SM of the plain kernel (lora = 0), the one with the LoRA epilogue (lora = 1) or the linear kernel
// (lora = 2: the shrink in the launch too).
extern "C" int qerl_nvfp4_gemm_decode_tma_ctas_per_sm(int block_m, int lora) {
  if (lora == 2) {
    if (block_m == 8) return qerl::DtLinearLauncher<8>::ctas_per_sm();
    if (block_m == 16) return qerl::DtLinearLauncher<16>::ctas_per_sm();
    return 0;
  }
  if (block_m == 8) return lora ? qerl::DtLauncher<8, true>::ctas_per_sm() : qerl::DtLauncher<8, false>::ctas_per_sm();
  if (block_m == 16)
    return lora ? qerl::DtLauncher<16, true>::ctas_per_sm() : qerl::DtLauncher<16, false>::ctas_per_sm();
  return 0;
}
