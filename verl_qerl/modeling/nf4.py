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
    """Replace the named ``nn.Linear`` layers by NF4 ``Linear4bit`` one at a time (peak: one layer).

    A refused conversion leaves the model as it was (the nvfp4 mode's rule) wherever it can be foreseen: every layer
    is checked first (:func:`_check_layers`), and a bitsandbytes backend that cannot quantize on the weights' device
    fails on the first layer, before any is replaced. (The replaced layers are not kept for a rollback of a failure
    further on: that would hold the dense model and its NF4 copy at once.)
    """
    bnb = _bitsandbytes()
    _check_layers(model, names)
    wrap = progress or (lambda it, total, desc: it)
    for name in wrap(names, len(names), "quantize NF4"):
        _set_module(model, name, _nf4_layer(bnb, model.get_submodule(name), name, compute_dtype))
    # peft picks its bitsandbytes LoRA layer only for models flagged like transformers' 4-bit loads.
    model.is_loaded_in_4bit = True
    return model


def _check_layers(model: nn.Module, names: list[str]) -> None:
    """Refuse, naming the tensor, any layer mode='nf4' cannot quantize: a weight or bias on the meta device (no
    data), a weight that is not a float of 16 bits or more, or one holding NaN/Inf (bitsandbytes took it and every
    logit came out NaN). All are checked before the first layer is replaced."""
    from .model_conversion import ModelConversionError

    for name in names:
        lin = model.get_submodule(name)
        w, bias = lin.weight, lin.bias
        for what, t in (("weight", w), ("bias", bias)):
            if t is not None and t.is_meta:
                raise ModelConversionError(f"quantize_model: {name}.{what} is on the meta device (no data to "
                                           "quantize): load the weights before mode='nf4'")
        if not w.dtype.is_floating_point or w.dtype.itemsize < 2:
            raise ModelConversionError(f"quantize_model: {name}.weight is {w.dtype}; mode='nf4' quantizes "
                                       "bfloat16/float16/float32 weights")
        bad = int(w.detach().isfinite().logical_not().sum())
        if bad:
            raise ModelConversionError(f"quantize_model: {name}.weight contains {bad} NaN/Inf value(s); refusing to "
                                       "quantize it to NF4 (fix or reload the checkpoint)")


def _nf4_layer(bnb, lin: nn.Linear, name: str, compute_dtype: torch.dtype | None) -> nn.Module:
    """The NF4 ``Linear4bit`` of ``lin`` (checked by :func:`_check_layers`), on the weight's device."""
    w = lin.weight.detach()
    dtype = compute_dtype or w.dtype
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
    return new


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
