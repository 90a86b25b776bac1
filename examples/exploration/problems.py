"""Generated multi-step arithmetic word problems with checkable answers (GSM8K format), for the exploration study.

Why generated: the study trains its policy from scratch (no hub weights, no dataset downloads), so it needs a
reasoning task whose answers are exact, whose difficulty is tunable so that a ~25M-parameter model learns it
*partially* in a couple of minutes of SFT (leaving room for RL), and whose format verl's built-in GSM8K scorer
grades strictly: the number after ``#### `` must equal the ground truth.

A problem is a start quantity followed by 2-4 operations (add, subtract, multiply by a small factor, optionally
divide into equal groups), told as a story. The gold solution states one computation per line and ends with
``#### <answer>``::

    Ann has 12 coins. Then she finds 5 more. Then the coins are multiplied by 3. Then she gives away 7.
    How many coins does Ann have now?
    ->  12 + 5 = 17
        17 * 3 = 51
        51 - 7 = 44
        #### 44

Every value stays a non-negative integer <= ``max_value`` (so the strict scorer's string comparison is exact).

Outputs (``python examples/exploration/problems.py --out DIR``):

* ``train.parquet`` (RL prompts) and ``test.parquet`` (held-out RL validation) in verl's schema, the same as
  :mod:`verl_qerl.testing.data` (``data_source="openai/gsm8k"``, ``prompt`` as chat messages,
  ``reward_model.ground_truth``);
* ``sft.jsonl`` (prompt messages + gold response, for :mod:`sft`) and ``dev.jsonl`` (held-out set that SFT
  uses to decide when to stop; disjoint from ``test``, so stopping does not select on the RL test set);
* ``problems.json``: the generator settings and split sizes.

Splits come from separate seeded streams and the held-out splits are de-duplicated against the training ones
by question text.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_qerl.datasets import GSM8K_SUFFIX

#: The instruction verl's GSM8K preprocessing appends (one definition: :mod:`verl_qerl.datasets`).
INSTRUCTION = GSM8K_SUFFIX
DATA_SOURCE = "openai/gsm8k"

NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lu", "Max", "Ned", "Oz", "Pam")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells", "stones", "stamps", "beads", "marbles")
OPS = ("+", "-", "*", "/")

_ADD = ("Then {p} finds {b} more.", "Then {p} buys {b} more.", "Then {p} gets {b} more.")
_SUB = ("Then {p} gives away {b}.", "Then {p} loses {b}.", "Then {p} sells {b}.")
_MUL = ("Then the {i} are multiplied by {b}.", "Then {p} ends up with {b} times as many.")
_DIV = ("Then {p} splits them into {b} equal groups and keeps one group.",)


@dataclass(frozen=True)
class Difficulty:
    """The knobs that set how hard a problem is (defaults: partially learnable by ~25M params in ~2 min SFT)."""

    min_ops: int = 2
    max_ops: int = 4
    max_start: int = 30  # first quantity in [2, max_start]
    max_operand: int = 30  # added / subtracted amounts in [1, max_operand]
    max_factor: int = 5  # multipliers / divisors in [2, max_factor]
    max_value: int = 300  # every intermediate value stays in [0, max_value]
    ops: str = "+-*"  # allowed operations; "/" (exact division) is harder

    def __post_init__(self) -> None:
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={self.min_ops}, max_ops={self.max_ops}")
        if self.max_start < 2 or self.max_operand < 1 or self.max_factor < 2:
            raise ValueError("need max_start >= 2, max_operand >= 1 and max_factor >= 2")
        if self.max_value < max(self.max_start, 2 * self.max_factor):
            raise ValueError(f"max_value={self.max_value} must be >= max_start and >= 2*max_factor")
        bad = sorted(set(self.ops) - set(OPS))
        if not self.ops or bad:
            raise ValueError(f"ops={self.ops!r}: use a non-empty subset of {''.join(OPS)!r}")


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[tuple[int, str, int, int], ...]  # (left, op, right, result)
    answer: int

    @property
    def solution(self) -> str:
        """The gold response: one computation per line, then ``#### <answer>``."""
        lines = [f"{a} {op} {b} = {r}" for a, op, b, r in self.steps]
        return "\n".join([*lines, f"#### {self.answer}"])

    @property
    def prompt(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.question} {INSTRUCTION}"}]


def apply_op(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0 or a % b:
            raise ValueError(f"{a} / {b} is not an exact division")
        return a // b
    raise ValueError(f"unknown op {op!r}")


def _pick_step(rng: random.Random, x: int, d: Difficulty) -> tuple[str, int]:
    """One operation valid at value ``x`` (keeps results integral and within [0, max_value])."""
    choices = []
    if "+" in d.ops and x + 1 <= d.max_value:
        choices.append(("+", rng.randint(1, min(d.max_operand, d.max_value - x))))
    if "-" in d.ops and x >= 1:
        choices.append(("-", rng.randint(1, min(d.max_operand, x))))
    if "*" in d.ops:
        factors = [k for k in range(2, d.max_factor + 1) if x * k <= d.max_value]
        if factors and x > 0:
            choices.append(("*", rng.choice(factors)))
    if "/" in d.ops:
        divisors = [k for k in range(2, d.max_factor + 1) if x % k == 0 and x > 0]
        if divisors:
            choices.append(("/", rng.choice(divisors)))
    if not choices:  # only possible with restrictive ops (e.g. "/" alone at a prime): fall back to +1
        return "+", 1
    return rng.choice(choices)


def make_problem(rng: random.Random, d: Difficulty = Difficulty()) -> Problem:
    """Draw one problem from ``rng`` (deterministic given its state)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    x = rng.randint(2, d.max_start)
    sentences = [f"{name} has {x} {item}."]
    steps = []
    for _ in range(rng.randint(d.min_ops, d.max_ops)):
        op, b = _pick_step(rng, x, d)
        table = {"+": _ADD, "-": _SUB, "*": _MUL, "/": _DIV}[op]
        sentences.append(rng.choice(table).format(p=name, b=b, i=item))
        y = apply_op(x, op, b)
        steps.append((x, op, b, y))
        x = y
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(question=" ".join(sentences), steps=tuple(steps), answer=x)


def gsm8k_strict_score(solution: str, ground_truth: str) -> float:
    """verl's ``gsm8k.compute_score`` (method="strict", format_score=0, score=1), restated without verl.

    The last ``#### <number>`` in the last 300 characters, with ``,`` and ``$`` removed, must equal the
    ground-truth string exactly. The test suite checks this against verl's own function.
    """
    tail = solution[-300:]
    found = re.findall(r"#### (\-?[0-9\.\,]+)", tail)
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "").replace("$", "") == ground_truth else 0.0


def _verl_row(p: Problem, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": p.prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
        "extra_info": {"split": split, "index": index, "answer": str(p.answer), "question": p.question,
                       "num_ops": len(p.steps)},
    }


def generate(n: int, split: str, seed: int, difficulty: Difficulty = Difficulty(),
             exclude: set[str] | None = None) -> list[Problem]:
    """``n`` problems from the stream ``(seed, split)``, skipping questions in ``exclude`` and repeats."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(f"exploration/{seed}/{split}")
    seen = set(exclude or ())
    out: list[Problem] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct {split} problems; widen the difficulty settings")
        p = make_problem(rng, difficulty)
        if p.question in seen:
            continue
        seen.add(p.question)
        out.append(p)
    return out


def write_splits(out_dir: str | Path, *, n_sft: int = 100000, n_train: int = 4096, n_dev: int = 256,
                 n_test: int = 256, seed: int = 0, difficulty: Difficulty = Difficulty()) -> dict[str, Path]:
    """Write all splits under ``out_dir`` (see the module docstring); returns their paths."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sft = generate(n_sft, "sft", seed, difficulty)
    train = generate(n_train, "train", seed, difficulty)
    seen = {p.question for p in sft} | {p.question for p in train}
    test = generate(n_test, "test", seed, difficulty, exclude=seen)
    dev = generate(n_dev, "dev", seed, difficulty, exclude=seen | {p.question for p in test})
    paths = {"train": out / "train.parquet", "test": out / "test.parquet", "sft": out / "sft.jsonl",
             "dev": out / "dev.jsonl", "meta": out / "problems.json"}
    pd.DataFrame([_verl_row(p, "train", i) for i, p in enumerate(train)]).to_parquet(paths["train"])
    pd.DataFrame([_verl_row(p, "test", i) for i, p in enumerate(test)]).to_parquet(paths["test"])
    for key, probs in (("sft", sft), ("dev", dev)):
        with open(paths[key], "w", encoding="utf-8") as f:
            for p in probs:
                f.write(json.dumps({"prompt": p.prompt, "response": p.solution, "answer": str(p.answer),
                                    "num_ops": len(p.steps)}) + "\n")
    meta = {"seed": seed, "difficulty": asdict(difficulty), "instruction": INSTRUCTION, "data_source": DATA_SOURCE,
            "sizes": {"sft": n_sft, "train": n_train, "dev": n_dev, "test": n_test}}
    paths["meta"].write_text(json.dumps(meta, indent=1))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-sft", type=int, default=100000)
    ap.add_argument("--n-train", type=int, default=4096, help="RL training prompts")
    ap.add_argument("--n-dev", type=int, default=256, help="SFT stopping set")
    ap.add_argument("--n-test", type=int, default=256, help="held-out RL validation set")
    dflt = Difficulty()
    for key in ("min_ops", "max_ops", "max_start", "max_operand", "max_factor", "max_value"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=getattr(dflt, key))
    ap.add_argument("--ops", default=dflt.ops, help="subset of '+-*/'")
    args = ap.parse_args(argv)
    for key in ("n_sft", "n_train", "n_dev", "n_test"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    try:
        d = Difficulty(args.min_ops, args.max_ops, args.max_start, args.max_operand, args.max_factor,
                       args.max_value, args.ops)
    except ValueError as err:
        ap.error(str(err))
    paths = write_splits(args.out, n_sft=args.n_sft, n_train=args.n_train, n_dev=args.n_dev, n_test=args.n_test,
                         seed=args.seed, difficulty=d)
    print(f"[problems] wrote {', '.join(f'{k}={v}' for k, v in paths.items())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
