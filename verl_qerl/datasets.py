"""GSM8K, MATH500 and BigMath to verl's RL parquet schema (the rows verl's built-in scorers grade).

Each source row becomes ``{data_source, prompt: [{role: user, content}], ability, reward_model:
{style: rule, ground_truth}, extra_info}``. ``data_source`` picks verl's scorer: ``openai/gsm8k`` (the
number after ``####``), ``math_dapo`` (the ``Answer:`` line, math-verify style normalisation).
Loading goes through ``datasets``: a hub name, or local files (``.parquet``, ``.json``, ``.jsonl``,
``.csv``) or a folder saved with ``save_to_disk``; tests use local files only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: The instruction appended to every GSM8K question (verl's own GSM8K preprocessing uses it; the
#: generated problems of :mod:`verl_qerl.testing.data` and the exploration example reuse it).
GSM8K_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

HUB_NAMES = {
    "gsm8k": ("openai/gsm8k", "main"),
    "math500": ("HuggingFaceH4/MATH-500", None),
    "bigmath": ("open-r1/Big-Math-RL-Verified-Processed", "level_3_4_5"),
}


class DatasetFormatError(ValueError):
    """A source row without the fields a converter needs; the message names them."""


def _field(row: dict[str, Any], key: str, where: str) -> Any:
    if key not in row or row[key] is None:
        raise DatasetFormatError(f"{where}: row has no {key!r} field (fields: {sorted(row)})")
    return row[key]


def gsm8k_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K solution, without thousands separators."""
    match = re.search(r"####\s*(-?[0-9.,]+)", solution)
    if not match:
        raise DatasetFormatError(f"gsm8k: answer has no '#### <number>': {solution[-80:]!r}")
    return match.group(1).replace(",", "").rstrip(".")


def gsm8k_row(row: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    question = _field(row, "question", "gsm8k")
    answer = gsm8k_answer(_field(row, "answer", "gsm8k"))
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_SUFFIX}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": question},
    }


def dapo_math_row(question: str, answer: str, index: int, split: str, source: str) -> dict[str, Any]:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"{DAPO_PREFIX}{question}{DAPO_SUFFIX}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "source": source},
    }


def math500_row(row: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    return dapo_math_row(_field(row, "problem", "math500"), _field(row, "answer", "math500"), index, split,
                         "math500")


def bigmath_row(row: dict[str, Any], index: int, split: str, question_key: str = "prompt",
                answer_key: str = "solution") -> dict[str, Any]:
    return dapo_math_row(_field(row, question_key, "bigmath"), _field(row, answer_key, "bigmath"), index, split,
                         "bigmath")


def load_rows(source: str, split: str, config: str | None = None) -> Iterable[dict[str, Any]]:
    """Rows of a hub dataset or of local files via ``datasets``."""
    import datasets

    path = Path(source)
    if path.is_dir() and (path / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(path))
    if path.exists():
        files = sorted(path.glob("*")) if path.is_dir() else [path]
        ext = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
        kinds = {ext.get(f.suffix) for f in files} - {None}
        if len(kinds) != 1:
            raise DatasetFormatError(f"{source}: expected .parquet/.json/.jsonl/.csv files of one kind, got "
                                     f"{sorted(f.name for f in files)}")
        data_files = [str(f) for f in files if f.suffix in ext]
        return datasets.load_dataset(kinds.pop(), data_files=data_files, split="train")
    return datasets.load_dataset(source, config, split=split)


def convert(rows: Iterable[dict[str, Any]], kind: str, split: str, limit: int | None = None,
            **kwargs: Any) -> Iterator[dict[str, Any]]:
    fn = {"gsm8k": gsm8k_row, "math500": math500_row, "bigmath": bigmath_row}[kind]
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        yield fn(dict(row), i, split, **kwargs)


def write_parquet(rows: Iterable[dict[str, Any]], out: str | Path) -> int:
    import pandas as pd

    frame = pd.DataFrame(list(rows))
    if frame.empty:
        raise DatasetFormatError(f"{out}: no rows to write")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out)
    return len(frame)
