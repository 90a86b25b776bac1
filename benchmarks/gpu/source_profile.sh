#!/usr/bin/env bash
# Instruction-level profile of one fused-GEMM launch (ON the GPU machine, repository root):
#   OUT=$OUT [VARIANT=streamk|splitk|wgmma_rs|wgmma_ss] [M=64] [NK=3584x3584] bash benchmarks/gpu/source_profile.sh
#   (~1 min; NK picks the weight shape among kernel_diagnostics.PROFILE_SHAPES, default the 7B gate_up 37888x3584)
# Why: the section-level stall counters (kernel_check.sh) say *which* stall grows, not *where*. This keeps
# ncu's warp-state samples per SASS instruction (SourceCounters) for the 7B gate_up GEMM at M, prints them
# with the SASS (--page source), and dumps the kernels' SASS with cuobjdump, so the hot instructions can be
# read on the dev machine (which has no ncu / cuobjdump).
# Writes to $OUT: src-<variant>-m<M>.ncu-rep, src-<variant>-m<M>-sass.csv.gz, src-<variant>-m<M>-details.txt,
# sass-ext.txt.gz (every kernel of the built extension).
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
VARIANT=${VARIANT:-streamk}
M=${M:-64}
NK=${NK:-37888x3584}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
case "$VARIANT" in streamk) KREGEX='regex:nvfp4_gemm_streamk';; splitk) KREGEX='regex:nvfp4_gemm_splitk';;
  wgmma_rs) KREGEX='regex:nvfp4_gemm_wgmma_(kernel|wide)';; wgmma_ss) KREGEX='regex:nvfp4_gemm_wgmma_ss';;
  *) echo "VARIANT must be splitk, streamk, wgmma_rs or wgmma_ss, got $VARIANT" >&2; exit 2;; esac
tag="src-$VARIANT-m$M"
[ "$NK" = 37888x3584 ] || tag="$tag-$NK"
# the second launch of the kernel (the first is the warm-up call of kernel.py --profile)
"$NCU" --clock-control none -k "$KREGEX" --launch-skip 1 --launch-count 1 --set full \
  --import-source no -f -o "$OUT/$tag" \
  python3 benchmarks/kernel.py --profile --variants "$VARIANT" --profile-m "$M" --profile-nk "$NK" > "$OUT/$tag-ncu.log" 2>&1
rc=$?
"$NCU" --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass 2> "$OUT/$tag-sass.err" \
  | gzip -c > "$OUT/$tag-sass.csv.gz"
"$NCU" --import "$OUT/$tag.ncu-rep" --page details --section SourceCounters --section WarpStateStats \
  > "$OUT/$tag-details.txt" 2>&1
so=$(python3 -c "from verl_qerl import kernels; kernels.load_extension(); print(kernels.extension().__file__)" \
  2>/dev/null | tail -1)
[ -n "$so" ] || so=$(find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name '*.so' 2>/dev/null | head -1)
[ -n "$so" ] && "$CUOBJDUMP" -sass "$so" 2>&1 | gzip -c > "$OUT/sass-ext.txt.gz"
echo "[source_profile] ncu rc=$rc; rep $(du -h "$OUT/$tag.ncu-rep" 2>/dev/null | cut -f1); so=$so"
exit $rc
