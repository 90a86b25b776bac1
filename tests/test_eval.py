"""examples/eval/evaluate.py on the tiny model: vLLM (qerl_nvfp4) + a peft adapter, graded by verl's scorer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
import verl  # noqa: E402, F401  (required in CI: missing verl / vLLM must fail, not skip)
import vllm  # noqa: E402, F401


@pytest.mark.slow
def test_evaluate_nvfp4_base_with_adapter(tiny_bf16, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_qerl.modeling import get_lora_model, quantize_model
    from verl_qerl.testing.data import write_arith_parquet

    model = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.bfloat16)
    quantize_model(model, mode="nvfp4")
    peft_model = get_lora_model(model, r=8, lora_alpha=16)
    with torch.no_grad():  # a non-trivial adapter (peft initialises B to zero)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    _, test = write_arith_parquet(tmp_path / "data", n_train=2, n_val=4)
    out = tmp_path / "result.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, str(REPO / "examples/eval/evaluate.py"), "--model", str(tiny_bf16), "--adapter",
         str(tmp_path / "adapter"), "--data", str(test), "--samples", "2", "--max-tokens", "8", "--max-model-len",
         "256", "--enforce-eager", "--gpu-memory-utilization", "0.3", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["prompts"] == 4 and result["samples"] == 2 and result["quantization"] == "qerl_nvfp4"
    assert result["generated_tokens"] > 0
    # 2 samples per prompt: each prompt scores 0, 0.5 or 1, and pass@1 is their mean
    assert len(result["per_prompt"]) == 4 and all(p in (0.0, 0.5, 1.0) for p in result["per_prompt"])
    assert result["pass@1"] == sum(result["per_prompt"]) / 4


def test_pass_at_1_on_constructed_completions():
    """Exact values where the right answers are known: verl's GSM8K (``#### n``) and DAPO (``Answer: n``) scorers,
    a wrong or missing answer is 0 (GSM8K's format score does not count), averaged per prompt, then over prompts."""
    from verl_qerl.testing.scripts import load_script

    ev = load_script("examples/eval/evaluate.py", "evaluate_script")
    sources = ["openai/gsm8k", "math_dapo", "openai/gsm8k"]
    truths = ["42", "7", "5"]
    completions = [
        ["6 * 7 = 42\n#### 42", "#### 41", "so #### 42", "no answer here"],  # 2 of 4
        ["Answer: 7", "Answer: 8", "it is 7\nAnswer: 7", "Answer: 7"],  # 3 of 4
        ["#### 6", "#### 4", "#### 50", "5"],  # none
    ]
    per_prompt, acc = ev.pass_at_1(sources, truths, completions)
    assert per_prompt == [0.5, 0.75, 0.0]
    assert acc == pytest.approx(1.25 / 3, abs=1e-15)
    assert ev.pass_at_1(sources[:1], truths[:1], [["#### 42"]]) == ([1.0], 1.0)
    with pytest.raises(ValueError, match="no completions"):
        ev.pass_at_1(sources[:1], truths[:1], [[]])
    with pytest.raises(ValueError):  # prompts and completions must pair up
        ev.pass_at_1(sources, truths, completions[:2])


def test_evaluate_refuses_missing_inputs(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "examples/eval/evaluate.py"), "--model", str(tmp_path / "nope"),
                          "--data", str(tmp_path / "nope.parquet")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_max_lora_rank_is_one_vllm_accepts():
    """vLLM takes only a few max_lora_rank values; max(8, rank) made its constructor refuse a rank-12 adapter."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    from verl_qerl.testing.scripts import load_script

    ev = load_script("examples/eval/evaluate.py", "evaluate_script")
    allowed = set(typing.get_args(MaxLoRARanks))
    for rank, want in ((1, 1), (4, 8), (8, 8), (12, 16), (24, 32), (48, 64), (320, 320)):
        assert ev.vllm_max_lora_rank(rank) == want and want in allowed
    with pytest.raises(ValueError, match="above the largest max_lora_rank"):
        ev.vllm_max_lora_rank(4096)


def test_evaluate_refuses_a_zero_limit_and_an_out_folder_that_does_not_exist(tmp_path):
    """--limit 0 evaluated every prompt; --out in a missing folder failed only after the whole evaluation."""
    data, model = tmp_path / "d.parquet", tmp_path / "m"
    data.write_bytes(b"")
    model.mkdir()
    base = [sys.executable, str(REPO / "examples/eval/evaluate.py"), "--model", str(model), "--data", str(data)]
    res = subprocess.run([*base, "--limit", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--limit 0: give at least 1 prompt" in res.stderr
    res = subprocess.run([*base, "--out", str(tmp_path / "no" / "r.json")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "does not exist" in res.stderr and "--out" in res.stderr
