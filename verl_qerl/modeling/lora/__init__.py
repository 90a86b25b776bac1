"""LoRA on NVFP4 (and on the BF16 / NF4 baselines) through peft.

``get_lora_model(model, r=..., ...)`` registers :class:`NVFP4LoraLinear` for ``NVFP4Linear`` on the
``LoraConfig`` and calls ``peft.get_peft_model``; ``load_lora_adapter`` does the same for
``PeftModel.from_pretrained`` (the registration is not saved in ``adapter_config.json``, so a plain
``PeftModel.from_pretrained`` on an NVFP4 model would reject the layers).

peft's ``target_modules="all-linear"`` matches ``nn.Linear`` only, so on its own it puts no LoRA on an
``NVFP4Linear``: :func:`get_lora_model` and :func:`peft_custom_modules` expand it with the model at hand,
and a config built without the model (:func:`nvfp4_lora_config`, :func:`register_nvfp4_lora`) refuses it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model

from ..linear import NVFP4Linear
from .layer import MERGE_REFUSED, NVFP4LoraLinear, NVFP4MergeError

#: The Linear layers of a Qwen2/Llama decoder block (LoRA on all of them, as in the QeRL paper).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: peft's shorthand for every Linear layer but the output head (peft matches it in any case).
ALL_LINEAR = "all-linear"


def _is_all_linear(target_modules: object) -> bool:
    """peft's shorthand, spelled as peft accepts it (any case)."""
    return isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR


def _refuse_all_linear(target_modules: object, where: str) -> None:
    """A config made without the model cannot expand ``"all-linear"``, and peft's own expansion skips every
    NVFP4Linear (it matches ``nn.Linear`` only): the LoRA would silently miss the quantized layers."""
    if _is_all_linear(target_modules):
        raise ValueError(f"{where}: target_modules={target_modules!r} would put no LoRA on the NVFP4 layers (peft's "
                         "'all-linear' matches torch.nn.Linear only); pass the model to get_lora_model(model, "
                         "target_modules='all-linear'), or list the layers with resolve_target_modules(model, "
                         "'all-linear')")


def _register(config: LoraConfig) -> LoraConfig:
    config._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    return config


def register_nvfp4_lora(config: LoraConfig) -> LoraConfig:
    """Teach ``config`` (in place) to wrap ``NVFP4Linear`` with ``NVFP4LoraLinear``; returns it.

    ``target_modules="all-linear"`` is refused (see :func:`_refuse_all_linear`): resolve it first."""
    _refuse_all_linear(config.target_modules, "register_nvfp4_lora")
    return _register(config)


def _nvfp4_layer_names(model: nn.Module) -> set[str]:
    """Full names of the NVFP4Linear layers that "all-linear" means: not the output head (as peft and
    :func:`resolve_target_modules` leave it out) and not a base layer inside a LoRA wrapper."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    wrapped = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, BaseTunerLayer))
    return {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear) and m is not head
            and n.rpartition(".")[2] != "lm_head" and not n.startswith(wrapped)}


def _include_nvfp4(original: Callable[[Any, nn.Module], Any]) -> Callable[[Any, nn.Module], Any]:
    """peft's "all-linear" expansion (run where the model is known, at injection), plus the NVFP4 layers of a
    config registered for them."""

    def include(peft_config: Any, model: nn.Module) -> Any:
        asked = _is_all_linear(getattr(peft_config, "target_modules", None))
        peft_config = original(peft_config, model)
        if asked and NVFP4Linear in (getattr(peft_config, "_custom_modules", None) or {}):
            peft_config.target_modules = set(peft_config.target_modules) | _nvfp4_layer_names(model)
        return peft_config

    include._qerl_original = original  # type: ignore[attr-defined]
    return include


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0


@contextlib.contextmanager
def peft_custom_modules() -> Iterator[None]:
    """Within the block, every ``LoraConfig`` created (by ``LoraConfig(...)``, ``from_pretrained``,
    ``PeftModel.from_pretrained``) is registered for NVFP4 layers.

    For code that builds its own ``LoraConfig`` and calls ``get_peft_model`` in one go (verl's
    ``FSDPEngine._build_lora_module``), where there is no config object to register beforehand.
    ``LoraConfig.__post_init__`` is wrapped only while the block runs (re-entrant; restored after), and so is
    peft's ``"all-linear"`` expansion, which then includes the NVFP4 layers (it runs when the model is known);
    a peft without that function refuses ``"all-linear"`` in the block instead of skipping them silently.
    """
    global _PATCH_DEPTH
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            _patch_peft()
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                _unpatch_peft()


def _patch_peft() -> None:
    """Install :func:`peft_custom_modules`' wrappers (under ``_PATCH_LOCK``, at depth 0)."""
    from peft.tuners import tuners_utils

    expand = getattr(tuners_utils, "_maybe_include_all_linear_layers", None)
    original = LoraConfig.__post_init__

    def __post_init__(self: LoraConfig, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if expand is None:
            _refuse_all_linear(self.target_modules, "LoraConfig under peft_custom_modules")
        _register(self)

    __post_init__._qerl_original = original  # type: ignore[attr-defined]
    LoraConfig.__post_init__ = __post_init__  # type: ignore[method-assign]
    if expand is not None:
        tuners_utils._maybe_include_all_linear_layers = _include_nvfp4(expand)


def _unpatch_peft() -> None:
    from peft.tuners import tuners_utils

    LoraConfig.__post_init__ = LoraConfig.__post_init__._qerl_original  # type: ignore[attr-defined]
    expand = getattr(tuners_utils, "_maybe_include_all_linear_layers", None)
    if hasattr(expand, "_qerl_original"):
        tuners_utils._maybe_include_all_linear_layers = expand._qerl_original  # type: ignore[union-attr]


def resolve_target_modules(model: nn.Module, target_modules: str | Iterable[str] | None) -> list[str] | str:
    """peft's ``"all-linear"`` only matches ``nn.Linear``; expand it to the leaf names of every
    Linear-like layer (NVFP4Linear included) except the output head. Explicit lists pass through."""
    if target_modules is None or _is_all_linear(target_modules):
        leaves = set()
        for name, module in model.named_modules():
            leaf = name.rpartition(".")[2]
            if isinstance(module, (nn.Linear, NVFP4Linear)) and leaf != "lm_head":
                leaves.add(leaf)
        if not leaves:
            raise ValueError("resolve_target_modules: the model has no Linear layers to put LoRA on")
        return sorted(leaves)
    if isinstance(target_modules, str):
        return target_modules  # a regex, as peft accepts
    return list(target_modules)


def nvfp4_lora_config(
    r: int = 32,
    lora_alpha: int = 64,
    target_modules: str | Iterable[str] | None = DEFAULT_LORA_TARGETS,
    lora_dropout: float = 0.0,
    **kwargs: Any,
) -> LoraConfig:
    """A registered ``LoraConfig`` (task ``CAUSAL_LM``, no LoRA bias) for NVFP4 / BF16 / NF4 bases.

    ``target_modules="all-linear"`` is refused: without the model it cannot be expanded, and peft's own
    expansion skips the NVFP4 layers (use :func:`get_lora_model` or :func:`resolve_target_modules`)."""
    _refuse_all_linear(target_modules, "nvfp4_lora_config")
    kwargs.setdefault("task_type", "CAUSAL_LM")
    kwargs.setdefault("bias", "none")
    targets = list(target_modules) if target_modules is not None and not isinstance(target_modules, str) else (
        target_modules)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=lora_dropout, **kwargs)
    return register_nvfp4_lora(config)


def get_lora_model(
    model: nn.Module, config: LoraConfig | None = None, *, adapter_name: str = "default", **config_kwargs: Any
) -> PeftModel:
    """``peft.get_peft_model`` with NVFP4 support; ``config_kwargs`` go to :func:`nvfp4_lora_config`.

    Only adapter parameters require grad afterwards (peft freezes everything else; NVFP4 state is
    uint8 buffers, which never do).
    """
    if config is None:
        config_kwargs.setdefault("target_modules", DEFAULT_LORA_TARGETS)
        config_kwargs["target_modules"] = resolve_target_modules(model, config_kwargs["target_modules"])
        config = nvfp4_lora_config(**config_kwargs)
    elif config_kwargs:
        raise TypeError("get_lora_model: pass either config or config keyword arguments, not both")
    else:
        if _is_all_linear(config.target_modules) or config.target_modules is None:
            config.target_modules = set(resolve_target_modules(model, config.target_modules))
        register_nvfp4_lora(config)
    _refuse_frozen_modules_to_save(model, config)
    return get_peft_model(model, config, adapter_name=adapter_name)


def _refuse_frozen_modules_to_save(model: nn.Module, config: LoraConfig) -> None:
    """peft's ``modules_to_save`` trains a full copy of a module; an NVFP4 layer's copy has no trainable parameter
    (uint8 buffers; at most its bias), so the user would train nothing there without a word: refuse it by name."""
    from ..linear import NVFP4Linear

    wanted = config.modules_to_save or []
    hits = [name for name, module in model.named_modules() if isinstance(module, NVFP4Linear)
            and any(name == w or name.endswith("." + w) for w in wanted)]
    if hits:
        raise ValueError(f"get_lora_model: modules_to_save {list(wanted)} names NVFP4 layer(s) {hits[:3]}: their 4-bit "
                         "base is frozen, so a trainable copy would train nothing; train them through LoRA "
                         "(target_modules) or keep them in BF16 (quantize_model(ignore=...))")


def load_lora_adapter(
    model: nn.Module, path: str | os.PathLike, *, is_trainable: bool = False, adapter_name: str = "default"
) -> PeftModel:
    """``PeftModel.from_pretrained`` for adapters saved with ``save_pretrained`` (peft's usual files)."""
    config = LoraConfig.from_pretrained(str(path))
    if _is_all_linear(config.target_modules):  # written by hand: expanded with the model, as get_lora_model does
        config.target_modules = set(resolve_target_modules(model, config.target_modules))
    register_nvfp4_lora(config)
    return PeftModel.from_pretrained(model, str(path), adapter_name=adapter_name, is_trainable=is_trainable,
                                     config=config)


__all__ = [
    "DEFAULT_LORA_TARGETS",
    "MERGE_REFUSED",
    "NVFP4LoraLinear",
    "NVFP4MergeError",
    "get_lora_model",
    "load_lora_adapter",
    "nvfp4_lora_config",
    "peft_custom_modules",
    "register_nvfp4_lora",
    "resolve_target_modules",
]
