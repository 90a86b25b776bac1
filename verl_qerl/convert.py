"""Convert a BF16 Hugging Face checkpoint folder into an NVFP4 (compressed-tensors) one, streaming.

Memory stays near one input tensor plus one output shard: pass 1 reads each Linear weight once to
find its amax (fused q/k/v and gate/up share a global scale, and their parts may sit in different
shards); pass 2 rewrites the checkpoint shard by shard. Output goes to a temporary folder beside
DST and is renamed into place only when complete, so an interrupted run leaves nothing half-written
and an existing DST is replaced only with ``force=True``, after the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .nvfp4.checkpoint import (
    FORMAT_BF16,
    SCALE_RULE_KEY,
    CheckpointError,
    CheckpointReader,
    ct_quantization_config,
    ct_tensors,
    matches_pattern,
)
from .nvfp4.quantize import DEFAULT_SCALE_RULE, check_scale_rule, checked_amax, global_scale_from_amax, quantize

#: model_type values whose Linear layout (q/k/v/o, gate/up/down, lm_head) we have tested.
SUPPORTED_MODEL_TYPES = ("qwen2", "llama")

#: Modules left in BF16 unless the user says otherwise (embeddings are not Linear layers at all).
DEFAULT_IGNORE = ("lm_head",)

#: Projections that inference engines fuse into one GEMM, so their parts share a global scale.
FUSED_GROUPS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def fused_group(module: str) -> str:
    """The fused-layer key a module belongs to (itself when it is not fused)."""
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{FUSED_GROUPS[leaf]}" if leaf in FUSED_GROUPS else module


def linear_module_names(config: dict) -> list[str]:
    """Names of the nn.Linear modules of the architecture in ``config`` (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"config.json model_type={model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return [name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]


@dataclass
class ConversionReport:
    """What a conversion did, for the CLI's summary and for tests."""

    src: Path
    dst: Path
    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0


def _replace_dir(tmp: Path, dst: Path, force: bool) -> None:
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()
    if dst.exists():
        if not force:
            raise FileExistsError(f"{dst}: exists and is not empty (pass --force to replace it)")
        old = dst.with_name(dst.name + f".old-{os.getpid()}")
        dst.rename(old)
        tmp.rename(dst)
        shutil.rmtree(old)
    else:
        tmp.rename(dst)


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    ignore: Iterable[str] = (),
    force: bool = False,
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> ConversionReport:
    """Write an NVFP4A16 compressed-tensors checkpoint of the BF16 checkpoint at ``src`` to ``dst``.

    ``ignore``: extra module patterns (exact names, dotted suffixes or ``re:<regex>``) kept in BF16,
    on top of :data:`DEFAULT_IGNORE`. ``progress(iterable, total, desc)`` wraps the loops (tqdm).
    ``scale_rule``: how scales are computed (``verl_qerl.nvfp4.SCALE_RULES``); recorded in config.json.
    """
    check_scale_rule(scale_rule, "scale_rule")
    src, dst = Path(src), Path(dst)
    wrap = progress or (lambda it, total, desc: it)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not force:
        raise FileExistsError(f"{dst}: exists and is not empty (pass --force to replace it)")
    if dst.resolve() == src.resolve():
        raise FileExistsError(f"{dst}: is the source folder; choose another destination")
    reader = CheckpointReader(src)
    if reader.format != FORMAT_BF16:
        raise CheckpointError(f"{src}: is already quantized ({reader.format}); nothing to convert")
    patterns = list(DEFAULT_IGNORE) + list(ignore)
    linear = linear_module_names(reader.config)
    targets = [m for m in linear if f"{m}.weight" in reader and not matches_pattern(m, patterns)]
    missing = [m for m in linear if f"{m}.weight" not in reader and not matches_pattern(m, patterns)]
    if missing and not reader.config.get("tie_word_embeddings"):
        raise CheckpointError(f"{src}: Linear weight(s) missing from the checkpoint: "
                              f"{', '.join(m + '.weight' for m in missing[:5])}")

    # Pass 1: per-group global scale, from the largest amax of the group's parts.
    group_amax: dict[str, torch.Tensor] = {}
    for module in wrap(targets, len(targets), "scan amax"):
        amax = checked_amax(reader.get(f"{module}.weight"), f"{module}.weight")
        key = fused_group(module)
        group_amax[key] = amax if key not in group_amax else torch.maximum(group_amax[key], amax)
    group_scale = {key: global_scale_from_amax(amax, scale_rule) for key, amax in group_amax.items()}

    report = ConversionReport(src=src, dst=dst)
    target_set = set(targets)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the result the permissions a mkdir would
    try:
        weight_map: dict[str, str] = {}
        total = len(reader.names())
        for shard in reader.shards:
            out: dict[str, torch.Tensor] = {}
            names = reader.shard_names(shard)
            for name, tensor in wrap(reader.iter_shard(shard), len(names), f"quantize {shard}"):
                report.bytes_in += tensor.numel() * tensor.element_size()
                module = name.removesuffix(".weight")
                if name.endswith(".weight") and module in target_set:
                    q = quantize(tensor, group_scale[fused_group(module)], name=name, rule=scale_rule)
                    out.update(ct_tensors(module, q))
                    report.quantized.append(module)
                else:
                    out[name] = tensor.contiguous()
                    report.kept.append(name)
            save_file(out, tmp / shard, metadata={"format": "pt"})
            os.chmod(tmp / shard, 0o666 & ~umask)
            report.bytes_out += sum(t.numel() * t.element_size() for t in out.values())
            weight_map.update({n: shard for n in out})
            del out
        assert len(report.quantized) + len(report.kept) == total
        if len(reader.shards) > 1:
            index = {"metadata": {"total_size": report.bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = dict(reader.config)
        config["quantization_config"] = ct_quantization_config(patterns)
        config[SCALE_RULE_KEY] = scale_rule
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for path in sorted(src.iterdir()):
            if path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_FILE_SUFFIXES):
                shutil.copy2(path, tmp / path.name)
        _replace_dir(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
