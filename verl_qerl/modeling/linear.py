"""``NVFP4Linear``: a frozen NVFP4 linear layer whose quantized state lives in uint8 buffers only.

Why buffers, and why uint8 (each point below was observed on 2xH200 with torch 2.11):

* integer Parameters break FSDP1 ("Cannot flatten integer dtype tensors") and FSDP2 ("only
  Tensors of floating point dtype can require gradients");
* an FP8 Parameter is all-gathered as bf16 by FSDP2 mixed precision, and FSDP1 casts floating
  buffers (FP8 included) to its ``buffer_dtype``;
* ``Module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` cast every floating buffer too.

So the packed E2M1 codes, the E4M3 block scales *and* the FP32 global scale are all stored as
uint8: the scales as a byte view of their float8_e4m3fn values, the global scale as its 4 bytes.
No framework casts uint8, and every read reinterprets the bytes (``Tensor.view(dtype)``), which is
free. There is deliberately no float ``weight``: the whole point is never to hold a BF16 copy. The
dense weight exists only inside one op (forward, or the input-gradient in backward) and is freed
when that op returns.

Under FSDP2 the two large tensors (codes and block scales) can instead be frozen uint8
*Parameters* (:meth:`NVFP4Linear.store_as_parameters`, called by
:func:`verl_qerl.modeling.fsdp.shard_nvfp4_base`): FSDP2 row-shards them like any parameter and
all-gathers them as raw bytes, which is exact. An integer Parameter is fine there as long as it is
frozen, sits in an FSDP2 unit of its own whose mixed-precision policy casts nothing (FSDP2 casts a
unit's parameters to ``param_dtype`` before the all-gather, and torch 2.11, the GPU stack, does so
even for integer dtypes), and is handed to ``fully_shard`` by ``shard_nvfp4_base``, which works
around torch 2.11's construction of the sharded parameter. The global scale (4 bytes) stays a
replicated buffer.

The bias (Qwen2 q/k/v have one) stays an ordinary frozen float ``nn.Parameter``, like
``nn.Linear``'s: it then follows ``model.to(dtype)`` and FSDP mixed precision like the other frozen
parameters of the unit (norm weights), which keeps FSDP1's one-dtype-per-flat-parameter rule.
(Under ``shard_nvfp4_base`` it is gathered with the codes in its stored dtype and cast to the
input's dtype inside the op: the same rounding as a mixed-precision cast.)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from ..nvfp4 import BLOCK_SIZE, DEFAULT_SCALE_RULE, SCALE_DTYPE, NVFP4FormatError, NVFP4Weight, quantize
from ..nvfp4.format import CT_WEIGHT_GLOBAL_SCALE, CT_WEIGHT_PACKED, CT_WEIGHT_SCALE
from . import _ops

#: Elements quantized at a time by :func:`quantize_rows` (whole rows): bounds the float32 temporaries of
#: quantization (a few copies of the chunk) to ~64 MiB each, whatever the layer size. Read at each call,
#: so tests can lower it to run the chunked path on small layers.
QUANTIZE_CHUNK_ELEMENTS = 1 << 24


class _NVFP4LinearFunction(torch.autograd.Function):
    """``y = x @ dequant(W).T + b`` with the input gradient computed by dequantizing W again.

    Only the (uint8) quantized tensors are saved for backward; the dense weight of the forward is
    freed as soon as the forward op returns. The base weight gets no gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        b = bias.to(x.dtype) if bias is not None and bias.dtype != x.dtype else bias
        y = _ops.linear(x, packed, scale, global_scale, b)
        if y._base is not None:
            # A 3-D input comes back as a view of the 2-D GEMM output. Nothing else holds that
            # output, so drop the view relation (no copy): FSDP2 hooks the layer's output for its
            # pre-backward all-gather, and hooks on a view can be lost to a later in-place op.
            y = torch.ops.aten._unsafe_view(y, y.shape)
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        packed, scale, global_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = _ops.dequantize(packed, scale, global_scale, grad_out.dtype)
            grad_x = (grad_out @ w).to(ctx.x_dtype)
            del w
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, None, grad_bias


class NVFP4Linear(nn.Module):
    """A frozen linear layer stored in NVFP4 (compressed-tensors NVFP4A16 numbers, uint8 storage).

    Buffers (all uint8, all persistent):

    * ``weight_packed`` [N, K/2]: two E2M1 codes per byte, even element in the low nibble;
    * ``weight_scale`` [N, K/16]: the float8_e4m3fn block scales, as bytes;
    * ``weight_global_scale`` [4]: the fp32 per-tensor divisor ``448*6/amax``, as bytes.

    ``forward(x)`` computes in ``x.dtype``. ``compute_dtype`` (the dtype the replaced layer had, or
    the bias dtype) tells peft which dtype to create LoRA adapters in; ``qweight`` exposes the
    packed buffer so that peft finds the layer's device.
    """

    in_features: int
    out_features: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if in_features % BLOCK_SIZE != 0 or in_features <= 0:
            raise NVFP4FormatError(
                f"NVFP4Linear: in_features={in_features} must be a positive multiple of the block size {BLOCK_SIZE}"
            )
        if out_features <= 0:
            raise NVFP4FormatError(f"NVFP4Linear: out_features={out_features} must be positive")
        if not dtype.is_floating_point:
            raise TypeError(f"NVFP4Linear: compute dtype must be a float dtype, got {dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self._compute_dtype = dtype
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, **u8))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK_SIZE, **u8))
        one = torch.ones(1, dtype=torch.float32, device=device)
        self.register_buffer("weight_global_scale", one.view(torch.uint8).clone())
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # ----------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_nvfp4(
        cls,
        weight: NVFP4Weight,
        bias: torch.Tensor | None = None,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        name: str | None = None,
    ) -> NVFP4Linear:
        """A layer holding ``weight`` (e.g. from ``CheckpointReader.read_nvfp4``) and an optional bias; ``name``
        (the module's name in its model) is what an error about the tensors names."""
        where = name or "NVFP4Linear.from_nvfp4"
        n, k = _check_nvfp4(weight, where)
        device = device if device is not None else weight.packed.device
        layer = cls(k, n, bias=bias is not None, device="meta", dtype=dtype)
        layer.set_nvfp4(weight, device=device, name=where)
        if bias is not None:
            if tuple(bias.shape) != (n,):
                raise NVFP4FormatError(f"NVFP4Linear: bias shape {tuple(bias.shape)} does not match out_features={n}")
            layer.bias = nn.Parameter(bias.detach().to(device=device, dtype=dtype), requires_grad=False)
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        global_scale: torch.Tensor | None = None,
        *,
        name: str = "linear",
        weight: torch.Tensor | None = None,
        scale_rule: str = DEFAULT_SCALE_RULE,
    ) -> NVFP4Linear:
        """Quantize an ``nn.Linear`` (round to nearest even; ``global_scale`` for fused groups).

        ``weight`` overrides ``linear.weight`` (used when the weight comes from a checkpoint and
        the module is an empty shell). Rows are quantized in chunks so the float32 temporaries stay
        small; quantization is row-independent given the global scale, so chunking is exact.
        ``scale_rule``: see ``verl_qerl.nvfp4.SCALE_RULES``.
        """
        w = linear.weight if weight is None else weight
        if w.is_meta:
            raise NVFP4FormatError(f"{name}.weight: is on the meta device (no data to quantize); "
                                   "load the model's weights first or pass checkpoint= to quantize_model")
        dtype = w.dtype if w.dtype.is_floating_point else torch.bfloat16
        q = quantize_rows(w, global_scale, name=f"{name}.weight", scale_rule=scale_rule)
        bias = linear.bias
        if bias is not None and bias.is_meta:
            raise NVFP4FormatError(f"{name}.bias: is on the meta device (no data)")
        return cls.from_nvfp4(q, bias, dtype=dtype, device=w.device, name=name)

    def set_nvfp4(self, weight: NVFP4Weight, *, device: torch.device | str | None = None,
                  name: str | None = None) -> None:
        """Replace the quantized state with ``weight``'s tensors as uint8, once their dtypes and shapes are checked
        (:func:`_check_nvfp4`) against each other and the layer: nothing is stored from a malformed weight.
        ``name``: what an error names (default ``NVFP4Linear.set_nvfp4``)."""
        n, k = _check_nvfp4(weight, name or "NVFP4Linear.set_nvfp4")
        if (n, k) != (self.out_features, self.in_features):
            raise NVFP4FormatError(
                f"NVFP4Linear: weight is [{n}, {k}] but the layer is [{self.out_features}, {self.in_features}]"
                + (f" ({name})" if name else "")
            )
        device = device if device is not None else weight.packed.device
        scale = weight.scale.view(torch.uint8) if weight.scale.dtype == SCALE_DTYPE else weight.scale
        gs = weight.global_scale.detach().to(torch.float32).reshape(1).contiguous()
        self._set_stored("weight_packed", weight.packed.detach().to(device=device, dtype=torch.uint8).contiguous())
        self._set_stored("weight_scale", scale.detach().to(device=device).contiguous())
        self.weight_global_scale = gs.view(torch.uint8).to(device).clone()

    def _set_stored(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._parameters:  # stored as a frozen Parameter (see store_as_parameters)
            if _is_dtensor(self._parameters[name]):
                raise NVFP4FormatError(f"NVFP4Linear.{name}: the layer is sharded by FSDP2; load a state dict "
                                       "through FSDP (set_model_state_dict) instead of set_nvfp4")
            self._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        else:
            setattr(self, name, tensor)

    # ----------------------------------------------------------------------------------------
    # FSDP2 sharding

    #: The stored tensors: compressed-tensors' names, so the state dict holds a checkpoint's tensors.
    STORED = (CT_WEIGHT_PACKED, CT_WEIGHT_SCALE, CT_WEIGHT_GLOBAL_SCALE)

    #: The stored tensors that :meth:`store_as_parameters` turns into Parameters (row-shardable).
    SHARDABLE = STORED[:2]

    def store_as_parameters(self) -> None:
        """Hold ``weight_packed`` and ``weight_scale`` as frozen uint8 Parameters instead of buffers.

        Same names, shapes, dtypes and bytes, so the state dict is unchanged (keys, order, values);
        only FSDP2 sees a difference: it shards parameters, never buffers. Idempotent. Used by
        :func:`verl_qerl.modeling.fsdp.shard_nvfp4_base` right before ``fully_shard``; the module
        must then be its own FSDP2 unit with a policy that casts nothing (see the module docstring).
        """
        for name in self.SHARDABLE:
            if name in self._parameters:
                continue
            tensor = self._buffers.pop(name)
            self._non_persistent_buffers_set.discard(name)
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    @property
    def stores_parameters(self) -> bool:
        """Whether the codes and block scales are Parameters (FSDP2-shardable) rather than buffers."""
        return all(name in self._parameters for name in self.SHARDABLE)

    @property
    def is_sharded(self) -> bool:
        """Whether FSDP2 holds only this rank's rows right now (outside this layer's forward/backward)."""
        return _is_dtensor(self.weight_packed)

    # ----------------------------------------------------------------------------------------
    # views of the stored state

    @property
    def global_scale(self) -> torch.Tensor:
        """The fp32 [1] global scale (divisor), a view of the stored bytes."""
        return self.weight_global_scale.view(torch.float32)

    @property
    def scale_fp8(self) -> torch.Tensor:
        """The float8_e4m3fn [N, K/16] block scales, a view of the stored bytes."""
        return self.weight_scale.view(SCALE_DTYPE)

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes. peft looks up ``weight`` then ``qweight`` to find a layer's device."""
        return self.weight_packed

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype for LoRA adapters on this layer (peft reads ``compute_dtype``, as for bnb layers)."""
        return self.bias.dtype if self.bias is not None else self._compute_dtype

    @property
    def device(self) -> torch.device:
        return self.weight_packed.device

    def _require_full(self, what: str) -> None:
        if self.is_sharded:
            raise NVFP4FormatError(
                f"NVFP4Linear.{what}: the layer is sharded by FSDP2 (this rank holds only its rows of weight_packed "
                "and weight_scale); gather a full state dict (torch.distributed.checkpoint.state_dict."
                "get_model_state_dict with full_state_dict=True) and load it into an unsharded model first")

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense [N, K] weight (a new tensor; for export and tests, never kept by the layer)."""
        self._require_full("dequantize_weight")
        return _ops.dequantize(self.weight_packed, self.weight_scale, self.global_scale, dtype or self.compute_dtype)

    # ----------------------------------------------------------------------------------------
    # nn.Module plumbing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear: input has {x.shape[-1]} features, expected {self.in_features}")
        if self.is_sharded:  # FSDP2's pre-forward hook gathers the rows; a direct call bypassed it
            raise RuntimeError("NVFP4Linear: called while sharded by FSDP2 (weight_packed is a DTensor); call it "
                               "through its FSDP2 module so that the rows are all-gathered first")
        return _NVFP4LinearFunction.apply(x, self.weight_packed, self.weight_scale, self.global_scale, self.bias)

    def _apply(self, fn: Any, recurse: bool = True) -> NVFP4Linear:
        # Follow dtype conversions of the module (``model.to(torch.float32)``, ``.half()``) in the
        # compute dtype, as they would convert an ``nn.Linear``'s weight; probe ``fn`` on a scalar.
        super()._apply(fn, recurse)
        try:
            probe = fn(torch.zeros((), dtype=self._compute_dtype))
        except Exception:  # noqa: BLE001 - fn may not accept a CPU scalar (device-only moves): keep dtype
            return self
        if isinstance(probe, torch.Tensor) and probe.dtype.is_floating_point:
            self._compute_dtype = probe.dtype
        return self

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # Accept the on-disk compressed-tensors dtypes too (fp8 block scales, fp32 [1] divisor).
        key = prefix + "weight_scale"
        if key in state_dict and state_dict[key].dtype == SCALE_DTYPE:
            state_dict[key] = state_dict[key].view(torch.uint8)
        key = prefix + "weight_global_scale"
        if key in state_dict and state_dict[key].dtype == torch.float32:
            state_dict[key] = state_dict[key].reshape(1).contiguous().view(torch.uint8)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"


def _check_nvfp4(weight: NVFP4Weight, where: str) -> tuple[int, int]:
    """The [N, K] of ``weight`` once its tensors fit together: ``packed`` uint8 [N, K/2], ``scale`` float8_e4m3fn
    (or its uint8 bytes) [N, K/16], ``global_scale`` one float value; else an NVFP4FormatError naming ``where`` and
    the tensor. Dtypes and shapes only (no values read: no device sync, meta tensors pass).

    Why: a scale of the wrong shape or dtype was stored as it was, so the layer and its state dict held it and the
    error came only at the first forward, naming neither the layer nor the tensor."""
    packed, scale, gs = weight.packed, weight.scale, weight.global_scale
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NVFP4FormatError(f"{where}: weight.packed must be uint8 [N, K/2], got {packed.dtype} "
                               f"{tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if scale.dtype not in (SCALE_DTYPE, torch.uint8) or tuple(scale.shape) != (n, k // BLOCK_SIZE):
        raise NVFP4FormatError(f"{where}: weight.scale must be float8_e4m3fn (or its uint8 bytes) [N, K/16] = "
                               f"[{n}, {k // BLOCK_SIZE}] for the packed [{n}, {k}/2], got {scale.dtype} "
                               f"{tuple(scale.shape)}")
    if gs.numel() != 1 or not gs.dtype.is_floating_point:
        raise NVFP4FormatError(f"{where}: weight.global_scale must hold one float value (the fp32 divisor), got "
                               f"{gs.dtype} {tuple(gs.shape)}")
    return n, k


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def quantize_rows(
    weight: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    name: str = "weight",
    chunk_elements: int | None = None,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> NVFP4Weight:
    """:func:`verl_qerl.nvfp4.quantize`, row-chunked so temporaries stay ~``chunk_elements`` floats
    (default :data:`QUANTIZE_CHUNK_ELEMENTS`)."""
    if chunk_elements is None:
        chunk_elements = QUANTIZE_CHUNK_ELEMENTS
    if global_scale is None:
        from ..nvfp4 import compute_global_scale

        global_scale = compute_global_scale(weight, name, scale_rule)
    if weight.dim() != 2 or weight.shape[0] * weight.shape[1] <= chunk_elements:
        return quantize(weight, global_scale, name=name, rule=scale_rule)
    rows = max(1, chunk_elements // weight.shape[1])
    parts = [quantize(weight[i : i + rows], global_scale, name=name, rule=scale_rule)
             for i in range(0, weight.shape[0], rows)]
    scale = torch.cat([p.scale.view(torch.uint8) for p in parts]).view(SCALE_DTYPE)
    return NVFP4Weight(torch.cat([p.packed for p in parts]), scale, parts[0].global_scale)
