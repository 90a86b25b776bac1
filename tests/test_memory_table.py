"""benchmarks/memory_table.py: the per-rank base bytes behind the README's memory table."""

from __future__ import annotations

import pytest

from verl_qerl.nvfp4 import BLOCK_SIZE
from verl_qerl.testing.scripts import load_script

mt = load_script("benchmarks/memory_table.py", "memory_table")
rollout = load_script("benchmarks/rollout.py", "rollout")


@pytest.mark.parametrize("model", ["7b", "32b", "72b"])
def test_unsharded_base_is_the_checkpoints_linear_bytes(model):
    shape = mt.MODELS[model]
    linear, _ = rollout.count_params(shape)  # the checkpoint writer's own count of quantized weights
    n_layers = 7 * shape["num_hidden_layers"]
    one = mt.base_bytes_per_rank(shape, 1)
    assert BLOCK_SIZE == mt.BLOCK
    assert one["qerl"] == one["qerl_repl"] == linear * 9 // 16 + 4 * n_layers  # 0.5625 B/weight + global scales
    assert one["lora_bf16"] == 2 * linear and one["lora_fp32"] == 4 * linear


@pytest.mark.parametrize("model", ["7b", "32b", "72b"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_sharded_base_is_one_nth_and_replicated_is_not(model, ranks):
    shape = mt.MODELS[model]
    one, n = mt.base_bytes_per_rank(shape, 1), mt.base_bytes_per_rank(shape, ranks)
    assert n["qerl"] <= one["qerl"] / ranks * 1.001  # Qwen2.5 rows divide by 8: only the global scales stay
    assert n["qerl_repl"] == one["qerl"]
    assert n["lora_bf16"] == one["lora_bf16"] // ranks
    assert n["qerl"] < 0.3 * n["lora_bf16"]  # QeRL keeps its edge at every N once sharded


def test_uneven_rows_count_the_largest_share():
    assert mt.nvfp4_layer_bytes(10, 32, 4) == 3 * (16 + 2) + 4  # ceil(10 / 4) = 3 rows on rank 0


def test_cli_prints_the_table(capsys):
    assert mt.main(["--models", "7b", "--ranks", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "| 7b | 1 | 3.67 |" in out and "| 7b | 2 | 1.84 |" in out
    with pytest.raises(SystemExit):
        mt.main(["--models", "7x"])
