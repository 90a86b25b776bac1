"""The single seam between modeling and the NVFP4 compute kernels (:mod:`verl_qerl.kernels`).

How training computes with a frozen NVFP4 weight: every ``NVFP4Linear`` forward, and the input
gradient of its backward, dequantizes the weight to the activations' dtype with
``kernels.dequantize`` (the CUDA dequant kernel where the extension loads, the format's torch
reference elsewhere; the two are bit-identical) and multiplies with ``F.linear`` (cuBLAS on CUDA).
The fused FP4 GEMM is never used here: it reads the kernel's repacked layout, which only the vLLM
rollout keeps, and a training batch has many tokens (large M), where the GEMM op itself would choose
dequantize + cuBLAS.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..nvfp4.format import SCALE_DTYPE


def backend() -> str:
    """What the dequantization runs on here, for benchmark records: ``"kernels"`` (the CUDA extension
    loads) or ``"torch-reference"``."""
    return "kernels" if kernels.cuda_available() else "torch-reference"


def _as_fp8(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(SCALE_DTYPE) if scale.dtype == torch.uint8 else scale


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dense [N, K] weight in ``dtype`` (bit-identical to the format's reference dequantization)."""
    return kernels.dequantize(packed, _as_fp8(scale), global_scale, dtype)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequant(W).T + bias`` in ``x.dtype``: dequantize, then ``F.linear`` (see the module docstring)."""
    return kernels.linear(x, packed, _as_fp8(scale), global_scale, bias)
