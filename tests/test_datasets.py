"""Data preparation to verl's schema, from local files only, graded by verl's own scorers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from verl_qerl import datasets as ds

REPO = Path(__file__).resolve().parents[1]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "examples/data/prepare.py"), *args], capture_output=True,
                          text=True, timeout=300)


def test_gsm8k_from_local_files_is_graded_by_verl(tmp_path):
    rows = [{"question": "Tom has 3 apples and buys 4,000 more. How many?", "answer": "3+4000=4003\n#### 4,003"},
            {"question": "What is 2+2?", "answer": "#### 4"}]
    _jsonl(tmp_path / "src/train.jsonl", rows)
    _jsonl(tmp_path / "src/test.jsonl", rows[:1])
    res = run_prepare("gsm8k", "--source", str(tmp_path / "src"), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    train = pd.read_parquet(tmp_path / "out/train.parquet")
    assert len(train) == 2 and len(pd.read_parquet(tmp_path / "out/test.parquet")) == 1
    row = train.iloc[0]
    assert row.data_source == "openai/gsm8k" and row.reward_model["ground_truth"] == "4003"
    assert row.prompt[0]["role"] == "user" and row.prompt[0]["content"].endswith(ds.GSM8K_SUFFIX)
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score("openai/gsm8k", "so 4003 apples\n#### 4003", "4003") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 4002", "4003") == 0.0


def test_math500_and_bigmath_use_the_dapo_scorer(tmp_path):
    _jsonl(tmp_path / "m500.jsonl", [{"problem": "What is $\\frac{1}{2}+\\frac{1}{2}$?", "answer": "1"}])
    res = run_prepare("math500", "--source", str(tmp_path / "m500.jsonl"), "--out", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    rows = [{"prompt": "Compute 6*7.", "solution": "42"}, {"prompt": "x" * 2000, "solution": "1"}]
    _jsonl(tmp_path / "bm.jsonl", rows)
    res = run_prepare("bigmath", "--source", str(tmp_path / "bm.jsonl"), "--out", str(tmp_path / "b"))
    assert res.returncode == 0, res.stderr
    bm = pd.read_parquet(tmp_path / "b/train.parquet")
    assert len(bm) == 1  # the over-long prompt was dropped (the authors' 1024-character filter)
    m = pd.read_parquet(tmp_path / "m/test.parquet").iloc[0]
    assert m.data_source == "math_dapo" and "Answer:" in m.prompt[0]["content"]
    from verl.utils.reward_score import default_compute_score

    good = default_compute_score("math_dapo", "6*7 is 42.\nAnswer: 42", "42")
    bad = default_compute_score("math_dapo", "Answer: 41", "42")
    assert (good["score"] if isinstance(good, dict) else good) > (bad["score"] if isinstance(bad, dict) else bad)


def test_bad_rows_are_named(tmp_path):
    _jsonl(tmp_path / "src/train.jsonl", [{"question": "q", "answer": "no marker"}])
    _jsonl(tmp_path / "src/test.jsonl", [{"question": "q", "answer": "#### 1"}])
    res = run_prepare("gsm8k", "--source", str(tmp_path / "src"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "no '#### <number>'" in res.stderr
    with pytest.raises(ds.DatasetFormatError, match=r"math500: row has no 'answer' field"):
        ds.math500_row({"problem": "p"}, 0, "test")
