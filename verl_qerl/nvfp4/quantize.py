"""Quantize, pack, unpack and dequantize NVFP4 weights: pure torch functions.

Every number here follows compressed-tensors / llm-compressor (the format's reference
implementation and this project's test oracles) bit for bit:

* global scale ``g = 448 * 6 / amax(|W|)`` (a divisor, fp32 ``[1]``); an all-zero tensor gets 1.0;
* block scale ``s_b = e4m3(g * amax_b / 6)``, a zero block scale becomes 0.125;
* code ``= rtne_e2m1(clamp(W / (s_b / g), -6, 6))`` with ties to the even mantissa, the sign bit set
  where the scaled value is < 0 (so tiny negatives become code 8, "-0", and a -0.0 weight code 0);
* packing: element ``2i`` in the low nibble of byte ``i``, ``2i+1`` in the high nibble.

The *scale rule* says in which precision the two scale formulas are evaluated (:data:`SCALE_RULES`):

* ``"bf16"`` (the default): ``amax``, ``448 * 6 / amax`` and ``amax_b / 6`` are rounded to bfloat16,
  the product ``g * (amax_b / 6)`` is taken in float32. This is what llm-compressor's NVFP4A16
  writes for a BF16 model: its min-max observers keep the model's dtype, so compressed-tensors'
  ``generate_gparam`` and ``calculate_qparams`` compute in bfloat16 (tested bit for bit against
  llm-compressor 0.14.0.1 with compressed-tensors 0.19.0). The result does not depend on whether a
  BF16 checkpoint's weights are held in bf16 or float32, so a float32 actor and a bf16 vLLM agree.
* ``"fp32"``: both formulas in float32, i.e. compressed-tensors' functions on the float32 weight
  (tested against compressed-tensors 0.17.0). A checkpoint whose config.json records no rule may have
  been made under either (see ``verl_qerl.nvfp4.checkpoint.matching_scale_rules``).

Everything else (the per-element division and rounding) is float32 under both rules, and the
weight is upcast to float32 first (exact for bf16/fp16 inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .format import (
    BLOCK_SIZE,
    E2M1_BOUNDARIES,
    E2M1_TIE_ROUNDS_UP,
    FP4_MAX,
    FP8_E4M3_MAX,
    SCALE_DTYPE,
    ZERO_BLOCK_SCALE,
    e2m1_values,
)

#: How the global and block scales are computed from the amax statistics (see the module docstring).
SCALE_RULES: tuple[str, ...] = ("bf16", "fp32")

#: llm-compressor's rule on BF16 models, so that our checkpoints and quantize-at-load match its bytes.
DEFAULT_SCALE_RULE = "bf16"


class NVFP4FormatError(ValueError):
    """A tensor that cannot be quantized to, or read as, NVFP4; the message names it."""


def check_scale_rule(rule: str, where: str = "scale_rule") -> str:
    """``rule`` if it is one of :data:`SCALE_RULES`; otherwise an error naming ``where``."""
    if rule not in SCALE_RULES:
        raise NVFP4FormatError(f"{where}={rule!r}: unknown NVFP4 scale rule; choose one of {', '.join(SCALE_RULES)}")
    return rule


@dataclass(frozen=True)
class NVFP4Weight:
    """One quantized [N, K] weight in the compressed-tensors layout.

    ``packed`` uint8 [N, K/2]; ``scale`` float8_e4m3fn [N, K/16]; ``global_scale`` fp32 [1],
    the divisor 448*6/amax.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.global_scale, dtype)

    def to(self, device: torch.device | str) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))


def _check_weight(weight: torch.Tensor, name: str) -> None:
    if not isinstance(weight, torch.Tensor):
        raise NVFP4FormatError(f"{name}: expected a torch.Tensor, got {type(weight).__name__}")
    if not torch.is_floating_point(weight) or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise NVFP4FormatError(f"{name}: expected a float16/bfloat16/float32 weight, got dtype {weight.dtype}")
    if weight.dim() != 2:
        raise NVFP4FormatError(f"{name}: expected a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if weight.numel() == 0:
        raise NVFP4FormatError(f"{name}: an empty weight {tuple(weight.shape)} has no scale to compute")
    if k % BLOCK_SIZE != 0:
        raise NVFP4FormatError(
            f"{name}: in_features K={k} is not a multiple of the NVFP4 block size {BLOCK_SIZE}"
        )
    if weight.is_meta:
        raise NVFP4FormatError(f"{name}: is on the meta device (no data to quantize)")
    if not bool(torch.isfinite(weight).all()):
        n_bad = int((~torch.isfinite(weight)).sum())
        raise NVFP4FormatError(f"{name}: contains {n_bad} NaN/Inf value(s); refusing to quantize")


def tensor_amax(weight: torch.Tensor) -> torch.Tensor:
    """max(|W|) in float32 as a 0-d tensor."""
    return weight.detach().abs().amax().to(torch.float32)


def checked_amax(weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """max(|W|) in float32 (0-d) of a weight that can be quantized; errors name the weight."""
    _check_weight(weight, name)
    return tensor_amax(weight)


def global_scale_from_amax(amax: torch.Tensor | float, rule: str = DEFAULT_SCALE_RULE) -> torch.Tensor:
    """The per-tensor divisor ``448 * 6 / amax`` in fp32 [1] under ``rule``; 1.0 where it is not finite."""
    check_scale_rule(rule)
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    if rule == "bf16":
        # llm-compressor's observer hands compressed-tensors a bf16 amax, so every step below rounds to bf16
        amax = amax.to(torch.bfloat16)
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    # ``reciprocal(amax) * 2688``, not ``2688 / amax``: this is how torch evaluates compressed-tensors'
    # ``448 * 6 / amax`` (scalar / tensor), and the two differ in the last bit for some amax.
    gs = torch.reciprocal(amax) * (FP8_E4M3_MAX * FP4_MAX)
    gs = torch.nan_to_num(gs.to(torch.float32), nan=1.0, posinf=1.0, neginf=1.0)
    return gs.reshape(1)


def compute_global_scale(weight: torch.Tensor, name: str = "weight", rule: str = DEFAULT_SCALE_RULE) -> torch.Tensor:
    """Global scale (divisor) of one weight."""
    return global_scale_from_amax(checked_amax(weight, name), rule)


def fused_global_scale(
    weights: Sequence[torch.Tensor], names: Sequence[str] | None = None, rule: str = DEFAULT_SCALE_RULE
) -> torch.Tensor:
    """One global scale shared by weights that an inference engine fuses (q/k/v; gate/up).

    vLLM runs ``qkv_proj`` and ``gate_up_proj`` as single GEMMs with one per-tensor scale, so the
    parts must agree. As llm-compressor does, the shared divisor is that of the largest amax of
    the parts (the smallest of their divisors, except that an all-zero part does not force 1.0).
    """
    if len(weights) == 0:
        raise NVFP4FormatError("fused_global_scale: got no weights")
    names = list(names) if names is not None else [f"weights[{i}]" for i in range(len(weights))]
    device = weights[0].device
    amaxes = [checked_amax(w, n).to(device) for w, n in zip(weights, names, strict=True)]
    return global_scale_from_amax(torch.stack(amaxes).amax(), rule)


def compute_block_scales(
    weight: torch.Tensor, global_scale: torch.Tensor, rule: str = DEFAULT_SCALE_RULE
) -> torch.Tensor:
    """E4M3 block scales [N, K/16] for a weight under a given global scale (divisor) and ``rule``."""
    check_scale_rule(rule)
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    amax_b = w.abs().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE).amax(dim=-1)
    if rule == "bf16":  # compressed-tensors' ``amax_b / 6`` on llm-compressor's bf16 statistics
        per_block = (amax_b.to(torch.bfloat16) / FP4_MAX).to(torch.float32)
    else:
        per_block = amax_b / FP4_MAX
    scale = global_scale.to(torch.float32).to(w.device) * per_block
    scale = torch.clamp(scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(SCALE_DTYPE)
    zero = scale.to(torch.float32) == 0
    if bool(zero.any()):
        scale = torch.where(zero, torch.tensor(ZERO_BLOCK_SCALE, device=w.device), scale.to(torch.float32))
        scale = scale.to(SCALE_DTYPE)
    return scale


def cast_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 0..15) of float32 values already scaled into [-6, 6].

    Round to nearest, ties to the even mantissa; values beyond 6 saturate. The sign bit is set
    where ``x < 0``, so negative values that round to zero give code 8, while ``-0.0`` gives code 0
    (compressed-tensors multiplies the rounded magnitude by ``sign(x)``, and ``sign(-0.0)`` is 0).
    """
    x = x.to(torch.float32)
    mag = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for boundary, up_on_tie in zip(E2M1_BOUNDARIES, E2M1_TIE_ROUNDS_UP, strict=True):
        above = (mag >= boundary) if up_on_tie else (mag > boundary)
        idx += above.to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return idx | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [N, K] (values 0..15) into bytes [N, K/2], even element in the low nibble."""
    if codes.dim() != 2 or codes.shape[1] % 2 != 0:
        raise NVFP4FormatError(f"pack_fp4: expected [N, K] codes with even K, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[:, 0::2] & 0xF) | ((c[:, 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: bytes [N, K/2] -> codes uint8 [N, K]."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NVFP4FormatError(
            f"unpack_fp4: expected uint8 [N, K/2], got dtype {packed.dtype} shape {tuple(packed.shape)}"
        )
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def quantize(
    weight: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    name: str = "weight",
    rule: str = DEFAULT_SCALE_RULE,
) -> NVFP4Weight:
    """Quantize a float [N, K] weight to NVFP4 (round to nearest, ties to even).

    ``global_scale`` (a divisor) is computed from the weight unless given; pass the result of
    :func:`fused_global_scale` for the parts of a fused layer. ``rule``: see :data:`SCALE_RULES`.
    """
    check_scale_rule(rule)
    _check_weight(weight, name)
    w = weight.detach().to(torch.float32)
    gs = global_scale_from_amax(tensor_amax(w), rule) if global_scale is None else global_scale
    gs = gs.to(device=w.device, dtype=torch.float32).reshape(1)
    if not bool(torch.isfinite(gs).all()) or float(gs) <= 0:
        raise NVFP4FormatError(f"{name}: global scale must be finite and > 0, got {float(gs)}")
    scale = compute_block_scales(w, gs, rule)
    n, k = w.shape
    eff = (scale.to(torch.float32) / gs).repeat_interleave(BLOCK_SIZE, dim=1)
    scaled = torch.clamp(w / eff, -FP4_MAX, FP4_MAX)
    codes = cast_to_e2m1_codes(scaled)
    return NVFP4Weight(pack_fp4(codes), scale, gs.clone())


def _scale_as_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        scale = scale.view(SCALE_DTYPE)
    if scale.dtype != SCALE_DTYPE:
        raise NVFP4FormatError(f"block scale: expected float8_e4m3fn (or its uint8 view), got {scale.dtype}")
    return scale.to(torch.float32)


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """NVFP4 -> float [N, K]: ``e2m1(code) * (scale / global_scale)`` in fp32, then cast to ``dtype``.

    ``scale`` may be float8_e4m3fn or its uint8 view (the training side keeps uint8 buffers).
    """
    n, half_k = packed.shape
    k = half_k * 2
    if scale.shape != (n, k // BLOCK_SIZE):
        raise NVFP4FormatError(
            f"dequantize: block scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
            f"(expected {(n, k // BLOCK_SIZE)})"
        )
    codes = unpack_fp4(packed)
    values = e2m1_values(torch.float32, packed.device)[codes.long()]
    eff = _scale_as_float(scale) / global_scale.to(torch.float32).reshape(1).to(packed.device)
    return (values * eff.repeat_interleave(BLOCK_SIZE, dim=1)).to(dtype)
