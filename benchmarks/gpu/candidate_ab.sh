#!/usr/bin/env bash
# ON THE GPU MACHINE: one kernel candidate against HEAD in one call, A-B-A-B, with its checks first.
#   OUT=$OUT [AB_MS=64,128,256,512,1024] [AB_ROUNDS=2] [AB_STAMPS_MS=256] \
#     bash benchmarks/gpu/candidate_ab.sh .xfer-cand/<head> .xfer-cand/<cand>
# Both folders come from benchmarks/gpu/stage_candidates.sh (HEAD and a patch). Steps: candidates_check.sh on both
# (HEAD: build + timing; the candidate: build, the wgmma GPU tests, tests/test_lora_fused_gpu.py and
# tests/test_lora_expand_gpu.py (~10 s: a GPU test file no run exercised went stale once), compute-sanitizer
# memcheck + racecheck with the cluster split on and off, timing), then the timing once more in the other order
# (candidate, HEAD), so each tree is timed twice in the order H, C, C, H (drift shows as a difference between a
# tree's two runs); AB_ROUNDS=n (default 2) times each tree n times, the order alternating (H C, C H, H C, ...): at
# M = 64-128 two rounds each left a spread of ~+-2.5 % per layer (NOTES, `ordered-fixup`), ~12 s per tree and round.
# AB_STAMPS_MS (optional): kernel_anatomy.py --stamps at those M from both trees (per-CTA timelines, where a change
# moved time). The timed variants are split-K and wgmma_rs (forced), 7B and 32B.
# Writes $OUT/ab.tgz (every log and JSON) and $OUT/ab-summary.txt (benchmarks/kernel_ab.py: per GEMM and per layer,
# each tree's runs and the change of the means).
# ~4-5 min on an H200 (sanitizers ~100 s, four timings ~15 s each, two builds concurrently ~60 s).
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
[ "$#" -eq 2 ] || { echo "usage: OUT=... bash benchmarks/gpu/candidate_ab.sh HEAD_FOLDER CANDIDATE_FOLDER" >&2; exit 2; }
head_dir=$1; cand_dir=$2
head=$(basename "$head_dir"); cand=$(basename "$cand_dir")
[ "$head" != "$cand" ] || { echo "candidate_ab: both folders are named $head (each needs its own JIT cache)" >&2; exit 2; }
MS=${AB_MS:-64,128,256,512,1024}
ROUNDS=${AB_ROUNDS:-2}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "candidate_ab: AB_ROUNDS=$ROUNDS is not a positive integer" >&2; exit 2; }
work=${AB_WORK:-/tmp/candidate-ab}; rm -rf "$work"; mkdir -p "$work" "$OUT"
OUT="$work" CAND_SKIP_TESTS="$head" CAND_SANITIZE="$cand" CAND_TESTS="tests/test_lora_fused_gpu.py tests/test_lora_expand_gpu.py" \
  CAND_VARIANTS=splitk,wgmma_rs CAND_MS="$MS" bash benchmarks/gpu/candidates_check.sh "$head_dir" "$cand_dir"
rc=$?
if [ $rc -eq 0 ]; then
  for r in $(seq 2 "$ROUNDS"); do  # rounds 2.. alternate the order: C H, H C, C H, ...
    if [ $((r % 2)) -eq 0 ]; then order="$cand_dir $head_dir"; else order="$head_dir $cand_dir"; fi
    for dir in $order; do
      name=$(basename "$dir")
      ( cd "$dir" && PYTHONPATH="$PWD" TORCH_EXTENSIONS_DIR="/tmp/qerl-ext-$name" timeout 200 python3 \
          benchmarks/kernel.py --no-tune --no-marlin --variants splitk,wgmma_rs --models qwen2.5-7b,qwen2.5-32b \
          --ms "$MS" --out "$work/$name-r$r.json" > "$work/$name-r$r.log" 2>&1 ) || rc=1
    done
  done
  if [ -n "${AB_STAMPS_MS:-}" ]; then
    for dir in "$head_dir" "$cand_dir"; do
      name=$(basename "$dir")
      ( cd "$dir" && PYTHONPATH="$PWD" TORCH_EXTENSIONS_DIR="/tmp/qerl-ext-stamps-$name" QERL_ANATOMY_STAMPS=1 \
          timeout 240 python3 benchmarks/kernel_anatomy.py --stamps --ms "$AB_STAMPS_MS" --out "$work/stamps-$name" \
          > "$work/stamps-$name.log" 2>&1 ) || echo "[candidate_ab] stamps of $name failed (see its log)"
    done
  fi
  heads=("$work/$head-kernel.json"); cands=("$work/$cand-kernel.json")
  for r in $(seq 2 "$ROUNDS"); do heads+=("$work/$head-r$r.json"); cands+=("$work/$cand-r$r.json"); done
  python3 benchmarks/kernel_ab.py --head "${heads[@]}" --cand "${cands[@]}" > "$OUT/ab-summary.txt" || rc=1
fi
cat "$OUT/ab-summary.txt" 2>/dev/null
tail -n 3 "$work"/*.log
tar -czf "$OUT/ab.tgz" -C "$work" .
exit $rc
