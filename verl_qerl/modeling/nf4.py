"""The QLoRA baseline: bitsandbytes NF4 ``Linear4bit`` layers (double quantization, as QLoRA).

Kept behind ``quantize_model(model, mode="nf4")`` so NVFP4, BF16 and NF4 runs share one code
path. bitsandbytes is optional: it is imported only here, and a missing package or device
support gives a message that says so instead of an import error deep in peft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn


class NF4UnavailableError(RuntimeError):
    """bitsandbytes (or its support for the model's device) is missing."""


def _bitsandbytes():
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise NF4UnavailableError(
            "mode='nf4' (the QLoRA baseline) needs bitsandbytes: pip install 'bitsandbytes>=0.45' "
            f"(import failed: {exc})") from exc
    return bnb


def convert_to_nf4(
    model: nn.Module,
    names: list[str],
    *,
    compute_dtype: torch.dtype | None = None,
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
) -> nn.Module:
    """Replace the named ``nn.Linear`` layers by NF4 ``Linear4bit`` one at a time (peak: one layer)."""
    bnb = _bitsandbytes()
    wrap = progress or (lambda it, total, desc: it)
    for name in wrap(names, len(names), "quantize NF4"):
        lin = model.get_submodule(name)
        w = lin.weight.detach()
        if w.is_meta:
            raise NF4UnavailableError(f"{name}.weight is on the meta device: load the weights before mode='nf4'")
        dtype = compute_dtype or (w.dtype if w.dtype.is_floating_point else torch.bfloat16)
        new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                compute_dtype=dtype, compress_statistics=True, quant_type="nf4", device="meta")
        try:
            new.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                           module=new).to(w.device)
        except Exception as exc:  # noqa: BLE001 - bnb raises many types for a missing backend
            raise NF4UnavailableError(
                f"bitsandbytes could not quantize {name}.weight on {w.device.type} ({type(exc).__name__}: {exc}); "
                "mode='nf4' is meant for CUDA: move the model to the GPU first") from exc
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.detach().to(dtype), requires_grad=False)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        del lin, w
    # peft picks its bitsandbytes LoRA layer only for models flagged like transformers' 4-bit loads.
    model.is_loaded_in_4bit = True
    return model
