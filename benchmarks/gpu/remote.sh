#!/usr/bin/env bash
# Runs ON the GPU machine (see stage.py).  usage:
#   bash benchmarks/gpu/remote.sh receive .stage/pK   # keep one carried part in /tmp/stage (survives until reclaim)
#   bash benchmarks/gpu/remote.sh install             # join + verify + install into /tmp/site, write /tmp/site/qerl_env.sh
# Exit 3 = "COLD START": the machine was reclaimed between calls and parts are missing; send them again.
set -uo pipefail
cmd=${1:?receive|install}
STAGE=/tmp/stage
mkdir -p "$STAGE"
case "$cmd" in
  receive)
    part=${2:?part folder}
    cp "$part"/payload.tar.xz.part-* "$part"/manifest.json "$STAGE"/ || exit 2
    echo "[remote] have $(ls "$STAGE"/payload.tar.xz.part-* | wc -l) part(s) in $STAGE (uptime $(cut -d' ' -f1 /proc/uptime) s)"
    ;;
  install)
    t0=$(date +%s)
    want=$(python3 -c "import json;print(json.load(open('$STAGE/manifest.json'))['parts'])" 2>/dev/null || echo 999)
    have=$(ls "$STAGE"/payload.tar.xz.part-* 2>/dev/null | wc -l)
    if [ "$have" -lt "$want" ]; then echo "[remote] COLD START: $have of $want parts present"; exit 3; fi
    cat "$STAGE"/payload.tar.xz.part-* > /tmp/payload.tar.xz
    sha=$(python3 -c "import json;print(json.load(open('$STAGE/manifest.json'))['sha256'])")
    echo "$sha  /tmp/payload.tar.xz" | sha256sum -c --quiet || { echo "[remote] checksum mismatch"; exit 4; }
    rm -rf /tmp/payload /tmp/site && mkdir -p /tmp/site
    tar -xJf /tmp/payload.tar.xz -C /tmp || exit 5
    if ls /tmp/payload/whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/payload/whl/*.whl || exit 6
    fi
    cp -a /tmp/payload/site/. /tmp/site/
    cat > /tmp/site/qerl_env.sh <<ENV
export PYTHONPATH=/tmp/site:$(pwd)\${PYTHONPATH:+:\$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
ENV
    source /tmp/site/qerl_env.sh
    python3 - <<'PY'
import importlib, importlib.metadata as md
for mod in ("torch", "vllm", "compressed_tensors", "bitsandbytes", "verl", "ray", "verl_qerl"):
    try:
        m = importlib.import_module(mod)
        print(f"[remote] import {mod}: ok {getattr(m, '__version__', '')}")
    except Exception as err:  # noqa: BLE001
        print(f"[remote] import {mod}: FAILED {type(err).__name__}: {str(err)[:200]}")
print("[remote] vllm.general_plugins:", [e.name for e in md.entry_points(group="vllm.general_plugins")])
PY
    echo "[remote] installed in $(( $(date +%s) - t0 )) s; /tmp/site $(du -sh /tmp/site | cut -f1)"
    ;;
  *) echo "unknown command $cmd"; exit 2 ;;
esac
