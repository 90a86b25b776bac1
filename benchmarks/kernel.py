"""NVFP4 kernel benchmark on the GPU machine: BF16 cuBLAS vs bitsandbytes NF4 vs ours, per decoder layer.

For Qwen2.5-7B and -32B decoder-layer GEMMs (qkv, o, gate_up, down) and M in
{1, 4, 16, 64, 256, 1024, 4096}, times in one run:

* ``bf16``   -- ``F.linear`` on a BF16 weight (cuBLAS);
* ``nf4``    -- ``bitsandbytes.matmul_4bit`` (QLoRA's NF4, blocksize 64), if bitsandbytes imports;
* ``ours``   -- ``qerl::nvfp4_gemm`` through its M dispatch (the production path);
* ``kernel`` / ``dqmm`` -- the two paths forced (fused GEMM; dequantize + cuBLAS), to tune the
  dispatch threshold.

Timing follows shared/bench/anchors.py (rotating ROT weight sets so L2 does not serve the weight,
CUDA-event medians) in two modes: ``eager`` (events around one call, launch overhead included, as
the anchors) and ``graph`` (a CUDA graph of ROT calls replayed; per-call time = replay / ROT, which
is how vLLM runs decode steps). Targets are checked on the graph times; both are printed and saved.

Writes ``benchmarks/results/kernel-<gpu>.json`` (or ``$OUT``) and prints the ratio table last.

    python benchmarks/kernel.py                 # full run
    python benchmarks/kernel.py --quick         # fewer shapes/iterations (smoke test)
    python benchmarks/kernel.py --sanitize      # tiny correctness run for compute-sanitizer
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verl_qerl import kernels  # noqa: E402
from verl_qerl.kernels import reference  # noqa: E402

DEV = "cuda"
MODELS = {
    "qwen2.5-7b": dict(h=3584, i=18944, q=3584, kv=512),
    "qwen2.5-32b": dict(h=5120, i=27648, q=5120, kv=1024),
}
MS = [1, 4, 16, 64, 256, 1024, 4096]
ROT = 4
TARGETS = [  # (M predicate, target ratio vs bf16)
    (lambda m: m <= 16, 4.0),
    (lambda m: m == 64, 3.0),
    (lambda m: m == 256, 1.2),
    (lambda m: m >= 1024, 0.95),
]


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


def bench_graph(fn, reps: int = 20) -> float | None:
    """Median ms per call of a CUDA graph holding ROT calls (one per weight set); None if uncapturable."""
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
    except Exception as ex:  # noqa: BLE001
        print(f"#   graph capture failed: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
        torch.cuda.synchronize()
        return None
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / ROT)
    del g
    return statistics.median(times)


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


def random_nvfp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes and E4M3 scales in [0.5, 2.5] (as anchors.py); not zeros (see METHOD.md)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
    scale = (torch.rand(n, k // 16, device=DEV) * 2 + 0.5).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor([100.0], device=DEV)


def sanitize_run() -> int:
    """Small shapes through every kernel and split path, checked; meant for compute-sanitizer."""
    kernels.load_extension()
    torch.manual_seed(0)
    bad = 0
    for m, n, k, mode in [(1, 256, 256, 1), (5, 272, 512, 18), (16, 128, 384, 19), (40, 384, 256, 1),
                          (70, 128, 256, 17), (3, 256, 512, 2), (300, 2048, 256, 2), (260, 1040, 384, 3)]:
        packed, scale, gs = random_nvfp4(n, k)
        rw = kernels.repack(packed, scale)
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        b = torch.randn(n, device=DEV).to(torch.bfloat16)
        out = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, b, n, mode)
        ref = reference.linear_f64(x, packed, scale, gs, b)
        err = float((out.double() - ref).norm() / ref.norm())
        w1 = kernels.dequantize(packed, scale, gs)
        w2 = kernels.dequantize_repacked(rw, gs, n)
        ok = err < 1e-2 and torch.equal(w1, w2)
        bad += not ok
        print(f"sanitize M={m} N={n} K={k} mode={mode}: rel err {err:.2e} dequant equal {torch.equal(w1, w2)}")
    torch.cuda.synchronize()
    print("SANITIZE", "OK" if bad == 0 else f"{bad} FAILED")
    return 1 if bad else 0


def tune_splits(models: dict, ms: list[int]) -> dict:
    """Graph-time the fused kernel over split-K penalties on decode shapes; keep the best."""
    ext = kernels.extension()
    penalties = (0.0, 0.004, 0.015, 0.05)
    totals = dict.fromkeys(penalties, 0.0)
    gs = torch.tensor([100.0], device=DEV)
    for cfg in models.values():
        for _, n, k in layer_shapes(cfg):
            ws = [kernels.repack(*random_nvfp4(n, k)[:2]) for _ in range(ROT)]
            for m in ms:
                x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                for pen in penalties:
                    ext.set_tuning(-1, pen)
                    t = bench_graph(lambda r, x=x, ws=ws, n=n: torch.ops.qerl.nvfp4_gemm(
                        x, ws[r % ROT].qweight, ws[r % ROT].qscale, gs, None, n, 1), reps=10)
                    totals[pen] += t or 0.0
            del ws
    for pen, tot in totals.items():
        print(f"# split penalty {pen}: decode GEMMs total {tot:.4f} ms", flush=True)
    best = min(totals, key=totals.get)
    ext.set_tuning(-1, best)
    return {"split_penalty": best, "totals_ms": totals}


def measure_shape(mname: str, lname: str, n: int, k: int, ms: list[int], iters: int, bnb_mods) -> list[dict]:
    """All methods, eager and graph, for one GEMM shape over ms (weights rotate over ROT sets)."""
    ext = kernels.extension()
    w_bf16 = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(ROT)]
    q4 = [random_nvfp4(n, k) for _ in range(ROT)]
    rws = [kernels.repack(p, s) for p, s, _ in q4]
    gss = [g for _, _, g in q4]
    nf4 = [bnb_mods[1].quantize_4bit(w, quant_type="nf4", blocksize=64) for w in w_bf16] if bnb_mods else None

    def ours(mode: int, x: torch.Tensor):  # noqa: ANN202
        return lambda r: torch.ops.qerl.nvfp4_gemm(
            x, rws[r % ROT].qweight, rws[r % ROT].qscale, gss[r % ROT], None, n, mode)

    recs = []
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        fns = {
            "bf16": lambda r, x=x: F.linear(x, w_bf16[r % ROT]),
            "ours": ours(0, x),
            "kernel": ours(1, x),
            "dqmm": ours(2, x),
        }
        if m >= 256:
            fns["dqmm_sliced"] = ours(3, x)
        if bnb_mods:
            xb = x.unsqueeze(0) if m == 1 else x
            fns["nf4"] = lambda r, xb=xb: bnb_mods[0].matmul_4bit(
                xb, nf4[r % ROT][0].t(), quant_state=nf4[r % ROT][1])
        rec = {"model": mname, "layer": lname, "N": n, "K": k, "M": m, "splits": int(ext.splits_for(m, n, k))}
        for key, fn in fns.items():
            if key == "kernel" and m > 1024:
                continue  # the fused kernel is not meant for these sizes (and is slow there)
            rec[f"{key}_eager_ms"] = round(bench_eager(fn, iters), 5)
            g = bench_graph(fn, reps=iters)
            rec[f"{key}_graph_ms"] = round(g, 5) if g is not None else None
        recs.append(rec)
    return recs


def repro_throw() -> int:
    """Call the op with a shape it must refuse; print the error (run under cuda-gdb if it crashes)."""
    kernels.load_extension()
    packed, scale, gs = random_nvfp4(64, 256)
    rw = kernels.repack(packed, scale)
    try:
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 128, device=DEV).to(torch.bfloat16), rw.qweight, rw.qscale,
                                  gs, None, 64, 1)
    except RuntimeError as ex:
        print("REPRO caught:", str(ex).splitlines()[0][:200])
    try:
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 256, device=DEV).half(), rw.qweight, rw.qscale, gs, None, 64, 1)
    except RuntimeError as ex:
        print("REPRO caught:", str(ex).splitlines()[0][:200])
    print("REPRO done")
    return 0


def profile_run() -> int:
    """One fused-kernel call per decode shape (for ncu), after a warm-up call each."""
    kernels.load_extension()
    gs = torch.tensor([100.0], device=DEV)
    for m, n, k in [(1, 37888, 3584), (1, 3584, 3584), (1, 3584, 18944), (16, 37888, 3584), (64, 37888, 3584)]:
        rw = kernels.repack(*random_nvfp4(n, k)[:2])
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, 1)
        torch.cuda.synchronize()
        torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, 1)
        torch.cuda.synchronize()
    return 0


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


def sass_summary(path: str) -> int:
    """Opcode histogram per kernel of a ``cuobjdump -sass`` listing (instruction mix of the loops)."""
    import collections
    import re

    funcs: dict[str, collections.Counter] = {}
    cur = None
    for line in Path(path).read_text(errors="replace").splitlines():
        mf = re.search(r"Function : (\S+)", line)
        if mf:
            cur = mf.group(1)
            funcs[cur] = collections.Counter()
            continue
        mi = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if cur and mi:
            funcs[cur][mi.group(1)] += 1
    for name, c in funcs.items():
        print(f"{name} ({sum(c.values())} instructions)")
        print("   " + " ".join(f"{op}:{n}" for op, n in c.most_common(28)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default=None, help="summarize a cuobjdump -sass listing and exit")
    ap.add_argument("--repro-throw", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one call per decode shape (run under ncu)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--threshold", type=int, default=-1, help="force the dispatch threshold (M)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.sass:
        return sass_summary(args.sass)
    if args.sanitize:
        return sanitize_run()
    if args.repro_throw:
        return repro_throw()
    if args.profile:
        return profile_run()
    torch.backends.cuda.matmul.allow_tf32 = True
    if not kernels.load_extension(verbose=False):
        print("extension failed:", kernels.cuda_unavailable_reason())
        return 1
    ext = kernels.extension()
    ms = [1, 16, 64, 256, 4096] if args.quick else MS
    iters = 10 if args.quick else 30
    name = torch.cuda.get_device_name()
    out: dict = {
        "device": name,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        "command": "python " + " ".join(sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "rot_weight_sets": ROT,
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

    if not args.no_tune:
        out["split_tuning"] = tune_splits(MODELS, [1, 16, 64])
    if args.threshold >= 0:
        ext.set_tuning(args.threshold, -1)
    out["tuning"] = dict(zip(("gemm_max_m", "split_penalty"), ext.get_tuning(), strict=True))
    print(f"# tuning: {out['tuning']}", flush=True)

    rows = []
    t0 = time.time()
    for mname, cfg in MODELS.items():
        per_m = {m: {} for m in ms}
        counts = {m: {} for m in ms}
        for lname, n, k in layer_shapes(cfg):
            for rec in measure_shape(mname, lname, n, k, ms, iters, bnb_mods):
                rows.append(rec)
                print(json.dumps(rec), flush=True)
                for key, v in rec.items():
                    if key.endswith("_ms") and v is not None:
                        per_m[rec["M"]][key] = per_m[rec["M"]].get(key, 0.0) + v
                        counts[rec["M"]][key] = counts[rec["M"]].get(key, 0) + 1
            torch.cuda.empty_cache()
        nweights = sum(n * k for _, n, k in layer_shapes(cfg))
        for m in ms:
            nl = len(layer_shapes(cfg))  # a sum with a missing layer would mislead: drop it
            lay = {"model": mname, "M": m, "layer": "sum",
                   **{k: round(v, 5) for k, v in per_m[m].items() if counts[m][k] == nl}}
            lay["floor_fp4_ms"] = round(nweights * 0.5625 / (bw * 1e12) * 1e3, 5)
            lay["floor_bf16_bytes_ms"] = round(nweights * 2 / (bw * 1e12) * 1e3, 5)
            lay["floor_compute_ms"] = round(2 * m * nweights / (tf * 1e12) * 1e3, 5)
            rows.append(lay)
    out["rows"] = rows
    out["elapsed_s"] = round(time.time() - t0, 1)

    targets = []
    for r in rows:
        if r["layer"] != "sum":
            continue
        for pred, tgt in TARGETS:
            if pred(r["M"]) and r.get("ours_graph_ms"):
                targets.append({
                    "name": f"{r['model']} M={r['M']} per-layer speedup vs BF16 cuBLAS (CUDA graph timing)",
                    "measured": round(r["bf16_graph_ms"] / r["ours_graph_ms"], 3), "op": ">=", "target": tgt,
                })
    out["targets"] = targets

    dev_tag = name.lower().replace("nvidia", "").strip().split()[0] if name else "gpu"
    path = Path(args.out) if args.out else Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    path = path / f"kernel-{dev_tag}.json" if path.is_dir() or not path.suffix else path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"# wrote {path}")

    print(f"\n# {name}; per decoder layer (qkv+o+gate_up+down), ms; ratio = bf16 / method (higher is better)")
    print(f"{'model':12s} {'M':>5s} | {'bf16 g':>8s} {'ours g':>8s} {'x':>5s} | {'bf16 e':>8s} {'ours e':>8s} "
          f"{'x':>5s} | {'kern g':>8s} {'dqmm g':>8s} {'nf4 g':>8s} {'x nf4':>5s} | {'fp4 floor':>9s}")
    for r in rows:
        if r["layer"] != "sum":
            continue

        def f(key: str, r=r) -> str:
            v = r.get(key)
            return f"{v:8.4f}" if v else f"{'-':>8s}"

        def ratio(a: str, b: str, r=r) -> str:
            return f"{r[a] / r[b]:5.2f}" if r.get(a) and r.get(b) else f"{'-':>5s}"

        print(f"{r['model']:12s} {r['M']:5d} | {f('bf16_graph_ms')} {f('ours_graph_ms')} "
              f"{ratio('bf16_graph_ms', 'ours_graph_ms')} | {f('bf16_eager_ms')} {f('ours_eager_ms')} "
              f"{ratio('bf16_eager_ms', 'ours_eager_ms')} | {f('kernel_graph_ms')} {f('dqmm_graph_ms')} "
              f"{f('nf4_graph_ms')} {ratio('bf16_graph_ms', 'nf4_graph_ms')} | {r['floor_fp4_ms']:9.4f}")
    rec_thr = {}
    for mname in MODELS:
        faster = [r["M"] for r in rows if r["layer"] == "sum" and r["model"] == mname
                  and r.get("kernel_graph_ms") and r.get("dqmm_graph_ms") and r["kernel_graph_ms"] < r["dqmm_graph_ms"]]
        rec_thr[mname] = max(faster) if faster else 0
    out["recommended_gemm_max_m"] = rec_thr
    path.write_text(json.dumps(out, indent=1))
    print(f"# fused kernel faster than dequant+cuBLAS up to M = {rec_thr} (dispatch threshold now "
          f"{out['tuning']['gemm_max_m']:.0f})")
    met = sum(t["measured"] >= t["target"] for t in targets)
    print(f"# targets met: {met}/{len(targets)}")
    for t in targets:
        print(f"#  {'MET ' if t['measured'] >= t['target'] else 'MISS'} {t['name']}: {t['measured']} >= {t['target']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
