#!/usr/bin/env bash
# Compile-only check of the CUDA kernels (no GPU, no torch): catches a build break before it
# reaches the GPU machine. Compiles every cuda/*.cu alone for sm_90a (Hopper, the target) and for
# sm_80 / sm_89 (the mma.sync kernels must build there too; the wgmma kernel builds to a stub there).
# Fails loudly: any nvcc error, any ptxas spill or stack frame in a kernel, wgmma instructions ptxas serialized,
# or a missing nvcc.
# QERL_SOURCE_ROOT=DIR compiles DIR/cuda instead of this checkout's (benchmarks/gpu/stage_candidates.sh checks a staged
# candidate with it before the candidate costs a GPU call).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO_ROOT=$(pwd)
if [ -n "${QERL_SOURCE_ROOT:-}" ]; then
  [ -d "$QERL_SOURCE_ROOT/cuda" ] || { echo "compile_cuda.sh: FAIL: QERL_SOURCE_ROOT=$QERL_SOURCE_ROOT has no cuda/" >&2; exit 2; }
  cd "$QERL_SOURCE_ROOT"
fi
NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "compile_cuda.sh: FAIL: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 2
fi
"$NVCC" --version | tail -n 2
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
status=0
fail_fast() {  # QERL_COMPILE_FAIL_FAST=1: stop at the first failure (stage_candidates.sh: one error is enough to refuse)
  if [ "${QERL_COMPILE_FAIL_FAST:-0}" = 1 ]; then echo "compile_cuda.sh: FAILED" >&2; exit 1; fi
}
shopt -s nullglob
sources=(cuda/*.cu)
if [ "${#sources[@]}" -eq 0 ]; then
  echo "compile_cuda.sh: FAIL: no cuda/*.cu sources" >&2
  exit 2
fi
for arch in "compute_90a,code=sm_90a" "compute_80,code=sm_80" "compute_89,code=sm_89"; do
  for src in "${sources[@]}"; do
    obj="$tmp/$(basename "$src" .cu).${arch##*=}.o"
    log="$tmp/log"
    defs=()
    [ "${arch##*=}" = "sm_90a" ] && defs=(-DQERL_HAVE_SM90A=1)  # the wgmma kernel's host side (build.py sets it too)
    if ! "$NVCC" -c -O3 -std=c++17 --expt-relaxed-constexpr -Werror all-warnings "${defs[@]}" \
        -gencode="arch=$arch" -Xptxas -v -o "$obj" "$src" >"$log" 2>&1; then
      echo "compile_cuda.sh: FAIL: $src for ${arch##*=}" >&2
      cat "$log" >&2
      status=1
      fail_fast
      continue
    fi
    if grep -E "[1-9][0-9]* bytes (spill stores|spill loads|stack frame)" "$log" >/dev/null; then
      echo "compile_cuda.sh: FAIL: $src for ${arch##*=}: register spills / stack frame" >&2
      grep -E "Compiling entry|bytes (spill|stack)" "$log" >&2
      status=1
      fail_fast
      continue
    fi
    # ptxas serializes a kernel's wgmmas (an info line, C7510-C7515, not a warning) when registers run short or
    # accumulators are defined on two paths: the kernel stays correct but loses the asynchronous tensor pipe
    if grep "wgmma.mma_async instructions are serialized" "$log" >"$tmp/serialized"; then
      echo "compile_cuda.sh: FAIL: $src for ${arch##*=}: ptxas serialized wgmma instructions" >&2
      cat "$tmp/serialized" >&2
      status=1
      fail_fast
      continue
    fi
    regs="$(grep -oE "Used [0-9]+ registers" "$log" | awk '{print $2}' | sort -n | tail -1)"
    echo "ok   $src ${arch##*=} (max ${regs:-?} registers/thread, no spills)"
  done
done
# The torch binding (cuda/qerl_torch.cpp: the ops; cuda/gemm_route.cpp: the dispatch they run) is JIT-built only on
# the GPU machine; compile both here against the installed torch's headers, with stubs (.ci/stubs) for the CUDA
# math-library headers that torch's CUDA headers include (the CI machine has nvcc but not cuBLAS / cuSPARSE /
# cuSOLVER), to objects that are not linked; then check that every qerl_binding symbol one of them uses is defined
# in the other (a declaration in cuda/gemm_route.h without its definition would otherwise fail only at the GPU
# machine's link / import).
PY="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
BINDING_SOURCES=(cuda/qerl_torch.cpp cuda/gemm_route.cpp)
if [ -x "$PY" ] && ti="$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)"; then
  pyi="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  # nvcc's own include flags (it may be a wrapper script outside the toolkit: ask it rather than guess)
  cuda_inc="$("$NVCC" -dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ INCLUDES="\([^"]*\)".*/\1/p')"
  tv="$("$PY" -c 'import torch; print(torch.__version__)')"
  objs_ok=1
  for src in "${BINDING_SOURCES[@]}"; do
    # shellcheck disable=SC2086  # cuda_inc is a list of -I flags
    if g++ -std=c++17 -c -O0 -I"$REPO_ROOT/.ci/stubs" -I"$ti" -I"$ti/torch/csrc/api/include" $cuda_inc -I"$pyi" -Icuda \
        -DTORCH_EXTENSION_NAME=qerl_binding_check -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE "$src" \
        -o "$tmp/$(basename "$src" .cpp).o" >"$tmp/binding.log" 2>&1; then
      echo "ok   $src (g++ -c against torch $tv)"
    else
      echo "compile_cuda.sh: FAIL: $src" >&2
      grep -E "error" "$tmp/binding.log" | head -20 >&2
      status=1; objs_ok=0
      fail_fast
    fi
  done
  if [ "$objs_ok" = 1 ]; then
    # (C++-demangled names; `U`: used here, defined elsewhere; `T`: defined here)
    nm -C --undefined-only "$tmp/qerl_torch.o" | sed -n 's/^ *U \(qerl_binding::.*\)$/\1/p' | sort -u > "$tmp/used"
    nm -C --defined-only "$tmp/gemm_route.o" | sed -n 's/^[0-9a-f]* [TW] \(qerl_binding::.*\)$/\1/p' | sort -u \
      > "$tmp/defined"
    missing="$(comm -23 "$tmp/used" "$tmp/defined")"
    if [ -n "$missing" ]; then
      echo "compile_cuda.sh: FAIL: cuda/qerl_torch.cpp uses qerl_binding symbols cuda/gemm_route.cpp does not define:" >&2
      echo "$missing" >&2
      status=1
    else
      echo "ok   the binding's two translation units: $(wc -l < "$tmp/used") shared symbols, all defined"
    fi
  fi
else
  echo "skip the torch binding (cuda/*.cpp): no torch at $PY (set PYTHON=...)"
fi
if [ "$status" -ne 0 ]; then
  echo "compile_cuda.sh: FAILED" >&2
else
  echo "compile_cuda.sh: all CUDA sources compile"
fi
exit "$status"
