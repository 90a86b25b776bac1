#!/usr/bin/env bash
# One GPU call that validates and times qerl::nvfp4_lora_linear (the LoRA shrink inside the split-K GEMM's launch)
# ON the GPU machine, repository root:
#   OUT=$OUT bash benchmarks/gpu/lora_linear_check.sh          # ~5-8 min on one H100/H200, bare image
# In order: "is it correct" (the LoRA / PDL / kernel GPU tests; compute-sanitizer memcheck, racecheck and synccheck
# on the op at decode M, where the shrink CTAs publish their partials and the tiles wait on a flag), then "is it
# fast" (benchmarks/lora_gemm_bench.py: per decode GEMM the base, the shrink + GEMM pair and the one op, with and
# without PDL, 7B and 32B shapes). Steps after a failed one still run; the exit status says whether any failed.
# Writes to $OUT: lora_linear_check.log, gpu_tests.log, sanitizer.log, lora-gemm-<gpu>.json.
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
cd "$(dirname "$0")/../.."
source benchmarks/gpu/steps.sh
check_start lora_linear_check
echo "[lora_linear_check] $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$LOG"
build_step 240
step gpu_tests 300 bash -c "python3 -m pytest -q -p no:cacheprovider ${QERL_CHECK_TESTS:-tests/test_lora_linear_gpu.py \
  tests/test_lora_fused_gpu.py tests/test_pdl_gpu.py tests/test_kernels_gpu.py} > '$OUT/gpu_tests.log' 2>&1"
tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
: > "$OUT/sanitizer.log"
for tool in memcheck racecheck synccheck; do
  extra=(); [ "$tool" = racecheck ] && extra=(--racecheck-report all)
  for args in "1 0 0" "5 1 4" "8 1 1" "3 1 0"; do
    # shellcheck disable=SC2086
    step "sanitizer_${tool}_${args// /_}" 180 "$SAN" --tool "$tool" "${extra[@]}" --error-exitcode 9 \
      python3 benchmarks/racecheck/fused_once.py $args linear >> "$OUT/sanitizer.log" 2>&1
  done
done
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|repeat bit-identical" "$OUT/sanitizer.log" | sort | uniq -c | tee -a "$LOG"
step lora_gemm_bench 300 bash -c "set -o pipefail; python3 benchmarks/lora_gemm_bench.py --models \
  ${QERL_CHECK_MODELS:-qwen2.5-7b,qwen2.5-32b} --ms 1,8 --out '$OUT' | grep -vE '^\{' | tee -a '$LOG'"
echo "[lora_linear_check] done, failed steps: $fail" | tee -a "$LOG"
exit $fail
