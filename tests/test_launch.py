"""verl_qerl.verl.launch: the shared main_ppo override lists, and both launchers that use them.

The two frozen sets below are what ``benchmarks/grpo_step.py`` and ``examples/exploration/run_arms.py``
produce for a CPU run, written out in full: the shared core in ``launch.py`` must keep producing exactly these.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_qerl.testing.scripts import REPO, load_script
from verl_qerl.verl.launch import cpu_platform_overrides, grpo_overrides, sdpa_overrides, varlen_overrides

gs = load_script("benchmarks/grpo_step.py", "grpo_step")
sys.path.insert(0, str(REPO / "examples" / "exploration"))
import run_arms  # noqa: E402

CORE = dict(qerl="nvfp4", model=Path("/m"), train_files="/d/train.parquet", val_files="/d/test.parquet",
            train_batch_size=8, max_prompt_length=64, max_response_length=32, n=4, lora_rank=16, lora_alpha=32,
            lr=1e-5, mini_batch_size=4, micro_batch_size=2, gpu_memory_utilization=0.3, seed=5, steps=3)


def test_grpo_overrides_values():
    ov = grpo_overrides(**CORE)
    for kv in ("+qerl=nvfp4", "algorithm.adv_estimator=grpo", "data.train_files=/d/train.parquet",
               "data.val_files=/d/test.parquet", "data.train_batch_size=8", "data.max_prompt_length=64",
               "data.max_response_length=32", "data.shuffle=True", "data.seed=5", "actor_rollout_ref.model.path=/m",
               "actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
               "actor_rollout_ref.actor.optim.lr=1e-05", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=4",
               "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
               "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.max_model_len=96",
               "actor_rollout_ref.rollout.seed=5", "actor_rollout_ref.actor.fsdp_config.seed=5",
               "actor_rollout_ref.actor.data_loader_seed=5", "trainer.n_gpus_per_node=1",
               "trainer.total_training_steps=3", "trainer.logger=[console,file]", "trainer.save_freq=-1"):
        assert kv in ov, kv
    assert len(set(ov)) == len(ov) and all("=" in x for x in ov)
    assert len({x.split("=", 1)[0] for x in ov}) == len(ov)  # each key once
    ov = grpo_overrides(**CORE, gpus=2, tp=2, temperature=0.7, shuffle=False, max_model_len=104,
                        logger='["console","file"]')
    for kv in ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
               "actor_rollout_ref.rollout.temperature=0.7", "data.shuffle=False",
               "actor_rollout_ref.rollout.max_model_len=104", 'trainer.logger=["console","file"]'):
        assert kv in ov, kv
    with pytest.raises(TypeError):
        grpo_overrides("nvfp4")  # keyword-only


def test_cpu_platform_and_sdpa():
    assert sdpa_overrides() == ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                                "actor_rollout_ref.model.use_remove_padding=False"]
    cpu = cpu_platform_overrides(2)
    assert "+ray_kwargs.ray_init.num_gpus=2" in cpu and "trainer.device=cpu" in cpu
    assert set(sdpa_overrides()) <= set(cpu) and "actor_rollout_ref.rollout.enforce_eager=True" in cpu
    assert "+ray_kwargs.ray_init.num_gpus=1" in cpu_platform_overrides(1)


def _grpo_step_cpu() -> list[str]:
    args = gs.parse_args(["--tiny", "--enforce-eager", "--batch", "4", "--n", "2", "--micro-batch", "4", "--seed", "7"])
    return gs.main_ppo_overrides(args, "qerl", 2, Path("/x/m"), Path("/x/t"), Path("/x/v"))


def _run_arms_cpu(tmp_path: Path) -> list[str]:
    args = run_arms.parse_args(["--model", str(tmp_path / "m"), "--data", str(tmp_path / "d"), "--out",
                                str(tmp_path / "o"), "--dry-run", "--device", "cpu"])
    return run_arms.overrides(args, "nvfp4", 3, tmp_path / "run", flash_attn=False)


#: grpo_step.py --tiny (CPU), variant qerl, 2 GPUs: the full override list, qerl.replay_poll_s included
GRPO_STEP_CPU = {
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "+actor_rollout_ref.rollout.enable_sleep_mode=False", "+qerl=nvfp4", "+ray_kwargs.ray_init.num_gpus=2",
    "actor_rollout_ref.actor.data_loader_seed=7", "actor_rollout_ref.actor.fsdp_config.seed=7",
    "actor_rollout_ref.actor.optim.lr=1e-05", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.path=/x/m",
    "actor_rollout_ref.model.use_remove_padding=False", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.free_cache_engine=False", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.max_model_len=648",
    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.seed=7",
    "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "algorithm.adv_estimator=grpo", "data.dataloader_num_workers=0", "data.max_prompt_length=128",
    "data.max_response_length=512", "data.seed=7", "data.shuffle=False", "data.train_batch_size=4",
    "data.train_files=/x/t", "data.val_files=/x/v", "qerl.aqn.num_stages=3", "qerl.replay_poll_s=0.1",
    "ray_kwargs.ray_init.num_cpus=32", "reward.num_workers=1", "trainer.device=cpu",
    "trainer.experiment_name=qerl-2gpu",
    "trainer.logger=[console,file]", "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
    "trainer.project_name=qerl-grpo-step", "trainer.save_freq=-1", "trainer.test_freq=-1",
    "trainer.total_training_steps=4", "trainer.val_before_train=False",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
}


def _run_arms_cpu_expected(d: Path, m: Path, run: Path) -> set[str]:
    """run_arms.py --device cpu, arm nvfp4, seed 3, defaults otherwise: the full override list."""
    return {
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False", "+qerl=nvfp4",
        "+ray_kwargs.ray_init.include_dashboard=False", "+ray_kwargs.ray_init.num_gpus=1",
        "+ray_kwargs.ray_init.object_store_memory=1073741824", "actor_rollout_ref.actor.data_loader_seed=3",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.fsdp_config.seed=3",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.optim.lr=0.0002",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.model.lora_rank=32",
        f"actor_rollout_ref.model.path={m}", "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.ref.fsdp_config.seed=3", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.free_cache_engine=False", "actor_rollout_ref.rollout.gpu_memory_utilization=0.05",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.max_model_len=224", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.seed=3",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False", "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0", "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False", "data.dataloader_num_workers=0", "data.max_prompt_length=128",
        "data.max_response_length=96", "data.seed=3", "data.shuffle=True", "data.train_batch_size=32",
        f"data.train_files={d}/train.parquet", f"data.val_files={d}/test.parquet", "qerl.aqn.num_stages=10",
        "qerl.aqn.seed=3", "ray_kwargs.ray_init.num_cpus=32", "reward.num_workers=1",
        f"trainer.default_local_dir={run}/ckpt", "trainer.device=cpu", "trainer.experiment_name=nvfp4-s3",
        'trainer.logger=["console","file"]', "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.project_name=qerl-exploration", "trainer.save_freq=-1", "trainer.test_freq=5",
        "trainer.total_training_steps=30", "trainer.val_before_train=True",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    }


def test_both_launchers_keep_their_cpu_overrides(tmp_path):
    ov = _grpo_step_cpu()
    assert set(ov) == GRPO_STEP_CPU and len(ov) == len(GRPO_STEP_CPU)
    ov = _run_arms_cpu(tmp_path)
    expected = _run_arms_cpu_expected((tmp_path / "d").resolve(), (tmp_path / "m").resolve(), tmp_path / "run")
    assert set(ov) == expected and len(ov) == len(expected)


def test_no_flash_attn_picks_varlen_in_both(tmp_path, monkeypatch):
    monkeypatch.setattr(gs, "_has_flash_attn", lambda: False)
    args = gs.parse_args(["--variants", "lora"])
    ov = gs.main_ppo_overrides(args, "lora", 1, Path("/m"), Path("/t"), Path("/v"))
    assert set(varlen_overrides()) <= set(ov) and not set(sdpa_overrides()) & set(ov)
    assert "trainer.device=cpu" not in ov
    ov = gs.main_ppo_overrides(gs.parse_args(["--variants", "lora", "--attention", "sdpa"]), "lora", 1, Path("/m"),
                               Path("/t"), Path("/v"))
    assert set(sdpa_overrides()) <= set(ov) and not set(varlen_overrides()) & set(ov)
    with pytest.raises(gs.StepBenchError, match="flash-attn package is not installed"):
        gs.main_ppo_overrides(gs.parse_args(["--variants", "lora", "--attention", "flash"]), "lora", 1, Path("/m"),
                              Path("/t"), Path("/v"))
    monkeypatch.setattr(gs, "_has_flash_attn", lambda: True)
    ov = gs.main_ppo_overrides(args, "lora", 1, Path("/m"), Path("/t"), Path("/v"))
    assert not (set(sdpa_overrides()) | set(varlen_overrides())) & set(ov)
    args = run_arms.parse_args(["--model", "m", "--data", "d", "--out", "o", "--dry-run"])
    ov = run_arms.overrides(args, "bf16", 0, tmp_path, flash_attn=False)
    assert set(varlen_overrides()) <= set(ov) and "trainer.device=cpu" not in ov
    assert not set(varlen_overrides()) & set(run_arms.overrides(args, "bf16", 0, tmp_path, flash_attn=True))


def test_both_launchers_cpu_lists_compose_in_verls_config(tmp_path):
    from hydra import compose, initialize_config_module

    from verl_qerl.verl.config import apply_qerl

    for ov, gpus, seed in ((_grpo_step_cpu(), 2, 7), (_run_arms_cpu(tmp_path), 1, 3)):
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=ov)
        assert cfg.qerl.mode == "nvfp4" and cfg.trainer.device == "cpu"
        assert cfg.trainer.n_gpus_per_node == gpus and cfg.actor_rollout_ref.rollout.seed == seed
        assert list(cfg.trainer.logger) == ["console", "file"]
        apply_qerl(cfg)  # the plugin's own validation accepts it


def _keys(overrides) -> set[str]:
    return {o.split("=", 1)[0] for o in overrides}


def test_tiny_shell_launcher_keeps_up_with_launch_py():
    """examples/tiny/grpo.sh spells the README main job's overrides out for readers; it must set every key that
    launch.py's GRPO core and CPU platform set (apart from the seeds and shuffle it leaves at verl's defaults),
    so a key added to launch.py fails here until the shell twin has it too."""
    import re

    text = (REPO / "examples" / "tiny" / "grpo.sh").read_text()
    shell = set(re.findall(r"(?<![\w.$/-])(\+[a-z_]\w*(?:\.\w+)*|[a-z_]\w*(?:\.\w+)+)=", text))
    left_at_defaults = {"data.shuffle", "data.seed", "actor_rollout_ref.actor.data_loader_seed",
                        "actor_rollout_ref.actor.fsdp_config.seed", "actor_rollout_ref.rollout.seed",
                        "actor_rollout_ref.rollout.temperature"}
    missing = _keys(grpo_overrides(**CORE)) - left_at_defaults - shell
    assert not missing, f"examples/tiny/grpo.sh lacks {sorted(missing)} (set in verl_qerl/verl/launch.py)"
    missing = _keys(cpu_platform_overrides(1)) - shell
    assert not missing, f"examples/tiny/grpo.sh's CPU branch lacks {sorted(missing)}"


@pytest.mark.parametrize("python,has_varlen", [("false", True), ("true", False)])
def test_launch_scripts_pick_qerl_varlen_only_without_flash_attn(python, has_varlen):
    """examples/qerl/common.sh: a python whose `import flash_attn` fails (`false`) gets qerl_varlen, else verl's
    default (flash_attention_2) stays."""
    import subprocess

    script = (f'source "{REPO}/examples/qerl/common.sh"; PYTHON={python} qerl_base_args 7B lora; '
              'printf "%s\\n" "${QERL_ARGS[@]}"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert ("+actor_rollout_ref.model.override_config.attn_implementation=qerl_varlen" in out) is has_varlen
    assert ("actor_rollout_ref.model.use_remove_padding=True" in out) is has_varlen
    assert "+qerl=bf16" in out


@pytest.mark.parametrize("variant", ["nvfp4", "nvfp4_noaqn", "bf16"])
def test_tiny_grpo_script_composes_for_every_variant(variant, tmp_path):
    """examples/tiny/grpo.sh passed qerl.aqn.num_stages=3 to every variant, and the bf16 / nvfp4_noaqn groups have
    no such key: hydra refused both runs the README advertises. A stand-in python records what the script
    launches; its main_ppo overrides must compose in verl's config and pass the plugin's check."""
    import os
    import shlex
    import subprocess

    from hydra import compose, initialize_config_module

    from verl_qerl.verl.config import apply_qerl

    calls, fake = tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\nfor a in \"$@\"; do printf '%q ' \"$a\"; done >> {calls}\n"
                    f"echo >> {calls}\nexit 0\n")
    fake.chmod(0o755)
    work = tmp_path / "w"
    work.mkdir()
    env = dict(os.environ, PYTHON=str(fake), WORKDIR=str(work), QERL_DEVICE="gpu", RAY_TMPDIR=str(tmp_path / "ray"))
    res = subprocess.run(["bash", str(REPO / "examples" / "tiny" / "grpo.sh"), variant], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    launch = [shlex.split(line) for line in calls.read_text().splitlines() if "verl.trainer.main_ppo" in line]
    assert len(launch) == 1
    overrides = launch[0][launch[0].index("verl.trainer.main_ppo") + 1:]
    assert f"+qerl={variant}" in overrides
    assert ("qerl.aqn.num_stages=3" in overrides) == (variant == "nvfp4")
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    assert apply_qerl(cfg).mode == ("bf16" if variant == "bf16" else "nvfp4")


@pytest.mark.parametrize("script", ["gsm8k_grpo.sh", "bigmath_dapo.sh"])
def test_paper_scripts_launch_the_python_they_checked_flash_attn_in(script, tmp_path):
    """common.sh decides the attention by `${PYTHON:-python3} -c "import flash_attn"`; the scripts then ran plain
    python3, so with PYTHON set the choice was made for another interpreter than the one launched."""
    import os
    import subprocess

    calls, fake = tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {calls}\nexit 1\n")  # `import flash_attn` fails here
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), DATA_DIR=str(tmp_path), MODEL_PATH=str(tmp_path / "m"))
    res = subprocess.run(["bash", str(REPO / "examples" / "qerl" / script), "7B", "qerl"], env=env,
                         capture_output=True, text=True, timeout=60)
    launched = [line for line in calls.read_text().splitlines() if "verl.trainer.main_ppo" in line]
    assert res.returncode == 1 and len(launched) == 1, (res.returncode, res.stderr[-2000:])
    assert "attn_implementation=qerl_varlen" in launched[0]  # the launched interpreter got its own choice
