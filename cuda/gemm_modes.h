// The modes of qerl::nvfp4_gemm and the GEMM paths it can run: their one definition, read by the C++ binding
// (cuda/qerl_torch.cpp builds `enum class GemmMode` and `enum class GemmKernel` from these lines) and by Python
// (verl_qerl/kernels/modes.py parses them at import, so CPU-only machines know the names too).
//
//   QERL_GEMM_MODE(Enumerator, value, "name", "what the op runs in this mode")
//   QERL_GEMM_KERNEL_DEF(Enumerator, id, "name", "what the kernel is")
//
// X-macro list: define QERL_GEMM_MODE and / or QERL_GEMM_KERNEL_DEF, then include this file (a macro left
// undefined expands to nothing; both are undefined again at the end, so the file can be included repeatedly).
// Python parses strictly: one entry per line, exactly the form above, a name of [a-z0-9_], a doc string without
// quotes or backslashes. Values are the integers the op's `mode` argument takes; kernel ids are the calibration
// table's ids (0, 1, 2, ... in this order) and the names are what gemm_choice() returns and the table file holds.
// The op's `splits` argument (K-splits of the split-K kernel, 0: its heuristic) is valid in mode splitk only.
#ifndef QERL_GEMM_MODE
#define QERL_GEMM_MODE(id, value, name, doc)
#endif
#ifndef QERL_GEMM_KERNEL_DEF
#define QERL_GEMM_KERNEL_DEF(id, value, name, doc)
#endif

QERL_GEMM_MODE(Auto, 0, "auto", "the calibration table's measured kernel where one is loaded; else by M: the fused kernel up to QERL_GEMM_MAX_M (stream-K where it applies and pays, split-K elsewhere), dequantize + cuBLAS above")
QERL_GEMM_MODE(SplitK, 1, "splitk", "the split-K kernel at every M; `splits` sets its K-split count (0: its heuristic)")
QERL_GEMM_MODE(DequantCublas, 2, "dequant_cublas", "dequantize the weight to the activations' dtype, then cuBLAS, at every M")
QERL_GEMM_MODE(AutoStreamK, 4, "auto_streamk", "by M as auto without a table, the fused kernel stream-K wherever it applies (M >= 17)")
QERL_GEMM_MODE(StreamK, 5, "streamk", "the stream-K kernel at every M where it applies (M >= 17, enough shared memory), split-K elsewhere")
QERL_GEMM_MODE(AutoSplitK, 6, "auto_splitk", "by M as auto without a table, the fused kernel split-K only")
QERL_GEMM_MODE(WgmmaRS, 7, "wgmma_rs", "the register-A Hopper wgmma kernel at every M where it runs (sm_90a build, sm_90 device), as streamk elsewhere")
QERL_GEMM_MODE(WgmmaSS, 8, "wgmma_ss", "as wgmma_rs with the shared-memory-operand wgmma kernel (experimental, never picked by auto)")
QERL_GEMM_MODE(DecodeTma, 9, "decode_tma", "the copy-engine decode kernel at M <= 16 where it runs (sm_90a build, sm_90 device; with the LoRA expand in its epilogue), as streamk elsewhere")
QERL_GEMM_MODE(WgmmaWide, 10, "wgmma_wide", "as wgmma_rs, with the wide kernel's 128-row tiles from M = 65 (its 128-token tiles at 65-128, where wgmma_rs runs the 256-row 128-token kernel)")

QERL_GEMM_KERNEL_DEF(SplitK, 0, "splitk", "split-K mma.sync kernel (cuda/nvfp4_gemm.cu): decode and small M")
QERL_GEMM_KERNEL_DEF(StreamK, 1, "streamk", "stream-K mma.sync kernel (cuda/nvfp4_gemm_streamk.cu): 256-row tiles, M >= 17")
QERL_GEMM_KERNEL_DEF(WgmmaRS, 2, "wgmma_rs", "Hopper wgmma kernel, A operand from registers (cuda/nvfp4_gemm_wgmma.cu)")
QERL_GEMM_KERNEL_DEF(DequantCublas, 3, "dequant_cublas", "dequantize to BF16 (cuda/nvfp4_dequant.cu), then cuBLAS")
QERL_GEMM_KERNEL_DEF(WgmmaSS, 4, "wgmma_ss", "Hopper wgmma kernel, both operands in shared memory (cuda/nvfp4_gemm_wgmma_ss.cu)")
QERL_GEMM_KERNEL_DEF(DecodeTma, 5, "decode_tma", "Hopper decode kernel, M <= 16, fed by the copy engine (cuda/nvfp4_gemm_decode_tma.cu)")
QERL_GEMM_KERNEL_DEF(WgmmaWide, 6, "wgmma_wide", "Hopper wgmma kernel, A from registers, 128-row tiles of 128 tokens at M = 65-128 (cuda/nvfp4_gemm_wgmma_wide.cu)")

#undef QERL_GEMM_MODE
#undef QERL_GEMM_KERNEL_DEF
