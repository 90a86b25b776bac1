// verl-qerl NVFP4 kernels: the C launcher API (no torch headers).
//
// The .cu files behind this header are plain CUDA so that a machine without a GPU (CI) can
// compile them alone with nvcc; cuda/qerl_torch.cpp is the only file that sees torch.
//
// Layouts (see verl_qerl/kernels/layout.py for the full description):
//   compressed-tensors: packed uint8 [N, K/2] (even element in the low nibble), scale E4M3 [N, K/16],
//                       global_scale fp32 [1] (a divisor: W = e2m1 * scale / global_scale);
//   repacked (GEMM):    qweight uint8 [N_pad/128, K/128, 8192], qscale uint8 [N_pad/128, K/128, 1024]
//                       (one GEMM pipeline stage of one 128-row tile per contiguous block).
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum QerlDtype { QERL_BF16 = 0, QERL_F16 = 1, QERL_F32 = 2 };

// GEMM tile constants shared with the host-side heuristics.
enum { QERL_GEMM_BN = 128, QERL_GEMM_BK = 128, QERL_GEMM_THREADS = 256 };

// out[M, N] (bf16) = x[M, K] (bf16, row-major, rows 16-byte aligned) @ W^T (+ bias[N] bf16).
// block_m in {8, 16, 32, 64}; splits >= 1 splits K over CTAs (then `workspace` must hold
// qerl_nvfp4_gemm_workspace_floats(...) floats and `counters` >= tiles ints, all zero on entry;
// the kernel leaves them zero). N_pad = N rounded up to 128 (the qweight's rows).
cudaError_t qerl_nvfp4_gemm_launch(const void* x, const void* qweight, const void* qscale,
                                   const float* global_scale, const void* bias, void* out,
                                   float* workspace, int* counters, int M, int N, int K,
                                   int splits, int block_m, cudaStream_t stream);

// Floats of split-K workspace for one launch.
size_t qerl_nvfp4_gemm_workspace_floats(int M, int N, int splits, int block_m);

// A LoRA expand for the split-K GEMM's epilogue (cuda/lora_epilogue.cuh): with it the launch below writes
//   out[m, n] = bf16(gemm[m, n] + bias[n] + mask[m] * sum_j shrunk[m, s(n) * rank + j] * lora_b[n, s(n) * rank + j])
// in FP32 before the one rounding, s(n) the slice of column n (at most 3 slices: a fused qkv layer). lora_b is the
// slices' B on a block diagonal (row n holds its slice's rank values at columns s(n) * rank ..); only those blocks
// are read. All bf16, rows 16-byte aligned (rank and the leading dimensions multiples of 8).
//
// With lora_a set (the split-K launch, qerl_nvfp4_gemm_lora_launch, and the decode launch below), the launch computes
// the shrink itself and `shrunk` is not read (cuda/lora_shrink_in_launch.cuh): split-K runs extra CTAs ahead of the
// GEMM's (the lowest block indices of each split, one per 32 ranks of A_cat) that write FP32 partial shrinks of their
// K range to the workspace, and the last of them sums them in split order and rounds the sum to bf16 (the value a
// separate shrink kernel would have stored); each tile's last CTA waits for that sum before the expand.
typedef struct {
  const void* shrunk;  // bf16 [M, ld_shrunk]: x @ A_cat^T, slice s at columns s * rank .. + rank
  const void* lora_b;  // bf16 [N, ld_b]
  const void* mask;    // bf16, element m at mask[m * mask_stride]: 1 for tokens with the adapter, 0 without
  int ld_shrunk;
  int ld_b;
  int mask_stride;
  int rank;            // per slice, a multiple of 8
  int n_slices;        // 1..3
  int slice_end[3];    // exclusive end column of each slice, increasing; slice_end[n_slices - 1] == N
  const void* lora_a;  // bf16 [n_slices * rank, ld_a] (A_cat, K columns read), or NULL: `shrunk` holds the shrink
  int ld_a;
} QerlLoraEpilogue;

// 1 when qerl_nvfp4_gemm_lora_launch accepts `lora` for an output of N columns with this block_m: operands present
// and 16-byte aligned, rank a positive multiple of 8, 1..3 increasing slices ending at N, and n_slices x rank within
// what the kernel stages in shared memory (>= 96), block_m <= QERL_LORA_EPILOGUE_MAX_BLOCK_M; else 0 (then run the
// GEMM and a separate expand).
int qerl_nvfp4_gemm_lora_supported(int N, int block_m, const QerlLoraEpilogue* lora);

// The largest block_m whose launches take the LoRA epilogue (qerl_nvfp4_gemm_lora_supported is 0 above it): the
// epilogue runs in the tile's last CTA after its main loop, so its cost grows with the tile's tokens. Measured on one
// H200 (7B decode step, benchmarks/NOTES.md "fused LoRA expand"): a gain at M = 1 (3.60 vs 3.66 ms per step), even
// at M = 8 (3.91 vs 3.87), a loss at M = 64 where the table routes o_proj to split-K (7.06 vs 6.45 ms).
#define QERL_LORA_EPILOGUE_MAX_BLOCK_M 8

// qerl_nvfp4_gemm_launch with the LoRA expand above in its epilogue (lora == NULL: exactly that launch). The LoRA
// term is added where the bf16 output is written: by every CTA with one split, by the last CTA of a tile (after the
// deterministic sum of the partials) with several.
// pdl != 0 (sm_90+ devices only): a programmatic dependent launch. The kernel may start while the previous kernel on
// the stream finishes and streams its first stage of qweight / qscale (and prefetches lora_b) before waiting for it;
// everything else (x, shrunk, mask, bias, workspace, counters, out) is touched after the wait. The caller promises
// that the previous kernel does not write qweight, qscale, lora_b or lora_a (the in-launch shrink streams its first
// stage of lora_a before the wait too).
// With lora->lora_a set: `workspace` holds qerl_nvfp4_gemm_lora_workspace_floats(...) floats (also with one split)
// and `counters` qerl_nvfp4_gemm_lora_counters(...) ints, zero on entry, left zero.
cudaError_t qerl_nvfp4_gemm_lora_launch(const void* x, const void* qweight, const void* qscale,
                                        const float* global_scale, const void* bias, void* out, float* workspace,
                                        int* counters, int M, int N, int K, int splits, int block_m,
                                        const QerlLoraEpilogue* lora, int pdl, cudaStream_t stream);

// Workspace floats / counters of a qerl_nvfp4_gemm_lora_launch: the split-K partials, plus with lora->lora_a set the
// in-launch shrink's FP32 partials (m-tiles x splits x block_m x 32 per shrink CTA column) and three counters per
// m-tile after the tiles' own.
size_t qerl_nvfp4_gemm_lora_workspace_floats(int M, int N, int splits, int block_m, const QerlLoraEpilogue* lora);
int qerl_nvfp4_gemm_lora_counters(int M, int N, int block_m, const QerlLoraEpilogue* lora);

// CTA columns of the in-launch shrink for a LoRA of n_slices x rank shrunk columns (32 ranks per CTA).
#define QERL_LORA_SHRINK_RANKS_PER_CTA 32
// Those columns for `lora` (0 without lora_a): per split, the launch's grid has this many CTAs more than tiles.
int qerl_nvfp4_gemm_lora_shrink_cols(const QerlLoraEpilogue* lora);

// Resident CTAs per SM of the GEMM for this block_m (0 on error).
int qerl_nvfp4_gemm_ctas_per_sm(int block_m);

// Opt-in medium-M variant (cuda/nvfp4_gemm_streamk.cu): persistent stream-K over 256-row tiles, block_m in
// {32, 64}. `grid` = CTAs requested (SMs x qerl_nvfp4_gemm_streamk_ctas_per_sm); the launch uses the CTAs
// with non-empty ranges. `workspace` must hold qerl_nvfp4_gemm_streamk_workspace_floats(...) floats (may be
// null when that is 0); `counters` >= qerl_nvfp4_gemm_streamk_tiles(...) ints, zero on entry, left zero.
cudaError_t qerl_nvfp4_gemm_streamk_launch(const void* x, const void* qweight, const void* qscale,
                                           const float* global_scale, const void* bias, void* out,
                                           float* workspace, int* counters, int M, int N, int K, int grid,
                                           int block_m, cudaStream_t stream);

// Floats of stream-K workspace for one launch: 2 partial slots x CTAs x block_m x 256 (0: no partials).
size_t qerl_nvfp4_gemm_streamk_workspace_floats(int M, int N, int K, int grid, int block_m);

// Output tiles (256 rows x block_m tokens) = counters the stream-K launch uses.
int qerl_nvfp4_gemm_streamk_tiles(int M, int N, int block_m);

// Resident CTAs per SM of the stream-K kernel (0: unsupported block_m, or the device's per-CTA shared
// memory is too small for its ring, e.g. sm_89: callers fall back to qerl_nvfp4_gemm_launch).
int qerl_nvfp4_gemm_streamk_ctas_per_sm(int block_m);

// block_t of the wgmma entry points below for the wide kernel's 128-token tiles (128-row x 128-token tiles, the
// `wgmma_wide` GEMM kernel), as opposed to block_t = 128: the 256-row x 128-token kernel.
#define QERL_WGMMA_WIDE_128 (-128)

// Hopper wgmma kernel (cuda/nvfp4_gemm_wgmma.cu, sm_90a builds only): persistent stream-K over 256-row x block_t
// token tiles, block_t in {64, 128}, or 128-row x block_t-token tiles with block_t = 192 or 256 (the wide-token
// kernel, cuda/nvfp4_gemm_wgmma_wide.cu; QERL_WGMMA_WIDE_128: its 128-token tiles). Same workspace / counter contract as the stream-K launch above.
// qerl_nvfp4_gemm_wgmma_ctas_per_sm is 0 where the kernel is not available (not built for sm_90a, not an sm_90
// device, or too little shared memory): callers then run another kernel.
cudaError_t qerl_nvfp4_gemm_wgmma_launch(const void* x, const void* qweight, const void* qscale,
                                         const float* global_scale, const void* bias, void* out, float* workspace,
                                         int* counters, int M, int N, int K, int grid, int block_t,
                                         cudaStream_t stream);
size_t qerl_nvfp4_gemm_wgmma_workspace_floats(int M, int N, int K, int grid, int block_t);
int qerl_nvfp4_gemm_wgmma_tiles(int M, int N, int block_t);
int qerl_nvfp4_gemm_wgmma_ctas_per_sm(int block_t);

// The wide-token kernel's own entry points (block_t = 192 / 256 / QERL_WGMMA_WIDE_128 of the wgmma functions above
// forward to them; each takes the token tile as block_t, 128, 192 or 256: qerl_nvfp4_gemm_wgmma_wide_tile(block_t)
// says whether it is one).
int qerl_nvfp4_gemm_wgmma_wide_tile(int block_t);
cudaError_t qerl_nvfp4_gemm_wgmma_wide_launch(const void* x, const void* qweight, const void* qscale,
                                              const float* global_scale, const void* bias, void* out,
                                              float* workspace, int* counters, int M, int N, int K, int grid,
                                              int block_t, cudaStream_t stream);
// The same with the LoRA term of `lora` (normalized by lora_valid, ranks <= 128, shrunk given) as each tile's starting
// accumulator (the wide LoRA kernel); lora == NULL: exactly qerl_nvfp4_gemm_wgmma_wide_launch.
cudaError_t qerl_nvfp4_gemm_wgmma_wide_lora_launch(const void* x, const void* qweight, const void* qscale,
                                                   const float* global_scale, const void* bias, void* out,
                                                   float* workspace, int* counters, int M, int N, int K, int grid,
                                                   int block_t, const QerlLoraEpilogue* lora, cudaStream_t stream);
// 1 where the wide LoRA kernel of that token tile can run (sm_90a build, sm_90 device), else 0.
int qerl_nvfp4_gemm_wgmma_wide_lora_available(int block_t);
size_t qerl_nvfp4_gemm_wgmma_wide_workspace_floats(int M, int N, int K, int grid, int block_t);
int qerl_nvfp4_gemm_wgmma_wide_tiles(int M, int N, int block_t);
int qerl_nvfp4_gemm_wgmma_wide_ctas_per_sm(int block_t);

// The register-A wgmma kernel at 64-token tiles, and the wide one at 192 / 256 (block_t 64 / 192 / 256), with the LoRA
// expand of
// QerlLoraEpilogue (shrunk given, lora_a NULL; at most 128 slices x rank) in the same launch: the term is each tile's
// starting accumulator, a few wgmmas run by the CTA whose stream-K segment (or cluster rank 0) starts the tile while
// its first stages' copies are in flight. The same output as the plain launch plus mask * expand, with the shrink's
// rows multiplied by their mask in bf16 first (exact for 0 / 1 masks). Workspace and counters as
// qerl_nvfp4_gemm_wgmma_launch's at the same block_t.
int qerl_nvfp4_gemm_wgmma_lora_supported(int N, int block_t, const QerlLoraEpilogue* lora);
cudaError_t qerl_nvfp4_gemm_wgmma_lora_launch(const void* x, const void* qweight, const void* qscale,
                                              const float* global_scale, const void* bias, void* out,
                                              float* workspace, int* counters, int M, int N, int K, int grid,
                                              int block_t, const QerlLoraEpilogue* lora, cudaStream_t stream);

// Hopper wgmma kernel with both operands in shared memory (cuda/nvfp4_gemm_wgmma_ss.cu, sm_90a builds only):
// warp-specialized (producer, dequant and MMA warpgroups), persistent stream-K over 256-row x block_t token tiles,
// block_t in {64, 128}. Same workspace / counter contract and availability rule as the wgmma launch above.
cudaError_t qerl_nvfp4_gemm_wgmma_ss_launch(const void* x, const void* qweight, const void* qscale,
                                            const float* global_scale, const void* bias, void* out, float* workspace,
                                            int* counters, int M, int N, int K, int grid, int block_t,
                                            cudaStream_t stream);
size_t qerl_nvfp4_gemm_wgmma_ss_workspace_floats(int M, int N, int K, int grid, int block_t);
int qerl_nvfp4_gemm_wgmma_ss_tiles(int M, int N, int block_t);
int qerl_nvfp4_gemm_wgmma_ss_ctas_per_sm(int block_t);

// Decode kernel on the copy engine (cuda/nvfp4_gemm_decode_tma.cu, sm_90a builds only): the split-K kernel's math
// for block_m in {8, 16} tokens per tile, fed by a producer warp through a TMA / bulk-copy mbarrier ring, persistent
// stream-K over 128-row tiles. Same workspace / counter contract and availability rule as the wgmma launch above.
// `lora` (null: none): the LoRA expand added in the epilogue, as the split-K launch's, up to 128 shrunk columns
// (qerl_nvfp4_gemm_decode_tma_lora_supported; an unsupported one is cudaErrorInvalidValue). `pdl`: as
// qerl_nvfp4_gemm_lora_launch's (the producer issues the first unit's weight and scale copies before the wait).
cudaError_t qerl_nvfp4_gemm_decode_tma_launch(const void* x, const void* qweight, const void* qscale,
                                              const float* global_scale, const void* bias, void* out,
                                              float* workspace, int* counters, int M, int N, int K, int grid,
                                              int block_m, const QerlLoraEpilogue* lora, int pdl,
                                              cudaStream_t stream);
// With lora->lora_a set the launch computes the shrink too (qerl::nvfp4_lora_linear; the linear kernel): the
// lowest-indexed CTAs each compute one unit (32 ranks x one 128-K stage) first, the last unit of each 32-rank column
// sums the column's stage partials in a fixed order and rounds to bf16, and every tile's storing CTA waits for all
// columns before its expand. Then M <= block_m, at most qerl_nvfp4_gemm_decode_tma_shrink_fits's units, `workspace`
// holds qerl_nvfp4_gemm_decode_tma_lora_workspace_floats(...) floats and `counters`
// qerl_nvfp4_gemm_decode_tma_lora_counters(...) ints (zero on entry, left zero), `grid` is SMs x
// qerl_nvfp4_gemm_decode_tma_ctas_per_sm(block_m, 2) (the flag wait needs the grid resident at once), and `pdl`'s
// promise covers lora_a (each unit's A rows are copied before the wait).
int qerl_nvfp4_gemm_decode_tma_lora_supported(int N, int block_m, const QerlLoraEpilogue* lora);
size_t qerl_nvfp4_gemm_decode_tma_workspace_floats(int M, int N, int K, int grid, int block_m);
int qerl_nvfp4_gemm_decode_tma_tiles(int M, int N, int block_m);
int qerl_nvfp4_gemm_decode_tma_ctas_per_sm(int block_m, int lora);  // lora: 1 LoRA epilogue, 2 with the shrink too
// 1 where the launch takes an in-launch shrink of `ranks` (= n_slices x rank) columns for this shape and grid: 1 <= M
// <= block_m, ranks <= 128, and no more shrink units (ceil(ranks / 32) x K / 128) than the launch's CTAs.
int qerl_nvfp4_gemm_decode_tma_shrink_fits(int M, int N, int K, int grid, int block_m, int ranks);
// 1 where the launch takes `lora` with lora_a set: the operands (as qerl_nvfp4_gemm_lora_supported's, ld_a >= K) and
// qerl_nvfp4_gemm_decode_tma_shrink_fits.
int qerl_nvfp4_gemm_decode_tma_shrink_supported(int M, int N, int K, int grid, int block_m,
                                               const QerlLoraEpilogue* lora);
size_t qerl_nvfp4_gemm_decode_tma_lora_workspace_floats(int M, int N, int K, int grid, int block_m,
                                                        const QerlLoraEpilogue* lora);
int qerl_nvfp4_gemm_decode_tma_lora_counters(int M, int N, int block_m, const QerlLoraEpilogue* lora);

// Dense [N, K] in `out_dtype` from the compressed-tensors layout (K % 16 == 0).
cudaError_t qerl_nvfp4_dequant_launch(const uint8_t* packed, const uint8_t* scale,
                                      const float* global_scale, void* out, int N, int K,
                                      int out_dtype, cudaStream_t stream);

// Dense [N, K] in `out_dtype` from the repacked layout (K % 128 == 0, rows >= N not written).
// `qweight`/`qscale` may point at any 128-row tile of a larger weight (slices: N = slice rows).
cudaError_t qerl_nvfp4_dequant_repacked_launch(const uint8_t* qweight, const uint8_t* qscale,
                                               const float* global_scale, void* out, int N,
                                               int K, int out_dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
