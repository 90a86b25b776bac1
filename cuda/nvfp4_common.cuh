// Device helpers shared by the NVFP4 kernels: the E2M1 / scale decoders of the repacked layout and the
// cp.async / ldmatrix / mma.sync wrappers of the GEMM kernels (one definition, no copies per kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "qerl_nvfp4.h"

namespace qerl {

// Bits of a bf16x2 register that one decoded word fills: magnitude (e1 e0 m) at 8..6, sign 15.
constexpr uint32_t kMask = 0x81C081C0u;
constexpr uint32_t kMaskA3Lo = 0x80C080C0u;
constexpr uint32_t kMaskA3Hi = 0x01000100u;

__device__ __forceinline__ uint32_t rotl(uint32_t v, int s) { return __funnelshift_l(v, v, s); }

// One 32-bit word of the repacked layout -> the four bf16x2 registers of an m16n8k16 A fragment,
// still in the "raw" domain: each bf16 is e2m1(code) * 2^-126 (subnormal for |code| = 0.5).
__device__ __forceinline__ void decode_raw(uint32_t w, uint32_t r[4]) {
  r[0] = w & kMask;
  r[1] = rotl(w, 4) & kMask;
  r[2] = rotl(w, 10) & kMask;
  r[3] = (rotl(w, 6) & kMaskA3Lo) | (rotl(w, 14) & kMaskA3Hi);
}

// Scale byte `idx` (0..3) of `word` -> bf16x2 {S, S} with S = scale * 2^119 (exact).
__device__ __forceinline__ uint32_t scale_pair(uint32_t word, int idx) {
  const uint32_t v = __byte_perm(word, 0u, 0x4040u | (uint32_t(idx) << 8) | uint32_t(idx));
  return v * 16u + 0x70007000u;
}

// Scale bytes idx and idx+1 of `word` -> bf16x2 {S(idx), S(idx+1)}, each scale * 2^119 (exact).
__device__ __forceinline__ uint32_t scale_two(uint32_t word, int idx) {
  const uint32_t v = __byte_perm(word, 0u, 0x4040u | (uint32_t(idx + 1) << 8) | uint32_t(idx));
  return v * 16u + 0x70007000u;
}

// a * {lo(s), lo(s)} and a * {hi(s), hi(s)}: the half broadcast is an operand selector of HMUL2.
__device__ __forceinline__ uint32_t bf16x2_mul_lo(uint32_t a, uint32_t s) {
  const __nv_bfloat162 sv = *reinterpret_cast<const __nv_bfloat162*>(&s);
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), __low2bfloat162(sv));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t bf16x2_mul_hi(uint32_t a, uint32_t s) {
  const __nv_bfloat162 sv = *reinterpret_cast<const __nv_bfloat162*>(&s);
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), __high2bfloat162(sv));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Scale byte -> float32 scale (exact); 0 -> 0.
__device__ __forceinline__ float scale_from_byte(uint32_t b) {
  const float s = __uint_as_float(((b << 4) | 0x7000u) << 16) * 0x1p-119f;
  return b == 0u ? 0.0f : s;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                             *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Upper or lower bf16 of a raw register -> the exact e2m1 value in float32.
__device__ __forceinline__ float raw_half_to_float(uint32_t r, int half) {
  const uint32_t bits = half ? (r & 0xFFFF0000u) : (r << 16);
  return __uint_as_float(bits) * 0x1p126f;
}

template <typename T>
struct OutPair;
template <>
struct OutPair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ __forceinline__ static type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct OutPair<__half> {
  using type = __half2;
  __device__ __forceinline__ static type make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <>
struct OutPair<float> {
  using type = float2;
  __device__ __forceinline__ static type make(float a, float b) { return make_float2(a, b); }
};

// ---- async copies, ldmatrix and the bf16 MMA (the GEMM kernels: nvfp4_gemm.cu, nvfp4_gemm_streamk.cu)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy to a shared address; src_bytes 0 zero-fills (nothing is read).
__device__ __forceinline__ void cp_async16_u32(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix x4 from a shared-space address. Prefer it in hot loops: the generic-pointer form below converts
// generic -> shared, which on sm_90 reads the CTA's cluster id with a long-latency S2R whenever ptxas does not
// hoist it.
__device__ __forceinline__ void ldmatrix_x4_u32(uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3,
                                                uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3,
                                            const void* p) {
  ldmatrix_x4_u32(d0, d1, d2, d3, smem_u32(p));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t& d0, uint32_t& d1, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(d0), "=r"(d1)
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}

// k16 step j (0..3) of a warp's 16-row x 64-K block of the repacked layout (this lane's 16 bytes wv, its two rows'
// 8 scale bytes sv) -> the scaled A fragment: e2m1 * scale / 128 as bf16x2 (the wgmma kernels' per-step decode).
__device__ __forceinline__ void decode_scaled(const uint4& wv, const uint2& sv, int j, uint32_t (&a)[4]) {
  const uint32_t s2 = scale_two(j < 2 ? sv.x : sv.y, (j & 1) * 2);  // {S(row r), S(row r + 8)}
  decode_raw(word_of(wv, j), a);
  a[0] = bf16x2_mul_lo(a[0], s2);
  a[1] = bf16x2_mul_hi(a[1], s2);
  a[2] = bf16x2_mul_lo(a[2], s2);
  a[3] = bf16x2_mul_hi(a[3], s2);
}

// ---- programmatic dependent launch (PDL, sm_90+; benchmarks/NOTES.md "Sixth round")
//
// A kernel launched with launch_kernel(..., pdl = true) may start while the kernel before it on the stream is still
// running (with no explicit trigger there, from when that kernel's last CTAs exit; a trigger at the start of the
// LoRA shrink measured slower, NOTES "Sixth round"). Until wait_prior_grid() returns it may only read what the
// previous kernel cannot be writing and the caller promised stays unchanged: the weights, scales and LoRA B.
// Activations, `shrunk`, the mask, the bias, the workspace, the counters and the output (whose memory the allocator
// may have handed over from a tensor the previous kernel still reads) come after it. Without the launch attribute,
// and below sm_90, the wait is a no-op.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// (host) Launch `kernel` on `stream`, as a programmatic dependent launch when `pdl` (the kernel must then keep the
// wait_prior_grid() rule above; the caller passes pdl only on sm_90+ devices).
template <class... Params, class... Args>
inline cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                 cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

// ---- the pipeline both GEMM kernels drive (one definition: a fix to the ring protocol reaches both)

// Streams `count` K stages through a STAGES-deep cp.async ring: STAGES - 1 stages in flight ahead of the one
// computed. load(buf, stage) issues one stage's copies into ring slot buf; compute(buf) consumes slot buf.
// kLoadAfterCompute issues the next stage's copies after computing the current one instead of before: the
// slot it refills was consumed in the previous iteration either way (every warp has passed this iteration's
// barrier), so only the order within the iteration changes. Why: a burst of cp.async right before the MMAs
// holds its address registers until the load/store unit accepts them, and a register-tight kernel then
// stalls on reusing them (stream-K at 246 registers: 7% of warp samples on that write-after-read wait).
// Returns with the ring drained and every warp past a barrier, so the caller may reuse the shared memory.
//
// With a `load_early` (run_cp_async_ring_after_prior) the prologue issues stage 0's load_early (its weights and
// scales) before it waits for the prior grid (PDL), then stage 0's `load` (its activations); every other stage issues
// both together. Each commit group still holds one stage's copies. Only stage 0's: issuing the first STAGES - 1
// stages' weights before the wait put them all in group 0, so the first MMA waited for all of them (7B o at M = 1
// 7.6 -> 8.2 us without PDL, NOTES "Sixth round").
template <int STAGES, bool kLoadAfterCompute, bool kWaitPrior, class LoadEarly, class Load, class Compute>
__device__ __forceinline__ void run_cp_async_ring_impl(int count, LoadEarly&& load_early, Load&& load,
                                                       Compute&& compute) {
  if constexpr (kWaitPrior) {
    if (count > 0) load_early(0, 0);
    wait_prior_grid();
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < count) {
      if (!kWaitPrior || s > 0) load_early(s, s);
      load(s, s);
    }
    cp_async_commit();
  }
  for (int it = 0; it < count; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nxt = it + STAGES - 1;
    if constexpr (kLoadAfterCompute) compute(it % STAGES);
    if (nxt < count) {
      load_early(nxt % STAGES, nxt);
      load(nxt % STAGES, nxt);
    }
    cp_async_commit();
    if constexpr (!kLoadAfterCompute) compute(it % STAGES);
  }
  cp_async_wait<0>();
  __syncthreads();
}

template <int STAGES, bool kLoadAfterCompute = false, class Load, class Compute>
__device__ __forceinline__ void run_cp_async_ring(int count, Load&& load, Compute&& compute) {
  run_cp_async_ring_impl<STAGES, kLoadAfterCompute, false>(count, [](int, int) {}, load, compute);
}

template <int STAGES, class LoadEarly, class Load, class Compute>
__device__ __forceinline__ void run_cp_async_ring_after_prior(int count, LoadEarly&& load_early, Load&& load,
                                                              Compute&& compute) {
  run_cp_async_ring_impl<STAGES, false, true>(count, load_early, load, compute);
}

// The two k-half warps of an output fragment set (kh = 0 / 1, same rt in 0..127) sum their accumulators
// through `red` (NB * MT * 4 * 128 floats of free shared memory): afterwards kh == 0 holds the total. `sync` is the
// barrier over the warps taking part (the CTA; the decode kernel's consumer warps).
template <int NB, int MT, class Sync>
__device__ __forceinline__ void sum_k_halves(float (&acc)[NB][MT][4], float* red, int kh, int rt, Sync&& sync) {
  if (kh == 1) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int c = 0; c < 4; ++c) red[((nb * MT + mt) * 4 + c) * 128 + rt] = acc[nb][mt][c];
  }
  sync();
  if (kh == 0) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nb][mt][c] += red[((nb * MT + mt) * 4 + c) * 128 + rt];
  }
}

// ---- the warp's share of a 128-row stage (the split-K and decode kernels: warp rows 32 wn .., k64 half kh)

// This warp's two n16 blocks of the stage in shared memory (wsm: its 8 KB of weights, ssm: its 1 KB of scales): the
// lane's 16 weight bytes and 8 scale bytes of each.
__device__ __forceinline__ void load_warp_blocks(const uint4* wsm, const uint2* ssm, int wn, int kh, int lane,
                                                 uint4 (&wv)[2], uint2 (&sv)[2]) {
#pragma unroll
  for (int nbw = 0; nbw < 2; ++nbw) {
    const int blk = (wn * 2 + nbw) * (QERL_GEMM_BK / 64) + kh;
    wv[nbw] = wsm[blk * 32 + lane];
    sv[nbw] = ssm[blk * 8 + (lane >> 2)];
  }
}

// k16 step j of the warp's two blocks: decode each block's A fragment and multiply it with the MT token tiles' B
// fragments.
template <int MT>
__device__ __forceinline__ void mma_k16_step(const uint4 (&wv)[2], const uint2 (&sv)[2], int j,
                                             const uint32_t (&b)[MT][2], float (&acc)[2][MT][4]) {
#pragma unroll
  for (int nbw = 0; nbw < 2; ++nbw) {
    uint32_t a[4];
    decode_scaled(wv[nbw], sv[nbw], j, a);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mma_bf16(acc[nbw][mt], a, b[mt]);
  }
}

// ---- split-K / stream-K partials and the bf16 epilogue (both GEMM kernels)

// Writes this thread's accumulators as float4 partials (fragment set (nb, mt) at dst[(nb * MT + mt) * 128 + rt]),
// only for token rows that exist (M = 1: a quarter of them).
template <int NB, int MT>
__device__ __forceinline__ void store_partial(const float (&acc)[NB][MT][4], float4* dst, int m0, int lane, int rt,
                                              int M) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      if (m0 + mt * 8 + (lane & 3) * 2 < M)
        dst[(nb * MT + mt) * 128 + rt] = make_float4(acc[nb][mt][0], acc[nb][mt][1], acc[nb][mt][2], acc[nb][mt][3]);
}

// After this CTA published its partial: counts its arrival and returns, in every thread, whether it is the last
// of `arrivals` on counters[index]. `sync` is a barrier over the threads taking part (the CTA, or the warpgroups
// holding the accumulators), `leader` one of them, `flag` a __shared__ int.
// Ordering (PTX memory model): the barrier puts every participating thread's partial stores before the leader's
// atomic; the atomic is acq_rel at GPU scope and fences are cumulative, so it releases all of them, and for the last
// arrival it acquires every other CTA's released partials; the second barrier passes that on to the threads that
// read them back. One fence by one thread, where a __threadfence() in every thread (MEMBAR.SC.GPU, plus an L1
// invalidate each) cost ~4 % of the wgmma kernel's warp samples at M = 64 (benchmarks/NOTES.md, v6.8).
template <class Sync>
__device__ __forceinline__ bool arrive_last(int* counters, int index, int arrivals, bool leader, int& flag,
                                            Sync&& sync) {
  sync();
  if (leader) {
    int prev;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counters + index) : "memory");
    flag = (prev == arrivals - 1);
  }
  sync();
  return flag != 0;
}

// The same over the whole CTA (thread 0 counts).
__device__ __forceinline__ bool arrive_last(int* counters, int index, int arrivals, int tid, int& flag) {
  return arrive_last(counters, index, arrivals, tid == 0, flag, [] { __syncthreads(); });
}

// What store_bf16 adds to a value before its rounding: nothing (the plain GEMM; no instruction is emitted for it), or
// a tile of extra terms (the LoRA epilogue's LoraTile, cuda/lora_epilogue.cuh).
struct NoAddend {
  static constexpr bool kActive = false;
  __device__ __forceinline__ float operator()(int, int) const { return 0.0f; }
};

// out[m, n] = bf16(acc * alpha + bias[n] (+ addend(m - m0, n))) for the rows m < M and columns n < N this thread
// holds: fragment set (nb, mt) covers columns (blk0 + nb) * 16 + lane / 4 (+ 8) and rows m0 + mt * 8 + 2 * (lane % 4)
// (+ 1).
template <int NB, int MT, class Addend = NoAddend>
__device__ __forceinline__ void store_bf16(const float (&acc)[NB][MT][4], __nv_bfloat16* out,
                                           const __nv_bfloat16* bias, float alpha, int blk0, int m0, int lane, int M,
                                           int N, const Addend& addend = {}) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = (blk0 + nb) * 16 + (lane >> 2) + 8 * h;
      if (n >= N) continue;
      const float bv = bias != nullptr ? __bfloat162float(bias[n]) : 0.0f;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = mt * 8 + (lane & 3) * 2 + e;
          if (m0 + t < M) {
            float v = acc[nb][mt][2 * h + e] * alpha + bv;
            if constexpr (Addend::kActive) v += addend(t, n);
            out[size_t(m0 + t) * N + n] = __float2bfloat16_rn(v);
          }
        }
      }
    }
  }
}

}  // namespace qerl
