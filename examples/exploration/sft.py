"""Supervised warm-start of the exploration study's policy: a small Qwen2 trained from scratch on generated problems.

Why: QeRL's exploration claim needs a policy that already follows the answer format and solves *some* problems
(RL has nothing to reinforce at 0% and little to gain near 100%). No hub weights are used, so the study makes its
own: a Qwen2-architecture model of ~25M parameters and a byte-level BPE tokenizer, both trained here, supervised
on ``sft.jsonl`` from :mod:`problems`, and stopped the first time its greedy accuracy on the held-out ``dev`` split
reaches ``--stop-acc`` (or at ``--max-steps`` / ``--time-limit``), so RL starts from partial accuracy.

Choices that matter downstream:

* The tokenizer uses exactly the pre-tokenization that transformers' ``Qwen2Tokenizer`` forces on every
  ``model_type=qwen2`` checkpoint (Qwen's split regex, in which each digit is its own piece, then byte-level), so
  the merges learned here are the ones vLLM and verl apply, and digits are single tokens (good for arithmetic).
  ChatML ``<|im_start|>``/``<|im_end|>`` with a chat template: verl renders prompts with it.
* All Linear dims are multiples of 128 (NVFP4 scales 16-element blocks along K; the FP4 kernel wants K % 128 == 0).
* The loss covers response tokens only (prompt tokens are context), including the closing ``<|im_end|>`` so the
  model learns to stop; prompts are tokenized on their own, as verl does, so SFT and RL see the same ids.
* Accuracy uses the strict GSM8K rule verl's reward uses (:func:`problems.gsm8k_strict_score`).

Writes ``--out``: ``model.safetensors`` + ``config.json`` (bf16), tokenizer files, ``generation_config.json``,
``sft_log.json`` (loss and accuracy curves, wall time, why it stopped). Deterministic given ``--seed`` on CPU
(GPU kernels may differ in the last bits).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from problems import gsm8k_strict_score  # noqa: E402

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: transformers' Qwen2Tokenizer pre-tokenizer regex (each ``\p{N}`` is its own piece: single-digit tokens).
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def render_prompt(messages: list[dict[str, str]]) -> str:
    """The chat template applied with ``add_generation_prompt=True`` (what verl feeds the rollout)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def build_tokenizer(texts: list[str], vocab_size: int = 1024):
    """Train a byte-level BPE with Qwen2's pre-tokenization and ChatML specials on ``texts``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def build_config(vocab_size: int, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 eos_id: int, pad_id: int, max_positions: int = 1024):
    """A Qwen2 config (untied embeddings, bf16)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_positions, tie_word_embeddings=False, rope_theta=10000.0,
                       eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, use_sliding_window=False,
                       dtype="bfloat16")


def check_args(args: argparse.Namespace) -> None:
    """Refuse settings that cannot work, naming the flag."""
    positive = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "batch_size", "max_steps",
                "eval_every", "eval_n", "max_new_tokens")
    for key in positive:
        if getattr(args, key) <= 0:
            raise SystemExit(f"sft.py: --{key.replace('_', '-')} must be > 0, got {getattr(args, key)}")
    if args.hidden % args.heads:
        raise SystemExit(f"sft.py: --hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.heads % args.kv_heads:
        raise SystemExit(f"sft.py: --heads {args.heads} is not divisible by --kv-heads {args.kv_heads}")
    if not args.allow_odd_dims:
        kv_dim = args.hidden // args.heads * args.kv_heads
        for flag, value in (("--hidden", args.hidden), ("--intermediate", args.intermediate), ("k/v dim", kv_dim)):
            if value % 128:
                raise SystemExit(f"sft.py: {flag}={value} is not a multiple of 128 (NVFP4 blocks and the FP4 kernel "
                                 "need it); pass --allow-odd-dims for a model only used on the torch path")
    if not 0.0 < args.stop_acc <= 1.0:
        raise SystemExit(f"sft.py: --stop-acc must be in (0, 1], got {args.stop_acc}")
    if args.lr <= 0 or args.time_limit <= 0:
        raise SystemExit("sft.py: --lr and --time-limit must be > 0")
    if args.vocab < 300:
        raise SystemExit(f"sft.py: --vocab {args.vocab} is below the 256 byte symbols + specials")
    for flag in ("data",):
        d = Path(getattr(args, flag))
        for name in ("sft.jsonl", "dev.jsonl"):
            if not (d / name).is_file():
                raise SystemExit(f"sft.py: {d / name} not found (make it with problems.py --out {d})")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise SystemExit(f"sft.py: --out {out} exists and is not empty (pass --force to overwrite)")


def encode_examples(tok, rows: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + eos) per row; the prompt is tokenized alone, as verl does."""
    prompts = tok([render_prompt(r["prompt"]) for r in rows], add_special_tokens=False)["input_ids"]
    responses = tok([r["response"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p, r + [tok.eos_token_id]) for p, r in zip(prompts, responses)]


def make_batch(examples: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device):
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    length = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(examples):
        seq = p + r
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p): len(seq)] = torch.tensor(r)
        mask[i, : len(seq)] = 1
    return ids.to(device), mask.to(device), labels.to(device)


@torch.no_grad()
def greedy_accuracy(model, tok, rows: list[dict[str, Any]], *, device: torch.device, batch_size: int,
                    max_new_tokens: int, autocast: bool) -> tuple[float, list[str]]:
    """Greedy (KV-cached, batched, left-padded) generation; exact match of the ``####`` answer."""
    model.eval()
    prompts = tok([render_prompt(r["prompt"]) for r in rows], add_special_tokens=False)["input_ids"]
    outs: list[str] = []
    for start in range(0, len(rows), batch_size):
        chunk = prompts[start: start + batch_size]
        length = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), length), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, length - len(p):] = torch.tensor(p)
            mask[i, length - len(p):] = 1
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        outs += tok.batch_decode(gen[:, length:], skip_special_tokens=True)
    model.train()
    scores = [gsm8k_strict_score(o, r["answer"]) for o, r in zip(outs, rows)]
    return sum(scores) / max(len(scores), 1), outs


def train(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    autocast = device.type == "cuda"
    data = Path(args.data)
    sft_rows, dev_rows = read_jsonl(data / "sft.jsonl"), read_jsonl(data / "dev.jsonl")[: args.eval_n]
    if args.n_sft:
        sft_rows = sft_rows[: args.n_sft]
    corpus = [render_prompt(r["prompt"]) + r["response"] for r in sft_rows[:20000]]
    tok = build_tokenizer(corpus, args.vocab)
    examples = encode_examples(tok, sft_rows)
    vocab = math.ceil(len(tok) / 128) * 128
    cfg = build_config(vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                       intermediate=args.intermediate, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    order = random.Random(args.seed)
    log: dict[str, Any] = {
        "args": vars(args), "device": str(device), "n_params": n_params, "vocab_size": vocab,
        "tokenizer_size": len(tok), "n_sft_examples": len(examples), "n_dev": len(dev_rows),
        "prompt_tokens_max": max(len(p) for p, _ in examples), "response_tokens_max": max(len(r) for _, r in examples),
        "loss": [], "eval": [],
    }
    print(f"[sft] {n_params / 1e6:.1f}M params, vocab {vocab}, {len(examples)} examples on {device}; "
          f"stop at dev acc >= {args.stop_acc}, {args.max_steps} steps or {args.time_limit:.0f} s", flush=True)
    stopped_by = "max_steps"
    step = 0
    bar = tqdm(total=args.max_steps, desc="sft", mininterval=5, file=sys.stdout)
    model.train()
    perm: list[int] = []
    while step < args.max_steps:
        if len(perm) < args.batch_size:
            perm += order.sample(range(len(examples)), len(examples))
        batch_idx, perm = perm[: args.batch_size], perm[args.batch_size:]
        ids, mask, labels = make_batch([examples[i] for i in batch_idx], tok.pad_token_id, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        loss_value = loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        if step % args.log_every == 0 or step == 1:
            log["loss"].append({"step": step, "loss": loss_value, "t": round(time.time() - t0, 2)})
            bar.set_postfix(loss=f"{loss_value:.3f}")
        timed_out = time.time() - t0 >= args.time_limit
        if step % args.eval_every == 0 or step == args.max_steps or timed_out:
            acc, outs = greedy_accuracy(model, tok, dev_rows, device=device, batch_size=args.eval_batch_size,
                                        max_new_tokens=args.max_new_tokens, autocast=autocast)
            log["eval"].append({"step": step, "dev_acc": acc, "t": round(time.time() - t0, 2), "sample": outs[0]})
            print(f"\n[sft] step {step} loss {loss_value:.4f} dev acc {acc:.3f} ({time.time() - t0:.0f} s)",
                  flush=True)
            if acc >= args.stop_acc:
                stopped_by = "stop_acc"
                break
            if timed_out:
                stopped_by = "time_limit"
                break
    bar.close()
    log.update(steps=step, stopped_by=stopped_by, train_wall_s=round(time.time() - t0, 2),
               final_dev_acc=log["eval"][-1]["dev_acc"] if log["eval"] else None)
    save(model, tok, Path(args.out), log)
    # the saved bf16 weights through a fresh load, as verl will see them
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).to(device)
    tok2 = AutoTokenizer.from_pretrained(args.out)
    check_tokenizer(tok, tok2, corpus[:50])
    acc, _ = greedy_accuracy(reloaded, tok2, dev_rows, device=device, batch_size=args.eval_batch_size,
                             max_new_tokens=args.max_new_tokens, autocast=False)
    log.update(saved_bf16_dev_acc=acc, wall_s=round(time.time() - t0, 2))
    (Path(args.out) / "sft_log.json").write_text(json.dumps(log, indent=1))
    print(f"[sft] stopped by {stopped_by} at step {step}: dev acc {log['final_dev_acc']} (fp32), {acc:.3f} (saved "
          f"bf16); {log['wall_s']:.0f} s; checkpoint {args.out}", flush=True)
    return log


def check_tokenizer(trained, loaded, texts: list[str]) -> None:
    """The saved tokenizer, as transformers reloads it (Qwen2Tokenizer), must encode like the trained one."""
    if not getattr(loaded, "chat_template", None):
        raise RuntimeError("saved tokenizer lost its chat template")
    for text in texts:
        a = trained(text, add_special_tokens=False)["input_ids"]
        b = loaded(text, add_special_tokens=False)["input_ids"]
        if a != b:
            raise RuntimeError(f"reloaded tokenizer ({type(loaded).__name__}) encodes differently: {text[:80]!r}")


def save(model, tok, out: Path, log: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    gc.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "sft_log.json").write_text(json.dumps(log, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder written by problems.py (sft.jsonl, dev.jsonl)")
    ap.add_argument("--out", required=True, help="checkpoint folder")
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary (model vocab rounds up to 128)")
    ap.add_argument("--allow-odd-dims", action="store_true", help="skip the multiple-of-128 check")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--time-limit", type=float, default=150.0, help="seconds of training before it stops anyway")
    ap.add_argument("--stop-acc", type=float, default=0.3, help="stop when greedy dev accuracy first reaches this")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-n", type=int, default=256, help="dev problems per evaluation")
    ap.add_argument("--eval-batch-size", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--n-sft", type=int, default=0, help="use only the first N SFT examples (0: all)")
    ap.add_argument("--log-every", type=int, default=20)
    args = ap.parse_args(argv)
    check_args(args)
    return args


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
