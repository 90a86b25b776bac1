"""NVFP4 kernels: FP4xBF16 GEMM and NVFP4 -> BF16 dequantize, as torch ops with torch fallbacks.

Public API (all of it works on CPU through the torch references):

* :func:`repack` -- compressed-tensors NVFP4 -> the GEMM kernel's tile layout (run once at load);
* :func:`linear` -- ``x @ W.T + bias`` for a frozen NVFP4 weight; on CUDA with the extension it
  dispatches by M inside the op (fused GEMM for small M, dequantize + cuBLAS for large M);
* :func:`linear_lora` -- the same plus a single-adapter LoRA expand (``qerl::nvfp4_gemm_lora``: on CUDA in the
  split-K kernel's epilogue at decode M);
* :func:`dequantize` / :func:`dequantize_repacked` -- NVFP4 -> dense weight;
* :func:`cuda_available` / :func:`cuda_unavailable_reason` / :func:`load_extension`.

Importing this package never touches CUDA and never compiles: the extension is built (JIT, ninja,
cached) or imported (ahead-of-time ``verl_qerl._C``) on the first CUDA use, or by an explicit
:func:`load_extension`. Call :func:`load_extension` (or :func:`repack` on a CUDA tensor) before
``torch.ops.qerl.*`` is called directly on CUDA tensors or captured in a CUDA graph: the CUDA
kernels register when the library loads, and the split-K semaphores are allocated then.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings

import torch
import torch.nn.functional as F

from . import layout, ops, reference
from .build import env_flag
from .layout import K_STAGE, K_TILE, N_PAD, LayoutError, RepackedWeight
from .modes import GEMM_KERNEL_NAMES, GEMM_MODES, GemmMode

__all__ = [
    "GEMM_KERNEL_NAMES",
    "GEMM_MODES",
    "K_STAGE",
    "K_TILE",
    "N_PAD",
    "GemmMode",
    "LayoutError",
    "RepackedWeight",
    "cuda_available",
    "cuda_unavailable_reason",
    "dequantize",
    "dequantize_repacked",
    "extension",
    "gemm_kernel_variant",
    "check_tuning_env",
    "gemm_supported",
    "linear",
    "linear_lora",
    "load_extension",
    "pdl_enabled",
    "repack",
]

log = logging.getLogger(__name__)

#: The GEMM kernel (and the repacked layout) need K to be a multiple of its pipeline stage.
GEMM_K_MULTIPLE = K_STAGE

#: Environment variable choosing the fused GEMM kernel (names: :mod:`verl_qerl.kernels.modes`): ``auto`` (default:
#: the calibration table's measured kernel on a device it was measured for, verl_qerl/kernels/dispatch.py; else by
#: M, the stream-K kernel where it applies and pays, split-K elsewhere), ``splitk`` (the split-K kernel only),
#: ``streamk`` (stream-K wherever it applies), ``wgmma_rs`` (the register-A Hopper wgmma kernel at every M where it
#: runs; as ``streamk`` elsewhere), ``wgmma_wide`` (the same with the wide kernel's 128-row tiles at M = 65-128 too),
#: ``wgmma_ss`` (the same with both wgmma operands in shared memory) or
#: ``decode_tma`` (the copy-engine decode kernel at M <= 16 where it runs; as ``streamk`` elsewhere). Only the
#: CUDA fused-GEMM dispatch reads it; the torch fallbacks ignore it.
GEMM_KERNEL_ENV = "QERL_GEMM_KERNEL"
#: ``$QERL_GEMM_KERNEL`` value -> the ``qerl::nvfp4_gemm`` mode :func:`linear` passes (the auto modes still
#: dispatch by M; the wgmma ones run the kernel at every M).
GEMM_KERNEL_MODES = {"auto": GemmMode.AUTO, "splitk": GemmMode.AUTO_SPLITK, "streamk": GemmMode.AUTO_STREAMK,
                     "wgmma_rs": GemmMode.WGMMA_RS, "wgmma_wide": GemmMode.WGMMA_WIDE, "wgmma_ss": GemmMode.WGMMA_SS,
                     "decode_tma": GemmMode.DECODE_TMA}
#: fused kernel -> the mode that *forces* it (no M dispatch; benchmarks and tests); the names are the
#: kernels' own (:data:`GEMM_KERNEL_NAMES`).
GEMM_KERNEL_FORCED_MODES = {"splitk": GemmMode.SPLITK, "streamk": GemmMode.STREAMK,
                            "wgmma_rs": GemmMode.WGMMA_RS, "wgmma_wide": GemmMode.WGMMA_WIDE,
                            "wgmma_ss": GemmMode.WGMMA_SS, "decode_tma": GemmMode.DECODE_TMA}
#: Former names still accepted in ``$QERL_GEMM_KERNEL`` (and benchmark ``--variants``), with a warning.
GEMM_KERNEL_ALIASES = {"v5": "splitk", "wgmma": "wgmma_rs"}
_warned_aliases: set[str] = set()


def canonical_kernel_name(name: str, what: str = GEMM_KERNEL_ENV) -> str:
    """``name`` lower-cased and stripped, with a former name (:data:`GEMM_KERNEL_ALIASES`) replaced by the current
    one; a former name warns once per process (``FutureWarning`` naming ``what`` and the new name)."""
    v = name.strip().lower()
    new = GEMM_KERNEL_ALIASES.get(v)
    if new is None:
        return v
    if v not in _warned_aliases:
        _warned_aliases.add(v)
        warnings.warn(f"{what}: {v!r} is a deprecated name; use {new!r}", FutureWarning, stacklevel=3)
    return new


#: ``QERL_PDL``: ``1`` (default) lets vLLM's forward launch the decode GEMMs as programmatic dependent launches
#: (:func:`pdl_enabled`; the ``pdl`` argument of :func:`linear`); ``0`` turns it off (A/B measurements).
PDL_ENV = "QERL_PDL"


def pdl_enabled() -> bool:
    """Whether ``$QERL_PDL`` allows programmatic dependent launch of the decode GEMMs (default yes). Read at every
    call in eager mode; a CUDA graph keeps what it captured. Anything but 0 / 1 (or empty) raises ``ValueError``
    naming the variable."""
    raw = os.environ.get(PDL_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV}={raw!r}; expected 1 (programmatic dependent launch, the default) or 0 (off)")
    return raw != "0"


#: Tuning variables the CUDA extension reads once, at its first GEMM (cuda/gemm_route.cpp): name -> parser.
#: Its C++ side parses with atoll / atof, which read a typo as 0 and silently change the dispatch, so
#: :func:`check_tuning_env` validates them first.
TUNING_ENV = {"QERL_GEMM_MAX_M": int, "QERL_SPLIT_PENALTY": float, "QERL_STREAMK_MIN_TILES_PER_CTA": float}
#: parser -> the text atoll / atof read whole, as Python reads it: plain ASCII digits (``[0-9]`` is ASCII-only in a
#: ``re``, unlike ``\d`` or ``int()``, which take other scripts' digits), no ``_`` separators, no sign but ``+``,
#: no ``nan`` / ``inf`` / hex. Anything else the C++ side reads as a prefix of it (``1_000`` -> 1) or as 0.
_TUNING_SYNTAX = {int: re.compile(r"\+?[0-9]+"), float: re.compile(r"\+?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")}
#: What atoll / atof skip before the number (C isspace); trailing ones end the number, so both are stripped.
_C_SPACE = " \t\n\v\f\r"


def check_tuning_env() -> None:
    """Raise ``ValueError`` naming the variable and its value when a :data:`TUNING_ENV` variable is set to anything
    but a non-negative number in plain ASCII (:data:`_TUNING_SYNTAX`; unset: the extension's default). An empty
    value is refused too: ``getenv`` gives the C++ side ``""``, which it reads as 0, not as its default."""
    for name, parse in TUNING_ENV.items():
        raw = os.environ.get(name)
        if raw is None:
            continue
        text = raw.strip(_C_SPACE)
        if not text:
            raise ValueError(f"{name}={raw!r} is set but empty, which the extension reads as 0; "
                             "unset it to use the default")
        if not _TUNING_SYNTAX[parse].fullmatch(text):
            kind = "a non-negative integer" if parse is int else "a non-negative number"
            raise ValueError(f"{name}={raw!r} is not {kind} in plain ASCII digits, which the extension would read "
                             "otherwise (unset it for the default)")


def _check_mode_table(ext) -> None:  # noqa: ANN001 - the compiled module
    """Refuse an extension built from another ``cuda/gemm_modes.h`` than the one Python parsed (a stale
    ahead-of-time build): its mode integers and kernel ids would mean other things here."""
    built_modes, built_names = dict(ext.gemm_modes()), tuple(ext.gemm_kernel_names())
    if built_modes != GEMM_MODES or built_names != GEMM_KERNEL_NAMES:
        raise RuntimeError(
            f"the CUDA extension's GEMM modes {built_modes} / kernels {built_names} differ from "
            f"cuda/gemm_modes.h's {GEMM_MODES} / {GEMM_KERNEL_NAMES}: rebuild the extension"
        )


class _State:
    lock = threading.Lock()
    tried = False
    ext = None
    workspace_devices: set[int] = set()
    reason = "not loaded yet (call load_extension())"


#: Switch (``1`` / ``0``, :func:`verl_qerl.kernels.build.env_flag`) that keeps the CUDA extension unloaded.
DISABLE_ENV = "VERL_QERL_DISABLE_CUDA_KERNELS"


def _load_cuda(verbose: bool):  # noqa: ANN202 - the compiled module
    """Build or import the extension, check it and give it its workspace and dispatch table; raises on any failure
    (``ValueError`` for a bad setting)."""
    if env_flag(DISABLE_ENV):
        raise RuntimeError(f"disabled by {DISABLE_ENV}")
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is not a CUDA build")
    from . import build, dispatch

    ext = build.load(verbose=verbose)
    _check_mode_table(ext)
    ext.init_workspace(torch.cuda.current_device())
    log.info("verl_qerl.kernels: GEMM dispatch: %s", dispatch.install(ext, tuple(torch.cuda.get_device_capability())))
    return ext


def load_extension(verbose: bool = False) -> bool:
    """Build (JIT, cached) or import the CUDA extension once; True when its kernels are registered.

    A bad setting raises (a ``ValueError``) and leaves the extension unloaded (the next call tries again): a
    ``$QERL_GEMM_DISPATCH_TABLE`` that is missing or malformed (``dispatch.DispatchTableError``, as
    ``dispatch.install`` documents), a switch that is neither on nor off (:func:`~verl_qerl.kernels.build.env_flag`).
    Why: falling back would run every op on the slow torch reference, with one log line, for a mistake the user
    can fix. Any other failure (no GPU, no compiler, a failed build) does not raise: the torch references are
    registered as the ops' CUDA kernels and :func:`cuda_unavailable_reason` says why. Set
    ``VERL_QERL_DISABLE_CUDA_KERNELS=1`` to skip.
    """
    if _State.tried:
        return _State.ext is not None
    with _State.lock:
        if _State.tried:
            return _State.ext is not None
        try:
            _State.ext = _load_cuda(verbose)
            _State.reason = ""
        except Exception as ex:  # noqa: BLE001 - any other failure means "use the fallback"
            from .build import SettingError
            from .dispatch import DispatchTableError

            if isinstance(ex, (SettingError, DispatchTableError)):
                raise  # a bad setting: the caller's to fix, not a reason to run without the kernels
            _State.reason = f"{type(ex).__name__}: {ex}"
            if torch.cuda.is_available():  # a GPU without our kernels is worth a warning; a CPU box is not
                log.warning("verl_qerl.kernels: CUDA extension unavailable, using torch fallbacks (%s)", ex)
                ops.register_cuda_fallbacks()
            else:
                log.info("verl_qerl.kernels: no CUDA, using torch fallbacks (%s)", ex)
        _State.tried = True
    return _State.ext is not None


def extension():  # noqa: ANN201 - the compiled module, or None
    """The loaded extension module (tuning hooks: ``set_tuning``, ``get_tuning``, ``splits_for``) or None."""
    return _State.ext if load_extension() else None


def cuda_available() -> bool:
    """True when the CUDA kernels can run here (builds/loads the extension on first call)."""
    return load_extension()


def cuda_unavailable_reason() -> str:
    """Why :func:`cuda_available` is False ('' when it is True, or 'not loaded yet')."""
    return _State.reason


def gemm_kernel_variant() -> str:
    """The fused GEMM variant named by ``$QERL_GEMM_KERNEL`` (``auto`` when unset or empty).

    Read at every dispatch in eager mode (so a benchmark can switch it between calls); under
    ``torch.compile`` it is read once at trace time and baked into the graph. A former name (``v5``, ``wgmma``)
    is accepted with a one-line ``FutureWarning`` naming the new one; an unknown value raises ``ValueError``
    naming the variable, rather than silently running the default.
    """
    raw = os.environ.get(GEMM_KERNEL_ENV, "")
    v = canonical_kernel_name(raw) or "auto"
    if v not in GEMM_KERNEL_MODES:
        raise ValueError(
            f"{GEMM_KERNEL_ENV}={raw!r} is not a GEMM kernel variant; expected one of {sorted(GEMM_KERNEL_MODES)}"
        )
    return v


def _ext_ready(device: torch.device) -> bool:
    """Extension usable for tensors on ``device``; never loads while torch.compile traces."""
    if device.type != "cuda":
        return False
    if torch.compiler.is_compiling():
        return _State.ext is not None
    if not load_extension():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _State.workspace_devices and not torch.cuda.is_current_stream_capturing():
        _State.ext.init_workspace(idx)
        _State.workspace_devices.add(idx)
    return True


def gemm_supported(k: int, dtype: torch.dtype) -> bool:
    """Whether the fused GEMM handles activations of this K and dtype (else dequant + matmul)."""
    return dtype == torch.bfloat16 and k % GEMM_K_MULTIPLE == 0


def repack(packed: torch.Tensor, scale: torch.Tensor) -> RepackedWeight:
    """compressed-tensors NVFP4 -> the GEMM's tile layout (``RepackedWeight(qweight, qscale)``).

    Runs in torch on the tensors' device. N must be a multiple of 16 and K of 128 (else
    :class:`LayoutError`); N is zero-padded to a multiple of 128. Keep the result as buffers and
    pass it to :func:`linear` as ``kernel_weight``. On CUDA this also loads the extension, so that
    later calls can be graph-captured.
    """
    if packed.is_cuda:
        _ext_ready(packed.device)
    qweight, qscale = torch.ops.qerl.nvfp4_repack(packed, layout.scale_as_uint8(scale))
    return RepackedWeight(qweight, qscale)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """NVFP4 (compressed-tensors layout) -> [N, K] ``dtype``; bit-identical to the torch reference."""
    expect_scale = (packed.shape[0], packed.shape[1] // 8) if packed.dim() == 2 else None
    if packed.dtype != torch.uint8 or packed.dim() != 2 or tuple(scale.shape) != expect_scale:
        raise LayoutError(
            f"dequantize: expected packed uint8 [N, K/2] and scale [N, K/16], got {packed.dtype} "
            f"{tuple(packed.shape)} and {tuple(scale.shape)}"
        )
    _check_global_scale(global_scale, "dequantize")
    if _ext_ready(packed.device):
        return torch.ops.qerl.nvfp4_dequant(packed, layout.scale_as_uint8(scale), global_scale, dtype)
    return reference.dequantize_ref(packed, scale, global_scale, dtype)


def dequantize_repacked(
    kernel_weight: RepackedWeight, global_scale: torch.Tensor, n: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dense [n, K] weight from the kernel layout (for large-M paths that keep only that layout). ``n`` must be the
    weight's N (:func:`ops.check_n_fits`): the layout pads N, so another ``n`` would return fewer rows or another
    weight's."""
    _check_global_scale(global_scale, "dequantize_repacked")
    ops.check_n_fits(kernel_weight.qweight, n, "dequantize_repacked")
    qweight, qscale = kernel_weight
    if _ext_ready(qweight.device):
        return torch.ops.qerl.nvfp4_dequant_repacked(qweight, qscale, global_scale, n, dtype)
    return reference.dequantize_repacked_ref(qweight, qscale, global_scale, n, dtype)


def _check_global_scale_shape(global_scale: torch.Tensor, caller: str) -> None:
    """One value (a second one gives a shape error deep inside the op that names nothing). Shape only, so it is
    safe in a compiled forward or under CUDA-graph capture: no read of the value, no device sync."""
    if global_scale.numel() != 1:
        raise ValueError(f"{caller}: global_scale must hold one value, got shape {tuple(global_scale.shape)}")


def _check_global_scale(global_scale: torch.Tensor, caller: str) -> None:
    """One finite value > 0 (the divisor of the format): a zero or NaN one gives inf / NaN weights, a second value
    a shape error deep inside the op. The value is read in eager mode on the CPU only: no device sync on the GPU hot
    path, and no data-dependent branch for torch.compile to trace; meta tensors (shape-only tracing) pass."""
    _check_global_scale_shape(global_scale, caller)
    if torch.compiler.is_compiling() or global_scale.is_meta or global_scale.device.type != "cpu":
        return
    g = float(global_scale.reshape(()))
    if not (0 < g < float("inf")):
        raise ValueError(f"{caller}: global_scale must be finite and > 0, got {g}")


def linear(
    x: torch.Tensor,
    packed: torch.Tensor | None,
    scale: torch.Tensor | None,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    kernel_weight: RepackedWeight | None = None,
    n: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ W.T + bias`` for an NVFP4 weight W [N, K]; x is [..., K] (bf16, fp16 or fp32).

    ``pdl``: let the op's decode kernels start while the previous kernel drains (``qerl::nvfp4_gemm``'s ``pdl``,
    :mod:`verl_qerl.kernels.ops`): only when the kernel right before does not write the weight (a model's forward).

    Paths, in order:

    1. CUDA, extension loaded, ``kernel_weight`` given, x bf16, K % 128 == 0: the
       ``qerl::nvfp4_gemm`` op, which picks the fused GEMM (M <= its tuned threshold) or
       dequantize + cuBLAS inside the op (no Python branch on M, so no torch.compile guard);
       the fused GEMM is the table's measured kernel, or stream-K where it applies and pays, split-K elsewhere (see
       :func:`gemm_kernel_variant` for ``QERL_GEMM_KERNEL``);
    2. CUDA, extension loaded: ``qerl::nvfp4_dequant`` to x's dtype, then ``F.linear``;
    3. anywhere else: the torch reference (dequantize, ``F.linear``).

    ``packed``/``scale`` may be None when ``kernel_weight`` is given (then ``n`` = N is needed if
    ``packed`` is None, since the kernel layout pads N).
    """
    if not x.is_floating_point():
        raise TypeError(f"linear: x must be a floating-point tensor (bf16, fp16 or fp32), got {x.dtype}")
    _check_global_scale_shape(global_scale, "linear")  # shape only: this runs in vLLM's compiled forward
    if packed is not None:
        n_out = packed.shape[0]
    elif n is not None:
        n_out = n
    else:
        raise ValueError("linear: give packed (or n together with kernel_weight)")
    if kernel_weight is not None:
        ops.check_n_fits(kernel_weight.qweight, n_out, "linear")
    k = x.shape[-1]
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    ready = _ext_ready(x.device)
    if ready and kernel_weight is not None and gemm_supported(k, x.dtype):
        mode = int(GEMM_KERNEL_MODES[gemm_kernel_variant()])
        check_tuning_env()
        x2 = x.reshape(-1, k)
        out = torch.ops.qerl.nvfp4_gemm(
            x2, kernel_weight.qweight, kernel_weight.qscale, global_scale, bias, n_out, mode, 0, pdl
        )
        return out.reshape(*x.shape[:-1], n_out)
    if packed is None or scale is None:
        if kernel_weight is None:
            raise ValueError("linear: give packed and scale, or kernel_weight")
        w = dequantize_repacked(kernel_weight, global_scale, n_out, x.dtype)
        return F.linear(x, w, bias)
    if ready:
        w = torch.ops.qerl.nvfp4_dequant(packed, layout.scale_as_uint8(scale), global_scale, x.dtype)
        return F.linear(x, w, bias)
    return ops.linear_reference(x, packed, scale, global_scale, bias)


def linear_lora(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    kernel_weight: RepackedWeight,
    n: int,
    lora_b: torch.Tensor,
    mask: torch.Tensor,
    slice_bounds: list[int] | tuple[int, ...],
    shrunk: torch.Tensor | None = None,
    lora_a: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ W.T + bias + mask * expand(shrunk, lora_b)`` for an NVFP4 weight in the kernel layout, given either the
    shrink's output ``shrunk`` (one ``qerl::nvfp4_gemm_lora`` op) or the concatenated A ``lora_a`` (one
    ``qerl::nvfp4_lora_linear`` op: ``shrunk = x @ lora_a^T`` computed by the op); see :mod:`verl_qerl.kernels.ops`
    for the operands. x is [M, K]. ``pdl``: as :func:`linear`'s (the kernel before must not write the weight,
    ``lora_b`` or ``lora_a``).

    Why one op: at decode token counts the LoRA shrink and expand as kernels of their own cost about as much as the
    GEMM's tail; on CUDA the op adds the expand in the epilogue of the split-K or decode kernel wherever one of them
    runs (the same ``$QERL_GEMM_KERNEL`` dispatch as :func:`linear`) and, given ``lora_a``, runs the shrink in that
    kernel's launch too; elsewhere the shrink, the GEMM and ``qerl::lora_expand`` run apart. On the CPU (or without
    the extension) the ops are the float32 reference.
    """
    if x.dim() != 2:
        raise ValueError(f"linear_lora: x must be 2-D [M, K], got {tuple(x.shape)}")
    _check_global_scale_shape(global_scale, "linear_lora")  # shape only: this runs in vLLM's compiled forward
    if (shrunk is None) == (lora_a is None):
        raise ValueError("linear_lora: pass exactly one of shrunk (the shrink's output) and lora_a (the A matrices)")
    ops.check_n_fits(kernel_weight.qweight, n, "linear_lora")
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    mode = 0
    if _ext_ready(x.device):
        mode = int(GEMM_KERNEL_MODES[gemm_kernel_variant()])
        check_tuning_env()
    bounds = [int(b) for b in slice_bounds]
    if lora_a is not None:
        return torch.ops.qerl.nvfp4_lora_linear(x, kernel_weight.qweight, kernel_weight.qscale, global_scale, bias, n,
                                                lora_a, lora_b, mask, bounds, mode, 0, pdl)
    return torch.ops.qerl.nvfp4_gemm_lora(x, kernel_weight.qweight, kernel_weight.qscale, global_scale, bias, n,
                                          shrunk, lora_b, mask, bounds, mode, 0, pdl)
