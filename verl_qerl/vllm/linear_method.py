"""The ``qerl_nvfp4`` linear method: create NVFP4 (or BF16-to-quantize) parameters, load, finalize, run.

Lifecycle of one vLLM linear layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``):

1. ``create_weights`` registers parameters named like the checkpoint's tensors, as vLLM's v2
   parameter classes, so vLLM's own loaders do the tensor-parallel slicing (rows along N for
   column-parallel layers and per q/k/v or gate/up shard, K for row-parallel ones; FP4 is packed
   along K, so no packed-dim adjustment on N) and place each fused shard's global scale in its slot.
2. vLLM loads the checkpoint through those loaders; we record which shards arrived, read U8-stored
   block scales as the E4M3 bits they are, and name a tensor whose shape does not fit.
3. ``process_weights_after_loading`` checks completeness, brings every layout to one canonical form
   (``weight_packed`` uint8 [N, K/2], ``weight_scale`` E4M3 [N, K/16], ``weight_global_scale``
   fp32 divisor), quantizes BF16 weights on the spot (global scale from the TP-wide amax of the
   whole fused group, under the config's scale rule, so it is bit-identical to ``qerl-quantize``
   and ``quantize_model`` with the same rule), and where the FP4 GEMM runs (CUDA with the
   extension loaded) replaces packed weight and scales by the kernel's repacked layout (no second
   copy is kept). ``weight_packed`` keeps its name in both layouts: vLLM's LoRA wrappers look for it
   (for its device only); the layer's :class:`QeRLLayerState` says which layout it holds.
4. ``apply`` calls ``verl_qerl.kernels.linear``. Repacked layout: the ``qerl::nvfp4_gemm`` op (fused
   GEMM for small M, dequantize + cuBLAS for large M, chosen inside the op; the package's torch
   reference where the extension is not loaded). Compressed-tensors layout: the CUDA dequant op +
   ``F.linear`` on CUDA, :func:`verl_qerl.nvfp4.dequantize` + ``F.linear`` elsewhere. No host syncs,
   no data-dependent shapes: it traces under torch.compile and captures into CUDA graphs.

Fused layers whose parts were quantized with different global scales (a checkpoint written
without llm-compressor's scale fusing) stay exact: the compressed-tensors layout dequantizes each
part with its own scale; the kernel runs with the first part's scale and rescales the other parts'
output columns.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter, PerTensorScaleParameter

from verl_qerl import kernels
from verl_qerl.nvfp4 import (
    BLOCK_SIZE,
    SCALE_DTYPE,
    block_scale_problem,
    dequantize,
    global_scale_from_amax,
    pack_fp4,
    quantize,
)
from verl_qerl.nvfp4.quant_config import LAYOUT_TENSOR_NAMES

from . import compat
from .config import FORMAT_BF16, FORMAT_CT, FORMAT_MODELOPT, QeRLNvFp4Config, QeRLNvFp4Error

logger = logging.getLogger(__name__)

#: ``auto`` (kernel layout on CUDA when the extension loads, else torch), ``torch``, ``kernel``.
BACKEND_ENV = "QERL_NVFP4_BACKEND"

#: Rows quantized at a time at load, to bound the fp32 temporaries of large layers.
_QUANT_ROWS = 2048

#: Input-scale parameters of W4A4 checkpoints, per layout: loaded into placeholders and dropped.
_PLACEHOLDERS = {FORMAT_CT: ("input_global_scale",), FORMAT_MODELOPT: ("input_scale",), FORMAT_BF16: ()}


#: :attr:`QeRLLayerState.layout` values: what ``weight_packed`` / ``weight_scale`` hold once finalized.
LAYOUT_CT = "compressed-tensors"  # packed codes uint8 [N, K/2], block scales E4M3 [N, K/16]
LAYOUT_REPACKED = "repacked"  # the FP4 GEMM's tile layout (verl_qerl.kernels.layout), N padded


@dataclass
class QeRLLayerState:
    """What the method keeps about one vLLM linear layer besides its parameters (``layer.qerl_state``)."""

    #: the layer's module name, for messages
    prefix: str
    #: the checkpoint layout the parameters are created in and loaded from (``CHECKPOINT_FORMATS``)
    checkpoint_format: str
    #: parameter name -> fused-part ids loaded since the last finalize (vLLM does not check completeness)
    loaded: dict[str, set[Any]] = field(default_factory=dict)
    #: None until finalized; then :data:`LAYOUT_CT` or :data:`LAYOUT_REPACKED`
    layout: str | None = None
    #: ``kernel`` or ``torch`` (:func:`_choose_backend`); ``kernel`` keeps :data:`LAYOUT_CT` where repacking fails
    backend: str | None = None
    #: whether every fused part has the same global scale
    uniform_scale: bool = True
    #: per output column, the first part's global scale over the column's own (kernel path, mixed scales)
    col_scale: torch.Tensor | None = None


def _choose_backend(device: torch.device) -> str:
    """``kernel``: keep only the FP4 GEMM's repacked layout and run ``verl_qerl.kernels.linear``;
    ``torch``: keep the compressed-tensors layout and dequantize + ``F.linear``.

    ``QERL_NVFP4_BACKEND=kernel`` forces the repacked layout even without the CUDA extension (the
    kernels package then runs its torch reference on it): how the CPU tests cover that path.
    """
    wanted = os.environ.get(BACKEND_ENV, "auto").lower()
    if wanted not in ("auto", "torch", "kernel"):
        raise QeRLNvFp4Error(f"{BACKEND_ENV}={wanted!r}; expected auto, torch or kernel")
    if wanted in ("torch", "kernel"):
        return wanted
    if device.type != "cuda":
        return "torch"
    if not kernels.cuda_available():
        logger.warning("qerl_nvfp4: FP4 CUDA kernels unavailable (%s); using dequantize + F.linear",
                       kernels.cuda_unavailable_reason())
        return "torch"
    return "kernel"


def _shard_key(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    for key in ("loaded_shard_id", "shard_id"):
        if key in kwargs:
            return kwargs[key]
    return None


def _checkpoint_tensor(layer: torch.nn.Module, name: str, shard: Any, parts: list[str]) -> str:
    """The checkpoint tensor behind one load: ``q_proj.weight_packed`` for fused part ``'q'`` of ``qkv_proj``."""
    index = {"q": 0, "k": 1, "v": 2}.get(shard, shard) if shard is not None else None
    if len(parts) > 1 and isinstance(index, int) and 0 <= index < len(parts):
        return f"{parts[index]}.{name}"
    where = f" (fused part {shard!r})" if shard is not None else ""
    return f"{layer.qerl_state.prefix}.{name}{where}"


def _tracking(layer: torch.nn.Module, name: str, loader: Callable, parts: list[str] | None = None) -> Callable:
    """Wrap a weight loader to record which shard of which parameter arrived (vLLM does not check), to read
    U8-stored block scales as the E4M3 bits they are, and to name the tensor when its shape does not fit.

    ``parts``: the checkpoint modules behind the layer (``q_proj``, ``k_proj``, ``v_proj`` of a fused
    ``qkv_proj``), for messages.

    Some converters store ``weight_scale`` as U8 (safetensors has the E4M3 dtype, not every writer uses it);
    vLLM's loaders ``copy_`` into the float8 parameter, a numeric conversion (byte 0x38, E4M3 1.0, became
    56.0), so the weights came out wrong without an error. The training side reads them as bits too
    (:func:`verl_qerl.nvfp4.checkpoint.validate_nvfp4`). A tensor whose shape disagrees with config.json made
    vLLM fail with a bare ``AssertionError``; the message now names the tensor and both shapes.
    """

    @functools.wraps(loader)
    def load_and_record(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shard = _shard_key(args, kwargs)
        layer.qerl_state.loaded.setdefault(name, set()).add(shard)
        if loaded_weight.dtype == torch.uint8 and param.dtype == SCALE_DTYPE:
            loaded_weight = loaded_weight.view(SCALE_DTYPE)  # the stored bytes are E4M3 codes, not numbers
        try:
            return loader(param, loaded_weight, *args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except (AssertionError, RuntimeError) as err:
            # vLLM asserts equal shapes after its tensor-parallel narrowing; narrow / copy_ raise RuntimeErrors
            # mentioning sizes. Other RuntimeErrors (device faults) are not a checkpoint's doing: left as they are.
            if isinstance(err, RuntimeError) and "size" not in str(err):
                raise
            tensor = _checkpoint_tensor(layer, name, shard, parts or [layer.qerl_state.prefix])
            detail = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            raise QeRLNvFp4Error(
                f"{tensor}: the checkpoint tensor of shape {list(loaded_weight.shape)} does not fit the model's "
                f"parameter {layer.qerl_state.prefix}.{name} of shape {list(param.shape)} (this tensor-parallel "
                f"rank's rows of all fused parts; vLLM: {detail}): the checkpoint does not match its config.json "
                "(another model's weights, or a damaged conversion)") from err

    return load_and_record


def _replace(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, Parameter(value, requires_grad=False))


@register_weight_loader_v2_supported_method
class QeRLNvFp4LinearMethod(LinearMethodBase):
    """NVFP4-weight, BF16-activation linear layers for vLLM (``quantization="qerl_nvfp4"``)."""

    def __init__(self, config: QeRLNvFp4Config, prefix: str = "") -> None:
        self.config = config
        self.prefix = prefix

    # -- 1. parameters ----------------------------------------------------------------------------

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        fmt = self.config.checkpoint_format
        k = input_size_per_partition
        if k % BLOCK_SIZE != 0:
            raise QeRLNvFp4Error(f"{self.prefix}: input size per tensor-parallel rank K={k} (of {input_size}) is not "
                                 f"a multiple of the NVFP4 block size {BLOCK_SIZE}; use a smaller tensor-parallel "
                                 "size or leave this layer unquantized (ignore)")
        n = sum(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.qerl_state = QeRLLayerState(prefix=self.prefix, checkpoint_format=fmt)
        loader = extra_weight_attrs["weight_loader"]
        parts = self.config._shard_names(self.prefix)
        track = functools.partial(_tracking, layer, parts=parts)

        if fmt == FORMAT_BF16:
            weight = ModelWeightParameter(data=torch.empty(n, k, dtype=params_dtype), input_dim=1, output_dim=0,
                                          weight_loader=track("weight", loader))
            layer.register_parameter("weight", weight)
            return

        packed_name, scale_name, gscale_name = LAYOUT_TENSOR_NAMES[fmt]
        layer.register_parameter(packed_name, ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0,
            weight_loader=track(packed_name, loader)))
        layer.register_parameter(scale_name, GroupQuantScaleParameter(
            data=torch.empty(n, k // BLOCK_SIZE, dtype=SCALE_DTYPE), input_dim=1, output_dim=0,
            weight_loader=track(scale_name, loader)))
        # One slot per fused part (q/k/v, gate/up): vLLM writes each part's scalar into its slot.
        layer.register_parameter(gscale_name, PerTensorScaleParameter(
            data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32),
            weight_loader=track(gscale_name, loader)))
        for name in _PLACEHOLDERS[fmt]:  # W4A4 checkpoints carry input scales; Qwen2/Llama loaders need a target
            layer.register_parameter(name, PerTensorScaleParameter(
                data=torch.empty(len(output_partition_sizes), dtype=torch.float32), weight_loader=loader))

    # -- 3. after loading ------------------------------------------------------------------------

    def _check_loaded(self, layer: torch.nn.Module, names: tuple[str, ...]) -> None:
        parts = len(layer.logical_widths)
        state: QeRLLayerState = layer.qerl_state
        for name in names:
            seen = state.loaded.get(name, set())
            if None in seen or len(seen) >= parts:
                continue
            if not seen:
                detail = "was not in the checkpoint"
            else:
                detail = f"arrived only for fused part(s) {sorted(map(str, seen))} of {parts}"
            raise QeRLNvFp4Error(f"{state.prefix}.{name} {detail}: the checkpoint is incomplete "
                                 f"(format {state.checkpoint_format})")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        state: QeRLLayerState = layer.qerl_state
        if state.layout is not None and not state.loaded:
            # Already finalized and nothing loaded since: a second pass over the whole model (verl runs
            # one after a full, non-LoRA weight sync) must leave the quantized layer alone.
            return
        fmt = state.checkpoint_format
        if fmt == FORMAT_BF16:
            self._check_loaded(layer, ("weight",))
            packed, scale, gscale = self._quantize_bf16(layer)
            del layer.weight
        else:
            names = LAYOUT_TENSOR_NAMES[fmt]
            self._check_loaded(layer, names)
            packed_name, scale_name, gscale_name = names
            packed = getattr(layer, packed_name).data
            scale = getattr(layer, scale_name).data
            raw = getattr(layer, gscale_name).data.to(torch.float32)
            # ModelOpt stores the multiplier amax/2688; we keep compressed-tensors' divisor 2688/amax.
            gscale = torch.reciprocal(raw) if fmt == FORMAT_MODELOPT else raw
            bad = ~(torch.isfinite(gscale) & (gscale > 0))
            if bool(bad.any()):
                raise QeRLNvFp4Error(f"{state.prefix}.{gscale_name}: global scale(s) {raw.tolist()} are not "
                                     "finite and positive")
            problem = block_scale_problem(scale) if scale.dtype in (SCALE_DTYPE, torch.uint8) else None
            if problem is None and bool(torch.isnan(scale.to(torch.float32)).any()):
                problem = "block scales contain NaN"
            if problem:
                raise QeRLNvFp4Error(f"{state.prefix}.{scale_name}: {problem}")
            for name in (*names, *_PLACEHOLDERS[fmt]):
                if hasattr(layer, name):
                    delattr(layer, name)
        self._finalize(layer, packed.contiguous(), scale.contiguous(), gscale.contiguous())
        state.loaded = {}  # a later layerwise reload records afresh

    @torch.no_grad()
    def _quantize_bf16(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize the loaded weight as ``qerl-quantize`` would: one global scale per fused group."""
        w = layer.weight.data
        prefix = layer.qerl_state.prefix
        bounds = torch.tensor([0, *layer.logical_widths]).cumsum(0).tolist()
        amax = torch.stack([w[a:b].abs().amax().to(torch.float32) for a, b in zip(bounds[:-1], bounds[1:])])
        compat.tp_all_reduce_max(amax)  # each rank holds a slice; the scale is that of the whole weight
        if not bool(torch.isfinite(amax).all()):
            raise QeRLNvFp4Error(f"{prefix}.weight: contains NaN/Inf; refusing to quantize")
        rule = self.config.scale_rule
        gscale = global_scale_from_amax(amax.max(), rule)  # == verl_qerl.nvfp4.fused_global_scale, bit for bit
        packed_rows, scale_rows = [], []
        for start in range(0, w.shape[0], _QUANT_ROWS):
            q = quantize(w[start:start + _QUANT_ROWS], gscale, name=f"{prefix}.weight", rule=rule)
            packed_rows.append(q.packed)
            scale_rows.append(q.scale)
        return torch.cat(packed_rows), torch.cat(scale_rows), gscale.to(w.device)

    def _finalize(self, layer: torch.nn.Module, packed: torch.Tensor, scale: torch.Tensor,
                  gscale: torch.Tensor) -> None:
        """Canonical parameters, per-part scale bookkeeping, and the FP4 kernel's own layout where it runs."""
        widths = layer.logical_widths
        state: QeRLLayerState = layer.qerl_state
        uniform = bool((gscale == gscale[0]).all())
        state.uniform_scale = uniform
        state.col_scale = None
        if not uniform:
            logger.info("qerl_nvfp4: %s has per-part global scales %s; kept exact per part",
                        state.prefix, gscale.tolist())
            ratio = (gscale[0] / gscale).to(torch.float32)  # y_part = y(g0) * g0 / g_part
            state.col_scale = torch.repeat_interleave(ratio, torch.tensor(widths, device=ratio.device))
        _replace(layer, "weight_global_scale", gscale[:1].clone() if uniform else gscale.clone())
        state.backend = _choose_backend(packed.device)
        state.layout = LAYOUT_CT
        if state.backend == "kernel":
            try:
                repacked = kernels.repack(packed, scale)
            except kernels.LayoutError as exc:
                logger.warning("qerl_nvfp4: %s cannot use the FP4 GEMM layout (%s); dequantize + F.linear",
                               state.prefix, exc)
            else:
                # Only the kernel layout is kept (no second copy of the weight). ``weight_packed`` keeps
                # its name for vLLM's LoRA wrappers, which only read its device.
                packed, scale = repacked.qweight, repacked.qscale
                state.layout = LAYOUT_REPACKED
        _replace(layer, "weight_packed", packed)
        _replace(layer, "weight_scale", scale)

    # -- 4. forward -------------------------------------------------------------------------------

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        state: QeRLLayerState = layer.qerl_state
        if state.layout == LAYOUT_REPACKED:
            return self._apply_repacked(layer, x, bias)
        if state.uniform_scale:
            return kernels.linear(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, bias)
        return F.linear(x, self.dequantized_weight(layer, x.dtype), bias)

    @staticmethod
    def _apply_repacked(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        repacked = kernels.RepackedWeight(layer.weight_packed, layer.weight_scale)
        n = layer.output_size_per_partition
        g = layer.weight_global_scale[:1]
        col_scale = layer.qerl_state.col_scale
        pdl = kernels.pdl_enabled()  # the forward never writes weights: the decode GEMMs may overlap the kernel before
        if col_scale is None:
            return kernels.linear(x, None, None, g, bias, kernel_weight=repacked, n=n, pdl=pdl)
        y = kernels.linear(x, None, None, g, None, kernel_weight=repacked, n=n, pdl=pdl)
        y = (y.to(torch.float32) * col_scale).to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)

    # -- 5. forward with a LoRA expand in the GEMM's epilogue (verl_qerl.vllm.lora_fast_path) -------------------

    @staticmethod
    def lora_epilogue_supported(layer: torch.nn.Module) -> bool:
        """Whether :meth:`apply_with_lora` can serve this layer: the kernel layout with one global scale (per-part
        scales rescale the GEMM's columns after it, which a LoRA term added inside the GEMM must not see)."""
        state: QeRLLayerState = layer.qerl_state
        return state.layout == LAYOUT_REPACKED and state.col_scale is None

    @staticmethod
    def apply_with_lora(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                        shrunk: torch.Tensor | None, lora_b: torch.Tensor, mask: torch.Tensor, slice_bounds: list[int],
                        lora_a: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`apply` plus ``mask * expand(shrunk, lora_b)`` as one op (:func:`verl_qerl.kernels.linear_lora`),
        given the shrink's output ``shrunk`` or (``shrunk=None``) the concatenated A ``lora_a``, whose shrink the op
        then runs itself (inside the GEMM's launch at decode M); x is [T, K]. Only for layers where
        :meth:`lora_epilogue_supported` holds."""
        repacked = kernels.RepackedWeight(layer.weight_packed, layer.weight_scale)
        return kernels.linear_lora(x, layer.weight_global_scale[:1], bias, kernel_weight=repacked,
                                   n=layer.output_size_per_partition, shrunk=shrunk, lora_a=lora_a, lora_b=lora_b,
                                   mask=mask, slice_bounds=slice_bounds, pdl=kernels.pdl_enabled())

    @staticmethod
    def canonical_nvfp4(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed uint8 [N, K/2], E4M3 scale [N, K/16], global scale divisor(s)) whatever the stored layout."""
        if layer.qerl_state.layout == LAYOUT_REPACKED:
            n = layer.output_size_per_partition
            packed = pack_fp4(kernels.layout.unrepack_codes(layer.weight_packed, n))
            scale = kernels.layout.unrepack_scales(layer.weight_scale, n).to(SCALE_DTYPE)
            return packed, scale, layer.weight_global_scale
        return layer.weight_packed, layer.weight_scale, layer.weight_global_scale

    @classmethod
    def dequantized_weight(cls, layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight as NVFP4 represents it, [N, K] in ``dtype`` (each fused part with its own scale)."""
        packed, scale, gscale = cls.canonical_nvfp4(layer)
        if layer.qerl_state.uniform_scale:
            return dequantize(packed, scale, gscale, dtype)
        parts, start = [], 0
        for i, width in enumerate(layer.logical_widths):
            rows = slice(start, start + width)
            parts.append(dequantize(packed[rows], scale[rows], gscale[i:i + 1], dtype))
            start += width
        return torch.cat(parts)
