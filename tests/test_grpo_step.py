"""benchmarks/grpo_step.py: its overrides compose in verl's real config, and its summaries/targets are right."""

from __future__ import annotations

import json

import pytest

from verl_qerl.testing.scripts import load_script

gs = load_script("benchmarks/grpo_step.py", "grpo_step")


@pytest.mark.parametrize("variant", sorted(gs.VARIANTS))
@pytest.mark.parametrize("tiny", [False, True])
def test_overrides_compose_in_verls_config(variant, tiny, tmp_path):
    from hydra import compose, initialize_config_module

    from verl_qerl.verl.config import apply_qerl

    args = gs.parse_args(["--variants", variant, "--batch", "4", "--n", "2", "--micro-batch", "4", "--seed", "7"]
                         + (["--tiny"] if tiny else []))
    ov = gs.main_ppo_overrides(args, variant, 2, tmp_path / "m", tmp_path / "t.parquet", tmp_path / "v.parquet")
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ov)
    assert cfg.qerl.mode == gs.VARIANTS[variant].split("_")[0]
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.actor_rollout_ref.rollout.seed == 7
    assert cfg.actor_rollout_ref.model.lora_rank == 32
    apply_qerl(cfg)  # the plugin's own validation accepts it


def _steps(n: int, step_s: float, tokens: int, score0: float = 0.1) -> list[dict]:
    return [{"training/global_step": i + 1, "timing_s/step": step_s * (3 if i == 0 else 1), "timing_s/gen": step_s / 2,
             "timing_s/update_actor": step_s / 4, "timing_s/old_log_prob": 0.1, "timing_s/update_weights": 0.05,
             "perf/total_num_tokens": tokens, "critic/score/mean": score0 + 0.1 * i, "actor/pg_loss": 0.01 * i,
             "actor/entropy": 1.0, "actor/perf/max_memory_allocated_gb": 3.0 + i} for i in range(n)]


def test_summary_drops_the_warmup_step_and_computes_throughput():
    s = gs.summarize_run(_steps(4, 2.0, 1000), gpus=2)
    assert s["step_s"] == pytest.approx(2.0)  # the 6 s first step is left out
    assert s["tokens_per_s"] == pytest.approx(500.0) and s["tokens_per_s_per_gpu"] == pytest.approx(250.0)
    assert s["actor_peak_allocated_gb"] == 6.0 and s["steps_measured"] == 3
    assert s["curves"]["critic/score/mean"][0] == pytest.approx(0.1)


def test_targets_for_both_comparisons():
    rows = [{"variant": "qerl", "gpus": 1, **gs.summarize_run(_steps(4, 3.0, 900), 1)},
            {"variant": "lora", "gpus": 1, **gs.summarize_run(_steps(4, 4.0, 900), 1)}]
    ratios, targets = gs.compare(rows, "variants")
    assert targets == [{"name": "grpo_step_time_ratio[qerl/lora]", "measured": pytest.approx(0.75), "op": "<=",
                        "target": 0.75}]
    rows = [{"variant": "qerl", "gpus": 1, **gs.summarize_run(_steps(4, 4.0, 1000), 1)},
            {"variant": "qerl", "gpus": 2, **gs.summarize_run(_steps(4, 2.5, 1000, score0=0.2), 2)}]
    ratios, targets = gs.compare(rows, "gpus")
    assert ratios["throughput_ratio"] == pytest.approx(1.6) and ratios["scaling_efficiency"] == pytest.approx(0.8)
    assert ratios["max_abs_diff[critic/score/mean]"] == pytest.approx(0.1)
    assert targets[0]["op"] == ">=" and targets[0]["measured"] == pytest.approx(1.6)
    # a failed run gives no target rather than a wrong one
    assert gs.compare([rows[0], {"variant": "qerl", "gpus": 2, "error": "rc=1"}], "gpus")[1] == []


def test_metrics_reader_sorts_by_step(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps({"step": s, "data": {"timing_s/step": float(s)}}) for s in (2, 1, 3)) + "\n")
    assert [r["timing_s/step"] for r in gs.read_metrics(f)] == [1.0, 2.0, 3.0]
    assert gs.read_metrics(tmp_path / "missing.jsonl") == []


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        gs.parse_args(["--variants", "qerl,fp8"])
    assert "--variants" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gs.parse_args(["--batch", "3", "--n", "3", "--micro-batch", "4"])
    assert "--micro-batch" in capsys.readouterr().err
