# Sourced by the GPU check scripts (kernel_check.sh, wgmma_check.sh, wgmma_ss_check.sh): one way to run a step.
#   STEP_TAG=kernel_check LOG=$OUT/x.log; fail=0; source benchmarks/gpu/steps.sh
#   step NAME TIMEOUT_S CMD...   run CMD under a time limit, log "[TAG] NAME rc=.. in .. s", set fail=1 on a
#                                non-zero exit, return CMD's status, and keep going (later steps still run)
step() {
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout "$limit" "$@"; local rc=$?
  echo "[${STEP_TAG:?set STEP_TAG}] $name rc=$rc in $(( $(date +%s) - t )) s" | tee -a "${LOG:?set LOG}"
  [ $rc -eq 0 ] || fail=1
  return $rc
}
#   build_step TIMEOUT_S        step "build": JIT-build the kernels extension (or say why it does not load)
QERL_BUILD_CHECK_PY="from verl_qerl.kernels import load_extension as l, cuda_unavailable_reason as r; \
import sys; ok = l(); print('kernels loaded' if ok else 'NOT loaded: ' + r()); sys.exit(0 if ok else 1)"
export QERL_BUILD_CHECK_PY
build_step() {
  step build "$1" python3 -c "$QERL_BUILD_CHECK_PY"
}

#   check_start TAG             in a check script (after cd-ing to the repository root, with OUT set): make OUT,
#                               put the repository on PYTHONPATH, start $OUT/TAG.log as LOG, fail=0, STEP_TAG=TAG
check_start() {
  mkdir -p "${OUT:?set OUT}"
  export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
  LOG="$OUT/$1.log"; : > "$LOG"
  fail=0
  STEP_TAG=$1
}
