"""Where the wide wgmma kernel's time goes at one M: main-loop rate vs per-segment cost, and tensor-pipe use.

Two jobs, both on the GPU machine, for the question issue 18 leaves open at M = 256 (the wide kernel at 0.87x BF16
per 7B layer while BF16 cuBLAS runs at ~80 % of the measured BF16 peak):

* ``--sweep`` times, side by side in one run (CUDA graphs, rotating weight sets, interleaved rounds as in
  ``kernel.py``), the wide kernel forced (``wgmma_rs``; its cluster split where the launcher picks it), the same with
  the cluster split off (``QERL_WGMMA_CLUSTER=0``: stream-K everywhere) and BF16 cuBLAS, over GEMMs that differ only
  in K. Under stream-K a CTA runs ``ceil(tiles * K / 128 / CTAs)`` stages in ~2-3 segments whatever K is, so a
  least-squares line of time against stages per CTA splits the kernel into a main-loop rate (us per stage, the
  slope) and what every CTA pays once (prologue, pipeline fill, partials, fix-up, store: the intercept).
* ``--stamps`` (the build with ``QERL_ANATOMY_STAMPS=1``, cuda/anatomy_stamps.cuh) reads one launch's per-CTA
  timeline on the 7B GEMMs at each M: time to the first stage's data, in the stage loops (of it waiting for data),
  in the segment ends, the kernel's span and its CTAs' entry / exit spread, next to the graph time of the call.
* ``--ncu-calls`` makes one call of each method per shape after a warm-up, for ``ncu --metrics`` (the device script
  ``benchmarks/gpu/anatomy.sh`` runs it): tensor-pipe activity and the SM clock of our kernel next to cuBLAS's on
  the same GEMM say whether the remaining gap is the MMA issue rate or time outside the MMAs.

    python benchmarks/kernel_anatomy.py --sweep --m 256 --out $OUT/anatomy-nvidia-h200.json
    python benchmarks/kernel_anatomy.py --ncu-calls --m 256
    QERL_ANATOMY_STAMPS=1 python benchmarks/kernel_anatomy.py --stamps --ms 64,128,256 --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernel import ROT, capture_graph, interleaved_graph_ms, rotated_weights, run_header  # noqa: E402
from kernel_common import DEV, random_nvfp4  # noqa: E402
from kernel_variants import wide_tile  # noqa: E402
from results_format import report_and_write  # noqa: E402

from verl_qerl import kernels  # noqa: E402

TILE_ROWS = 128    # weight rows per wide-kernel tile (cuda/nvfp4_gemm_wgmma_wide.cu, WD_ROWS)
STAGE_K = 128      # K per pipeline stage (QERL_GEMM_BK)
# N of the 7B GEMMs (qkv, o / down, gate_up) against K from a sixteenth to over five times the 7B hidden size
SWEEP_NS = (4608, 3584, 37888)
SWEEP_KS = (1792, 3584, 7168, 14336, 18944)
NCU_SHAPES = ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944))  # the 7B layer: qkv, o, gate_up, down


def stages_per_cta(m: int, n: int, k: int, ctas: int) -> int:
    """Stages the busiest CTA runs under stream-K (the wide kernel's unit split over ``ctas``; its token tile
    fitted to M as the op fits it)."""
    tiles = math.ceil(n / TILE_ROWS) * math.ceil(m / wide_tile(m))
    return math.ceil(tiles * (k // STAGE_K) / ctas)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line: every x is the same; the sweep needs at least two K per N")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


#: the forced op modes --stamps can read (the register-A kernels; ``wgmma_wide``: the wide kernel from M = 65)
STAMP_MODES = ("wgmma_rs", "wgmma_wide")


def stamp_kernel(m: int, mode: str) -> str:
    """Which stamp table the forced ``mode`` fills at M: ``wide`` (cuda/nvfp4_gemm_wgmma_wide.cu: from M = 129, and
    from 65 under ``wgmma_wide``) or ``wgmma`` (the 64- / 128-token kernels)."""
    if mode not in STAMP_MODES:
        raise ValueError(f"--mode {mode!r}: one of {', '.join(STAMP_MODES)}")
    return "wide" if m > 128 or (mode == "wgmma_wide" and m > 64) else "wgmma"


def _gemm_fns(m: int, n: int, k: int, mode_name: str = "wgmma_rs") -> dict:
    """The three timed methods for one shape, each a callable of the weight-set index r (ours forced to
    ``mode_name``)."""
    ws = rotated_weights(n, k)
    gs = torch.ones((), device=DEV)
    w16 = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(ROT)]
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    mode = int(kernels.GEMM_MODES[mode_name])

    def ours(r: int) -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm(x, ws[r % ROT].qweight, ws[r % ROT].qscale, gs, None, n, mode)

    return {"wide": ours, "bf16": lambda r: F.linear(x, w16[r % ROT])}


@contextlib.contextmanager
def _cluster_split(on: bool) -> Iterator[None]:
    """The wide kernel's cluster split on or off (``QERL_WGMMA_CLUSTER``, read by the launcher per call) for the
    block, the caller's own setting restored after."""
    old = os.environ.get("QERL_WGMMA_CLUSTER")
    os.environ["QERL_WGMMA_CLUSTER"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["QERL_WGMMA_CLUSTER"]
        else:
            os.environ["QERL_WGMMA_CLUSTER"] = old


def _capture(fn, cluster: bool):  # noqa: ANN001, ANN202 - a callable, a CUDA graph or None
    """A graph of ``fn`` captured with the cluster split on or off."""
    with _cluster_split(cluster):
        return capture_graph(fn)


def sweep(m: int, ns: list[int], ks: list[int], reps: int) -> dict:
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n in ns:
        for k in ks:
            fns = _gemm_fns(m, n, k)
            graphs = {"wide": _capture(fns["wide"], True), "wide_streamk": _capture(fns["wide"], False),
                      "bf16": capture_graph(fns["bf16"])}
            ms = interleaved_graph_ms(graphs, reps)
            del graphs
            row = {"M": m, "N": n, "K": k, "stages_per_cta": stages_per_cta(m, n, k, ctas),
                   **{f"{key}_us": round(v * 1e3, 2) if v is not None else None for key, v in ms.items()}}
            tf = 2 * m * n * k / 1e12
            row["bf16_TFLOPs"] = round(tf / (ms["bf16"] / 1e3), 1) if ms["bf16"] else None
            row["wide_TFLOPs"] = round(tf / (ms["wide"] / 1e3), 1) if ms["wide"] else None
            rows.append(row)
            print(f"M={m} N={n:6d} K={k:6d} stages/CTA {row['stages_per_cta']:4d}  wide {row['wide_us']:8.2f} us  "
                  f"stream-K only {row['wide_streamk_us']:8.2f}  bf16 {row['bf16_us']:8.2f}  "
                  f"({row['wide_TFLOPs']} vs {row['bf16_TFLOPs']} TFLOP/s)", flush=True)
            torch.cuda.empty_cache()
    fits = []
    for n in ns:
        pts = [(r["stages_per_cta"], r["wide_streamk_us"]) for r in rows if r["N"] == n and r["wide_streamk_us"]]
        if len(pts) >= 2:
            a, b = fit_line([p[0] for p in pts], [p[1] for p in pts])
            worst = max(abs(y - (a + b * x)) for x, y in pts)
            fits.append({"N": n, "intercept_us": round(a, 2), "us_per_stage": round(b, 4),
                         "worst_residual_us": round(worst, 2)})
            print(f"# N={n}: stream-K time = {a:.2f} us + {b * 1e3:.1f} ns x stages/CTA (worst residual "
                  f"{worst:.2f} us)", flush=True)
    return {"rows": rows, "fits": fits, "ctas": ctas}


STAMP_FIELDS = ("entry_ns", "exit_ns", "cycles", "first_data", "loop", "loop_wait", "ends", "segments", "sm",
                "end_sub0", "end_sub1", "end_sub2", "end_sub3", "end_sub4")
STAMP_MS = (64, 128, 256)


def stamp_summary(rows: list[list[int]]) -> dict:
    """Per-launch figures from the CTA rows of ``anatomy_stamps`` (cuda/anatomy_stamps.cuh's fields): the kernel's
    span from the first CTA's entry to the last one's exit (globaltimer), the entry / exit spread, and per CTA the
    phases in us (its SM cycles over its own clock), as mean and max over the CTAs that ran."""
    ran = [dict(zip(STAMP_FIELDS, r)) for r in rows if r[0] > 0]
    if not ran:
        raise ValueError("anatomy_stamps: no CTA wrote its row (was the stamped kernel the one launched?)")
    t0 = min(r["entry_ns"] for r in ran)
    out = {"ctas": len(ran), "span_us": round((max(r["exit_ns"] for r in ran) - t0) / 1e3, 2),
           "entry_spread_us": round((max(r["entry_ns"] for r in ran) - t0) / 1e3, 2),
           "exit_spread_us": round((max(r["exit_ns"] for r in ran) - min(r["exit_ns"] for r in ran)) / 1e3, 2)}
    ghz = [r["cycles"] / max(1, r["exit_ns"] - r["entry_ns"]) for r in ran]
    out["clock_GHz"] = round(statistics.median(ghz), 3)
    for f in ("cycles", "first_data", "loop", "loop_wait", "ends", "end_sub0", "end_sub1", "end_sub2", "end_sub3",
              "end_sub4"):
        us = [r[f] / g / 1e3 for r, g in zip(ran, ghz)]
        out[f"{f}_us_mean"] = round(statistics.fmean(us), 2)
        out[f"{f}_us_max"] = round(max(us), 2)
    out["segments_mean"] = round(statistics.fmean(r["segments"] for r in ran), 2)
    return out


def stamps(ms: list[int], reps: int, mode: str = "wgmma_rs") -> dict:
    """The stamped build's per-CTA phases for the four 7B GEMMs at each M (the wgmma kernel ``mode`` forces there:
    :func:`stamp_kernel`), the cluster split on and off, next to the graph time of the same call (the launch gap is
    the difference) and BF16 cuBLAS's."""
    ext = kernels.extension()
    if not hasattr(ext, "anatomy_stamps"):
        raise RuntimeError("--stamps needs the stamped build: run with QERL_ANATOMY_STAMPS=1 (its own JIT name)")
    rows = []
    for m in ms:
        kern = stamp_kernel(m, mode)
        for n, k in NCU_SHAPES:
            fns = _gemm_fns(m, n, k, mode)
            for cluster in (True, False):
                ext.anatomy_stamps(kern, anatomy_max_ctas(), True)
                with _cluster_split(cluster):
                    for r in range(3):
                        fns["wide"](r)
                    torch.cuda.synchronize()
                    ext.anatomy_stamps(kern, anatomy_max_ctas(), True)
                    fns["wide"](0)
                    torch.cuda.synchronize()
                    st = stamp_summary(ext.anatomy_stamps(kern, anatomy_max_ctas()).tolist())
                graphs = {"ours": _capture(fns["wide"], cluster), "bf16": capture_graph(fns["bf16"])}
                ms_ = interleaved_graph_ms(graphs, reps)
                del graphs
                row = {"M": m, "N": n, "K": k, "mode": mode, "kernel": kern, "cluster": cluster, **st,
                       "graph_us": round(ms_["ours"] * 1e3, 2), "bf16_graph_us": round(ms_["bf16"] * 1e3, 2)}
                rows.append(row)
                print(f"M={m:4d} N={n:6d} K={k:6d} {kern:5s} cluster={int(cluster)} ctas {st['ctas']:4d} seg "
                      f"{st['segments_mean']:.2f} | graph {row['graph_us']:7.2f} span {st['span_us']:7.2f} entry+"
                      f"{st['entry_spread_us']:5.2f} exit+{st['exit_spread_us']:5.2f} | per CTA mean/max: first "
                      f"{st['first_data_us_mean']:5.2f}/{st['first_data_us_max']:5.2f} loop "
                      f"{st['loop_us_mean']:6.2f}/{st['loop_us_max']:6.2f} (wait {st['loop_wait_us_mean']:5.2f}) ends "
                      f"{st['ends_us_mean']:5.2f}/{st['ends_us_max']:5.2f} [{st['end_sub0_us_mean']:5.2f} "
                      f"{st['end_sub1_us_mean']:5.2f} {st['end_sub2_us_mean']:5.2f} {st['end_sub3_us_mean']:5.2f} "
                      f"{st['end_sub4_us_mean']:5.2f}] total "
                      f"{st['cycles_us_mean']:6.2f} @ "
                      f"{st['clock_GHz']} GHz | bf16 {row['bf16_graph_us']:6.2f}", flush=True)
            torch.cuda.empty_cache()
    return {"rows": rows}


def anatomy_max_ctas() -> int:
    """Rows read from the stamp table: the largest grid the wgmma kernels launch (2 CTAs per SM at most)."""
    return 2 * torch.cuda.get_device_properties(0).multi_processor_count


def ncu_calls(m: int) -> int:
    """One call of each method per 7B layer shape after two warm-up calls (profile with ncu --launch-skip 0)."""
    kernels.load_extension()
    for n, k in NCU_SHAPES:
        packed, scale, gs = random_nvfp4(n, k)
        rw = kernels.repack(packed, scale)
        w16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        mode = int(kernels.GEMM_MODES["wgmma_rs"])
        for _ in range(2):
            torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, mode)
            F.linear(x, w16)
        torch.cuda.synchronize()
        print(f"# ncu shape M={m} N={n} K={k}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time vs K: main-loop rate and per-CTA cost")
    ap.add_argument("--ncu-calls", action="store_true", help="one call per method and 7B shape, for ncu")
    ap.add_argument("--stamps", action="store_true",
                    help="per-CTA phases of the stamped build (QERL_ANATOMY_STAMPS=1), 7B shapes at --ms")
    ap.add_argument("--ms", default=",".join(map(str, STAMP_MS)), help="with --stamps: comma list of M")
    ap.add_argument("--mode", default="wgmma_rs", choices=STAMP_MODES,
                    help="with --stamps: the forced kernel (wgmma_wide: the wide kernel's 128-token tiles at 65-128)")
    ap.add_argument("--m", type=int, default=256, help="tokens (default 256)")
    ap.add_argument("--ns", default=",".join(map(str, SWEEP_NS)), help="comma list of N")
    ap.add_argument("--ks", default=",".join(map(str, SWEEP_KS)), help="comma list of K (multiples of 128)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="results JSON (a folder: anatomy-m<M>-<gpu>.json inside)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_anatomy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.ncu_calls:
        return ncu_calls(args.m)
    if not (args.sweep or args.stamps):
        ap.error("give --sweep, --stamps or --ncu-calls")
    ks = [int(v) for v in args.ks.split(",")]
    bad = [k for k in ks if k % STAGE_K]
    if bad:
        ap.error(f"--ks: {bad} not multiples of {STAGE_K}")
    kernels.load_extension()
    t0 = time.time()
    name = torch.cuda.get_device_name(0)
    part = (stamps([int(v) for v in args.ms.split(",")], args.reps, args.mode) if args.stamps
            else sweep(args.m, [int(v) for v in args.ns.split(",")], ks, args.reps))
    res = {**run_header(name), **part, "elapsed_s": round(time.time() - t0, 1), "targets": []}
    out = Path(args.out or "benchmarks/results")
    if out.suffix != ".json":
        gpu = name.lower().replace("nvidia ", "").split()[0]
        out = out / (f"anatomy-stamps-nvidia-{gpu}.json" if args.stamps else f"anatomy-m{args.m}-nvidia-{gpu}.json")
    report_and_write(out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
