#!/usr/bin/env bash
# GPU checks of the wgmma SS kernel (cuda/nvfp4_gemm_wgmma_ss.cu, op mode wgmma_ss) next to the register-A wgmma kernel (wgmma_rs), ON the GPU
# machine from the repository root. Phases (STEPS, comma list, default all): build, tests (the wgmma_ss GPU tests,
# -x), timing (CUDA-graph, 7B + 32B, M = 64/128/256/1024, stream-K / wgmma_rs / wgmma_ss), alltests (the whole
# wgmma test subset), sanitizer (memcheck, racecheck, synccheck on the wgmma_ss cases).
#   OUT=$OUT STEPS=build,tests,timing bash benchmarks/gpu/wgmma_ss_check.sh
# Writes to $OUT: ss_check.log, ss_tests.log, kernel-<gpu>.json (+ gemm_dispatch), ss_alltests.log, ss_sanitizer.log
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
STEPS=${STEPS:-build,tests,timing,alltests,sanitizer}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/qerl-ext-$$}"
LOG="$OUT/ss_check.log"; : > "$LOG"
fail=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }
STEP_TAG=ss_check
source benchmarks/gpu/steps.sh  # the script has cd-ed to the repository root
echo "[ss_check] $(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | head -1)" | tee -a "$LOG"
if has build; then
  build_step "${BUILD_S:-150}" 2>&1 | tail -5 | tee -a "$LOG"
fi
if has tests; then
  step tests "${TESTS_S:-75}" bash -c "python3 -m pytest -x -q -p no:cacheprovider tests/test_kernels_gpu.py \
    -k \"${SS_TESTS_K:-wgmma_ss}\" \
    > '$OUT/ss_tests.log' 2>&1"
  tail -15 "$OUT/ss_tests.log" | tee -a "$LOG"
fi
if has timing; then
  step timing "${TIMING_S:-110}" python3 benchmarks/kernel.py --no-tune --no-marlin --variants "${SS_VARIANTS:-wgmma_rs,wgmma_ss}" \
    --models "${SS_MODELS:-qwen2.5-7b,qwen2.5-32b}" --ms "${SS_MS:-64,128,256,1024}" --out "$OUT" > "$OUT/ss_timing.log" 2>&1
  grep -A60 "fused-kernel variants" "$OUT/ss_timing.log" | tee -a "$LOG" | tail -80
fi
if has alltests; then
  step alltests "${ALLTESTS_S:-120}" bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
    -k 'wgmma or variants or calibration or auto' > '$OUT/ss_alltests.log' 2>&1"
  tail -5 "$OUT/ss_alltests.log" | tee -a "$LOG"
fi
if has sanitizer; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  : > "$OUT/ss_sanitizer.log"
  for tool in memcheck racecheck synccheck; do
    # memcheck on every mode-8 case; racecheck / synccheck (slow: every shared access) on the weights <= 1.4 M
    lim=""; [ "$tool" = memcheck ] || lim="--sanitize-max-nk 1400000"
    echo "### $tool" >> "$OUT/ss_sanitizer.log"
    step "sanitizer-$tool" "${SAN_S:-60}" bash -c "'$SAN' --tool $tool --error-exitcode 9 python3 benchmarks/kernel.py \
      --sanitize --sanitize-modes wgmma_ss $lim >> '$OUT/ss_sanitizer.log' 2>&1"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SANITIZE|Error|error" "$OUT/ss_sanitizer.log" | tail -3 | tee -a "$LOG"
  done
fi
echo "[ss_check] done, failed steps: $fail" | tee -a "$LOG"
exit $fail
