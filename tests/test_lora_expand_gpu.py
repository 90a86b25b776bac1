"""GPU tests of the LoRA expand kernel launched from C++ (cuda/lora_expand.cu): ``out + mask * (shrunk @ B^T)``.

It runs inside ``qerl::nvfp4_gemm_lora`` / ``qerl::nvfp4_lora_linear`` wherever the GEMM has no LoRA epilogue (in
place on the GEMM's output, each column reading only its slice's ranks of the block-diagonal B), and as the CUDA
side of ``qerl::lora_expand`` (a new tensor, all ranks). What can go wrong, and what catches it here:
* a wrong sum (slice offsets, a token block's shrink rows, the last partial token block or column pair): the float64
  oracle on odd shapes (N odd, slice bounds inside a column pair, T across the 8- and 32-token blocks), bf16 and fp16;
* rows of tokens without the adapter touched: bit-for-bit equality with the GEMM's output;
* unwritten output: the op's allocation is NaN-poisoned first;
* operands it does not take (fp32, B rows not unit-stride): the op still answers, through Triton;
* capture: a CUDA graph replay with fresh operands equals the eager call bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import GemmMode as Mode
from verl_qerl.kernels import reference
from verl_qerl.kernels.lora_expand import lora_expand
from verl_qerl.testing.gpu import capture, kernels_launched
from verl_qerl.testing.nvfp4_random import random_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
KERNEL = "qerl::(anonymous namespace)::lora_expand_kernel"
#: (N, slice bounds, rank per slice): one slice (o / down), two (gate_up), three uneven (qkv), N odd with bounds that
#: split a thread's column pair, the largest rank count the kernel takes (256 = 2 x 128)
SHAPES = [(512, [0, 512], 32), (1024, [0, 512, 1024], 32), (768, [0, 512, 640, 768], 32), (37, [0, 17, 24, 37], 8),
          (301, [0, 301], 96), (384, [0, 129, 384], 128)]
TOKENS = [1, 3, 8, 9, 33, 300]


@pytest.fixture(scope="module", autouse=True)
def _ext() -> None:
    if not kernels.load_extension(verbose=False):
        pytest.fail(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")


def poison(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = torch.empty(shape, dtype=dtype, device=DEV)
    t.fill_(float("nan"))
    del t


def operands(t: int, n: int, bounds: list[int], rank: int, dtype: torch.dtype, seed: int):
    """out [t, n], shrunk [t, S*rank], block-diagonal B [n, S*rank], mask [t, 1] (every 4th token without the
    adapter); the LoRA term about as large as out."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    slices = len(bounds) - 1
    out = torch.randn(t, n, device=DEV, generator=g).to(dtype)
    shrunk = (torch.randn(t, slices * rank, device=DEV, generator=g) / rank**0.5).to(dtype)
    lora_b = torch.zeros(n, slices * rank, device=DEV, dtype=dtype)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        lora_b[lo:hi, i * rank:(i + 1) * rank] = torch.randn(hi - lo, rank, device=DEV, generator=g).to(dtype)
    mask = (torch.arange(t, device=DEV) % 4 != 3).to(dtype).unsqueeze(1)
    return out, shrunk, lora_b, mask


def oracle(out, shrunk, lora_b, mask) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(float64 result, float64 sum of absolute products: the scale of FP32 accumulation noise)."""
    s = shrunk.double() * mask.double()
    return out.double() + s @ lora_b.double().T, s.abs() @ lora_b.double().abs().T


def within_one_rounding(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> bool:
    """One rounding of the exact value to got's dtype (half an ulp), FP32 accumulation noise aside."""
    mant = torch.finfo(got.dtype).nmant
    half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - mant - 1)
    return bool(((got.double() - ref).abs() <= half_ulp + 1e-5 * mag + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,bounds,rank", SHAPES)
@pytest.mark.parametrize("t", TOKENS)
def test_op_matches_float64(t: int, n: int, bounds: list[int], rank: int, dtype: torch.dtype) -> None:
    out, shrunk, lora_b, mask = operands(t, n, bounds, rank, dtype, seed=t * 1000 + n)
    ref, mag = oracle(out, shrunk, lora_b, mask)
    poison((t, n), dtype)
    names = kernels_launched(lambda: lora_expand(out, shrunk, lora_b.t(), mask))
    assert names == [n for n in names if KERNEL in n] and len(names) == 1, names  # the C++ kernel, not Triton
    poison((t, n), dtype)
    got = lora_expand(out, shrunk, lora_b.t(), mask)
    assert got.shape == (t, n) and got.dtype == dtype and not torch.isnan(got).any()
    assert within_one_rounding(got, ref, mag), float((got.double() - ref).abs().max())
    assert torch.equal(got[3::4], out[3::4])  # tokens without the adapter: out, bit for bit
    assert torch.equal(got, lora_expand(out, shrunk, lora_b.t(), mask))  # deterministic


@pytest.mark.parametrize("m", [9, 64, 300])
def test_inside_the_gemm_lora_op_slice_aware_and_in_place(m: int) -> None:
    """Where the GEMM has no LoRA epilogue the op adds the expand in place on its output: the rows of tokens without
    the adapter are the GEMM's, bit for bit; the others match the float64 layer; the slice-aware sum equals the
    Python op's all-ranks sum over the block-diagonal B bit for bit."""
    n, k, bounds, rank = 768, 1024, [0, 512, 640, 768], 32
    packed, scale, gs = random_nvfp4(n, k, m, DEV)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    _, shrunk, lora_b, mask = operands(m, n, bounds, rank, torch.bfloat16, seed=m)
    assert not kernels.extension().lora_epilogue_runs(m, n, k, int(Mode.AUTO))
    base = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, int(Mode.AUTO), 0)
    names = kernels_launched(lambda: torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk,
                                                                    lora_b, mask, bounds, int(Mode.AUTO), 0))
    assert sum(KERNEL in nm for nm in names) == 1 and not any("_lora_expand_kernel" in nm for nm in names), names
    got = torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk, lora_b, mask, bounds,
                                         int(Mode.AUTO), 0)
    assert torch.equal(got[3::4], base[3::4])
    assert torch.equal(got, lora_expand(base, shrunk, lora_b.t(), mask))
    w = reference.dequantize_f64(packed, scale, gs)
    ref = reference.linear_f64(x, packed, scale, gs, None)
    s = shrunk.double() * mask.double()
    ref += s @ lora_b.double().T
    mag = x.double().abs() @ w.abs().T + s.abs() @ lora_b.double().abs().T
    # the GEMM's bf16 rounding (at most 2^-8 of the base value), then the expand's (2^-8 of the result)
    base_ref = reference.linear_f64(x, packed, scale, gs, None)
    assert bool(((got.double() - ref).abs() <= 2.0**-8 * (ref.abs() + base_ref.abs()) + 1e-5 * mag).all())


def test_strided_operands_and_the_ones_it_does_not_take() -> None:
    """Row strides other than the width are taken (a column slice of out, shrunk inside a wider buffer, B rows inside
    a wider buffer); fp32 operands and a b_t whose rows are not B's (B^T stored contiguously) go to Triton, and
    the answer is the same either way."""
    ext = kernels.extension()
    t, n, r = 40, 300, 32
    g = torch.Generator(device=DEV).manual_seed(7)
    wide_out = torch.randn(t, n + 20, device=DEV, generator=g).to(torch.bfloat16)
    wide_s = torch.randn(t, r + 8, device=DEV, generator=g).to(torch.bfloat16)
    wide_b = torch.randn(n, r + 16, device=DEV, generator=g).to(torch.bfloat16)
    out, shrunk, b = wide_out[:, 5:5 + n], wide_s[:, :r], wide_b[:, 16:]
    mask = (torch.arange(t, device=DEV) % 3 != 0).to(torch.bfloat16)
    ref, mag = oracle(out, shrunk, b, mask.unsqueeze(1))
    got = ext.lora_expand(out, shrunk, b.t(), mask)
    assert got is not None and got.is_contiguous() and within_one_rounding(got, ref, mag)
    assert ext.lora_expand(out.float(), shrunk.float(), b.t().float(), mask.float()) is None
    b_t_rows = b.t().contiguous()  # [R, N] row-major: B's rows are not unit-stride
    assert ext.lora_expand(out, shrunk, b_t_rows, mask) is None
    via_triton = lora_expand(out, shrunk, b_t_rows, mask)
    assert not torch.isnan(via_triton).any()
    assert float((via_triton.double() - ref).abs().max()) <= float(2e-2 * ref.abs().max())
    assert ext.lora_expand(out, shrunk[:, :24], b.t()[:24], mask) is not None  # rank 24: any rank
    too_many = torch.randn(t, 264, device=DEV).to(torch.bfloat16)
    assert ext.lora_expand(out, too_many, torch.randn(n, 264, device=DEV).to(torch.bfloat16).t(), mask) is None


@pytest.mark.parametrize("t", [8, 300])
def test_graph_capture(t: int) -> None:
    """Captured and replayed with fresh operands: the eager op's result bit for bit."""
    n, bounds, rank = 768, [0, 512, 640, 768], 32
    out, shrunk, lora_b, mask = operands(t, n, bounds, rank, torch.bfloat16, seed=11)
    o_static, s_static = out.clone(), shrunk.clone()

    def f() -> torch.Tensor:
        return lora_expand(o_static, s_static, lora_b.t(), mask)

    f()
    graph, y_static = capture(f)
    for i in range(3):
        o_new, s_new, _, _ = operands(t, n, bounds, rank, torch.bfloat16, seed=100 + i)
        o_static.copy_(o_new)
        s_static.copy_(s_new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, lora_expand(o_new, s_new, lora_b.t(), mask)), i
