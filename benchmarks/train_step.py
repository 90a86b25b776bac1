"""One LoRA training step of a Qwen2.5-7B-shaped policy: NVFP4 vs BF16 vs NF4 (QLoRA), one run.

Every mode goes through the same code path (``quantize_model(model, mode)`` then
``get_lora_model``): random weights built on the GPU (no download), batch 4 x seq 2048, gradient
checkpointing on, LoRA rank 32 / alpha 64 on q/k/v/o/gate/up/down, adapters in bf16 (as verl casts
them to the frozen parameters' dtype), AdamW. Per mode: weight memory (whole model, and the Linear
layers alone), peak memory of a step, and the median step time (forward + backward + optimizer)
after warm-up steps.

    python benchmarks/train_step.py                       # GPU: writes benchmarks/results/train_step-<gpu>.json
    python benchmarks/train_step.py --tiny --device cpu   # smoke test of the script itself
    python benchmarks/train_step.py --fsdp2 --modes bf16,nvfp4,nvfp4:shard-base   # as verl's FSDP2 actor

``--fsdp2`` wraps the LoRA model the way verl 0.9.1's ``apply_fsdp2`` does (``fully_shard`` on every decoder
layer, the embedding and lm_head, then the root; bf16 params, fp32 gradient reduction) on a one-rank process
group, i.e. the GRPO step's single-GPU actor. Mode ``nvfp4:shard-base`` first makes every ``NVFP4Linear`` an
FSDP2 unit of its own (``shard_nvfp4_base``, what ``qerl.shard_base=true`` does in verl), so the cost of those
196 extra units at 7B is measured against ``nvfp4`` without them, side by side.

Results JSON: ``device``, ``versions``, ``command``, ``date``, ``rows`` and ``targets`` (see README).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from results_format import target_status  # benchmarks/: this script's own folder

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=False, rms_norm_eps=1e-6)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _tensor_bytes(model) -> int:
    """Bytes of a model's parameters and buffers (off-GPU stand-in for the allocator's figure)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def build_model(shape: dict, device: torch.device, seed: int = 0):
    """A random-weight Qwen2 causal LM in bf16, made directly on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, initializer_range=0.02, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return model


def non_linear_bytes(model) -> int:
    """Bytes of everything but the decoder's Linear layers (embeddings, lm_head, norms): the same in
    every mode, subtracted from the model's memory to get the Linear layers' weight memory."""
    total = 0
    for name, p in model.named_parameters():
        if not any(f".{t}." in name for t in TARGETS):
            total += p.numel() * p.element_size()
    return total


def _process_group(device: torch.device):
    """A one-rank process group and device mesh (FSDP2 needs one even on a single GPU, as in verl)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    return init_device_mesh(device.type, (1,))


def wrap_fsdp2(model, device: torch.device, *, shard_base: bool) -> int:
    """``fully_shard`` as verl's ``apply_fsdp2`` (decoder layers, embeddings / lm_head, root; bf16 params, fp32
    reduce), after ``shard_nvfp4_base`` when ``shard_base``. Returns the number of FSDP2 units."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _process_group(device)
    units = 0
    if shard_base:
        from verl_qerl.modeling.fsdp import shard_nvfp4_base

        units += len(shard_nvfp4_base(model, mesh=mesh, reshard_after_forward=True))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if type(module).__name__ == "Qwen2DecoderLayer" or (leaf in ("embed_tokens", "lm_head")
                                                            and hasattr(module, "weight")):
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
            units += 1
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    return units + 1


def run_mode(mode: str, args, shape: dict, device: torch.device, nonlinear: int) -> dict:
    from verl_qerl.modeling import get_lora_model, kernel_backend, quantize_model

    mode, _, option = mode.partition(":")
    if option not in ("", "shard-base") or (option and (mode != "nvfp4" or not args.fsdp2)):
        raise ValueError(f"mode {mode}:{option}: the only option is nvfp4:shard-base, with --fsdp2")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base_mem = _allocated(device)
    t0 = time.perf_counter()
    model = build_model(shape, device)
    _sync(device)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    quantize_model(model, mode)
    _sync(device)
    t_convert = time.perf_counter() - t0
    gc.collect()
    weight_mem = _allocated(device) - base_mem if device.type == "cuda" else _tensor_bytes(model)
    model = get_lora_model(model, r=args.rank, lora_alpha=2 * args.rank, target_modules=list(TARGETS))
    for p in model.parameters():  # verl casts adapters to the frozen parameters' dtype
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False
    model.train()
    fsdp_units = wrap_fsdp2(model, device, shard_base=option == "shard-base") if args.fsdp2 else 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    g = torch.Generator(device="cpu").manual_seed(123)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).to(device)

    losses, times = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        del loss
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) - base_mem if device.type == "cuda" else 0
    row = {
        "mode": f"{mode}:{option}" if option else mode,
        "fsdp2_units": fsdp_units,
        "kernel_backend": kernel_backend() if mode == "nvfp4" else ("bitsandbytes" if mode == "nf4" else "cuBLAS"),
        "weight_mem_gb": weight_mem / GB,
        "linear_weight_mem_gb": (weight_mem - nonlinear) / GB,
        "peak_mem_gb": peak / GB,
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "losses": losses,
        "trainable_params": sum(p.numel() for p in trainable),
        "build_s": t_build,
        "convert_s": t_convert,
    }
    del model, opt, trainable, ids
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def dequant_check(shape: dict, device: torch.device) -> dict:
    """The NVFP4 path's dequantization on this device vs the format's reference: bit-exactness and
    time for one gate_proj-sized weight (what the large-M training path runs 3x per layer per step)."""
    from verl_qerl.modeling import _ops
    from verl_qerl.nvfp4 import dequantize, quantize

    w = torch.randn(shape["intermediate_size"], shape["hidden_size"], device=device, dtype=torch.bfloat16) * 0.02
    q = quantize(w)
    out = {"backend": _ops.backend()}

    def timed(fn) -> float:
        fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / 10 * 1e3

    ref = dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16)
    got = _ops.dequantize(q.packed, q.scale.view(torch.uint8), q.global_scale, torch.bfloat16)
    out["bit_exact"] = bool(torch.equal(ref, got))
    out["ms_dispatch"] = timed(lambda: _ops.dequantize(q.packed, q.scale.view(torch.uint8), q.global_scale,
                                                       torch.bfloat16))
    out["ms_reference"] = timed(lambda: dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16))
    return out


def versions() -> dict:
    import peft
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "transformers": transformers.__version__, "peft": peft.__version__}
    try:
        import bitsandbytes

        v["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        v["bitsandbytes"] = None
    return v


def write_results(out: Path, args, shape: dict, dev_name: str, kernels_info: dict, nonlinear: int,
                  rows: list[dict]) -> list[dict]:
    """Write the results JSON (after every mode, so a run cut short keeps what it measured)."""
    by = {r["mode"]: r for r in rows if "error" not in r}

    def ratio(a: str, b: str, key: str) -> float | None:
        return by[a][key] / by[b][key] if a in by and b in by and by[b][key] else None

    fsdp_targets = [] if "nvfp4:shard-base" not in by else [
        {"name": "step time nvfp4:shard-base/nvfp4 (FSDP2 units of the base on one rank)",
         "measured": ratio("nvfp4:shard-base", "nvfp4", "step_time_s"), "op": "<=", "target": 1.01},
        {"name": "step time nvfp4:shard-base/bf16", "measured": ratio("nvfp4:shard-base", "bf16", "step_time_s"),
         "op": "<=", "target": 1.05}]

    targets = [
        {"name": "linear weight memory nvfp4/bf16", "measured": ratio("nvfp4", "bf16", "linear_weight_mem_gb"),
         "op": "<=", "target": 0.30},
        {"name": "step time nvfp4/bf16", "measured": ratio("nvfp4", "bf16", "step_time_s"), "op": "<=",
         "target": 1.15},
        {"name": "step time nvfp4/nf4", "measured": ratio("nvfp4", "nf4", "step_time_s"), "op": "<=", "target": 1.0},
        *fsdp_targets,
    ]
    if "nf4" not in by:  # no NF4 row measured (--modes without nf4): no target against it
        targets = [t for t in targets if not t["name"].endswith("/nf4")]
    result = {
        "benchmark": "train_step",
        "device": dev_name,
        "versions": versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": {"shape": shape, "batch": args.batch, "seq": args.seq, "lora_rank": args.rank,
                   "lora_alpha": 2 * args.rank, "lora_targets": list(TARGETS), "gradient_checkpointing": True,
                   "warmup": args.warmup, "steps": args.steps, "adapter_dtype": "bfloat16", "optimizer": "AdamW",
                   "attn_implementation": "sdpa", "fsdp2": args.fsdp2},
        "kernels": kernels_info,
        "non_linear_weight_gb": nonlinear / GB,
        "whole_model_weight_ratio_nvfp4_bf16": ratio("nvfp4", "bf16", "weight_mem_gb"),
        "rows": rows,
        "targets": targets,
    }
    text = json.dumps(result, indent=2) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(text)
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="bf16,nvfp4,nf4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--fsdp2", action="store_true",
                    help="wrap each mode's model in FSDP2 on a one-rank group as verl's actor (modes may then "
                         "include nvfp4:shard-base)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/train_step-<gpu>.json)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shape = TINY if args.tiny else QWEN25_7B
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    kernels_info: dict = {}
    if device.type == "cuda":
        from verl_qerl import kernels

        t0 = time.perf_counter()
        kernels_info["cuda_kernels"] = kernels.load_extension()
        kernels_info["load_s"] = time.perf_counter() - t0
        kernels_info["unavailable_reason"] = kernels.cuda_unavailable_reason()
    kernels_info["dequant"] = dequant_check(shape, device)
    print("kernels:", json.dumps(kernels_info), flush=True)
    nonlinear = 0
    model = build_model(shape, torch.device("meta"))
    nonlinear = non_linear_bytes(model)
    del model
    slug = "".join(c if c.isalnum() else "-" for c in dev_name.lower()).strip("-") or "cpu"
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"train_step-{slug}.json"
    rows: list[dict] = []
    targets: list[dict] = []
    for mode in args.modes.split(","):
        try:
            row = run_mode(mode, args, shape, device, nonlinear)
        except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others' figures
            row = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_times_s", "losses")}), flush=True)
        targets = write_results(out, args, shape, dev_name, kernels_info, nonlinear, rows)
    print(f"{'mode':6} {'weights GB':>10} {'linear GB':>9} {'peak GB':>8} {'step s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:6} ERROR {r['error']}")
        else:
            print(f"{r['mode']:6} {r['weight_mem_gb']:10.2f} {r['linear_weight_mem_gb']:9.2f} {r['peak_mem_gb']:8.2f} "
                  f"{r['step_time_s']:7.3f}")
    for t in targets:
        m = t["measured"]
        print(f"target {t['name']}: {m if m is None else round(m, 3)} {t['op']} {t['target']} -> {target_status(t)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
