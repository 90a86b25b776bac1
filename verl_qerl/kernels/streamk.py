"""Python mirror of the stream-K GEMM variant's schedule (``cuda/nvfp4_gemm_streamk.cu``).

Why a mirror: the kernel's workspace size and its partial-sum protocol follow from the schedule alone,
so they can be checked on a CPU (tests/test_kernels.py) exactly as the kernel computes them: the
flattened unit space ``(m_tile, n_tile, k_stage)`` (tile index ``m_tile * n_tiles + n_tile``, each
tile ``stages = K / 128`` consecutive units) is cut into equal contiguous ranges of
``units_per_cta = ceil(units / grid)``, one per CTA (``ctas = ceil(units / units_per_cta)`` CTAs run).
A CTA walks the tile segments of its range; a segment that is a whole tile stores directly; a partial
segment writes workspace slot ``2 * cta + (0 if the tile is the CTA's first tile else 1)``, and the
last segment of the tile to arrive sums the slots of every CTA overlapping the tile in CTA order.
Keep this file and the kernel in step (same formulas, same names).
"""

from __future__ import annotations

from typing import NamedTuple

from verl_qerl.kernels.layout import K_STAGE, N_PAD

#: Weight rows per stream-K CTA tile (two 128-row tiles of the repacked layout).
BN = 2 * N_PAD
#: K per pipeline stage (the repacked layout's stage).
BK = K_STAGE
#: block_m values the stream-K kernel is compiled for; other M use v5.
BLOCK_MS = (32, 64)


def block_m_for(m: int) -> int:
    """The fused GEMM's token tile for M (``pick_block_m`` in cuda/qerl_torch.cpp)."""
    if m <= 8:
        return 8
    if m <= 16:
        return 16
    if m <= 32:
        return 32
    return 64


def applies(m: int) -> bool:
    """Whether the stream-K variant runs for this M (else the v5 kernel does)."""
    return block_m_for(m) in BLOCK_MS


class Schedule(NamedTuple):
    n_tiles: int
    m_tiles: int
    stages: int
    units: int
    units_per_cta: int
    ctas: int


class Segment(NamedTuple):
    cta: int
    tile: int
    k_begin: int  # first stage of the tile this segment covers
    k_end: int  # one past its last stage
    slot: int | None  # workspace slot index (2 * cta + 0/1), None for a whole-tile segment


def schedule(m: int, n: int, k: int, grid: int, block_m: int) -> Schedule:
    """The kernel's ``schedule()``: ranges of equal length over all units, CTAs with a non-empty range."""
    if m <= 0 or n <= 0 or k <= 0 or k % BK or grid <= 0:
        raise ValueError(f"stream-K schedule: bad shape M={m} N={n} K={k} grid={grid}")
    n_tiles = -(-n // BN)
    m_tiles = -(-m // block_m)
    stages = k // BK
    units = n_tiles * m_tiles * stages
    per = -(-units // grid)
    return Schedule(n_tiles, m_tiles, stages, units, per, -(-units // per))


def ctas_of_tile(s: Schedule, tile: int) -> range:
    """CTAs whose ranges overlap ``tile``, in the order the last arriving one sums their partials."""
    return range(tile * s.stages // s.units_per_cta, (tile * s.stages + s.stages - 1) // s.units_per_cta + 1)


def reader_slot(s: Schedule, cta: int, tile: int) -> int:
    """Slot the reducing CTA reads for ``cta``'s partial of ``tile`` (the kernel's ``cslot`` rule)."""
    return 2 * cta + (0 if tile == cta * s.units_per_cta // s.stages else 1)


def segments(s: Schedule) -> list[Segment]:
    """Every (CTA, tile) segment, walked as the kernel walks them."""
    out = []
    for cta in range(s.ctas):
        u, end = cta * s.units_per_cta, min((cta + 1) * s.units_per_cta, s.units)
        first_tile = u // s.stages
        while u < end:
            tile = u // s.stages
            kb = u - tile * s.stages
            ke = min(s.stages, end - tile * s.stages)
            whole = len(ctas_of_tile(s, tile)) == 1
            out.append(Segment(cta, tile, kb, ke, None if whole else 2 * cta + (0 if tile == first_tile else 1)))
            u = tile * s.stages + ke
    return out


def workspace_floats(m: int, n: int, k: int, grid: int, block_m: int) -> int:
    """``qerl_nvfp4_gemm_streamk_workspace_floats``: 2 slots per running CTA of block_m x 256 floats, or 0
    when every range starts and ends on a tile boundary (no partial segments)."""
    if block_m not in BLOCK_MS:
        return 0
    s = schedule(m, n, k, grid, block_m)
    if s.units_per_cta % s.stages == 0:
        return 0
    return 2 * s.ctas * block_m * BN
