"""Constants of the NVFP4 number format (compressed-tensors ``nvfp4-pack-quantized`` layout).

NVFP4 stores each weight as a 4-bit E2M1 float (1 sign, 2 exponent, 1 mantissa bit), one
FP8-E4M3 scale per 16 consecutive input-dimension (K) elements of a row, and one FP32 scale
per tensor. The per-tensor scale is stored as a *divisor*, ``448 * 6 / amax`` (compressed-tensors'
convention), so the dequantized value is ``e2m1 * e4m3_scale / global_scale``.
"""

from __future__ import annotations

import torch

#: Magnitudes of the eight non-negative E2M1 codes; code bit 3 is the sign.
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: Largest E2M1 magnitude.
FP4_MAX = 6.0

#: Round-to-nearest decision boundaries between consecutive E2M1 magnitudes: their midpoints.
E2M1_BOUNDARIES: tuple[float, ...] = tuple((lo + hi) / 2 for lo, hi in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))

#: Whether a value exactly on each boundary rounds up. Ties go to the neighbour whose mantissa bit (the
#: code's lowest bit) is 0, so up exactly where the upper neighbour's code is even.
E2M1_TIE_ROUNDS_UP: tuple[bool, ...] = tuple((code + 1) % 2 == 0 for code in range(len(E2M1_BOUNDARIES)))

#: Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0

#: Elements of K that share one E4M3 block scale.
BLOCK_SIZE = 16

#: What compressed-tensors writes in place of a block scale that rounds to zero (FP8 eps).
ZERO_BLOCK_SCALE = 0.125

#: Module-name suffixes of the tensors a compressed-tensors NVFP4 layer stores.
CT_WEIGHT_PACKED = "weight_packed"
CT_WEIGHT_SCALE = "weight_scale"
CT_WEIGHT_GLOBAL_SCALE = "weight_global_scale"

#: ModelOpt NVFP4 names: ``weight`` (packed uint8), ``weight_scale`` (E4M3), ``weight_scale_2``
#: (FP32 *multiplier*, the reciprocal of compressed-tensors' divisor).
MODELOPT_WEIGHT = "weight"
MODELOPT_WEIGHT_SCALE = "weight_scale"
MODELOPT_WEIGHT_SCALE_2 = "weight_scale_2"

SCALE_DTYPE = torch.float8_e4m3fn


def block_scale_problem(scale: torch.Tensor) -> str | None:
    """What makes E4M3 block scales (``float8_e4m3fn`` or their uint8 bits) unusable, or None: NaN codes (0x7F /
    0xFF; E4M3 has no inf) and negative scales (sign bit set on a non-zero magnitude). A quantizer writes amax / 6
    of each block, never below zero, so a negative scale is a damaged or wrongly converted checkpoint; loaded, it
    would silently negate its block's weights. ``-0`` (0x80) is a zero block and allowed. Meta tensors: None. The
    one rule both the training-side loader and the vLLM method apply."""
    if scale.is_meta:
        return None
    bits = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    mag = bits & 0x7F
    nan = int((mag == 0x7F).sum())
    if nan:
        return f"{nan} block scale(s) are NaN (E4M3 0x7F / 0xFF); a damaged or wrongly converted checkpoint"
    negative = int(((bits & 0x80) != 0).logical_and(mag != 0).sum())
    if negative:
        return (f"{negative} block scale(s) are negative (E4M3 sign bit set); NVFP4 block scales are >= 0: a "
                "damaged or wrongly converted checkpoint")
    return None


def e2m1_values(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 values indexed by a 4-bit code (0..7 positive, 8..15 the same magnitudes negated)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])
