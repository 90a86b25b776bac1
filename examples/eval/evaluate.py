"""Accuracy of a QeRL policy (NVFP4 base + LoRA adapter) on GSM8K / MATH500 through vLLM.

usage:
  python examples/eval/evaluate.py --model Qwen2.5-7B-Instruct --adapter ckpt/actor/lora_adapter \\
      --data ~/data/gsm8k/test.parquet [--quantization qerl_nvfp4] [--samples 4] [--limit 500] [--out result.json]

The data is a parquet in verl's schema (examples/data/prepare.py); each response is graded by verl's scorer
for its ``data_source`` (GSM8K ``####``, DAPO-style ``Answer:``), so evaluation and RL training use the same
reward. Sampling follows the paper's evaluation: temperature 0.6, top-p 0.95; pass@1 is averaged over
``--samples`` samples per prompt. ``--quantization`` ``qerl_nvfp4`` (default: the model is quantized at load, or an
NVFP4 checkpoint is read as is), ``none`` (BF16) or ``bitsandbytes`` (NF4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _score(data_source: str, response: str, truth: str) -> float:
    from verl.utils.reward_score import default_compute_score

    result = default_compute_score(data_source, response, truth)
    if isinstance(result, dict):  # math_dapo: {"score": +-1, "acc": bool, "pred": ...}
        return float(bool(result["acc"])) if "acc" in result else float(result["score"] > 0)
    return float(result > 0.5)  # gsm8k / math: 1.0 correct, 0.0 (or a small format score) otherwise


def pass_at_1(data_sources: list[str], truths: list[str], completions: list[list[str]]) -> tuple[list[float], float]:
    """Per prompt, the fraction of its sampled completions graded correct; and their mean over prompts (pass@1)."""
    per_prompt = []
    for source, truth, texts in zip(data_sources, truths, completions, strict=True):
        if not texts:
            raise ValueError(f"pass_at_1: a prompt with no completions (data_source={source!r})")
        per_prompt.append(sum(_score(source, text, truth) for text in texts) / len(texts))
    if not per_prompt:
        raise ValueError("pass_at_1: no prompts")
    return per_prompt, sum(per_prompt) / len(per_prompt)


#: vLLM's accepted ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``), read from vLLM where it has them
_VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank`` (vLLM takes only a few values:
    ``max(8, rank)`` made its constructor refuse adapters of rank 12, 24, 48...)."""
    allowed = _VLLM_MAX_LORA_RANKS
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks

        allowed = tuple(sorted(typing.get_args(MaxLoRARanks))) or allowed
    except ImportError:  # another vLLM layout: the values above (vLLM 0.24 / 0.32)
        pass
    for value in allowed:
        if value >= rank:
            return value
    raise ValueError(f"adapter rank {rank} is above the largest max_lora_rank vLLM accepts ({allowed[-1]})")


def evaluate(args: argparse.Namespace) -> dict:
    import pandas as pd
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    frame = pd.read_parquet(args.data)
    if args.limit is not None:
        frame = frame.iloc[: args.limit]
    llm_kwargs = dict(model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
                      gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    if args.quantization != "none":
        llm_kwargs["quantization"] = args.quantization
    if args.adapter:
        rank = json.loads((Path(args.adapter) / "adapter_config.json").read_text())["r"]
        llm_kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(rank), max_loras=1)
    llm = LLM(**llm_kwargs)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
               for p in frame["prompt"]]
    params = SamplingParams(n=args.samples, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    lora = LoRARequest("adapter", 1, str(args.adapter)) if args.adapter else None
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=lora)
    gen_s = time.perf_counter() - t0
    truths = [row["reward_model"]["ground_truth"] for _, row in frame.iterrows()]
    per_prompt, accuracy = pass_at_1(list(frame["data_source"]), truths,
                                     [[c.text for c in out.outputs] for out in outputs])
    n_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {"data": str(args.data), "model": str(args.model), "adapter": str(args.adapter) if args.adapter else None,
            "quantization": args.quantization, "prompts": len(per_prompt), "samples": args.samples,
            "pass@1": accuracy, "per_prompt": per_prompt, "generated_tokens": n_tokens, "generate_s": gen_s,
            "tokens_per_s": n_tokens / gen_s if gen_s > 0 else None,
            "sampling": {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="BF16 or NVFP4 checkpoint folder")
    ap.add_argument("--adapter", help="peft LoRA adapter folder (verl's lora_adapter checkpoint)")
    ap.add_argument("--data", required=True, help="parquet in verl's schema (examples/data/prepare.py)")
    ap.add_argument("--quantization", default="qerl_nvfp4", choices=["qerl_nvfp4", "none", "bitsandbytes"])
    ap.add_argument("--samples", type=int, default=1, help="samples per prompt (pass@1 averaged over them)")
    ap.add_argument("--limit", type=int, help="evaluate the first N prompts")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the result JSON here")
    args = ap.parse_args(argv)
    for path, what in ((args.data, "--data"), (args.model, "--model")):
        if not os.path.exists(path):
            print(f"evaluate: error: {what} {path} does not exist", file=sys.stderr)
            return 2
    if args.adapter and not (Path(args.adapter) / "adapter_config.json").is_file():
        print(f"evaluate: error: --adapter {args.adapter} has no adapter_config.json", file=sys.stderr)
        return 2
    if args.limit is not None and args.limit < 1:
        print(f"evaluate: error: --limit {args.limit}: give at least 1 prompt (leave it out for all)", file=sys.stderr)
        return 2
    if args.out and not Path(args.out).expanduser().parent.is_dir():  # checked before the whole evaluation runs
        print(f"evaluate: error: --out {args.out}: folder {Path(args.out).expanduser().parent} does not exist",
              file=sys.stderr)
        return 2
    if args.adapter:
        rank = json.loads((Path(args.adapter) / "adapter_config.json").read_text())["r"]
        try:
            vllm_max_lora_rank(rank)
        except ValueError as err:
            print(f"evaluate: error: --adapter {args.adapter}: {err}", file=sys.stderr)
            return 2
    result = evaluate(args)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).expanduser().write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
