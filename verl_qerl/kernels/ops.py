"""The ``qerl::*`` torch.library ops: schemas, CPU fallbacks, fake (meta) impls, autograd.

Why ops and not plain Python functions: vLLM compiles the model with ``torch.compile(fullgraph=True)``
and captures CUDA graphs; an opaque custom op with a fake impl is traced as one node, and its CUDA
kernel (registered from C++ by the extension, see ``cuda/qerl_torch.cpp``) makes no host syncs and
allocates only shape-determined outputs, so it can be captured.

Ops (shapes: x [M, K]; weight [N, K]; N_pad = N rounded up to 128):

* ``nvfp4_gemm(x, qweight, qscale, global_scale, bias, n, mode=0, splits=0, pdl=False) -> [M, n]``: ``x @ W.T + bias``
  on the repacked layout. On CUDA the kernel itself dispatches by M and shape: on a device with a
  calibration table (``verl_qerl/kernels/dispatch.py``; an H200 one ships) the measured fastest of split-K,
  stream-K, the Hopper wgmma kernel and dequantize + cuBLAS for the nearest measured shape and M; elsewhere
  the fused FP4xBF16 GEMM up to a tuned M, dequantize + cuBLAS above it. ``mode`` (benchmarks/tests) is one
  of :data:`verl_qerl.kernels.modes.GEMM_MODES`, defined once in ``cuda/gemm_modes.h`` with what each runs;
  ``splits`` (mode ``splitk`` only) fixes the split-K kernel's K-split count (0: its heuristic). ``pdl``: on
  sm_90+ the decode kernels (split-K, ``decode_tma``) go out as programmatic dependent launches: a GEMM starts while
  the kernel before it drains and streams its first weight stage before waiting for that kernel's results (1-2 % per
  decode layer on an H200). Only pass it when the kernel right before the op does not write ``qweight``, ``qscale``
  (or ``lora_b``): a model's forward (``verl_qerl.kernels.pdl_enabled``).
* ``nvfp4_gemm_lora(x, qweight, qscale, global_scale, bias, n, shrunk, lora_b, mask, slice_bounds, mode=0,
  splits=0, pdl=False) -> [M, n]``: ``nvfp4_gemm`` plus a single-adapter LoRA expand, ``out[m, c] += mask[m] *
  shrunk[m, s r:(s+1) r] . lora_b[c, s r:(s+1) r]`` with ``s`` the slice of output column ``c`` (``slice_bounds =
  [0, end_0, ..., n]``, 1-3 slices of one rank ``r``: a fused qkv or gate_up layer). ``shrunk`` [M, S r] is the
  shrink ``x @ A_cat^T`` (``qerl::lora_shrink``), ``lora_b`` [n, S r] the slices' B on a block diagonal (zero
  elsewhere: the single-adapter fast path's layout), ``mask`` [M] or [M, 1] (1: the token's request has the
  adapter). On CUDA, wherever the split-K kernel runs (auto dispatch at decode M), the LoRA term is added in that
  kernel's epilogue in FP32 before the one bf16 rounding, so no expand kernel runs and the result is *more* exact
  than ``nvfp4_gemm`` followed by ``qerl::lora_expand`` (which rounds the base output to bf16 first); elsewhere
  (other kernels, larger M, operands the epilogue does not take) the op runs the GEMM and then ``qerl::lora_expand``.
  The CPU implementation is the reference (float32, the diagonal blocks of ``lora_b`` only). Inference only (no
  autograd).
* ``nvfp4_lora_linear(x, qweight, qscale, global_scale, bias, n, lora_a, lora_b, mask, slice_bounds, mode=0,
  splits=0, pdl=False) -> [M, n]``: a whole single-adapter LoRA linear layer, ``nvfp4_gemm_lora`` with ``shrunk =
  bf16(x @ lora_a^T)`` (``lora_a`` [S r, K], the slices' A concatenated). On CUDA, wherever the split-K kernel runs
  with its LoRA epilogue (decode M) or the copy-engine decode kernel does (``decode_tma``, up to 16 tokens, one
  32-rank x 128-K shrink unit per CTA at most), it is one kernel launch: the shrink's units ride in the GEMM's grid
  ahead of the GEMM's work and the tiles' epilogues wait for their sum (cuda/nvfp4_gemm.cu,
  cuda/nvfp4_gemm_decode_tma.cu, cuda/lora_shrink_in_launch.cuh), where the fast path used to run a separate
  ``qerl::lora_shrink`` launch (2.5-5 us per decode GEMM in a CUDA graph for < 1 us of work). Elsewhere it runs
  ``qerl::lora_shrink`` and then ``nvfp4_gemm_lora``. The shrink's FP32 sum is rounded to bf16 before the expand in
  both, as the separate shrink stores it (in another summation order: a shrunk value may land one bf16 ulp from the
  separate shrink's). ``pdl``: the promise also covers ``lora_a``. Inference only.
* ``nvfp4_dequant(packed, scale, global_scale, dtype) -> [N, K]`` (compressed-tensors layout).
* ``nvfp4_dequant_repacked(qweight, qscale, global_scale, n, dtype) -> [n, K]``.
* ``nvfp4_repack(packed, scale) -> (qweight, qscale)``: pure torch on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import layout, reference
from . import lora_expand as _lora_expand  # noqa: F401 - defines qerl::lora_expand, which nvfp4_gemm_lora's CUDA op calls
from . import lora_shrink as _lora_shrink  # noqa: F401 - defines qerl::lora_shrink, which nvfp4_lora_linear's CUDA op calls
from .modes import GEMM_MODES
from .op_library import LIB_NAME, library

_lib = library()
_lib.define(
    "nvfp4_gemm(Tensor x, Tensor qweight, Tensor qscale, Tensor global_scale, Tensor? bias, int n, "
    "int mode=0, int splits=0, bool pdl=False) -> Tensor"
)
_lib.define(
    "nvfp4_gemm_lora(Tensor x, Tensor qweight, Tensor qscale, Tensor global_scale, Tensor? bias, int n, "
    "Tensor shrunk, Tensor lora_b, Tensor mask, int[] slice_bounds, int mode=0, int splits=0, "
    "bool pdl=False) -> Tensor"
)
_lib.define(
    "nvfp4_lora_linear(Tensor x, Tensor qweight, Tensor qscale, Tensor global_scale, Tensor? bias, int n, "
    "Tensor lora_a, Tensor lora_b, Tensor mask, int[] slice_bounds, int mode=0, int splits=0, "
    "bool pdl=False) -> Tensor"
)
_lib.define("nvfp4_dequant(Tensor packed, Tensor scale, Tensor global_scale, ScalarType dtype) -> Tensor")
_lib.define(
    "nvfp4_dequant_repacked(Tensor qweight, Tensor qscale, Tensor global_scale, int n, "
    "ScalarType dtype) -> Tensor"
)
_lib.define("nvfp4_repack(Tensor packed, Tensor scale) -> (Tensor, Tensor)")


# ----------------------------------------------------------------------------------- CPU fallbacks


class GemmArgumentError(ValueError):
    """Arguments of the ``qerl::nvfp4_gemm*`` ops that the op refuses; the message names the argument."""


def check_n_fits(qweight: torch.Tensor, n: int, who: str) -> None:
    """``n`` must be the repacked weight's N: a multiple of the row tile within its last padding block (the C++
    ``check_repacked`` rule); another ``n`` would give fewer rows, or another weight's."""
    rows = qweight.shape[0] * layout.N_PAD
    if not (n > 0 and n % layout.N_TILE == 0 and rows - layout.N_PAD < n <= rows):
        raise GemmArgumentError(f"{who}: n={n} does not fit the weight's {rows} padded rows (n must be a multiple "
                                f"of {layout.N_TILE} in ({rows - layout.N_PAD}, {rows}])")


def check_gemm_args(x: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, bias: torch.Tensor | None,
                    n: int, mode: int, splits: int, who: str) -> None:
    """The CPU side of the C++ ``check_gemm_args`` (cuda/qerl_torch.cpp): the CPU implementations are also what runs
    when the CUDA extension is unavailable, so they refuse what the CUDA op refuses, naming the argument, instead of
    computing something (a 3-D x, an unknown mode, ``splits`` outside split-K, an integer x, a K or ``n`` that does
    not fit the weight, a bias of another length)."""
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise GemmArgumentError(f"{who}: x must be a 2-D floating-point tensor [M, K], got {x.dtype} "
                                f"{tuple(x.shape)}")
    k = qweight.shape[1] * layout.K_STAGE if qweight.dim() == 3 else -1
    if x.shape[1] != k:
        raise GemmArgumentError(f"{who}: x has K={x.shape[1]} but the weight has K={k}")
    check_n_fits(qweight, n, who)
    if global_scale.numel() != 1:
        raise GemmArgumentError(f"{who}: global_scale must hold one value, got shape {tuple(global_scale.shape)}")
    if bias is not None and bias.numel() != n:
        raise GemmArgumentError(f"{who}: bias must have n={n} values, got shape {tuple(bias.shape)}")
    if int(mode) not in GEMM_MODES.values():
        known = ", ".join(f"{v} {name}" for name, v in GEMM_MODES.items())
        raise GemmArgumentError(f"{who}: unknown mode {mode} ({known}; cuda/gemm_modes.h)")
    if splits < 0 or (splits != 0 and int(mode) != GEMM_MODES["splitk"]):
        raise GemmArgumentError(f"{who}: splits={splits} (K-splits of the split-K kernel) needs mode "
                                f"{GEMM_MODES['splitk']} (splitk) and must be >= 0")


def _gemm_cpu(
    x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None, n: int, mode: int = 0, splits: int = 0, pdl: bool = False,
) -> torch.Tensor:
    check_gemm_args(x, qweight, global_scale, bias, n, mode, splits, "qerl::nvfp4_gemm")
    w = reference.dequantize_repacked_ref(qweight, qscale, global_scale, n, torch.float32)
    out = x.to(torch.float32) @ w.T
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


class LoRAOperandError(ValueError):
    """Operands of ``qerl::nvfp4_gemm_lora`` that do not fit each other; the message names the tensor."""


def check_lora_operands(x: torch.Tensor, n: int, shrunk: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor,
                        slice_bounds: list[int] | tuple[int, ...]) -> int:
    """Raise :class:`LoRAOperandError` naming the tensor when the LoRA operands of ``nvfp4_gemm_lora`` do not fit
    ``x`` [M, K] and ``n`` output columns (the CUDA op checks the same in C++); returns the rank per slice."""
    who = "qerl::nvfp4_gemm_lora"
    bounds = [int(b) for b in slice_bounds]
    slices = len(bounds) - 1
    if not 1 <= slices <= 3 or bounds[0] != 0 or bounds[-1] != n or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise LoRAOperandError(f"{who}: slice_bounds must be [0, end of slice 0, ..., n={n}], increasing, for 1 to 3 "
                               f"slices; got {bounds}")
    if lora_b.dim() != 2 or lora_b.shape[0] != n or lora_b.shape[1] == 0 or lora_b.shape[1] % slices:
        raise LoRAOperandError(f"{who}: lora_b must be [n, slices * rank] = [{n}, {slices} * rank], got "
                               f"{tuple(lora_b.shape)}")
    m = x.shape[0]
    if shrunk.dim() != 2 or tuple(shrunk.shape) != (m, lora_b.shape[1]):
        raise LoRAOperandError(f"{who}: shrunk must be [M, slices * rank] = [{m}, {lora_b.shape[1]}], got "
                               f"{tuple(shrunk.shape)}")
    if mask.numel() != m or mask.dim() > 2 or (mask.dim() == 2 and mask.shape[1] != 1):
        raise LoRAOperandError(f"{who}: mask must be [M] or [M, 1] with M={m}, got {tuple(mask.shape)}")
    for name, t in (("shrunk", shrunk), ("lora_b", lora_b), ("mask", mask)):
        if t.device != x.device:
            raise LoRAOperandError(f"{who}: {name} is on {t.device}, x on {x.device}")
        if not t.dtype.is_floating_point:
            raise LoRAOperandError(f"{who}: {name} must be floating point, got {t.dtype}")
    return lora_b.shape[1] // slices


def lora_expand_reference(
    shrunk: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor, slice_bounds: list[int] | tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``mask[m] * shrunk[m, s r:(s+1) r] . lora_b[c, s r:(s+1) r]`` for every token m and output column c of slice
    s, in ``dtype``: what ``nvfp4_gemm_lora`` adds to the GEMM (only the diagonal blocks of ``lora_b`` are read)."""
    slices = len(slice_bounds) - 1
    rank = lora_b.shape[1] // slices
    s = shrunk.to(dtype)
    parts = [s[:, i * rank:(i + 1) * rank] @ lora_b[lo:hi, i * rank:(i + 1) * rank].to(dtype).T
             for i, (lo, hi) in enumerate(zip(slice_bounds, slice_bounds[1:]))]
    return torch.cat(parts, dim=1) * mask.reshape(-1, 1).to(dtype)


def _gemm_lora_cpu(
    x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None, n: int, shrunk: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor,
    slice_bounds: list[int], mode: int = 0, splits: int = 0, pdl: bool = False,
) -> torch.Tensor:
    check_gemm_args(x, qweight, global_scale, bias, n, mode, splits, "qerl::nvfp4_gemm_lora")
    check_lora_operands(x, n, shrunk, lora_b, mask, slice_bounds)
    w = reference.dequantize_repacked_ref(qweight, qscale, global_scale, n, torch.float32)
    out = x.to(torch.float32) @ w.T
    if bias is not None:
        out = out + bias.to(torch.float32)
    return (out + lora_expand_reference(shrunk, lora_b, mask, slice_bounds)).to(x.dtype)


def check_lora_a(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    """Raise :class:`LoRAOperandError` naming ``lora_a`` when it is not ``[slices * rank, K]`` on ``x``'s device."""
    who = "qerl::nvfp4_lora_linear"
    want = (lora_b.shape[1], x.shape[1])
    if lora_a.dim() != 2 or tuple(lora_a.shape) != want:
        raise LoRAOperandError(f"{who}: lora_a must be [slices * rank, K] = [{want[0]}, {want[1]}], got "
                               f"{tuple(lora_a.shape)}")
    if lora_a.device != x.device:
        raise LoRAOperandError(f"{who}: lora_a is on {lora_a.device}, x on {x.device}")
    if not lora_a.dtype.is_floating_point:
        raise LoRAOperandError(f"{who}: lora_a must be floating point, got {lora_a.dtype}")


def lora_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """``x @ lora_a^T`` in float32, rounded to ``x``'s dtype: the ``shrunk`` that ``nvfp4_lora_linear`` expands."""
    return (x.to(torch.float32) @ lora_a.to(torch.float32).T).to(x.dtype)


def _lora_linear_cpu(
    x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None, n: int, lora_a: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor,
    slice_bounds: list[int], mode: int = 0, splits: int = 0, pdl: bool = False,
) -> torch.Tensor:
    check_gemm_args(x, qweight, global_scale, bias, n, mode, splits, "qerl::nvfp4_lora_linear")
    shrunk = x.new_empty((x.shape[0], lora_b.shape[1] if lora_b.dim() == 2 else 0))
    check_lora_operands(x, n, shrunk, lora_b, mask, slice_bounds)  # names lora_b, mask, slice_bounds
    check_lora_a(x, lora_a, lora_b)
    return _gemm_lora_cpu(x, qweight, qscale, global_scale, bias, n, lora_shrink_reference(x, lora_a), lora_b, mask,
                          slice_bounds)


def _dequant_cpu(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return reference.dequantize_ref(packed, scale, global_scale, dtype)


def _dequant_repacked_cpu(
    qweight: torch.Tensor, qscale: torch.Tensor, global_scale: torch.Tensor, n: int, dtype: torch.dtype
) -> torch.Tensor:
    check_n_fits(qweight, n, "qerl::nvfp4_dequant_repacked")
    return reference.dequantize_repacked_ref(qweight, qscale, global_scale, n, dtype)


def _repack_any(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rw = layout.repack(packed, scale)
    return rw.qweight, rw.qscale


_lib.impl("nvfp4_gemm", _gemm_cpu, "CPU")
_lib.impl("nvfp4_gemm_lora", _gemm_lora_cpu, "CPU")
_lib.impl("nvfp4_lora_linear", _lora_linear_cpu, "CPU")
_lib.impl("nvfp4_dequant", _dequant_cpu, "CPU")
_lib.impl("nvfp4_dequant_repacked", _dequant_repacked_cpu, "CPU")
_lib.impl("nvfp4_repack", _repack_any, "CompositeExplicitAutograd")


def register_cuda_fallbacks() -> None:
    """Register the torch references as the ops' CUDA kernels (when the extension cannot load).

    Only called when building/loading the extension failed, so that ``torch.ops.qerl.*`` still
    work on GPU tensors (slowly). The extension registers the real kernels from C++ otherwise.
    """
    _lib.impl("nvfp4_gemm", _gemm_cpu, "CUDA")
    _lib.impl("nvfp4_gemm_lora", _gemm_lora_cpu, "CUDA")
    _lib.impl("nvfp4_lora_linear", _lora_linear_cpu, "CUDA")
    _lib.impl("nvfp4_dequant", _dequant_cpu, "CUDA")
    _lib.impl("nvfp4_dequant_repacked", _dequant_repacked_cpu, "CUDA")


# ------------------------------------------------------------------------------------- fake impls


def _gemm_out_fake(op: str, x: torch.Tensor, qweight: torch.Tensor, n: int) -> torch.Tensor:
    """The [M, n] output of a GEMM op on x [M, K] and a repacked weight, shapes checked (the ops' fake impls)."""
    torch._check(x.dim() == 2, lambda: f"{op}: x must be 2-D [M, K]")
    torch._check(x.shape[1] == qweight.shape[1] * layout.K_STAGE, lambda: f"{op}: K mismatch")
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake(f"{LIB_NAME}::nvfp4_gemm")
def _gemm_fake(x, qweight, qscale, global_scale, bias, n, mode=0, splits=0, pdl=False):  # noqa: ANN001, ANN202
    return _gemm_out_fake("nvfp4_gemm", x, qweight, n)


@torch.library.register_fake(f"{LIB_NAME}::nvfp4_gemm_lora")
def _gemm_lora_fake(x, qweight, qscale, global_scale, bias, n, shrunk, lora_b, mask, slice_bounds, mode=0,  # noqa: ANN001, ANN202
                    splits=0, pdl=False):
    return _gemm_out_fake("nvfp4_gemm_lora", x, qweight, n)


@torch.library.register_fake(f"{LIB_NAME}::nvfp4_lora_linear")
def _lora_linear_fake(x, qweight, qscale, global_scale, bias, n, lora_a, lora_b, mask, slice_bounds, mode=0,  # noqa: ANN001, ANN202
                      splits=0, pdl=False):
    return _gemm_out_fake("nvfp4_lora_linear", x, qweight, n)


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
    x, qweight, qscale, global_scale, bias, n, _mode, _splits, _pdl = inputs
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
    return grad_x, None, None, None, grad_bias, None, None, None, None


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
