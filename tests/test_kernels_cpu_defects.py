"""Defects of the kernels' CPU side found by an audit (benchmarks/NOTES.md, "Defect audits, fifth pass"); each test
failed before its fix. The CPU implementations are also what runs when the CUDA extension is unavailable, so they
refuse what the CUDA op refuses, naming the argument, rather than computing something else."""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import layout, ops

N, K = 256, 256


def _weight(scale_byte: int = 0x38) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    scale = torch.full((N, K // 16), scale_byte, dtype=torch.uint8)
    return packed, scale


@pytest.mark.parametrize(("byte", "what"), [(0xB8, "negative"), (0x7F, "NaN"), (0xFF, "NaN")])
def test_repack_refuses_negative_or_nan_block_scales(byte: int, what: str) -> None:
    """Before: repack turned them into zero blocks, while dequantize of the same pair gave negated / NaN weights."""
    packed, scale = _weight()
    scale[2, 3] = byte
    with pytest.raises(layout.LayoutError, match=f"repack: 1 block scale\\(s\\) are {what}"):
        kernels.repack(packed, scale)
    scale[2, 3] = 0x80  # -0: a zero block, allowed
    kernels.repack(packed, scale)


def _args() -> tuple:
    packed, scale = _weight()
    rw = kernels.repack(packed, scale)
    return rw.qweight, rw.qscale, torch.ones(1)


@pytest.mark.parametrize(("change", "message"), [
    ({"mode": 99}, "unknown mode 99"),
    ({"splits": 7}, "splits=7"),
    ({"mode": 1, "splits": -3}, "splits=-3"),
    ({"x": torch.randn(2, 3, K)}, "x must be a 2-D floating-point tensor"),
    ({"x": torch.randint(-3, 3, (4, K), dtype=torch.int32)}, "x must be a 2-D floating-point tensor"),
    ({"x": torch.randn(4, 128)}, "x has K=128 but the weight has K=256"),
    ({"n": 300}, "n=300 does not fit"),
    ({"n": 250}, "n=250 does not fit"),
    ({"bias": torch.randn(1)}, "bias must have n=256 values"),
    ({"global_scale": torch.ones(2)}, "global_scale must hold one value"),
])
def test_cpu_gemm_refuses_what_the_cuda_op_refuses(change: dict, message: str) -> None:
    qw, qs, gs = _args()
    a = {"x": torch.randn(4, K), "bias": None, "n": N, "mode": 0, "splits": 0, "global_scale": gs, **change}
    with pytest.raises(ops.GemmArgumentError, match=message):
        torch.ops.qerl.nvfp4_gemm(a["x"], qw, qs, a["global_scale"], a["bias"], a["n"], a["mode"], a["splits"])
    rank = 8
    shrunk, lora_b, mask = torch.zeros(a["x"].shape[0], rank), torch.zeros(a["n"], rank), torch.ones(a["x"].shape[0])
    if a["x"].dim() == 2:  # (the LoRA op's own operand checks come after the GEMM's)
        with pytest.raises(ops.GemmArgumentError, match=message):
            torch.ops.qerl.nvfp4_gemm_lora(a["x"], qw, qs, a["global_scale"], a["bias"], a["n"], shrunk, lora_b, mask,
                                           [0, a["n"]], a["mode"], a["splits"])


def test_cpu_dequant_repacked_refuses_an_n_that_does_not_fit() -> None:
    """Before: n=300 returned 256 rows, n=100 another weight's first rows."""
    qw, qs, gs = _args()
    for n in (300, 100, 250):
        with pytest.raises(ops.GemmArgumentError, match=f"n={n} does not fit"):
            torch.ops.qerl.nvfp4_dequant_repacked(qw, qs, gs, n, torch.float32)
    assert torch.ops.qerl.nvfp4_dequant_repacked(qw, qs, gs, N, torch.float32).shape == (N, K)


@pytest.mark.parametrize(("o", "s", "b"), [(torch.bfloat16, torch.float32, torch.float32),
                                           (torch.float32, torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.bfloat16, torch.float32)])
def test_lora_expand_cpu_takes_mixed_dtypes_like_the_triton_kernel(o, s, b) -> None:
    """Before: ``addmm`` refused them ("self and mat2 must have the same dtype"), naming nothing."""
    g = torch.Generator().manual_seed(1)
    out, shrunk = torch.randn(4, 32, generator=g).to(o), torch.randn(4, 8, generator=g).to(s)
    b_t, mask = torch.randn(8, 32, generator=g).to(b), torch.tensor([1.0, 0.0, 1.0, 1.0])
    got = torch.ops.qerl.lora_expand(out, shrunk, b_t, mask)
    ref = out.double() + mask.double().reshape(-1, 1) * (shrunk.double() @ b_t.double())
    assert got.dtype == o and torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="mask \\(1, 4\\)"):
        torch.ops.qerl.lora_expand(out, shrunk, b_t, mask.reshape(1, 4))
