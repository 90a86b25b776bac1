#!/usr/bin/env bash
# The wide kernel's anatomy at one M (ON the GPU machine, repository root; bare image):
#   OUT=$OUT [M=256] [STEPS=sweep,ncu] bash benchmarks/gpu/anatomy.sh      # ~1-2 min after the build
# Why: at M = 256 BF16 cuBLAS already runs near the tensor cores' limit, so the wide kernel can only match it by
# the same tensor-pipe activity; this puts the two side by side. `sweep`: benchmarks/kernel_anatomy.py --sweep (time
# against K: main-loop rate and per-CTA cost). `ncu`: tensor-pipe activity, SM clock, shared-memory and L2 / DRAM
# throughput of our kernel and cuBLAS's on the four 7B GEMMs (ncu --clock-control none: the clock the GPU chose).
# Only metrics this ncu knows are asked for (an unknown name fails the whole run).
# Writes to $OUT: anatomy.log, anatomy-m<M>-*.json, anatomy-ncu-m<M>.csv, ncu-metric-names.txt.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/steps.sh
check_start anatomy
M=${M:-256}
STEPS=${STEPS:-sweep,ncu}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
build_step 240
if [[ ",$STEPS," == *,sweep,* ]]; then
  step sweep 300 python3 benchmarks/kernel_anatomy.py --sweep --m "$M" --out "$OUT" > "$OUT/anatomy-sweep.log" 2>&1
  tail -8 "$OUT/anatomy-sweep.log" | tee -a "$LOG"
fi
if [[ ",$STEPS," == *,ncu,* ]]; then
  "$NCU" --query-metrics > /tmp/ncu_names.txt 2>&1
  gzip -c /tmp/ncu_names.txt > "$OUT/ncu-metric-names.txt.gz"
  want="gpu__time_duration.sum sm__cycles_elapsed.avg.per_second sm__cycles_active.avg
    sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
    sm__inst_executed_pipe_tensor_op_gmma.sum sm__throughput.avg.pct_of_peak_sustained_elapsed
    l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed
    smsp__inst_executed.sum smsp__issue_active.avg.pct_of_peak_sustained_elapsed
    lts__t_bytes.sum.per_second dram__bytes.sum.per_second launch__grid_size launch__registers_per_thread"
  metrics=""
  for w in $want; do
    base=${w%%.*}
    grep -q "^ *$base\b" /tmp/ncu_names.txt && metrics="$metrics${metrics:+,}$w"
  done
  echo "[anatomy] ncu metrics: $metrics" | tee -a "$LOG"
  # only the GEMMs (ours and cuBLAS's): profiling every torch kernel of the script ran past 240 s
  step ncu 240 "$NCU" --clock-control none -k 'regex:nvfp4_gemm|nvjet|gemm' --metrics "$metrics" -f -o /tmp/anatomy \
    python3 benchmarks/kernel_anatomy.py --ncu-calls --m "$M" > "$OUT/anatomy-ncu.log" 2>&1
  "$NCU" --import /tmp/anatomy.ncu-rep --csv --page raw > "$OUT/anatomy-ncu-m$M.csv" 2>> "$OUT/anatomy-ncu.log"
fi
echo "[anatomy] done, failed steps: $fail" | tee -a "$LOG"
exit $fail
