"""What every mode of ``benchmarks/kernel.py`` shares: the device and the random NVFP4 weights it times and checks.

Kept apart so the timing run (``kernel.py``) and the diagnostic modes (``kernel_diagnostics.py``) both import it
without importing each other. ``kernel.py`` re-exports ``random_nvfp4`` for scripts that import it from there.
"""

from __future__ import annotations

import torch

DEV = "cuda"


def random_nvfp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes and E4M3 scales in [0.5, 2.5] (as anchors.py); not zeros (see METHOD.md)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
    scale = (torch.rand(n, k // 16, device=DEV) * 2 + 0.5).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor([100.0], device=DEV)
