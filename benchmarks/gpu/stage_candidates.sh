#!/usr/bin/env bash
# ON THE DEV MACHINE: copies of the repository at several commits, each as a folder the device tool can carry, so
# one GPU call checks and times kernel candidates side by side (benchmarks/gpu/candidates_check.sh).
#   bash benchmarks/gpu/stage_candidates.sh 44fb047 51ade69 main      # -> .xfer-cand/<commit>/ (~1 MB each)
#   bash benchmarks/gpu/stage_candidates.sh HEAD benchmarks/candidates/wide-k16-pipeline.patch   # -> .xfer-cand/<name>/
# A FILE.patch argument stages HEAD with that patch applied (as a commit object made without touching the working
# tree or the index; the folder is named after the patch): candidates kept on main as patches, because branches do
# not outlive a session here. A patched copy is compiled first (.ci/compile_cuda.sh on the copy: every .cu for sm_90a /
# sm_80 / sm_89 and the binding's C++, ~2 min) and refused if it does not build, so a broken candidate does not cost a
# GPU call; STAGE_COMPILE=0 skips that.
# Each folder holds what the kernel tests and benchmarks need at that commit: cuda/, verl_qerl/, benchmarks/kernel*.py,
# benchmarks/lora_*bench.py, benchmarks/results_format.py, benchmarks/gpu/, tests/test_*gpu.py, tests/conftest.py,
# pytest.ini. It prints the run call to make: carry=['.xfer-cand'] (one path, under the 64 MiB a call sends), then
# candidates_check.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$#" -ge 1 ] || { echo "usage: bash benchmarks/gpu/stage_candidates.sh COMMIT [COMMIT ...]" >&2; exit 2; }
DEST=${DEST:-.xfer-cand}
names=()
for rev in "$@"; do
  if [[ "$rev" == *.patch ]]; then
    [ -f "$rev" ] || { echo "stage_candidates: $rev: no such patch file" >&2; exit 2; }
    index=$(mktemp)
    GIT_INDEX_FILE=$index git read-tree HEAD
    if ! GIT_INDEX_FILE=$index git apply --cached "$rev"; then
      rm -f "$index"; echo "stage_candidates: $rev does not apply to HEAD" >&2; exit 2
    fi
    tree=$(GIT_INDEX_FILE=$index git write-tree); rm -f "$index"
    sha=$(GIT_AUTHOR_NAME=stage_candidates GIT_AUTHOR_EMAIL=stage_candidates@localhost \
          GIT_COMMITTER_NAME=stage_candidates GIT_COMMITTER_EMAIL=stage_candidates@localhost \
          git commit-tree "$tree" -p HEAD -m "candidate $(basename "$rev" .patch) on HEAD")  # (works without a git identity)
    name=$(basename "$rev" .patch)
  else
    sha=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "stage_candidates: $rev is not a commit here" >&2; exit 2; }
    name=${sha:0:7}
  fi
  rm -rf "${DEST:?}/$name.tmp" && mkdir -p "$DEST/$name.tmp"
  git archive "$sha" cuda verl_qerl pytest.ini tests/conftest.py benchmarks/gpu \
    $(git ls-tree --name-only "$sha" tests/ | grep -E '^tests/test_[a-z_]*gpu\.py$') \
    $(git ls-tree --name-only "$sha" benchmarks/ \
      | grep -E '^benchmarks/(kernel[a-z_]*|lora_[a-z_]*bench|results_format)\.py$') \
    | tar -x -C "$DEST/$name.tmp"
  if [[ "$rev" == *.patch ]] && [ "${STAGE_COMPILE:-1}" != 0 ]; then
    if ! QERL_SOURCE_ROOT="$DEST/$name.tmp" QERL_COMPILE_FAIL_FAST=1 bash .ci/compile_cuda.sh > "$DEST/$name.compile.log" 2>&1; then
      rm -rf "${DEST:?}/$name.tmp"
      echo "stage_candidates: $rev does not compile (log: $DEST/$name.compile.log); nothing staged for it" >&2
      grep -E "FAIL|error" "$DEST/$name.compile.log" | head -20 >&2
      exit 2
    fi
    rm -f "$DEST/$name.compile.log"
  fi
  rm -rf "${DEST:?}/$name" && mv "$DEST/$name.tmp" "$DEST/$name"  # no half-written folder under the final name
  names+=("$DEST/$name")
  echo "staged $rev -> $DEST/$name ($(du -sh "$DEST/$name" | cut -f1))"
done
echo "run: carry=['$DEST'], command: OUT=\$OUT bash benchmarks/gpu/candidates_check.sh ${names[*]}"
