"""benchmarks/lora_profile.py's arguments and its ``--merge`` (no engine): ``--max-num-seqs`` is checked against the
batches and recorded in the workload, and a merge refuses a file of another device or workload instead of mixing
rows whose ratios compare different runs."""

from __future__ import annotations

import pytest

from verl_qerl.testing.scripts import load_script


@pytest.fixture(scope="module")
def lp():
    return load_script("benchmarks/lora_profile.py", "lora_profile_bench")


def _result(lp, argv: list[str], rows: list[dict], device: str = "NVIDIA H200") -> dict:
    args = lp.parse_args(["--variant", "fast", *argv])
    return {"benchmark": "lora_profile", "device": device, "workload": lp.workload(args), "rows": rows,
            "kernel_tables": {}, "lora_layer_ops": {}}


def _row(variant: str, batch: int, ms: float) -> dict:
    return {"variant": variant, "part": "graphs", "batch": batch, "decode_ms_per_step": ms}


def test_max_num_seqs_below_the_largest_batch_is_refused(lp, capsys):
    with pytest.raises(SystemExit):
        lp.parse_args(["--variant", "fast", "--batches", "1,8", "--profile-batches", "64", "--max-num-seqs", "32"])
    assert "--max-num-seqs 32 is below the largest batch 64" in capsys.readouterr().err


def test_workload_records_max_num_seqs_only_when_set(lp):
    assert "max_num_seqs" not in lp.workload(lp.parse_args(["--variant", "none"]))
    assert lp.workload(lp.parse_args(["--variant", "none", "--max-num-seqs", "256"]))["max_num_seqs"] == 256


def test_merge_keeps_the_rows_it_does_not_remeasure(lp):
    earlier = _result(lp, [], [_row("none", 1, 3.0), _row("none", 64, 5.1), _row("fast", 1, 9.9)])
    new = _result(lp, [], [_row("fast", 1, 3.3), _row("fast", 64, 6.2)])
    got = lp.merge_rows(new, earlier, "old.json")
    assert sorted((r["variant"], r["batch"], r["decode_ms_per_step"]) for r in got["rows"]) == [
        ("fast", 1, 3.3), ("fast", 64, 6.2), ("none", 1, 3.0), ("none", 64, 5.1)]
    targets = {t["name"]: t["measured"] for t in lp.targets(got["rows"])}
    assert targets["decode tok/s, fast LoRA / no LoRA, B=64"] == pytest.approx(5.1 / 6.2)


@pytest.mark.parametrize("earlier_argv,new_argv,key", [
    ([], ["--max-num-seqs", "256"], "max_num_seqs"),
    (["--prompt-tokens", "256"], [], "prompt_tokens"),
])
def test_merge_refuses_another_workload(lp, earlier_argv, new_argv, key):
    earlier = _result(lp, earlier_argv, [_row("none", 1, 3.0)])
    new = _result(lp, new_argv, [_row("fast", 1, 3.3)])
    with pytest.raises(ValueError, match=rf"--merge old\.json: another workload \({key} "):
        lp.merge_rows(new, earlier, "old.json")


def test_merge_refuses_another_device(lp):
    earlier = _result(lp, [], [_row("none", 1, 3.0)], device="NVIDIA H100 80GB HBM3")
    with pytest.raises(ValueError, match="not a lora_profile JSON of NVIDIA H200"):
        lp.merge_rows(_result(lp, [], [_row("fast", 1, 3.3)]), earlier, "old.json")
