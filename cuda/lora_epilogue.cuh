// The LoRA expand of one GEMM output tile, for the epilogues of the split-K kernel (cuda/nvfp4_gemm.cu) and the
// copy-engine decode kernel (cuda/nvfp4_gemm_decode_tma.cu).
//
// Why in the epilogue: at decode token counts a separate expand kernel costs a launch and a dependent memory round
// trip (~2.5 us) for a few KB of work, and a 7B model has 112 LoRA layers per step. Here the CTA that writes an output
// tile adds the tile's LoRA term in FP32 before the one bf16 rounding, so the base output is never rounded on its own
// (the separate expand rounds it once more) and no extra kernel runs.
//
// Work split: 128 threads (4 warps) build the tile's LoRA term in shared memory with mma.sync (lora_tile), while the
// other 128 threads sum the split-K partials; then the threads holding the accumulators add it as they
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
// threads (c = 0 .. BN - 1), so that every column then reads them from shared memory. The caller's barrier orders
// these writes before lora_tile's reads: one over every thread of the epilogue (the CTA in the split-K kernel, all
// consumer warps in decode_tma's), not a named one over only the BN staging threads (with that, compute-sanitizer's
// racecheck reports hazards on correct code, benchmarks/NOTES.md).
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

// The LoRA term runs on the tensor cores (mma.sync m16n8k16, FP32 accumulators): per 16 output columns and 8 tokens
// D[col, tok] = sum_j B[col, s(col) r + j] shrunk[tok, s r + j]. Why not one FMA chain per column: at 8 tokens that
// chain is ~550 instructions per thread (each token's shrunk piece converted and multiplied per column), ~1 us on the
// tile's serial tail (lora_gemm_bench: the epilogue +2.3-2.7 us per split-K GEMM at M = 8 against +1.4-1.6 at M = 1);
// here a warp's 32 columns are 2 MMAs per 32 ranks and 8 tokens.
//   The K order of the MMA is permuted so that every operand is one 16-byte load: the lane (g = lane / 4,
// t = lane % 4) holds ranks [8 t, 8 t + 8) of a 32-rank chunk of its rows (A: columns g and g + 8 of the group; B:
// token g), words w0..w3 = rank pairs (8t, 8t+1), (8t+2, 8t+3), ...; MMA k index 2t + e of the first k16 step is rank
// 8t + e, 2t + 8 + e is 8t + 2 + e, and the second step takes w2 / w3 the same way. A sum over k does not depend on
// which k a rank sits at, and A and B use one map, so D is the same dot product (in the tensor core's FP32 order).
//   Slices: a 16-column group whose columns span slices is run once per slice with the other slices' rows zeroed.

// The A operand (B rows) of the thread's two 16-column groups for the first 32 ranks, loaded before the tile's shrunk
// rows are staged so the two L2 round trips overlap (the split-K kernel's last CTA; NOTES "Seventh round").
struct LoraBFrags {
  uint4 v[2][2];  // [group of the warp][column g, column g + 8]
};

// Column `col`'s 8 ranks [ch * 32 + 8 t, + 8) of its slice's B row; zero past N or past the rank.
__device__ __forceinline__ uint4 lora_b_piece(const QerlLoraEpilogue& p, int col, int N, int ch, int t) {
  const int j = ch * 32 + t * 8;
  if (col >= N || j >= p.rank) return make_uint4(0u, 0u, 0u, 0u);
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.lora_b) + size_t(col) * p.ld_b +
                                              size_t(lora_slice(p, col)) * p.rank + j));
}

// Thread c (0 .. BN - 1; warp c / 32 holds the tile's columns [32 (c / 32), + 32)) of the tile at n0: its first chunk.
__device__ __forceinline__ void lora_load_b_frags(LoraBFrags& f, const QerlLoraEpilogue& p, int n0, int N, int c) {
  const int lane = c & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int col = n0 + (c >> 5) * 32 + q * 16 + g;
    f.v[q][0] = lora_b_piece(p, col, N, 0, t);
    f.v[q][1] = lora_b_piece(p, col + 8, N, 0, t);
  }
}

// lt[t * pitch + col] = mask[m0 + t] * sum_j shrunk[m0 + t, s * r + j] * lora_b[n0 + col, s * r + j] (s: column
// n0 + col's slice) for the tile's tokens t with m0 + t < M. Columns >= N get 0; rows >= M are not written (the store
// skips them). Run by BN threads (BN / 32 whole warps; c = 0 .. BN - 1) after lora_stage_shrunk and a CTA barrier.
// `pre` (kPre): the first chunk, already loaded by lora_load_b_frags.
template <int BM, int BN, bool kPre = false>
__device__ __forceinline__ void lora_tile(float* lt, const __nv_bfloat16* s_sm, const QerlLoraEpilogue& p, int n0,
                                          int m0, int M, int N, int c, const LoraBFrags* pre = nullptr) {
  static_assert(BN % 32 == 0 && BM % 8 == 0, "whole warps of 32 columns, 8-token MMA tiles");
  constexpr int PITCH = lora_tile_pitch<BN>();
  constexpr int NT = BM / 8;
  const int ranks = p.n_slices * p.rank;
  const int rows = min(BM, M - m0);
  const int lane = c & 31, g = lane >> 2, t = lane & 3;
  const int wcol = (c >> 5) * 32;  // the warp's first column in the tile
  const int chunks = (p.rank + 31) / 32;
  const __nv_bfloat16* mask = static_cast<const __nv_bfloat16*>(p.mask);
  // One 16-column group at a time (registers: the decode_tma kernels run LoRA at a 72-register cap).
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int first = n0 + wcol + q * 16;  // the group's first column
    const int col = first + g;
    const int s_row0 = col < N ? lora_slice(p, col) : -1;
    const int s_row1 = col + 8 < N ? lora_slice(p, col + 8) : -1;
    const int s_lo = first < N ? lora_slice(p, first) : 3;  // a group past N: no pass
    const int s_hi = first < N ? lora_slice(p, min(first + 15, N - 1)) : -1;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
#pragma unroll 1
    for (int ch = 0; ch < chunks; ++ch) {
      uint4 ar0, ar1;
      if (kPre && ch == 0) {
        ar0 = pre->v[q][0];
        ar1 = pre->v[q][1];
      } else {
        ar0 = lora_b_piece(p, col, N, ch, t);
        ar1 = lora_b_piece(p, col + 8, N, ch, t);
      }
      const bool piece_ok = ch * 32 + t * 8 < p.rank;
#pragma unroll 1
      for (int s = s_lo; s <= s_hi; ++s) {
        const uint4 a0 = s_row0 == s ? ar0 : make_uint4(0u, 0u, 0u, 0u);
        const uint4 a1 = s_row1 == s ? ar1 : make_uint4(0u, 0u, 0u, 0u);
        const uint32_t af0[4] = {a0.x, a1.x, a0.y, a1.y};
        const uint32_t af1[4] = {a0.z, a1.z, a0.w, a1.w};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int tok = nt * 8 + g;
          const uint4 b = (tok < rows && piece_ok)
                              ? *reinterpret_cast<const uint4*>(s_sm + tok * ranks + s * p.rank + ch * 32 + t * 8)
                              : make_uint4(0u, 0u, 0u, 0u);
          const uint32_t bf0[2] = {b.x, b.y};
          const uint32_t bf1[2] = {b.z, b.w};
          mma_bf16(acc[nt], af0, bf0);
          mma_bf16(acc[nt], af1, bf1);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = nt * 8 + 2 * t + e;
        if (tok < rows) {
          const float mk = __bfloat162float(mask[size_t(m0 + tok) * p.mask_stride]);
          const int lc = col - n0;  // the tile's column of c0 / c1 (c2 / c3: + 8)
          lt[tok * PITCH + lc] = col < N ? acc[nt][e] * mk : 0.0f;
          lt[tok * PITCH + lc + 8] = col + 8 < N ? acc[nt][2 + e] * mk : 0.0f;
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
