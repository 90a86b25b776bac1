"""The trainable QeRL policy: frozen NVFP4 linear layers + peft LoRA, and the BF16 / NF4 baselines.

Typical use (what verl's FSDP engine does, via the plugin's patch of ``_build_lora_module``)::

    model = AutoModelForCausalLM.from_pretrained(bf16_path, dtype=torch.bfloat16)
    quantize_model(model, mode="nvfp4")            # or: load_nvfp4_model(nvfp4_path)
    model = get_lora_model(model, r=32, lora_alpha=64)
    ...train...
    model.save_pretrained(adapter_dir)              # peft's usual adapter files
    export_merged(model, out_dir, dtype="bf16")    # dequant(W) + BA as a HF checkpoint

peft is imported lazily (only the LoRA and export helpers need it).
"""

from __future__ import annotations

from typing import Any

from ._ops import backend as kernel_backend
from .linear import NVFP4Linear, quantize_rows
from .model_conversion import (
    MODES,
    ModelConversionError,
    fill_meta_from_checkpoint,
    load_nvfp4_model,
    params_on_meta,
    quantize_model,
)

_LAZY = {
    "export_merged": ".export",
    "DEFAULT_LORA_TARGETS": ".lora",
    "NVFP4LoraLinear": ".lora",
    "NVFP4MergeError": ".lora",
    "get_lora_model": ".lora",
    "load_lora_adapter": ".lora",
    "nvfp4_lora_config": ".lora",
    "peft_custom_modules": ".lora",
    "register_nvfp4_lora": ".lora",
    "resolve_target_modules": ".lora",
    "NF4UnavailableError": ".nf4",
    "shard_nvfp4_base": ".fsdp",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MODES",
    "ModelConversionError",
    "NVFP4Linear",
    "fill_meta_from_checkpoint",
    "kernel_backend",
    "load_nvfp4_model",
    "params_on_meta",
    "quantize_model",
    "quantize_rows",
    *_LAZY,
]
