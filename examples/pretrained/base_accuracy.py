"""Greedy base accuracy of a pretrained policy on graded generated GSM8K-format arithmetic problems.

An RL study needs a task the policy starts on at roughly 10-40% accuracy: high enough that GRPO's
groups contain rewarded samples, low enough to leave room to learn. This script scores a Hugging
Face folder (e.g. ``qerl-pretrained qwen2.5-coder-0.5b``) greedily with transformers on problems from
``examples/exploration/problems.py`` at several difficulty levels, with the same chat prompt and
strict ``#### <answer>`` grading (verl's GSM8K scorer) as the training data, plus a ``\\boxed{N}`` score
(how the Qwen2.5 instruct models state an answer unprompted) and a lenient one (the last number in the
response), which separate "cannot compute" from "ignores the format", and the study's reward
(``numeric``: :mod:`verl_qerl.verl.reward`, the last ``\\boxed{N}`` / ``#### N`` / "The answer is N").

usage: python examples/pretrained/base_accuracy.py MODEL_DIR [--n 24] [--levels L1,L2,L3] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exploration"))
from problems import Difficulty, generate, gsm8k_strict_score  # noqa: E402

from verl_qerl.verl.reward import score_numeric  # noqa: E402

#: Graded levels: more operations, larger values, then division.
LEVELS: dict[str, Difficulty] = {
    "L1": Difficulty(min_ops=1, max_ops=2, max_start=20, max_operand=20, max_factor=3, max_value=100, ops="+-"),
    "L2": Difficulty(min_ops=2, max_ops=3, max_start=30, max_operand=30, max_factor=5, max_value=300, ops="+-*"),
    "L3": Difficulty(min_ops=3, max_ops=4, max_start=50, max_operand=50, max_factor=6, max_value=1000, ops="+-*"),
    "L4": Difficulty(min_ops=4, max_ops=6, max_start=99, max_operand=99, max_factor=9, max_value=5000, ops="+-*/"),
    "L5": Difficulty(min_ops=6, max_ops=8, max_start=99, max_operand=99, max_factor=9, max_value=20000, ops="+-*/"),
}


def last_number(text: str) -> str | None:
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return found[-1].replace(",", "") if found else None


def score_level(model, tok, problems, max_new_tokens: int, batch: int, label: str = "") -> dict:
    from tqdm.auto import tqdm  # a level is minutes of greedy decoding on a CPU: show the batches

    strict = lenient = boxed = numeric = 0
    lengths, samples = [], []
    for start in tqdm(range(0, len(problems), batch), desc=label or "problems", unit="batch"):
        chunk = problems[start:start + batch]
        texts = [tok.apply_chat_template(p.prompt, tokenize=False, add_generation_prompt=True) for p in chunk]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        for p, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
            text = tok.decode(row, skip_special_tokens=True)
            strict += gsm8k_strict_score(text, str(p.answer)) == 1.0
            lenient += last_number(text) == str(p.answer)
            boxed += score_numeric(text, str(p.answer), forms=("boxed",)) == 1.0  # the last \boxed{N} only
            numeric += score_numeric(text, str(p.answer)) == 1.0
            lengths.append(int((row != tok.pad_token_id).sum()))
            if len(samples) < 2:
                samples.append({"question": p.question, "answer": p.answer, "response": text})
    n = len(problems)
    return {"n": n, "strict": strict / n, "lenient": lenient / n, "boxed": boxed / n, "numeric": numeric / n,
            "mean_tokens": sum(lengths) / n,
            "samples": samples}


def parse_levels(text: str) -> list[str]:
    """``--levels``: comma-separated names of :data:`LEVELS` (spaces around them allowed), each once."""
    names = [name.strip() for name in text.split(",")]
    if not names or any(not name for name in names):
        raise ValueError(f"{text!r}: expected comma-separated level names from {list(LEVELS)}")
    unknown = [name for name in names if name not in LEVELS]
    if unknown:
        raise ValueError(f"{text!r}: unknown level(s) {unknown}; choose from {list(LEVELS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{text!r}: level(s) {repeated} given more than once")
    return names


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked before any model is loaded (a bad value is an argparse error naming the flag)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="Hugging Face model folder")
    parser.add_argument("--n", type=int, default=24, help="problems per level (>= 1)")
    parser.add_argument("--levels", default=",".join(LEVELS), help=f"comma-separated subset of {list(LEVELS)}")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help="write the results JSON here (rewritten after each level, so finished levels are kept)")
    args = parser.parse_args(argv)
    try:
        args.levels = parse_levels(args.levels)
    except ValueError as err:
        parser.error(f"--levels {err}")
    for flag in ("n", "max_new_tokens", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    if args.out is not None:
        args.out = Path(args.out)
        if not args.out.parent.is_dir():
            parser.error(f"--out {args.out}: folder {args.out.parent} does not exist")
        if args.out.is_dir():
            parser.error(f"--out {args.out}: is a folder; give a file name")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    results = {"model": args.model, "n": args.n, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
               "levels": {}}
    for name in args.levels:
        t0 = time.perf_counter()
        problems = generate(args.n, "test", args.seed, LEVELS[name])
        res = score_level(model, tok, problems, args.max_new_tokens, args.batch, label=name)
        res["settings"] = LEVELS[name].__dict__
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results["levels"][name] = res
        print(f"{name}: strict {res['strict']:.2f} boxed {res['boxed']:.2f} numeric {res['numeric']:.2f} "
              f"lenient {res['lenient']:.2f} "
              f"(n={res['n']}, {res['mean_tokens']:.0f} tokens, {res['seconds']:.0f} s)", flush=True)
        if args.out:  # after each level: an interrupted run keeps the levels it finished
            write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
