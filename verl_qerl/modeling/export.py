"""Write dequant(W) + B@A of a LoRA-on-NVFP4 policy as a Hugging Face checkpoint others can load.

Merging in place is refused (the sum is not an NVFP4 tensor). Exporting is the supported way to
get a merged model: ``dtype="bf16"`` writes a plain BF16 checkpoint (transformers, vLLM, anything);
``dtype="nvfp4"`` re-quantizes the merged weights (fused q/k/v and gate/up sharing a global scale,
as ``qerl-quantize``) and writes the compressed-tensors NVFP4A16 layout that vLLM's stock loader and
``verl_qerl.nvfp4.checkpoint.CheckpointReader`` read. The merge is computed in float32, one fused
group at a time, and shards are flushed as they fill, so memory stays near the output model.

What is written is what the in-memory model computes: each layer's forward as peft runs it (the active
adapters' ``scaling * B@A`` and ``scaling * lora_B.bias``, nothing more where ``merge_adapter()`` already
put them into the base), and a peft ``modules_to_save`` module as its active copy under the plain name.
Everything is checked before any weight is written, written into a hidden folder beside ``out_dir`` and
renamed into place only when complete (as ``qerl-quantize`` does), so a failed or killed export never
leaves a half-written ``out_dir``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoint_conversion import check_output_folder, make_temp_folder, remove_made, replace_dir
from ..nvfp4 import DEFAULT_SCALE_RULE, check_scale_rule, fused_global_scale
from ..nvfp4.arch import DEFAULT_IGNORE, fused_group
from ..nvfp4.checkpoint import (
    SCALE_RULE_KEY,
    check_ignore,
    check_patterns,
    ct_quantization_config,
    ct_tensors,
    matches_pattern,
    write_safetensors,
)
from .linear import NVFP4Linear, quantize_rows

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}

#: The key of each dense torch dtype export_merged writes (``dtype=torch.bfloat16`` means ``"bf16"``).
_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: Tokenizer / generation files copied from ``tokenizer`` when it is a folder.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")

#: A ``tokenizer`` folder must hold one of these (else it is not a tokenizer folder, and nothing would be copied).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _base_model(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


# ------------------------------------------------------------------------------------------------
# peft modules_to_save: which copy the forward runs, and the names it is exported under


def _saved_copy(wrapper: nn.Module) -> str:
    """The child of a peft ``ModulesToSaveWrapper`` its forward runs: ``modules_to_save.<adapter>`` (the trained
    copy of the active adapter) or ``original_module`` (adapters disabled, or none of them saves this module)."""
    active = list(wrapper.active_adapters)
    if wrapper.disable_adapters or not active or any(a not in wrapper.modules_to_save for a in active):
        return "original_module"
    return f"modules_to_save.{active[0]}"


def _routes(base: nn.Module) -> dict[str, str]:
    """{name of a peft ModulesToSaveWrapper: the child exported in its place}, innermost first.

    Why: the wrapper holds the frozen original and one trained copy per adapter; a loader knows neither
    ``lm_head.original_module.weight`` nor ``lm_head.modules_to_save.default.weight``, only ``lm_head.weight``."""
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    routes = {}
    for name, module in base.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            routes[name] = _saved_copy(module)
        elif isinstance(module, AuxiliaryTrainingWrapper):
            raise ValueError(f"export_merged: {name!r} is a peft {type(module).__qualname__} (trainable_token_indices"
                             "); only LoRA and modules_to_save can be exported")
    return dict(sorted(routes.items(), key=lambda kv: -kv[0].count(".")))


def _export_name(name: str, routes: dict[str, str]) -> str | None:
    """``name`` with each ModulesToSaveWrapper's exported child folded into the wrapper's own name (so ignore
    patterns see ``lm_head``), or None for anything under a child that is not exported."""
    for wrapper, kept in routes.items():
        if name.startswith(wrapper + "."):
            rest = name[len(wrapper) + 1:]
            if rest != kept and not rest.startswith(kept + "."):
                return None
            name = wrapper + rest[len(kept):]
    return name


def _head_is_own(base: nn.Module) -> bool:
    """Whether the output head computes with another weight than the input embedding, although the config ties
    them: a trained ``modules_to_save`` copy of either, or LoRA on ``lm_head``. The export is then untied (its
    ``lm_head.weight`` written), or loading would put the embedding back in the head."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    def weight(module: nn.Module | None) -> torch.Tensor | None:
        if isinstance(module, ModulesToSaveWrapper):
            module = module.get_submodule(_saved_copy(module))
        if isinstance(module, LoraLayer):
            adapters, _ = _adapter_terms(module)
            if adapters:
                return None
            module = module.get_base_layer()
        w = getattr(module, "weight", None)
        return w if isinstance(w, torch.Tensor) else None

    get_out, get_in = getattr(base, "get_output_embeddings", None), getattr(base, "get_input_embeddings", None)
    if not callable(get_out) or not callable(get_in) or get_out() is None or get_in() is None:
        return False
    w_out, w_in = weight(get_out()), weight(get_in())
    return w_out is None or w_in is None or not (w_out is w_in or w_out.data_ptr() == w_in.data_ptr())


# ------------------------------------------------------------------------------------------------
# the Linear layers and their merged tensors


def _linear_layers(base: nn.Module, routes: dict[str, str]) -> dict[str, nn.Module]:
    """Linear-like layers (NVFP4Linear, nn.Linear, and peft LoRA wrappers of them) by export name."""
    from peft.tuners.lora import LoraLayer

    layers: dict[str, nn.Module] = {}
    lora_prefixes: list[str] = []
    for raw, module in base.named_modules():
        name = _export_name(raw, routes)
        if name is None or raw.startswith(tuple(lora_prefixes)):
            continue  # a copy that is not exported, or the base layer and adapters of a LoRA layer
        if isinstance(module, LoraLayer):
            inner = module.get_base_layer()
            if not isinstance(inner, (nn.Linear, NVFP4Linear)) or type(inner).__module__.startswith("bitsandbytes"):
                raise ValueError(f"export_merged: layer {name!r} wraps a {type(inner).__qualname__}; only LoRA on "
                                 "NVFP4Linear or torch.nn.Linear can be exported")
            layers[name] = module
            lora_prefixes.append(raw + ".")
        elif isinstance(module, NVFP4Linear) or type(module) is nn.Linear:
            layers[name] = module
        elif type(module).__module__.startswith("bitsandbytes") and isinstance(module, nn.Linear):
            raise ValueError(f"export_merged: layer {name!r} is a bitsandbytes {type(module).__qualname__}; "
                             "export from an NVFP4 or BF16 base")
    return layers


def _adapter_terms(layer: nn.Module) -> tuple[list[str], float]:
    """The adapters whose ``scaling * B@A`` (and ``scaling * lora_B.bias``) turn the base layer's tensors into what
    the layer's forward computes, and their sign.

    Why: peft's forward runs the base layer alone once ``merge_adapter()`` has added the deltas into it (adding
    them again would count them twice), and un-merges first when adapters are disabled while merged."""
    merged = [a for a in getattr(layer, "merged_adapters", ()) if a in layer.lora_A]
    if layer.disable_adapters:
        return merged, -1.0
    if merged:
        return [], 1.0
    return [a for a in layer.active_adapters if a in layer.lora_A], 1.0


def _merged_weight(layer: nn.Module) -> torch.Tensor:
    """float32 dequant(W) or W, plus the adapter deltas the forward adds (see :func:`_adapter_terms`)."""
    from peft.tuners.lora import LoraLayer

    from .lora.layer import lora_delta

    if isinstance(layer, LoraLayer):
        w = _merged_weight(layer.get_base_layer())
        adapters, sign = _adapter_terms(layer)
        for adapter in adapters:
            w = w + sign * lora_delta(layer, adapter).detach()
        return w
    if isinstance(layer, NVFP4Linear):
        return layer.dequantize_weight(torch.float32)
    return layer.weight.detach().float()


def _merged_bias(layer: nn.Module) -> torch.Tensor | None:
    """float32 bias plus ``scaling * lora_B.bias`` of the adapters the forward adds (peft ``lora_bias=True``);
    a layer without a bias of its own gets one from its adapters."""
    from peft.tuners.lora import LoraLayer

    if isinstance(layer, LoraLayer):
        bias = _merged_bias(layer.get_base_layer())
        adapters, sign = _adapter_terms(layer)
        for adapter in adapters:
            extra = layer.lora_B[adapter].bias
            if extra is not None:
                term = extra.detach().float() * (sign * layer.scaling[adapter])
                bias = term if bias is None else bias + term
        return bias
    bias = getattr(layer, "bias", None)
    return None if bias is None else bias.detach().float()


def _own_bias(layer: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    inner = layer.get_base_layer() if isinstance(layer, LoraLayer) else layer
    return getattr(inner, "bias", None) is not None


def _config_biases(base: nn.Module, cfg: dict) -> set[str]:
    """The Linear layers that transformers builds with a bias from ``cfg`` (the architecture on the meta device)."""
    config = type(base.config).from_dict(cfg)
    with torch.device("meta"):
        model = type(base)._from_config(config)
    return {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is not None}


def _bias_config(base: nn.Module, cfg: dict, wanted: list[str]) -> tuple[dict, set[str]]:
    """``cfg`` with the bias settings of the model type (``attention_bias``, ``mlp_bias``, ...) turned on where the
    layers ``wanted`` (given a bias by their LoRA) need one, and the Linear layers that then load with a bias.

    Why: transformers builds a bias only where the config says so, and would drop the tensor without one; Qwen2's
    o_proj and MLP have no setting at all, so such a layer is refused by name rather than exported without it."""
    have = _config_biases(base, cfg)
    for key in sorted(k for k, v in cfg.items() if v is False and "bias" in k.lower()):
        if all(n in have for n in wanted):
            break
        trial = {**cfg, key: True}
        got = _config_biases(base, trial)
        if got & (set(wanted) - have):
            cfg, have = trial, got
    missing = [n for n in wanted if n not in have]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"export_merged: the LoRA bias (lora_bias=True) gives {missing[0]}{more} a bias, but "
                         f"transformers' {type(base).__name__} has none there and no config setting "
                         f"({cfg.get('model_type')!r}) adds one, so the checkpoint would load without it; train "
                         "without lora_bias on those layers (or leave them out of target_modules)")
    return cfg, have


# ------------------------------------------------------------------------------------------------
# checks made before anything is written


def _dtype_key(dtype: str | torch.dtype) -> str:
    """``dtype`` as a lower-case key of :data:`_DTYPES` or ``"nvfp4"``; a ``torch.dtype`` maps to its key.

    Why: ``dtype=torch.bfloat16`` (the type quantize_model and transformers take) failed with an AttributeError
    naming neither export_merged nor dtype."""
    if isinstance(dtype, torch.dtype):
        key = _DTYPE_KEYS.get(dtype)
    else:
        key = dtype.lower() if isinstance(dtype, str) else None
    if key != "nvfp4" and key not in _DTYPES:
        raise ValueError(f"export_merged: dtype={dtype!r}; expected 'bf16', 'fp16', 'fp32' or 'nvfp4' (or "
                         "torch.bfloat16, torch.float16, torch.float32)")
    return key



def _check_tokenizer(tokenizer: str | os.PathLike | object | None) -> None:
    """A ``tokenizer`` that is neither a tokenizer folder nor has ``save_pretrained`` is refused by name: it used
    to leave the export without a tokenizer, without a word."""
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"export_merged: tokenizer={tokenizer!r}: expected a tokenizer folder or an object with "
                        "save_pretrained")
    src = Path(tokenizer).expanduser()  # "~/tok", as out_dir
    if not src.is_dir():
        raise FileNotFoundError(f"export_merged: tokenizer={str(src)!r}: no such folder")
    if not any((src / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"export_merged: tokenizer={str(src)!r}: holds none of "
                                f"{', '.join(_TOKENIZER_FILES)}; not a tokenizer folder")


def _check_ignore(ignore: Iterable[str] | str, linear: list[str]) -> list[str]:
    """``ignore`` as a list of patterns (a string is one pattern); each pattern of the caller's own (not in
    :data:`DEFAULT_IGNORE`) must match a Linear layer, or a misspelling would quietly quantize what it meant."""
    patterns = check_patterns(ignore, "export_merged: ignore")
    # no fused-group rule here (patterns=()): a group partly ignored is kept whole in the dense dtype below
    check_ignore(linear, (), "export_merged: ignore", must_match=[p for p in patterns if p not in DEFAULT_IGNORE])
    return patterns


# ------------------------------------------------------------------------------------------------
# writing


def _export_config(config: object, dense_dtype: torch.dtype, untie: bool) -> dict:
    """config.json without the source's quantization entries, in the written dtype; untied when the head
    computes with a weight of its own (see :func:`_head_is_own`)."""
    cfg = config.to_dict()  # type: ignore[attr-defined]
    for k in ("quantization_config", "compression_config", SCALE_RULE_KEY):
        cfg.pop(k, None)
    cfg["dtype"] = str(dense_dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    if untie:
        cfg["tie_word_embeddings"] = False
    return cfg


class _ShardWriter:
    """Collect tensors and write ``model-0000i-of-0000N.safetensors`` shards of ~max_bytes."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.max_bytes:
            self.flush()
        self.current[name] = tensor.detach().to("cpu").contiguous()
        self.size += nbytes

    def flush(self) -> None:
        if not self.current:
            return
        tmp = f"shard-{len(self.files):05d}.tmp.safetensors"
        write_safetensors(self.current, self.out / tmp)
        self.files.append((tmp, list(self.current)))
        self.current, self.size = {}, 0

    def finish(self) -> int:
        self.flush()
        n = len(self.files)
        weight_map, total = {}, 0
        for i, (tmp, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / tmp, self.out / final)
            weight_map.update({k: final for k in names})
            total += (self.out / final).stat().st_size
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return total


def export_merged(
    model: nn.Module,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype = "bf16",
    *,
    ignore: Iterable[str] | str = DEFAULT_IGNORE,
    tokenizer: str | os.PathLike | object | None = None,
    max_shard_bytes: int = 5 << 30,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> Path:
    """Write ``model`` (a PeftModel or a model with NVFP4Linear / LoRA layers) with adapters merged.

    ``dtype``: ``"bf16"`` (also ``"fp16"``, ``"fp32"``, or the torch dtype) for a dense checkpoint, ``"nvfp4"``
    for a re-quantized compressed-tensors NVFP4A16 one (layers matching ``ignore`` stay dense; a string is one
    pattern, and a pattern of the caller's that matches no Linear layer is refused).
    ``tokenizer``: a folder to copy tokenizer/generation files from, or an object with
    ``save_pretrained``. ``out_dir`` must not exist or be empty; it is written through a hidden folder
    beside it and appears only when complete. ``out_dir`` and a ``tokenizer`` folder may start with ``~``.
    ``scale_rule``: how the ``"nvfp4"`` export computes its scales (``verl_qerl.nvfp4.SCALE_RULES``). Returns the
    folder (``~`` expanded).
    """
    check_scale_rule(scale_rule, "export_merged: scale_rule")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"export_merged: max_shard_bytes={max_shard_bytes!r} must be a positive number of bytes "
                         "(a value <= 0 wrote one shard per tensor)")
    key = _dtype_key(dtype)
    dense_dtype = _DTYPES.get(key, torch.bfloat16)
    _check_tokenizer(tokenizer)
    shown = Path(out_dir).expanduser()  # as CheckpointReader and the CLIs: "~/merged" wrote ./~/merged before
    out = check_output_folder(shown, "export_merged")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{shown}: exists and is not empty")
    base = _base_model(model)
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError("export_merged: the model has no Hugging Face config")
    routes = _routes(base)
    layers = _linear_layers(base, routes)
    ignore = _check_ignore(ignore, list(layers))
    linear_names = list(layers)  # with a tied head, which is written as the embedding alone (dense)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    untie = tied and _head_is_own(base)
    tied = tied and not untie
    if tied:  # the head's weight is the input embedding, written once under its own name
        layers = {n: m for n, m in layers.items() if not (n == "lm_head" or n.endswith(".lm_head"))}
    groups: dict[str, list[str]] = {}
    for name in layers:
        groups.setdefault(fused_group(name), []).append(name)
    quantized = {g: key == "nvfp4" and not any(matches_pattern(n, ignore) for n in group)
                 for g, group in groups.items()}
    biases = {n: _merged_bias(m) for n, m in layers.items()}

    cfg = _export_config(config, dense_dtype, untie)
    new_bias = [n for n, b in biases.items() if b is not None and not _own_bias(layers[n])]
    if new_bias:  # the config must declare them, and every layer it then gives a bias needs a tensor (zeros)
        cfg, have = _bias_config(base, cfg, new_bias)
        biases.update({n: torch.zeros(layers[n].out_features) for n in have if n in layers and biases[n] is None})
    if key == "nvfp4":
        # full names of the Linear layers written dense, as llm-compressor writes them: compressed-tensors, vLLM's
        # stock loader and transformers read ignore entries as exact names (or re:), not the dotted suffixes
        # ``ignore`` may hold, so "down_proj" there would have them expect NVFP4 tensors of a BF16 layer
        cfg["quantization_config"] = ct_quantization_config(
            n for n in linear_names if n not in layers or not quantized[fused_group(n)])
        cfg[SCALE_RULE_KEY] = scale_rule

    stage, made = make_temp_folder(out, shown, tag="partial")
    try:
        writer = _ShardWriter(stage, max_shard_bytes)
        for g, group in groups.items():
            merged = {n: _merged_weight(layers[n]) for n in group}
            if quantized[g]:
                gs = fused_global_scale(list(merged.values()), [f"{n}.weight" for n in group], scale_rule)
            for n, w in merged.items():
                if quantized[g]:
                    for k, t in ct_tensors(n, quantize_rows(w, gs, name=f"{n}.weight", scale_rule=scale_rule)).items():
                        writer.add(k, t)
                else:
                    writer.add(f"{n}.weight", w.to(dense_dtype))
                if biases[n] is not None:
                    writer.add(f"{n}.bias", biases[n].to(dense_dtype))
            del merged
        for name, tensor in _other_tensors(base, set(layers), routes):
            if tied and name.endswith("lm_head.weight"):
                continue
            writer.add(name, tensor.to(dense_dtype) if tensor.dtype.is_floating_point else tensor)
        writer.finish()
        (stage / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        _write_side_files(base, stage, tokenizer)
        replace_dir(stage, out, force=False)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        remove_made(made)
        raise
    return shown


def _other_tensors(base: nn.Module, covered: set[str], routes: dict[str, str]) -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers outside the exported Linear layers, under their export names (peft's
    ``.base_layer`` and modules_to_save wrapping removed, copies that are not exported left out)."""
    skip = tuple(n + "." for n in covered)
    seen: set[int] = set()
    for raw, tensor in base.state_dict(keep_vars=False).items():
        name = _export_name(raw, routes)
        if name is None or ".lora_" in raw:
            continue
        clean = name.replace(".base_layer.", ".")
        if clean.startswith(skip):
            continue
        key = id(tensor)
        if key in seen and clean.endswith("lm_head.weight"):
            continue
        seen.add(key)
        yield clean, tensor


def _write_side_files(base: nn.Module, out: Path, tokenizer: str | os.PathLike | object | None) -> None:
    gen = getattr(base, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(out)
    if tokenizer is None:
        return
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)  # type: ignore[union-attr]
        return
    src = Path(tokenizer).expanduser()  # type: ignore[arg-type]
    for name in _SIDE_FILES:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy2(src / name, out / name)
