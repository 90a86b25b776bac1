"""GPU tests of ``qerl::nvfp4_lora_linear``: a whole LoRA linear layer, the shrink riding in the split-K GEMM's launch
(run on the GPU machine; skipped without CUDA).

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


def in_launch(m: int, n: int, k: int, mode: int) -> bool:
    ext = kernels.extension()
    runs = bool(ext.lora_shrink_in_launch_runs(m, n, k, int(mode)))
    assert runs == bool(ext.lora_epilogue_runs(m, n, k, int(mode)) and ext.gemm_choice(m, n, k, int(mode)) == "splitk")
    return runs



@pytest.mark.parametrize("mode,splits", MODES)
@pytest.mark.parametrize("n,k,bounds,rank", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_lora_linear_matches_float64(m: int, n: int, k: int, bounds: list[int], rank: int, mode: int, splits: int):
    packed, scale, gs = random_nvfp4(n, k, seed=n + k + m, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=m * n + rank)
    bias = torch.randn(n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(m + n)).to(torch.bfloat16)
    # float64 oracle: the exact shrink (the kernel rounds its FP32 sum to bf16: up to half an ulp of each shrunk
    # value, bounded below through |shrunk| @ |B|)
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
    poison((m, n))
    got = linear(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode, splits)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 8)
    err = (got.double() - ref).abs()
    bound = half_ulp + 1e-5 * mag_gemm + 2.0**-8 * mag_lora
    assert bool((err <= bound).all()), float((err / bound).max())
    base = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, int(mode), splits)
    before = pair(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds, mode, splits)
    if splits or not in_launch(m, n, k, mode):
        assert torch.equal(got[3::4], base[3::4])  # tokens without the adapter: the GEMM's output, bit for bit
    else:
        # with the in-launch shrink the op may split K differently from the GEMM alone (its shrink CTAs count as
        # tiles: 768 x 2048 at M <= 8 runs 8 splits against the GEMM's 1), so those rows are the GEMM's value summed
        # in another order: at most one bf16 rounding apart (an unseeded bias once made this fail 1 run in 2)
        apart = (got[3::4].double() - base[3::4].double()).abs()
        assert bool((apart <= 2 * half_ulp[3::4] + 1e-5 * mag_gemm[3::4]).all())
    if not in_launch(m, n, k, mode):
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
        if in_launch(m, n, k, 0):
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
    packed, scale, gs = random_nvfp4(n, k, seed=m, device=DEV)
    rw = kernels.repack(packed, scale)
    x, lora_a, lora_b, mask = operands(m, n, k, bounds, rank, seed=3)
    sk = Mode.SPLITK
    assert in_launch(m, n, k, sk) and kernels.extension().splits_for(m, n, k) > 4
    runs = [linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, sk, pdl=pdl) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert torch.equal(runs[0], linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds, sk, pdl=not pdl))
    xs, As, Bs = x.clone(), lora_a.clone(), lora_b.clone()

    def f() -> torch.Tensor:
        return linear(xs, rw, gs, None, n, As, Bs, mask, bounds, sk, pdl=pdl)

    graph, y = capture(f)
    for i in range(6):
        x2, a2, b2, _ = operands(m, n, k, bounds, rank, seed=100 + i)
        xs.copy_(x2)
        As.copy_(a2)
        Bs.copy_(b2)
        graph.replay()
        torch.cuda.synchronize()
        want = linear(x2, rw, gs, None, n, a2, b2, mask, bounds, sk, pdl=pdl)
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
    assert not in_launch(m, n, k, Mode.AUTO)
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
