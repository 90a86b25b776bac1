#!/usr/bin/env bash
# ON A MULTI-GPU MACHINE: several candidates_check.sh sequences at once, one per GPU ("lane"). A multi-GPU kind costs
# the same device-seconds as one GPU (benchmarks/GPU.md), so four lanes do in one call what one GPU does in four.
#   OUT=$OUT bash benchmarks/gpu/candidates_per_gpu.sh \
#     'CAND_MS=256 CAND_LORA_MS=129,256 :: .xfer-cand/wide-x .xfer-cand/head-a' \
#     'CAND_PDL=1 CAND_MS=64 :: .xfer-cand/pdl-x .xfer-cand/head-b'
# Each argument is one lane: CAND_* settings (candidates_check.sh's, may be none), `::`, then its staged folders (in order: put a
# copy of HEAD in every lane that times against it, so each comparison runs on one GPU). Lane i runs on GPU i. A folder
# name may appear in one lane only (each folder has its own JIT cache, /tmp/qerl-ext-<name>): copy HEAD's folder under
# other names (cp -r .xfer-cand/<sha> .xfer-cand/head-b). The lanes start together and each candidates_check.sh builds
# its folders at once, so every folder's JIT build runs concurrently.
# Writes $OUT/lanes.tgz (lane i's files under g<i>/: candidates_check.sh's logs and JSONs) and $OUT/lanes.txt (each
# lane's exit status and seconds): two files, however many lanes (a call returns 8). LANE_TIMEOUT (default 540 s)
# bounds each lane, so the archive is written inside a 10-minute call.
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
RESULTS=$OUT  # the lanes re-point OUT at their own folders
[ "$#" -ge 1 ] || { echo "usage: OUT=... bash benchmarks/gpu/candidates_per_gpu.sh 'CAND_...=... :: FOLDER ...' ..." >&2
                    exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
lanes=("$@")
mkdir -p "$OUT"
WORK=$(mktemp -d)
declare -A lane_of
folders=()
for i in "${!lanes[@]}"; do
  spec=${lanes[$i]}
  [[ "$spec" == *"::"* ]] || { echo "candidates_per_gpu: lane $i: no '::' between settings and folders: $spec" >&2; exit 2; }
  for dir in ${spec#*::}; do
    name=$(basename "$dir")
    [ -f "$dir/cuda/qerl_nvfp4.h" ] || { echo "candidates_per_gpu: lane $i: $dir is not a staged repository copy" >&2; exit 2; }
    if [ -n "${lane_of[$name]:-}" ]; then
      echo "candidates_per_gpu: folder name $name is in lanes ${lane_of[$name]} and $i (one JIT cache per name: copy it under another name)" >&2
      exit 2
    fi
    lane_of[$name]=$i
    folders+=("$dir")  # (counted for lanes.txt)
  done
done
t0=$(date +%s)
echo "${#lanes[@]} lanes, ${#folders[@]} folders" > "$OUT/lanes.txt"
for i in "${!lanes[@]}"; do
  spec=${lanes[$i]}
  (
    mkdir -p "$WORK/g$i"
    settings=${spec%%::*}
    [ -z "${settings// /}" ] || eval "export $settings"  # the lane's CAND_* settings, quotes kept (CAND_TESTS="a b")
    export CUDA_VISIBLE_DEVICES="$i" OUT="$WORK/g$i"
    # shellcheck disable=SC2086  # the lane's folders are a word list
    timeout "${LANE_TIMEOUT:-540}" bash "$HERE/candidates_check.sh" ${spec#*::} > "$WORK/g$i/lane.log" 2>&1
    echo "lane $i rc=$? after $(( $(date +%s) - t0 )) s: $spec" >> "$RESULTS/lanes.txt"
  ) &
done
wait
tar czf "$OUT/lanes.tgz" -C "$WORK" $(cd "$WORK" && ls -d g*)
rm -rf "$WORK"
cat "$OUT/lanes.txt"
! grep -q " rc=[1-9]" "$OUT/lanes.txt"
