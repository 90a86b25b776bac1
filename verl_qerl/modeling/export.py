"""Write dequant(W) + B@A of a LoRA-on-NVFP4 policy as a Hugging Face checkpoint others can load.

Merging in place is refused (the sum is not an NVFP4 tensor). Exporting is the supported way to
get a merged model: ``dtype="bf16"`` writes a plain BF16 checkpoint (transformers, vLLM, anything);
``dtype="nvfp4"`` re-quantizes the merged weights (fused q/k/v and gate/up sharing a global scale,
as ``qerl-quantize``) and writes the compressed-tensors NVFP4A16 layout that vLLM's stock loader and
``verl_qerl.nvfp4.checkpoint.CheckpointReader`` read. The merge is computed in float32, one fused
group at a time, and shards are flushed as they fill, so memory stays near the output model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from ..nvfp4 import DEFAULT_SCALE_RULE, check_scale_rule, fused_global_scale
from ..nvfp4.arch import DEFAULT_IGNORE, fused_group
from ..nvfp4.checkpoint import (
    SCALE_RULE_KEY,
    ct_quantization_config,
    ct_tensors,
    matches_pattern,
    write_safetensors,
)
from .linear import NVFP4Linear, quantize_rows

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}

#: Tokenizer / generation files copied from ``tokenizer`` when it is a folder.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")


def _base_model(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _merged_weights(base: nn.Module) -> dict[str, nn.Module]:
    """Linear-like layers (NVFP4Linear, nn.Linear, and peft LoRA wrappers of them) by export name."""
    from peft.tuners.lora import LoraLayer

    layers: dict[str, nn.Module] = {}
    lora_prefixes: list[str] = []
    tied = bool(getattr(getattr(base, "config", None), "tie_word_embeddings", False))
    for name, module in base.named_modules():
        if tied and (name == "lm_head" or name.endswith(".lm_head")):
            continue  # its weight is the input embedding, written once under its own name
        if isinstance(module, LoraLayer):
            inner = module.get_base_layer()
            if not isinstance(inner, (nn.Linear, NVFP4Linear)) or type(inner).__module__.startswith("bitsandbytes"):
                raise ValueError(f"export_merged: layer {name!r} wraps a {type(inner).__qualname__}; only LoRA on "
                                 "NVFP4Linear or torch.nn.Linear can be exported")
            layers[name] = module
            lora_prefixes.append(name + ".")
        elif any(name.startswith(p) for p in lora_prefixes):
            continue  # the base layer and the adapters of a LoRA layer: exported through it
        elif isinstance(module, NVFP4Linear) or type(module) is nn.Linear:
            layers[name] = module
        elif type(module).__module__.startswith("bitsandbytes") and isinstance(module, nn.Linear):
            raise ValueError(f"export_merged: layer {name!r} is a bitsandbytes {type(module).__qualname__}; "
                             "export from an NVFP4 or BF16 base")
    return layers


def _dense(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 dequant(W) + sum of active adapters' scaling*B@A, and the bias."""
    from peft.tuners.lora import LoraLayer

    from .lora.layer import lora_delta

    if isinstance(layer, LoraLayer):
        inner = layer.get_base_layer()
        w = _dense(inner)[0]
        if not layer.disable_adapters:
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    w = w + lora_delta(layer, adapter).detach()
        return w, inner.bias
    if isinstance(layer, NVFP4Linear):
        return layer.dequantize_weight(torch.float32), layer.bias
    return layer.weight.detach().float(), layer.bias


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
    dtype: str = "bf16",
    *,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    tokenizer: str | os.PathLike | object | None = None,
    max_shard_bytes: int = 5 << 30,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> Path:
    """Write ``model`` (a PeftModel or a model with NVFP4Linear / LoRA layers) with adapters merged.

    ``dtype``: ``"bf16"`` (also ``"fp16"``, ``"fp32"``) for a dense checkpoint, ``"nvfp4"`` for a
    re-quantized compressed-tensors NVFP4A16 one (layers matching ``ignore`` stay dense).
    ``tokenizer``: a folder to copy tokenizer/generation files from, or an object with
    ``save_pretrained``. ``out_dir`` must not exist or be empty. ``scale_rule``: how the
    ``"nvfp4"`` export computes its scales (``verl_qerl.nvfp4.SCALE_RULES``). Returns the folder.
    """
    check_scale_rule(scale_rule, "export_merged: scale_rule")
    key = dtype.lower()
    if key != "nvfp4" and key not in _DTYPES:
        raise ValueError(f"export_merged: dtype={dtype!r}; expected 'bf16', 'fp16', 'fp32' or 'nvfp4'")
    dense_dtype = _DTYPES.get(key, torch.bfloat16)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not empty")
    base = _base_model(model)
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError("export_merged: the model has no Hugging Face config")
    layers = _merged_weights(base)
    ignore = list(ignore)
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, max_shard_bytes)
    try:
        covered = set()
        groups: dict[str, list[str]] = {}
        for name in layers:
            groups.setdefault(fused_group(name), []).append(name)
        kept_dense = []
        for group in groups.values():
            merged = {n: _dense(layers[n]) for n in group}
            quantized = key == "nvfp4" and not any(matches_pattern(n, ignore) for n in group)
            if quantized:
                gs = fused_global_scale([w for w, _ in merged.values()], [f"{n}.weight" for n in group], scale_rule)
            for n, (w, bias) in merged.items():
                if quantized:
                    for k, t in ct_tensors(n, quantize_rows(w, gs, name=f"{n}.weight", scale_rule=scale_rule)).items():
                        writer.add(k, t)
                else:
                    writer.add(f"{n}.weight", w.to(dense_dtype))
                    kept_dense.append(n)
                if bias is not None:
                    writer.add(f"{n}.bias", bias.detach().to(dense_dtype))
                covered.add(n)
            del merged
        tied = bool(getattr(config, "tie_word_embeddings", False))
        for name, tensor in _other_tensors(base, covered):
            if tied and name.endswith("lm_head.weight"):
                continue
            writer.add(name, tensor.to(dense_dtype) if tensor.dtype.is_floating_point else tensor)
        writer.finish()
        cfg = config.to_dict()
        for k in ("quantization_config", "compression_config", SCALE_RULE_KEY):
            cfg.pop(k, None)
        cfg["dtype"] = str(dense_dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
        if key == "nvfp4":
            dense_linear = [n for n in kept_dense if not any(matches_pattern(n, [p]) for p in ignore)]
            cfg["quantization_config"] = ct_quantization_config(ignore + dense_linear)
            cfg[SCALE_RULE_KEY] = scale_rule
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        _write_side_files(base, out, tokenizer)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def _other_tensors(base: nn.Module, covered: set[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers outside the exported Linear layers, with peft's
    ``.base_layer`` wrapping removed from the names."""
    skip = tuple(n + "." for n in covered)
    seen: set[int] = set()
    for name, tensor in base.state_dict(keep_vars=False).items():
        if name.startswith(skip) or ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
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
    src = Path(tokenizer)  # type: ignore[arg-type]
    for name in _SIDE_FILES:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy2(src / name, out / name)
