#!/usr/bin/env bash
# The register-A wgmma kernel with the LoRA term in its launch (17-64 tokens) and the prefill in CUDA graphs, one
# detached job on the staged GPU machine:
#   bash benchmarks/gpu/detached.sh start wl bash benchmarks/gpu/wgmma_lora_check.sh /tmp/detached/wl/out
# In order: build; the fused-LoRA and kernel GPU tests (float64 references, the wgmma LoRA kernel included);
# lora_profile_pair.sh at B = 64 (decode with / without LoRA, eager kernel table); rollout.py 7B (ours) with /
# without LoRA at B = 1, 8 with max_num_seqs 256, as verl runs the engine (prompts up to 512 tokens captured).
# NO_ROLLOUT=1 skips the rollout. Steps after a failed one still run; the exit status says whether any failed.
# Needs the vLLM stage (GPU.md).
set -uo pipefail
OUT=${1:?usage: $0 OUT_DIR}
cd "$(dirname "$0")/../.."
source benchmarks/gpu/steps.sh
check_start wgmma_lora_check
build_step 240
step gpu_tests 300 bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_lora_fused_gpu.py \
  tests/test_kernels_gpu.py > '$OUT/gpu_tests.log' 2>&1"
tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
step lora_profile 500 bash benchmarks/gpu/lora_profile_pair.sh "$OUT/lp" --prompt-tokens 256 --batches 64 \
  --profile-batches 64
grep -hE "target" "$OUT"/lp/log-* | tee -a "$LOG"
if [ -z "${NO_ROLLOUT:-}" ]; then
  step rollout 600 bash -c "python3 benchmarks/rollout.py --models 7b --backends qerl_nvfp4 --batches 1,8 \
    --lora-split --max-num-seqs 256 --out '$OUT' > '$OUT/rollout.log' 2>&1"
  grep -E "^\[rollout\].*(B=|target)" "$OUT/rollout.log" | tail -12 | tee -a "$LOG"
fi
echo "[wgmma_lora_check] done, failed steps: $fail" | tee -a "$LOG"
exit $fail
