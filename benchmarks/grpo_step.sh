#!/usr/bin/env bash
# Issue 8's GRPO step benchmark with its defaults: QeRL (NVFP4 + LoRA + AQN) vs BF16 LoRA on a random
# Qwen2.5-7B-shaped model, one GPU each, a few `python -m verl.trainer.main_ppo` GRPO steps, per-phase
# times, tokens/s and peak GPU memory; writes benchmarks/results/grpo_step-*.json (or $OUT).
#   bash benchmarks/grpo_step.sh                      # 7B, qerl vs lora, sequential on GPU 0
#   bash benchmarks/grpo_step.sh --concurrent         # the two runs at once on GPUs 0 and 1
#   bash benchmarks/grpo_step.sh --model 32b --variants qerl     # (32B: see README, "32B on one GPU")
#   bash benchmarks/grpo_step.sh --compare gpus --gpus 2 --model /path/to/hf   # issue 9: 1 vs 2 GPUs
# Every option: python benchmarks/grpo_step.py --help
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/grpo_step.py" "$@"
