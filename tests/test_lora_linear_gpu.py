"""GPU tests of ``qerl::nvfp4_lora_linear``: a whole LoRA linear layer, the shrink riding in the split-K GEMM's launch
or in the copy-engine decode kernel's (``decode_tma``: one shrink unit in each of its lowest-indexed CTAs; run on the
GPU machine; skipped without CUDA).

What can go wrong in the in-launch shrink, and what catches it here:
* a wrong shrink (rank rows, slices, the K range of a split, a partial summed twice or missed): the float64 oracle,
  with the LoRA term scaled to the size of the GEMM's output;
* a tile reading the shrink's sum before its last CTA wrote it (the ready flag, the release / acquire pair), or
  counters not reset for the next launch: CUDA-graph replays with fresh activations must equal eager calls bit for
  bit (a stale flag makes a replay use the previous activations' shrink), on a long K with many splits;
* the deterministic order: repeats are bit-identical;
* the route: at decode M the op launches one kernel (no Triton shrink), elsewhere the shrink and the LoRA GEMM pair,
  and there it is that pair bit for bit.
Outputs are NaN-poisoned first (a freed NaN-filled block of the output's size is what the op's allocation gets).
"""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import GemmMode as Mode
from verl_qerl.kernels import reference
from verl_qerl.kernels.lora_shrink import lora_shrink
from verl_qerl.testing.gpu import capture, kernels_launched, poison
from verl_qerl.testing.nvfp4_random import random_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
#: (N, K, slice_bounds, rank): o-like (one slice of rank 32: one shrink column), rank 64 (two columns), gate_up-like,
#: qkv-like (three uneven slices: three columns), down-like long K (many splits), and N not a multiple of the tile
#: with rank 8 x 3 = 24 ranks (one column, its last 8 A rows zero-filled)
SHAPES = [(512, 1024, [0, 512], 32), (512, 1024, [0, 512], 64), (1024, 1024, [0, 512, 1024], 32),
          (768, 2048, [0, 512, 640, 768], 32), (384, 7168, [0, 384], 32), (208, 512, [0, 40, 80, 208], 8)]
#: auto dispatch; split-K with one split (each CTA its own tile's last, the shrink CTAs cover all of K) and with 4
MODES = [(Mode.AUTO, 0), (Mode.SPLITK, 1), (Mode.SPLITK, 4)]
TOKENS = [1, 2, 3, 7, 8, 9, 17, 64]


@pytest.fixture(scope="module", autouse=True)
def _ext() -> None:
    if not kernels.load_extension(verbose=False):
        pytest.fail(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")


def operands(m: int, n: int, k: int, bounds: list[int], rank: int, seed: int):
    """x [m, k], A_cat [S*rank, k], block-diagonal B [n, S*rank], mask [m, 1] (every 4th token without the adapter);
    the LoRA term about as large as the GEMM's output."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    slices = len(bounds) - 1
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    lora_a = (torch.randn(slices * rank, k, device=DEV, generator=g) * (2.0 / k**0.5)).to(torch.bfloat16)
    lora_b = torch.zeros(n, slices * rank, device=DEV, dtype=torch.bfloat16)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        lora_b[lo:hi, i * rank:(i + 1) * rank] = torch.randn(hi - lo, rank, device=DEV, generator=g).to(torch.bfloat16)
    mask = (torch.arange(m, device=DEV) % 4 != 3).to(torch.bfloat16).unsqueeze(1)
    return x, lora_a, lora_b, mask


def linear(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode=0, splits=0, pdl=False) -> torch.Tensor:  # noqa: ANN001
    return torch.ops.qerl.nvfp4_lora_linear(x, rw.qweight, rw.qscale, gs, bias, n, lora_a, lora_b, mask, bounds,
                                            int(mode), splits, pdl)


def pair(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode=0, splits=0) -> torch.Tensor:  # noqa: ANN001
    """The fast path before the in-launch shrink: qerl::lora_shrink, then qerl::nvfp4_gemm_lora."""
    shrunk = lora_shrink(x, lora_a)
    return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, bias, n, shrunk, lora_b, mask, bounds,
                                          int(mode), splits)


def in_launch(m: int, n: int, k: int, mode: int, ranks: int = 32) -> bool:
    """Whether the op runs the shrink in the GEMM's launch for ``ranks`` = slices x rank shrunk columns: split-K at
    decode M wherever its LoRA epilogue runs; ``decode_tma`` where it runs and the shrink's units fit its grid."""
    ext = kernels.extension()
    runs = bool(ext.lora_shrink_in_launch_runs(m, n, k, int(mode), ranks))
    epilogue = bool(ext.lora_epilogue_runs(m, n, k, int(mode)))
    choice = ext.gemm_choice(m, n, k, int(mode))
    if choice == "decode_tma":
        assert epilogue and (not runs or m <= 16)
    else:
        assert runs == (epilogue and choice == "splitk")
    return runs


def oracle(x, packed, scale, gs, bias, lora_a, lora_b, mask, bounds, rank):  # noqa: ANN001, ANN201
    """float64 oracle of the layer with the exact shrink: (result, |x| @ |W|^T: the GEMM's FP32 noise scale, the LoRA
    term's magnitude through |shrunk| @ |B|: the scale of the kernel's one bf16 rounding of each shrunk value, half a
    bf16 ulp of the result)."""
    w = reference.dequantize_f64(packed, scale, gs)
    shrunk64 = x.double() @ lora_a.double().T
    ref = reference.linear_f64(x, packed, scale, gs, bias)
    mag_gemm = x.double().abs() @ w.abs().T
    mag_lora = torch.zeros_like(ref)
    r = rank
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        s = shrunk64[:, i * r:(i + 1) * r] * mask.double()
        bb = lora_b[lo:hi, i * r:(i + 1) * r].double()
        ref[:, lo:hi] += s @ bb.T
        s_mag = (x.double().abs() @ lora_a[i * r:(i + 1) * r].double().abs().T) * mask.double()
        mag_lora[:, lo:hi] += s_mag @ bb.abs().T
    half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 8)
    return ref, mag_gemm, mag_lora, half_ulp


def run_checked(m: int, n: int, k: int, bounds: list[int], rank: int, mode: int, splits: int = 0):  # noqa: ANN201
    """The op on operands seeded by the shape (a bias too) into a NaN-poisoned output, checked against the oracle:
    every element written, within one rounding of the float64 value (half an ulp, FP32 accumulation noise of the
    GEMM, half a bf16 ulp of each shrunk value through |B|). Returns the output, the operands (x, weight, global
    scale, bias, lora_a, lora_b, mask) and the oracle's scales (|x| @ |W|^T, |shrunk| @ |B|^T, half an ulp)."""
    packed, scale, gs = random_nvfp4(n, k, seed=n + k + m, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=m * n + rank)
    bias = torch.randn(n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(m + n)).to(torch.bfloat16)
    ref, mag_gemm, mag_lora, half_ulp = oracle(x, packed, scale, gs, bias, lora_a, lora_b, mask, bounds, rank)
    poison((m, n))
    got = linear(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode, splits)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    err = (got.double() - ref).abs()
    bound = half_ulp + 1e-5 * mag_gemm + 2.0**-8 * mag_lora
    assert bool((err <= bound).all()), float((err / bound).max())
    return got, (x, rw, gs, bias, lora_a, lora_b, mask), (mag_gemm, mag_lora, half_ulp)


@pytest.mark.parametrize("mode,splits", MODES)
@pytest.mark.parametrize("n,k,bounds,rank", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_lora_linear_matches_float64(m: int, n: int, k: int, bounds: list[int], rank: int, mode: int, splits: int):
    got, (x, rw, gs, bias, lora_a, lora_b, mask), (mag_gemm, mag_lora, half_ulp) = run_checked(m, n, k, bounds, rank,
                                                                                               mode, splits)
    base = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, int(mode), splits)
    before = pair(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode, splits)
    ranks = (len(bounds) - 1) * rank
    if splits or not in_launch(m, n, k, mode, ranks):
        assert torch.equal(got[3::4], base[3::4])  # tokens without the adapter: the GEMM's output, bit for bit
    else:
        # with the in-launch shrink the op may split K differently from the GEMM alone (its shrink CTAs count as
        # tiles: 768 x 2048 at M <= 8 runs 8 splits against the GEMM's 1), so those rows are the GEMM's value summed
        # in another order: at most one bf16 rounding apart (an unseeded bias once made this fail 1 run in 2)
        apart = (got[3::4].double() - base[3::4].double()).abs()
        assert bool((apart <= 2 * half_ulp[3::4] + 1e-5 * mag_gemm[3::4]).all())
    if not in_launch(m, n, k, mode, ranks):
        assert torch.equal(got, before)  # the fallback is that pair, bit for bit
    else:
        # the same up to the shrink's summation order (its bf16 rounding may land one ulp apart)
        assert bool(((got.double() - before.double()).abs() <= 2 * half_ulp + 2.0**-7 * mag_lora).all())


def test_decode_runs_one_kernel_and_the_fallback_more() -> None:
    """At decode M the op launches the split-K kernel only (no shrink, no expand kernel); where auto picks another
    GEMM it runs the Triton shrink too."""
    n, k, bounds, rank = 768, 2048, [0, 512, 640, 768], 32
    packed, scale, gs = random_nvfp4(n, k, seed=1, device=DEV)
    rw = kernels.repack(packed, scale)
    for m in (1, 8, 300):
        x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=m)
        names = kernels_launched(lambda: linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))  # noqa: B023
        print(f"\nM={m} ({kernels.extension().gemm_choice(m, n, k, 0)}): {names}")
        if in_launch(m, n, k, 0, 3 * rank):
            assert len(names) == 1 and "nvfp4_gemm_splitk_kernel" in names[0], names
        else:
            assert len(names) >= 2, names


@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize("pdl", [False, True])
def test_graph_replays_and_repeats_are_bit_identical(m: int, pdl: bool) -> None:
    """Captured in a CUDA graph and replayed with fresh activations and adapter weights, on a long K (many splits):
    each replay equals the eager op on the same inputs bit for bit (a stale ready flag or counter from the previous
    launch would hand the tiles the previous shrink); eager repeats are bit-identical; PDL changes nothing."""
    n, k, bounds, rank = 1536, 18944, [0, 1024, 1536], 32
    assert in_launch(m, n, k, Mode.SPLITK, 2 * rank) and kernels.extension().splits_for(m, n, k) > 4
    check_replays_and_repeats(m, n, k, bounds, rank, Mode.SPLITK, pdl, seed=m, replays=6)


def check_replays_and_repeats(m, n, k, bounds, rank, mode, pdl, seed, replays) -> None:  # noqa: ANN001
    """Eager repeats of the op in `mode` bit-identical, with PDL flipped too; then the op captured in a CUDA graph and
    replayed with fresh activations and adapter weights copied into its inputs: each replay the eager op's bits."""
    packed, scale, gs = random_nvfp4(n, k, seed=seed, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=3)
    runs = [linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, mode, pdl=pdl) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert torch.equal(runs[0], linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, mode, pdl=not pdl))
    xs, As, Bs = x.clone(), lora_a.clone(), lora_b.clone()

    def f() -> torch.Tensor:
        return linear(xs, rw, gs, None, n, As, Bs, mask, bounds, mode, pdl=pdl)

    graph, y = capture(f)
    for i in range(replays):
        x2, a2, b2, _ = operands(m, n, k, bounds, rank, seed=100 + i)
        xs.copy_(x2)
        As.copy_(a2)
        Bs.copy_(b2)
        graph.replay()
        torch.cuda.synchronize()
        want = linear(x2, rw, gs, None, n, a2, b2, mask, bounds, mode, pdl=pdl)
        assert torch.equal(y, want), f"replay {i}"


def test_bad_operands_name_the_tensor() -> None:
    n, k, bounds, rank = 512, 1024, [0, 512], 32
    packed, scale, gs = random_nvfp4(n, k, seed=2, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(4, n, k, bounds, rank, seed=2)
    with pytest.raises(RuntimeError, match="lora_a must be"):
        linear(x, rw, gs, None, n, lora_a[:, :512], lora_b, mask, bounds)
    with pytest.raises(RuntimeError, match="lora_a must be"):
        linear(x, rw, gs, None, n, lora_a[:16], lora_b, mask, bounds)
    with pytest.raises(RuntimeError, match="lora_a is on"):
        linear(x, rw, gs, None, n, lora_a.cpu(), lora_b, mask, bounds)
    # an A the in-launch shrink does not take (rows not 16-byte aligned) still gives the right answer, through the pair
    wide = torch.zeros(lora_a.shape[0], k + 8, device=DEV, dtype=torch.bfloat16)
    wide[:, 1:k + 1] = lora_a
    odd = wide[:, 1:k + 1]
    got = linear(x, rw, gs, None, n, odd, lora_b, mask, bounds, Mode.SPLITK)
    assert torch.equal(got, pair(x, rw, gs, None, n, odd, lora_b, mask, bounds, Mode.SPLITK))
    assert not torch.equal(got, pair(x, rw, gs, None, n, odd * 2, lora_b, mask, bounds, Mode.SPLITK))


def test_shrink_above_the_triton_threshold_is_cublas_from_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``TRITON_MAX_TOKENS``, where ``triton_wins`` does not hold (here K > 4096), the op calls cuBLAS for the
    shrink itself (no Triton shrink kernel), bit-identical to the pair whose Python shrink runs ``F.linear``;
    ``QERL_LORA_SHRINK=triton`` still reaches the Triton kernel, and a bad value still raises the Python op's error
    naming the variable."""
    from verl_qerl.kernels.lora_shrink import TRITON_MAX_TOKENS, triton_wins

    n, k, bounds, rank = 768, 4608, [0, 512, 640, 768], 32
    m = TRITON_MAX_TOKENS + 1
    assert not triton_wins(m, 3 * rank, k)
    packed, scale, gs = random_nvfp4(n, k, seed=5, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=6)
    assert not in_launch(m, n, k, Mode.AUTO, 3 * rank)
    names = kernels_launched(lambda: linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))
    assert not any("_lora_shrink_kernel" in nm for nm in names), names
    assert torch.equal(linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds),
                       pair(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))
    monkeypatch.setenv("QERL_LORA_SHRINK", "triton")
    names = kernels_launched(lambda: linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))
    assert sum("_lora_shrink_kernel" in nm for nm in names) == 1, names
    monkeypatch.setenv("QERL_LORA_SHRINK", "fastest")
    with pytest.raises(Exception, match="QERL_LORA_SHRINK"):
        linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds)


@pytest.mark.parametrize("m", [17, 42, 64])
def test_shrink_stays_on_triton_where_it_wins_by_shape(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    """17-64 tokens with a short K and a small T x R (``triton_wins``): the C++ side hands the shrink to the Python op,
    which runs the Triton kernel, so the one op and the pair run the same shrink kernel and give the same bits; where
    the rule fails (m = 64 here: T x R = 6144) both run cuBLAS. ``QERL_LORA_SHRINK=cublas`` moves both to cuBLAS."""
    from verl_qerl.kernels.lora_shrink import triton_wins

    monkeypatch.delenv("QERL_LORA_SHRINK", raising=False)
    n, k, bounds, rank = 768, 2048, [0, 512, 640, 768], 32
    packed, scale, gs = random_nvfp4(n, k, seed=7, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=8)
    wins = triton_wins(m, 3 * rank, k)
    assert wins is (m < 64)
    names = kernels_launched(lambda: linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))
    assert sum("_lora_shrink_kernel" in nm for nm in names) == (1 if wins else 0), names
    assert torch.equal(linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds),
                       pair(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))
    monkeypatch.setenv("QERL_LORA_SHRINK", "cublas")
    names = kernels_launched(lambda: linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))
    assert not any("_lora_shrink_kernel" in nm for nm in names), names
    assert torch.equal(linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds),
                       pair(x, rw, gs, None, n, lora_a, lora_b, mask, bounds))


# ---- the copy-engine decode kernel's in-launch shrink (mode decode_tma; the H200 table routes 7B / 32B gate_up there)

#: (N, K, slice_bounds, rank) in mode decode_tma: gate_up-like (two slices) with 48 ranks (the second shrink column's
#: last 16 A rows zero-filled by the tensor map), one stage (K = 128: whole-tile ranges, no stream-K partials ahead of
#: the shrink's), N not a multiple of the 128-row tile with a slice boundary inside a tile and 80 ranks (three columns),
#: qkv-like (three slices, 96 ranks), a long K (148 stages x 2 columns: 296 shrink units, more than a block_m 16 launch
#: has CTAs, so there the op runs the pair), and 7B gate_up itself (56 units; ranges shorter than a tile at block_m 8,
#: whole tiles in them at 16)
DECODE_SHAPES = [(1024, 2048, [0, 512, 1024], 24), (1024, 128, [0, 512, 1024], 24), (1040, 1024, [0, 528, 1040], 40),
                 (768, 2048, [0, 512, 640, 768], 32), (1536, 18944, [0, 1024, 1536], 32),
                 (37888, 3584, [0, 18944, 37888], 32)]
#: block_m 8 (1, 5, 8) and 16 (13, 16)
DECODE_TOKENS = [1, 5, 8, 13, 16]
#: 7B gate_up (N, K, slice_bounds, rank)
GATE_UP_7B = (37888, 3584, [0, 18944, 37888], 32)


def needs_decode_tma() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the copy-engine decode kernel runs on sm_90 (Hopper) only")
    got = kernels.extension().gemm_choice(1, 256, 128, int(Mode.DECODE_TMA))
    assert got == "decode_tma", f"sm_90 device but no sm_90a decode_tma build (runs {got})"


@pytest.mark.parametrize("n,k,bounds,rank", DECODE_SHAPES)
@pytest.mark.parametrize("m", DECODE_TOKENS)
def test_decode_tma_in_launch_shrink_matches_float64(m: int, n: int, k: int, bounds: list[int], rank: int) -> None:
    """The decode kernel with the shrink in its launch: within one rounding of the float64 oracle; tokens without the
    adapter are the pair's bits (the decode LoRA kernel on the same grid) and, at block_m 8 (where the plain kernel has
    that grid too), the base GEMM's; the rest within the shrink's own rounding of the pair (its FP32 sum is taken in
    another order than the Triton shrink's, then rounded to bf16 once, as there); a repeat gives the same bits. Where
    the shrink's units outnumber the launch's CTAs the op is the pair, bit for bit."""
    needs_decode_tma()
    mode = Mode.DECODE_TMA
    got, (x, rw, gs, bias, lora_a, lora_b, mask), (_, mag_lora, half_ulp) = run_checked(m, n, k, bounds, rank, mode)
    runs = in_launch(m, n, k, mode, (len(bounds) - 1) * rank)
    print(f"\nM={m} N={n} K={k} ranks={(len(bounds) - 1) * rank}: shrink in the decode kernel's launch {runs}")
    assert runs or (k == 18944 and m > 8)
    before = pair(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode)
    assert torch.equal(got[3::4], before[3::4])  # tokens without the adapter: the same GEMM, bit for bit
    if m <= 8:
        base = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, int(mode), 0)
        assert torch.equal(got[3::4], base[3::4])
    if runs:
        assert bool(((got.double() - before.double()).abs() <= 2 * half_ulp + 2.0**-7 * mag_lora).all())
        poison((m, n))
        assert torch.equal(got, linear(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode))
    else:
        assert torch.equal(got, before)  # the fallback is that pair, bit for bit


def test_decode_tma_in_launch_is_one_kernel() -> None:
    """7B gate_up in mode decode_tma at M = 1 / 8 / 16 (and in auto where the device's table runs decode_tma there, as
    the H200's does): one kernel launch, the decode kernel's linear kernel (no Triton shrink, no expand kernel). With
    more shrink units than CTAs (one 128-row tile: 2 columns x 8 stages on 8 CTAs) the op runs the Triton shrink and
    the decode LoRA kernel."""
    needs_decode_tma()
    n, k, bounds, rank = GATE_UP_7B
    packed, scale, gs = random_nvfp4(n, k, seed=3, device=DEV)
    rw = kernels.repack(packed, scale)
    for mode in (Mode.DECODE_TMA, Mode.AUTO):
        for m in (1, 8, 16):
            if kernels.extension().gemm_choice(m, n, k, int(mode)) != "decode_tma":
                continue  # auto without a table that runs decode_tma here
            x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=m)
            assert in_launch(m, n, k, mode, 2 * rank)
            names = kernels_launched(lambda: linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, mode))  # noqa: B023
            print(f"\nM={m} mode={int(mode)}: {names}")
            assert len(names) == 1 and "nvfp4_gemm_decode_tma_linear_kernel" in names[0], names
    n, k, bounds = 128, 1024, [0, 64, 128]
    packed, scale, gs = random_nvfp4(n, k, seed=4, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(1, n, k, bounds, rank, seed=5)
    assert not in_launch(1, n, k, Mode.DECODE_TMA, 2 * rank)
    names = kernels_launched(lambda: linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, Mode.DECODE_TMA))
    assert any("_lora_shrink_kernel" in nm for nm in names), names
    assert any("nvfp4_gemm_decode_tma_kernel" in nm for nm in names), names
    assert torch.equal(linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, Mode.DECODE_TMA),
                       pair(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, Mode.DECODE_TMA))


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("pdl", [False, True])
def test_decode_tma_in_launch_graph_replays_and_repeats(m: int, pdl: bool) -> None:
    """7B gate_up in mode decode_tma, captured in a CUDA graph and replayed with fresh activations and adapter weights:
    each replay equals the eager op on the same inputs bit for bit (a ready flag or a counter the previous launch
    left set would hand the tiles the previous shrink, or a column sum the previous partials); eager repeats are
    bit-identical; PDL changes nothing (each unit's A rows are copied before the wait for the prior grid, its
    activations after)."""
    needs_decode_tma()
    n, k, bounds, rank = GATE_UP_7B
    assert in_launch(m, n, k, Mode.DECODE_TMA, 2 * rank)
    check_replays_and_repeats(m, n, k, bounds, rank, Mode.DECODE_TMA, pdl, seed=m + 7, replays=4)
