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
//  * Optional LoRA expand in the epilogue (template flag LORA, cuda/lora_epilogue.cuh): the tile's LoRA term is added
//    in FP32 before the bf16 rounding. LORA = false is the kernel without it, instruction for instruction.
#include "lora_epilogue.cuh"
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

template <int BM, bool LORA>
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
  const int ntile = blockIdx.x;
  const int split = blockIdx.y;
  const int mtile = blockIdx.z;
  const int stages_total = K / BK;
  const int q = stages_total / splits;
  const int rem = stages_total % splits;
  const int s_begin = split * q + min(split, rem);
  const int s_count = q + (split < rem ? 1 : 0);
  const int nb0 = ntile * (BN / 16);
  const int m0 = mtile * BM;
  if constexpr (LORA) {
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
  constexpr int XCHUNKS = BM * (BK / 8);
  constexpr int XPER = (XCHUNKS + THREADS - 1) / THREADS;
  const __nv_bfloat16* xsrc[XPER];
  uint32_t xdst[XPER];
  int xbytes[XPER];
#pragma unroll
  for (int i = 0; i < XPER; ++i) {
    const int c = tid + i * THREADS;
    const int row = c / (BK / 8), ch = c % (BK / 8);
    const bool valid = (XCHUNKS % THREADS == 0 || c < XCHUNKS) && (m0 + row < M);
    xsrc[i] = x + size_t(valid ? m0 + row : 0) * K + size_t(s_begin) * BK + ch * 8;
    xdst[i] = W_STAGE_BYTES + S_STAGE_BYTES + row * XROW_BYTES + ch * 16;
    xbytes[i] = valid ? 16 : 0;
  }
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
  auto load_acts = [&](int buf, int s_rel) {
    const uint32_t base = smem_base + buf * C::STAGE_BYTES;
#pragma unroll
    for (int i = 0; i < XPER; ++i)
      if (XCHUNKS % THREADS == 0 || tid + i * THREADS < XCHUNKS)
        cp_async16_u32(base + xdst[i], xsrc[i] + size_t(s_rel) * BK, xbytes[i]);
  };

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
      if constexpr (MT == 1) {
        const uint8_t* p = xs + (lane & 7) * XROW_BYTES + (kk + ((lane >> 3) & 1) * 8) * 2;
        ldmatrix_x2(b[0][0], b[0][1], p);
      } else {
#pragma unroll
        for (int mp = 0; mp < MT / 2; ++mp) {
          const int row = (2 * mp + (lane >> 4)) * 8 + (lane & 7);
          const uint8_t* p = xs + row * XROW_BYTES + (kk + ((lane >> 3) & 1) * 8) * 2;
          ldmatrix_x4(b[2 * mp][0], b[2 * mp][1], b[2 * mp + 1][0], b[2 * mp + 1][1], p);
        }
      }
      mma_k16_step(wv, sv, j, b, acc);
    }
  };

  // ---- main loop: STAGES-deep cp.async ring, stage 0's weights in flight before the wait for the prior grid (a no-op
  // unless launched with PDL); then the drained ring sums the two k halves
  run_cp_async_ring_after_prior<STAGES>(s_count, load_weights, load_acts, compute_stage);
  sum_k_halves(acc, reinterpret_cast<float*>(smem), kh, rt, [] { __syncthreads(); });

  // ---- split-K: publish the partial, the last CTA of the tile reduces in split order
  if (splits > 1) {
    const int tile_id = mtile * gridDim.x + ntile;
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
  if constexpr (LORA) {
    __nv_bfloat16* s_sm = reinterpret_cast<__nv_bfloat16*>(smem + C::S_OFFSET);
    if (kh == 1) lora_stage_shrunk<BM, BN>(s_sm, lora, m0, M, rt);
    __syncthreads();
    if (kh == 1) lora_tile<BM, BN>(reinterpret_cast<float*>(smem + C::LT_OFFSET), s_sm, lora, nb0 * 16, m0, M, N, rt);
    __syncthreads();
  }
  if (kh != 0) return;
  // ---- epilogue: scale by 128 / global_scale, add bias (and the LoRA tile), store bf16
  if constexpr (LORA) {
    store_bf16(acc, out, bias, __fdiv_rn(128.0f, __ldg(gscale)), nb0 + wn * 2, m0, lane, M, N,
               LoraTile<BN>{reinterpret_cast<const float*>(smem + C::LT_OFFSET), nb0 * 16});
  } else {
    store_bf16(acc, out, bias, __fdiv_rn(128.0f, __ldg(gscale)), nb0 + wn * 2, m0, lane, M, N);
  }
}

template <int BM, bool LORA = false>
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

template <int BM, bool LORA>
cudaError_t launch_as(const void* x, const void* qweight, const void* qscale, const float* gscale,
                      const void* bias, void* out, float* ws, int* counters, int M, int N, int K, int splits,
                      const QerlLoraEpilogue& lora, bool pdl, cudaStream_t stream) {
  cudaError_t e = prepare<BM, LORA>();
  if (e != cudaSuccess) return e;
  const int n_tiles = (N + BN - 1) / BN;
  const int m_tiles = (M + BM - 1) / BM;
  e = launch_kernel(nvfp4_gemm_splitk_kernel<BM, LORA>, dim3(n_tiles, splits, m_tiles), dim3(THREADS),
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
    return launch_as<BM, false>(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, splits,
                                QerlLoraEpilogue{}, pdl, stream);
  // LoRA kernels exist only up to QERL_LORA_EPILOGUE_MAX_BLOCK_M tokens per tile (qerl_nvfp4_gemm_lora_supported)
  if constexpr (BM <= QERL_LORA_EPILOGUE_MAX_BLOCK_M)
    return launch_as<BM, true>(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, splits, *lora, pdl,
                               stream);
  else
    return cudaErrorInvalidValue;
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
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, nvfp4_gemm_splitk_kernel<BM, false>, THREADS,
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
                 qerl::lora_valid(*lora, N, qerl::lora_max_ranks(block_m), &norm)
             ? 1
             : 0;
}

extern "C" cudaError_t qerl_nvfp4_gemm_lora_launch(const void* x, const void* qweight, const void* qscale,
                                                   const float* global_scale, const void* bias, void* out,
                                                   float* workspace, int* counters, int M, int N, int K, int splits,
                                                   int block_m, const QerlLoraEpilogue* lora, int pdl,
                                                   cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || K % QERL_GEMM_BK != 0 || N % 16 != 0 || splits < 1 ||
      splits > K / QERL_GEMM_BK)
    return cudaErrorInvalidValue;
  if (splits > 1 && (workspace == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
  QerlLoraEpilogue norm{};
  if (lora != nullptr && (block_m > QERL_LORA_EPILOGUE_MAX_BLOCK_M ||
                          !qerl::lora_valid(*lora, N, qerl::lora_max_ranks(block_m), &norm)))
    return cudaErrorInvalidValue;
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
