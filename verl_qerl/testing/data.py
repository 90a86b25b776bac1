"""Generated GSM8K-format arithmetic problems in verl's parquet schema (no dataset downloads).

Each row: ``data_source="openai/gsm8k"`` (so verl's built-in GSM8K scorer grades it: the answer is the
number after ``####``), ``prompt`` as chat messages, ``reward_model.ground_truth``, ``extra_info``.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..datasets import GSM8K_SUFFIX


def arithmetic_problem(rng: random.Random) -> tuple[str, int]:
    """A short word problem with two or three operations and its integer answer."""
    names = ("Ann", "Bo", "Cy", "Dee", "Eli")
    items = ("apples", "books", "coins", "pens")
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    who, what = rng.choice(names), rng.choice(items)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{who} has {a} {what} and buys {b} more. How many {what} does {who} have?", a + b
    if kind == 1:
        big = a + b
        return f"{who} has {big} {what} and gives away {b}. How many are left?", big - b
    return f"{who} has {c} bags with {a} {what} each, then gets {b} more. How many {what} in total?", c * a + b


def make_rows(n: int, split: str, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        question, answer = arithmetic_problem(rng)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {GSM8K_SUFFIX}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "answer": str(answer), "question": question},
            }
        )
    return rows


def write_arith_parquet(out_dir: str | Path, n_train: int = 64, n_val: int = 16, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns their paths."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = out / "train.parquet", out / "test.parquet"
    pd.DataFrame(make_rows(n_train, "train", seed)).to_parquet(train)
    pd.DataFrame(make_rows(n_val, "test", seed)).to_parquet(test)
    return train, test
