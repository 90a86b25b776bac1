#!/usr/bin/env bash
# ON THE GPU MACHINE (repository root): the copy-engine decode kernel (cuda/nvfp4_gemm_decode_tma.cu) as skeletons,
# its decode and MMAs switched off, each built from a copy of the tree beside main with its own JIT cache, timed at
# M = 1 next to split-K (benchmarks/NOTES.md, "Where the skeleton's time goes"). Variants: sk (every copy), wonly
# (weights only: no scales, no activation boxes), w4k (the weights as two 4 KB bulk copies). ~110 s on one H200.
#   OUT=$OUT bash benchmarks/gpu/decode_skeleton.sh
# The skeletons compute nothing: their outputs are garbage, only their times mean something.
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
R=$PWD
F=cuda/nvfp4_gemm_decode_tma.cu
for v in sk wonly w4k; do
  rm -rf "/tmp/$v"; cp -r "$R" "/tmp/$v"; cd "/tmp/$v" || exit 2
  sed -i 's/^        mma_k16_step(wv, sv, j, b, acc);/        if (M < 0) mma_k16_step(wv, sv, j, b, acc);/' $F
  if [ $v = wonly ]; then
    sed -i 's/, 2 \* C::X_HALF_BYTES + DT_W_BYTES + DT_S_BYTES);/, DT_W_BYTES);/; /tma::load_2d(base/d; /tma::bulk_copy(base + C::S_OFF/d' $F
  fi
  if [ $v = w4k ]; then
    sed -i 's|tma::bulk_copy(base + C::W_OFF, qw + blk \* W_VEC, DT_W_BYTES, bar);|tma::bulk_copy(base + C::W_OFF, qw + blk * W_VEC, DT_W_BYTES / 2, bar); tma::bulk_copy(base + C::W_OFF + DT_W_BYTES / 2, qw + blk * W_VEC + W_VEC / 2, DT_W_BYTES / 2, bar);|' $F
  fi
  # the edits took: one skipped MMA step; no activation boxes left in wonly; two half copies in w4k
  echo "== $v: skipped $(grep -c 'if (M < 0)' $F), boxes $(grep -c 'load_2d(base' $F), half copies $(grep -c 'DT_W_BYTES / 2' $F)"
  TORCH_EXTENSIONS_DIR=/tmp/ext-$v PYTHONPATH=/tmp/$v timeout 150 python3 benchmarks/kernel.py --no-tune --no-marlin \
    --variants splitk,decode_tma --models qwen2.5-7b,qwen2.5-32b --ms 1 --out "$OUT/$v" > "$OUT/$v.log" 2>&1
  echo "rc=$?"; grep -A12 "fused-kernel variants" "$OUT/$v.log" | grep -E "qkv|  o |gate_up|down"
  cd "$R" || exit 2
done
