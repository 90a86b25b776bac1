"""The workload of ``benchmarks/rollout.py`` and the folders it needs: the backends, the model shapes, the random
Qwen2 checkpoints (BF16 written layer by layer; NVFP4 quantized from it or written directly, same bits), their
tokenizer, the random peft LoRA adapter, and ``build_model``, the child job that makes one model's folders.

Kept apart from the runner because none of it starts an engine or times anything: it writes files, and other
benchmarks reuse its writers and shapes (``grpo_step.py``, ``tp_parity.py``, ``lora_profile.py``,
``memory_table.py``, through ``rollout``, which re-exports them).
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

BACKENDS = ("bf16", "qerl_nvfp4", "ct_marlin", "nf4")
GPU_ONLY = {"ct_marlin": "vLLM's compressed-tensors NVFP4 (Marlin) path needs a CUDA GPU",
            "nf4": "bitsandbytes NF4 in vLLM needs a CUDA GPU"}

#: Qwen2.5 shapes (untied embeddings, q/k/v biases).
SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
}

LORA_RANK = 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INIT_STD = 0.02
DONE = ".complete"  # marker file: a checkpoint folder whose writing finished


class BenchError(RuntimeError):
    """A setup problem the user can fix; printed without a traceback."""


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------


def qwen2_config(shape: dict, eos_id: int, pad_id: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **shape,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def layer_tensor_shapes(shape: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one Qwen2 decoder layer's tensors, in checkpoint order."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    p = f"model.layers.{layer}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
        p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
        p + "self_attn.o_proj.weight": (h, h),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
    }


def count_params(shape: dict) -> tuple[int, int]:
    """(parameters in decoder Linear weights, all other parameters)."""
    linear = other = 0
    for name, s in layer_tensor_shapes(shape, 0).items():
        n = 1
        for d in s:
            n *= d
        if name.endswith("proj.weight"):
            linear += n
        else:
            other += n
    emb = shape["vocab_size"] * shape["hidden_size"]
    return linear * shape["num_hidden_layers"], other * shape["num_hidden_layers"] + 2 * emb + shape["hidden_size"]


def checkpoint_bytes(shape: dict, fmt: str) -> int:
    linear, other = count_params(shape)
    per_weight = 2.0 if fmt == "bf16" else 0.5 + 1 / 16  # packed e2m1 + one fp8 scale per 16
    return int(linear * per_weight + other * 2)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, device):
    """Deterministic in (seed, name): N(0, 0.02) bf16 weights, ones for norms, zeros for biases."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * INIT_STD).to(torch.bfloat16)


def check_disk(folder: Path, needed: int, what: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed * 1.05:
        raise BenchError(f"not enough disk for {what} in {folder}: needs {needed / 1e9:.1f} GB "
                         f"(+5%), {free / 1e9:.1f} GB free; use --work-dir elsewhere, or --bf16-checkpoint never")


#: what a random checkpoint written without ``tokenizer`` gets (and what every checkpoint written before the
#: marker recorded its tokenizer got): the tiny byte-level BPE of ``verl_qerl.testing.tiny.build_tokenizer``
TINY_TOKENIZER = "tiny-bpe-512"


def tokenizer_identity(tokenizer: Path | None) -> str:
    """A checkpoint's tokenizer as its ``DONE`` marker records it: :data:`TINY_TOKENIZER`, or the SHA-256 of the
    folder's ``tokenizer.json`` (a path would differ between machines; the content does not)."""
    if tokenizer is None:
        return TINY_TOKENIZER
    import hashlib

    file = Path(tokenizer) / "tokenizer.json"
    if not file.is_file():
        raise BenchError(f"tokenizer folder {tokenizer}: no tokenizer.json (write one with `qerl-pretrained "
                         f"qwen2.5-coder-0.5b --tokenizer-only --out {tokenizer}`)")
    return "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()


def load_tokenizer(tokenizer: Path | None, vocab_size: int):
    """The checkpoint's tokenizer: the tiny 512-id BPE when ``tokenizer`` is None, else the folder's; refused when
    it has more ids than the model's ``vocab_size`` (the model could not embed them)."""
    from verl_qerl.testing.tiny import build_tokenizer

    if tokenizer is None:
        return build_tokenizer(512)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    if len(tok) > vocab_size:
        raise BenchError(f"tokenizer {tokenizer} has {len(tok)} ids, more than the model's vocab_size {vocab_size}")
    return tok


def write_random_checkpoint(folder: Path, shape: dict, fmt: str, *, seed: int = 0, device: str | None = None,
                            show_progress: bool = True, tokenizer: Path | None = None) -> Path:
    """Write a random Qwen2 checkpoint (``fmt`` 'bf16' or 'nvfp4') shard by shard; returns ``folder``.

    ``tokenizer``: a tokenizer folder (e.g. Qwen2.5's, ``qerl-pretrained ... --tokenizer-only``) saved into the
    checkpoint, its EOS / pad ids in ``config.json``; default the tiny 512-id BPE. Which one matters to a rollout:
    verl masks every logit at or above ``len(tokenizer)``, so the tiny one lets the model sample only 512 ids.
    A complete folder is reused when its marker names the same tokenizer, otherwise written again.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from verl_qerl.nvfp4 import fused_global_scale, quantize
    from verl_qerl.nvfp4.checkpoint import ct_quantization_config, ct_tensors

    want = tokenizer_identity(tokenizer)
    if (folder / DONE).is_file():
        done = json.loads((folder / DONE).read_text())
        have = done.get("tokenizer", TINY_TOKENIZER)
        if have == want:
            print(f"[rollout] reusing {folder}", flush=True)
            return folder
        print(f"[rollout] {folder} was written with tokenizer {have}, {want} asked: writing it again", flush=True)
    if folder.exists():
        shutil.rmtree(folder)
    check_disk(folder.parent, checkpoint_bytes(shape, fmt), f"the {fmt} checkpoint")
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(tokenizer, shape["vocab_size"])
    tok.save_pretrained(tmp)
    config = qwen2_config(shape, tok.eos_token_id, tok.pad_token_id)
    if fmt == "nvfp4":
        config["quantization_config"] = ct_quantization_config(["lm_head"])
    weight_map: dict[str, str] = {}
    total = 0
    n_layers = shape["num_hidden_layers"]
    h, v = shape["hidden_size"], shape["vocab_size"]
    shards: list[tuple[str, dict[str, tuple[int, ...]]]] = [("model-embed.safetensors",
                                                              {"model.embed_tokens.weight": (v, h)})]
    shards += [(f"model-layer-{i:03d}.safetensors", layer_tensor_shapes(shape, i)) for i in range(n_layers)]
    shards.append(("model-head.safetensors", {"model.norm.weight": (h,), "lm_head.weight": (v, h)}))
    bar = tqdm(shards, desc=f"write {fmt} {folder.name}", unit="shard", disable=not show_progress)
    for shard, names in bar:
        made = {name: _random_tensor(name, s, seed, device) for name, s in names.items()}
        out: dict[str, torch.Tensor] = {}
        if fmt == "nvfp4":
            groups = {}
            for name in made:
                if name.endswith("proj.weight"):
                    leaf = name.rsplit(".", 2)[-2]
                    key = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
                    groups.setdefault(key.get(leaf, leaf), []).append(name)
            for members in groups.values():
                gs = fused_global_scale([made[m] for m in members], members)
                for m in members:
                    out.update(ct_tensors(m.removesuffix(".weight"), quantize(made.pop(m), gs, name=m)))
        out.update(made)
        out = {k: t.to("cpu").contiguous() for k, t in out.items()}
        save_file(out, tmp / shard, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update({k: shard for k in out})
        del made, out
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / DONE).write_text(json.dumps({"fmt": fmt, "seed": seed, "bytes": total, "tokenizer": want,
                                        "tokenizer_len": len(tok)}))
    tmp.rename(folder)
    return folder


def write_config_only(folder: Path, shape: dict) -> Path:
    """config.json + tokenizer, for ``load_format='dummy'`` engines."""
    from verl_qerl.testing.tiny import build_tokenizer

    if (folder / DONE).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(512)
    tok.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(qwen2_config(shape, tok.eos_token_id, tok.pad_token_id), indent=2))
    (folder / DONE).write_text("{}")
    return folder


def quantize_with_progress(src: Path, dst: Path) -> Path:
    from tqdm import tqdm

    from verl_qerl.checkpoint_conversion import quantize_checkpoint

    if (dst / DONE).is_file():
        print(f"[rollout] reusing {dst}", flush=True)
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    quantize_checkpoint(src, dst, progress=lambda it, total, desc: tqdm(it, total=total, desc=desc, leave=False))
    (dst / DONE).write_text("{}")
    return dst


def write_lora_adapter(folder: Path, config: dict, rank: int = LORA_RANK, seed: int = 1) -> Path:
    """A random peft LoRA adapter (A and B nonzero) on q/k/v/o/gate/up/down of every layer."""
    import torch
    from safetensors.torch import save_file

    if (folder / DONE).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for mod, (d_in, d_out) in dims.items():
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            base = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            a = torch.randn(rank, d_in, generator=gen) * (1.0 / d_in**0.5)
            b = torch.randn(d_out, rank, generator=gen) * 0.01
            tensors[f"{base}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{base}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(LORA_TARGETS), "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    (folder / DONE).write_text("{}")
    return folder


def build_model(job: dict) -> dict:
    """Make the folders one model's backends need; returns their paths and what was done instead."""
    work = Path(job["work_dir"]) / job["model"]
    work.mkdir(parents=True, exist_ok=True)
    backends, info = job["backends"], {"skipped": {}}
    if job["model"] == "tiny":
        from verl_qerl.testing.tiny import make_tiny_model

        bf16 = work / "bf16"
        if not (bf16 / DONE).is_file():
            shutil.rmtree(bf16, ignore_errors=True)
            make_tiny_model(bf16)
            (bf16 / DONE).write_text("{}")
        info["bf16"] = str(bf16)
        info["nvfp4"] = str(quantize_with_progress(bf16, work / "nvfp4"))
        config = json.loads((bf16 / "config.json").read_text())
    else:
        shape = SHAPES[job["model"]]
        config = qwen2_config(shape, 0, 0)
        want_bf16 = any(b in backends for b in ("bf16", "nf4"))
        mode = job["bf16_checkpoint"]
        write_bf16 = want_bf16 and (mode == "always" or (mode == "auto" and job["model"] != "32b"))
        if write_bf16 and job["model"] == "32b" and mode == "always":
            check_disk(work, checkpoint_bytes(shape, "bf16") + checkpoint_bytes(shape, "nvfp4"),
                       "the 32B BF16 + NVFP4 checkpoints")
        if write_bf16:
            bf16 = write_random_checkpoint(work / "bf16", shape, "bf16", seed=job["seed"])
            info["bf16"] = str(bf16)
        elif want_bf16:
            info["bf16"] = str(write_config_only(work / "config-only", shape))
            info["bf16_dummy"] = True
            if "nf4" in backends:
                info["skipped"]["nf4"] = ("no BF16 checkpoint written (32B BF16 is 65.5 GB, over the disk); vLLM's "
                                          "bitsandbytes path quantizes a BF16 checkpoint while loading and has no "
                                          "dummy-weight path we know of")
        if any(b in backends for b in ("qerl_nvfp4", "ct_marlin")):
            if write_bf16 and not job["nvfp4_direct"]:
                info["nvfp4"] = str(quantize_with_progress(bf16, work / "nvfp4"))
            else:
                info["nvfp4"] = str(write_random_checkpoint(work / "nvfp4", shape, "nvfp4", seed=job["seed"]))
    if job["lora"]:
        info["lora"] = str(write_lora_adapter(work / f"lora-r{LORA_RANK}", config))
    return info
