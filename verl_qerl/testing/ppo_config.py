"""verl's ``ppo_trainer`` config composed the way the config tests need it: the few overrides any qerl run has
(model path, LoRA rank, vLLM rollout, FSDP2, GRPO, small batches) plus the test's own. Needs verl and hydra."""

from __future__ import annotations

from typing import Any

#: The overrides every composed test config starts from.
BASE_OVERRIDES = (
    "actor_rollout_ref.model.path=/nonexistent/model",
    "actor_rollout_ref.model.lora_rank=32",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "trainer.n_gpus_per_node=1",
)


def composed(*overrides: str) -> Any:
    """``ppo_trainer`` with :data:`BASE_OVERRIDES` and ``overrides`` (hydra's compose API, as main_ppo reads it)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*BASE_OVERRIDES, *overrides])
