"""Random NVFP4 weights for the GPU kernel tests and benchmarks: one definition of what "a random weight" is.

Every byte pattern of the packed E2M1 codes is fair (all 16 codes, both signs), the E4M3 block scales are drawn
from subnormals up to ~0.5 (``big``: up to ~448, the format's top), never NaN, and the global scale is what
``nvfp4.quantize`` would store for an absolute maximum in [0.05, 1.05) (``big``: up to ~50). Draws come from a
generator on ``device`` seeded with ``seed``, in a fixed order, so a test's inputs are the same on every run.
"""

from __future__ import annotations

import torch

#: E4M3 scale bytes drawn: 0x01 (the smallest subnormal) .. 0x58 (0.5), or .. 0x7E (448) with ``big``
SCALE_BYTES = (1, 0x58)
SCALE_BYTES_BIG = (0x30, 0x7E)


def random_nvfp4(n: int, k: int, seed: int, device: str | torch.device = "cuda",
                 big: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [n, k/2], E4M3 scale [n, k/16], FP32 global scale [1]) of a random [n, k] NVFP4 weight."""
    g = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=g)
    lo, hi = SCALE_BYTES_BIG if big else SCALE_BYTES
    sb = torch.randint(lo, hi + 1, (n, k // 16), dtype=torch.uint8, device=device, generator=g)
    amax = 0.05 + torch.rand(1, device=device, generator=g) * (50.0 if big else 1.0)
    return packed, sb.view(torch.float8_e4m3fn), (2688.0 / amax).to(torch.float32)
