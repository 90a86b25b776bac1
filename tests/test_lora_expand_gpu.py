"""GPU tests of the LoRA expand's two CUDA routes: Triton below ``CUBLAS_MIN_TOKENS`` tokens, cuBLAS from there on.

From ``CUBLAS_MIN_TOKENS`` tokens ``qerl::nvfp4_gemm_lora`` / ``qerl::nvfp4_lora_linear`` add the expand in place on
the GEMM's output by cuBLAS called from C++ (no Python op: ~96 us of host time per layer at a host-bound prefill), and
``qerl::lora_expand``'s CUDA side runs the same torch ops from the same count. What can go wrong, and what catches it:
* the two sides drifting apart (a threshold or an op changed on one side only): bit-for-bit equality of the fused
  op with the GEMM followed by ``qerl::lora_expand``, just below, at and above the threshold;
* the wrong route: the Triton kernel is launched below the threshold and not from it on (profiler);
* a wrong value or a token without the adapter touched: the float64 oracle, and bit-for-bit equality of those rows
  with the GEMM's output; NaN-poisoned allocations;
* capture: up to ``TRITON_CAPTURED_MAX_TOKENS`` tokens a captured expand runs the Triton kernel (one launch where
  cuBLAS's route is two; no host time to save in a graph): a replay with fresh operands equals the GEMM followed by
  the Triton kernel bit for bit; above it the eager call's cuBLAS result. The first eager call of a shape goes
  through the Python op (which compiles that kernel for the capture), later ones not: the same bits.
"""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import GemmMode as Mode
from verl_qerl.kernels.lora_expand import (
    CUBLAS_MIN_TOKENS,
    TRITON_CAPTURED_MAX_TOKENS,
    lora_expand,
    lora_expand_torch,
    lora_expand_triton,
)
from verl_qerl.testing.gpu import capture, kernels_launched, poison
from verl_qerl.testing.nvfp4_random import random_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
TRITON = "_lora_expand_kernel"
#: (N, slice bounds, rank per slice): one slice, qkv-like three uneven slices, N not a multiple of the 128-row tile
#: with odd slice bounds (the kernel layout needs N % 16 == 0)
SHAPES = [(512, [0, 512], 32), (768, [0, 512, 640, 768], 32), (304, [0, 17, 24, 304], 8)]
TOKENS = [CUBLAS_MIN_TOKENS - 1, CUBLAS_MIN_TOKENS, 300]
#: The GEMM the expand follows: dequantize + cuBLAS, which has no LoRA epilogue at any M. Under ``auto`` the shipped
#: dispatch table puts these token counts on the register-A wgmma kernels, whose epilogue adds the LoRA term itself, so
#: the expand routes under test would not run at all (this file asserted ``auto`` and failed 10 of 15 on an H200 once
#: the table moved, 2026-11-29).
MODE = Mode.DEQUANT_CUBLAS


@pytest.fixture(scope="module", autouse=True)
def _ext() -> None:
    if not kernels.load_extension(verbose=False):
        pytest.fail(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")



def operands(t: int, n: int, bounds: list[int], rank: int, dtype: torch.dtype, seed: int):
    """shrunk [t, S*rank], block-diagonal B [n, S*rank], mask [t, 1] (every 4th token without the adapter)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    slices = len(bounds) - 1
    shrunk = (torch.randn(t, slices * rank, device=DEV, generator=g) / rank**0.5).to(dtype)
    lora_b = torch.zeros(n, slices * rank, device=DEV, dtype=dtype)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        lora_b[lo:hi, i * rank:(i + 1) * rank] = torch.randn(hi - lo, rank, device=DEV, generator=g).to(dtype)
    mask = (torch.arange(t, device=DEV) % 4 != 3).to(dtype).unsqueeze(1)
    return shrunk, lora_b, mask


@pytest.mark.parametrize("n,bounds,rank", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_fused_op_equals_gemm_then_expand_around_the_threshold(m: int, n: int, bounds: list[int], rank: int) -> None:
    k = 1024
    packed, scale, gs = random_nvfp4(n, k, m + n, DEV)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    shrunk, lora_b, mask = operands(m, n, bounds, rank, torch.bfloat16, seed=m)
    assert not kernels.extension().lora_epilogue_runs(m, n, k, int(MODE))

    def fused() -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk, lora_b, mask, bounds,
                                              int(MODE), 0)

    triton_launches = sum(TRITON in nm for nm in kernels_launched(fused))
    assert triton_launches == (0 if m >= CUBLAS_MIN_TOKENS else 1)
    poison((m, n), torch.bfloat16)
    got = fused()
    base = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, int(MODE), 0)
    assert not torch.isnan(got).any()
    assert torch.equal(got[3::4], base[3::4])  # tokens without the adapter: the GEMM's output, bit for bit
    assert torch.equal(got, lora_expand(base, shrunk, lora_b.t(), mask))  # the Python op's route, bit for bit
    # the expand against float64 on the GEMM's own output (the GEMM's accuracy per route, dequantize + cuBLAS
    # included, is tests/test_kernels_gpu.py's): one rounding of the result, plus cuBLAS's reduced-precision split-K
    # sums (a few bf16 roundings of at most 2^-8 of the LoRA term's magnitude each)
    s = shrunk.double() * mask.double()
    ref = base.double() + s @ lora_b.double().T
    mag_lora = s.abs() @ lora_b.double().abs().T
    bound = 2.0**-8 * ref.abs() + 2.0**-6 * mag_lora + 1e-30
    assert bool(((got.double() - ref).abs() <= bound).all()), float(((got.double() - ref).abs() / bound).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_from_the_threshold_matches_float64(dtype: torch.dtype) -> None:
    t, n, bounds, rank = 300, 768, [0, 512, 640, 768], 32
    shrunk, lora_b, mask = operands(t, n, bounds, rank, dtype, seed=5)
    out = torch.randn(t, n, device=DEV).to(dtype)
    names = kernels_launched(lambda: lora_expand(out, shrunk, lora_b.t(), mask))
    assert not any(TRITON in nm for nm in names), names
    poison((t, n), dtype)
    got = lora_expand(out, shrunk, lora_b.t(), mask)
    s = shrunk.double() * mask.double()
    ref = out.double() + s @ lora_b.double().T
    mag = out.double().abs() + s.abs() @ lora_b.double().abs().T
    assert not torch.isnan(got).any() and torch.equal(got[3::4], out[3::4])
    mant = 7 if dtype == torch.bfloat16 else 10
    half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - mant - 1)
    # one rounding of the result, and cuBLAS's reduced-precision split-K sums (a few roundings of the products' sum)
    bound = half_ulp + 4 * 2.0 ** -(mant + 1) * mag
    assert bool(((got.double() - ref).abs() <= bound).all()), float(((got.double() - ref).abs() / bound).max())
    assert torch.equal(got, lora_expand(out, shrunk, lora_b.t(), mask))  # deterministic


@pytest.mark.parametrize("m", [300, TRITON_CAPTURED_MAX_TOKENS + 88])
def test_graph_capture_from_the_threshold(m: int) -> None:
    """The fused op captured from the threshold and replayed with fresh operands: up to TRITON_CAPTURED_MAX_TOKENS the
    GEMM followed by the Triton expand, bit for bit (the captured route), above it the eager op's result (cuBLAS in
    place on the GEMM's output, captured as it runs eagerly)."""
    n, k, bounds, rank = 768, 1024, [0, 512, 640, 768], 32
    packed, scale, gs = random_nvfp4(n, k, 3, DEV)
    rw = kernels.repack(packed, scale)
    shrunk, lora_b, mask = operands(m, n, bounds, rank, torch.bfloat16, seed=11)
    x_static, s_static = torch.randn(m, k, device=DEV).to(torch.bfloat16), shrunk.clone()

    def f(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, s, lora_b, mask, bounds,
                                              int(MODE), 0)

    f(x_static, s_static)
    graph, y_static = capture(lambda: f(x_static, s_static))
    for i in range(3):
        x_new = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        s_new, _, _ = operands(m, n, bounds, rank, torch.bfloat16, seed=100 + i)
        x_static.copy_(x_new)
        s_static.copy_(s_new)
        graph.replay()
        torch.cuda.synchronize()
        if m <= TRITON_CAPTURED_MAX_TOKENS:
            base = torch.ops.qerl.nvfp4_gemm(x_new, rw.qweight, rw.qscale, gs, None, n, int(MODE), 0)
            assert torch.equal(y_static, lora_expand_triton(base, s_new, lora_b.t(), mask)), i
        else:
            assert torch.equal(y_static, f(x_new, s_new)), i


def test_python_op_runs_triton_when_captured_and_cublas_eagerly() -> None:
    """qerl::lora_expand at 256 tokens: eagerly the torch ops (cuBLAS), bit for bit, and no Triton launch; captured
    (the kernel compiled by the eager call before it), the Triton kernel's bits, replayed with fresh operands."""
    t, n, bounds, rank = 256, 768, [0, 512, 640, 768], 32
    shrunk, lora_b, mask = operands(t, n, bounds, rank, torch.bfloat16, seed=21)
    out = torch.randn(t, n, device=DEV).to(torch.bfloat16)
    assert not any(TRITON in nm for nm in kernels_launched(lambda: lora_expand(out, shrunk, lora_b.t(), mask)))
    assert torch.equal(lora_expand(out, shrunk, lora_b.t(), mask), lora_expand_torch(out, shrunk, lora_b.t(), mask))
    graph, y = capture(lambda: lora_expand(out, shrunk, lora_b.t(), mask))
    for i in range(2):
        out.copy_(torch.randn(t, n, device=DEV).to(torch.bfloat16))
        shrunk.copy_(operands(t, n, bounds, rank, torch.bfloat16, seed=30 + i)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, lora_expand_triton(out, shrunk, lora_b.t(), mask)), i


def test_first_eager_call_through_the_python_op_gives_the_same_bits() -> None:
    """A shape's first eager call of the fused op at 200 tokens goes through qerl::lora_expand (compiling the capture's
    Triton kernel), the next ones run cuBLAS from C++: all equal bit for bit, and none launches the Triton kernel."""
    m, n, k, bounds, rank = 200, 784, 1024, [0, 784], 16
    packed, scale, gs = random_nvfp4(n, k, 9, DEV)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    shrunk, lora_b, mask = operands(m, n, bounds, rank, torch.bfloat16, seed=41)

    def fused() -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk, lora_b, mask, bounds,
                                              int(MODE), 0)

    assert not kernels.extension().lora_epilogue_runs(m, n, k, int(MODE))
    first = fused()
    assert torch.equal(first, fused()) and torch.equal(first, fused())
    assert not any(TRITON in nm for nm in kernels_launched(fused))
