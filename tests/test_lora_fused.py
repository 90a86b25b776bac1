"""``qerl::nvfp4_gemm_lora`` on the CPU: its reference implementation (what the CUDA op is held to) against a
float64 oracle written here from the op's definition, its operand checks, its fake impl, and
:func:`verl_qerl.kernels.linear_lora`. The CUDA kernel's own tests are in tests/test_lora_fused_gpu.py."""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import reference
from verl_qerl.kernels.ops import LoRAOperandError

#: (N, slice_bounds): one slice; three of uneven widths (N not a multiple of 128); a boundary inside a 16-column block
SHAPES = [(16, [0, 16]), (208, [0, 48, 80, 208]), (144, [0, 40, 144]), (384, [0, 128, 256, 384])]


def random_nvfp4(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    sbytes = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen)
    gs = torch.tensor([2688.0 / (0.05 + torch.rand(1, generator=gen).item())], dtype=torch.float32)
    return packed, sbytes.view(torch.float8_e4m3fn), gs


def lora_operands(t: int, n: int, bounds: list[int], rank: int, dtype: torch.dtype, seed: int):
    """shrunk [t, S*rank], the block-diagonal lora_b [n, S*rank] (zero off the diagonal blocks), a 0/1 mask [t, 1]
    (token 1 without the adapter when t > 1)."""
    gen = torch.Generator().manual_seed(seed)
    slices = len(bounds) - 1
    shrunk = torch.randn(t, slices * rank, generator=gen).to(dtype)
    lora_b = torch.zeros(n, slices * rank, dtype=dtype)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        lora_b[lo:hi, i * rank:(i + 1) * rank] = torch.randn(hi - lo, rank, generator=gen).to(dtype)
    mask = torch.ones(t, 1, dtype=dtype)
    if t > 1:
        mask[1] = 0
    return shrunk, lora_b, mask


def oracle(x, packed, scale, gs, bias, shrunk, lora_b, mask, bounds) -> torch.Tensor:  # noqa: ANN001
    """float64: x W^T + bias + mask * (slice s of shrunk) (slice s's block of lora_b)^T, column block by block."""
    out = reference.linear_f64(x, packed, scale, gs, bias)
    rank = lora_b.shape[1] // (len(bounds) - 1)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        s = shrunk[:, i * rank:(i + 1) * rank].double()
        out[:, lo:hi] += mask.reshape(-1, 1).double() * (s @ lora_b[lo:hi, i * rank:(i + 1) * rank].double().T)
    return out


def run_op(x, rw, gs, bias, n, shrunk, lora_b, mask, bounds) -> torch.Tensor:  # noqa: ANN001
    return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, bias, n, shrunk, lora_b, mask, bounds)


@pytest.mark.parametrize("n,bounds", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 5, 8, 13, 16])
def test_cpu_op_matches_float64(n: int, bounds: list[int], t: int) -> None:
    k, rank = 256, 8
    packed, scale, gs = random_nvfp4(n, k, seed=n + t)
    rw = kernels.repack(packed, scale)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    shrunk, lora_b, mask = lora_operands(t, n, bounds, rank, torch.float32, seed=n * t)
    want = oracle(x, packed, scale, gs, bias, shrunk, lora_b, mask, bounds)
    got = run_op(x, rw, gs, bias, n, shrunk, lora_b, mask, bounds)
    assert got.shape == (t, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # the LoRA term is there (not just the GEMM) and the mask removes it from token 1
    base = reference.linear_f64(x, packed, scale, gs, bias)
    assert float((want - base).abs().max()) > 1e-2 * float(base.abs().max())
    if t > 1:
        torch.testing.assert_close(got[1].double(), base[1], rtol=1e-5, atol=1e-5 * float(base.abs().max()))


def test_cpu_op_bf16_rounds_once() -> None:
    """bf16 operands: the result is the float64 value rounded once to bf16 (the reference sums in float32)."""
    n, k, t, bounds = 208, 256, 9, [0, 48, 80, 208]
    packed, scale, gs = random_nvfp4(n, k, seed=3)
    rw = kernels.repack(packed, scale)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    shrunk, lora_b, mask = lora_operands(t, n, bounds, 16, torch.bfloat16, seed=2)
    got = run_op(x, rw, gs, None, n, shrunk, lora_b, mask, bounds)
    assert got.dtype == torch.bfloat16
    want = oracle(x, packed, scale, gs, None, shrunk, lora_b, mask, bounds)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs()  # one bf16 ulp (within 2x)
    assert bool(((got.double() - want).abs() <= ulp + 1e-6 * float(want.abs().max())).all())


def test_linear_lora_is_the_op() -> None:
    n, k, t, bounds = 144, 128, 4, [0, 40, 144]
    packed, scale, gs = random_nvfp4(n, k, seed=5)
    rw = kernels.repack(packed, scale)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(n, dtype=torch.float64)  # converted to x's dtype like kernels.linear does
    shrunk, lora_b, mask = lora_operands(t, n, bounds, 8, torch.float32, seed=6)
    got = kernels.linear_lora(x, gs, bias, kernel_weight=rw, n=n, shrunk=shrunk, lora_b=lora_b, mask=mask,
                              slice_bounds=tuple(bounds))
    assert torch.equal(got, run_op(x, rw, gs, bias.float(), n, shrunk, lora_b, mask, bounds))
    with pytest.raises(ValueError, match="x must be 2-D"):
        kernels.linear_lora(x[None], gs, None, kernel_weight=rw, n=n, shrunk=shrunk, lora_b=lora_b, mask=mask,
                            slice_bounds=bounds)


def run_linear(x, rw, gs, bias, n, lora_a, lora_b, mask, bounds) -> torch.Tensor:  # noqa: ANN001
    return torch.ops.qerl.nvfp4_lora_linear(x, rw.qweight, rw.qscale, gs, bias, n, lora_a, lora_b, mask, bounds)


@pytest.mark.parametrize("n,bounds", SHAPES)
def test_cpu_lora_linear_is_the_shrink_then_the_lora_gemm(n: int, bounds: list[int]) -> None:
    """``nvfp4_lora_linear`` = ``nvfp4_gemm_lora`` on ``x @ lora_a^T`` rounded to x's dtype: bit for bit in bf16,
    and the float64 value in float32."""
    k, t, rank = 256, 5, 8
    packed, scale, gs = random_nvfp4(n, k, seed=n)
    rw = kernels.repack(packed, scale)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(t, k, generator=gen)
    lora_a = torch.randn((len(bounds) - 1) * rank, k, generator=gen) / 16
    _, lora_b, mask = lora_operands(t, n, bounds, rank, torch.float32, seed=n + 1)
    want = oracle(x, packed, scale, gs, None, x.double() @ lora_a.double().T, lora_b, mask, bounds)
    got = run_linear(x, rw, gs, None, n, lora_a, lora_b, mask, bounds)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    xb, ab, bb, mb = x.bfloat16(), lora_a.bfloat16(), lora_b.bfloat16(), mask.bfloat16()
    shrunk = kernels.ops.lora_shrink_reference(xb, ab)
    assert shrunk.dtype == torch.bfloat16
    assert torch.equal(run_linear(xb, rw, gs, None, n, ab, bb, mb, bounds),
                       run_op(xb, rw, gs, None, n, shrunk, bb, mb, bounds))
    assert torch.equal(kernels.linear_lora(xb, gs, None, kernel_weight=rw, n=n, lora_a=ab, lora_b=bb, mask=mb,
                                           slice_bounds=bounds),
                       run_linear(xb, rw, gs, None, n, ab, bb, mb, bounds))
    with pytest.raises(ValueError, match="exactly one of shrunk"):
        kernels.linear_lora(xb, gs, None, kernel_weight=rw, n=n, lora_b=bb, mask=mb, slice_bounds=bounds)
    with pytest.raises(ValueError, match="exactly one of shrunk"):
        kernels.linear_lora(xb, gs, None, kernel_weight=rw, n=n, shrunk=shrunk, lora_a=ab, lora_b=bb, mask=mb,
                            slice_bounds=bounds)


@pytest.mark.parametrize("lora_a,match", [
    (torch.zeros(16, 64), "lora_a must be \\[slices \\* rank, K\\] = \\[16, 128\\]"),
    (torch.zeros(8, 128), "lora_a must be"),
    (torch.zeros(16, 128, dtype=torch.int32), "lora_a must be floating point"),
])
def test_cpu_lora_linear_refuses_lora_a_naming_it(lora_a: torch.Tensor, match: str) -> None:
    n, k, t = 144, 128, 4
    packed, scale, gs = random_nvfp4(n, k, seed=7)
    rw = kernels.repack(packed, scale)
    _, lora_b, mask = lora_operands(t, n, [0, 40, 144], 8, torch.float32, seed=8)
    with pytest.raises(LoRAOperandError, match=match):
        run_linear(torch.randn(t, k), rw, gs, None, n, lora_a, lora_b, mask, [0, 40, 144])
    with pytest.raises(LoRAOperandError, match="slice_bounds"):
        run_linear(torch.randn(t, k), rw, gs, None, n, torch.zeros(16, 128), lora_b, mask, [0, 40, 100])


@pytest.mark.parametrize("change,match", [
    (dict(bounds=[0, 40, 100]), "slice_bounds .* n=144"),
    (dict(bounds=[0, 40, 40, 144]), "slice_bounds .*increasing"),
    (dict(bounds=[0, 10, 20, 30, 144]), "slice_bounds .*1 to 3 slices"),
    (dict(lora_b=torch.zeros(140, 16)), "lora_b must be \\[n, slices \\* rank\\] = \\[144, 2 \\* rank\\]"),
    (dict(lora_b=torch.zeros(144, 15)), "lora_b must be"),
    (dict(shrunk=torch.zeros(4, 8)), "shrunk must be \\[M, slices \\* rank\\] = \\[4, 16\\]"),
    (dict(shrunk=torch.zeros(3, 16)), "shrunk must be"),
    (dict(mask=torch.ones(5, 1)), "mask must be \\[M\\] or \\[M, 1\\] with M=4"),
    (dict(mask=torch.ones(4, 2)), "mask must be"),
    (dict(mask=torch.ones(4, dtype=torch.int32)), "mask must be floating point"),
])
def test_cpu_op_refuses_operands_naming_them(change: dict, match: str) -> None:
    n, k, t = 144, 128, 4
    packed, scale, gs = random_nvfp4(n, k, seed=7)
    rw = kernels.repack(packed, scale)
    x = torch.randn(t, k)
    shrunk, lora_b, mask = lora_operands(t, n, [0, 40, 144], 8, torch.float32, seed=8)
    args = dict(shrunk=shrunk, lora_b=lora_b, mask=mask, bounds=[0, 40, 144]) | change
    with pytest.raises(LoRAOperandError, match=match):
        run_op(x, rw, gs, None, n, args["shrunk"], args["lora_b"], args["mask"], args["bounds"])


def test_operand_check_names_the_device() -> None:
    x = torch.zeros(2, 128)
    shrunk, lora_b, mask = torch.zeros(2, 8), torch.zeros(16, 8), torch.ones(2, device="meta")
    with pytest.raises(LoRAOperandError, match="mask is on meta, x on cpu"):
        kernels.ops.check_lora_operands(x, 16, shrunk, lora_b, mask, [0, 16])
    with pytest.raises(LoRAOperandError, match="lora_a is on meta, x on cpu"):
        kernels.ops.check_lora_a(x, torch.zeros(8, 128, device="meta"), lora_b)


def test_fake_impl_traces_under_torch_compile() -> None:
    """The op is one node for torch.compile (fullgraph): the fake impl gives [M, n] without running it."""
    n, k, bounds = 208, 128, [0, 48, 80, 208]
    packed, scale, gs = random_nvfp4(n, k, seed=9)
    rw = kernels.repack(packed, scale)
    shrunk, lora_b, mask = lora_operands(3, n, bounds, 8, torch.float32, seed=10)

    def f(x: torch.Tensor) -> torch.Tensor:
        return run_op(x, rw, gs, None, n, shrunk, lora_b, mask, bounds) * 2

    x = torch.randn(3, k)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, f(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = run_op(torch.empty(3, k), rw, gs, None, n, shrunk, lora_b, mask, bounds)
    assert tuple(out.shape) == (3, n)
