#!/usr/bin/env bash
# Shared base of the QeRL launch scripts: one place for the paper's hyperparameters (arXiv 2510.11696,
# Table 4 / App. E-J), so the three variants of every run differ only where the method differs.
#   variant: qerl  = NVFP4 frozen base + LoRA + AQN      (lr 1e-5)
#            nvfp4 = NVFP4 frozen base + LoRA, no AQN     (lr 1e-5)
#            lora  = BF16 base + LoRA                      (lr 5e-6: BF16 LoRA collapses above it, paper App. I)
#            qlora = NF4 base (bitsandbytes) + LoRA        (lr 1e-5)
# Sourced by gsm8k_grpo.sh and bigmath_dapo.sh; sets QERL_ARGS (an array of hydra overrides).
set -euo pipefail

qerl_model_path() {  # SIZE -> the Qwen2.5-*-Instruct checkpoint (local folder; override with MODEL_PATH)
  echo "${MODEL_PATH:-${MODELS_DIR:-$HOME/models}/Qwen2.5-$1-Instruct}"
}

source "$(dirname "${BASH_SOURCE[0]}")/../lib/paths.sh"

qerl_hydra_path() {  # PATH -> the path as a hydra override value, asking ${PYTHON:-python3} (examples/lib/paths.sh)
  hydra_path "${PYTHON:-python3}" "$1"
}

qerl_vllm_mem() {  # the paper's vLLM memory budget per size (App. J), identical across variants
  case "$1" in 3B) echo 0.20 ;; 7B) echo 0.30 ;; 14B) echo 0.45 ;; 32B) echo 0.40 ;; *) echo 0.40 ;; esac
}

qerl_variant_args() {  # VARIANT -> overrides that select the base-weight format, AQN and the learning rate
  case "$1" in
    qerl)  echo "+qerl=nvfp4 actor_rollout_ref.actor.optim.lr=1e-5" ;;
    nvfp4) echo "+qerl=nvfp4_noaqn actor_rollout_ref.actor.optim.lr=1e-5" ;;
    lora)  echo "+qerl=bf16 actor_rollout_ref.actor.optim.lr=5e-6" ;;
    qlora) echo "+qerl=nf4 actor_rollout_ref.actor.optim.lr=1e-5" ;;
    *) echo "unknown variant '$1' (qerl | nvfp4 | lora | qlora)" >&2; return 2 ;;
  esac
}

qerl_base_args() {  # SIZE VARIANT -> QERL_ARGS shared by GRPO and DAPO runs
  local size=$1 variant=$2
  local vargs model
  vargs=$(qerl_variant_args "$variant")
  model=$(qerl_hydra_path "$(qerl_model_path "$size")")
  QERL_ARGS=(
    actor_rollout_ref.model.path="$model"
    actor_rollout_ref.model.lora_rank=32                # paper: rank 32 in the main experiments
    actor_rollout_ref.model.lora_alpha=32
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.grad_clip=0.2
    actor_rollout_ref.actor.entropy_coeff=0             # no entropy loss (Table 4)
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization="$(qerl_vllm_mem "$size")"
    actor_rollout_ref.rollout.load_format=safetensors   # the base loads once; only LoRA tensors sync each step
    data.train_batch_size=${TRAIN_BATCH_SIZE:-128}
    trainer.logger='["console","tensorboard"]'
    trainer.project_name=qerl
    trainer.experiment_name="${EXPERIMENT:-$(basename "$0" .sh)-$size-$variant}"
    trainer.n_gpus_per_node=${GPUS:-1}
    trainer.nnodes=1
    trainer.save_freq=${SAVE_FREQ:-100}
    trainer.test_freq=${TEST_FREQ:-50}
    +actor_rollout_ref.actor.checkpoint.save_lora_only=True
  )
  # shellcheck disable=SC2206
  QERL_ARGS+=($vargs)
  if ! "${PYTHON:-python3}" -c "import flash_attn" 2>/dev/null; then
    # verl's actor expects flash-attn; without it: packed rows on PyTorch's FlashAttention-2 (verl-qerl's qerl_varlen)
    QERL_ARGS+=(+actor_rollout_ref.model.override_config.attn_implementation=qerl_varlen
                actor_rollout_ref.model.use_remove_padding=True)
  fi
}
