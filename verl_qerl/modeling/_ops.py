"""The single seam between modeling and the NVFP4 compute kernels.

``verl_qerl.kernels`` (CUDA FP4xBF16 GEMM and dequant kernels with torch fallbacks, M-based
dispatch) is its own package, below modeling. Everything in :mod:`verl_qerl.modeling` calls NVFP4 compute
through the two functions here, so the modeling code neither knows nor cares whether that package
is installed, built, or still missing: without it we fall back to the format's reference
``verl_qerl.nvfp4.dequantize`` followed by ``F.linear`` (correct everywhere, slow on GPU).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from ..nvfp4 import dequantize as _reference_dequantize
from ..nvfp4.format import SCALE_DTYPE


@functools.cache
def _kernels() -> ModuleType | None:
    """``verl_qerl.kernels`` if it is present and exposes the planned API, else None.

    A kernels package that exists but fails to import for another reason is a real bug and is
    raised, not silently replaced by the slow path.
    """
    try:
        from .. import kernels  # type: ignore[attr-defined]
    except ModuleNotFoundError as exc:
        if exc.name not in ("verl_qerl.kernels",):
            raise
        return None
    if not all(callable(getattr(kernels, name, None)) for name in ("dequantize", "linear")):
        return None
    return kernels


def backend() -> str:
    """Which implementation runs: ``"kernels"`` or ``"torch-reference"`` (for benchmark records)."""
    return "kernels" if _kernels() is not None else "torch-reference"


def _as_fp8(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(SCALE_DTYPE) if scale.dtype == torch.uint8 else scale


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dense [N, K] weight in ``dtype`` (bit-identical to the format's reference dequantization)."""
    kernels = _kernels()
    if kernels is not None:
        return kernels.dequantize(packed, _as_fp8(scale), global_scale, dtype)
    return _reference_dequantize(packed, scale, global_scale, dtype)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequant(W).T + bias`` in ``x.dtype``; the kernels package picks GEMM vs dequant+cuBLAS by M."""
    kernels = _kernels()
    if kernels is not None:
        return kernels.linear(x, packed, _as_fp8(scale), global_scale, bias)
    w = _reference_dequantize(packed, scale, global_scale, x.dtype)
    return F.linear(x, w, bias)
