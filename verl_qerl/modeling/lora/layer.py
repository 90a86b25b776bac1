"""peft LoRA layer for :class:`~verl_qerl.modeling.linear.NVFP4Linear` (registered as a custom module).

peft only wraps layer types it knows; ``LoraConfig._register_custom_module({NVFP4Linear:
NVFP4LoraLinear})`` teaches it ours. The layer follows peft's tuner conventions (a ``LoraLayer``
with ``lora_A``/``lora_B`` ``ModuleDict``s of ``nn.Linear``), so ``get_peft_model_state_dict`` key
names (``...q_proj.lora_A.weight``), adapter save/load and ``disable_adapter()`` are exactly
peft's, and vLLM parses the adapters like any other.

What differs from peft's dense ``Linear``: the base has no float ``weight``, so

* merging is refused (W + BA is not representable in the frozen NVFP4 grid without
  re-quantizing, which would silently change the base every step); use
  :func:`verl_qerl.modeling.export_merged` to write dequant(W) + BA as a new checkpoint;
* initializations that read the base weight (PiSSA, CorDA, OLoRA, LoftQ, ...) and variants
  (DoRA, ...) are refused up front with a message naming them, instead of failing deep inside peft.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from peft.tuners.lora import LoraConfig, LoraLayer, LoraModel

from ..linear import NVFP4Linear

#: ``init_lora_weights`` values that need the dense base weight.
_WEIGHT_INITS = ("pissa", "corda", "olora", "loftq", "orthogonal", "lora_ga", "mica", "eva")


class NVFP4MergeError(RuntimeError):
    """Raised when asked to merge LoRA into a frozen NVFP4 base layer."""


MERGE_REFUSED = (
    "cannot merge LoRA into an NVFP4 base layer: W + B@A is not representable in the frozen FP4 grid "
    "without re-quantizing the base. Keep adapters unmerged (verl: lora.merge=False, the default), or "
    "write a merged checkpoint with verl_qerl.modeling.export_merged(model, out_dir, dtype='bf16'|'nvfp4')."
)


def lora_delta(layer: LoraLayer, adapter: str) -> torch.Tensor:
    """``scaling * B @ A`` of one adapter of a peft LoRA layer, in float32.

    The one definition of the LoRA weight delta: :meth:`NVFP4LoraLinear.get_delta_weight` returns it
    and :func:`verl_qerl.modeling.export_merged` adds it to the dequantized (or dense) base weight.
    """
    a = layer.lora_A[adapter].weight.float()
    b = layer.lora_B[adapter].weight.float()
    return (b @ a) * layer.scaling[adapter]


class NVFP4LoraLinear(nn.Module, LoraLayer):
    """LoRA adapters around a frozen ``NVFP4Linear``: ``y = base(x) + sum_a scale_a * B_a(A_a(drop(x)))``."""

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: LoraConfig,
        r: int = 0,
        lora_alpha: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        if not isinstance(self.get_base_layer(), NVFP4Linear):
            raise TypeError(f"NVFP4LoraLinear wraps NVFP4Linear, got {type(self.get_base_layer()).__name__}")
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        # peft's generic lookup warns "Unsupported layer type" for custom modules; we know ours.
        return module.in_features, module.out_features

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs: Any) -> None:
        init = config.init_lora_weights
        if isinstance(init, str) and any(init.lower().startswith(w) for w in _WEIGHT_INITS):
            raise ValueError(f"init_lora_weights={init!r} needs the dense base weight, which an NVFP4 layer does "
                             "not keep; use True (default) or 'gaussian'")
        try:
            super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        except ValueError as exc:
            if "variant" in str(exc):
                raise ValueError(f"LoRA variants (DoRA, aLoRA, ...) are not supported on NVFP4 layers: {exc}") from exc
            raise

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NVFP4MergeError(MERGE_REFUSED)

    def unmerge(self) -> None:
        warnings.warn("NVFP4LoraLinear: nothing to unmerge (NVFP4 layers never merge)", stacklevel=2)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``scaling * B @ A`` in float32: what a merge would add (see :func:`lora_delta`)."""
        return lora_delta(self, adapter)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if self.disable_adapters:
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        result_dtype = result.dtype
        for active in self.active_adapters:
            if active not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[active], self.lora_B[active]
            xa = self._cast_input_dtype(x, lora_a.weight.dtype)
            result = result + lora_b(lora_a(self.lora_dropout[active](xa))) * self.scaling[active]
        return result.to(result_dtype)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def refuse_merge_up_front() -> None:
    """Make peft refuse a merge of a model with NVFP4 LoRA layers before it merges anything.

    ``merge_and_unload`` and ``merge_adapter`` merge layer by layer in module order, after one call
    to ``LoraModel._check_merge_allowed``. :meth:`NVFP4LoraLinear.merge` refuses only when its turn
    comes: layers kept in BF16 (``ignore=``) ahead of the first NVFP4 layer would already have been
    merged and unwrapped. The check is extended (once, for every ``LoraModel``) to look for NVFP4
    layers first; models without them are unaffected.
    """
    original = LoraModel._check_merge_allowed
    if getattr(original, "_refuses_nvfp4", False):
        return

    def _check_merge_allowed(self: LoraModel) -> None:
        nvfp4 = [name for name, module in self.model.named_modules() if isinstance(module, NVFP4LoraLinear)]
        if nvfp4:
            more = f" and {len(nvfp4) - 1} more" if len(nvfp4) > 1 else ""
            raise NVFP4MergeError(f"{MERGE_REFUSED} NVFP4 layer(s) with adapters: {nvfp4[0]}{more}; nothing was "
                                  "merged.")
        original(self)

    _check_merge_allowed._refuses_nvfp4 = True  # type: ignore[attr-defined]
    LoraModel._check_merge_allowed = _check_merge_allowed  # type: ignore[method-assign]


refuse_merge_up_front()
