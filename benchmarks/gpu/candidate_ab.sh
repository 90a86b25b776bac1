#!/usr/bin/env bash
# ON THE GPU MACHINE: one kernel candidate against HEAD in one call, A-B-A-B, with its checks first.
#   OUT=$OUT [AB_MS=64,128,256,512,1024] [AB_STAMPS_MS=256] bash benchmarks/gpu/candidate_ab.sh .xfer-cand/<head> .xfer-cand/<cand>
# Both folders come from benchmarks/gpu/stage_candidates.sh (HEAD and a patch). Steps: candidates_check.sh on both
# (HEAD: build + timing; the candidate: build, the wgmma GPU tests, tests/test_lora_fused_gpu.py, compute-sanitizer
# memcheck + racecheck with the cluster split on and off, timing), then the timing once more in the other order
# (candidate, HEAD), so each tree is timed twice in the order H, C, C, H (drift shows as a difference between a
# tree's two runs). AB_STAMPS_MS (optional): kernel_anatomy.py --stamps at those M from both trees (per-CTA timelines,
# where a change moved time). The timed variants are split-K and wgmma_rs (forced), 7B and 32B.
# Writes $OUT/ab.tgz (every log and JSON) and $OUT/ab-summary.txt (per-GEMM and per-layer means, candidate vs HEAD).
# ~4-5 min on an H200 (sanitizers ~100 s, four timings ~15 s each, two builds concurrently ~60 s).
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
[ "$#" -eq 2 ] || { echo "usage: OUT=... bash benchmarks/gpu/candidate_ab.sh HEAD_FOLDER CANDIDATE_FOLDER" >&2; exit 2; }
head_dir=$1; cand_dir=$2
head=$(basename "$head_dir"); cand=$(basename "$cand_dir")
MS=${AB_MS:-64,128,256,512,1024}
work=/tmp/candidate-ab; rm -rf "$work"; mkdir -p "$work"
OUT="$work" CAND_SKIP_TESTS="$head" CAND_SANITIZE="$cand" CAND_TESTS=tests/test_lora_fused_gpu.py \
  CAND_VARIANTS=splitk,wgmma_rs CAND_MS="$MS" bash benchmarks/gpu/candidates_check.sh "$head_dir" "$cand_dir"
rc=$?
if [ $rc -eq 0 ]; then
  for dir in "$cand_dir" "$head_dir"; do  # the second round, in the other order
    name=$(basename "$dir")
    ( cd "$dir" && PYTHONPATH="$PWD" TORCH_EXTENSIONS_DIR="/tmp/qerl-ext-$name" timeout 200 python3 benchmarks/kernel.py \
        --no-tune --no-marlin --variants splitk,wgmma_rs --models qwen2.5-7b,qwen2.5-32b --ms "$MS" \
        --out "$work/$name-r2.json" > "$work/$name-r2.log" 2>&1 ) || rc=1
  done
  if [ -n "${AB_STAMPS_MS:-}" ]; then
    for dir in "$head_dir" "$cand_dir"; do
      name=$(basename "$dir")
      ( cd "$dir" && PYTHONPATH="$PWD" TORCH_EXTENSIONS_DIR="/tmp/qerl-ext-stamps-$name" QERL_ANATOMY_STAMPS=1 \
          timeout 240 python3 benchmarks/kernel_anatomy.py --stamps --ms "$AB_STAMPS_MS" --out "$work/stamps-$name" \
          > "$work/stamps-$name.log" 2>&1 ) || echo "[candidate_ab] stamps of $name failed (see its log)"
    done
  fi
  python3 - "$work" "$head" "$cand" > "$OUT/ab-summary.txt" <<'EOF' || rc=1
import collections, json, sys
work, head, cand = sys.argv[1:]
def load(path):
    return {(r["model"], r["layer"], r["M"]): r for r in json.load(open(path))["rows"]}
h = [load(f"{work}/{head}-kernel.json"), load(f"{work}/{head}-r2.json")]
c = [load(f"{work}/{cand}-kernel.json"), load(f"{work}/{cand}-r2.json")]
print(f"forced wgmma_rs, us: {head} (two runs) -> {cand} (two runs), change of the means; bf16 = cuBLAS")
for key in sorted(h[0]):
    hv = [t[key]["kernel_wgmma_rs_graph_ms"] * 1e3 for t in h]
    cv = [t[key]["kernel_wgmma_rs_graph_ms"] * 1e3 for t in c]
    hm, cm = sum(hv) / 2, sum(cv) / 2
    bf = h[0][key]["bf16_graph_ms"] * 1e3
    print(f"{key[0]:12s} {key[1]:8s} M={key[2]:5d}  {hv[0]:8.1f} {hv[1]:8.1f} -> {cv[0]:8.1f} {cv[1]:8.1f}  "
          f"{100 * (cm / hm - 1):+5.1f} %  bf16 {bf:8.1f}  bf16/cand {bf / cm:.3f}")
EOF
fi
cat "$OUT/ab-summary.txt" 2>/dev/null
tail -3 "$work"/*.log
tar -czf "$OUT/ab.tgz" -C "$work" .
exit $rc
