// The LoRA expand of one GEMM output tile, for the epilogues of the split-K kernel (cuda/nvfp4_gemm.cu) and the
// copy-engine decode kernel (cuda/nvfp4_gemm_decode_tma.cu).
//
// Why in the epilogue: at decode token counts a separate expand kernel costs a launch and a dependent memory round
// trip (~2.5 us) for a few KB of work, and a 7B model has 112 LoRA layers per step. Here the CTA that writes an output
// tile adds the tile's LoRA term in FP32 before the one bf16 rounding, so the base output is never rounded on its own
// (the separate expand rounds it once more) and no extra kernel runs.
//
// Work split: 128 threads build the tile's LoRA term in shared memory, one column each (all of the tile's tokens),
// while the other 128 threads sum the split-K partials; then the threads holding the accumulators add it as they
// store. The B rows are prefetched into L2 when the kernel starts, so the epilogue's loads are L2 hits. Operands (QerlLoraEpilogue, cuda/qerl_nvfp4.h): shrunk [M, S*r] = x @ A_cat^T, lora_b [N, S*r] with only the
// diagonal blocks read (row n, columns s(n) * r ..), a bf16 token mask.
#pragma once

#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"

namespace qerl {

// Row pitch (floats) of the LoRA tile in shared memory: 4 more than the tile's columns, so the accumulator-layout
// reads (rows 2 * (lane % 4), columns lane / 4) hit 32 different banks.
template <int BN>
constexpr int lora_tile_pitch() {
  return BN + 4;
}

// Shared-memory bytes of the LoRA tile of a BM x BN output tile.
template <int BM, int BN>
constexpr int lora_tile_bytes() {
  return BM * lora_tile_pitch<BN>() * 4;
}

// Slice of output column n (< N): slice_end holds the slices' exclusive ends, padded with N past n_slices.
__device__ __forceinline__ int lora_slice(const QerlLoraEpilogue& p, int n) {
  return (n >= p.slice_end[0]) + (n >= p.slice_end[1]);
}

// 8 bf16 (one 16-byte load) -> 8 floats, exactly.
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float f[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

// Pull the B rows of output columns [n0, n0 + BN) into L2 at the start of the kernel, so that the epilogue's loads,
// several microseconds later, are L2 hits instead of DRAM round trips. One CTA per tile calls it (split 0).
template <int BN, int THREADS>
__device__ __forceinline__ void lora_prefetch_b(const QerlLoraEpilogue& p, int n0, int N, int tid) {
  const int n = n0 + tid % BN;
  if (n >= N) return;
  const char* row = static_cast<const char*>(p.lora_b) +
                    (size_t(n) * p.ld_b + size_t(lora_slice(p, n)) * p.rank) * sizeof(__nv_bfloat16);
  const int bytes = p.rank * int(sizeof(__nv_bfloat16));
  for (int o = (tid / BN) * 32; o < bytes; o += 32 * (THREADS / BN))
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + o));
}

// The tile's rows of `shrunk` (m0 + t < M) -> s_sm, row t at t * n_slices * rank: one round of 16-byte loads by BN
// threads (c = 0 .. BN - 1), so that every column then reads them from shared memory. The caller's CTA barrier
// orders these writes before lora_tile's reads (a CTA-wide barrier, not a named one over the BN threads: with the
// named barrier compute-sanitizer's racecheck reports hazards on correct code, benchmarks/NOTES.md).
// kWrittenByThisGrid: `shrunk` was written by other CTAs of this launch (the split-K kernel's in-launch shrink), so it is
// read through L2 (ld.cg) rather than the read-only path, which is only defined for data no CTA of the grid writes.
template <int BM, int BN, bool kWrittenByThisGrid = false>
__device__ __forceinline__ void lora_stage_shrunk(__nv_bfloat16* s_sm, const QerlLoraEpilogue& p, int m0, int M, int c) {
  const int ranks = p.n_slices * p.rank;  // staged row length (elements), a multiple of 8
  const int rows = min(BM, M - m0);
  const int row_chunks = ranks / 8;
  for (int q = c; q < rows * row_chunks; q += BN) {
    const int t = q / row_chunks, ch = q % row_chunks;
    const uint4* src =
        reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.shrunk) + size_t(m0 + t) * p.ld_shrunk) + ch;
    reinterpret_cast<uint4*>(s_sm + t * ranks)[ch] = kWrittenByThisGrid ? __ldcg(src) : __ldg(src);
  }
}

// The first kPreChunks 16-byte chunks (rank 32) of column c's B row, loaded into registers before the tile's shrunk
// rows are staged, so the two L2 round trips overlap instead of following each other (the split-K kernel's last CTA;
// NOTES "Seventh round").
struct LoraBRow {
  static constexpr int kPreChunks = 4;
  uint4 v[kPreChunks];
};
__device__ __forceinline__ void lora_load_b_row(LoraBRow& r, const QerlLoraEpilogue& p, int n0, int N, int c) {
  const int n = n0 + c;
  const int off = n < N ? lora_slice(p, n) * p.rank : 0;
  const uint4* brow = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.lora_b) +
                                                     size_t(n < N ? n : 0) * p.ld_b + off);
  const int chunks = p.rank / 8;
#pragma unroll
  for (int j = 0; j < LoraBRow::kPreChunks; ++j)
    if (j < chunks) r.v[j] = __ldg(brow + j);
}

// lt[t * pitch + c] = mask[m0 + t] * sum_j shrunk[m0 + t, s * r + j] * lora_b[n0 + c, s * r + j] (s: column n0 + c's
// slice) for the tile's tokens t with m0 + t < M; column c is this thread's (0 .. BN - 1), FP32 sums in j order.
// Columns >= N get 0; rows >= M are not written (the store skips them). Run by BN threads (warps 4 .. 7 of the CTA)
// after lora_stage_shrunk and a CTA barrier; the B row of each column is read once per 8 tokens (from L1 after the
// first). `pre` (kPre): the row's first chunks, already loaded by lora_load_b_row.
template <int BM, int BN, bool kPre = false>
__device__ __forceinline__ void lora_tile(float* lt, const __nv_bfloat16* s_sm, const QerlLoraEpilogue& p, int n0,
                                          int m0, int M, int N, int c, const LoraBRow* pre = nullptr) {
  constexpr int PITCH = lora_tile_pitch<BN>();
  const int ranks = p.n_slices * p.rank;
  const int rows = min(BM, M - m0);
  const int n = n0 + c;
  const bool col_ok = n < N;
  const int off = col_ok ? lora_slice(p, n) * p.rank : 0;
  const uint4* brow = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.lora_b) +
                                                     size_t(col_ok ? n : 0) * p.ld_b + off);
  const __nv_bfloat16* mask = static_cast<const __nv_bfloat16*>(p.mask);
  const int chunks = p.rank / 8;
#pragma unroll 1
  for (int t0 = 0; t0 < rows; t0 += 8) {
    float sum[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] = 0.0f;
    auto accumulate = [&](const uint4& bv, int j) {
      float b[8];
      bf16x8_to_float(bv, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (t0 + i < rows) {
          float s[8];
          bf16x8_to_float(reinterpret_cast<const uint4*>(s_sm + (t0 + i) * ranks + off)[j], s);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum[i] = fmaf(s[e], b[e], sum[i]);
        }
      }
    };
    // (Two spellings of one loop: the plain one is instruction for instruction what decode_tma's kernels ran before
    // the preloaded variant existed, sass_census.py --against.)
    if constexpr (kPre) {
#pragma unroll
      for (int j = 0; j < LoraBRow::kPreChunks; ++j)
        if (j < chunks) accumulate(pre->v[j], j);
#pragma unroll 2
      for (int j = LoraBRow::kPreChunks; j < chunks; ++j) accumulate(__ldg(brow + j), j);
    } else {
#pragma unroll 2
      for (int j = 0; j < chunks; ++j) {
        float b[8];
        bf16x8_to_float(__ldg(brow + j), b);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (t0 + i < rows) {
            float s[8];
            bf16x8_to_float(reinterpret_cast<const uint4*>(s_sm + (t0 + i) * ranks + off)[j], s);
#pragma unroll
            for (int e = 0; e < 8; ++e) sum[i] = fmaf(s[e], b[e], sum[i]);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (t0 + i < rows) {
        const float mk = __bfloat162float(mask[size_t(m0 + t0 + i) * p.mask_stride]);
        lt[(t0 + i) * PITCH + c] = col_ok ? sum[i] * mk : 0.0f;
      }
    }
  }
}

// store_bf16's addend for the LoRA tile: token row t of the tile, column n - n0 (the tile's first column n0).
template <int BN>
struct LoraTile {
  static constexpr bool kActive = true;
  const float* lt;
  int n0;
  __device__ __forceinline__ float operator()(int t, int n) const { return lt[t * lora_tile_pitch<BN>() + (n - n0)]; }
};

// (host) A LoRA epilogue a kernel staging up to max_ranks shrunk columns can run for an [M, N] output: operands
// present and 16-byte aligned rows, rank a positive multiple of 8, 1..3 increasing slices ending at N; lora_a (the
// in-launch shrink, then `shrunk` is not read) only where the kernel computes the shrink (in_launch_shrink). On
// success `norm` is a copy with the unused slice_end entries set to N (the kernel's slice lookup reads the first two).
inline bool lora_valid(const QerlLoraEpilogue& p, int N, int max_ranks, QerlLoraEpilogue* norm,
                       bool in_launch_shrink = false) {
  auto aligned = [](const void* q) { return q != nullptr && reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (p.lora_a != nullptr && (!in_launch_shrink || !aligned(p.lora_a) || p.ld_a <= 0 || p.ld_a % 8 != 0))
    return false;
  if ((p.lora_a == nullptr && !aligned(p.shrunk)) || !aligned(p.lora_b) || p.mask == nullptr || p.mask_stride < 0)
    return false;
  if (p.rank <= 0 || p.rank % 8 != 0 || p.n_slices < 1 || p.n_slices > 3 || p.n_slices * p.rank > max_ranks)
    return false;
  if (p.lora_a == nullptr && (p.ld_shrunk % 8 != 0 || p.ld_shrunk < p.n_slices * p.rank)) return false;
  if (p.ld_b % 8 != 0 || p.ld_b < p.n_slices * p.rank) return false;
  int prev = 0;
  for (int i = 0; i < p.n_slices; ++i) {
    if (p.slice_end[i] <= prev) return false;
    prev = p.slice_end[i];
  }
  if (prev != N) return false;
  *norm = p;
  for (int i = p.n_slices; i < 3; ++i) norm->slice_end[i] = N;
  return true;
}

// The register-A wgmma kernels' LoRA term stages its B operand (a token's shrink row piece of 8 ranks, `v`, times the
// token's mask) at token row r, 16-byte chunk q of a k64 half (`half`) in the activations' 128-byte-swizzled K-major
// layout. The mask is applied in bf16 (exact for 0 / 1 masks; a 0 mask stores exact zeros).
__device__ __forceinline__ void stage_masked_shrink(uint8_t* half, int r, int q, uint4 v, float mask) {
  if (mask == 0.0f) {
    v = make_uint4(0u, 0u, 0u, 0u);
  } else if (mask != 1.0f) {
    __nv_bfloat162* e = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      e[j] = __float22bfloat162_rn(make_float2(__low2float(e[j]) * mask, __high2float(e[j]) * mask));
  }
  *reinterpret_cast<uint4*>(half + r * 128 + ((q ^ (r & 7)) << 4)) = v;
}

}  // namespace qerl
