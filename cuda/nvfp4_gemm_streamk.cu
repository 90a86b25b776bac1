// FP4 x BF16 GEMM (W4A16, NVFP4 weights), medium-M kernel: persistent stream-K, 256-row tiles.
// block_m 32 / 64 only. The op's auto mode (cuda/qerl_torch.cpp, streamk_pays) runs it where its tiles number
// >= 0.25 x its CTAs or each CTA's range is >= 24 K stages (the H200 calibration in benchmarks/NOTES.md), and
// nvfp4_gemm.cu (split-K) elsewhere; QERL_GEMM_KERNEL=splitk|streamk forces one.
//
// Why a second kernel (ncu numbers in benchmarks/NOTES.md, "v5.5"; v5 there is the split-K kernel): at M = 64
// split-K is bound by shared-memory traffic and latency, not by the tensor pipe. Each split-K warp owns 32 weight rows, so per k16 step it issues
// 4 ldmatrix.x4 of activations for only 16 MMAs, and its 296 N-tiles each re-read all activations from L2;
// 4.5 waves of CTAs leave a partial last wave and every split-K CTA pays a fence. Here:
//  * CTA tile = 256 weight rows x BM tokens, 8 warps: warp w owns rows [64 (w % 4), +64) (4 n16 blocks) and
//    the k64 half w / 4 of every 128-wide stage (the two halves are summed through smem, as in split-K). Per k16
//    step a warp issues BM/16 ldmatrix.x4 for 4 * BM/8 MMAs: twice split-K's MMAs per activation load, and half
//    the tiles re-reading activations from L2.
//  * The repacked layout is read unchanged: a 256-row tile is the two consecutive 128-row tiles 2t, 2t+1
//    (per stage two 8 KB weight blocks and two 1 KB scale blocks). When 2t+1 does not exist (N % 256 in
//    (0, 128]) its half is neither loaded nor computed; rows >= N are never stored.
//  * A 6-deep (BM = 64) / 8-deep (BM = 32) cp.async ring of ~212 KB: one CTA per SM, twice split-K's bytes in flight.
//  * Persistent stream-K: the grid is (SMs x CTAs/SM); the flattened (m_tile, n_tile, k_stage) unit space is
//    cut into equal contiguous ranges of `units_per_cta`, one per CTA, so every SM gets the same number of
//    stages whatever the tile count (no partial wave). A CTA walks the tile segments of its range. A segment
//    that is a whole tile stores bf16 directly; a partial one writes an FP32 partial to workspace slot
//    (CTA, 0 = the first tile of its range / 1 = its last tile) and the last segment of the tile to arrive
//    (atomic counter, re-zeroed by it) sums every partial of the tile in CTA order (deterministic whichever
//    CTA arrives last) and runs the epilogue. A CTA writes at most 2 partials (its middle tiles are whole),
//    so the workspace is 2 x CTAs x BM x 256 floats (qerl_nvfp4_gemm_streamk_workspace_floats, from schedule()).
//  * Epilogue math identical to split-K: acc * (128 / global_scale) + bias -> bf16, only rows < M and < N.
// Known cost kept in this version: the ring drains at each segment boundary (about 2 segments per CTA at
// the 7B gate_up shape), one pipeline refill each.
#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"
#include "streamk_schedule.cuh"

namespace qerl {
namespace {

constexpr int BN = streamk::kTileRows;  // 256 weight rows per CTA tile (two tiles of the repacked layout)
constexpr int BK = streamk::kStageK;    // K per pipeline stage
constexpr int THREADS = QERL_GEMM_THREADS;
constexpr int XPAD = 8;  // bf16 of padding per smem activation row (ldmatrix without bank conflicts)
constexpr int XROW_BYTES = (BK + XPAD) * 2;
constexpr int HALF_W_BYTES = (QERL_GEMM_BN / 16) * (BK / 64) * 512;  // one 128-row tile, one stage
constexpr int HALF_S_BYTES = (QERL_GEMM_BN / 16) * (BK / 64) * 64;
constexpr int W_STAGE_BYTES = 2 * HALF_W_BYTES;
constexpr int S_STAGE_BYTES = 2 * HALF_S_BYTES;
constexpr int HALF_W_VEC = HALF_W_BYTES / 16;  // uint4 per half-tile stage of weights
constexpr int HALF_S_VEC = HALF_S_BYTES / 16;

template <int BM>
struct SkCfg {
  static constexpr int MT = BM / 8;  // n8 token tiles
  static constexpr int X_STAGE_BYTES = BM * XROW_BYTES;
  static constexpr int STAGE_BYTES = W_STAGE_BYTES + S_STAGE_BYTES + X_STAGE_BYTES;
  // As deep as fits in ~212 KB (Hopper allows 227 KB per CTA): 6 x 35 KB at BM = 64, 8 x 26.5 KB at 32.
  static constexpr int STAGES = BM == 64 ? 6 : 8;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
  // k-half reduction buffer (reuses the drained ring): 4 n16 blocks x MT x 4 floats x 128 threads.
  static constexpr int RED_BYTES = 4 * MT * 4 * 128 * 4;
  static_assert(BM == 32 || BM == 64, "stream-K kernel: block_m 32 or 64");
  static_assert(RED_BYTES <= SMEM_BYTES, "reduction buffer must fit in the ring");
  static_assert(SMEM_BYTES <= 227 * 1024, "ring larger than Hopper's per-CTA shared memory");
};

// The two k-half warps of an output fragment set (kh = 0 / 1, same rt) each end up with the totals of half of
// its 4 n16 blocks: warp half kh keeps blocks 2 kh, 2 kh + 1, summed into acc[0], acc[1] (acc[2], acc[3] are
// dead afterwards). Each half writes the other half's blocks to `red` (4 * MT * 4 * 128 floats of drained
// shared memory), one barrier, then adds what the other half wrote for its own blocks.
template <int MT>
__device__ __forceinline__ void sum_k_halves_split(float (&acc)[4][MT][4], float* red, int kh, int rt) {
  float* to_other = red + (1 - kh) * (2 * MT * 4 * 128);
  const float* from_other = red + kh * (2 * MT * 4 * 128);
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int c = 0; c < 4; ++c) to_other[((nb * MT + mt) * 4 + c) * 128 + rt] = kh ? acc[nb][mt][c] : acc[nb + 2][mt][c];
  __syncthreads();
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        acc[nb][mt][c] = (kh ? acc[nb + 2][mt][c] : acc[nb][mt][c]) + from_other[((nb * MT + mt) * 4 + c) * 128 + rt];
}

template <int BM>
__global__ void __launch_bounds__(THREADS, 1)
    nvfp4_gemm_streamk_kernel(const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ qw,
                              const uint4* __restrict__ qs, const float* __restrict__ gscale,
                              const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                              float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                              int units_per_cta) {
  using C = SkCfg<BM>;
  constexpr int MT = C::MT;
  constexpr int STAGES = C::STAGES;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_is_last;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wn = warp & 3;   // 64-row group of the 256-row tile
  const int kh = warp >> 2;  // k64 half of each stage
  const int half = wn >> 1;  // which 128-row tile of the repacked layout this warp reads
  const int rt = wn * 32 + lane;  // index among the 128 threads holding one output fragment set

  const int S = K / BK;  // stages per tile
  const int tiles_128 = (N + QERL_GEMM_BN - 1) / QERL_GEMM_BN;
  const int n_tiles = (N + BN - 1) / BN;
  const int m_tiles = (M + BM - 1) / BM;
  const streamk::CtaRange range(n_tiles * m_tiles * S, S, units_per_cta);
  const int my_first_tile = range.first_tile();
  const uint32_t smem_base = smem_u32(smem);

  constexpr int XCHUNKS = BM * (BK / 8);
  constexpr int XPER = XCHUNKS / THREADS;
  static_assert(XCHUNKS % THREADS == 0, "activation chunks per thread");

  for (int u = range.begin; u < range.end;) {
    const streamk::Segment seg = range.segment_at(u);
    const int tile = seg.tile;
    const int kb = seg.kb;
    const int count = seg.count();
    const int mtile = tile / n_tiles;
    const int ntile = tile - mtile * n_tiles;
    const int m0 = mtile * BM;
    const bool has_hi = 2 * ntile + 1 < tiles_128;  // the second 128-row half exists
    const bool active = half == 0 || has_hi;        // warp-uniform

    float acc[4][MT][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < MT; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;

    // Stage-contiguous layout: tile 2*ntile + h, stage s is at qw[((2*ntile + h) * S + s) * HALF_W_VEC].
    // Source addresses are formed once per segment and advanced by a constant per stage: the first build
    // recomputed them from (tile, h, row, chunk) at every stage (~170 integer instructions per stage and warp,
    // an S2R of the CTA id per stage; SASS in benchmarks/NOTES.md "v5.5 outcome").
    static_assert(HALF_W_VEC == 2 * THREADS, "weights: thread t copies chunks t, t + 256 of each 128-row half");
    static_assert(S_STAGE_BYTES / 16 <= THREADS, "scales: one chunk per thread at most");
    static_assert(BK / 8 == 16 && THREADS % 16 == 0, "activations: thread t copies chunk t % 16 of rows t / 16 + 16 i");
    const size_t half_w_stride = size_t(S) * HALF_W_VEC;
    const uint4* w_thr = qw + (size_t(2 * ntile) * S + kb) * HALF_W_VEC + tid;
    const int s_h = tid / HALF_S_VEC;  // scale chunk's half (threads >= S_STAGE_BYTES / 16 copy none)
    const bool s_copies = tid < S_STAGE_BYTES / 16 && (s_h == 0 || has_hi);
    const uint4* s_thr =
        qs + (size_t(2 * ntile + s_h) * S + kb) * HALF_S_VEC + (tid % HALF_S_VEC);
    const int x_row0 = tid / (BK / 8);              // this thread's first activation row in the tile
    const int x_rows_left = M - m0 - x_row0;        // rows x_row0 + 16 i exist while 16 i < x_rows_left
    const __nv_bfloat16* x_thr = x + size_t(m0 + x_row0) * K + size_t(kb) * BK + (tid % (BK / 8)) * 8;
    const size_t x_row_step = size_t(THREADS / (BK / 8)) * K;  // 16 rows
    const uint32_t x_dst0 = W_STAGE_BYTES + S_STAGE_BYTES + x_row0 * XROW_BYTES + (tid % (BK / 8)) * 16;

    auto load_stage = [&](int buf, int s_rel) {
      const uint32_t base = smem_base + buf * C::STAGE_BYTES;
      const uint4* w = w_thr + size_t(s_rel) * HALF_W_VEC;
      cp_async16_u32(base + tid * 16, w, 16);
      cp_async16_u32(base + (tid + THREADS) * 16, w + THREADS, 16);
      if (has_hi) {
        cp_async16_u32(base + HALF_W_BYTES + tid * 16, w + half_w_stride, 16);
        cp_async16_u32(base + HALF_W_BYTES + (tid + THREADS) * 16, w + half_w_stride + THREADS, 16);
      }
      if (s_copies) cp_async16_u32(base + W_STAGE_BYTES + tid * 16, s_thr + size_t(s_rel) * HALF_S_VEC, 16);
      const __nv_bfloat16* xs = x_thr + size_t(s_rel) * BK;
#pragma unroll
      for (int i = 0; i < XPER; ++i) {
        const bool valid = i * (THREADS / (BK / 8)) < x_rows_left;
        // a missing token row is zero-filled (src-size 0: nothing is read; x itself stands in as the address)
        cp_async16_u32(base + x_dst0 + i * (THREADS / (BK / 8)) * XROW_BYTES, valid ? xs + i * x_row_step : x,
                       valid ? 16 : 0);
      }
    };

    // ldmatrix source of this lane: row (lane / 16) * 8 + lane % 8 of each 16-row pair, k half lane / 8 % 2;
    // per (mp, j) a constant offset (shared addresses in 32 bits: no generic -> shared conversion per stage)
    const uint32_t x_lane = W_STAGE_BYTES + S_STAGE_BYTES + ((lane >> 4) * 8 + (lane & 7)) * XROW_BYTES +
                            (kh * 64 + ((lane >> 3) & 1) * 8) * 2;

    auto compute_stage = [&](int buf) {
      const uint8_t* base = smem + buf * C::STAGE_BYTES;
      const uint4* wsm = reinterpret_cast<const uint4*>(base) + half * HALF_W_VEC;
      const uint2* ssm = reinterpret_cast<const uint2*>(base + W_STAGE_BYTES) + half * (HALF_S_BYTES / 8);
      const uint32_t xa = smem_base + buf * C::STAGE_BYTES + x_lane;
      uint4 wv[4];
      uint2 sv[4];
#pragma unroll
      for (int nbw = 0; nbw < 4; ++nbw) {
        const int blk = ((wn & 1) * 4 + nbw) * (BK / 64) + kh;  // n16 block within the 128-row half
        wv[nbw] = wsm[blk * 32 + lane];
        sv[nbw] = ssm[blk * 8 + (lane >> 2)];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[4][4];
#pragma unroll
        for (int nbw = 0; nbw < 4; ++nbw) {
          const uint32_t sword = (j < 2) ? sv[nbw].x : sv[nbw].y;
          const uint32_t s2 = scale_two(sword, (j & 1) * 2);  // {S(row r), S(row r+8)}
          decode_raw(word_of(wv[nbw], j), a[nbw]);
          a[nbw][0] = bf16x2_mul_lo(a[nbw][0], s2);
          a[nbw][1] = bf16x2_mul_hi(a[nbw][1], s2);
          a[nbw][2] = bf16x2_mul_lo(a[nbw][2], s2);
          a[nbw][3] = bf16x2_mul_hi(a[nbw][3], s2);
        }
#pragma unroll
        for (int mp = 0; mp < MT / 2; ++mp) {
          uint32_t b0[2], b1[2];
          ldmatrix_x4_u32(b0[0], b0[1], b1[0], b1[1], xa + mp * 16 * XROW_BYTES + j * 32);
#pragma unroll
          for (int nbw = 0; nbw < 4; ++nbw) {
            mma_bf16(acc[nbw][2 * mp], a[nbw], b0);
            mma_bf16(acc[nbw][2 * mp + 1], a[nbw], b1);
          }
        }
      }
    };

    // ---- this segment's stages [kb, ke) through the STAGES-deep ring (drained at the end), then the
    // drained ring sums the two k halves: afterwards warp half kh holds the totals of n16 blocks 2 kh, 2 kh + 1
    // in acc[0], acc[1], and both halves share the partial store, the fix-up and the epilogue (the first build
    // left all of it to kh = 0 while the other 4 warps waited at the barrier: ~8% of warp samples).
    run_cp_async_ring<STAGES, true>(count, load_stage, [&](int buf) {
      if (active) compute_stage(buf);
    });
    sum_k_halves_split(acc, reinterpret_cast<float*>(smem), kh, rt);
    float(&own)[2][MT][4] = reinterpret_cast<float(&)[2][MT][4]>(acc);
    const int own_nb0 = 2 * kh;  // first n16 block (of this warp's 4) whose totals this thread holds

    // ---- CTAs whose ranges overlap this tile (c_first .. c_last) combine their partials; one of them stores it
    const bool do_store = streamk::finish_segment(
        range, counters, tile, tid == 0, s_is_last, [] { __syncthreads(); },
        [&] {
          float4* mine = streamk::partial_slot<BM * BN>(ws, blockIdx.x, range.my_slot(tile, my_first_tile));
          store_partial(own, mine + own_nb0 * MT * 128, m0, lane, rt, M);
        },
        [&](int c_first, int c_last) {
          // One n16 block at a time (MT float4 loads in flight per CTA), its sum replacing this thread's totals
          // of that block.
#pragma unroll
          for (int nbw = 0; nbw < 2; ++nbw) {
            float4 sum[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sum[mt] = make_float4(0.f, 0.f, 0.f, 0.f);
            streamk::for_each_partial<BM * BN>(range, ws, tile, c_first, c_last, [&](const float4* slot) {
              const float4* part = slot + (own_nb0 + nbw) * MT * 128 + rt;
              float4 v[MT];
#pragma unroll
              for (int mt = 0; mt < MT; ++mt)
                v[mt] = (m0 + mt * 8 + (lane & 3) * 2 < M) ? __ldcg(part + mt * 128)
                                                           : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                sum[mt].x += v[mt].x;
                sum[mt].y += v[mt].y;
                sum[mt].z += v[mt].z;
                sum[mt].w += v[mt].w;
              }
            });
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              own[nbw][mt][0] = sum[mt].x;
              own[nbw][mt][1] = sum[mt].y;
              own[nbw][mt][2] = sum[mt].z;
              own[nbw][mt][3] = sum[mt].w;
            }
          }
        });

    // ---- epilogue (split-K's math): scale by 128 / global_scale, add bias, store bf16
    if (do_store && active)
      store_bf16(own, out, bias, __fdiv_rn(128.0f, __ldg(gscale)), ntile * (BN / 16) + wn * 4 + own_nb0, m0, lane,
                 M, N);
    __syncthreads();  // the reduction buffer and s_is_last are reused by the next segment
    u = range.after(seg);
  }
}

template <int BM>
using SkLauncher = streamk::Launcher<nvfp4_gemm_streamk_kernel<BM>, BM, THREADS, SkCfg<BM>::SMEM_BYTES,
                                     streamk::Target::kAnyArch>;
using SkEntry = streamk::EntryPoints<SkLauncher<32>, SkLauncher<64>>;

}  // namespace
}  // namespace qerl

// The C API of qerl_nvfp4.h, forwarded to this kernel's entry points.
extern "C" cudaError_t qerl_nvfp4_gemm_streamk_launch(const void* x, const void* qweight, const void* qscale,
                                                      const float* global_scale, const void* bias, void* out,
                                                      float* workspace, int* counters, int M, int N, int K, int grid,
                                                      int block_m, cudaStream_t stream) {
  return qerl::SkEntry::launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, grid, block_m,
                               stream);
}

extern "C" size_t qerl_nvfp4_gemm_streamk_workspace_floats(int M, int N, int K, int grid, int block_m) {
  return qerl::SkEntry::workspace_floats(M, N, K, grid, block_m);
}

extern "C" int qerl_nvfp4_gemm_streamk_tiles(int M, int N, int block_m) { return qerl::SkEntry::tiles(M, N, block_m); }

extern "C" int qerl_nvfp4_gemm_streamk_ctas_per_sm(int block_m) { return qerl::SkEntry::ctas_per_sm(block_m); }
