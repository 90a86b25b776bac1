#!/usr/bin/env bash
# Compile-only check of the CUDA kernels (no GPU, no torch): catches a build break before it
# reaches the GPU machine. Compiles every cuda/*.cu alone for sm_90a (Hopper, the target) and for
# sm_80 / sm_89 (the code uses only mma.sync / ldmatrix / cp.async, so it must build there too).
# Fails loudly: any nvcc error, any ptxas spill or stack frame in a kernel, or a missing nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "compile_cuda.sh: FAIL: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 2
fi
"$NVCC" --version | tail -n 2
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
status=0
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
    if ! "$NVCC" -c -O3 -std=c++17 --expt-relaxed-constexpr -Werror all-warnings \
        -gencode="arch=$arch" -Xptxas -v -o "$obj" "$src" >"$log" 2>&1; then
      echo "compile_cuda.sh: FAIL: $src for ${arch##*=}" >&2
      cat "$log" >&2
      status=1
      continue
    fi
    if grep -E "[1-9][0-9]* bytes (spill stores|spill loads|stack frame)" "$log" >/dev/null; then
      echo "compile_cuda.sh: FAIL: $src for ${arch##*=}: register spills / stack frame" >&2
      grep -E "Compiling entry|bytes (spill|stack)" "$log" >&2
      status=1
      continue
    fi
    regs="$(grep -oE "Used [0-9]+ registers" "$log" | awk '{print $2}' | sort -n | tail -1)"
    echo "ok   $src ${arch##*=} (max ${regs:-?} registers/thread, no spills)"
  done
done
if [ "$status" -ne 0 ]; then
  echo "compile_cuda.sh: FAILED" >&2
else
  echo "compile_cuda.sh: all CUDA sources compile"
fi
exit "$status"
