#!/usr/bin/env bash
# The README's main job on the embedded default: `python -m verl.trainer.main_ppo +qerl=nvfp4` for 3 GRPO steps
# of a tiny local Qwen2 (NVFP4 actor + LoRA under FSDP2, the qerl_nvfp4 vLLM rollout with the adapter synced
# each step, AQN on the rollout's RMSNorms). CPU by default; GPU when one is present. No downloads.
# WORKDIR (default runs/tiny), PYTHON (default .venv/bin/python) and VERL_FILE_LOGGER_PATH as for examples/tiny/grpo.sh.
set -euo pipefail
# paths given relative to the caller's folder stay so: made absolute before the cd to the repository
source "$(dirname "${BASH_SOURCE[0]}")/lib/paths.sh"
if [ -n "${WORKDIR:-}" ]; then export WORKDIR; WORKDIR=$(abs_path "$WORKDIR"); fi
if [ -n "${VERL_FILE_LOGGER_PATH:-}" ]; then export VERL_FILE_LOGGER_PATH; VERL_FILE_LOGGER_PATH=$(abs_path "$VERL_FILE_LOGGER_PATH"); fi
if [[ ${PYTHON:-} == */* ]]; then export PYTHON; PYTHON=$(abs_path "$PYTHON"); fi
cd "$(dirname "$0")/.."
W=${WORKDIR:-runs/tiny}
PY=${PYTHON:-.venv/bin/python}  # the interpreter grpo.sh runs
WORKDIR=$W bash examples/tiny/grpo.sh nvfp4 "$@"
# the metrics file grpo.sh wrote: VERL_FILE_LOGGER_PATH when given, else its default in WORKDIR
"$PY" examples/tiny/summarize.py "${VERL_FILE_LOGGER_PATH:-$W/metrics-nvfp4.jsonl}"
