#!/usr/bin/env bash
# The exploration study in one call: generate problems -> SFT warm start (bounded) -> GRPO arms x seeds, all
# concurrently over the visible GPUs -> summary (table, PNG, results JSON) -> one tarball with what matters.
# Built for one ~9-minute call on a 2-GPU machine whose outputs come back as at most 8 files from $OUT.
#
# usage (repo root):  OUT=/path/out bash examples/exploration/campaign.sh
#   OUT        output folder (required): exploration.tar.gz, exploration-<device>.{json,md,png}, campaign.log
#   PYTHON     interpreter (default python3)       SEEDS  seeds per arm (default 3)
#   STEPS      GRPO steps per run (default 30)      ARMS   default bf16,nvfp4_noaqn,nvfp4
#   BUDGET_S   total wall seconds (default 540)     SFT_S  SFT training seconds (default 120)
#   RESERVE_S  seconds kept for summary + packing (default 30)
#   WORKDIR    scratch (default /tmp/qx; keep it short)   QERL_DEVICE gpu (default) | cpu
#              Only the script's own entries in it (data model runs logs probe.json exploration-*, marked by
#              .qerl-campaign) are ever removed; OUT may not lie inside WORKDIR when `problems` starts it afresh.
#   PROBLEM_ARGS / SFT_ARGS / ARM_ARGS   extra flags for problems.py / sft.py / run_arms.py
#   PHASES     comma list of problems,sft,probe,arms,summary (default all; probe = entropy_probe.py, the
#              step-0 paired entropy of bf16 / nvfp4 / nvfp4+AQN on the SFT policy, seconds on a GPU). Without `problems` the data and SFT
#              checkpoint already in WORKDIR are kept and reused: e.g. PHASES=problems,sft in one call (check
#              the SFT accuracy in $OUT/sft_log.json), then PHASES=arms,summary in the next.
#   KEEP_RUNS  1: keep the runs of earlier calls in WORKDIR (seeds spread over calls on one warm machine:
#              SEEDS=1 ARM_ARGS="--seed0 1" KEEP_RUNS=1 PHASES=arms,summary; the summary covers all of them)
# Degrades gracefully: runs still going at the deadline are killed (whole process trees) and whatever they
# logged is summarized; a failed step is reported and the rest still packs.
set -uo pipefail
die() { echo "campaign.sh: $*" >&2; exit 2; }
OUT=${OUT:?set OUT to an output folder}
W=${WORKDIR:-/tmp/qx}
# absolute (symlinks resolved) before the cd to the repository: relative paths are the caller's
OUT=$(realpath -m -- "$OUT") && W=$(realpath -m -- "$W") || die "cannot resolve OUT / WORKDIR"
if [[ ${PYTHON:-} == */* ]]; then PYTHON=$(realpath -m -- "$PYTHON"); fi  # a bare name is looked up on PATH
cd "$(dirname "$0")/../.." || die "cannot cd to the repository"
PY=${PYTHON:-python3}
SEEDS=${SEEDS:-3}; STEPS=${STEPS:-30}; BUDGET_S=${BUDGET_S:-540}; SFT_S=${SFT_S:-120}; RESERVE_S=${RESERVE_S:-30}
ARMS=${ARMS:-bf16,nvfp4_noaqn,nvfp4}
DEVICE=${QERL_DEVICE:-gpu}
T0=$(date +%s); DEADLINE=$((T0 + BUDGET_S))
PHASES=${PHASES:-problems,sft,probe,arms,summary}
has() { [[ ",$PHASES," == *",$1,"* ]]; }
# What this script creates in WORKDIR, and so may remove there; never WORKDIR itself nor anything else in it (a
# WORKDIR of `.` or $HOME keeps its other files). The marker says that these entries were made by this script.
MARK="$W/.qerl-campaign"
if has problems; then
  CLEAN=(data model runs logs probe.json exploration-*.json exploration-*.md exploration-*.png)
  case "$OUT/" in "${W%/}"/*) die "OUT=$OUT lies inside WORKDIR=$W, which PHASES=$PHASES starts afresh: use an OUT outside it";; esac
elif [ "${KEEP_RUNS:-0}" = 1 ]; then CLEAN=(logs)
else CLEAN=(runs logs); fi
EXISTING=()
for e in "${CLEAN[@]}"; do
  for p in "$W"/$e; do [ -e "$p" ] || [ -L "$p" ] && EXISTING+=("$p"); done
  case "$OUT/" in "${W%/}/$e"/*) die "OUT=$OUT lies inside $W/$e, which this call removes: use an OUT outside it";; esac
done
if [ ${#EXISTING[@]} -gt 0 ] && [ ! -f "$MARK" ]; then
  die "WORKDIR=$W holds ${EXISTING[*]} but no $MARK: not made by this script, so not removed. Use a new or empty WORKDIR (or remove them yourself)"
fi
if [ ${#EXISTING[@]} -gt 0 ]; then rm -rf -- "${EXISTING[@]}" || die "cannot clean ${EXISTING[*]}"; fi
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
mkdir -p "$W/logs" "$W/runs" && : > "$MARK" || die "cannot create WORKDIR=$W/{logs,runs}"
CLOG="$OUT/campaign.log"; : > "$CLOG" || die "cannot write $CLOG"
log() { echo "[campaign +$(( $(date +%s) - T0 ))s] $*" | tee -a "$CLOG"; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck disable=SC2206
PROBLEM_EXTRA=(${PROBLEM_ARGS:-}); SFT_EXTRA=(${SFT_ARGS:-}); ARM_EXTRA=(${ARM_ARGS:-})

log "OUT=$OUT PY=$PY SEEDS=$SEEDS STEPS=$STEPS ARMS=$ARMS BUDGET_S=$BUDGET_S SFT_S=$SFT_S device=$DEVICE"
"$PY" - "$W/runs/meta.json" "$BUDGET_S" "$STEPS" "$SEEDS" "$W/model/sft_log.json" <<'PYMETA' >>"$CLOG" 2>&1
import datetime, json, sys
sys.path.insert(0, "examples/exploration")
from summarize import device_slug, versions
path, budget, steps, seeds, sft_log = sys.argv[1:6]
meta = {"device": device_slug(), "versions": versions(), "budget_s": int(budget), "steps": int(steps),
        "seeds": int(seeds), "sft_log": sft_log, "launcher": "examples/exploration/campaign.sh",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
try:
    import torch
    meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as err:  # noqa: BLE001
    meta["gpus"] = repr(err)
json.dump(meta, open(path, "w"), indent=1)
print("meta", meta)
PYMETA

# 1. problems
if ! has problems; then
  log "problems: reusing $W/data"
elif "$PY" examples/exploration/problems.py --out "$W/data" "${PROBLEM_EXTRA[@]}" >"$W/logs/problems.log" 2>&1; then
  log "problems: $(tail -1 "$W/logs/problems.log")"
else
  log "problems FAILED:"; tail -20 "$W/logs/problems.log" | tee -a "$CLOG"
fi

# 1b. beside SFT: byte-compile the staged packages (installed --no-compile, so every process of every run would
# compile them at import) and build the FP4 CUDA kernels once (else each NVFP4 run JIT-builds them at its start)
KPID=
if [ "$DEVICE" = gpu ]; then
  (
    SITE=$("$PY" -c "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))" 2>/dev/null)
    t=$(date +%s)
    if [ -n "$SITE" ] && [ -w "$SITE" ]; then
      (timeout 120 "$PY" -m compileall -q -j 12 "$SITE" >/dev/null 2>&1; echo "compiled $SITE in $(( $(date +%s) - t )) s") &
    fi
    timeout 150 "$PY" -c "from verl_qerl.kernels import load_extension, cuda_unavailable_reason as r; ok = load_extension(); \
print('qerl kernels loaded' if ok else 'qerl kernels NOT loaded: ' + r())"
    echo "kernels after $(( $(date +%s) - t )) s"
    wait
  ) >"$W/logs/warmup.log" 2>&1 &
  KPID=$!
fi

# 2. SFT warm start (training stops at SFT_S seconds; the hard limit leaves room for its last eval and save)
if ! has sft; then
  log "sft: reusing $W/model"
elif [ -f "$W/data/sft.jsonl" ]; then
  timeout $((SFT_S + 120)) "$PY" examples/exploration/sft.py --data "$W/data" --out "$W/model" --force \
    --time-limit "$SFT_S" "${SFT_EXTRA[@]}" >"$W/logs/sft.log" 2>&1
  rc=$?
  log "sft rc=$rc: $(grep '^\[sft\] stopped' "$W/logs/sft.log" | tail -1)"
  [ $rc -eq 0 ] || tail -30 "$W/logs/sft.log" | tee -a "$CLOG"
fi

if [ -n "$KPID" ]; then wait "$KPID"; log "warm-up: $(tr '\n' ';' < "$W/logs/warmup.log" | tail -c 300)"; fi

if has sft; then
  cp "$W/model/sft_log.json" "$OUT/" 2>/dev/null; tail -c 20000 "$W/logs/sft.log" > "$OUT/sft.log.tail" 2>/dev/null
fi

# 2b. step-0 entropy probe on the SFT policy (same weights scored by each variant; embedded by the summary)
if has probe && [ -f "$W/model/config.json" ]; then
  timeout 180 "$PY" examples/exploration/entropy_probe.py --model "$W/model" --data "$W/data" \
    --out "$W/probe.json" >"$W/logs/probe.log" 2>&1
  rc=$?; log "probe rc=$rc: $(grep '^\[probe\]' "$W/logs/probe.log" | tr '\n' ';' | tail -c 600)"
fi

# 3. GRPO arms x seeds, concurrent, killed at the deadline minus the reserve
if ! has arms; then
  log "arms: not in PHASES=$PHASES"
elif [ -f "$W/model/config.json" ]; then
  DEV_FLAG=(--device "$DEVICE")
  "$PY" examples/exploration/run_arms.py --model "$W/model" --data "$W/data" --out "$W/runs" --arms "$ARMS" \
    --seeds "$SEEDS" --steps "$STEPS" --python "$PY" --deadline $((DEADLINE - RESERVE_S)) "${DEV_FLAG[@]}" \
    "${ARM_EXTRA[@]}" >"$W/logs/arms.log" 2>&1
  rc=$?; log "arms rc=$rc: $(tail -1 "$W/logs/arms.log")"
  grep -h "rc=\|killing" "$W/logs/arms.log" | tee -a "$CLOG" >/dev/null
  for d in "$W"/runs/*/; do  # the last lines of each run's log, for diagnosis
    [ -f "$d/log.txt" ] && tail -c 200000 "$d/log.txt" > "$d/log.tail"
  done
else
  log "no SFT checkpoint: skipping the arms"
fi

# 4. summary (works on partial logs) and packing
if ! has summary; then
  log "summary: not in PHASES=$PHASES"; exit 0
elif ls "$W"/runs/*/metrics.jsonl >/dev/null 2>&1; then
  "$PY" examples/exploration/summarize.py "$W/runs" --out "$OUT" --sft-log "$W/model/sft_log.json" --probe "$W/probe.json" \
    --command "OUT=... SEEDS=$SEEDS STEPS=$STEPS BUDGET_S=$BUDGET_S SFT_S=$SFT_S ARMS=$ARMS bash examples/exploration/campaign.sh" \
    >"$W/logs/summarize.log" 2>&1
  rc=$?; log "summarize rc=$rc"
  cat "$W/logs/summarize.log" >>"$CLOG"
else
  log "no metrics were logged"
fi
cp "$OUT"/exploration-*.{json,md,png} "$W/" 2>/dev/null
(cd "$W" && tar czf "$OUT/exploration.tar.gz" --ignore-failed-read \
  logs data/problems.json model/sft_log.json model/config.json probe.json runs/meta.json runs/runs.json \
  runs/*/metrics.jsonl runs/*/log.tail runs/*/command.sh exploration-* 2>/dev/null)
log "packed $(du -h "$OUT/exploration.tar.gz" | cut -f1) -> $OUT/exploration.tar.gz; total $(( $(date +%s) - T0 )) s"
cat "$OUT"/exploration-*.md 2>/dev/null
ls "$OUT"/exploration-*.json >/dev/null 2>&1
