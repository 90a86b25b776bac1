#!/usr/bin/env bash
# One GPU call that validates and times the fused-GEMM variants (ON the GPU machine, repository root).
#   OUT=$OUT bash benchmarks/gpu/kernel_check.sh            # ~4-6 min on one H100/H200
# Why one script: each new stream-K kernel version (cuda/nvfp4_gemm_streamk.cu) is written without a GPU; its call
# must answer, in order, "is it correct" (GPU tests of both variants, compute-sanitizer) before "is it fast"
# (CUDA-graph timing of splitk and streamk side by side on every model's shapes, which also calibrates auto's
# stream-K rule, then an ncu stall profile at M = 64 next to the version's prediction in benchmarks/NOTES.md).
# Works on the bare image (torch, nvcc, ninja, ncu, compute-sanitizer); when
# vLLM is staged (/tmp/site/qerl_env.sh, benchmarks/GPU.md) the timing gets the Marlin column and ncu profiles
# Marlin on the same weights. Steps after a failed one still run; the exit status says whether any failed.
# Writes to $OUT: kernel_check.log, gpu_tests.log, sanitizer.log, kernel-<gpu>.json, ncu-variants-m64.csv.gz.
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
if [ -f /tmp/site/qerl_env.sh ]; then source /tmp/site/qerl_env.sh; STAGED=1; else STAGED=0; fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
LOG="$OUT/kernel_check.log"; : > "$LOG"
fail=0
STEP_TAG=kernel_check
source benchmarks/gpu/steps.sh  # the script has cd-ed to the repository root
echo "[kernel_check] staged vLLM: $STAGED; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$LOG"
build_step 240
step gpu_tests 300 bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py > '$OUT/gpu_tests.log' 2>&1"
tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step sanitizer 300 bash -c "'$SAN' --tool memcheck --error-exitcode 9 python3 benchmarks/kernel.py --sanitize \
  > '$OUT/sanitizer.log' 2>&1"
grep -E "ERROR SUMMARY|error" "$OUT/sanitizer.log" | tail -3 | tee -a "$LOG"
MARLIN=(--no-marlin); [ "$STAGED" = 1 ] && MARLIN=()
step timing 300 python3 benchmarks/kernel.py --no-tune --variants splitk,streamk --models all \
  --ms 1,16,33,64,96,128 "${MARLIN[@]}" --out "$OUT"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
PM=(); [ "$STAGED" = 1 ] && PM=(--profile-marlin)
step ncu 240 bash -c "'$NCU' --clock-control none -k 'regex:nvfp4_gemm|Marlin' --set full --page raw --csv \
  python3 benchmarks/kernel.py --profile ${PM[*]} --variants splitk,streamk --profile-m 64 > /tmp/ncu_variants.csv"
gzip -c /tmp/ncu_variants.csv > "$OUT/ncu-variants-m64.csv.gz" 2>/dev/null
echo "[kernel_check] done, failed steps: $fail" | tee -a "$LOG"
exit $fail
