// FP4 x BF16 GEMM on Hopper's warpgroup MMA for wide token tiles (M > 128): the register-A design of
// cuda/nvfp4_gemm_wgmma.cu with 256 tokens per wgmma (m64n256k16) instead of 64 / 128. sm_90a only (the same
// QERL_HAVE_SM90A rule); reached through qerl_nvfp4_gemm_wgmma_launch with block_t = 256.
//
// Why (benchmarks/NOTES.md, "v6.3 wide token tile"): the register-A kernel decodes every weight once per token tile,
// and its warps run decode, wgmma issue and wgmma waits as one chain; at T = 128 a 128-K stage takes ~3,900 cycles
// per SM for 2,048 cycles of tensor work. With T = 256 one decoded A fragment feeds a 256-token wgmma: the same
// tensor work per stage needs half the decode, and each wgmma is long enough (256 tensor cycles) to cover the
// decode of the next k64 half.
//  * CTA tile: one 128-row tile of the repacked layout x 256 tokens, 2 warpgroups; warpgroup g owns rows 64 g ..
//    64 g + 63 (warp w of it decodes n16 block 4 g + w) and issues one m64n256k16 wgmma per k16 step: 128 FP32
//    accumulators per thread.
//  * Ring of 3 stage slots, all copies by the copy engine, issued by thread 0 on the slot's mbarrier: per slot the
//    stage's 256 tokens x 128 K of activations as two k64 halves (32 KB each, wgmma's 128-byte-swizzled K-major
//    layout, SBO = 1024 B): one 256-token TMA box each, or for a last tile of <= 192 tokens only the 64-token boxes
//    holding a token < M (8 KB each), and the stage's weights (8 KB) and scales (1 KB) of the 128-row tile, each one
//    contiguous run of the repacked layout: one bulk copy each. So the warps issue no copies and compute no copy
//    addresses; they wait on the slot's barrier, decode and issue wgmmas. The A registers of consecutive k64 halves
//    alternate, and `wgmma.wait_group 1` after each half's commit retires the half before it, so a half's wgmmas run
//    while the next half is decoded. One CTA barrier per stage, before its second half: by then every warp has
//    retired the previous stage (both halves), whose slot thread 0 then refills with the stage after next.
//  * Persistent stream-K over (128-row x 256-token tile, 128-K stage) units, partials and the deterministic fix-up
//    from cuda/streamk_schedule.cuh; epilogue acc * (128 / global_scale) + bias -> bf16, rows < M and < N only.
#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "anatomy_stamps.cuh"
#include "cluster_splitk.cuh"
#include "lora_epilogue.cuh"
#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"
#include "streamk_schedule.cuh"
#include "tma_sm90.cuh"
#include "wgmma_rs_epilogue.cuh"
#include "wgmma_sm90.cuh"

QERL_ANATOMY_TABLE(qerl_anatomy_read_wide)  // (empty unless QERL_ANATOMY_STAMPS: cuda/anatomy_stamps.cuh)

namespace qerl {
namespace {

constexpr int WD_ROWS = QERL_GEMM_BN;         // weight rows per tile: one 128-row tile of the repacked layout
constexpr int WD_THREADS = 256;               // 2 warpgroups
constexpr int WD_HALF_K = 64;                 // K per wgmma batch (one TMA box of activations)
constexpr int WD_BOX_ROWS = 64;                                 // token rows per part box (a last tile's)
constexpr int WD_BOX_BYTES = WD_BOX_ROWS * WD_HALF_K * 2;       // 8 KB, a multiple of the swizzle's 1024 B
constexpr int WD_W_BYTES = (WD_ROWS / 16) * (QERL_GEMM_BK / 64) * 512;  // the stage's weights: 8 KB
constexpr int WD_S_BYTES = (WD_ROWS / 16) * (QERL_GEMM_BK / 64) * 64;   // its scales: 1 KB
constexpr int WD_SLOTS = 3;
static_assert(QERL_GEMM_BK == 2 * WD_HALF_K, "a stage is two k64 halves");

// The token tile: T = 256 (m64n256k16), or T = 192 (m64n192k16) where ceil(M / 192) tiles of 192 pad M less than
// ceil(M / 256) of 256 (M = 129-192, 257-384, ...: qerl_torch.cpp's wgmma_block_t). Why 192: every wgmma multiplies
// all T token columns whether they exist or not, so at M = 129 the 256-token tile spends half of its tensor work on
// zeros (7B layer 192 us at M = 129 against 198 at M = 256, BF16 152 / 185: benchmarks/NOTES.md, "Twenty-first
// round"). The weights and their decode per stage are the same for both.
template <int T>
struct WideTile {
  static constexpr int kXHalfBytes = T * WD_HALF_K * 2;  // activations per k64 half: 32 KB (256), 24 KB (192)
  static constexpr int kWOff = 2 * kXHalfBytes;          // in a slot: activations, weights, scales
  static constexpr int kSOff = kWOff + WD_W_BYTES;
  static constexpr int kSlotBytes = ((kSOff + WD_S_BYTES + 1023) / 1024) * 1024;  // 73 KB (256), 57 KB (192)
  static constexpr int kSmemBytes = WD_SLOTS * kSlotBytes + 1024;  // + the 1024-byte alignment of the ring
  static_assert(T == 128 || T == 160 || T == 192 || T == 224 || T == 256,
                "wide kernel: 128-, 160-, 192-, 224- or 256-token tiles");
  static_assert(kSmemBytes <= 227 * 1024, "ring larger than Hopper's per-CTA shared memory");
  static_assert(kSlotBytes % 1024 == 0 && kXHalfBytes % 1024 == 0, "swizzled blocks stay 1024-byte aligned");
  // (a tile of T - 64 rows or fewer loads ceil(rows / 64) part boxes: < T rows, so they fit the half for any T)
  static_assert(T % 32 == 0 && WD_BOX_BYTES % 1024 == 0,
                "part boxes start a swizzle period and lie where the whole box would put their rows");
};

#ifdef QERL_WGMMA_DEVICE
// The LoRA term mask * (shrunk @ B^T) of a 128-row x 256-token tile as its starting accumulator (the wide LoRA
// kernel; the 64-token kernel's design, cuda/nvfp4_gemm_wgmma.cu): the tile's tokens' shrink rows times their mask
// (bf16; 0 / 1 masks are exact) staged in ring slot `slot` in the activations' swizzled layout (R = slices x rank
// zero-padded to 64 / 128: one or two k64 halves), lora_b's rows of this warp as the register A operand (the k16
// fragment of rows g, g + 8 and ranks 2t, 2t + 1, + 8; zero outside the row's slice), m64n256k16 wgmmas into acc,
// then acc scaled by global_scale / 128 so that the store's 128 / global_scale gives the term back. `here`: this
// segment starts the tile (kb == 0); elsewhere zeros are staged and the same wgmmas run (a branch around them would
// make ptxas serialize every wgmma of the kernel: C7515). The caller has the slot free and refills it only after a
// CTA barrier that follows this function (every wgmma here is retired on return).
template <int T>
__device__ __forceinline__ void wide_lora_start(float (&acc)[T / 2], const QerlLoraEpilogue& L, uint8_t* stage,
                                                uint32_t stage_addr, bool here, int row0, int m0, int M, int N,
                                                const float* gscale) {
  // the thread's indices read here (volatile): ptxas would otherwise keep the kernel's copies live from its prologue
  // across the main loop, which spills at 255 registers
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  const int lane = tid & 31;
  const int wl = (tid >> 5) & 3;
  const int wg = tid >> 7;
  const int R = L.n_slices * L.rank;  // <= 128, a multiple of 8 (qerl_nvfp4_gemm_wgmma_lora_supported)
  const int halves = (R + 63) >> 6;
  const __nv_bfloat16* bb = static_cast<const __nv_bfloat16*>(L.lora_b);
  const __nv_bfloat16* sh = static_cast<const __nv_bfloat16*>(L.shrunk);
  const __nv_bfloat16* mk = static_cast<const __nv_bfloat16*>(L.mask);
  // the staged B operand, one k64 half at a time (8 uint4 per thread each: 256 tokens x 8 pieces of 8 ranks)
  constexpr int kItems = T * 8 / WD_THREADS;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (h >= halves) break;  // CTA-uniform, before any wgmma
    uint4 v[kItems];
    float mv[kItems];
#pragma unroll
    for (int c = 0; c < kItems; ++c) {  // every load first: one latency per half
      const int i = tid + c * WD_THREADS;
      const int m = m0 + (i >> 3);
      const int k0 = h * 64 + (i & 7) * 8;
      const bool ok = here && m < M && k0 < R;
      mv[c] = ok ? __bfloat162float(mk[size_t(m) * L.mask_stride]) : 0.0f;
      v[c] = ok ? *reinterpret_cast<const uint4*>(sh + size_t(m) * L.ld_shrunk + k0) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int c = 0; c < kItems; ++c) {
      const int i = tid + c * WD_THREADS;
      stage_masked_shrink(stage + h * WideTile<T>::kXHalfBytes, i >> 3, i & 7, v[c], mv[c]);
    }
  }
  fence_proxy_async();  // generic-proxy stores, read by wgmma through the async proxy
  __syncthreads();
  const int g = lane >> 2;
  const int t2 = 2 * (lane & 3);
  // this warpgroup's m64 block; its index read through a shuffle so ptxas can prove the k16 loop's bounds
  // warp-uniform (else it serializes every wgmma of the kernel behind injected warpgroup arrivals: C7520)
  const int n_first = row0 + 64 * __shfl_sync(0xffffffffu, wg, 0);
  auto slice_of = [&](int n) { return (n >= L.slice_end[0]) + (n >= L.slice_end[1]); };
  // register e of lora_b's A fragment for k16 step j (zero outside the row's slice, past N, or where the segment
  // does not start the tile)
  auto b_frag = [&](int j, int e) -> uint32_t {
    const int n = n_first + 16 * wl + g + 8 * (e & 1);
    const int k = 16 * j + t2 + 8 * (e >> 1);
    const int sl = n < N ? slice_of(n) : 0;
    return here && n < N && k >= sl * L.rank && k < (sl + 1) * L.rank
               ? __ldg(reinterpret_cast<const uint32_t*>(bb + size_t(n) * L.ld_b + k))
               : 0u;
  };
  // the block runs k16 steps [lo, hi) (past N: the last slice's, with zero fragments); kKPrefetch of them always,
  // from registers (rank 32 in one slice: every step), the rest in a loop
  constexpr int kKPrefetch = 2;
  const int lo = slice_of(n_first) * L.rank / 16;
  const int hi = ((slice_of(min(n_first + 63, N - 1)) + 1) * L.rank + 15) / 16;
  uint32_t fb[kKPrefetch][4];
#pragma unroll
  for (int jj = 0; jj < kKPrefetch; ++jj)
#pragma unroll
    for (int e = 0; e < 4; ++e) fb[jj][e] = lo + jj < hi ? b_frag(lo + jj, e) : 0u;
  auto k_desc = [&](int j) {
    return kWgmmaDescSwizzle128 |
           uint64_t(((stage_addr + (j >> 2) * WideTile<T>::kXHalfBytes + (j & 3) * 32) >> 4) & 0x3FFF);
  };
  wgmma_fence();
#pragma unroll
  for (int jj = 0; jj < kKPrefetch; ++jj) wgmma_m64k16_rs<T>(acc, fb[jj], k_desc(min(lo + jj, hi - 1)));
  for (int j = lo + kKPrefetch; j < hi; ++j) {  // ranks past the registers (rank > 32, or a slice boundary)
    uint32_t f[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] = b_frag(j, e);
    wgmma_fence();  // f's registers were written since the last wgmma (PTX ISA, wgmma.fence)
    wgmma_m64k16_rs<T>(acc, f, k_desc(j));
    // f is the same registers every step and a wgmma reads its A registers asynchronously: they may not be written
    // before a wait_group has retired it (PTX ISA, wgmma.mma_async). Without this wait the next step's loads (and
    // the zeros ptxas writes first) overwrite the fragment of a wgmma still queued behind the earlier ones, so that
    // step's ranks are lost or multiplied by the wrong shrink columns. (A wait placed before the loads, or loading
    // the next fragment first, makes ptxas serialize every wgmma of the kernel: C7513.)
    wgmma_commit();
    wgmma_wait<0>();
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < T / 2; ++i) reg_fence(acc[i]);
  const float inv_alpha = __ldg(gscale) * (1.0f / 128.0f);
#pragma unroll
  for (int i = 0; i < T / 2; ++i) acc[i] *= inv_alpha;
}

// kCluster = false: persistent stream-K over all SMs (units_per_cta: the range length). kCluster = true: one tile per
// cluster of s CTAs (launched with a cluster dimension), CTA rank r running stages [r * units_per_cta, (r + 1) *
// units_per_cta) of it, the sums reduced on chip (cluster_splitk::reduce_store): no workspace, no counters. kLora: the
// tile starts from its LoRA term (wide_lora_start; `lora` normalized by lora_valid), else `lora` is unused. x_map's
// boxes are whole tiles (256 rows), x_part's 64 rows: a last tile of at most 192 rows.
template <int T, bool kCluster, bool kLora>
__device__ __forceinline__ void wide_body(const CUtensorMap& x_map, const CUtensorMap& x_part,
                                          const uint4* __restrict__ qw,
                                          const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                          const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                          float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                          int units_per_cta, const QerlLoraEpilogue* lora,
                                          const CUtensorMap* out_tma = nullptr) {
  constexpr int PF = WD_SLOTS - 1;  // stages in flight ahead of the one computed
  using W = WideTile<T>;
  constexpr int WD_ACC = T / 2;   // FP32 accumulators per thread (one m64nT block)
  constexpr int WD_STAGE_W_VEC = WD_W_BYTES / 16;  // uint4 per tile-stage: 512
  constexpr int WD_STAGE_S_VEC = WD_S_BYTES / 16;  // 64
  constexpr int SLOT_FLOATS = T * WD_ROWS;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int s_is_last;
  __shared__ __align__(8) uint64_t full_bar[WD_SLOTS];  // a stage slot's copies landed (TMA transaction count)

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wg = warp >> 2;  // warpgroup: rows 64 wg .. 64 wg + 63 of the tile
  const int wl = warp & 3;   // warp in the warpgroup
  const int nb = wg * 4 + wl;  // the n16 block this warp decodes

  const int S = K / QERL_GEMM_BK;
  const int n_tiles = (N + WD_ROWS - 1) / WD_ROWS;
  const int m_tiles = (M + T - 1) / T;
  const streamk::CtaRange range(n_tiles * m_tiles * S, S, units_per_cta);
  const int my_first_tile = range.first_tile();
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem_base - smem_u32(smem_raw));

  const uint32_t bar0 = smem_u32(&full_bar[0]);
  tma::init_slots(bar0, WD_SLOTS, &x_map);
  QERL_AN_ENTRY
  if (tid == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&x_part)) : "memory");
  int g0 = 0;  // stages this CTA ran before the current segment: slot of stage s = (g0 + s) % SLOTS, and its
               // barrier's phase parity = ((g0 + s) / SLOTS) % 2

  // stream-K: the range's segments in K-aligned order where there are several token tiles (CtaRange::aligned_begin:
  // the activations of a long-K GEMM at M >= 512 outgrow L2 otherwise: 7B down at M = 1,024 -9 %, 32B -13-16 %); with
  // one token tile in unit order (its activations stay in L2; the aligned order read 0.5-2.9 % slower at M = 256,
  // NOTES "Eighteenth round"); the cluster split: one segment
  const bool k_aligned = m_tiles > 1;
  // stage st of segment `sg` -> its slot: thread 0 sets the transaction count, then issues the copies completing it
  auto issue_stage = [&](const streamk::Segment& sg, int slot, int st) {
    if (tid != 0) return;
    const int mt = sg.tile / n_tiles;
    const int nt = sg.tile - mt * n_tiles;
    const int m0 = mt * T;
    const uint4* w_seg = qw + (size_t(nt) * S + sg.kb) * WD_STAGE_W_VEC;
    const uint4* s_seg = qs + (size_t(nt) * S + sg.kb) * WD_STAGE_S_VEC;
    const uint32_t base = smem_base + slot * W::kSlotBytes;
    const uint32_t bar = bar0 + 8 * slot;
    const int k0 = (sg.kb + st) * QERL_GEMM_BK;
    if (M - m0 > T - WD_BOX_ROWS) {  // one T-row box per k64 half: a full tile, or one needing all its part boxes
      tma::mbar_expect_tx(bar, 2 * W::kXHalfBytes + WD_W_BYTES + WD_S_BYTES);
      tma::load_2d(base, &x_map, bar, k0, m0);
      tma::load_2d(base + W::kXHalfBytes, &x_map, bar, k0 + WD_HALF_K, m0);
    } else {
      // the last tile, at most 192 rows: only the 64-row boxes with a token row < M (zero-filling rows past M
      // costs the copy engine more than loading real rows: NOTES lead 6; four part boxes fill as much as the whole
      // box and cost 3 % more: NOTES "Eighteenth round"). The slot rows of the boxes not asked for keep stale
      // values, which reach only the accumulators of tokens >= M, never stored.
      const int boxes = (M - m0 + WD_BOX_ROWS - 1) / WD_BOX_ROWS;
      tma::mbar_expect_tx(bar, 2 * boxes * WD_BOX_BYTES + WD_W_BYTES + WD_S_BYTES);
      for (int b = 0; b < boxes; ++b) {
        tma::load_2d(base + b * WD_BOX_BYTES, &x_part, bar, k0, m0 + b * WD_BOX_ROWS);
        tma::load_2d(base + W::kXHalfBytes + b * WD_BOX_BYTES, &x_part, bar, k0 + WD_HALF_K,
                     m0 + b * WD_BOX_ROWS);
      }
    }
    tma::bulk_copy(base + W::kWOff, w_seg + size_t(st) * WD_STAGE_W_VEC, WD_W_BYTES, bar);
    tma::bulk_copy(base + W::kSOff, s_seg + size_t(st) * WD_STAGE_S_VEC, WD_S_BYTES, bar);
  };
  // a segment after the first had its first PF stages issued during the previous segment's end (below), so they are
  // issued here only where g0 == 0 (derived, not a flag: a flag kept across segments spilled in the 255-register
  // kernel)
  for (int u = kCluster ? 0 : range.first_unit(k_aligned); u >= 0;) {
    streamk::Segment seg;
    if constexpr (kCluster) {
      const int kb = min(S, cluster_ctarank() * units_per_cta);
      seg = {cluster_id_x(), kb, min(S, kb + units_per_cta)};
    } else {
      seg = range.segment_at(u);
    }
    const int tile = seg.tile;
    const int kb = seg.kb;
    const int count = seg.count();
    const int mtile = tile / n_tiles;
    const int ntile = tile - mtile * n_tiles;
    const int m0 = mtile * T;

    float acc[1][WD_ACC];  // one m64 block (the layout wgmma_rs::finish_tile takes)
#pragma unroll
    for (int i = 0; i < WD_ACC; ++i) acc[0][i] = 0.0f;

    auto load_stage = [&](int slot, int st) { issue_stage(seg, slot, st); };

    // k64 half t of the stage in `slot`: decode this warp's n16 block (repacked block 2 nb + t of the stage) into 4
    // A fragments (k16 steps j = 0..3), then 4 wgmmas
    auto compute_half = [&](int slot, int t, uint32_t (&a)[4][4]) {
      const uint8_t* base = smem + slot * W::kSlotBytes;
      const uint4 wv = reinterpret_cast<const uint4*>(base + W::kWOff)[(2 * nb + t) * 32 + lane];
      const uint2 sv = reinterpret_cast<const uint2*>(base + W::kSOff)[(2 * nb + t) * 8 + (lane >> 2)];
#pragma unroll
      for (int j = 0; j < 4; ++j) decode_scaled(wv, sv, j, a[j]);
      const uint64_t desc0 = kWgmmaDescSwizzle128 |
                             uint64_t(((smem_base + slot * W::kSlotBytes + t * W::kXHalfBytes) >> 4) & 0x3FFF);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) wgmma_m64k16_rs<T>(acc[0], a[j], desc0 + uint64_t((j * 32) >> 4));
      wgmma_commit();
      wgmma_wait<1>();
    };

    QERL_AN_SEGMENT_BEGIN
    // ---- the segment's stages: two register sets for A, alternating between the halves (the wgmmas of one half
    // read its set while the next half is decoded into the other)
    if (g0 == 0) {
#pragma unroll
      for (int st = 0; st < PF; ++st)
        if (st < count) load_stage((g0 + st) % WD_SLOTS, st);
    }
    if constexpr (kLora) {
      // the slot the prologue left free (refilled only after the loop's first CTA barrier). (It is the slot the
      // previous segment's copy-engine store read from; the LoRA kernel has no such store: were one added, its
      // store_wait_read would have to come before this.)
      const int free_slot = (g0 + PF) % WD_SLOTS;
      wide_lora_start<T>(acc[0], *lora, smem + free_slot * W::kSlotBytes, smem_base + free_slot * W::kSlotBytes,
                      kb == 0, ntile * WD_ROWS, m0, M, N, gscale);
    }
    uint32_t a0[4][4], a1[4][4];
    for (int st = 0; st < count; ++st) {
      const int slot = (g0 + st) % WD_SLOTS;
      QERL_AN_WAIT_BEGIN
      tma::mbar_wait(bar0 + 8 * slot, ((g0 + st) / WD_SLOTS) & 1);  // stage st's activations, weights, scales
      QERL_AN_WAIT_END
      compute_half(slot, 0, a0);  // retires stage st - 1's second half
      __syncthreads();            // every warp has retired stage st - 1, whose slot is refilled now
      // (the slot refilled at st = 0 staged the previous segment's tile for the copy engine: read by now?)
      if (out_tma != nullptr && st == 0 && tid == 0) tma::store_wait_read();
      if (st + PF < count) load_stage((g0 + st + PF) % WD_SLOTS, st + PF);
      compute_half(slot, 1, a1);
    }
    g0 += count;
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < WD_ACC; ++i) reg_fence(acc[0][i]);
    __syncthreads();  // every warp is done with the ring before the next segment refills it (no copy is in flight:
                      // every stage loaded was waited for)
    QERL_AN_LOOP_END

    if constexpr (kCluster) {
      static_assert(cluster_splitk::ReduceLayout<1, WD_ACC, WD_THREADS>::kBytes <= WD_SLOTS * W::kSlotBytes,
                    "the cluster sums do not fit the ring");
      cluster_splitk::reduce_store<1, WD_ACC, WD_THREADS>(acc, smem, smem_base, ntile * WD_ROWS, m0, M, N, gscale,
                                                          bias, out);
      u = -1;
    } else {
      // ---- the next segment's first PF stages, issued now into the slots they take (free: every warp has retired
      // this segment's stages), so that their copies fly during this segment's end; the end stages its bf16 store in
      // the slot they leave free (NOTES "Nineteenth round": each segment start waited ~2 us for its first copies)
      const int u_next = range.next_unit(range.after(seg), k_aligned);
      if (u_next >= 0) {
        const streamk::Segment next = range.segment_at(u_next);
#pragma unroll
        for (int st = 0; st < PF; ++st)
          if (st < next.count()) issue_stage(next, (g0 + st) % WD_SLOTS, st);
      }
      // ---- partials and the fix-up (CTAs sharing this tile; in the K-aligned order a range's first tile runs last,
      // so its last CTA usually arrives last: the sums go in descending CTA order, which lets that CTA sum in place;
      // not in the LoRA kernel, where the flag spilled in its scalar-store path and rollouts run M <= 256 anyway),
      // then the bf16 store
      static_assert(wgmma_rs::StagedStore<1, WD_ACC, WD_THREADS>::kBytes <= W::kSlotBytes &&
                        wgmma_rs::TmaStore<1, WD_ACC, WD_THREADS>::kBytes <= W::kSlotBytes,
                    "the staged store does not fit one ring slot");
      wgmma_rs::finish_tile<1, WD_ACC, WD_THREADS, SLOT_FLOATS, true>(acc, range, ws, counters, s_is_last, tile,
                                                              my_first_tile, ntile * WD_ROWS, m0, M, N, true, gscale,
                                                              bias, out, smem + ((g0 + PF) % WD_SLOTS) * W::kSlotBytes,
                                                              out_tma, !kLora && k_aligned);
      __syncthreads();  // s_is_last is reused by the next segment
      u = u_next;
    }
    QERL_AN_SEGMENT_END
  }
  if (out_tma != nullptr && tid == 0) tma::store_wait();  // the last tile's copy-engine store has landed
  QERL_AN_EXIT
}
#endif  // QERL_WGMMA_DEVICE

template <int T, bool kCluster>
__global__ void __launch_bounds__(WD_THREADS, 1)
    nvfp4_gemm_wgmma_wide_kernel(const __grid_constant__ CUtensorMap x_map, const uint4* __restrict__ qw,
                                 const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                 const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                 float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                 int units_per_cta, const __grid_constant__ CUtensorMap x_part,
                                 const __grid_constant__ CUtensorMap out_map, int tma_store) {
#ifdef QERL_WGMMA_DEVICE
  // the tile's bf16 store by the copy engine where the launcher could encode `out_map` (stream-K only: the cluster
  // split stores its sums from the reduction)
  wide_body<T, kCluster, false>(x_map, x_part, qw, qs, gscale, bias, out, ws, counters, M, N, K, units_per_cta,
                                nullptr, !kCluster && tma_store ? &out_map : nullptr);
#else
  __trap();  // not built for sm_90a: the launcher never starts this kernel (ctas_per_sm = 0)
#endif
}

// The same kernel with the LoRA term as each tile's starting accumulator: a separate kernel so that the plain one's
// code stays as measured.
template <int T, bool kCluster>
__global__ void __launch_bounds__(WD_THREADS, 1)
    nvfp4_gemm_wgmma_wide_lora_kernel(const __grid_constant__ CUtensorMap x_map, const uint4* __restrict__ qw,
                                      const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                      const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                      float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                      int units_per_cta, const __grid_constant__ QerlLoraEpilogue lora,
                                      const __grid_constant__ CUtensorMap x_part) {
#ifdef QERL_WGMMA_DEVICE
  wide_body<T, kCluster, true>(x_map, x_part, qw, qs, gscale, bias, out, ws, counters, M, N, K, units_per_cta,
                               &lora);
#else
  __trap();
#endif
}

template <int T>
using WideLauncher = tma::Launcher<nvfp4_gemm_wgmma_wide_kernel<T, false>, T, WD_THREADS, WideTile<T>::kSmemBytes,
                                   WD_ROWS>;
template <int T>
using ClusterLauncher = tma::Launcher<nvfp4_gemm_wgmma_wide_kernel<T, true>, T, WD_THREADS,
                                      WideTile<T>::kSmemBytes, WD_ROWS>;
template <int T>
using WideLoraLauncher = tma::Launcher<nvfp4_gemm_wgmma_wide_lora_kernel<T, false>, T, WD_THREADS,
                                       WideTile<T>::kSmemBytes, WD_ROWS>;
template <int T>
using ClusterLoraLauncher = tma::Launcher<nvfp4_gemm_wgmma_wide_lora_kernel<T, true>, T, WD_THREADS,
                                          WideTile<T>::kSmemBytes, WD_ROWS>;

// x's map of 64-row boxes, for the last tile when M is not a multiple of T (the launchers encode the whole-tile one)
cudaError_t encode_part(CUtensorMap* x_part, const void* x, int M, int K) {
  return tma::encode_activations(x_part, x, M, K, WD_BOX_ROWS);
}

// `lora` (normalized) launches the LoRA kernel, NULL the plain one.
template <int T>
cudaError_t launch_cluster(const void* x, const void* qweight, const void* qscale, const float* gscale,
                           const void* bias, void* out, int M, int N, int K, int s, int per,
                           const QerlLoraEpilogue* lora, cudaStream_t stream) {
  CUtensorMap x_map, x_part;
  cudaError_t e = tma::encode_activations(&x_map, x, M, K, T);
  if (e == cudaSuccess) e = encode_part(&x_part, x, M, K);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr;
  cluster_splitk::config(&cfg, &attr, s, WideLauncher<T>::tiles(M, N), WD_THREADS, WideTile<T>::kSmemBytes, stream);
  const auto* w = static_cast<const uint4*>(qweight);
  const auto* sc = static_cast<const uint4*>(qscale);
  const auto* b = static_cast<const __nv_bfloat16*>(bias);
  auto* o = static_cast<__nv_bfloat16*>(out);
  if (lora != nullptr)
    return cudaLaunchKernelEx(&cfg, nvfp4_gemm_wgmma_wide_lora_kernel<T, true>, x_map, w, sc, gscale, b, o,
                              static_cast<float*>(nullptr), static_cast<int*>(nullptr), M, N, K, per, *lora, x_part);
  return cudaLaunchKernelEx(&cfg, nvfp4_gemm_wgmma_wide_kernel<T, true>, x_map, w, sc, gscale, b, o,
                            static_cast<float*>(nullptr), static_cast<int*>(nullptr), M, N, K, per, x_part, x_part,
                            0);  // (the cluster split stores from its sums: no output map)
}

template <int T>
cudaError_t wide_launch(const void* x, const void* qweight, const void* qscale, const float* global_scale,
                        const void* bias, void* out, float* workspace, int* counters, int M, int N, int K, int grid,
                        const QerlLoraEpilogue* lora, cudaStream_t stream) {
  int per = 0;
  const int tiles = WideLauncher<T>::tiles(M, N);
  // the wide kernel tries only the largest cluster (split's smaller_clusters false: NOTES "Outcome of the cluster
  // candidate")
  const int s = lora != nullptr ? cluster_splitk::split<ClusterLoraLauncher<T>>(tiles, K, grid, &per, false)
                                : cluster_splitk::split<ClusterLauncher<T>>(tiles, K, grid, &per, false);
  if (s > 0) {
    // (split chose s only after the cluster launcher's prepare() succeeded)
    const cudaError_t e = streamk::check_launch_args(M, N, K, grid, counters, workspace,
                                                     WideLauncher<T>::workspace_floats(M, N, K, grid));
    if (e != cudaSuccess) return e;
    return launch_cluster<T>(x, qweight, qscale, global_scale, bias, out, M, N, K, s, per, lora, stream);
  }
  CUtensorMap x_part;
  const cudaError_t e = encode_part(&x_part, x, M, K);
  if (e != cudaSuccess) return e;
  if (lora != nullptr)
    return WideLoraLauncher<T>::launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K,
                                       grid, stream, false, *lora, x_part);
  // the output's map for the copy-engine store of whole tiles; where it cannot be encoded (N % 8, alignment) the
  // tiles leave through the threads' staged store (the map argument is then x_part, unused)
  CUtensorMap out_map;
  const bool tma_store = tma::encode_output(&out_map, out, M, N, T) == cudaSuccess;
  return WideLauncher<T>::launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, grid,
                                 stream, false, x_part, tma_store ? out_map : x_part, tma_store ? 1 : 0);
}

// f<T>() for block_t = T of 128, 160, 192, 224 or 256 (the entry points below check block_t first)
template <class F>
auto by_tile(int block_t, F&& f) {
  return block_t == 128   ? f(std::integral_constant<int, 128>{})
         : block_t == 160 ? f(std::integral_constant<int, 160>{})
         : block_t == 192 ? f(std::integral_constant<int, 192>{})
         : block_t == 224 ? f(std::integral_constant<int, 224>{})
                          : f(std::integral_constant<int, 256>{});
}

}  // namespace
}  // namespace qerl

// Internal entry points (qerl_nvfp4.h), reached through the qerl_nvfp4_gemm_wgmma_* functions with block_t = 192 or
// 256 (qerl_nvfp4_gemm_wgmma_wide_tile says which).
extern "C" int qerl_nvfp4_gemm_wgmma_wide_tile(int block_t) {
  return block_t == 128 || block_t == 160 || block_t == 192 || block_t == 224 || block_t == 256;
}

extern "C" cudaError_t qerl_nvfp4_gemm_wgmma_wide_launch(const void* x, const void* qweight, const void* qscale,
                                                         const float* global_scale, const void* bias, void* out,
                                                         float* workspace, int* counters, int M, int N, int K,
                                                         int grid, int block_t, cudaStream_t stream) {
  return qerl_nvfp4_gemm_wgmma_wide_lora_launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N,
                                                K, grid, block_t, nullptr, stream);
}

extern "C" cudaError_t qerl_nvfp4_gemm_wgmma_wide_lora_launch(const void* x, const void* qweight, const void* qscale,
                                                              const float* global_scale, const void* bias, void* out,
                                                              float* workspace, int* counters, int M, int N, int K,
                                                              int grid, int block_t, const QerlLoraEpilogue* lora,
                                                              cudaStream_t stream) {
  if (!qerl_nvfp4_gemm_wgmma_wide_tile(block_t)) return cudaErrorInvalidValue;
  return qerl::by_tile(block_t, [&](auto t) {
    return qerl::wide_launch<decltype(t)::value>(x, qweight, qscale, global_scale, bias, out, workspace, counters, M,
                                                 N, K, grid, lora, stream);
  });
}

extern "C" int qerl_nvfp4_gemm_wgmma_wide_lora_available(int block_t) {
  if (!qerl_nvfp4_gemm_wgmma_wide_tile(block_t)) return 0;
  return qerl::by_tile(block_t, [](auto t) {
    return qerl::WideLoraLauncher<decltype(t)::value>::prepare() == cudaSuccess ? 1 : 0;
  });
}

extern "C" size_t qerl_nvfp4_gemm_wgmma_wide_workspace_floats(int M, int N, int K, int grid, int block_t) {
  return qerl::by_tile(block_t, [&](auto t) {
    return qerl::WideLauncher<decltype(t)::value>::workspace_floats(M, N, K, grid);
  });
}

extern "C" int qerl_nvfp4_gemm_wgmma_wide_tiles(int M, int N, int block_t) {
  return qerl::by_tile(block_t, [&](auto t) { return qerl::WideLauncher<decltype(t)::value>::tiles(M, N); });
}

extern "C" int qerl_nvfp4_gemm_wgmma_wide_ctas_per_sm(int block_t) {
  return qerl::by_tile(block_t, [](auto t) { return qerl::WideLauncher<decltype(t)::value>::ctas_per_sm(); });
}
