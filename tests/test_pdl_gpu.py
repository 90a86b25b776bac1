"""GPU tests of the decode GEMMs as programmatic dependent launches (``pdl=True``; run on the GPU machine, skipped
without CUDA).

With ``pdl`` the split-K and ``decode_tma`` kernels may start while the kernel before them still runs and stream
their first weight stages before ``griddepcontrol.wait``; everything that kernel may write (activations, ``shrunk``,
workspace, output) must come after the wait. The producer here is the LoRA shrink kernel itself (the fast path's
order: shrink, then the GEMM), told to signal the next launch at its start (``signal_next``; the fast path does not)
and run on a long K so that it is still running when the GEMM's CTAs start, into a NaN-poisoned buffer: a GEMM that
read its activations or ``shrunk`` before the wait would see NaN or a partial sum. Oracle: the same op without
``pdl`` once the producer is done, bit for bit (PDL changes when a kernel starts, not what it computes).
"""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import GemmMode as Mode
from verl_qerl.kernels.lora_shrink import can_signal_next, launch_lora_shrink
from verl_qerl.testing.gpu import capture
from verl_qerl.testing.nvfp4_random import random_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
#: the producers' reduction lengths (activations: K columns; shrunk: 64 columns): long enough that the shrink runs for
#: tens of microseconds after signalling the launch
K_PRODUCER_X = 1 << 14
K_PRODUCER_SHRUNK = 1 << 18
#: (N, K): a 7B qkv shape, a small one with N not a multiple of the 128-row tile
SHAPES = [(4608, 3584), (208, 512)]
#: forced split-K, forced decode kernel (split-K where it does not run), auto dispatch
MODES = [Mode.SPLITK, Mode.DECODE_TMA, Mode.AUTO]


@pytest.fixture(scope="module", autouse=True)
def _ext() -> None:
    if not kernels.load_extension(verbose=False):
        pytest.fail(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")


def rand_weight(n: int, k: int, seed: int) -> tuple[kernels.RepackedWeight, torch.Tensor]:
    packed, scale, gs = random_nvfp4(n, k, seed, DEV)
    return kernels.repack(packed, scale), gs


def slow_product(rows: int, cols: int, depth: int, seed: int) -> torch.Tensor:
    """A [rows, cols] bf16 tensor written by the shrink kernel (which signals the next launch first) over a
    `depth`-long reduction, into a NaN-filled buffer; returned before the kernel finishes."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    u = torch.randn(rows, depth, device=DEV, generator=g).to(torch.bfloat16)
    a = (torch.randn(cols, depth, device=DEV, generator=g) / depth**0.5).to(torch.bfloat16)
    y = torch.full((rows, cols), float("nan"), device=DEV, dtype=torch.bfloat16)
    torch.cuda.synchronize()  # the inputs are ready: the shrink is the only kernel in flight when the GEMM launches
    assert can_signal_next(u.device), "needs sm_90+ and a Triton with grid dependency control"
    launch_lora_shrink(u, a, y, signal_next=True)
    return y


def gemm(x, rw, gs, n, mode, pdl):  # noqa: ANN001, ANN201
    return torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, int(mode), 0, pdl)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_pdl_gemm_waits_for_its_activations(m: int, n: int, k: int, mode: int) -> None:
    rw, gs = rand_weight(n, k, seed=n + m)
    x = slow_product(m, k, K_PRODUCER_X, seed=m)
    got = gemm(x, rw, gs, n, mode, pdl=True)
    torch.cuda.synchronize()
    assert not torch.isnan(x).any()
    want = gemm(x, rw, gs, n, mode, pdl=False)
    print(f"\nM={m} {n}x{k} mode={int(mode)}: {kernels.extension().gemm_choice(m, n, k, int(mode))}")
    assert not torch.isnan(got).any() and torch.equal(got, want)


def lora_operands(m: int, n: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Block-diagonal lora_b [n, 2 rank] over two slices, an all-ones mask [m, 1], the slice bounds."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    bounds = [0, n // 2 // 16 * 16, n]
    lora_b = torch.zeros(n, 2 * rank, device=DEV, dtype=torch.bfloat16)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        lora_b[lo:hi, i * rank:(i + 1) * rank] = torch.randn(hi - lo, rank, device=DEV, generator=g).to(torch.bfloat16)
    return lora_b, torch.ones(m, 1, device=DEV, dtype=torch.bfloat16), bounds


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 8, 16])
def test_pdl_lora_epilogue_waits_for_shrunk(m: int, mode: int) -> None:
    """The GEMM's activations are ready, `shrunk` is still being written by the shrink before it: the epilogue (or
    the expand after the GEMM, where the kernel has none) must see the finished `shrunk`."""
    n, k, rank = 4608, 3584, 32
    rw, gs = rand_weight(n, k, seed=m)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    lora_b, mask, bounds = lora_operands(m, n, rank, seed=m)
    shrunk = slow_product(m, 2 * rank, K_PRODUCER_SHRUNK, seed=100 + m)
    got = torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk, lora_b, mask, bounds,
                                         int(mode), 0, True)
    torch.cuda.synchronize()
    want = torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk, lora_b, mask, bounds,
                                          int(mode), 0, False)
    print(f"\nM={m} mode={int(mode)}: {kernels.extension().gemm_choice(m, n, k, int(mode))}, epilogue "
          f"{bool(kernels.extension().lora_epilogue_runs(m, n, k, int(mode)))}")
    assert not torch.isnan(got).any() and torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 8])
def test_pdl_in_a_cuda_graph(m: int) -> None:
    """The fast path's pair (shrink, then the fused GEMM with pdl) captured in a CUDA graph and replayed with fresh
    activations: the eager op without pdl, bit for bit."""
    n, k, rank = 4608, 3584, 32
    rw, gs = rand_weight(n, k, seed=7)
    lora_b, mask, bounds = lora_operands(m, n, rank, seed=7)
    a_cat = (torch.randn(2 * rank, k, device=DEV) / k**0.5).to(torch.bfloat16)
    x_static = torch.randn(m, k, device=DEV).to(torch.bfloat16)

    def f(x: torch.Tensor, pdl: bool) -> torch.Tensor:
        shrunk = torch.ops.qerl.lora_shrink(x, a_cat)
        return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk, lora_b, mask, bounds,
                                              0, 0, pdl)

    graph, y_static = capture(lambda: f(x_static, True))
    for i in range(3):
        x_new = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, f(x_new, False)), i
