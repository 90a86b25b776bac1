"""NVFP4 kernel benchmark on the GPU machine: BF16 cuBLAS vs bitsandbytes NF4 vs ours, per decoder layer.

For Qwen2.5-7B and -32B decoder-layer GEMMs (qkv, o, gate_up, down) and M in
{1, 4, 16, 64, 256, 1024, 4096} (``--models all`` adds 1.5B / 3B / 14B shapes that calibrate the stream-K
rule), times in one run:

* ``bf16``   -- ``F.linear`` on a BF16 weight (cuBLAS);
* ``nf4``    -- ``bitsandbytes.matmul_4bit`` (QLoRA's NF4, blocksize 64), if bitsandbytes imports;
* ``ours``   -- ``qerl::nvfp4_gemm`` through its dispatch (the production path: the calibration table or by M,
  then split-K or stream-K by shape; each row's ``ours_runs`` names what ran);
* ``kernel_splitk`` / ``dequant_cublas`` -- the two paths forced (the split-K fused GEMM; dequantize + cuBLAS), to
  tune the dispatch threshold;
* ``kernel_streamk`` -- with ``--variants splitk,streamk``: the stream-K fused kernel (which the dispatch picks by
  shape) forced, where it applies (M >= 17), next to ``kernel_splitk``, with the per-GEMM and per-layer ratio
  ``streamk/splitk`` = split-K time / stream-K time (> 1: stream-K faster);
* ``kernel_wgmma_rs`` / ``kernel_wgmma_ss`` -- with ``--variants splitk,streamk,wgmma_rs,wgmma_ss``: the Hopper
  wgmma kernels (cuda/nvfp4_gemm_wgmma.cu, cuda/nvfp4_gemm_wgmma_ss.cu) forced on sm_90 (the register-A ones at
  every M, ``wgmma_ss`` up to M = 1024: ``kernel_variants.timed_at``);
  the run also writes ``gemm_dispatch-<gpu>.json``, the fastest
  measured kernel per GEMM shape and M, which auto mode reads as its calibration (verl_qerl/kernels/dispatch.py;
  copy it to verl_qerl/kernels/gemm_dispatch_h200.json to ship it);
* ``marlin`` -- vLLM's own Marlin FP4 GEMM (W4A16, ``torch.ops._C.marlin_gemm`` with the
  ``float4_e2m1f`` type), through vLLM's public helpers ``prepare_fp4_layer_for_marlin`` and
  ``apply_fp4_marlin_linear`` (``vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py``,
  the calls vLLM's ``MarlinNvFp4LinearKernel`` makes), fed the same NVFP4 weights as ``ours`` and
  checked against the float64 reference before it is timed. Skipped, with the reason in the JSON
  (``"marlin": {"skipped": ...}``), where vLLM, its compiled ``_C`` ops or the helpers do not import
  or the GPU's capability is below Marlin FP4's.

Timing follows shared/bench/anchors.py (rotating ROT weight sets so L2 does not serve the weight,
CUDA-event medians) in two modes: ``eager`` (events around one call, launch overhead included, as
the anchors) and ``graph`` (a CUDA graph of ROT calls replayed; per-call time = replay / ROT, which
is how vLLM runs decode steps). Targets are checked on the graph times; both are printed and saved.

Kernel names are by role (cuda/gemm_modes.h); ``--variants`` also takes the former ``v5`` / ``wgmma`` (with a
warning). Result files written before the names by role have ``kernel`` (split-K), ``dqmm``, ``kernel_wgmma`` and
``<v>/v5`` keys instead.

Writes ``benchmarks/results/kernel-<gpu>.json`` (``<gpu>`` from the device name: h100, h200, ...; into
``--out``/``$OUT`` when that is a folder) and prints the ratio table last.

This file is the command line and the timing run; its parts live beside it: ``kernel_variants.py`` (the fused-kernel
variants), ``kernel_marlin.py`` (the vLLM Marlin anchor), ``kernel_results.py`` (sums, targets, table, file name),
``kernel_diagnostics.py`` (``--sanitize``, ``--profile``, ``--repro-throw``, ``--ncu-summary``, ``--sass``) and
``kernel_common.py`` (the device and the random weights).

    python benchmarks/kernel.py                 # full run
    python benchmarks/kernel.py --quick         # fewer shapes/iterations (smoke test)
    python benchmarks/kernel.py --sanitize      # tiny correctness run for compute-sanitizer
    python benchmarks/kernel.py --no-marlin     # without the vLLM Marlin column
    python benchmarks/kernel.py --variants splitk,streamk --models qwen2.5-7b --ms 16,64,128  # split-K vs stream-K
    python benchmarks/kernel.py --profile --variants splitk,streamk --profile-m 64  # both kernels, under ncu
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from results_format import positive_ints, target_met, target_status, write_json  # benchmarks/: this script's own folder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the siblings import verl_qerl too: after the repository is on sys.path
from kernel_common import DEV, random_nvfp4  # noqa: E402 - scripts import random_nvfp4 from here
from kernel_diagnostics import ncu_summary, parse_modes, profile_run, repro_throw, sanitize_run, sass_summary  # noqa: E402
from kernel_marlin import add_marlin_ratio, load_marlin, marlin_meta, prepare_marlin  # noqa: E402
from kernel_results import (  # noqa: E402
    DEFAULT_MODELS,
    build_targets,
    result_path,
    streamk_calibration,
    sum_layers,
    table_lines,
)
from kernel_splits import layer_sums, parse_splits, run_sweep, sweep_targets  # noqa: E402
from kernel_variants import (  # noqa: E402
    BASELINE,
    TILE_VARIANTS,
    add_variant_ratios,
    parse_variants,
    tile_variant,
    timed_at,
    variant_applies,
    variant_lines,
)

from verl_qerl import kernels  # noqa: E402
from verl_qerl.kernels import dispatch, layout  # noqa: E402

MODELS = {
    "qwen2.5-7b": dict(h=3584, i=18944, q=3584, kv=512),
    "qwen2.5-32b": dict(h=5120, i=27648, q=5120, kv=1024),
    # calibration shapes for the auto stream-K rule (their gate_up tile counts fall between 7B's qkv and
    # gate_up); timed with --models, not part of the default table or its targets
    "qwen2.5-1.5b": dict(h=1536, i=8960, q=1536, kv=256),
    "qwen2.5-3b": dict(h=2048, i=11008, q=2048, kv=256),
    "qwen2.5-14b": dict(h=5120, i=13824, q=5120, kv=1024),
}
MS = [1, 4, 16, 64, 128, 256, 1024, 4096]
ROT = 4


def select_models(text: str | None) -> dict:
    """``--models`` -> the MODELS subset, in MODELS order (default: DEFAULT_MODELS; ``all``: every model);
    unknown names raise ValueError naming them."""
    if not text:
        return {k: v for k, v in MODELS.items() if k in DEFAULT_MODELS}
    if text.strip() == "all":
        return dict(MODELS)
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in MODELS]
    if bad:
        raise ValueError(f"--models: unknown model(s) {bad}; known: {sorted(MODELS)}")
    return {k: v for k, v in MODELS.items() if k in names}


def parse_nks(text: str) -> set[tuple[int, int]]:
    """``--profile-nk`` ("3584x3584,4608x3584") -> {(N, K)}; an item that is not two positive integers joined by x
    raises ValueError naming the option and the bad items."""
    items = [v.strip().lower() for v in text.split(",")]
    bad = [v for v in items if len(v.split("x")) != 2 or not all(d.isdigit() and int(d) > 0 for d in v.split("x"))]
    if bad:
        raise ValueError(f"--profile-nk {text!r}: expected a comma list of NxK, e.g. 3584x3584 (bad: {bad})")
    return {(int(v.split("x")[0]), int(v.split("x")[1])) for v in items}


def layer_shapes(c: dict[str, int]) -> list[tuple[str, int, int]]:
    h, i = c["h"], c["i"]
    return [("qkv", c["q"] + 2 * c["kv"], h), ("o", h, c["q"]), ("gate_up", 2 * i, h), ("down", h, i)]


def bench_eager(fn, iters: int = 30) -> float:
    """Median ms of one call between two events (anchors.py's method)."""
    for r in range(3):
        fn(r)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(iters):
        s.record()
        fn(r)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def capture_graph(fn):  # noqa: ANN201 - torch.cuda.CUDAGraph, or None
    """A CUDA graph holding ROT calls of ``fn`` (one per weight set), after warm-up; None if uncapturable."""
    try:
        for r in range(ROT):
            fn(r)
        torch.cuda.synchronize()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for r in range(ROT):
                fn(r)
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for r in range(ROT):
                fn(r)
        g.replay()
        torch.cuda.synchronize()
        return g
    except Exception as ex:  # noqa: BLE001
        print(f"#   graph capture failed: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
        torch.cuda.synchronize()
        return None


def replay_ms(g, reps: int) -> list[float]:
    """ms per call of each of ``reps`` replays of a graph from :func:`capture_graph`."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / ROT)
    return times


def bench_graph(fn, reps: int = 20) -> float | None:
    """Median ms per call of a CUDA graph holding ROT calls (one per weight set); None if uncapturable."""
    g = capture_graph(fn)
    if g is None:
        return None
    t = statistics.median(replay_ms(g, reps))
    del g
    return t


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` methods, one per round, in which every method comes right after every other one equally often
    (a Williams design: n rounds for even n, 2n for odd n; within rounds, not across their boundaries).

    Why: a kernel timed right after a compute-bound one (BF16 cuBLAS above all) runs at the clock the power limit
    left. Rotations of one order (the rounds' first design) keep every method's predecessor fixed, so the auto
    dispatch's column, listed after BF16, read up to 16 % slower than the very same kernel forced a few columns later
    (benchmarks/NOTES.md, "The `ours` column reads slower than the same kernel's forced column")."""
    if n <= 0:
        return []
    if n == 1:
        return [[0]]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def interleaved_graph_ms(graphs: dict, reps: int) -> dict[str, float | None]:
    """Median ms per call of each graph, its ``reps`` replays spread over the rounds of :func:`balanced_orders`, so
    that every method sees the same mix of clock states: each one is timed after each other method equally often
    (NOTES "Kernel timings in rounds": timed one after the other, the wgmma kernel at M >= 256 right after BF16
    cuBLAS read 8-25 % slower than the same kernel timed a few methods later). A graph that is None reads None.
    """
    keys = [k for k, g in graphs.items() if g is not None]
    times: dict[str, list[float]] = {k: [] for k in keys}
    orders = balanced_orders(len(keys))
    per_round = max(1, -(-reps // max(1, len(orders))))
    for order in orders:
        for i in order:
            times[keys[i]] += replay_ms(graphs[keys[i]], per_round)
    return {k: (statistics.median(times[k]) if k in times else None) for k in graphs}


def ceilings() -> tuple[float, float]:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV).normal_()
    y = torch.empty_like(x)
    t = bench_eager(lambda r: y.copy_(x), 20)
    bw = 2 * x.numel() * 2 / (t / 1e3) / 1e12
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t2 = bench_eager(lambda r: a @ b, 20)
    tf = 2 * 8192**3 / (t2 / 1e3) / 1e12
    return bw, tf


def run_header(device_name: str) -> dict:
    """What every results JSON of this script starts with: device, versions, command, date, and the ``QERL_*``
    variables set (they pick kernels and routes, e.g. ``QERL_LORA_SHRINK=cublas``: without them two runs of the
    same command line could not be told apart)."""
    return {"device": device_name,
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
            "command": "python " + " ".join(sys.argv),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("QERL_")},
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}


def rotated_weights(n: int, k: int) -> list:
    """ROT random NVFP4 weights [n, k] in the kernel layout (graph timing cycles through them: no L2 reuse)."""
    return [kernels.repack(*random_nvfp4(n, k)[:2]) for _ in range(ROT)]


def splitk_graph_ms(x: torch.Tensor, ws: list, n: int, splits: int = 0, reps: int = 20) -> float | None:
    """Graph ms per call of the split-K kernel on ``x`` over the rotated weights ``ws`` (``splits`` 0: the
    heuristic's count)."""
    gs = torch.tensor([100.0], device=DEV)
    return bench_graph(lambda r: torch.ops.qerl.nvfp4_gemm(x, ws[r % ROT].qweight, ws[r % ROT].qscale, gs, None, n,
                                                           kernels.GemmMode.SPLITK, splits), reps=reps)


def tune_splits(models: dict, ms: list[int]) -> dict:
    """Graph-time the fused kernel over split-K penalties on decode shapes; keep the best."""
    ext = kernels.extension()
    penalties = (0.0, 0.004, 0.015, 0.05)
    totals = dict.fromkeys(penalties, 0.0)
    for cfg in models.values():
        for _, n, k in layer_shapes(cfg):
            ws = rotated_weights(n, k)
            for m in ms:
                x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                for pen in penalties:
                    ext.set_tuning(-1, pen)
                    totals[pen] += splitk_graph_ms(x, ws, n, reps=10) or 0.0
            del ws
    for pen, tot in totals.items():
        print(f"# split penalty {pen}: decode GEMMs total {tot:.4f} ms", flush=True)
    best = min(totals, key=totals.get)
    ext.set_tuning(-1, best)
    return {"split_penalty": best, "totals_ms": totals}


def measure_shape(mname: str, lname: str, n: int, k: int, ms: list[int], iters: int, bnb_mods,
                  marlin_mod=None, variants: list[str] | None = None, pdl: bool = False) -> list[dict]:
    """All methods, eager and graph, for one GEMM shape over ms (weights rotate over ROT sets). ``pdl``: ``ours``
    (auto dispatch) runs as vLLM's forward does, its decode kernels as programmatic dependent launches, and
    ``ours_nopdl`` beside it without (the graph replays one GEMM after another: each may start while the one
    before drains, as a decode GEMM does after the RMSNorm / attention / activation kernel before it)."""
    ext = kernels.extension()
    w_bf16 = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(ROT)]
    q4 = [random_nvfp4(n, k) for _ in range(ROT)]
    rws = [kernels.repack(p, s) for p, s, _ in q4]
    gss = [g for _, _, g in q4]
    nf4 = [bnb_mods[1].quantize_4bit(w, quant_type="nf4", blocksize=64) for w in w_bf16] if bnb_mods else None
    xs = {m: torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for m in ms}
    mfns, minfo = prepare_marlin(marlin_mod, q4, n, k, xs) if marlin_mod is not None else (None, {})
    if minfo:
        print(f"# marlin {mname} {lname} {n}x{k}: {json.dumps(minfo)}", flush=True)

    def ours(mode: str, x: torch.Tensor, with_pdl: bool = False):  # noqa: ANN202
        mode = kernels.GEMM_MODES[mode]
        return lambda r: torch.ops.qerl.nvfp4_gemm(
            x, rws[r % ROT].qweight, rws[r % ROT].qscale, gss[r % ROT], None, n, mode, 0, with_pdl)

    recs = []
    for m in ms:
        x = xs[m]
        fns = {
            "bf16": lambda r, x=x: F.linear(x, w_bf16[r % ROT]),
            "ours": ours("auto", x, pdl),
            **({"ours_nopdl": ours("auto", x)} if pdl else {}),
            f"kernel_{BASELINE}": ours(BASELINE, x),
            "dequant_cublas": ours("dequant_cublas", x),
        }
        for v in variants or []:
            if v != BASELINE and variant_applies(ext, v, m, n, k):
                fns[f"kernel_{v}"] = (tile_variant(ext, v, ours(TILE_VARIANTS[v], x)) if v in TILE_VARIANTS
                                      else ours(v, x))
        if bnb_mods:
            xb = x.unsqueeze(0) if m == 1 else x
            fns["nf4"] = lambda r, xb=xb: bnb_mods[0].matmul_4bit(
                xb, nf4[r % ROT][0].t(), quant_state=nf4[r % ROT][1])
        if mfns is not None:
            fns["marlin"] = lambda r, x=x: mfns[r % ROT](x)
        rec = {"model": mname, "layer": lname, "N": n, "K": k, "M": m, "splits": int(ext.splits_for(m, n, k)),
               "ours_runs": ext.gemm_choice(m, n, k, int(kernels.GemmMode.AUTO)), **minfo}
        if "streamk" in (variants or []):
            rec["streamk_grid"] = int(ext.streamk_grid(m, n))
            rec["streamk_tiles"] = int(ext.streamk_tiles(m, n))
        graphs = {}
        for key, fn in fns.items():
            if key.startswith("kernel_") and not timed_at(key[len("kernel_"):], m):
                continue  # (kernel_variants.timed_at: the decode-size kernels only up to 1,024 tokens)
            rec[f"{key}_eager_ms"] = round(bench_eager(fn, iters), 5)
            graphs[key] = capture_graph(fn)
        for key, g in interleaved_graph_ms(graphs, reps=iters).items():
            rec[f"{key}_graph_ms"] = round(g, 5) if g is not None else None
        del graphs
        recs.append(add_variant_ratios(add_marlin_ratio(rec), variants or []))
    return recs


def _dequant_times(n: int, k: int) -> dict[str, float]:
    packed, scale, gs = random_nvfp4(n, k)
    rw = kernels.repack(packed, scale)
    return {"ct": bench_eager(lambda r: kernels.dequantize(packed, scale, gs), 20),
            "repacked": bench_eager(lambda r: kernels.dequantize_repacked(rw, gs, n), 20)}


def dequant_bandwidth(bw: float) -> dict:
    """Dequant kernels alone on the largest 7B/32B weights: time and bytes/s vs the copy ceiling."""
    res = {}
    for n, k in [(37888, 3584), (55296, 5120)]:
        moved = n * k * (0.5625 + 2)
        for name, t in _dequant_times(n, k).items():
            res[f"{name}_{n}x{k}"] = {"ms": round(t, 4), "TBps": round(moved / (t / 1e3) / 1e12, 3),
                                      "of_copy": round(moved / (t / 1e3) / 1e12 / bw, 3)}
        torch.cuda.empty_cache()
    print("# dequant kernels:", json.dumps(res), flush=True)
    return res


def sweep_splits_run(models: dict, ms: list[int], swept: list[int], out_arg: str | None) -> int:
    """``--sweep-splits``: the split-K kernel per decode GEMM at each swept split count and the heuristic's, in CUDA
    graphs (kernel_splits.py says why); writes ``split-sweep-<gpu>.json``."""
    if not kernels.load_extension(verbose=False):
        print("extension failed:", kernels.cuda_unavailable_reason())
        return 1
    ext = kernels.extension()
    weights: dict[tuple[int, int], list] = {}

    def time_gemm(m: int, n: int, k: int, splits: int) -> float | None:
        if (n, k) not in weights:  # one shape at a time in memory (the sweep visits each shape's M in a row)
            weights.clear()
            torch.cuda.empty_cache()
            weights[(n, k)] = rotated_weights(n, k)
        return splitk_graph_ms(torch.randn(m, k, device=DEV).to(torch.bfloat16), weights[(n, k)], n, splits)

    name = torch.cuda.get_device_name()
    rows = run_sweep(models, ms, swept, time_gemm, lambda m, n, k: int(ext.splits_for(m, n, k)), layer_shapes,
                     layout.K_STAGE)
    sums = layer_sums(rows)
    out = {**run_header(name), "swept_splits": swept, "split_penalty": ext.get_tuning()[1], "rows": rows,
           "layer_sums": sums, "targets": sweep_targets(sums)}
    path = result_path(out_arg, os.environ.get("OUT"), name, Path(__file__).parent / "results")
    path = path.with_name(path.name.replace("kernel-", "split-sweep-"))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, out)
    print(f"# wrote {path}")
    for t in out["targets"]:
        print(f"#  {target_status(t):6} {t['name']}: {t['measured']} {t['op']} {t['target']}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default=None, help="summarize a cuobjdump -sass listing and exit")
    ap.add_argument("--ncu-summary", default=None, help="print the key metrics of an ncu --csv listing and exit")
    ap.add_argument("--repro-throw", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one call per decode shape (run under ncu)")
    ap.add_argument("--profile-marlin", action="store_true", help="with --profile: vLLM's Marlin on the same weights")
    ap.add_argument("--profile-m", default=None, help="with --profile: comma list of M to keep (default all)")
    ap.add_argument("--profile-nk", default=None,
                    help="with --profile: comma list of NxK weight shapes to keep, e.g. 3584x3584 (default all)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--sanitize-modes", default=None,
                    help="with --sanitize: comma list of op mode names to run (default all; cuda/gemm_modes.h)")
    ap.add_argument("--sanitize-max-nk", type=int, default=None, help="with --sanitize: skip weights with N x K above")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--sweep-splits", default=None, metavar="LIST",
                    help="time the split-K kernel at each split count of LIST and at the heuristic's, per decode GEMM "
                    "of --models at --ms (default 1,16), write split-sweep-<gpu>.json and exit")
    ap.add_argument("--threshold", type=int, default=-1, help="force the dispatch threshold (M)")
    ap.add_argument("--no-marlin", action="store_true", help="skip the vLLM Marlin FP4 column")
    ap.add_argument("--variants", default=None,
                    help="fused-kernel variants to time side by side (splitk,streamk); with --profile: to profile "
                    "(default: the one $QERL_GEMM_KERNEL selects)")
    ap.add_argument("--models", default=None,
                    help=f"comma list of {sorted(MODELS)}, or all (default {','.join(DEFAULT_MODELS)})")
    ap.add_argument("--ms", default=None, help="comma list of M (default: all, or --quick's)")
    ap.add_argument("--pdl", action="store_true",
                    help="time `ours` with programmatic dependent launch (as vLLM's forward runs it; QERL_PDL) and "
                    "`ours_nopdl` beside it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        variants = parse_variants(args.variants)
        models = select_models(args.models)
        ms_arg = positive_ints(args.ms, "--ms") if args.ms else None
        profile_ms = set(positive_ints(args.profile_m, "--profile-m")) if args.profile_m else None
        nks = parse_nks(args.profile_nk) if args.profile_nk else None
        sanitize_modes = parse_modes(args.sanitize_modes) if args.sanitize_modes else None
        swept = parse_splits(args.sweep_splits) if args.sweep_splits is not None else None
    except ValueError as ex:
        ap.error(str(ex))
    if args.ncu_summary:
        for row in ncu_summary(args.ncu_summary):
            print(json.dumps(row))
        return 0
    if args.sass:
        return sass_summary(args.sass)
    if args.sanitize:
        return sanitize_run(sanitize_modes, args.sanitize_max_nk)
    if args.repro_throw:
        return repro_throw()
    if swept:
        return sweep_splits_run(models, ms_arg or [1, 16], swept, args.out)
    if args.profile:
        return profile_run(marlin=args.profile_marlin, ms=profile_ms, variants=variants if args.variants else None,
                           nks=nks)
    torch.backends.cuda.matmul.allow_tf32 = True
    if not kernels.load_extension(verbose=False):
        print("extension failed:", kernels.cuda_unavailable_reason())
        return 1
    ext = kernels.extension()
    ms = ms_arg or ([1, 16, 64, 256, 4096] if args.quick else MS)
    iters = 10 if args.quick else 30
    name = torch.cuda.get_device_name()
    out: dict = {
        **run_header(name),
        "rot_weight_sets": ROT,
        "variants": variants,
        "gemm_kernel_env": os.environ.get(kernels.GEMM_KERNEL_ENV, ""),
        "pdl": args.pdl,
    }
    bw, tf = ceilings()
    out["copy_TBps"], out["bf16_TFLOPs"] = round(bw, 3), round(tf, 1)
    print(f"# {name} torch {torch.__version__}: copy {bw:.2f} TB/s, bf16 mm {tf:.0f} TFLOP/s", flush=True)
    out["dequant"] = dequant_bandwidth(bw)
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbF

        bnb_mods = (bnb, bnbF)
        out["versions"]["bitsandbytes"] = bnb.__version__
    except Exception as ex:  # noqa: BLE001
        print("# bitsandbytes unavailable:", ex)
        out["versions"]["bitsandbytes"] = f"unavailable: {ex}"
        bnb_mods = None

    if args.no_marlin:
        marlin_mod, reason = None, "disabled by --no-marlin"
    else:
        marlin_mod, reason = load_marlin(tuple(torch.cuda.get_device_capability()))
    if marlin_mod is None:
        out["marlin"] = {"skipped": reason}
        print(f"# vLLM Marlin FP4 column skipped: {reason}", flush=True)
    else:
        out["versions"]["vllm"], out["marlin"] = marlin_meta()
        print(f"# vLLM Marlin FP4 column: {out['marlin']['source']}", flush=True)

    if not args.no_tune:
        out["split_tuning"] = tune_splits({k: MODELS[k] for k in DEFAULT_MODELS}, [1, 16, 64])
    if args.threshold >= 0:
        ext.set_tuning(args.threshold, -1)
    out["tuning"] = dict(zip(("gemm_max_m", "split_penalty", "streamk_min_tiles_per_cta",
                              "streamk_min_stages_per_cta"), ext.get_tuning(), strict=True))
    print(f"# tuning: {out['tuning']}", flush=True)

    rows = []
    t0 = time.time()
    for mname, cfg in models.items():
        recs = []
        for lname, n, k in layer_shapes(cfg):
            for rec in measure_shape(mname, lname, n, k, ms, iters, bnb_mods, marlin_mod, variants, args.pdl):
                recs.append(rec)
                print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()
        rows.extend(recs)
        nweights = sum(n * k for _, n, k in layer_shapes(cfg))
        sums = sum_layers(recs, len(layer_shapes(cfg)))
        for m in ms:
            lay = {"model": mname, "M": m, "layer": "sum", **sums.get(m, {})}
            lay["floor_fp4_ms"] = round(nweights * 0.5625 / (bw * 1e12) * 1e3, 5)
            lay["floor_bf16_bytes_ms"] = round(nweights * 2 / (bw * 1e12) * 1e3, 5)
            lay["floor_compute_ms"] = round(2 * m * nweights / (tf * 1e12) * 1e3, 5)
            rows.append(add_variant_ratios(add_marlin_ratio(lay), variants))
    out["rows"] = rows
    out["elapsed_s"] = round(time.time() - t0, 1)
    if marlin_mod is not None:
        errs = [r["marlin_rel_err"] for r in rows if "marlin_rel_err" in r]
        failed = sorted({f"{r['model']} {r['layer']}: {r['marlin_error']}" for r in rows if "marlin_error" in r})
        out["marlin"]["max_rel_err"] = max(errs) if errs else None
        if failed:
            out["marlin"]["failed"] = failed
            print("# marlin column dropped for:", *failed, sep="\n#   ", flush=True)

    targets = build_targets(rows)
    out["targets"] = targets

    path = result_path(args.out, os.environ.get("OUT"), name, Path(__file__).parent / "results")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, out)
    print(f"# wrote {path}")
    # the measured winners per GEMM shape and M: auto mode's calibration (verl_qerl/kernels/dispatch.py)
    table = dispatch.table_from_rows(rows, name, tuple(torch.cuda.get_device_capability()), out["command"])
    table_path = path.with_name(path.name.replace("kernel-", "gemm_dispatch-"))
    write_json(table_path, table, indent=None)
    print(f"# wrote the measured dispatch table {table_path} ({len(table['points'])} points)")

    print()
    print("\n".join(table_lines(rows, name)))
    if len(variants) > 1:
        print()
        print("\n".join(variant_lines(rows, variants)))
    if args.pdl:
        print("\n# programmatic dependent launch: per layer, ours (PDL) vs ours_nopdl, CUDA graph ms")
        for r in rows:
            if r["layer"] == "sum" and r.get("ours_graph_ms") and r.get("ours_nopdl_graph_ms"):
                print(f"{r['model']:12s} M={r['M']:5d}  pdl {r['ours_graph_ms']:.4f}  no pdl "
                      f"{r['ours_nopdl_graph_ms']:.4f}  gain {r['ours_nopdl_graph_ms'] / r['ours_graph_ms']:.3f}x  "
                      f"vs bf16 {r['bf16_graph_ms'] / r['ours_graph_ms']:.3f}x (no pdl "
                      f"{r['bf16_graph_ms'] / r['ours_nopdl_graph_ms']:.3f}x)")
    if "streamk" in variants:
        tun = out["tuning"]
        out["streamk_calibration"] = cal = streamk_calibration(rows, tun["streamk_min_tiles_per_cta"],
                                                               tun["streamk_min_stages_per_cta"])
        print(f"# auto stream-K rule (tiles >= {cal['rule']} x CTAs or >= {cal['rule_stages']:.0f} stages per CTA): "
              f"picks the faster kernel in {cal['rule_right']}/{len(cal['points'])} GEMMs, {cal['rule_ms']:.4f} ms "
              f"summed vs {cal['oracle_ms']:.4f} best-of-both; best tiles threshold with that stages rule: "
              f"{cal['best_threshold']}")
    rec_thr = {}
    for mname in models:
        faster = [r["M"] for r in rows if r["layer"] == "sum" and r["model"] == mname
                  and r.get("kernel_splitk_graph_ms") and r.get("dequant_cublas_graph_ms")
                  and r["kernel_splitk_graph_ms"] < r["dequant_cublas_graph_ms"]]
        rec_thr[mname] = max(faster) if faster else 0
    out["recommended_gemm_max_m"] = rec_thr
    write_json(path, out)
    print(f"# fused kernel faster than dequant+cuBLAS up to M = {rec_thr} (dispatch threshold now "
          f"{out['tuning']['gemm_max_m']:.0f})")
    met = sum(bool(target_met(t)) for t in targets)
    print(f"# targets met: {met}/{len(targets)}")
    for t in targets:
        print(f"#  {target_status(t):6} {t['name']}: {t['measured']} {t['op']} {t['target']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
