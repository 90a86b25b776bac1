// FP4 x BF16 GEMM (W4A16, NVFP4 weights) on Hopper's warpgroup MMA with both operands in shared memory
// (`wgmma.mma_async` SS form), warp-specialized. sm_90a only: built into the extension only when the build targets
// sm_90a (QERL_HAVE_SM90A, set by verl_qerl/kernels/build.py); elsewhere the launcher reports cudaErrorNotSupported
// and the op runs other kernels.
//
// Why (benchmarks/NOTES.md, "wgmma SS"): the register-A wgmma kernel (cuda/nvfp4_gemm_wgmma.cu) decodes the weights
// in the warps that issue the MMAs, so decode, the tensor work and the waits for it add up per stage. Here the
// weights are decoded once per tile into shared memory by their own warpgroups, and the MMA warpgroups only issue
// wgmmas that read both operands from shared memory: the three kinds of work overlap through mbarrier rings.
//  * Roles: tokens are wgmma's M side (64 per MMA warpgroup), the dequantized weight rows its N side (n256, the
//    most efficient shape); out[token, n] = sum_k x[token, k] W[n, k], accumulator rows are tokens.
//  * CTA tile: 256 weight rows (the repacked 128-row tiles 2t, 2t + 1) x T tokens (64 or 128), 3 warpgroups:
//      first NDQ warpgroups dequant: E2M1 -> bf16 and the per-16 scale (decode_raw / scale_two of the repacked
//                           layout) from a raw ring slot, stored with stmatrix into a bf16 ring slot (256 rows x
//                           64 K, wgmma's 128-byte-swizzled K-major layout: row n at n * 128 B, 16-byte chunk q at
//                           (q ^ n % 8) * 16), then fence.proxy.async and an arrive on full_b;
//      last NMMA warpgroups MMA: warpgroup w multiplies tokens 64 w .. 64 w + 63 (A, from the raw slot's
//                           activations) by the 256 dequantized rows (B): 4 m64n256k16 per 64-K half stage, one
//                           commit group per half, wait_group 1, then releases the previous half's bf16 slot
//                           (empty_b) and, after a stage's second half, its raw slot (empty_raw). They also load:
//                           after the first half of stage g they issue the cp.async of stage g + RAW - 1 (packed
//                           weights 16 KB, scale bytes 2 KB, activations T x 256 B, same 128-byte swizzle) into
//                           the slot stage g - 1 used, with cp.async.mbarrier.arrive on full_raw.
//    Why the MMA warps load and the dequant warps do not: fence.proxy.async compiles to MEMBAR.ALL.CTA, which
//    waits for the thread's in-flight cp.async, so a dequant warp with loads in flight waits a DRAM latency at
//    every fence (measured: ~2 us per stage). The MMA warps need no fence: the dequant warps waited for the
//    activations on full_raw and fence before their full_b arrive, which the MMA warps wait on.
//    T = 64: NDQ = 2, NMMA = 1; T = 128: NDQ = 1, NMMA = 2 (both MMA warpgroups read the same bf16 tile, so one
//    decode serves 128 tokens). 384 threads: 168 registers each, enough for the 128 FP32 accumulators of
//    m64n256 (ptxas allocates one register budget for the whole kernel, setmaxnreg or not, so a fourth warpgroup
//    -- a separate producer -- would cap every thread at 128 and the wgmma does not compile).
//  * Persistent stream-K as the register-A wgmma kernel: the (n tile, m tile, k stage) units are cut into equal
//    contiguous ranges (at least kMinUnitsPerCta per CTA, so a small GEMM is not cut into slivers whose pipeline
//    fill and fix-up dominate), one per CTA; a partial segment writes FP32 partials to workspace slot (CTA, first /
//    last tile of its range) and the last arriving segment of a tile sums all partials in CTA order
//    (deterministic), then runs the epilogue: acc * (128 / global_scale) + bias -> bf16, rows < M and < N only.
//    Only the MMA warpgroups take part in the fix-up (named barrier 1): the dequant warpgroups (and the loads in
//    flight) run on into the next segment meanwhile. Tiles are ordered n-major (consecutive CTAs share a weight
//    tile at large M, which L2 then serves once).
#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"
#include "streamk_schedule.cuh"
#include "wgmma_sm90.cuh"

namespace qerl {
namespace {

constexpr int SS_BN = streamk::kTileRows;  // 256 weight rows per CTA tile
constexpr int SS_BK = streamk::kStageK;    // K per raw stage (128)
constexpr int SS_THREADS = 384;          // 3 warpgroups
constexpr int W_TILE_BYTES = (QERL_GEMM_BN / 16) * (SS_BK / 64) * 512;  // one 128-row tile, one stage: 8 KB
constexpr int S_TILE_BYTES = (QERL_GEMM_BN / 16) * (SS_BK / 64) * 64;   // 1 KB
constexpr int RAW_S_OFF = 2 * W_TILE_BYTES;                             // scale bytes after both tiles' weights
constexpr int RAW_X_OFF = RAW_S_OFF + 2 * S_TILE_BYTES;                 // activations after the scales
constexpr int B_SLOT_BYTES = SS_BN * 64 * 2;                            // bf16 weights, 256 rows x 64 K: 32 KB
constexpr int kMinUnitsPerCta = 8;                                      // see the schedule note above

template <int T>
struct SsCfg {
  static_assert(T == 64 || T == 128, "wgmma SS kernel: T = 64 or 128 tokens per tile");
  static constexpr int NMMA = T / 64;            // MMA warpgroups (64 tokens each)
  static constexpr int NDQ = T == 64 ? 2 : 1;    // dequant warpgroups (the first also loads)
  static_assert(NDQ + NMMA == SS_THREADS / 128, "three warpgroups");
  static constexpr int RAW_BYTES = RAW_X_OFF + T * SS_BK * 2;
  // ring slots: raw (128-K stages) and bf16 (64-K halves). Three bf16 slots let the dequant warps run two halves
  // ahead of the MMA warps (with two, each half waited for the previous half's release: measured 40% of the
  // dequant warps' samples on that wait); T = 128 has room for two only
  static constexpr int RAW = 3;
  static constexpr int BSLOTS = T == 64 ? 3 : 2;
  // + 1 KB: the ring starts at the first 1024-byte boundary (the 128-byte swizzle repeats every 1024 bytes and is
  // anchored to absolute shared addresses)
  static constexpr int SMEM_BYTES = RAW * RAW_BYTES + BSLOTS * B_SLOT_BYTES + 1024;
  static_assert(RAW_BYTES % 1024 == 0 && RAW_X_OFF % 1024 == 0, "swizzled blocks must stay 1024-byte aligned");
  static_assert(SMEM_BYTES <= 227 * 1024 - 256, "rings larger than Hopper's per-CTA shared memory");
};

#ifdef QERL_WGMMA_DEVICE
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits until the phase of `bar` with parity `parity` has completed (a C++ loop: the compiler sees the divergence
// and reconverges the warp before the next .aligned instruction).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// Arrives on `bar` once every cp.async this thread issued before has completed (one of the expected arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Barrier of the MMA warpgroups only (named barrier 1).
// threadIdx.x read afresh (volatile: not kept in a register across the code between uses)
__device__ __forceinline__ int fresh_tid() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}
__device__ __forceinline__ void mma_sync(int threads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
}
// Four 8x8 bf16 matrices to shared memory: register i of lane l holds row l / 4, columns 2 (l % 4), +1 of matrix
// i (the mma fragment layout); lanes 8 i .. 8 i + 7 give the addresses of matrix i's rows (16 bytes each).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// D[64 x 256] += A[64 x 16] x B[16 x 256], both bf16 in shared memory (K-major, descriptors), FP32 accumulators.
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " QERL_WGMMA_D128_PTX
      ", %128, %129, p, 1, 1, 0, 0;\n}\n"
      : QERL_WGMMA_D128_OPS(d)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}
#endif  // QERL_WGMMA_DEVICE

template <int T>
__global__ void __launch_bounds__(SS_THREADS, 1)
    nvfp4_gemm_wgmma_ss_kernel(const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ qw,
                               const uint4* __restrict__ qs, const float* __restrict__ gscale,
                               const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                               float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                               int units_per_cta) {
#ifdef QERL_WGMMA_DEVICE
  using C = SsCfg<T>;
  constexpr int RAW = C::RAW;
  constexpr int BSLOTS = C::BSLOTS;
  constexpr int NDQ = C::NDQ;
  constexpr int NMMA = C::NMMA;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * RAW + 2 * BSLOTS];
  __shared__ int s_is_last;

  const int tid = threadIdx.x;
  const int S = K / SS_BK;
  const int tiles_128 = (N + QERL_GEMM_BN - 1) / QERL_GEMM_BN;
  const int n_tiles = (N + SS_BN - 1) / SS_BN;
  const int m_tiles = (M + T - 1) / T;
  const streamk::CtaRange range(n_tiles * m_tiles * S, S, units_per_cta);
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint8_t* smem = smem_raw + (smem_base - smem_u32(smem_raw));
  const uint32_t b_base = smem_base + RAW * C::RAW_BYTES;  // bf16 ring
  const uint32_t full_raw = smem_u32(&bars[0]);
  const uint32_t empty_raw = full_raw + 8 * RAW;
  const uint32_t full_b = empty_raw + 8 * RAW;
  const uint32_t empty_b = full_b + 8 * BSLOTS;
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < RAW; ++i) {
      mbar_init(full_raw + 8 * i, 128 * NMMA);             // the MMA threads' cp.async arrivals
      mbar_init(empty_raw + 8 * i, 128 * (NDQ + NMMA));    // dequant done reading weights, MMA done with acts
    }
#pragma unroll
    for (int i = 0; i < BSLOTS; ++i) {
      mbar_init(full_b + 8 * i, 128 * NDQ);   // dequant threads
      mbar_init(empty_b + 8 * i, 128 * NMMA); // MMA threads, after their wgmmas reading the slot completed
    }
  }
  __syncthreads();

  // warp-uniform role (the shuffle tells the compiler so: the wgmmas must not sit on a possibly divergent path)
  const int role = __shfl_sync(0xffffffffu, tid >> 7, 0);
  if (role < NDQ) {
    // ================= dequant (raw slot -> bf16 ring, two 64-K halves per stage). Its proxy fence after the
    // stores also covers the slot's activations (cp.async writes it has seen land through full_raw), which the MMA
    // warpgroups read only after full_b. These warps issue no cp.async: the fence (a MEMBAR) would wait for them.
    constexpr int NDQW = 4 * NDQ;      // dequant warps
    constexpr int BPW = 16 / NDQW;     // n16 blocks per warp per half (16 blocks: 2 tiles x 8)
    const int lane = tid & 31;
    const int dw = tid >> 5;           // dequant warp
    // stmatrix row addresses: lane l gives row l % 8 of matrix l / 8 = (rows 8 (mi % 2) .., chunk 2 j + mi / 2)
    const int mi = lane >> 3, ri = lane & 7;
    uint32_t lane_off[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      lane_off[j] = uint32_t(ri + 8 * (mi & 1)) * 128 + ((uint32_t(2 * j + (mi >> 1)) ^ uint32_t(ri)) << 4);

    int g = 0;
    for (int u = range.begin; u < range.end;) {
      const streamk::Segment seg = range.segment_at(u);
      for (int s_rel = 0; s_rel < seg.count(); ++s_rel, ++g) {
        const int slot = g % RAW;
        mbar_wait(full_raw + 8 * slot, (g / RAW) & 1);
        const uint8_t* raw = smem + slot * C::RAW_BYTES;
#pragma unroll
        for (int t = 0; t < 2; ++t) {  // k64 half
          const int hb = 2 * g + t;
          const int bs = hb % BSLOTS;
          mbar_wait(empty_b + 8 * bs, ((hb / BSLOTS) & 1) ^ 1);
          const uint32_t bdst = b_base + bs * B_SLOT_BYTES;
#pragma unroll
          for (int k = 0; k < BPW; ++k) {
            const int bi = dw + NDQW * k;  // block: tile bi / 8, n16 block bi % 8
            const int h = bi >> 3, b = bi & 7;
            const uint4 wv = *reinterpret_cast<const uint4*>(raw + h * W_TILE_BYTES + (b * 2 + t) * 512 + lane * 16);
            const uint2 sv =
                *reinterpret_cast<const uint2*>(raw + RAW_S_OFF + h * S_TILE_BYTES + (b * 2 + t) * 64 + (lane >> 2) * 8);
            const uint32_t dst = bdst + uint32_t(h * 128 + b * 16) * 128;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              uint32_t a[4];
              decode_scaled(wv, sv, j, a);
              stmatrix_x4(dst + lane_off[j], a);
            }
          }
          fence_proxy_async();  // these generic-proxy stores are read by the tensor core (async proxy)
          mbar_arrive(full_b + 8 * bs);
        }
        mbar_arrive(empty_raw + 8 * slot);  // this warpgroup is done reading the slot's weights and scales
      }
      u = range.after(seg);
    }
  } else {
    // ================= MMA: wgmma over the rings, partials, fix-up, epilogue
    const int mw = role - NDQ;       // MMA warpgroup: tokens 64 mw .. 64 mw + 63 of the tile
    const int mt = tid - 128 * NDQ;  // 0 .. 128 NMMA - 1
    const int ltid = mt & 127;
    const int lane = tid & 31;
    // descriptors (SBO = the next 8 tokens of A / weight rows of B); the start address is added per k16 step
    const uint64_t desc_hi = kWgmmaDescSwizzle128;
    int g = 0;
    // releases the slots of half-stage batch hb once its wgmmas completed
    auto release = [&](int hb) {
      mbar_arrive(empty_b + 8 * (hb % BSLOTS));
      if (hb & 1) mbar_arrive(empty_raw + 8 * ((hb >> 1) % RAW));  // a stage's second half: its activations
    };

    // ---- loads (the MMA warpgroups issue them: their wgmma waits need no memory fence, so in-flight cp.async
    // cost them nothing). Stage lg of the CTA's range (unit range.begin + lg: the range is contiguous) goes to slot
    // lg % RAW once that slot's previous stage was released; the loads run RAW - 1 stages ahead of the MMA loop,
    // across segments.
    constexpr int NL = 128 * NMMA;  // loading threads
    auto load_stage = [&](int lg) {
      const int lu = range.begin + lg;
      if (lu >= range.end) return;
      const int pt = mt;
      const streamk::Segment seg = range.segment_at(lu);
      const int tile = seg.tile;
      const int kk = seg.kb;  // k stage
      const int ntile = tile / m_tiles;
      const int m0 = (tile - ntile * m_tiles) * T;
      const bool has_hi = 2 * ntile + 1 < tiles_128;
      const int slot = lg % RAW;
      mbar_wait(empty_raw + 8 * slot, ((lg / RAW) & 1) ^ 1);  // first round: passes at once
      const uint32_t base = smem_base + slot * C::RAW_BYTES;
      const uint4* w = qw + (size_t(2 * ntile) * S + kk) * (W_TILE_BYTES / 16) + pt;
#pragma unroll
      for (int i = 0; i < 512 / NL; ++i) cp_async16_u32(base + (pt + NL * i) * 16, w + NL * i, 16);
      // a missing second tile (N % 256 <= 128) is zero-filled (src-size 0 reads nothing; qw stands in)
      const uint4* w1 = w + size_t(S) * (W_TILE_BYTES / 16);
#pragma unroll
      for (int i = 0; i < 512 / NL; ++i)
        cp_async16_u32(base + W_TILE_BYTES + (pt + NL * i) * 16, has_hi ? w1 + NL * i : qw, has_hi ? 16 : 0);
      if (pt < 128) {
        const int s_h = pt >> 6;  // scale chunk pt: tile s_h, chunk pt % 64
        const bool s_ok = s_h == 0 || has_hi;
        const uint4* sc = qs + (size_t(2 * ntile + s_h) * S + kk) * (S_TILE_BYTES / 16) + (pt & 63);
        cp_async16_u32(base + RAW_S_OFF + pt * 16, s_ok ? sc : qs, s_ok ? 16 : 0);
      }
      // activation chunk pt + NL i: token row x_row0 + (NL / 16) i, k chunk x_kc; in shared memory k64 half
      // x_kc / 8 at (x_kc / 8) T 128, row r at r 128, its chunk x_kc % 8 at ((x_kc % 8) ^ (r % 8)) 16 (r % 8 =
      // x_row0 % 8). Token rows past M load row M - 1 instead (no branch): a token row of A only reaches the same
      // row of the accumulators, which are neither stored nor summed for rows >= M.
      const int x_row0 = pt >> 4;
      const int x_kc = pt & 15;
      const uint32_t x_dst = base + RAW_X_OFF + (x_kc >> 3) * (T * 128) + x_row0 * 128 +
                             ((uint32_t(x_kc & 7) ^ uint32_t(x_row0 & 7)) << 4);
      const __nv_bfloat16* xs = x + size_t(kk) * SS_BK + x_kc * 8;
      const int r0 = m0 + x_row0;
#pragma unroll
      for (int i = 0; i < T * 16 / NL; ++i) {
        const int r = min(r0 + (NL / 16) * i, M - 1);
        cp_async16_u32(x_dst + i * (NL / 16) * 128, xs + size_t(r) * K, 16);
      }
      cp_async_mbar_arrive(full_raw + 8 * slot);  // arrives once this thread's copies above have landed
    };
    for (int i = 0; i < RAW - 1; ++i) load_stage(i);
    for (int u = range.begin; u < range.end;) {
      const streamk::Segment seg = range.segment_at(u);
      const int tile = seg.tile;
      const int count = seg.count();

      float acc[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;

      for (int it = 0; it < count; ++it, ++g) {
        const int slot = g % RAW;
        // the activations of stage g: full_b of its halves implies they landed (the dequant warps waited for them
        // on full_raw and fenced the async proxy before arriving)
        const uint32_t a_addr = smem_base + slot * C::RAW_BYTES + RAW_X_OFF + mw * 64 * 128;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int hb = 2 * g + t;
          const int bs = hb % BSLOTS;
          mbar_wait(full_b + 8 * bs, (hb / BSLOTS) & 1);
          const uint64_t da = desc_hi | uint64_t(((a_addr + t * T * 128) >> 4) & 0x3FFF);
          const uint64_t db = desc_hi | uint64_t(((b_base + bs * B_SLOT_BYTES) >> 4) & 0x3FFF);
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < 4; ++j) wgmma_m64n256k16_ss(acc, da + uint64_t(2 * j), db + uint64_t(2 * j));
          wgmma_commit();
          wgmma_wait<1>();  // everything but this batch is done
          if (it > 0 || t > 0) release(hb - 1);  // the segment's batches are consecutive
          // after the first half's wait the previous stage's slot is released: refill it with stage g + RAW - 1
          if (t == 0) load_stage(g + RAW - 1);
        }
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) reg_fence(acc[i]);
      release(2 * g - 1);  // the segment's last batch (g is past the segment now)

      // ---- partials and the fix-up (CTAs c_first .. c_last share this tile). acc[4 q + 2 rh + e] is token
      // row_g + 8 rh, weight row ntile 256 + 8 q + 2 (lane % 4) + e
      // (recomputed where used: the fix-up's loads need every register)
      auto row_of = [&]() {  // m0 + 64 mw + 16 wl + lane / 4
        const int t = fresh_tid() - 128 * NDQ;
        return (tile % m_tiles) * T + 16 * (t >> 5) + ((t & 31) >> 2);
      };
      const int row_g = row_of();
      const bool do_store = streamk::finish_segment(
          range, counters, tile, mt == 0, s_is_last, [] { mma_sync(128 * NMMA); },
          [&] {
            float4* mine =
                streamk::partial_slot<T * SS_BN>(ws, blockIdx.x, range.my_slot(tile)) + mw * 32 * 128 + ltid;
            if (row_g < M) {
#pragma unroll
              for (int q = 0; q < 32; ++q)
                mine[q * 128] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
            }
          },
          [&](int c_first, int c_last) {
#pragma unroll
            for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
            if (row_of() < M) {
              streamk::for_each_partial<T * SS_BN>(range, ws, tile, c_first, c_last, [&](const float4* slot) {
                const float4* part = slot + mw * 32 * 128 + ltid;
#pragma unroll
                for (int q = 0; q < 32; ++q) {
                  const float4 v = __ldcg(part + q * 128);
                  acc[4 * q] += v.x;
                  acc[4 * q + 1] += v.y;
                  acc[4 * q + 2] += v.z;
                  acc[4 * q + 3] += v.w;
                }
              });
            }
          });

      // ---- epilogue: out[token, n] = acc * 128 / global_scale + bias[n], tokens < M and n < N only
      if (do_store && row_of() < M) {
        const float alpha = __fdiv_rn(128.0f, __ldg(gscale));
        const int n0 = (tile / m_tiles) * SS_BN + 2 * (lane & 3);
#pragma unroll
        for (int q = 0; q < 32; ++q) {
          const int n = n0 + 8 * q;
          if (n >= N) continue;  // N % 16 == 0: n + 1 < N too
          const float b0 = bias != nullptr ? __bfloat162float(bias[n]) : 0.0f;
          const float b1 = bias != nullptr ? __bfloat162float(bias[n + 1]) : 0.0f;
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) {
            const int m = row_of() + 8 * rh;
            if (m < M)
              *reinterpret_cast<__nv_bfloat162*>(out + size_t(m) * N + n) =
                  __floats2bfloat162_rn(acc[4 * q + 2 * rh] * alpha + b0, acc[4 * q + 2 * rh + 1] * alpha + b1);
          }
        }
      }
      mma_sync(128 * NMMA);  // s_is_last is reused by the next segment
      u = range.after(seg);
    }
  }
#else
  __trap();  // not built for sm_90a: the launcher never starts this kernel (ctas_per_sm = 0)
#endif
}

template <int T>
using SsLauncher = streamk::Launcher<nvfp4_gemm_wgmma_ss_kernel<T>, T, SS_THREADS, SsCfg<T>::SMEM_BYTES,
                                     streamk::Target::kSm90aOnly, kMinUnitsPerCta>;
using SsEntry = streamk::EntryPoints<SsLauncher<64>, SsLauncher<128>>;

}  // namespace
}  // namespace qerl

// The C API of qerl_nvfp4.h, forwarded to this kernel's entry points.
extern "C" cudaError_t qerl_nvfp4_gemm_wgmma_ss_launch(const void* x, const void* qweight, const void* qscale,
                                                       const float* global_scale, const void* bias, void* out,
                                                       float* workspace, int* counters, int M, int N, int K, int grid,
                                                       int block_t, cudaStream_t stream) {
  return qerl::SsEntry::launch(x, qweight, qscale, global_scale, bias, out, workspace, counters, M, N, K, grid, block_t,
                               stream);
}

extern "C" size_t qerl_nvfp4_gemm_wgmma_ss_workspace_floats(int M, int N, int K, int grid, int block_t) {
  return qerl::SsEntry::workspace_floats(M, N, K, grid, block_t);
}

extern "C" int qerl_nvfp4_gemm_wgmma_ss_tiles(int M, int N, int block_t) { return qerl::SsEntry::tiles(M, N, block_t); }

extern "C" int qerl_nvfp4_gemm_wgmma_ss_ctas_per_sm(int block_t) { return qerl::SsEntry::ctas_per_sm(block_t); }
