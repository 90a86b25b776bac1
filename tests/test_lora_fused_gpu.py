"""GPU tests of ``qerl::nvfp4_gemm_lora``: the LoRA expand in the split-K kernel's epilogue (run on the GPU machine;
skipped without CUDA).

Oracle: float64 from the exact dequantized weight and the bf16 operands. Where the split-K kernel runs (what
``gemm_choice`` names for the shape, M and mode) the LoRA term is added before the output's one bf16 rounding, so
every element is within half a bf16 ulp of the float64 value (plus FP32 accumulation noise), and on average closer
than ``qerl::nvfp4_gemm`` followed by ``qerl::lora_expand``, which rounds the base output first. Everywhere else the op
*is* that pair: bit-identical to it. Outputs are NaN-poisoned first (a freed NaN-filled block of the output's size
is what the op's allocation gets), so unwritten elements fail.
"""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import GemmMode as Mode
from verl_qerl.kernels import reference
from verl_qerl.kernels.lora_expand import lora_expand
from verl_qerl.testing.gpu import capture, kernels_launched, poison
from verl_qerl.testing.nvfp4_random import random_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
#: (N, K, slice_bounds, rank): o / down-like (one slice), gate_up-like (two), qkv-like (three, uneven), and N not a
#: multiple of the 128-row tile with a slice boundary inside a 16-column block
SHAPES = [(512, 1024, [0, 512], 32), (1024, 1024, [0, 512, 1024], 32), (768, 2048, [0, 512, 640, 768], 32),
          (208, 512, [0, 40, 80, 208], 8)]
#: (mode, splits): auto dispatch; the split-K kernel with one split (every CTA runs the epilogue) and with 4 (the
#: last CTA of each tile runs it, after the deterministic partial sum); the register-A wgmma kernels (wgmma_wide: the
#: wide kernel's LoRA term at 65-128 tokens too)
MODES = [(Mode.AUTO, 0), (Mode.SPLITK, 1), (Mode.SPLITK, 4), (Mode.WGMMA_RS, 0), (Mode.WGMMA_WIDE, 0)]
#: decode token counts (block_m 8 and 16), then 17, 64, 100, 129, 160, 200, 256, 300, 400: other block sizes (the
#: register-A wgmma kernel's 64-, 128-, 192- and 256-token tiles; 192 at 129 / 160 / 300 (its last tile as part boxes
#: at 300), 256 at 200 / 256 / 400 (as part boxes at 400), and the fallback where auto picks another kernel
TOKENS = [1, 2, 3, 7, 8, 9, 16, 17, 64, 100, 129, 160, 200, 256, 300, 400]


@pytest.fixture(scope="module", autouse=True)
def _ext() -> None:
    if not kernels.load_extension(verbose=False):
        pytest.fail(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")


def rand_nvfp4(n: int, k: int, seed: int):
    return random_nvfp4(n, k, seed, DEV)


def lora_operands(m: int, n: int, bounds: list[int], rank: int, seed: int):
    """bf16 shrunk [m, S*rank], block-diagonal lora_b [n, S*rank], mask [m, 1] (every 4th token without the
    adapter), scaled so the LoRA term is about as large as the GEMM's output."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    slices = len(bounds) - 1
    shrunk = (torch.randn(m, slices * rank, device=DEV, generator=g) * 2).to(torch.bfloat16)
    lora_b = torch.zeros(n, slices * rank, device=DEV, dtype=torch.bfloat16)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        lora_b[lo:hi, i * rank:(i + 1) * rank] = torch.randn(hi - lo, rank, device=DEV, generator=g).to(torch.bfloat16)
    mask = (torch.arange(m, device=DEV) % 4 != 3).to(torch.bfloat16).unsqueeze(1)
    return shrunk, lora_b, mask


def oracle(x, packed, scale, gs, bias, shrunk, lora_b, mask, bounds) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(float64 result, float64 sum of absolute terms: the scale of FP32 accumulation noise)."""
    w = reference.dequantize_f64(packed, scale, gs)
    out = reference.linear_f64(x, packed, scale, gs, bias)
    mag = x.double().abs() @ w.abs().T
    rank = lora_b.shape[1] // (len(bounds) - 1)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        s = shrunk[:, i * rank:(i + 1) * rank].double() * mask.double()
        bb = lora_b[lo:hi, i * rank:(i + 1) * rank].double()
        out[:, lo:hi] += s @ bb.T
        mag[:, lo:hi] += s.abs() @ bb.abs().T
    return out, mag


def half_ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units of half a bf16 ulp of ref."""
    exp = torch.floor(torch.log2(ref.abs().clamp_min(1e-30)))
    return (out.double() - ref).abs() / torch.exp2(exp - 8)



def fused(x, rw, gs, bias, n, shrunk, lora_b, mask, bounds, mode=0, splits=0) -> torch.Tensor:  # noqa: ANN001
    return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, bias, n, shrunk, lora_b, mask, bounds,
                                          int(mode), splits)


def separate(x, rw, gs, bias, n, shrunk, lora_b, mask, bounds, mode=0, splits=0) -> torch.Tensor:  # noqa: ANN001
    """What the fast path ran before the fused op: the GEMM, then qerl::lora_expand on the block-diagonal B."""
    out = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, int(mode), splits)
    return lora_expand(out, shrunk, lora_b.t(), mask)


def epilogue_runs(m: int, n: int, k: int, mode: int) -> bool:
    ext = kernels.extension()
    runs = bool(ext.lora_epilogue_runs(m, n, k, int(mode)))
    # the epilogue where the split-K kernel runs tiles of at most 8 tokens, the decode kernel, or the register-A wgmma
    # kernel its 64-, 192- or 256-token tiles (17-64 tokens; from 129, the wide kernel's default threshold), or its
    # 128-token tiles under wgmma_wide, not the 256-row 128-token kernel
    choice = ext.gemm_choice(m, n, k, int(mode))
    wgmma_tile = choice == "wgmma_wide" or (choice == "wgmma_rs" and (m <= 64 or m >= 129))
    assert runs == ((choice == "splitk" and m <= 8) or choice == "decode_tma" or wgmma_tile), (m, n, k, mode, choice)
    return runs


@pytest.mark.parametrize("mode,splits", MODES)
@pytest.mark.parametrize("n,k,bounds,rank", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_fused_op_matches_float64(m: int, n: int, k: int, bounds: list[int], rank: int, mode: int, splits: int):
    packed, scale, gs = rand_nvfp4(n, k, seed=n + k + m)
    rw = kernels.repack(packed, scale)
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    shrunk, lora_b, mask = lora_operands(m, n, bounds, rank, seed=m * n)
    ref, mag = oracle(x, packed, scale, gs, bias, shrunk, lora_b, mask, bounds)
    poison((m, n))
    got = fused(x, rw, gs, bias, n, shrunk, lora_b, mask, bounds, mode, splits)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    before = separate(x, rw, gs, bias, n, shrunk, lora_b, mask, bounds, mode, splits)
    base = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, int(mode), splits)
    assert torch.equal(got[3::4], base[3::4])  # tokens without the adapter: the GEMM's output, bit for bit
    if epilogue_runs(m, n, k, mode):
        # one rounding of the exact value (FP32 accumulation noise aside), and closer than the separate expand
        half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 8)
        assert bool(((got.double() - ref).abs() <= half_ulp + 1e-5 * mag).all())
        lora_rows = mask.reshape(-1) != 0
        e_fused = float(half_ulps(got, ref)[lora_rows].mean())
        e_before = float(half_ulps(before, ref)[lora_rows].mean())
        print(f"\nM={m} N={n} slices={len(bounds) - 1} mode={int(mode)}/{splits}: mean error {e_fused:.3f} "
              f"(fused) vs {e_before:.3f} (GEMM, then lora_expand) half-ulps")
        assert e_fused < e_before
    else:
        assert torch.equal(got, before)  # the fallback is that pair, bit for bit


@pytest.mark.parametrize("m", [5, 17, 64, 300])
def test_wgmma_lora_term_past_its_register_fragments(m: int) -> None:
    """Rank 64 with a slice boundary inside an m64 block: the register-A wgmma kernel's LoRA term (the tile's starting
    accumulator) holds the first two k16 steps of each block's lora_b fragments in registers and loads the rest in
    its loop (ranks 0-127 here), so both paths run against float64 (M = 300: the wide kernel, its 6 tiles split over
    clusters of 8 CTAs, the term added by rank 0)."""
    test_fused_op_matches_float64(m, 384, 1024, [0, 96, 384], 64, Mode.WGMMA_RS, 0)


@pytest.mark.parametrize("m", [17, 64])
def test_wgmma_lora_term_under_stream_k(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's small shapes split their few tiles over thread-block clusters (the term from rank 0); with the
    cluster split off (``QERL_WGMMA_CLUSTER=0``) the 64-token LoRA kernel runs stream-K on a qkv-like shape: the term
    from the segment that starts each tile, carried through the fix-up."""
    monkeypatch.setenv("QERL_WGMMA_CLUSTER", "0")
    test_fused_op_matches_float64(m, 768, 2048, [0, 512, 640, 768], 32, Mode.WGMMA_RS, 0)


@pytest.mark.parametrize("m", [129, 300])
def test_wide_lora_term_under_stream_k(m: int) -> None:
    """A 7B qkv-shaped layer (three slices, 36 128-row tiles of 28 stages): at M = 129 the wide kernel splits each tile
    over a cluster of 3 CTAs (the decode batches verl runs), at M = 300 its 72 tiles run stream-K (partial segments
    start inside tiles): only the segment that starts a tile adds its LoRA term, the sum over the others' partials
    (on chip or through the fix-up) carries it."""
    test_fused_op_matches_float64(m, 4608, 3584, [0, 3584, 4096, 4608], 32, Mode.WGMMA_RS, 0)


def test_decode_runs_one_kernel_and_the_fallback_two() -> None:
    """At decode M the op launches the split-K kernel only (no expand kernel); where auto picks another GEMM it is
    that GEMM's kernels plus ``_lora_expand_kernel`` (below ``CUBLAS_MIN_TOKENS``: tests/test_lora_expand_gpu.py
    covers the cuBLAS route above it)."""
    n, k, bounds, rank = 768, 2048, [0, 512, 640, 768], 32
    packed, scale, gs = rand_nvfp4(n, k, seed=1)
    rw = kernels.repack(packed, scale)
    for m in (1, 8, 64, 300):
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        shrunk, lora_b, mask = lora_operands(m, n, bounds, rank, seed=m)
        names = kernels_launched(lambda: fused(x, rw, gs, None, n, shrunk, lora_b, mask, bounds))  # noqa: B023
        print(f"\nM={m} ({kernels.extension().gemm_choice(m, n, k, 0)}): {names}")
        expand = sum("_lora_expand_kernel" in nm for nm in names)
        if epilogue_runs(m, n, k, 0):
            assert len(names) == 1 and expand == 0, names
            assert any(kn in names[0] for kn in ("nvfp4_gemm_splitk_kernel", "nvfp4_gemm_wgmma_lora_kernel",
                                                 "nvfp4_gemm_wgmma_wide_lora_kernel")), names
        else:
            assert expand == 1, names


@pytest.mark.parametrize("m", [1, 8, 16])
def test_graph_capture_and_bit_identical_repeats(m: int) -> None:
    """Captured in a CUDA graph (split-K semaphores and workspace inside it) and replayed with fresh activations and
    shrink outputs: the eager op's result bit for bit; eager repeats are bit-identical."""
    n, k, bounds, rank = 1024, 3584, [0, 512, 1024], 32
    packed, scale, gs = rand_nvfp4(n, k, seed=m)
    rw = kernels.repack(packed, scale)
    shrunk, lora_b, mask = lora_operands(m, n, bounds, rank, seed=3)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    runs = [fused(x, rw, gs, None, n, shrunk, lora_b, mask, bounds) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    x_static, s_static = x.clone(), shrunk.clone()

    def f() -> torch.Tensor:
        return fused(x_static, rw, gs, None, n, s_static, lora_b, mask, bounds)

    f()
    graph, y_static = capture(f)
    for i in range(3):
        x_new = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        s_new = (torch.randn(m, shrunk.shape[1], device=DEV) * 2).to(torch.bfloat16)
        x_static.copy_(x_new)
        s_static.copy_(s_new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, fused(x_new, rw, gs, None, n, s_new, lora_b, mask, bounds)), i


def test_operands_the_epilogue_does_not_take_fall_back() -> None:
    """fp32 shrink output, a rank that is not a multiple of 8, rows that are not 16-byte aligned, fp32 mask: the GEMM
    and then qerl::lora_expand, bit-identical to that pair."""
    n, k, bounds = 512, 1024, [0, 256, 512]
    packed, scale, gs = rand_nvfp4(n, k, seed=4)
    rw = kernels.repack(packed, scale)
    m = 4
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    shrunk, lora_b, mask = lora_operands(m, n, bounds, 16, seed=5)
    wide = torch.zeros(m, 36, device=DEV, dtype=torch.bfloat16)
    wide[:, :32] = shrunk
    s4, b4, _ = lora_operands(m, n, bounds, 4, seed=6)
    cases = {"fp32 shrunk": (shrunk.float(), lora_b, mask), "rank 4": (s4, b4, mask),
             "row stride 36": (wide[:, :32], lora_b, mask), "fp32 mask": (shrunk, lora_b, mask.float())}
    for name, (s, b, mk) in cases.items():
        poison((m, n))
        got = fused(x, rw, gs, None, n, s, b, mk, bounds)
        assert torch.equal(got, separate(x, rw, gs, None, n, s, b, mk, bounds)), name


def test_errors_name_the_operand() -> None:
    n, k, bounds = 512, 1024, [0, 256, 512]
    packed, scale, gs = rand_nvfp4(n, k, seed=7)
    rw = kernels.repack(packed, scale)
    x = torch.randn(2, k, device=DEV).to(torch.bfloat16)
    shrunk, lora_b, mask = lora_operands(2, n, bounds, 16, seed=8)
    with pytest.raises(RuntimeError, match="shrunk is on cpu"):
        fused(x, rw, gs, None, n, shrunk.cpu(), lora_b, mask, bounds)
    with pytest.raises(RuntimeError, match="lora_b must be \\[n, slices \\* rank\\]"):
        fused(x, rw, gs, None, n, shrunk, lora_b[:500], mask, bounds)
    with pytest.raises(RuntimeError, match="shrunk must be \\[M, slices \\* rank\\] = \\[2, 32\\]"):
        fused(x, rw, gs, None, n, shrunk[:, :16], lora_b, mask, bounds)
    with pytest.raises(RuntimeError, match="mask must be \\[M\\] or \\[M, 1\\] with M=2"):
        fused(x, rw, gs, None, n, shrunk, lora_b, mask[:1], bounds)
    with pytest.raises(RuntimeError, match="slice_bounds .* must start at 0 and end at n=512"):
        fused(x, rw, gs, None, n, shrunk, lora_b, mask, [0, 256, 500])
    with pytest.raises(RuntimeError, match="splits=2 .* needs mode 1"):
        fused(x, rw, gs, None, n, shrunk, lora_b, mask, bounds, Mode.AUTO, 2)


@pytest.mark.parametrize("m,bounds,rank,cluster", [
    (300, [0, 384], 48, "1"),      # one loop step past the register fragments, the last
    (300, [0, 384], 64, "1"),      # two loop steps, R = 64 (one k64 half)
    (300, [0, 96, 384], 32, "1"),  # the loop only from the slice boundary, R = 64
    (300, [0, 96, 384], 64, "0"),  # the rank-64 two-slice case under stream-K instead of clusters
    (256, [0, 96, 384], 64, "1"),
    (64, [0, 96, 384], 64, "1"),   # the 64-token LoRA kernel's same loop
])
def test_wgmma_lora_loop_steps(m: int, bounds: list[int], rank: int, cluster: str, monkeypatch) -> None:  # noqa: ANN001
    """The LoRA term's k16 loop past its register fragments, step by step: each wgmma of the loop reads the same
    fragment registers, which the next step may only overwrite after a wait retired it (a missing wait lost whole
    steps' ranks in the wide kernel: only rank > 32 or a slice boundary inside an m64 block reach the loop)."""
    monkeypatch.setenv("QERL_WGMMA_CLUSTER", cluster)  # read at each launch
    test_fused_op_matches_float64(m, 384, 1024, bounds, rank, Mode.WGMMA_RS, 0)
