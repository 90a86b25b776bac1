"""GSM8K, MATH500 and BigMath to verl's RL parquet schema (the rows verl's built-in scorers grade).

Each source row becomes ``{data_source, prompt: [{role: user, content}], ability, reward_model:
{style: rule, ground_truth}, extra_info}``. ``data_source`` picks verl's scorer: ``openai/gsm8k`` (the
number after ``####``), ``math_dapo`` (the ``Answer:`` line, math-verify style normalisation).
Loading goes through ``datasets``: a hub name, or local files (``.parquet``, ``.json``, ``.jsonl``,
``.csv``; a folder keeps the files named after the split) or a folder saved with ``save_to_disk``; a path-like
source is never looked up on the hub; tests use local files only. Rows with an empty question or answer are
errors (naming the row and field); exact duplicate prompts are dropped and counted.
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


#: Local file kinds ``datasets`` reads, by suffix.
DATA_SUFFIXES = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def _field(row: dict[str, Any], key: str, where: str) -> Any:
    if key not in row or row[key] is None:
        raise DatasetFormatError(f"{where}: row has no {key!r} field (fields: {sorted(row)})")
    value = row[key]
    if isinstance(value, str) and not value.strip():
        raise DatasetFormatError(f"{where}: row has an empty {key!r} field")
    return value


def gsm8k_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K solution, without thousands separators."""
    if not isinstance(solution, str):
        raise DatasetFormatError(f"gsm8k: 'answer' field is a {type(solution).__name__} ({solution!r}), expected a "
                                 "solution text ending in '#### <number>'")
    match = re.search(r"####\s*(-?(?:\d[\d,]*(?:\.\d+)?|\.\d+))", solution)
    if not match:
        raise DatasetFormatError(f"gsm8k: answer has no '#### <number>': {solution[-80:]!r}")
    return match.group(1).replace(",", "")


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


#: The source field holding each kind's question (``max_chars`` measures it).
QUESTION_KEYS = {"gsm8k": "question", "math500": "problem", "bigmath": "prompt"}


def is_local_source(source: str | Path) -> bool:
    """Whether ``source`` names local files rather than a hub dataset (``owner/name``).

    Local: it exists, or it looks like a path (starts with ``/``, ``.``, ``~``; ends with ``/``; has a data
    suffix such as ``.jsonl``; has a backslash or more than one ``/``). Such a source is never looked up on the hub.
    """
    s = str(source)
    if Path(s).expanduser().exists():
        return True
    return (s.startswith(("/", ".", "~")) or s.endswith("/") or "\\" in s or s.count("/") > 1
            or Path(s).suffix.lower() in DATA_SUFFIXES)


def _split_files(path: Path, split: str) -> list[Path]:
    """The data files of folder ``path`` whose names start with ``split`` (``test.jsonl``, ``train-0000.parquet``)."""
    present = sorted(f for f in path.iterdir() if not f.name.startswith("."))
    pattern = re.compile(rf"{re.escape(split)}(?:[._-]|$)", re.IGNORECASE)
    files = [f for f in present if f.is_file() and f.suffix.lower() in DATA_SUFFIXES and pattern.match(f.name)]
    if not files:
        raise DatasetFormatError(f"{path}: no {split!r} split: a folder source needs data files named {split}.* "
                                 f"(or {split}-*, {split}_*; .parquet/.json/.jsonl/.csv), found "
                                 f"{[f.name for f in present]}")
    return files


def _read_files(files: list[Path], where: str):
    import datasets

    kinds = {DATA_SUFFIXES.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DatasetFormatError(f"{where}: expected .parquet/.json/.jsonl/.csv files of one kind, got "
                                 f"{[f.name for f in files]}")
    empty = [f.name for f in files if f.stat().st_size == 0]
    if empty:
        raise DatasetFormatError(f"{files[0]}: empty file (no rows)" if len(files) == 1 else
                                 f"{where}: empty files {empty} (no rows)")
    try:
        return datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    except Exception as err:  # datasets' parse errors (StopIteration, ArrowInvalid, DatasetGenerationError, ...)
        raise DatasetFormatError(f"{where}: cannot read {[f.name for f in files]}: {type(err).__name__}: "
                                 f"{str(err).splitlines()[0] if str(err) else ''}") from err


def load_rows(source: str | Path, split: str, config: str | None = None, *,
              single_file: bool = True) -> Iterable[dict[str, Any]]:
    """The rows of ``split`` of a hub dataset or of local files, via ``datasets``.

    Local sources (see :func:`is_local_source`; a missing one is an error, never a hub lookup): a folder saved
    with ``save_to_disk`` (a ``DatasetDict``: its ``split``); a folder of data files (those whose names start with
    ``split``); a single file or a saved single ``Dataset``, taken whole as ``split``. ``single_file=False``
    refuses the latter: the caller needs several splits and the user has not said which one the file is.
    """
    import datasets

    if not is_local_source(source):
        try:
            return datasets.load_dataset(str(source), config, split=split)
        except Exception as exc:  # offline, a misspelled name, no such split: the hub's many error types, named
            raise DatasetFormatError(
                f"{source}: could not load split {split!r} from the Hugging Face hub ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); offline or misspelled? pass a local "
                "copy with --source (a folder of train.* / test.* files)") from exc
    path = Path(source).expanduser()
    if not path.exists():
        raise DatasetFormatError(f"{source}: no such file or folder (a local path: it is not looked up on the hub)")
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        saved = datasets.load_from_disk(str(path))
        if split not in saved:
            raise DatasetFormatError(f"{source}: saved DatasetDict has no {split!r} split (splits: {list(saved)})")
        return saved[split]
    whole = not path.is_dir() or (path / "dataset_info.json").is_file()
    if whole and not single_file:
        raise DatasetFormatError(f"{source}: one file (or one saved Dataset) cannot stand for several splits")
    if path.is_dir() and (path / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(path))
    files = [path] if not path.is_dir() else _split_files(path, split)
    return _read_files(files, str(source))


def describe_source(source: str | Path, split: str) -> str:
    """``source`` as error messages name it: the files a folder source reads for ``split``, else as given."""
    path = Path(source).expanduser()
    if is_local_source(source) and path.is_dir() and not (path / "dataset_dict.json").is_file() \
            and not (path / "dataset_info.json").is_file():
        try:
            files = _split_files(path, split)
        except DatasetFormatError:
            return str(source)
        return str(files[0]) if len(files) == 1 else f"{path}/{{{','.join(f.name for f in files)}}}"
    return str(source)


def _level(value: Any) -> int | None:
    """A difficulty level as an int (``4``, ``"4"``, ``"Level 4"``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) and float(value).is_integer():
        return int(value)
    match = re.fullmatch(r"\s*(?:level\s*)?(\d+)\s*", str(value), re.IGNORECASE)
    return int(match.group(1)) if match else None


def convert(rows: Iterable[dict[str, Any]], kind: str, split: str, limit: int | None = None, *,
            source: str | None = None, max_chars: int | None = None, levels: Iterable[int] | None = None,
            stats: dict[str, int] | None = None, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """verl rows of ``kind`` from source ``rows``; a bad row is an error naming ``source``, the row and the field.

    Rows whose question is longer than ``max_chars`` or (with ``levels``) whose ``level`` column is not in
    ``levels`` are skipped; a prompt seen before is dropped (exact duplicates); ``limit`` counts rows kept.
    ``stats`` (if given) gets the counts ``too_long``, ``other_level`` and ``duplicates``.
    """
    fn = {"gsm8k": gsm8k_row, "math500": math500_row, "bigmath": bigmath_row}[kind]
    where = f"{source or kind} ({split})"
    stats = {} if stats is None else stats
    for key in ("too_long", "other_level", "duplicates"):
        stats.setdefault(key, 0)
    wanted = None if levels is None else {int(v) for v in levels}
    seen: set[str] = set()
    kept = 0
    for i, row in enumerate(rows):
        if limit is not None and kept >= limit:
            break
        row = dict(row)
        if wanted is not None:
            level = _level(row.get("level"))
            if level is None:
                raise DatasetFormatError(f"{where} row {i}: --levels needs a 'level' column with a number, got "
                                         f"{row.get('level')!r} (fields: {sorted(row)})")
            if level not in wanted:
                stats["other_level"] += 1
                continue
        question_key = kwargs.get("question_key", QUESTION_KEYS[kind])
        if max_chars is not None and len(str(row.get(question_key) or "")) > max_chars:
            stats["too_long"] += 1
            continue
        try:
            out = fn(row, i, split, **kwargs)
        except DatasetFormatError as err:
            raise DatasetFormatError(f"{where} row {i}: {err}") from None
        prompt = out["prompt"][0]["content"]
        if prompt in seen:
            stats["duplicates"] += 1
            continue
        seen.add(prompt)
        kept += 1
        yield out


def write_parquet(rows: Iterable[dict[str, Any]], out: str | Path) -> int:
    import pandas as pd

    frame = pd.DataFrame(list(rows))
    if frame.empty:
        raise DatasetFormatError(f"{out}: no rows to write")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out)
    return len(frame)
