#!/usr/bin/env bash
# DAPO on BigMath (paper Table 2: 7B/14B levels 3-5, 32B levels 4-5), evaluated on MATH500.
# usage: bigmath_dapo.sh SIZE VARIANT [extra hydra overrides...]
#   data: python examples/data/prepare.py bigmath --out $DATA_DIR/bigmath [--levels 4,5]
#         python examples/data/prepare.py math500 --out $DATA_DIR/math500
# DAPO = dynamic sampling (drop groups with zero reward variance), clip-higher 0.28, token-mean loss,
# overlong reward shaping, no KL; one policy update per rollout (on-policy), G = 16.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/common.sh"
SIZE=${1:?SIZE (3B|7B|14B|32B)}; VARIANT=${2:?VARIANT (qerl|nvfp4|lora|qlora)}; shift 2
DATA=${DATA_DIR:-$HOME/data}
MAXLEN=${MAX_RESPONSE:-8192}
qerl_base_args "$SIZE" "$VARIANT"
TRAIN=$(qerl_hydra_path "$DATA/bigmath/train.parquet"); VAL=$(qerl_hydra_path "$DATA/math500/test.parquet")
exec "${PYTHON:-python3}" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  actor_rollout_ref.actor.use_kl_loss=False \
  algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc \
  reward.reward_manager.name=dapo \
  +reward.reward_kwargs.max_resp_len=$MAXLEN \
  +reward.reward_kwargs.overlong_buffer_cfg.enable=True \
  +reward.reward_kwargs.overlong_buffer_cfg.len=$((MAXLEN / 4)) \
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
  +reward.reward_kwargs.overlong_buffer_cfg.log=False \
  data.train_files="$TRAIN" data.val_files="$VAL" \
  data.max_prompt_length=1024 data.max_response_length=$MAXLEN \
  actor_rollout_ref.rollout.n=16 \
  actor_rollout_ref.actor.ppo_mini_batch_size=${TRAIN_BATCH_SIZE:-128} \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${MICRO_BATCH:-2} \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=${MICRO_BATCH:-2} \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=${MICRO_BATCH:-2} \
  trainer.total_training_steps=${STEPS:-1000} \
  "${QERL_ARGS[@]}" "$@"
