#!/usr/bin/env bash
# lora_profile.py's `none` variant, then each LoRA variant named in VARIANTS (default: fast) merged into one JSON,
# with the same arguments; for a detached job on the staged machine (benchmarks/GPU.md):
#
#   bash benchmarks/gpu/detached.sh start lp bash benchmarks/gpu/lora_profile_pair.sh /tmp/detached/lp/out \
#       --prompt-tokens 256 --batches 1,8,64 --prefill-profile 1,8 --profile-batches 64
#
# Each variant's log goes to OUT_DIR/log-<variant>; the JSON (lora-profile-7b-<device>.json) to OUT_DIR.
set -u
out=${1:?usage: $0 OUT_DIR [lora_profile.py args...]}
shift
mkdir -p "$out"
rc=0
python3 benchmarks/lora_profile.py --variant none --out "$out" "$@" > "$out/log-none" 2>&1 || rc=$?
for v in ${VARIANTS:-fast}; do
  json=$(ls "$out"/lora-profile-*.json 2>/dev/null | head -1)
  python3 benchmarks/lora_profile.py --variant "$v" --out "$out" ${json:+--merge "$json"} "$@" \
    > "$out/log-$v" 2>&1 || rc=$?
done
exit $rc
