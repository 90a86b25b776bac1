"""Torch references of the kernels: the CPU fallbacks and the tests' oracles.

The dequantize formula is the format's own, taken from ``verl_qerl.nvfp4`` (``e2m1(code) *
(scale / global_scale)`` in float32, then one rounding to the output dtype), so the CUDA dequant
kernels are held to *bit* equality with the one definition of the format.
"""

from __future__ import annotations

import torch

from ..nvfp4 import dequantize as _format_dequantize
from ..nvfp4 import e2m1_values as e2m1_table
from ..nvfp4 import unpack_fp4 as unpack_codes
from ..nvfp4.format import BLOCK_SIZE
from .layout import scale_as_float, unrepack_codes, unrepack_scales

__all__ = ["dequantize_f64", "dequantize_ref", "dequantize_repacked_ref", "e2m1_table", "linear_f64", "unpack_codes"]


def _dequant_codes(
    codes: torch.Tensor, scale_f32: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    vals = e2m1_table(torch.float32, codes.device)[codes.long()]
    eff = scale_f32 / global_scale.to(device=codes.device, dtype=torch.float32).reshape(1)
    return (vals * eff.repeat_interleave(BLOCK_SIZE, dim=1)).to(dtype)


def dequantize_ref(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """NVFP4 (compressed-tensors layout) -> [N, K] in ``dtype``; float32 math, one rounding."""
    return _format_dequantize(packed, scale, global_scale, dtype)


def dequantize_repacked_ref(
    qweight: torch.Tensor, qscale: torch.Tensor, global_scale: torch.Tensor, n: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The same from the kernel layout (decoded with the kernel's bit operations)."""
    return _dequant_codes(unrepack_codes(qweight, n), unrepack_scales(qscale, n), global_scale, dtype)


def dequantize_f64(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Exact dequantized weight in float64 (every NVFP4 value is exact there): the tests' oracle."""
    vals = e2m1_table(torch.float64, packed.device)[unpack_codes(packed).long()]
    s = scale_as_float(scale).to(torch.float64)
    g = global_scale.to(device=packed.device, dtype=torch.float64).reshape(1)
    return vals * (s / g).repeat_interleave(BLOCK_SIZE, dim=1)


def linear_f64(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + b`` in float64 with the exact dequantized weight."""
    w = dequantize_f64(packed, scale, global_scale)
    out = x.to(torch.float64) @ w.T
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out
