"""CPU tests of the stream-K GEMM variant's host logic: the schedule mirror that sizes its workspace,
the partial-sum slot protocol, and the ``QERL_GEMM_KERNEL`` switch (GPU tests: test_kernels_gpu.py)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import streamk

SHAPES = [  # (M, N, K): tails in M and N (N % 256 in {0, 16, 144}), 1..28 stages, the 7B gate_up
    (17, 272, 128),
    (33, 400, 640),
    (64, 512, 896),
    (100, 1040, 768),
    (200, 256, 3584),
    (64, 37888, 3584),
    (64, 3584, 18944),
]
GRIDS = [1, 7, 132, 264, 1000]


def check_schedule(m: int, n: int, k: int, grid: int, bm: int) -> None:
    s = streamk.schedule(m, n, k, grid, bm)
    assert s.ctas <= grid and s.ctas * s.units_per_cta >= s.units > (s.ctas - 1) * s.units_per_cta
    segs = streamk.segments(s)
    # every (tile, stage) unit exactly once
    seen = [0] * s.units
    for g in segs:
        assert 0 <= g.k_begin < g.k_end <= s.stages
        for st in range(g.k_begin, g.k_end):
            seen[g.tile * s.stages + st] += 1
    assert seen == [1] * s.units
    # CTAs cover contiguous equal ranges: each CTA's segments add up to its range length
    for cta in range(s.ctas):
        mine = [g for g in segs if g.cta == cta]
        length = min(s.units_per_cta, s.units - cta * s.units_per_cta)
        assert sum(g.k_end - g.k_begin for g in mine) == length
        partial = [g.slot for g in mine if g.slot is not None]
        assert len(partial) <= 2 and len(set(partial)) == len(partial)  # at most one write per slot
        assert all(2 * cta <= p < 2 * cta + 2 for p in partial)
    # per tile: whole iff one CTA; else the reducer reads exactly the slots written, in CTA order
    by_tile: dict[int, list] = {}
    for g in segs:
        by_tile.setdefault(g.tile, []).append(g)
    assert sorted(by_tile) == list(range(s.n_tiles * s.m_tiles))
    for tile, gs in by_tile.items():
        ctas = list(streamk.ctas_of_tile(s, tile))
        assert [g.cta for g in gs] == ctas
        if len(ctas) == 1:
            assert gs[0].slot is None and (gs[0].k_begin, gs[0].k_end) == (0, s.stages)
        else:
            assert [g.slot for g in gs] == [streamk.reader_slot(s, c, tile) for c in ctas]
    # the workspace holds every slot written (and is 0 when nothing is partial)
    slots = [g.slot for g in segs if g.slot is not None]
    wsf = streamk.workspace_floats(m, n, k, grid, bm)
    if slots:
        assert wsf >= (max(slots) + 1) * bm * streamk.BN
    else:
        assert wsf == 0


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_schedule_covers_every_unit_once_and_slots_match(m: int, n: int, k: int) -> None:
    for grid in GRIDS:
        check_schedule(m, n, k, grid, streamk.block_m_for(m))


def test_schedule_small_exhaustive() -> None:
    for m, n16, st, grid in itertools.product((17, 40, 64, 129), (1, 8, 16, 17, 33), (1, 2, 3, 5), (1, 2, 3, 5, 13)):
        check_schedule(m, n16 * 16, st * 128, grid, streamk.block_m_for(m))


def test_schedule_7b_gate_up_m64() -> None:
    """The shape of the NOTES prediction: 148 tiles x 28 stages over 132 SMs -> 130 CTAs of 32 stages."""
    s = streamk.schedule(64, 37888, 3584, 132, 64)
    assert (s.n_tiles, s.m_tiles, s.stages, s.units, s.units_per_cta, s.ctas) == (148, 1, 28, 4144, 32, 130)
    assert streamk.workspace_floats(64, 37888, 3584, 132, 64) == 2 * 130 * 64 * 256
    segs = streamk.segments(s)
    # each CTA walks at most 2 segments here (one ring refill each): the cost the NOTES prediction assumes
    assert max(sum(1 for g in segs if g.cta == c) for c in range(s.ctas)) == 2
    # a range that is a whole number of tiles has no partials and needs no workspace
    assert streamk.workspace_floats(64, 512, 256, 1, 64) == 0
    assert streamk.workspace_floats(8, 512, 256, 3, 8) == 0  # block_m 8 / 16 never use stream-K


def test_applies_only_to_block_m_32_and_64() -> None:
    assert [m for m in range(1, 300) if streamk.applies(m)] == list(range(17, 300))
    assert streamk.block_m_for(16) == 16 and streamk.block_m_for(17) == 32 and streamk.block_m_for(33) == 64


def test_schedule_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="K=100"):
        streamk.schedule(64, 256, 100, 132, 64)
    with pytest.raises(ValueError, match="grid=0"):
        streamk.schedule(64, 256, 128, 0, 64)


def test_gemm_kernel_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.GEMM_KERNEL_ENV, raising=False)
    assert kernels.GEMM_KERNEL_ENV == "QERL_GEMM_KERNEL"
    assert kernels.gemm_kernel_variant() == "auto"
    for raw, want in (("", "auto"), ("auto", "auto"), ("v5", "v5"), ("streamk", "streamk"), (" StreamK ", "streamk")):
        monkeypatch.setenv("QERL_GEMM_KERNEL", raw)
        assert kernels.gemm_kernel_variant() == want
    # cuda/qerl_torch.cpp's mode table: 0 auto, 6 auto with v5 only, 4 auto with stream-K wherever it applies;
    # forced fused kernels 1 (v5), 5 (stream-K) and 7 (wgmma, every M)
    assert kernels.GEMM_KERNEL_MODES == {"auto": 0, "v5": 6, "streamk": 4, "wgmma": 7}
    assert kernels.GEMM_KERNEL_FORCED_MODES == {"v5": 1, "streamk": 5, "wgmma": 7}
    for bad in ("stream-k", "v6", "marlin"):
        monkeypatch.setenv("QERL_GEMM_KERNEL", bad)
        with pytest.raises(ValueError, match=r"QERL_GEMM_KERNEL='[^']+' is not a GEMM kernel variant.*streamk"):
            kernels.gemm_kernel_variant()


def test_tuning_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension's C++ reads these with atoll / atof (a typo would become 0 and change the dispatch);
    the Python side refuses anything but a non-negative number, naming the variable."""
    assert set(kernels.TUNING_ENV) == {"QERL_GEMM_MAX_M", "QERL_SPLIT_PENALTY", "QERL_STREAMK_MIN_TILES_PER_CTA"}
    for name in kernels.TUNING_ENV:
        monkeypatch.delenv(name, raising=False)
    kernels.check_tuning_env()
    for name, good in (("QERL_GEMM_MAX_M", "64"), ("QERL_SPLIT_PENALTY", "0.05"),
                       ("QERL_STREAMK_MIN_TILES_PER_CTA", " 0.3 "), ("QERL_STREAMK_MIN_TILES_PER_CTA", "")):
        monkeypatch.setenv(name, good)
        kernels.check_tuning_env()
    for name, bad in (("QERL_GEMM_MAX_M", "1e3"), ("QERL_GEMM_MAX_M", "-1"), ("QERL_SPLIT_PENALTY", "high"),
                      ("QERL_STREAMK_MIN_TILES_PER_CTA", "nan"), ("QERL_STREAMK_MIN_TILES_PER_CTA", "0,25")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=rf"{name}='{re.escape(bad)}' is not a non-negative"):
            kernels.check_tuning_env()
        monkeypatch.delenv(name)


def test_cpu_paths_ignore_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch fallbacks are unaffected: a bad value is only refused where the CUDA GEMM dispatches,
    and the op's CPU impl gives the same answer for the stream-K and v5-only modes (4, 5, 6) as for 0 / 1."""
    gen = torch.Generator().manual_seed(0)
    n, k = 48, 256
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    gs = torch.tensor([1000.0])
    rw = kernels.repack(packed, scale)
    x = torch.randn(20, k, generator=gen).to(torch.bfloat16)
    monkeypatch.setenv("QERL_GEMM_KERNEL", "bogus")
    ref = kernels.linear(x, packed, scale, gs, kernel_weight=rw)
    outs = [torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, mode) for mode in (0, 1, 4, 5, 6)]
    for o in outs:
        assert torch.equal(o, outs[0])
    assert torch.allclose(ref.float(), outs[0].float(), rtol=2e-2, atol=2e-2)
