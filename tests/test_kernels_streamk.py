"""CPU tests of the fused GEMM kernels' host switches: ``QERL_GEMM_KERNEL``, the tuning variables the
extension reads, and the torch fallbacks' indifference to both. The stream-K schedule (tiles, CTAs, partial-sum
slots, workspace) has one definition, in cuda/streamk_schedule.cuh, shared by the stream-K and both wgmma kernels;
the host asks the extension for it (``gemm_choice``, ``streamk_grid``, ``streamk_tiles``), and
tests/test_kernels_gpu.py checks those answers and the kernels' results on the GPU."""

from __future__ import annotations

import re

import pytest
import torch

from verl_qerl import kernels


def test_gemm_kernel_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.GEMM_KERNEL_ENV, raising=False)
    assert kernels.GEMM_KERNEL_ENV == "QERL_GEMM_KERNEL"
    assert kernels.gemm_kernel_variant() == "auto"
    for raw, want in (("", "auto"), ("auto", "auto"), ("splitk", "splitk"), ("streamk", "streamk"),
                      (" StreamK ", "streamk")):
        monkeypatch.setenv("QERL_GEMM_KERNEL", raw)
        assert kernels.gemm_kernel_variant() == want
    # cuda/gemm_modes.h: the auto modes dispatch by M (auto, auto_splitk, auto_streamk); the wgmma variants run
    # their kernel at every M (decode_tma at M <= 16); the forced modes run one fused kernel at every M
    m = kernels.GEMM_MODES
    assert kernels.GEMM_KERNEL_MODES == {"auto": m["auto"], "splitk": m["auto_splitk"], "streamk": m["auto_streamk"],
                                         "wgmma_rs": m["wgmma_rs"], "wgmma_wide": m["wgmma_wide"],
                                         "wgmma_ss": m["wgmma_ss"], "decode_tma": m["decode_tma"]}
    assert kernels.GEMM_KERNEL_FORCED_MODES == {"splitk": m["splitk"], "streamk": m["streamk"],
                                                "wgmma_rs": m["wgmma_rs"], "wgmma_wide": m["wgmma_wide"],
                                                "wgmma_ss": m["wgmma_ss"], "decode_tma": m["decode_tma"]}
    for bad in ("stream-k", "v6", "marlin", "dqmm"):
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
                       ("QERL_STREAMK_MIN_TILES_PER_CTA", " 0.3 ")):
        monkeypatch.setenv(name, good)
        kernels.check_tuning_env()
    monkeypatch.setenv("QERL_STREAMK_MIN_TILES_PER_CTA", "")  # the C++ side reads a set, empty value as 0
    with pytest.raises(ValueError, match="QERL_STREAMK_MIN_TILES_PER_CTA='' is set but empty"):
        kernels.check_tuning_env()
    monkeypatch.delenv("QERL_STREAMK_MIN_TILES_PER_CTA")
    for name, bad in (("QERL_GEMM_MAX_M", "1e3"), ("QERL_GEMM_MAX_M", "-1"), ("QERL_SPLIT_PENALTY", "high"),
                      ("QERL_STREAMK_MIN_TILES_PER_CTA", "nan"), ("QERL_STREAMK_MIN_TILES_PER_CTA", "0,25")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=rf"{name}='{re.escape(bad)}' is not a non-negative"):
            kernels.check_tuning_env()
        monkeypatch.delenv(name)


def test_cpu_paths_ignore_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch fallbacks are unaffected: a bad value is only refused where the CUDA GEMM dispatches,
    and the op's CPU impl gives the same answer in every mode (and with a split count) as in auto."""
    gen = torch.Generator().manual_seed(0)
    n, k = 48, 256
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    gs = torch.tensor([1000.0])
    rw = kernels.repack(packed, scale)
    x = torch.randn(20, k, generator=gen).to(torch.bfloat16)
    monkeypatch.setenv("QERL_GEMM_KERNEL", "bogus")
    ref = kernels.linear(x, packed, scale, gs, kernel_weight=rw)
    outs = [torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, mode)
            for mode in kernels.GEMM_MODES.values()]
    outs.append(torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, kernels.GemmMode.SPLITK, 3))
    for o in outs:
        assert torch.equal(o, outs[0])
    assert torch.allclose(ref.float(), outs[0].float(), rtol=2e-2, atol=2e-2)
