#!/usr/bin/env bash
# The README's main job on the embedded default: `python -m verl.trainer.main_ppo +qerl=nvfp4` for 3 GRPO steps
# of a tiny local Qwen2 (NVFP4 actor + LoRA under FSDP2, the qerl_nvfp4 vLLM rollout with the adapter synced
# each step, AQN on the rollout's RMSNorms). CPU by default; GPU when one is present. No downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WORKDIR:-runs/tiny}
WORKDIR=$W bash examples/tiny/grpo.sh nvfp4 "$@"
.venv/bin/python examples/tiny/summarize.py "$W/metrics-nvfp4.jsonl"
