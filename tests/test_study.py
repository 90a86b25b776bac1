"""examples/pretrained/study.py: the four-arm plan composes in verl's real config, and its statistics are right."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(HERE / "pretrained"))
sys.path.insert(0, str(HERE / "exploration"))

import run_arms  # noqa: E402
import study  # noqa: E402


def _plan(tmp_path, *extra):
    argv = study.arm_argv(["--model", str(tmp_path / "m"), "--data", str(tmp_path / "d"), "--out",
                           str(tmp_path / "runs"), "--dry-run", "--gpus", "2", "--seeds", "2", *extra])
    return run_arms.plan(run_arms.parse_args(argv))


def test_plan_has_four_arms_and_every_run_composes_and_passes_the_qerl_check(tmp_path):
    from hydra import compose, initialize_config_module

    from verl_qerl.verl.config import apply_qerl

    runs = _plan(tmp_path)
    assert [r.name for r in runs[:4]] == ["bf16-s0", "nvfp4_noaqn-s0", "nvfp4-s0", "bf16_aqn-s0"]
    assert len(runs) == 8
    for r in runs:
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=r.cmd[3:])
        qerl = apply_qerl(cfg)
        assert qerl.mode == {"bf16": "bf16", "bf16_aqn": "bf16"}.get(r.arm, "nvfp4")
        assert qerl.aqn.enable == (r.arm in ("nvfp4", "bf16_aqn"))
        if qerl.aqn.enable:
            assert qerl.aqn.noise_from_start and qerl.aqn.seed == r.seed and qerl.aqn.num_stages == 10
        assert cfg.trainer.total_training_steps == 100 and cfg.data.seed == r.seed
        assert cfg.actor_rollout_ref.rollout.seed == r.seed and cfg.actor_rollout_ref.actor.fsdp_config.seed == r.seed
        assert cfg.reward.custom_reward_function.path == "pkg://verl_qerl.verl.reward"
        assert list(cfg.reward.custom_reward_function.reward_kwargs.forms) == ["boxed", "hash", "answer_is"]
        assert cfg.data.max_response_length == 384 and cfg.actor_rollout_ref.rollout.n == 8
        assert cfg.trainer.val_before_train and cfg.trainer.test_freq == 10
    # the arms of one seed differ only in the group, the AQN switch/keys and the names
    strip = re.compile(r"(\+qerl=\w+|experiment_name=.*|default_local_dir=.*|qerl\.aqn\..*)$")
    assert len({tuple(x for x in r.cmd if not strip.search(x)) for r in runs if r.seed == 0}) == 1


def test_user_flags_override_the_study_defaults(tmp_path):
    runs = _plan(tmp_path, "--arms", "bf16_aqn", "--steps", "4", "--", "trainer.save_freq=-1")
    (r0, _) = runs
    assert "trainer.total_training_steps=4" in r0.cmd and r0.cmd[-1] == "trainer.save_freq=-1"
    assert "++qerl.aqn.num_stages=2" in r0.cmd  # noise from step 1 needs only 2 stages for a 4-step run


def test_strict_reward_and_paper_schedule_stay_run_arms_defaults(tmp_path):
    """Without the study's flags run_arms.py keeps verl's strict scorer and the paper's noise-free stage 0."""
    args = run_arms.parse_args(["--model", "m", "--data", "d", "--out", str(tmp_path), "--dry-run", "--gpus", "1",
                                "--seeds", "1", "--arms", "nvfp4"])
    (r,) = run_arms.plan(args)
    assert not any("custom_reward_function" in x or "noise_from_start" in x for x in r.cmd)


def _t_cdf(t: float, df: int) -> float:
    """Student t CDF from the regularized incomplete beta function (mpmath, a sympy dependency, is the oracle)."""
    mpmath = pytest.importorskip("mpmath")
    x = df / (df + t * t)
    tail = 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, x, regularized=True))
    return 1 - tail if t >= 0 else tail


def test_t_quantiles_match_the_t_distribution():
    for df in range(1, 31):
        q = study.t975(df)
        assert _t_cdf(q, df) >= 0.975 - 1e-4  # never narrower than the exact interval
        if df in study._T975:
            assert _t_cdf(q, df) == pytest.approx(0.975, abs=1e-4)
    assert study.t975(200) == 1.96
    with pytest.raises(ValueError):
        study.t975(0)


def test_paired_effect_interval_is_the_paired_t_interval():
    diffs = [0.05, 0.02, 0.08, -0.01, 0.04]
    e = study.paired_effect(diffs)
    mean = sum(diffs) / 5
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4)
    assert e["mean"] == pytest.approx(mean) and e["dz"] == pytest.approx(mean / sd)
    # the interval's ends are where the t statistic reaches the 2.5% / 97.5% points of t(4)
    for end, p in zip(e["ci95"], (0.975, 0.025)):
        assert _t_cdf((mean - end) / (sd / math.sqrt(5)), 4) == pytest.approx(p, abs=1e-4)
    assert e["dz_ci95"][0] < e["dz"] < e["dz_ci95"][1]
    assert study.paired_effect([0.1])["ci95"] is None and study.paired_effect([])["mean"] is None


def _write_run(root: Path, arm: str, seed: int, *, reward0: float, slope: float, entropy: float, acc0: float):
    d = root / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    lines = [{"step": 0, "data": {"val-core/openai/gsm8k/reward/mean@1": acc0}}]
    for s in range(1, 13):
        lines.append({"step": s, "data": {"critic/score/mean": reward0 + slope * s, "actor/entropy": entropy,
                                          "rollout_corr/rollout_log_ppl": entropy + 0.1,
                                          "response_length/mean": 200.0, "timing_s/step": 10.0}})
    lines.append({"step": 12, "data": {"val-core/openai/gsm8k/reward/mean@1": acc0 + 0.1}})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_summary_contrasts_targets_and_bands(tmp_path):
    effects = {"bf16": (0.30, 0.010, 0.50, 0.30), "nvfp4_noaqn": (0.28, 0.010, 0.60, 0.25),
               "nvfp4": (0.28, 0.015, 0.65, 0.25), "bf16_aqn": (0.30, 0.012, 0.55, 0.30)}
    for arm, (r0, slope, ent, acc0) in effects.items():
        for seed in range(3):
            _write_run(tmp_path / "runs", arm, seed, reward0=r0 + 0.01 * seed, slope=slope,
                       entropy=ent + 0.01 * seed * (arm == "nvfp4"), acc0=acc0)
    res = study.summarize_study(tmp_path / "runs", tmp_path / "out", device="cpu")
    pairs = res["paired"]
    assert set(pairs) == {"nvfp4_noaqn - bf16", "nvfp4 - nvfp4_noaqn", "bf16_aqn - bf16", "nvfp4 - bf16"}
    assert pairs["nvfp4_noaqn - bf16"]["early_entropy"]["mean"] == pytest.approx(0.10)
    assert pairs["nvfp4_noaqn - bf16"]["acc_step0"]["mean"] == pytest.approx(-0.05)
    assert pairs["bf16_aqn - bf16"]["mean_reward"]["mean"] == pytest.approx(0.002 * 6.5)
    e = pairs["nvfp4 - bf16"]["early_entropy"]  # differences 0.15, 0.16, 0.17: a real interval
    assert e["mean"] == pytest.approx(0.16) and e["ci95"][0] < 0.16 < e["ci95"][1]
    names = [t["name"] for t in res["targets"]]
    assert any("AQN helps on the BF16 base" in n for n in names) and any("step-0 damage" in n for n in names)
    assert all("measured" in t and "ci95" in t for t in res["targets"])
    band = res["bands"]["reward"]["nvfp4"]
    assert band[0][0] == 1 and band[0][4] == 3 and band[0][2] < band[0][1] < band[0][3]
    assert (tmp_path / "out" / "study-cpu.json").is_file() and (tmp_path / "out" / "study-cpu.md").is_file()


def test_data_writes_the_chosen_level(tmp_path):
    assert study.main(["data", "--out", str(tmp_path / "d"), "--level", "L2", "--n-train", "5", "--n-test", "3"]) == 0
    meta = json.loads((tmp_path / "d" / "problems.json").read_text())
    assert meta["level"] == "L2" and meta["difficulty"]["max_value"] == 300
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "d" / "train.parquet")) == 5
    assert study.main([]) == 2
