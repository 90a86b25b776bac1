#!/usr/bin/env bash
# ON THE GPU MACHINE: kernel candidates checked and timed side by side in one call. Each argument is a repository
# copy at one commit (benchmarks/gpu/stage_candidates.sh makes them); for each, in its own folder and JIT cache:
# build, the wgmma GPU tests (stopping at the first failure: a wrong kernel is not timed), then the per-layer table
# (7B and 32B, M = 1-1024, split-K / stream-K / wgmma_rs side by side, CUDA graphs).
#   OUT=$OUT bash benchmarks/gpu/candidates_check.sh .xfer-cand/44fb047 .xfer-cand/51ade69   # ~2-3 min each
# Writes to $OUT, two files per candidate (a call returns 8): <name>.log and <name>-kernel.json (kernel.py's
# results: rows, per-layer ratios, targets). CAND_MS, CAND_MODELS override the table's M list and models.
# All candidates are JIT-built first, concurrently (one ninja each; ~1 min in all instead of ~1 min each).
# CAND_SANITIZE=all or a comma list of candidate names: for those, after the tests, compute-sanitizer memcheck and
# racecheck over kernel.py --sanitize's wgmma_rs shapes (N x K <= 1.5M; with QERL_WGMMA_CLUSTER=1 and =0), before
# timing. CAND_VARIANTS: the timed variants (default splitk,streamk,wgmma_rs). CAND_TESTS: pytest arguments of a
# second test step (e.g. tests/test_lora_fused_gpu.py), after the wgmma tests. CAND_LORA_MS: also time
# benchmarks/lora_gemm_bench.py at these token counts (<name>-lora-gemm.json; a third file per candidate).
# CAND_PDL=1: the table with kernel.py --pdl (`ours` as programmatic dependent launches, `ours_nopdl` beside it).
# CAND_SKIP_TESTS: a comma list of candidate names that go from the build straight to timing (the HEAD copies:
# their GPU tests ran when they landed; ~1-2 min saved per copy).
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
[ "$#" -ge 1 ] || { echo "usage: OUT=... bash benchmarks/gpu/candidates_check.sh FOLDER [FOLDER ...]" >&2; exit 2; }
mkdir -p "$OUT"
ROOT=$(pwd)
status=0
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
export SAN
for dir in "$@"; do  # concurrent JIT builds; each candidate's build step below then finds its cache
  [ -f "$dir/cuda/qerl_nvfp4.h" ] || continue
  name=$(basename "$dir")
  ( cd "$dir" && PYTHONPATH="$PWD" TORCH_EXTENSIONS_DIR="/tmp/qerl-ext-$name" MAX_JOBS=4 \
      timeout 300 python3 -c "from verl_qerl.kernels import load_extension as l; l()" \
      > "/tmp/prebuild-$name.log" 2>&1 ) &
done
wait
for dir in "$@"; do
  name=$(basename "$dir")
  [ -f "$dir/cuda/qerl_nvfp4.h" ] || { echo "candidates_check: $dir is not a staged repository copy" >&2; status=2; continue; }
  LOG="$OUT/$name.log"; : > "$LOG"
  STEP_TAG=$name
  fail=0
  (
    cd "$dir" || exit 2
    export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="/tmp/qerl-ext-$name"
    source "$ROOT/benchmarks/gpu/steps.sh"
    export LOG
    step build 150 bash -c 'python3 -c "$QERL_BUILD_CHECK_PY" >> "$LOG" 2>&1' || exit 1
    skip_tests=0
    [[ ",${CAND_SKIP_TESTS:-}," == *",$name,"* ]] && skip_tests=1
    [ "$skip_tests" = 1 ] && echo "[candidates_check] $name: tests skipped (CAND_SKIP_TESTS)" >> "$LOG"
    [ "$skip_tests" = 1 ] || step wgmma_tests 200 bash -c "python3 -m pytest -x -q -p no:cacheprovider tests/test_kernels_gpu.py -k wgmma \
      >> '$LOG' 2>&1" || { tail -30 "$LOG"; exit 1; }
    if [ -n "${CAND_TESTS:-}" ] && [ "$skip_tests" = 0 ]; then
      step more_tests 300 bash -c "python3 -m pytest -x -q -p no:cacheprovider $CAND_TESTS >> '$LOG' 2>&1" \
        || { tail -30 "$LOG"; exit 1; }
    fi
    if [ "${CAND_SANITIZE:-}" = all ] || [[ ",${CAND_SANITIZE:-}," == *",$name,"* ]]; then
      for tool in memcheck racecheck; do
        for cl in 1 0; do  # the wgmma kernels' cluster split-K where it applies, then stream-K on the same shapes
          step "sanitizer_${tool}_cluster$cl" 240 bash -c "QERL_WGMMA_CLUSTER=$cl '$SAN' --tool $tool \
            --error-exitcode 9 python3 benchmarks/kernel.py --sanitize --sanitize-modes wgmma_rs \
            --sanitize-max-nk 1500000 >> '$LOG' 2>&1" \
            || { tail -20 "$LOG"; exit 1; }
        done
      done
    fi
    step timing 240 python3 benchmarks/kernel.py --no-tune --no-marlin ${CAND_PDL:+--pdl} \
      --variants "${CAND_VARIANTS:-splitk,streamk,wgmma_rs}" --models "${CAND_MODELS:-qwen2.5-7b,qwen2.5-32b}" \
      --ms "${CAND_MS:-1,16,64,128,256,512,1024}" \
      --out "/tmp/qerl-cand-$name/kernel-$name.json" >> "$LOG" 2>&1 || exit 1
    cp "/tmp/qerl-cand-$name/kernel-$name.json" "$OUT/$name-kernel.json"  # its dispatch table is rebuilt from rows
    if [ -n "${CAND_LORA_MS:-}" ]; then  # the LoRA GEMM table (benchmarks/lora_gemm_bench.py) side by side too
      step lora_timing 200 python3 benchmarks/lora_gemm_bench.py --models "${CAND_MODELS:-qwen2.5-7b,qwen2.5-32b}" \
        --ms "$CAND_LORA_MS" --out "/tmp/qerl-cand-$name/lora" >> "$LOG" 2>&1 || exit 1
      cp /tmp/qerl-cand-$name/lora/lora-gemm-*.json "$OUT/$name-lora-gemm.json"
    fi
    exit $fail
  )
  rc=$?
  echo "[candidates_check] $name rc=$rc" | tee -a "$LOG"
  [ $rc -eq 0 ] || status=1
done
exit $status
