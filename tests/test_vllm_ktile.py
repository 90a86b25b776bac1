"""``qerl_nvfp4`` layers whose K is not a multiple of the FP4 GEMM's K stage take the dequant fallback.

SmolLM2-135M has hidden size 576 = 4.5 x 128: its q/k/v/o and gate/up projections (K = 576) cannot
use the GEMM's repacked layout (``verl_qerl.kernels.repack`` needs K % 128 == 0), while down_proj
(K = 1536) can. The vLLM method must keep such layers in the compressed-tensors layout and run
dequantize + ``F.linear``, not fail. ``QERL_NVFP4_BACKEND=kernel`` makes the method choose the
kernel layout on CPU too (the kernels package then runs its torch reference), so the decision is
exercised here without a GPU. Layers are built by hand with the attributes ``create_weights`` sets
(vLLM's parameter classes need a tensor-parallel group, which only an engine has).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from verl_qerl.kernels import K_STAGE  # noqa: E402
from verl_qerl.nvfp4 import dequantize, global_scale_from_amax, quantize  # noqa: E402
from verl_qerl.vllm.config import FORMAT_BF16, QeRLNvFp4Config  # noqa: E402
from verl_qerl.vllm.linear_method import (  # noqa: E402
    BACKEND_ENV,
    LAYOUT_CT,
    LAYOUT_REPACKED,
    QeRLLayerState,
    QeRLNvFp4LinearMethod,
)


def _bf16_layer(widths: list[int], k: int, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A loaded BF16-format layer (fused parts ``widths``), as vLLM leaves it before finalizing."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(sum(widths), k, generator=gen) * 0.05).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.logical_widths = list(widths)
    layer.input_size_per_partition = k
    layer.output_size_per_partition = sum(widths)
    layer.qerl_state = QeRLLayerState(prefix=f"model.layers.0.k{k}", checkpoint_format=FORMAT_BF16,
                                      loaded={"weight": {None}})
    layer.register_parameter("weight", torch.nn.Parameter(w.clone(), requires_grad=False))
    return layer, w


@pytest.mark.parametrize(("k", "layout"), [(576, LAYOUT_CT), (1536, LAYOUT_REPACKED)])
def test_k_not_multiple_of_gemm_stage_falls_back(k, layout, monkeypatch, caplog):
    assert (k % K_STAGE == 0) == (layout == LAYOUT_REPACKED)
    monkeypatch.setenv(BACKEND_ENV, "kernel")
    method = QeRLNvFp4LinearMethod(QeRLNvFp4Config(checkpoint_format=FORMAT_BF16), prefix="t")
    widths = [576, 192, 192]  # SmolLM2's fused q/k/v
    layer, w = _bf16_layer(widths, k, seed=k)
    with caplog.at_level(logging.WARNING, logger="verl_qerl.vllm.linear_method"):
        method.process_weights_after_loading(layer)
    assert layer.qerl_state.backend == "kernel"
    assert layer.qerl_state.layout == layout
    warned = [r.getMessage() for r in caplog.records if "cannot use the FP4 GEMM layout" in r.getMessage()]
    assert bool(warned) == (layout != LAYOUT_REPACKED)
    if warned:
        assert f"K={k}" in warned[0]

    # Reference: qerl-quantize's rule (one global scale over the fused group), dequantized, F.linear.
    gscale = global_scale_from_amax(w.float().abs().amax())
    q = quantize(w, gscale)
    bias = torch.randn(sum(widths), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).to(dtype)
        want = F.linear(x, dequantize(q.packed, q.scale, gscale, dtype), bias.to(dtype))
        got = method.apply(layer, x, bias.to(dtype))
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want), (dtype, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize(("byte", "problem"), [(0xB8, "are negative"), (0x7F, "are NaN"), (0xFF, "are NaN")])
def test_damaged_block_scales_are_refused_by_name(byte, problem):
    """The vLLM method refuses NaN and negative E4M3 block scales of a compressed-tensors layer, naming the tensor (a
    negative scale loaded silently as its block's weights negated)."""
    from verl_qerl.vllm.config import FORMAT_CT, QeRLNvFp4Error

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    gscale = global_scale_from_amax(w.abs().amax())
    q = quantize(w, gscale)
    scale = q.scale.view(torch.uint8).clone()
    scale[3, 5] = byte
    layer = torch.nn.Module()
    layer.logical_widths = [32]
    layer.input_size_per_partition = 128
    layer.output_size_per_partition = 32
    names = ("weight_packed", "weight_scale", "weight_global_scale")
    layer.qerl_state = QeRLLayerState(prefix="model.layers.0.mlp.down_proj", checkpoint_format=FORMAT_CT,
                                      loaded={n: {None} for n in names})
    for name, t in zip(names, (q.packed, scale.view(torch.float8_e4m3fn), gscale.reshape(1))):
        layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    method = QeRLNvFp4LinearMethod(QeRLNvFp4Config(checkpoint_format=FORMAT_CT), prefix="t")
    want = rf"model.layers.0.mlp.down_proj.weight_scale: 1 block scale\(s\) {problem}"
    with pytest.raises(QeRLNvFp4Error, match=want):
        method.process_weights_after_loading(layer)
