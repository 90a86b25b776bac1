// FP4 x BF16 GEMM (W4A16, NVFP4 weights) on Hopper's warpgroup MMA: `wgmma.mma_async` with the dequantized
// weights as the register A operand and the activations as the shared-memory B operand. sm_90a only: built into
// the extension only when the build targets sm_90a (QERL_HAVE_SM90A, set by verl_qerl/kernels/build.py next to
// -gencode arch=compute_90a); elsewhere the launcher reports cudaErrorNotSupported and the op runs other kernels.
//
// Why (benchmarks/NOTES.md, "v6 wgmma"): from M = 64 tokens on the GEMM is bound by the tensor pipe, and
// mma.sync kernels (ours, vLLM's Marlin) stall on its fixed-latency chains with 2 warps per scheduler. wgmma runs
// a 64 x T x 16 product per instruction asynchronously while the warps decode the next weights.
//  * Roles: the weight rows (the GEMM's N, the wide side) are wgmma's M (m64), the tokens are wgmma's N (T = 64 or
//    128). The repacked layout (verl_qerl/kernels/layout.py) is read unchanged: one warp's register-A fragment of
//    wgmma m64nTk16 is the m16n8k16 A fragment (rows lane/4 (+8), K 2 (lane%4) (+1, +8)) of that warp's 16 rows,
//    exactly what one 32-bit word of the layout decodes to with the split-K bit tricks (decode_raw, scale_two).
//  * CTA tile at T = 128: 256 weight rows (the repacked 128-row tiles 2t, 2t+1) x T tokens, 2 warpgroups. Warpgroup
//    g owns tile 2t+g and issues two m64 wgmmas per k16 step (its rows 0-63: warp w decodes n16 block w; rows
//    64-127: block 4+w), both reading the same B. If tile 2t+1 does not exist, warpgroup 1 loads and computes
//    nothing. At T = 64: one warpgroup, one 128-row tile, and two CTAs per SM (WgCfg), so that the SM runs one CTA's
//    decode while the other's wgmmas run instead of all warps alternating in step between the two.
//  * Activations in shared memory in wgmma's 128-byte-swizzled K-major layout: per k64 half of a stage, token row
//    r holds its 128 bytes at r * 128 with 16-byte chunk q at (q ^ (r % 8)) * 16; SBO (next 8 tokens) = 1024 B,
//    and k16 step j of the half starts at +32 j. (The no-swizzle layout, core matrices of 8 tokens 2048 bytes
//    apart, puts the 8 core matrices one wgmma reads together on the same banks: measured 1.3x slower,
//    benchmarks/NOTES.md.)
//  * Ring: STAGES slots of (weights 8 KB and scales 1 KB per 128-row tile, activations T x 256 B), all copied by
//    the copy engine (bulk copies and TMA issued by thread 0 on the slot's mbarrier),
//    prefetch distance STAGES - 2: a stage's second batch of wgmmas may still run while the next stage's first
//    half is decoded (T = 128: wait_group 1 after each half's commit retires the half before it, one set of A
//    registers; T = 64: three sets in rotation and wait_group 2, two halves in flight); the slot refilled at
//    iteration i was read at i - 2, whose wgmmas every warpgroup has waited for before the barrier of iteration
//    i. The slot's mbarrier completing makes the copies visible to the decode's loads and to the wgmmas alike; no
//    proxy fence is needed.
//  * Persistent stream-K as cuda/nvfp4_gemm_streamk.cu: the (m tile, n tile, k stage) units are cut into equal
//    contiguous ranges, one per CTA; a partial segment writes FP32 partials to workspace slot (CTA, first / last
//    tile of its range) and the last arriving segment of a tile sums all partials in CTA order
//    (deterministic), then runs the epilogue: acc * (128 / global_scale) + bias -> bf16, rows < M and < N only.
#include "anatomy_stamps.cuh"
#include "cluster_splitk.cuh"
#include "lora_epilogue.cuh"
#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"
#include "streamk_schedule.cuh"
#include "tma_sm90.cuh"
#include "wgmma_rs_epilogue.cuh"
#include "wgmma_sm90.cuh"

QERL_ANATOMY_TABLE(qerl_anatomy_read_wgmma)  // (empty unless QERL_ANATOMY_STAMPS: cuda/anatomy_stamps.cuh)

namespace qerl {
namespace {

constexpr int WG_BK = streamk::kStageK;    // K per pipeline stage
constexpr int TILE_W_BYTES = (QERL_GEMM_BN / 16) * (WG_BK / 64) * 512;  // one 128-row tile, one stage: 8 KB
constexpr int TILE_S_BYTES = (QERL_GEMM_BN / 16) * (WG_BK / 64) * 64;   // 1 KB

// T = 64: one warpgroup per CTA (one 128-row tile x 64 tokens) and two CTAs per SM, so that one CTA's decode runs
// while the other's wgmmas do (each CTA's barrier only holds its own four warps). T = 128: two warpgroups (two
// 128-row tiles), one CTA per SM (254 registers per thread leave no room for a second CTA).
template <int T>
struct WgCfg {
  static constexpr int WARPGROUPS = T == 64 ? 1 : 2;
  static constexpr int THREADS = 128 * WARPGROUPS;
  static constexpr int TILE_ROWS = QERL_GEMM_BN * WARPGROUPS;  // weight rows per output tile
  static constexpr int CTAS_PER_SM = T == 64 ? 2 : 1;
  static constexpr int X_OFF = WARPGROUPS * (TILE_W_BYTES + TILE_S_BYTES);  // activations after weights, scales
  static constexpr int STAGE_BYTES = X_OFF + T * WG_BK * 2;
  static constexpr int STAGES = 4;  // T = 64: 4 x 25 KB per CTA, two CTAs per SM; T = 128: 4 x 50 KB, one CTA
  // + 1 KB: the ring starts at the first 1024-byte boundary of the dynamic shared memory (the 128-byte swizzle
  // pattern of the activations repeats every 1024 bytes and is anchored to absolute shared addresses)
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;
  static_assert(STAGE_BYTES % 1024 == 0 && X_OFF % 1024 == 0, "activation blocks must stay 1024-byte aligned");
  static constexpr int ACC = T / 2;  // FP32 accumulators per thread per m64 block
  static_assert(T == 64 || T == 128, "wgmma kernel: T = 64 or 128 tokens per tile");
  static_assert(ACC % 4 == 0, "partials are stored as float4");
  static_assert(SMEM_BYTES <= 227 * 1024, "ring larger than Hopper's per-CTA shared memory");
  static_assert(CTAS_PER_SM * (SMEM_BYTES + 1024) <= 228 * 1024, "the CTAs of one SM do not fit its shared memory");
};

#ifdef QERL_WGMMA_DEVICE
// The kernel's body, inlined into the plain kernel (LORA false, `lora` unused) and the LoRA kernel. kCluster = false:
// persistent stream-K (units_per_cta: the range length); true: one tile per thread-block cluster of s CTAs, CTA rank r
// running stages [r units_per_cta, (r + 1) units_per_cta) of tile `cluster_id_x()`, the sums reduced on chip
// (cluster_splitk::reduce_store; the LoRA term comes from rank 0, whose range starts the tile).
template <int T, bool LORA, bool kCluster>
__device__ __forceinline__ void wgmma_body(const CUtensorMap& x_map, const uint4* __restrict__ qw,
                                           const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                           const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                           float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                           int units_per_cta, const QerlLoraEpilogue* lora) {
  using C = WgCfg<T>;
  constexpr int STAGES = C::STAGES;
  constexpr int PF = STAGES - 2;  // prefetch distance
  constexpr int ACC = C::ACC;
  constexpr int WGS = C::WARPGROUPS;
  constexpr int THREADS = C::THREADS;
  constexpr int X_OFF = C::X_OFF;
  // three A-register sets in rotation (the stage loop below) where the registers allow: not in the stream-K LoRA
  // kernel, whose bookkeeping on top of 64 more registers made ptxas serialize its wgmmas (C7512)
  constexpr bool kA3 = T == 64 && (kCluster || !LORA);
  constexpr int kInFlight = kA3 ? 2 : 1;   // wgmma groups left pending after each half's commit
  constexpr int SLOT_FLOATS = T * C::TILE_ROWS;  // one partial slot: T tokens x the tile's weight rows
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ int s_is_last;
  __shared__ __align__(8) uint64_t full_bar[STAGES];  // activations of a slot landed (TMA transaction count)

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // warpgroup: 128-row tile WGS t + wg. Read through a shuffle so ptxas can prove it warp-uniform: the branch on
  // `active` is then not divergent to it, and the wgmma descriptors stay in uniform registers (without it every
  // HGMMA of the stage loop waits on two R2UR moves of its descriptor: 38 R2UR per stage).
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int wl = warp & 3;   // warp in the warpgroup

  const int S = K / WG_BK;
  const int tiles_128 = (N + QERL_GEMM_BN - 1) / QERL_GEMM_BN;
  const int n_tiles = (N + C::TILE_ROWS - 1) / C::TILE_ROWS;
  const int m_tiles = (M + T - 1) / T;
  const streamk::CtaRange range(n_tiles * m_tiles * S, S, units_per_cta);
  const int my_first_tile = range.first_tile();
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem_base - smem_u32(smem_raw));
  // B descriptor (the activations: SBO = the next 8 tokens); the start address is added per k16 step
  const uint64_t desc_hi = kWgmmaDescSwizzle128;

  constexpr int TILE_W_VEC = TILE_W_BYTES / 16;
  constexpr int TILE_S_VEC = TILE_S_BYTES / 16;

  const uint32_t bar0 = smem_u32(&full_bar[0]);
  tma::init_slots(bar0, STAGES, &x_map);
  QERL_AN_ENTRY
  int g0 = 0;  // stages this CTA ran before the current segment: slot of stage it = (g0 + it) % STAGES, and its
               // barrier's phase parity = ((g0 + it) / STAGES) % 2

  // a stage's copies, all by thread 0 on the slot's mbarrier (transaction count first): per 128-row tile its
  // stage's weights (8 KB) and scales (1 KB), each one contiguous run of the repacked layout and one bulk copy, and
  // the activations as two TMA boxes (k64 halves hh = 0, 1 at X_OFF + hh * T * 128: per half, token row r at
  // r * 128 with the 128-byte swizzle; rows past M zero-filled by the copy engine); stage s_rel of segment `sg`
  auto issue_stage = [&](const streamk::Segment& sg, int buf, int s_rel) {
    if (tid != 0) return;
    const int mt = sg.tile / n_tiles;
    const int nt = sg.tile - mt * n_tiles;
    const uint4* w_seg = qw + (size_t(WGS * nt) * S + sg.kb) * TILE_W_VEC;
    const uint4* s_seg = qs + (size_t(WGS * nt) * S + sg.kb) * TILE_S_VEC;
    const uint32_t base = smem_base + buf * C::STAGE_BYTES;
    const uint32_t bar = bar0 + 8 * buf;
    const int tiles = WGS == 2 && 2 * nt + 1 < tiles_128 ? 2 : 1;
    tma::mbar_expect_tx(bar, T * WG_BK * 2 + tiles * (TILE_W_BYTES + TILE_S_BYTES));
    const int k0 = (sg.kb + s_rel) * WG_BK;
    tma::load_2d(base + X_OFF, &x_map, bar, k0, mt * T);
    tma::load_2d(base + X_OFF + T * 128, &x_map, bar, k0 + tma::kBoxK, mt * T);
    for (int h = 0; h < tiles; ++h) {
      tma::bulk_copy(base + h * TILE_W_BYTES, w_seg + (size_t(h) * S + s_rel) * TILE_W_VEC, TILE_W_BYTES, bar);
      tma::bulk_copy(base + WGS * TILE_W_BYTES + h * TILE_S_BYTES, s_seg + (size_t(h) * S + s_rel) * TILE_S_VEC,
                     TILE_S_BYTES, bar);
    }
  };
  // where a segment's end stages its bf16 store: in the two slots after the next segment's first PF stages (issued
  // during this end, NOTES "Nineteenth round"), when those are contiguous and hold the staged tile; else no copies
  // are issued early and the end uses the ring from its start
  using Staged = wgmma_rs::StagedStore<2, ACC, THREADS>;
  static_assert(PF == 2 && STAGES == 4, "the early copies take the slots of stages 0 and 1, the store the other two");
  constexpr bool kOneSlot = Staged::kBytes <= C::STAGE_BYTES;
  static_assert(Staged::kBytes <= 2 * C::STAGE_BYTES, "the staged store does not fit two ring slots");
  bool prefetched = false;  // the segment's first PF stages were issued during the previous segment's end
  const int u_end = kCluster ? 1 : range.end;
  for (int u = kCluster ? 0 : range.begin; u < u_end;) {
    streamk::Segment seg;
    if constexpr (kCluster) {
      // (read through shuffles so ptxas can prove them warp-uniform: the stage loop's bounds and slots, and the
      // wgmma descriptors with them, stay in uniform registers)
      const int kb0 = min(S, __shfl_sync(0xffffffffu, cluster_ctarank(), 0) * units_per_cta);
      seg = {__shfl_sync(0xffffffffu, cluster_id_x(), 0), kb0, min(S, kb0 + units_per_cta)};
    } else {
      seg = range.segment_at(u);
    }
    const int tile = seg.tile;
    const int kb = seg.kb;
    const int count = seg.count();
    const int mtile = tile / n_tiles;
    const int ntile = tile - mtile * n_tiles;
    const int m0 = mtile * T;
    const bool has_hi = WGS == 2 && 2 * ntile + 1 < tiles_128;
    const bool active = wg == 0 || has_hi;  // warpgroup-uniform

    float acc[2][ACC];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < ACC; ++i) acc[h][i] = 0.0f;
    // the 64-token kernels rotate three sets of A registers (one warpgroup, two CTAs per SM: 64 more registers
    // fit); the 128-token kernels (two warpgroups, 235-247 registers) and the 64-token stream-K LoRA kernel keep one
    uint32_t a3[kA3 ? 3 : 1][2][4][4];

    auto load_stage = [&](int buf, int s_rel) { issue_stage(seg, buf, s_rel); };

    // One k64 half t of a stage: decode this warp's weights into `a` (the register A operand), issue its wgmmas,
    // commit them as one group and wait until at most kInFlight groups are pending.
    auto compute_half = [&](int buf, int t, uint32_t(&a)[2][4][4]) {
      const uint8_t* base = smem + buf * C::STAGE_BYTES;
      const uint4* wsm = reinterpret_cast<const uint4*>(base + wg * TILE_W_BYTES);
      const uint2* ssm = reinterpret_cast<const uint2*>(base + WGS * TILE_W_BYTES + wg * TILE_S_BYTES);
      const uint64_t desc0 = desc_hi | uint64_t(((smem_base + buf * C::STAGE_BYTES + X_OFF) >> 4) & 0x3FFF);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int blk = (h * 4 + wl) * 2 + t;  // n16 block h*4 + wl, k64 tile t of this 128-row tile
        const uint4 wv = wsm[blk * 32 + lane];
        const uint2 sv = ssm[blk * 8 + (lane >> 2)];
#pragma unroll
        for (int j = 0; j < 4; ++j) decode_scaled(wv, sv, j, a[h][j]);
      }
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) wgmma_m64k16_rs<T>(acc[h], a[h][j], desc0 + uint64_t((t * T * 128 + j * 32) >> 4));
      wgmma_commit();
      // a wgmma reads its A registers until retired (PTX ISA, wgmma.mma_async): the next decode into the same
      // registers must come after this wait has retired the group that read them (see kInFlight)
      wgmma_wait<kInFlight>();
    };

    // T = 128: one set of A registers, reused by every half: the wait after each half's commit retires the half
    // before it (at t = 0 the previous stage's second half) before the next decode writes the registers. (One wait
    // per stage left the second half's wgmmas in flight through the next stage's second decode: a race.)
    auto compute_stage = [&](int buf) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        uint32_t a[2][4][4];
        compute_half(buf, t, a);
      }
    };

    QERL_AN_SEGMENT_BEGIN
    // ---- the segment's stages [kb, ke)
    if (!prefetched) {
#pragma unroll
      for (int s = 0; s < PF; ++s)
        if (s < count) load_stage((g0 + s) % STAGES, s);
    }
    prefetched = false;
    if constexpr (LORA) {
      // The LoRA term mask * (shrunk @ B^T) as the tile's starting accumulator, by the CTA whose segment starts the
      // tile (kb == 0; its partial reaches the store through the fix-up like any other), while the copies of its
      // first stages are in flight: the term is computed with lora_b's rows as the register A operand (the k16
      // fragment of rows g, g + 8 and ranks 2t, 2t + 1, + 8) and the tile's tokens' shrink rows times their mask
      // (bf16; 0 / 1 masks are exact) staged as the B operand in the ring slot the prologue leaves free, in the
      // activations' swizzled layout (R = slices x rank zero-padded to 64 / 128), then scaled by global_scale / 128
      // so that the store's 128 / global_scale gives it back. Only the k16 steps of the slices a block's rows belong
      // to run (ranks outside a row's slice are zero). Masked tokens start from an exact 0, as without LoRA. (Two
      // earlier versions ran this after the fix-up, before the store, and cost more than the expand kernel they
      // replaced: benchmarks/NOTES.md, "Ninth round".)
      static_assert(T == 64, "the LoRA term is built for 64-token tiles (one warpgroup, 8 uint4 per thread)");
      constexpr int kStageItems = 2 * T * 8 / THREADS;  // uint4 of the two k64 halves per thread
      // Every segment runs this code (kb != 0: no loads, zeros staged, so acc stays 0): branching around the wgmmas
      // makes ptxas serialize every wgmma of the kernel (C7515: the accumulators defined on two paths).
      const bool lora_here = kb == 0;
      {
        const QerlLoraEpilogue& L = *lora;
        const int R = L.n_slices * L.rank;  // <= 128, a multiple of 8 (qerl_nvfp4_gemm_wgmma_lora_supported)
        const int halves = (R + 63) >> 6;
        const __nv_bfloat16* bb = static_cast<const __nv_bfloat16*>(L.lora_b);
        const __nv_bfloat16* sh = static_cast<const __nv_bfloat16*>(L.shrunk);
        const __nv_bfloat16* mk = static_cast<const __nv_bfloat16*>(L.mask);
        const int g = lane >> 2;
        const int t2 = 2 * (lane & 3);
        const int row_blk0 = ntile * C::TILE_ROWS + wg * 128;
        auto slice_of = [&](int n) { return (n >= L.slice_end[0]) + (n >= L.slice_end[1]); };
        // lora_b's A fragment register e of k16 step j of block h (zero outside the row's slice, past N, or where
        // this segment does not start the tile)
        auto b_frag = [&](int h, int j, int e) -> uint32_t {
          const int n = row_blk0 + h * 64 + wl * 16 + g + 8 * (e & 1);
          const int k = 16 * j + t2 + 8 * (e >> 1);
          const int sl = n < N ? slice_of(n) : 0;
          return lora_here && n < N && k >= sl * L.rank && k < (sl + 1) * L.rank
                     ? __ldg(reinterpret_cast<const uint32_t*>(bb + size_t(n) * L.ld_b + k))
                     : 0u;
        };
        // block h runs k16 steps [lo, hi) (past N: the last slice's, with zero fragments); the first kKPrefetch of
        // them from registers loaded here, with the shrink rows: one DRAM latency, under the stages' copies
        constexpr int kKPrefetch = 2;  // rank 32: every step
        int lo[2], hi[2];
        uint32_t fb[2][kKPrefetch][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n_first = row_blk0 + h * 64;
          lo[h] = slice_of(n_first) * L.rank / 16;
          hi[h] = ((slice_of(min(n_first + 63, N - 1)) + 1) * L.rank + 15) / 16;
#pragma unroll
          for (int jj = 0; jj < kKPrefetch; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) fb[h][jj][e] = lo[h] + jj < hi[h] ? b_frag(h, lo[h] + jj, e) : 0u;
        }
        uint4 v[kStageItems];
        float mv[kStageItems];
#pragma unroll
        for (int c = 0; c < kStageItems; ++c) {  // every load first: one DRAM latency, under the stages' copies
          const int i = tid + c * THREADS;
          const int m = m0 + ((i >> 3) % T);
          const int k0 = (i / (8 * T)) * 64 + (i & 7) * 8;
          const bool ok = lora_here && i < halves * T * 8 && m < M && k0 < R;
          mv[c] = ok ? __bfloat162float(mk[size_t(m) * L.mask_stride]) : 0.0f;
          v[c] = ok ? *reinterpret_cast<const uint4*>(sh + size_t(m) * L.ld_shrunk + k0) : make_uint4(0u, 0u, 0u, 0u);
        }
        const int slot = (g0 + PF) % STAGES;  // not among the prologue's copies; refilled after the loop's first barrier
        uint8_t* stage = smem + slot * C::STAGE_BYTES;
#pragma unroll
        for (int c = 0; c < kStageItems; ++c) {
          const int i = tid + c * THREADS;
          if (i >= halves * T * 8) continue;  // zeros where !lora_here
          stage_masked_shrink(stage + (i / (8 * T)) * T * 128, (i >> 3) % T, i & 7, v[c], mv[c]);
        }
        fence_proxy_async();  // generic-proxy stores, read by wgmma through the async proxy
        __syncthreads();
        if (active) {
          const uint64_t d0 = desc_hi | uint64_t(((smem_base + slot * C::STAGE_BYTES) >> 4) & 0x3FFF);
          wgmma_fence();
          auto k_desc = [&](int j) { return d0 + uint64_t(((j >> 2) * T * 128 + (j & 3) * 32) >> 4); };
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // always kKPrefetch wgmmas (zero fragments past hi, on a staged k-step): a branch around them would
            // serialize the kernel's wgmmas, as above
#pragma unroll
            for (int jj = 0; jj < kKPrefetch; ++jj) wgmma_m64k16_rs<T>(acc[h], fb[h][jj], k_desc(min(lo[h] + jj, hi[h] - 1)));
            for (int j = lo[h] + kKPrefetch; j < hi[h]; ++j) {  // ranks past the registers (rank > 32)
              uint32_t f[4];
#pragma unroll
              for (int e = 0; e < 4; ++e) f[e] = b_frag(h, j, e);
              wgmma_fence();  // f's registers were written since the last wgmma (PTX ISA, wgmma.fence)
              wgmma_m64k16_rs<T>(acc[h], f, k_desc(j));
              // retired before the next step's loads write f's registers (a wgmma reads its A registers
              // asynchronously: PTX ISA, wgmma.mma_async; cuda/nvfp4_gemm_wgmma_wide.cu's LoRA loop says more)
              wgmma_commit();
              wgmma_wait<0>();
            }
          }
          wgmma_commit();
          wgmma_wait<0>();
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < ACC; ++i) reg_fence(acc[h][i]);
          const float inv_alpha = __ldg(gscale) * (1.0f / 128.0f);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < ACC; ++i) acc[h][i] *= inv_alpha;
        }
      }
    }
    auto stage_prologue = [&](int it) {
      const int slot = (g0 + it) % STAGES;
      __syncthreads();  // every warp has retired stage it - 2, whose slot is refilled next
      const int nxt = it + PF;
      if (nxt < count) load_stage((g0 + nxt) % STAGES, nxt);
      QERL_AN_WAIT_BEGIN
      tma::mbar_wait(bar0 + 8 * slot, ((g0 + it) / STAGES) & 1);  // stage it's weights, scales and activations
      QERL_AN_WAIT_END
      return slot;
    };
    if constexpr (kA3) {
      static_assert(WGS == 1, "the rotation assumes one warpgroup (active everywhere)");
      // T = 64: three sets of A registers in rotation, half h = 2 it + t decoding into set h % 3, so the decode of
      // half h only needs half h - 3 retired and the wait after each commit lets two groups stay in flight
      // (kInFlight = 2): the decode of a half overlaps the wgmmas of the two halves before it, as one set with one
      // wait per stage did (racily) before. The loop is unrolled by three stages so that every set index is a
      // constant (stage it % 3 == 0: sets 0, 1; == 1: 2, 0; == 2: 1, 2). Retiring stage it - 2 before the barrier
      // of stage it still holds: after stage it - 1's second commit at most its own two halves are pending.
      auto run_stage = [&](int it, uint32_t(&a0)[2][4][4], uint32_t(&a1)[2][4][4]) {
        const int slot = stage_prologue(it);
        compute_half(slot, 0, a0);
        compute_half(slot, 1, a1);
      };
      int it = 0;
      for (; it + 3 <= count; it += 3) {
        run_stage(it, a3[0], a3[1]);
        run_stage(it + 1, a3[2], a3[0]);
        run_stage(it + 2, a3[1], a3[2]);
      }
      if (it < count) run_stage(it, a3[0], a3[1]);
      if (it + 1 < count) run_stage(it + 1, a3[2], a3[0]);
    } else {
      for (int it = 0; it < count; ++it) {
        const int slot = stage_prologue(it);
        if (active) compute_stage(slot);
      }
    }
    g0 += count;
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < ACC; ++i) reg_fence(acc[h][i]);
    __syncthreads();  // every warp is done with the ring before the next segment refills it
    QERL_AN_LOOP_END

    if constexpr (kCluster) {
      static_assert(cluster_splitk::ReduceLayout<2, ACC, THREADS>::kBytes <= STAGES * C::STAGE_BYTES,
                    "the cluster sums do not fit the ring");
      cluster_splitk::reduce_store<2, ACC, THREADS>(acc, smem, smem_base, ntile * C::TILE_ROWS, m0, M, N, gscale, bias,
                                                    out);
      u = 1;
    } else {
      // ---- the next segment's first PF stages now, into their slots (free: every warp has retired this
      // segment's), when the two slots after them can stage this end's store
      const int u_next = range.after(seg);
      const int free0 = (g0 + PF) % STAGES;
      uint8_t* stage = smem;
      if (u_next < u_end && (kOneSlot || free0 + 1 < STAGES)) {
        const streamk::Segment next = range.segment_at(u_next);
#pragma unroll
        for (int s = 0; s < PF; ++s)
          if (s < next.count()) issue_stage(next, (g0 + s) % STAGES, s);
        prefetched = true;
        stage = smem + free0 * C::STAGE_BYTES;
      }
      // ---- partials and the fix-up (CTAs sharing this tile), then the bf16 store
      wgmma_rs::finish_tile<2, ACC, THREADS, SLOT_FLOATS>(acc, range, ws, counters, s_is_last, tile, my_first_tile,
                                                        ntile * C::TILE_ROWS, m0, M, N, active, gscale, bias, out,
                                                        stage);
      __syncthreads();  // s_is_last is reused by the next segment
      u = u_next;
    }
    QERL_AN_SEGMENT_END
  }
  QERL_AN_EXIT
}
#endif  // QERL_WGMMA_DEVICE

template <int T, bool kCluster>
__global__ void __launch_bounds__(WgCfg<T>::THREADS, WgCfg<T>::CTAS_PER_SM)
    nvfp4_gemm_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, const uint4* __restrict__ qw,
                            const uint4* __restrict__ qs, const float* __restrict__ gscale,
                            const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                            float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                            int units_per_cta) {
#ifdef QERL_WGMMA_DEVICE
  wgmma_body<T, false, kCluster>(x_map, qw, qs, gscale, bias, out, ws, counters, M, N, K, units_per_cta, nullptr);
#else
  __trap();  // not built for sm_90a: the launcher never starts this kernel (qerl_nvfp4_gemm_wgmma_ctas_per_sm = 0)
#endif
}

// The same kernel with the LoRA term as each tile's starting accumulator (T = 64 only:
// qerl_nvfp4_gemm_wgmma_lora_supported). A separate kernel so that the plain one's code stays as measured.
template <int T, bool kCluster>
__global__ void __launch_bounds__(WgCfg<T>::THREADS, WgCfg<T>::CTAS_PER_SM)
    nvfp4_gemm_wgmma_lora_kernel(const __grid_constant__ CUtensorMap x_map, const uint4* __restrict__ qw,
                                 const uint4* __restrict__ qs, const float* __restrict__ gscale,
                                 const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                 float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                 int units_per_cta, const __grid_constant__ QerlLoraEpilogue lora) {
#ifdef QERL_WGMMA_DEVICE
  wgmma_body<T, true, kCluster>(x_map, qw, qs, gscale, bias, out, ws, counters, M, N, K, units_per_cta, &lora);
#else
  __trap();
#endif
}

template <int T, bool kCluster = false>
using WgLauncher = tma::Launcher<nvfp4_gemm_wgmma_kernel<T, kCluster>, T, WgCfg<T>::THREADS, WgCfg<T>::SMEM_BYTES,
                                 WgCfg<T>::TILE_ROWS>;
template <bool kCluster = false>
using WgLoraLauncher = tma::Launcher<nvfp4_gemm_wgmma_lora_kernel<64, kCluster>, 64, WgCfg<64>::THREADS,
                                     WgCfg<64>::SMEM_BYTES, WgCfg<64>::TILE_ROWS>;

// The cluster split-K of the T-token kernel (`lora`: the LoRA kernel at T = 64 with that epilogue, normalized), where
// cluster_splitk::split takes it: 1 and *e the launch's status; else 0 (run stream-K).
template <int T>
int launch_if_cluster(const void* x, const void* qweight, const void* qscale, const float* gscale, const void* bias,
                      void* out, int M, int N, int K, int grid, const QerlLoraEpilogue* lora, cudaStream_t stream,
                      cudaError_t* e) {
  if (T != 64 && lora != nullptr) return 0;  // (no LoRA kernel at T = 128)
  const int tiles = WgLauncher<T>::tiles(M, N);
  int per = 0;
  const int s = lora != nullptr ? cluster_splitk::split<WgLoraLauncher<true>>(tiles, K, grid, &per)
                                : cluster_splitk::split<WgLauncher<T, true>>(tiles, K, grid, &per);
  if (s <= 0) return 0;
  CUtensorMap x_map;
  if ((*e = tma::encode_activations(&x_map, x, M, K, T)) != cudaSuccess) return 1;
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr;
  cluster_splitk::config(&cfg, &attr, s, tiles, WgCfg<T>::THREADS, WgCfg<T>::SMEM_BYTES, stream);
  const auto* w = static_cast<const uint4*>(qweight);
  const auto* sc = static_cast<const uint4*>(qscale);
  const auto* b = static_cast<const __nv_bfloat16*>(bias);
  auto* o = static_cast<__nv_bfloat16*>(out);
  if constexpr (T == 64) {
    if (lora != nullptr) {
      *e = cudaLaunchKernelEx(&cfg, nvfp4_gemm_wgmma_lora_kernel<64, true>, x_map, w, sc, gscale, b, o,
                              static_cast<float*>(nullptr), static_cast<int*>(nullptr), M, N, K, per, *lora);
      return 1;
    }
  }
  *e = cudaLaunchKernelEx(&cfg, nvfp4_gemm_wgmma_kernel<T, true>, x_map, w, sc, gscale, b, o,
                          static_cast<float*>(nullptr), static_cast<int*>(nullptr), M, N, K, per);
  return 1;
}
// The block_t values of the C API below that the wide kernel serves (its 192- / 256-token tiles, and its 128-token
// ones as QERL_WGMMA_WIDE_128: block_t 128 is this file's kernel), and the token tile they mean there.
constexpr bool forwards_to_wide(int block_t) {
  return block_t == 160 || block_t == 192 || block_t == 224 || block_t == 256 || block_t == QERL_WGMMA_WIDE_128;
}
constexpr int wide_tokens(int block_t) { return block_t == QERL_WGMMA_WIDE_128 ? 128 : block_t; }
// Ranks (slices x rank) the LoRA epilogue stages: two k64 halves of the ring slot.
constexpr int kWgLoraMaxRanks = 128;
using WgEntry = streamk::EntryPoints<WgLauncher<64>, WgLauncher<128>>;

}  // namespace
}  // namespace qerl

// The C API of qerl_nvfp4.h, forwarded to this kernel's entry points.
extern "C" cudaError_t qerl_nvfp4_gemm_wgmma_launch(const void* x, const void* qweight, const void* qscale,
                                                    const float* global_scale, const void* bias, void* out,
                                                    float* workspace, int* counters, int M, int N, int K, int grid,
                                                    int block_t, cudaStream_t stream) {
  if (qerl::forwards_to_wide(block_t))
    return qerl_nvfp4_gemm_wgmma_wide_launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N,
                                             K, grid, qerl::wide_tokens(block_t), stream);
  if (block_t == 64 || block_t == 128) {
    cudaError_t e = qerl::streamk::check_launch_args(M, N, K, grid, counters, workspace,
                                                     qerl::WgEntry::workspace_floats(M, N, K, grid, block_t));
    if (e != cudaSuccess) return e;
    const int clustered =
        block_t == 64 ? qerl::launch_if_cluster<64>(x, qweight, qscale, global_scale, bias, out, M, N, K, grid, nullptr,
                                                    stream, &e)
                      : qerl::launch_if_cluster<128>(x, qweight, qscale, global_scale, bias, out, M, N, K, grid,
                                                     nullptr, stream, &e);
    if (clustered) return e;
  }
  return qerl::WgEntry::launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, grid, block_t,
                               stream);
}

extern "C" size_t qerl_nvfp4_gemm_wgmma_workspace_floats(int M, int N, int K, int grid, int block_t) {
  if (qerl::forwards_to_wide(block_t))
    return qerl_nvfp4_gemm_wgmma_wide_workspace_floats(M, N, K, grid, qerl::wide_tokens(block_t));
  return qerl::WgEntry::workspace_floats(M, N, K, grid, block_t);
}

extern "C" int qerl_nvfp4_gemm_wgmma_tiles(int M, int N, int block_t) {
  return qerl::forwards_to_wide(block_t) ? qerl_nvfp4_gemm_wgmma_wide_tiles(M, N, qerl::wide_tokens(block_t))
                                         : qerl::WgEntry::tiles(M, N, block_t);
}

extern "C" int qerl_nvfp4_gemm_wgmma_ctas_per_sm(int block_t) {
  return qerl::forwards_to_wide(block_t) ? qerl_nvfp4_gemm_wgmma_wide_ctas_per_sm(qerl::wide_tokens(block_t))
                                         : qerl::WgEntry::ctas_per_sm(block_t);
}

extern "C" int qerl_nvfp4_gemm_wgmma_lora_supported(int N, int block_t, const QerlLoraEpilogue* lora) {
  QerlLoraEpilogue norm;
  if ((block_t != 64 && !qerl::forwards_to_wide(block_t)) || lora == nullptr || lora->lora_a != nullptr ||
      !qerl::lora_valid(*lora, N, qerl::kWgLoraMaxRanks, &norm))
    return 0;
  if (block_t != 64) return qerl_nvfp4_gemm_wgmma_wide_lora_available(qerl::wide_tokens(block_t));
  return qerl::WgLoraLauncher<>::prepare() == cudaSuccess ? 1 : 0;
}

extern "C" cudaError_t qerl_nvfp4_gemm_wgmma_lora_launch(const void* x, const void* qweight, const void* qscale,
                                                         const float* global_scale, const void* bias, void* out,
                                                         float* workspace, int* counters, int M, int N, int K,
                                                         int grid, int block_t, const QerlLoraEpilogue* lora,
                                                         cudaStream_t stream) {
  QerlLoraEpilogue norm;
  if ((block_t != 64 && !qerl::forwards_to_wide(block_t)) || lora == nullptr || lora->lora_a != nullptr ||
      !qerl::lora_valid(*lora, N, qerl::kWgLoraMaxRanks, &norm))
    return cudaErrorInvalidValue;
  if (block_t != 64)
    return qerl_nvfp4_gemm_wgmma_wide_lora_launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M,
                                                  N, K, grid, qerl::wide_tokens(block_t), &norm, stream);
  cudaError_t e = qerl::streamk::check_launch_args(M, N, K, grid, counters, workspace,
                                                   qerl::WgEntry::workspace_floats(M, N, K, grid, block_t));
  if (e != cudaSuccess) return e;
  if (qerl::launch_if_cluster<64>(x, qweight, qscale, global_scale, bias, out, M, N, K, grid, &norm, stream, &e)) return e;
  return qerl::WgLoraLauncher<>::launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, grid,
                                      stream, false, norm);
}
