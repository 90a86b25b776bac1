// FP4 x BF16 GEMM (W4A16, NVFP4 weights) for sm_80+ (tuned on sm_90): out = x @ W^T (+ bias).
//
// Design (numbers and history in benchmarks/NOTES.md):
//  * Weight-only, memory-bound at decode: the weight is the MMA's A operand (16 rows of N per
//    m16n8k16), activations are B (8 tokens per n8 tile), so M = 1..8 wastes no weight bandwidth.
//  * CTA = 8 warps over a 128 (N) x BM (tokens) output tile: warp w owns N rows [32(w%4), +32) and
//    the k64 half w/4 of every 128-wide stage (two warps per output fragment, summed through smem
//    at the end), so twice the warps per SM at the same shared memory: the small-M kernel is
//    issue/latency-bound, not byte-bound, with 4 warps per CTA (ncu: 8.7 warps/SM, 55% DRAM).
//    K is streamed in stages of 128 through a 4- or 5-deep cp.async ring: 8 KB of FP4 weights (one
//    contiguous block of the repacked layout), 1 KB of scale bytes and BM x 128 bf16 activations
//    per stage, every global load 16 B and coalesced.
//  * Dequantization in registers, no table: a word of the repacked layout becomes an A fragment
//    with rotates/masks (e2m1 * 2^-126 as bf16 bits) and one bf16x2 multiply per register by the
//    block scale pre-biased by 2^119 (built from its byte with one byte_perm and one imad). The
//    fragment holds e2m1 * scale / 128 exactly; FP32 accumulation; the epilogue multiplies by
//    128 / global_scale.
//  * Split-K over CTAs when the tiles alone cannot fill the GPU: each split writes an FP32
//    partial, the last CTA of a tile (atomic counter) sums the partials in split order
//    (deterministic), writes bf16 and re-zeroes its counter, so one launch, no memset.
//  * Optional LoRA expand in the epilogue (template argument LORA, cuda/lora_epilogue.cuh): the tile's LoRA term is
//    added in FP32 before the bf16 rounding. LORA = kNoLora is the kernel without it, instruction for instruction.
//  * Optionally the LoRA shrink too (LORA = kLoraShrinkInLaunch): a separate shrink kernel costs 2.5-5 us per decode
//    GEMM in a CUDA graph for < 1 us of work (NOTES "Sixth round"). The launch carries it as extra CTA columns, the
//    lowest block indices of each split (x fastest): column c computes ranks [32c, 32c + 32) of x @ A_cat^T over the
//    split's K range with the same ring and MMA (A rows as the MMA's A operand, as the weights are) and writes an FP32
//    partial; the last of them to arrive sums all partials in split order, rounds to bf16 into the workspace and sets
//    a ready flag. Each tile's last CTA waits for that flag before its epilogue. Forward progress rests on in-order
//    CTA dispatch (as stream-K fix-ups do): a tile's last CTA has seen its last split's CTA start, whose block index
//    is above every shrink CTA of its m-tile, and shrink CTAs wait on nothing.
#include "lora_epilogue.cuh"
#include "lora_shrink_in_launch.cuh"
#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"

namespace qerl {
namespace {

constexpr int BN = QERL_GEMM_BN;        // output features per CTA
constexpr int BK = QERL_GEMM_BK;        // K per pipeline stage (two 64-wide tiles)
constexpr int THREADS = QERL_GEMM_THREADS;
constexpr int XPAD = 8;                 // bf16 of padding per smem activation row (bank conflicts)
constexpr int XROW_BYTES = (BK + XPAD) * 2;
constexpr int W_STAGE_BYTES = (BN / 16) * (BK / 64) * 512;
constexpr int S_STAGE_BYTES = (BN / 16) * (BK / 64) * 64;

template <int BM>
struct Cfg {
  // Deeper ring for the byte-bound small-M tiles (more bytes in flight per SM), 4 otherwise.
  static constexpr int STAGES = BM <= 16 ? 5 : 4;
  // Register cap only where it costs no spills (the BM >= 32 accumulators need > 128 registers).
  static constexpr int MIN_BLOCKS = BM <= 16 ? 2 : 1;
  static constexpr int MT = BM / 8;  // n8 token tiles
  static constexpr int X_STAGE_BYTES = BM * XROW_BYTES;
  static constexpr int STAGE_BYTES = W_STAGE_BYTES + S_STAGE_BYTES + X_STAGE_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
  // After the ring drains: the k-half reduction buffer (sum_k_halves), then (LORA kernels) the LoRA tile and the
  // tile's rows of `shrunk`, as many ranks per row as the rest of the ring holds.
  static constexpr int RED_BYTES = 2 * MT * 4 * 128 * 4;
  static constexpr int LT_OFFSET = RED_BYTES;
  static constexpr int S_OFFSET = LT_OFFSET + lora_tile_bytes<BM, BN>();
  static constexpr int MAX_LORA_RANKS = (SMEM_BYTES - S_OFFSET) / (BM * 2) / 8 * 8;
  static_assert(MAX_LORA_RANKS >= 96, "the drained ring must hold the LoRA tile and shrunk rows of rank 32 x 3");
};

// The split-K kernel's activation stage: BM rows x BK bf16 of x (rows >= M zero-filled) into a ring slot at byte
// offset W_STAGE_BYTES + S_STAGE_BYTES, rows padded to XROW_BYTES; GEMM and in-launch shrink CTAs load it alike.
template <int BM>
struct XStage {
  static constexpr int CHUNKS = BM * (BK / 8);
  static constexpr int PER = (CHUNKS + THREADS - 1) / THREADS;
  const __nv_bfloat16* src[PER];
  uint32_t dst[PER];
  int bytes[PER];
  __device__ __forceinline__ XStage(const __nv_bfloat16* x, int M, int K, int m0, int s_begin, int tid) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = tid + i * THREADS;
      const int row = c / (BK / 8), ch = c % (BK / 8);
      const bool valid = (CHUNKS % THREADS == 0 || c < CHUNKS) && (m0 + row < M);
      src[i] = x + size_t(valid ? m0 + row : 0) * K + size_t(s_begin) * BK + ch * 8;
      dst[i] = W_STAGE_BYTES + S_STAGE_BYTES + row * XROW_BYTES + ch * 16;
      bytes[i] = valid ? 16 : 0;
    }
  }
  __device__ __forceinline__ void load(uint32_t slot, int s_rel, int tid) const {
#pragma unroll
    for (int i = 0; i < PER; ++i)
      if (CHUNKS % THREADS == 0 || tid + i * THREADS < CHUNKS)
        cp_async16_u32(slot + dst[i], src[i] + size_t(s_rel) * BK, bytes[i]);
  }
  // The MMA's B fragments (tokens as n) of the k16 step at column kk of the stage's activations `xs`.
  __device__ __forceinline__ static void fragments(const uint8_t* xs, int kk, int lane, uint32_t (&b)[BM / 8][2]) {
    if constexpr (BM / 8 == 1) {
      const uint8_t* p = xs + (lane & 7) * XROW_BYTES + (kk + ((lane >> 3) & 1) * 8) * 2;
      ldmatrix_x2(b[0][0], b[0][1], p);
    } else {
#pragma unroll
      for (int mp = 0; mp < BM / 16; ++mp) {
        const int row = (2 * mp + (lane >> 4)) * 8 + (lane & 7);
        const uint8_t* p = xs + row * XROW_BYTES + (kk + ((lane >> 3) & 1) * 8) * 2;
        ldmatrix_x4(b[2 * mp][0], b[2 * mp][1], b[2 * mp + 1][0], b[2 * mp + 1][1], p);
      }
    }
  }
};

// One in-launch shrink CTA (column `col`, one split's K range): ranks [32 col, 32 col + 32) of x @ A_cat^T for the
// m-tile's BM tokens. Ring slots hold 32 A rows x BK bf16 where the GEMM holds its weights (16-byte chunk ch of row r
// at r * 256 + (ch ^ (r % 8)) * 16: the ldmatrix rows of one fragment fall in 8 different bank groups) and the
// activations where the GEMM has them. Warp w: ranks 16 (w % 2) .., the k32 quarter w / 2 of each stage; the four
// quarters are summed through shared memory in a fixed order, then the FP32 partial goes to `part` (row t at t * 32).
// The last shrink CTA of the m-tile (counter `arrived`) sums every split's and column's partial in split order, rounds
// to bf16 into `sum` [BM, ranks] and releases `ready`.
template <int BM>
__device__ __forceinline__ void shrink_cta(const __nv_bfloat16* __restrict__ x, const QerlLoraEpilogue& lora,
                                           float* part_base, __nv_bfloat16* sum, int* arrived, int* ready, int M,
                                           int K, int splits, int split, int s_begin, int s_count, int col, int m0,
                                           uint8_t* smem, int& s_flag) {
  using C = Cfg<BM>;
  constexpr int MT = C::MT;
  constexpr int RPC = QERL_LORA_SHRINK_RANKS_PER_CTA;
  static_assert(RPC == 32 && (RPC * BK * 2) / 16 == 2 * THREADS, "two 16-byte A chunks per thread per stage");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ranks = lora.n_slices * lora.rank;
  const int cols = (ranks + RPC - 1) / RPC;
  const __nv_bfloat16* a = static_cast<const __nv_bfloat16*>(lora.lora_a);
  const __nv_bfloat16* asrc[2];
  uint32_t adst[2];
  int abytes[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = tid + i * THREADS, row = c >> 4, ch = c & 15;
    const bool valid = col * RPC + row < ranks;
    asrc[i] = a + size_t(valid ? col * RPC + row : 0) * lora.ld_a + size_t(s_begin) * BK + ch * 8;
    adst[i] = row * (BK * 2) + ((ch ^ (row & 7)) << 4);
    abytes[i] = valid ? 16 : 0;
  }
  const XStage<BM> xstage(x, M, K, m0, s_begin, tid);
  const uint32_t smem_base = smem_u32(smem);
  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[mt][c] = 0.0f;
  const int h = warp & 1, kq = warp >> 1;
  auto load_a = [&](int buf, int s_rel) {
    const uint32_t slot = smem_base + buf * C::STAGE_BYTES;
#pragma unroll
    for (int i = 0; i < 2; ++i) cp_async16_u32(slot + adst[i], asrc[i] + size_t(s_rel) * BK, abytes[i]);
  };
  auto load_x = [&](int buf, int s_rel) { xstage.load(smem_base + buf * C::STAGE_BYTES, s_rel, tid); };
  auto compute = [&](int buf) {
    const uint32_t slot = smem_base + buf * C::STAGE_BYTES;
    const uint8_t* xs = smem + buf * C::STAGE_BYTES + W_STAGE_BYTES + S_STAGE_BYTES;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int kk = kq * 32 + j * 16;
      const int row = h * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const int chunk = (kk >> 3) + (lane >> 4);
      uint32_t af[4];
      ldmatrix_x4_u32(af[0], af[1], af[2], af[3], slot + row * (BK * 2) + ((chunk ^ (row & 7)) << 4));
      uint32_t b[MT][2];
      XStage<BM>::fragments(xs, kk, lane, b);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_bf16(acc[mt], af, b[mt]);
    }
  };
  run_cp_async_ring_after_prior<C::STAGES>(s_count, load_a, load_x, compute);

  // The four k quarters of each 16-rank half, in quarter order, into this unit's partial.
  store_shrink_partial<BM, THREADS>(acc, reinterpret_cast<float*>(smem), part_base, size_t(split) * cols + col, tid,
                                    [] { __syncthreads(); });
  // Publish; the last shrink CTA of the m-tile acquires every partial and sums them.
  if (!arrive_last(arrived, 0, splits * cols, tid, s_flag)) return;
  const int rows = min(BM, M - m0);
  for (int e = tid; e < rows * ranks; e += THREADS) {
    const int t = e / ranks, j = e % ranks;
    const float* p = part_base + size_t(j / RPC) * (BM * RPC) + t * RPC + (j % RPC);
    float v = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) v += __ldcg(p + size_t(s) * cols * (BM * RPC));
    sum[e] = __float2bfloat16_rn(v);
  }
  __syncthreads();
  if (tid == 0) asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ready), "r"(1) : "memory");
}

template <int BM, int LORA>
__global__ void __launch_bounds__(THREADS, Cfg<BM>::MIN_BLOCKS)
    nvfp4_gemm_splitk_kernel(const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ qw,
                      const uint4* __restrict__ qs, const float* __restrict__ gscale,
                      const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                      float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                      int splits, const QerlLoraEpilogue lora) {
  using C = Cfg<BM>;
  constexpr int MT = C::MT;
  constexpr int STAGES = C::STAGES;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_is_last;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wn = warp & 3;   // 32-row group of the 128-row tile
  const int kh = warp >> 2;  // k64 half of each stage
  const int rt = wn * 32 + lane;  // index among the 128 threads holding one output fragment set
  const int shrink_cols = LORA == kLoraShrinkInLaunch ? ShrinkPlan::cols_for(lora) : 0;
  const int n_tiles = gridDim.x - shrink_cols;
  const int ntile = blockIdx.x - shrink_cols;
  const int split = blockIdx.y;
  const int mtile = blockIdx.z;
  const int stages_total = K / BK;
  const int q = stages_total / splits;
  const int rem = stages_total % splits;
  const int s_begin = split * q + min(split, rem);
  const int s_count = q + (split < rem ? 1 : 0);
  const int nb0 = ntile * (BN / 16);
  const int m0 = mtile * BM;
  // The in-launch shrink's buffers for this m-tile (ShrinkPlan) and its three counters after the tiles' own: shrink
  // CTAs arrived, sum ready, tiles done with it.
  [[maybe_unused]] float* sh_part = nullptr;
  [[maybe_unused]] __nv_bfloat16* sh_sum = nullptr;
  [[maybe_unused]] int* sh_counters = nullptr;
  if constexpr (LORA == kLoraShrinkInLaunch) {
    const int ranks = lora.n_slices * lora.rank;
    const size_t part_floats = splits > 1 ? size_t(n_tiles) * gridDim.z * splits * (BM * BN) : 0;
    float* base = ws + part_floats +
                  size_t(mtile) * (ShrinkPlan::partial_floats(BM, shrink_cols, splits) + ShrinkPlan::sum_floats(BM, ranks));
    sh_part = base;
    sh_sum = reinterpret_cast<__nv_bfloat16*>(base + ShrinkPlan::partial_floats(BM, shrink_cols, splits));
    sh_counters = counters + n_tiles * gridDim.z + 3 * mtile;
    if (ntile < 0) {
      shrink_cta<BM>(x, lora, sh_part, sh_sum, sh_counters, sh_counters + 1, M, K, splits, split, s_begin, s_count,
                     blockIdx.x, m0, smem, s_is_last);
      return;
    }
  }
  if constexpr (LORA != kNoLora) {
    if (split == 0) lora_prefetch_b<BN, THREADS>(lora, nb0 * 16, N, tid);
  }

  float acc[2][MT][4];
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < MT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;

  // Stage-contiguous repacked layout: this CTA's stage s is 8 KB of weights at
  // qw[(ntile * stages_total + s) * 512 ...] and 1 KB of scales at qs[(...) * 64 ...].
  const uint4* wsrc = qw + (size_t(ntile) * stages_total + s_begin) * (W_STAGE_BYTES / 16) + tid;
  const uint4* ssrc = qs + (size_t(ntile) * stages_total + s_begin) * (S_STAGE_BYTES / 16) + tid;
  const XStage<BM> xstage(x, M, K, m0, s_begin, tid);
  const uint32_t smem_base = smem_u32(smem);

  // A stage's weights and scales (read before wait_prior_grid: see launch_kernel), then its activations.
  auto load_weights = [&](int buf, int s_rel) {
    const uint32_t base = smem_base + buf * C::STAGE_BYTES;
    const uint4* w = wsrc + size_t(s_rel) * (W_STAGE_BYTES / 16);
#pragma unroll
    for (int i = 0; i < W_STAGE_BYTES / 16 / THREADS; ++i)
      cp_async16_u32(base + (tid + i * THREADS) * 16, w + i * THREADS, 16);
    if (tid < S_STAGE_BYTES / 16)
      cp_async16_u32(base + W_STAGE_BYTES + tid * 16, ssrc + size_t(s_rel) * (S_STAGE_BYTES / 16), 16);
  };
  auto load_acts = [&](int buf, int s_rel) { xstage.load(smem_base + buf * C::STAGE_BYTES, s_rel, tid); };

  auto compute_stage = [&](int buf) {
    const uint8_t* base = smem + buf * C::STAGE_BYTES;
    const uint4* wsm = reinterpret_cast<const uint4*>(base);
    const uint2* ssm = reinterpret_cast<const uint2*>(base + W_STAGE_BYTES);
    const uint8_t* xs = base + W_STAGE_BYTES + S_STAGE_BYTES;
    uint4 wv[2];
    uint2 sv[2];
    load_warp_blocks(wsm, ssm, wn, kh, lane, wv, sv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int kk = kh * 64 + j * 16;
      uint32_t b[MT][2];
      XStage<BM>::fragments(xs, kk, lane, b);
      mma_k16_step(wv, sv, j, b, acc);
    }
  };

  // ---- main loop: STAGES-deep cp.async ring, stage 0's weights in flight before the wait for the prior grid (a no-op
  // unless launched with PDL); then the drained ring sums the two k halves
  run_cp_async_ring_after_prior<STAGES>(s_count, load_weights, load_acts, compute_stage);
  sum_k_halves(acc, reinterpret_cast<float*>(smem), kh, rt, [] { __syncthreads(); });

  // ---- split-K: publish the partial, the last CTA of the tile reduces in split order
  if (splits > 1) {
    const int tile_id = mtile * n_tiles + ntile;
    float* tile_ws = ws + size_t(tile_id) * splits * (BM * BN);
    if (kh == 0) store_partial(acc, reinterpret_cast<float4*>(tile_ws + size_t(split) * (BM * BN)), m0, lane, rt, M);
    if (!arrive_last(counters, tile_id, splits, tid, s_is_last)) return;  // it acquired the other splits' partials
    // Sum all partials (this CTA's too) in split order: deterministic whichever CTA is last.
    // Loads are issued RB splits at a time so they overlap instead of paying one L2 round trip
    // per split.
    constexpr int NV = 2 * MT;
    constexpr int RB = MT <= 2 ? 8 : (MT == 4 ? 4 : 2);
    float4 sum[NV];
#pragma unroll
    for (int q = 0; q < NV; ++q) sum[q] = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* parts = reinterpret_cast<const float4*>(tile_ws);
    for (int s0 = 0; s0 < splits; s0 += RB) {
      float4 v[RB][NV];
#pragma unroll
      for (int r = 0; r < RB; ++r)
#pragma unroll
        for (int q = 0; q < NV; ++q)
          v[r][q] = (kh == 0 && s0 + r < splits && m0 + (q % MT) * 8 + (lane & 3) * 2 < M)
                        ? __ldcg(parts + size_t(s0 + r) * (BM * BN / 4) + q * 128 + rt)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int r = 0; r < RB; ++r)
#pragma unroll
        for (int q = 0; q < NV; ++q) {
          sum[q].x += v[r][q].x;
          sum[q].y += v[r][q].y;
          sum[q].z += v[r][q].z;
          sum[q].w += v[r][q].w;
        }
    }
#pragma unroll
    for (int nbw = 0; nbw < 2; ++nbw)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float4 t = sum[nbw * MT + mt];
        acc[nbw][mt][0] = t.x;
        acc[nbw][mt][1] = t.y;
        acc[nbw][mt][2] = t.z;
        acc[nbw][mt][3] = t.w;
      }
    if (tid == 0) counters[tile_id] = 0;  // every split has arrived: ready for the next launch
  }

  // The LoRA tile is built by the kh = 1 warps, idle from here on (with several splits they pass the partial sum
  // above without loads, so this overlaps the kh = 0 warps' partial loads), in the drained ring behind the
  // reduction buffer.
  // The B rows' first chunks go into registers before the shrunk rows are staged (two L2 round trips in parallel).
  [[maybe_unused]] LoraBFrags b_pre;
  if constexpr (LORA != kNoLora) {
    if (kh == 1) lora_load_b_frags(b_pre, lora, nb0 * 16, N, rt);
  }
  if constexpr (LORA == kLoraShrunk) {
    __nv_bfloat16* s_sm = reinterpret_cast<__nv_bfloat16*>(smem + C::S_OFFSET);
    if (kh == 1) lora_stage_shrunk<BM, BN>(s_sm, lora, m0, M, rt);
    __syncthreads();
    if (kh == 1)
      lora_tile<BM, BN, true>(reinterpret_cast<float*>(smem + C::LT_OFFSET), s_sm, lora, nb0 * 16, m0, M, N, rt,
                              &b_pre);
    __syncthreads();
  } else if constexpr (LORA == kLoraShrinkInLaunch) {
    // The shrink's bf16 sum (this m-tile's rows, row t at t * ranks) once its last CTA released it.
    __nv_bfloat16* s_sm = reinterpret_cast<__nv_bfloat16*>(smem + C::S_OFFSET);
    QerlLoraEpilogue ep = lora;
    ep.shrunk = sh_sum;
    ep.ld_shrunk = lora.n_slices * lora.rank;
    if (kh == 1) {
      wait_flag_acquire(sh_counters + 1);
      lora_stage_shrunk<BM, BN, true>(s_sm, ep, 0, min(BM, M - m0), rt);
    }
    __syncthreads();
    if (kh == 1)
      lora_tile<BM, BN, true>(reinterpret_cast<float*>(smem + C::LT_OFFSET), s_sm, ep, nb0 * 16, m0, M, N, rt, &b_pre);
    // The last tile of the m-tile to get here has every tile's reads of the sum behind it: it zeroes the counters
    // for the next launch.
    if (tid == 0) shrink_sum_read(sh_counters, n_tiles);
    __syncthreads();
  }
  if (kh != 0) return;
  // ---- epilogue: scale by 128 / global_scale, add bias (and the LoRA tile), store bf16
  if constexpr (LORA != kNoLora) {
    store_bf16(acc, out, bias, __fdiv_rn(128.0f, __ldg(gscale)), nb0 + wn * 2, m0, lane, M, N,
               LoraTile<BN>{reinterpret_cast<const float*>(smem + C::LT_OFFSET), nb0 * 16});
  } else {
    store_bf16(acc, out, bias, __fdiv_rn(128.0f, __ldg(gscale)), nb0 + wn * 2, m0, lane, M, N);
  }
}

template <int BM, int LORA = kNoLora>
cudaError_t prepare() {
  static bool done[64] = {};  // per device and kernel; benign race: the attribute call is idempotent
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 0 || dev >= 64 || !done[dev]) {
    e = cudaFuncSetAttribute(nvfp4_gemm_splitk_kernel<BM, LORA>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Cfg<BM>::SMEM_BYTES);
    if (e != cudaSuccess) return e;
    if (dev >= 0 && dev < 64) done[dev] = true;
  }
  return cudaSuccess;
}

template <int BM, int LORA>
cudaError_t launch_as(const void* x, const void* qweight, const void* qscale, const float* gscale,
                      const void* bias, void* out, float* ws, int* counters, int M, int N, int K, int splits,
                      const QerlLoraEpilogue& lora, bool pdl, cudaStream_t stream) {
  cudaError_t e = prepare<BM, LORA>();
  if (e != cudaSuccess) return e;
  const int n_tiles = (N + BN - 1) / BN;
  const int m_tiles = (M + BM - 1) / BM;
  const int shrink_cols = LORA == kLoraShrinkInLaunch ? ShrinkPlan::cols_for(lora) : 0;
  e = launch_kernel(nvfp4_gemm_splitk_kernel<BM, LORA>, dim3(shrink_cols + n_tiles, splits, m_tiles), dim3(THREADS),
                    Cfg<BM>::SMEM_BYTES, stream, pdl, static_cast<const __nv_bfloat16*>(x),
                    static_cast<const uint4*>(qweight), static_cast<const uint4*>(qscale), gscale,
                    static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(out), ws, counters, M, N, K,
                    splits, lora);
  return e != cudaSuccess ? e : cudaGetLastError();
}

template <int BM>
cudaError_t launch(const void* x, const void* qweight, const void* qscale, const float* gscale,
                   const void* bias, void* out, float* ws, int* counters, int M, int N, int K, int splits,
                   const QerlLoraEpilogue* lora, bool pdl, cudaStream_t stream) {
  if (lora == nullptr)
    return launch_as<BM, kNoLora>(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, splits,
                                  QerlLoraEpilogue{}, pdl, stream);
  // LoRA kernels exist only up to QERL_LORA_EPILOGUE_MAX_BLOCK_M tokens per tile (qerl_nvfp4_gemm_lora_supported)
  if constexpr (BM <= QERL_LORA_EPILOGUE_MAX_BLOCK_M) {
    if (lora->lora_a != nullptr)
      return launch_as<BM, kLoraShrinkInLaunch>(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, splits,
                                                *lora, pdl, stream);
    return launch_as<BM, kLoraShrunk>(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, splits, *lora,
                                      pdl, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}

// Most shrunk columns (n_slices x rank) the LoRA epilogue of the BM kernel stages in its drained ring (0: no kernel).
int lora_max_ranks(int block_m) {
  switch (block_m) {
    case 8:
      return Cfg<8>::MAX_LORA_RANKS;
    case 16:
      return Cfg<16>::MAX_LORA_RANKS;
    case 32:
      return Cfg<32>::MAX_LORA_RANKS;
    case 64:
      return Cfg<64>::MAX_LORA_RANKS;
    default:
      return 0;
  }
}

template <int BM>
int ctas_per_sm() {
  if (prepare<BM>() != cudaSuccess) return 0;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, nvfp4_gemm_splitk_kernel<BM, kNoLora>, THREADS,
                                                    Cfg<BM>::SMEM_BYTES) !=
      cudaSuccess)
    return 0;
  return n;
}

}  // namespace
}  // namespace qerl

extern "C" int qerl_nvfp4_gemm_lora_supported(int N, int block_m, const QerlLoraEpilogue* lora) {
  QerlLoraEpilogue norm{};
  return lora != nullptr && N > 0 && block_m <= QERL_LORA_EPILOGUE_MAX_BLOCK_M &&
                 qerl::lora_valid(*lora, N, qerl::lora_max_ranks(block_m), &norm, true)
             ? 1
             : 0;
}

extern "C" size_t qerl_nvfp4_gemm_lora_workspace_floats(int M, int N, int splits, int block_m,
                                                       const QerlLoraEpilogue* lora) {
  size_t f = qerl_nvfp4_gemm_workspace_floats(M, N, splits, block_m);
  if (lora != nullptr && lora->lora_a != nullptr && M > 0 && block_m > 0 && splits > 0) {
    const int cols = qerl::ShrinkPlan::cols_for(*lora);
    f += qerl::ShrinkPlan::floats(block_m, cols, lora->n_slices * lora->rank, splits, (M + block_m - 1) / block_m);
  }
  return f;
}

extern "C" int qerl_nvfp4_gemm_lora_shrink_cols(const QerlLoraEpilogue* lora) {
  return lora != nullptr && lora->lora_a != nullptr ? qerl::ShrinkPlan::cols_for(*lora) : 0;
}

extern "C" int qerl_nvfp4_gemm_lora_counters(int M, int N, int block_m, const QerlLoraEpilogue* lora) {
  if (M <= 0 || N <= 0 || block_m <= 0) return 0;
  const int n_tiles = (N + QERL_GEMM_BN - 1) / QERL_GEMM_BN;
  const int m_tiles = (M + block_m - 1) / block_m;
  return n_tiles * m_tiles + (lora != nullptr && lora->lora_a != nullptr ? 3 * m_tiles : 0);
}

extern "C" cudaError_t qerl_nvfp4_gemm_lora_launch(const void* x, const void* qweight, const void* qscale,
                                                   const float* global_scale, const void* bias, void* out,
                                                   float* workspace, int* counters, int M, int N, int K, int splits,
                                                   int block_m, const QerlLoraEpilogue* lora, int pdl,
                                                   cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || K % QERL_GEMM_BK != 0 || N % 16 != 0 || splits < 1 ||
      splits > K / QERL_GEMM_BK)
    return cudaErrorInvalidValue;
  const bool in_launch_shrink = lora != nullptr && lora->lora_a != nullptr;
  if ((splits > 1 || in_launch_shrink) && (workspace == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
  QerlLoraEpilogue norm{};
  if (lora != nullptr && (block_m > QERL_LORA_EPILOGUE_MAX_BLOCK_M ||
                          !qerl::lora_valid(*lora, N, qerl::lora_max_ranks(block_m), &norm, true)))
    return cudaErrorInvalidValue;
  // The shrink CTAs read K columns of each A row: its rows must be at least that long.
  if (in_launch_shrink && lora->ld_a < K) return cudaErrorInvalidValue;
  const QerlLoraEpilogue* ep = lora != nullptr ? &norm : nullptr;
  switch (block_m) {
    case 8:
      return qerl::launch<8>(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, splits, ep,
                             pdl != 0, stream);
    case 16:
      return qerl::launch<16>(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, splits, ep,
                              pdl != 0, stream);
    case 32:
      return qerl::launch<32>(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, splits, ep,
                              pdl != 0, stream);
    case 64:
      return qerl::launch<64>(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, splits, ep,
                              pdl != 0, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t qerl_nvfp4_gemm_launch(const void* x, const void* qweight, const void* qscale,
                                              const float* global_scale, const void* bias, void* out,
                                              float* workspace, int* counters, int M, int N, int K,
                                              int splits, int block_m, cudaStream_t stream) {
  return qerl_nvfp4_gemm_lora_launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K,
                                     splits, block_m, nullptr, 0, stream);
}

extern "C" size_t qerl_nvfp4_gemm_workspace_floats(int M, int N, int splits, int block_m) {
  if (splits <= 1) return 0;
  const size_t n_tiles = (N + QERL_GEMM_BN - 1) / QERL_GEMM_BN;
  const size_t m_tiles = (M + block_m - 1) / block_m;
  return n_tiles * m_tiles * size_t(splits) * size_t(block_m) * QERL_GEMM_BN;
}

extern "C" int qerl_nvfp4_gemm_ctas_per_sm(int block_m) {
  switch (block_m) {
    case 8:
      return qerl::ctas_per_sm<8>();
    case 16:
      return qerl::ctas_per_sm<16>();
    case 32:
      return qerl::ctas_per_sm<32>();
    case 64:
      return qerl::ctas_per_sm<64>();
    default:
      return 0;
  }
}
