#!/usr/bin/env bash
# One GPU call that validates and times the Hopper wgmma GEMM (cuda/nvfp4_gemm_wgmma.cu) next to split-K and stream-K
# (ON the GPU machine, repository root; bare image: torch, nvcc, ninja, ncu, compute-sanitizer).
#   OUT=$OUT bash benchmarks/gpu/wgmma_check.sh            # ~6-8 min on one H200
# Order: correctness first (the wgmma GPU tests, stopping at the first failure, then the whole GPU test file and
# compute-sanitizer), then CUDA-graph timing per decoder layer (7B and 32B, M = 1-1024) and an ncu summary at M = 64.
# Steps after a failed one still run; the exit status says whether any failed.
# Writes to $OUT: wgmma_check.log, wgmma_tests.log, gpu_tests.log, sanitizer.log, kernel-<gpu>.json, ncu-wgmma-m64.csv
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# a private JIT cache: a build killed mid-way on a shared warm machine leaves torch's lock file behind, and every
# later build of the same extension waits on it forever (seen: build step timed out at 300 s)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/qerl-ext-$$}"
LOG="$OUT/wgmma_check.log"; : > "$LOG"
fail=0
STEP_TAG=wgmma_check
source benchmarks/gpu/steps.sh  # the script has cd-ed to the repository root
echo "[wgmma_check] $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$LOG"
build_step 150
if ! step wgmma_tests 100 bash -c "python3 -m pytest -x -q -p no:cacheprovider tests/test_kernels_gpu.py -k wgmma \
    > '$OUT/wgmma_tests.log' 2>&1"; then
  tail -30 "$OUT/wgmma_tests.log" | tee -a "$LOG"
  # diagnostic: the shared-memory descriptor's LBO / SBO roles swapped
  step wgmma_tests_swapped 120 bash -c "QERL_WGMMA_SWAP_LBO_SBO=1 python3 -m pytest -x -q -p no:cacheprovider \
    tests/test_kernels_gpu.py -k 'wgmma_kernel_every_m and 4608' 2>&1 | tail -5" | tee -a "$LOG"
fi
tail -3 "$OUT/wgmma_tests.log" | tee -a "$LOG"
step timing 150 python3 benchmarks/kernel.py --no-tune --no-marlin --variants splitk,streamk,wgmma_rs \
  --models qwen2.5-7b,qwen2.5-32b --ms "${WGMMA_MS:-1,16,64,128,256,1024}" --out "$OUT"
step gpu_tests 200 bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py > '$OUT/gpu_tests.log' 2>&1"
tail -3 "$OUT/gpu_tests.log" | tee -a "$LOG"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step sanitizer 150 bash -c "'$SAN' --tool memcheck --error-exitcode 9 python3 benchmarks/kernel.py --sanitize \
  > '$OUT/sanitizer.log' 2>&1"
grep -E "ERROR SUMMARY|SANITIZE|error" "$OUT/sanitizer.log" | tail -3 | tee -a "$LOG"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu 120 bash -c "'$NCU' --clock-control none -k 'regex:nvfp4_gemm' --section SpeedOfLight \
  --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats --csv --page details \
  python3 benchmarks/kernel.py --profile --variants wgmma_rs,streamk --profile-m 64 > '$OUT/ncu-wgmma-m64.csv' 2>&1"
echo "[wgmma_check] done, failed steps: $fail" | tee -a "$LOG"
exit $fail
