"""The ``qerl::*`` torch.library ops: schemas, CPU fallbacks, fake (meta) impls, autograd.

Why ops and not plain Python functions: vLLM compiles the model with ``torch.compile(fullgraph=True)``
and captures CUDA graphs; an opaque custom op with a fake impl is traced as one node, and its CUDA
kernel (registered from C++ by the extension, see ``cuda/qerl_torch.cpp``) makes no host syncs and
allocates only shape-determined outputs, so it can be captured.

Ops (shapes: x [M, K]; weight [N, K]; N_pad = N rounded up to 128):

* ``nvfp4_gemm(x, qweight, qscale, global_scale, bias, n, mode=0, splits=0) -> [M, n]``: ``x @ W.T + bias``
  on the repacked layout. On CUDA the kernel itself dispatches by M and shape: on a device with a
  calibration table (``verl_qerl/kernels/dispatch.py``; an H200 one ships) the measured fastest of split-K,
  stream-K, the Hopper wgmma kernel and dequantize + cuBLAS for the nearest measured shape and M; elsewhere
  the fused FP4xBF16 GEMM up to a tuned M, dequantize + cuBLAS above it. ``mode`` (benchmarks/tests) is one
  of :data:`verl_qerl.kernels.modes.GEMM_MODES`, defined once in ``cuda/gemm_modes.h`` with what each runs;
  ``splits`` (mode ``splitk`` only) fixes the split-K kernel's K-split count (0: its heuristic).
* ``nvfp4_dequant(packed, scale, global_scale, dtype) -> [N, K]`` (compressed-tensors layout).
* ``nvfp4_dequant_repacked(qweight, qscale, global_scale, n, dtype) -> [n, K]``.
* ``nvfp4_repack(packed, scale) -> (qweight, qscale)``: pure torch on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import layout, reference
from .op_library import LIB_NAME, library

_lib = library()
_lib.define(
    "nvfp4_gemm(Tensor x, Tensor qweight, Tensor qscale, Tensor global_scale, Tensor? bias, int n, "
    "int mode=0, int splits=0) -> Tensor"
)
_lib.define("nvfp4_dequant(Tensor packed, Tensor scale, Tensor global_scale, ScalarType dtype) -> Tensor")
_lib.define(
    "nvfp4_dequant_repacked(Tensor qweight, Tensor qscale, Tensor global_scale, int n, "
    "ScalarType dtype) -> Tensor"
)
_lib.define("nvfp4_repack(Tensor packed, Tensor scale) -> (Tensor, Tensor)")


# ----------------------------------------------------------------------------------- CPU fallbacks


def _gemm_cpu(
    x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None, n: int, mode: int = 0, splits: int = 0,
) -> torch.Tensor:
    w = reference.dequantize_repacked_ref(qweight, qscale, global_scale, n, torch.float32)
    out = x.to(torch.float32) @ w.T
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _dequant_cpu(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return reference.dequantize_ref(packed, scale, global_scale, dtype)


def _dequant_repacked_cpu(
    qweight: torch.Tensor, qscale: torch.Tensor, global_scale: torch.Tensor, n: int, dtype: torch.dtype
) -> torch.Tensor:
    return reference.dequantize_repacked_ref(qweight, qscale, global_scale, n, dtype)


def _repack_any(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rw = layout.repack(packed, scale)
    return rw.qweight, rw.qscale


_lib.impl("nvfp4_gemm", _gemm_cpu, "CPU")
_lib.impl("nvfp4_dequant", _dequant_cpu, "CPU")
_lib.impl("nvfp4_dequant_repacked", _dequant_repacked_cpu, "CPU")
_lib.impl("nvfp4_repack", _repack_any, "CompositeExplicitAutograd")


def register_cuda_fallbacks() -> None:
    """Register the torch references as the ops' CUDA kernels (when the extension cannot load).

    Only called when building/loading the extension failed, so that ``torch.ops.qerl.*`` still
    work on GPU tensors (slowly). The extension registers the real kernels from C++ otherwise.
    """
    _lib.impl("nvfp4_gemm", _gemm_cpu, "CUDA")
    _lib.impl("nvfp4_dequant", _dequant_cpu, "CUDA")
    _lib.impl("nvfp4_dequant_repacked", _dequant_repacked_cpu, "CUDA")


# ------------------------------------------------------------------------------------- fake impls


@torch.library.register_fake(f"{LIB_NAME}::nvfp4_gemm")
def _gemm_fake(x, qweight, qscale, global_scale, bias, n, mode=0, splits=0):  # noqa: ANN001, ANN202
    torch._check(x.dim() == 2, lambda: "nvfp4_gemm: x must be 2-D [M, K]")
    torch._check(x.shape[1] == qweight.shape[1] * layout.K_STAGE, lambda: "nvfp4_gemm: K mismatch")
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake(f"{LIB_NAME}::nvfp4_dequant")
def _dequant_fake(packed, scale, global_scale, dtype):  # noqa: ANN001, ANN202
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


@torch.library.register_fake(f"{LIB_NAME}::nvfp4_dequant_repacked")
def _dequant_repacked_fake(qweight, qscale, global_scale, n, dtype):  # noqa: ANN001, ANN202
    return qweight.new_empty((n, qweight.shape[1] * layout.K_STAGE), dtype=dtype)


@torch.library.register_fake(f"{LIB_NAME}::nvfp4_repack")
def _repack_fake(packed, scale):  # noqa: ANN001, ANN202
    n, k = packed.shape[0], packed.shape[1] * 2
    n_pad = (n + layout.N_PAD - 1) // layout.N_PAD * layout.N_PAD
    st = k // layout.K_STAGE
    return (
        packed.new_empty((n_pad // layout.N_PAD, st, 8192), dtype=torch.uint8),
        packed.new_empty((n_pad // layout.N_PAD, st, 1024), dtype=torch.uint8),
    )


# --------------------------------------------------------------------------------------- autograd
# The base weight is frozen (QeRL trains LoRA only): gradients flow to x and bias.


def _gemm_setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    x, qweight, qscale, global_scale, bias, n, _mode, _splits = inputs
    ctx.save_for_backward(qweight, qscale, global_scale)
    ctx.n = n
    ctx.x_dtype = x.dtype
    ctx.has_bias = bias is not None


def _gemm_backward(ctx, grad):  # noqa: ANN001, ANN202
    qweight, qscale, global_scale = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.qerl.nvfp4_dequant_repacked(qweight, qscale, global_scale, ctx.n, grad.dtype)
        grad_x = grad.matmul(w).to(ctx.x_dtype)
    if ctx.has_bias and ctx.needs_input_grad[4]:
        grad_bias = grad.sum(0)
    return grad_x, None, None, None, grad_bias, None, None, None


torch.library.register_autograd(
    f"{LIB_NAME}::nvfp4_gemm", _gemm_backward, setup_context=_gemm_setup_context
)


def linear_reference(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch fallback of :func:`verl_qerl.kernels.linear`: dequantize to x's dtype, F.linear."""
    w = reference.dequantize_ref(packed, scale, global_scale, x.dtype)
    return F.linear(x, w, bias)
