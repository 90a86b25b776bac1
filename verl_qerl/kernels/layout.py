"""The kernel tile layout of an NVFP4 weight ("repacked"), in pure torch.

Why a second layout: the GEMM kernel runs ``mma.sync.m16n8k16`` with the *weight* as the A
operand (16 output features x 16 inputs) and the activations as B (tokens in the n8 side), so a
decode step with one token wastes nothing on the weight side. Each thread of a warp must then hold,
for every k16 step, the 8 weights of its A fragment: rows ``r = lane/4`` and ``r+8``, columns
``2*(lane%4) + {0, 1}`` and ``+8``. The repacked layout stores exactly those 8 nibbles in one
32-bit word, 4 k16 steps per lane in one 16-byte vector, so that a warp reads a 16 x 64 weight
tile as 512 contiguous bytes with one 16-byte load per thread and needs no shuffles.

Inside a word the nibbles are *not* in plain order: the kernel turns a word into four bf16x2
registers with rotates and masks only (no lookup table), by placing each code's three magnitude
bits (e1 e0 m) at bf16 bits 8..6 and its sign at bit 15 (and +16 for the upper half). A bf16 with
bits ``c << 6`` is exactly ``e2m1(c) * 2**-126`` (subnormal for c = 1), so after one bf16x2 multiply
by the block scale pre-biased by ``2**119`` the fragment holds ``e2m1 * scale / 128`` exactly.
The four registers of a word are extracted as (``M = 0x81C081C0``)::

    a0 = W & M
    a1 = rotl(W, 4) & M
    a2 = rotl(W, 10) & M
    a3 = (rotl(W, 6) & 0x80C080C0) | (rotl(W, 14) & 0x01000100)

(three rotated copies of one mask cannot tile 32 bits, so the fourth register needs two). The
placement below is the inverse of these formulas; :func:`unrepack` decodes with the very same
bit operations as the CUDA code, so the CPU tests check the kernel's decoding too.

Block scales are re-encoded to one byte ``b`` per 16 weights such that the bf16 with bits
``(b << 4) | 0x7000`` equals ``scale * 2**119`` exactly (E4M3 has 3 mantissa bits and its
exponents, subnormals included, fit the 5-bit field above 224). A zero scale becomes ``b = 0``
and its block's codes are zeroed, since ``b = 0`` decodes to ``2**97``, not 0. The FP32 global
scale is applied once per output in the epilogue as ``128 / global_scale``.

Shapes (N padded up to a multiple of :data:`N_PAD`, K a multiple of :data:`K_STAGE`), ordered so
that one pipeline stage of one GEMM CTA (128 rows x 128 K) is one contiguous block (DRAM pages are
read sequentially by each CTA):

* ``qweight`` uint8 ``[N_pad/128, K/128, 8192]``: per stage 8 row blocks x 2 k64 tiles x 32 lanes x
  16 bytes (tile (n16 = 8*i + b, k64 = 2*s + t) at ``[i, s, (b*2 + t)*512 : ...+512]``);
* ``qscale``  uint8 ``[N_pad/128, K/128, 1024]``: per stage 8 x 2 tiles x 64 bytes; inside a tile
  byte ``g*8 + j*2 + h`` is the scale of row ``g + 8*h`` for k16 step ``j``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..nvfp4.format import BLOCK_SIZE, block_scale_problem

#: K elements per repacked tile (4 k16 MMA steps).
K_TILE = 64
#: K elements per GEMM pipeline stage (2 tiles); repacked weights need K % K_STAGE == 0.
K_STAGE = 128
#: Output features are padded to a multiple of this (the GEMM's CTA tile along N).
N_PAD = 128
#: Rows per tile (the MMA's M side).
N_TILE = 16

_MASK = 0x81C081C0
_MASK_A3_LO = 0x80C080C0
_MASK_A3_HI = 0x01000100
# Destination bit in a bf16x2 register of code bit b (0 = m, 1 = e0, 2 = e1, 3 = sign), lower half.
_DEST = (6, 7, 8, 15)


def _src_bit(reg: int, half: int, code_bit: int) -> int:
    """Bit of the 32-bit word that holds ``code_bit`` of the element decoded into ``reg``/``half``."""
    d = _DEST[code_bit] + 16 * half
    if reg == 0:
        s = 0
    elif reg == 1:
        s = 4
    elif reg == 2:
        s = 10
    else:
        s = 6 if (_MASK_A3_LO >> d) & 1 else 14
    return (d - s) % 32


#: ``_SRC[reg][half][code_bit]`` -> bit position in the word.
_SRC = [[[_src_bit(r, h, b) for b in range(4)] for h in range(2)] for r in range(4)]


class RepackedWeight(NamedTuple):
    """Kernel-layout tensors of one weight; plain tensors so callers can register them as buffers."""

    qweight: torch.Tensor
    qscale: torch.Tensor


class LayoutError(ValueError):
    """A weight shape or dtype the kernel layout cannot hold; the message names it."""


def _tile_index(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row/column inside a 16x64 tile of (lane, k16 step, register, half): shape [32, 4, 4, 2]."""
    lane = torch.arange(32, device=device).view(32, 1, 1, 1)
    step = torch.arange(4, device=device).view(1, 4, 1, 1)
    reg = torch.arange(4, device=device).view(1, 1, 4, 1)
    half = torch.arange(2, device=device).view(1, 1, 1, 2)
    row = lane // 4 + 8 * (reg % 2)
    col = 16 * step + 2 * (lane % 4) + half + 8 * (reg // 2)
    return row.expand(32, 4, 4, 2), col.expand(32, 4, 4, 2)


def scale_as_uint8(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales as their raw bytes (accepts float8_e4m3fn or its uint8 view)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == torch.float8_e4m3fn:
        return scale.view(torch.uint8)
    raise LayoutError(f"block scale: expected float8_e4m3fn or uint8, got {scale.dtype}")


def scale_as_float(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales (float8_e4m3fn or uint8 view) as float32."""
    return scale_as_uint8(scale).view(torch.float8_e4m3fn).to(torch.float32)


def encode_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scales -> the kernel's scale bytes (see the module docstring); zero stays zero."""
    s = scale_as_float(scale)
    big = s * (2.0**119)  # exact: a power-of-two multiple, inside float32 range (448 * 2**119 < 2**128)
    bits = big.view(torch.int32).to(torch.int64)
    field = (bits >> 23) & 0xFF
    mant3 = (bits >> 20) & 0x7
    enc = ((field - 224) << 3) | mant3
    enc = torch.where(s > 0, enc, torch.zeros_like(enc))
    return enc.to(torch.uint8)


def decode_scale_bytes(enc: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_scale_bytes` with the kernel's bit operations -> float32 scale."""
    bits16 = (enc.to(torch.int32) << 4) | 0x7000
    as_f32 = (bits16 << 16).view(torch.float32)
    val = as_f32 * (2.0**-119)
    return torch.where(enc == 0, torch.zeros_like(val), val)


def check_shapes(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """Validate a compressed-tensors NVFP4 pair for the kernel layout; returns (N, K)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise LayoutError(
            f"packed weight: expected uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}"
        )
    n, k = packed.shape[0], packed.shape[1] * 2
    if scale.dim() != 2 or tuple(scale.shape) != (n, k // BLOCK_SIZE):
        raise LayoutError(f"block scale shape {tuple(scale.shape)} does not match weight [N={n}, K={k}]")
    if n % N_TILE != 0:
        raise LayoutError(f"NVFP4 kernel layout needs N (out features) % {N_TILE} == 0, got N={n}")
    if k % K_STAGE != 0:
        raise LayoutError(f"NVFP4 kernel layout needs K (in features) % {K_STAGE} == 0, got K={k}")
    return n, k


def repack(packed: torch.Tensor, scale: torch.Tensor, rows_per_chunk: int = 4096) -> RepackedWeight:
    """compressed-tensors NVFP4 (``packed`` [N, K/2], ``scale`` [N, K/16]) -> kernel layout.

    Pure torch, on the tensors' device (CPU or GPU); runs once per weight at load. Works in chunks
    of rows so the int64 intermediates stay small. N is zero-padded to a multiple of ``N_PAD``. NaN or negative
    block scales are refused (the kernel's scale bytes hold neither: they would become zero blocks here while
    ``dequantize`` gives NaN / negated weights from the same pair).
    """
    n, k = check_shapes(packed, scale)
    problem = block_scale_problem(scale)
    if problem is not None:
        raise LayoutError(f"repack: {problem}")
    sbytes = scale_as_uint8(scale)
    dev = packed.device
    n_pad = (n + N_PAD - 1) // N_PAD * N_PAD
    kt = k // K_TILE
    qweight = torch.zeros(n_pad // N_TILE, kt, 512, dtype=torch.uint8, device=dev)
    qscale = torch.zeros(n_pad // N_TILE, kt, 64, dtype=torch.uint8, device=dev)
    row_idx, col_idx = _tile_index(dev)
    chunk = max(N_PAD, rows_per_chunk // N_PAD * N_PAD)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        p = packed[r0:r1]
        codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(r1 - r0, k)
        enc = encode_scale_bytes(sbytes[r0:r1])
        # A zero scale decodes to 2**97 in the kernel: zero the block's codes instead.
        zero_blk = (enc == 0).repeat_interleave(BLOCK_SIZE, dim=1)
        codes = torch.where(zero_blk, torch.zeros_like(codes), codes)
        nb = (r1 - r0) // N_TILE
        tiles = codes.view(nb, N_TILE, kt, K_TILE).permute(0, 2, 1, 3)  # [nb, kt, 16, 64]
        g = tiles[:, :, row_idx, col_idx].to(torch.int64)  # [nb, kt, 32, 4, 4, 2]
        word = torch.zeros(g.shape[:4], dtype=torch.int64, device=dev)
        for reg in range(4):
            for half in range(2):
                c = g[..., reg, half]
                for b in range(4):
                    word |= ((c >> b) & 1) << _SRC[reg][half][b]
        by = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
        qweight[r0 // N_TILE : r1 // N_TILE] = by.reshape(nb, kt, 512)
        st = enc.view(nb, 2, 8, kt, 4).permute(0, 3, 2, 4, 1)  # [nb, kt, g, j, h]
        qscale[r0 // N_TILE : r1 // N_TILE] = st.reshape(nb, kt, 64)
    return RepackedWeight(_to_stage_order(qweight, 512), _to_stage_order(qscale, 64))


def _to_stage_order(t: torch.Tensor, tile_bytes: int) -> torch.Tensor:
    """[N_pad/16, K/64, B] tile-major -> [N_pad/128, K/128, 16*B] stage-contiguous."""
    nb, kt, _ = t.shape
    v = t.view(nb // 8, 8, kt // 2, 2, tile_bytes).permute(0, 2, 1, 3, 4)
    return v.reshape(nb // 8, kt // 2, 16 * tile_bytes).contiguous()


def _from_stage_order(t: torch.Tensor, tile_bytes: int) -> torch.Tensor:
    """Inverse of :func:`_to_stage_order`."""
    ntl, st, _ = t.shape
    v = t.view(ntl, st, 8, 2, tile_bytes).permute(0, 2, 1, 3, 4)
    return v.reshape(ntl * 8, st * 2, tile_bytes)


def _rotl(w: torch.Tensor, s: int) -> torch.Tensor:
    return ((w << s) | (w >> (32 - s))) & 0xFFFFFFFF if s else w


def unrepack_codes(qweight: torch.Tensor, n: int) -> torch.Tensor:
    """Decode ``qweight`` back to uint8 codes [n, K] with the kernel's own bit operations."""
    qweight = _from_stage_order(qweight, 512)
    nb, kt, _ = qweight.shape
    by = qweight.view(nb, kt, 32, 4, 4).to(torch.int64)
    w = by[..., 0] | (by[..., 1] << 8) | (by[..., 2] << 16) | (by[..., 3] << 24)  # [nb, kt, 32, 4]
    regs = [
        w & _MASK,
        _rotl(w, 4) & _MASK,
        _rotl(w, 10) & _MASK,
        (_rotl(w, 6) & _MASK_A3_LO) | (_rotl(w, 14) & _MASK_A3_HI),
    ]
    codes = torch.zeros(nb, kt, N_TILE, K_TILE, dtype=torch.uint8, device=qweight.device)
    row_idx, col_idx = _tile_index(qweight.device)
    for reg in range(4):
        for half in range(2):
            bits = regs[reg] >> (16 * half)
            c = ((bits >> 6) & 0x7) | (((bits >> 15) & 1) << 3)  # bf16 bits 8..6 = e1 e0 m, 15 = sign
            codes[:, :, row_idx[:, :, reg, half], col_idx[:, :, reg, half]] = c.to(torch.uint8)
    return codes.permute(0, 2, 1, 3).reshape(nb * N_TILE, kt * K_TILE)[:n]


def unrepack_scales(qscale: torch.Tensor, n: int) -> torch.Tensor:
    """Decode ``qscale`` back to float32 block scales [n, K/16] (kernel bit operations)."""
    qscale = _from_stage_order(qscale, 64)
    nb, kt, _ = qscale.shape
    st = qscale.view(nb, kt, 8, 4, 2).permute(0, 4, 2, 1, 3)  # [nb, h, g, kt, j]
    return decode_scale_bytes(st.reshape(nb * N_TILE, kt * 4))[:n]
