#!/usr/bin/env bash
# The LoRA expand above 8 tokens (cuBLAS from C++ from CUBLAS_MIN_TOKENS tokens, Triton below) on the staged GPU
# machine, one detached job:
#   bash benchmarks/gpu/detached.sh start le bash benchmarks/gpu/lora_expand_check.sh /tmp/detached/le/out
# In order: build + the expand / LoRA / kernel GPU tests; lora_profile_pair.sh (prefill medians and profile, decode at
# B = 1 / 8 / 64); rollout.py 7B with / without LoRA at B = 1, 8 (ours only); tests/test_vllm_gpu.py. Steps after a
# failed one still run; the exit status says whether any failed. Needs the vLLM stage (benchmarks/GPU.md).
set -uo pipefail
OUT=${1:?usage: $0 OUT_DIR}
cd "$(dirname "$0")/../.."
source benchmarks/gpu/steps.sh
check_start lora_expand_check
build_step 240
step gpu_tests 400 bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_lora_expand_gpu.py \
  tests/test_lora_fused_gpu.py tests/test_lora_linear_gpu.py tests/test_lora_expand.py tests/test_kernels_gpu.py \
  > '$OUT/gpu_tests.log' 2>&1"
tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
step lora_profile 600 bash benchmarks/gpu/lora_profile_pair.sh "$OUT/lp" --prompt-tokens 256 --batches 1,8,64 \
  --prefill-profile 1,8 --profile-batches 64
grep -hE "target|prefill profiled" "$OUT"/lp/log-* | tee -a "$LOG"
step rollout 700 bash -c "python3 benchmarks/rollout.py --models 7b --backends qerl_nvfp4 --batches 1,8 --lora-split \
  --out '$OUT' > '$OUT/rollout.log' 2>&1"
grep -E "^\[rollout\].*(B=|target)" "$OUT/rollout.log" | tail -12 | tee -a "$LOG"
step vllm_gpu_tests 500 bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_vllm_gpu.py > '$OUT/vllm_tests.log' 2>&1"
tail -3 "$OUT/vllm_tests.log" | tee -a "$LOG"
echo "[lora_expand_check] done, failed steps: $fail" | tee -a "$LOG"
exit $fail
