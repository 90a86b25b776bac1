"""The NVFP4 number format as pure torch functions, and its checkpoint layouts."""

from .format import BLOCK_SIZE, E2M1_MAGNITUDES, FP4_MAX, FP8_E4M3_MAX, SCALE_DTYPE, block_scale_problem, e2m1_values
from .quantize import (
    DEFAULT_SCALE_RULE,
    SCALE_RULES,
    NVFP4FormatError,
    NVFP4Weight,
    cast_to_e2m1_codes,
    check_scale_rule,
    compute_block_scales,
    compute_global_scale,
    dequantize,
    fused_global_scale,
    global_scale_from_amax,
    pack_fp4,
    quantize,
    unpack_fp4,
)

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_SCALE_RULE",
    "E2M1_MAGNITUDES",
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "SCALE_DTYPE",
    "SCALE_RULES",
    "block_scale_problem",
    "NVFP4FormatError",
    "NVFP4Weight",
    "cast_to_e2m1_codes",
    "check_scale_rule",
    "compute_block_scales",
    "compute_global_scale",
    "dequantize",
    "e2m1_values",
    "fused_global_scale",
    "global_scale_from_amax",
    "pack_fp4",
    "quantize",
    "unpack_fp4",
]
