#!/usr/bin/env bash
# GRPO on GSM8K (paper Table 1: 3B and 7B). usage: gsm8k_grpo.sh SIZE VARIANT [extra hydra overrides...]
#   SIZE: 3B | 7B | 14B | 32B   VARIANT: qerl | nvfp4 | lora | qlora
#   data: python examples/data/prepare.py gsm8k --out $DATA_DIR/gsm8k  (default DATA_DIR=$HOME/data)
# Example: bash examples/qerl/gsm8k_grpo.sh 7B qerl trainer.total_training_steps=600
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/common.sh"
SIZE=${1:?SIZE (3B|7B|14B|32B)}; VARIANT=${2:?VARIANT (qerl|nvfp4|lora|qlora)}; shift 2
DATA=${DATA_DIR:-$HOME/data}/gsm8k
qerl_base_args "$SIZE" "$VARIANT"
TRAIN=$(qerl_hydra_path "$DATA/train.parquet"); VAL=$(qerl_hydra_path "$DATA/test.parquet")
exec "${PYTHON:-python3}" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  actor_rollout_ref.actor.use_kl_loss=False \
  data.train_files="$TRAIN" data.val_files="$VAL" \
  data.max_prompt_length=256 data.max_response_length=${MAX_RESPONSE:-4096} \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${MICRO_BATCH:-4} \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=${MICRO_BATCH:-4} \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=${MICRO_BATCH:-4} \
  trainer.total_training_steps=${STEPS:-600} \
  "${QERL_ARGS[@]}" "$@"
# ppo_mini_batch_size=32 of 128 prompts: 4 policy updates per rollout, as the paper's GSM8K runs (Table 4).
