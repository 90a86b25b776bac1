"""The results side of ``benchmarks/kernel.py``: per-layer sums of the timed GEMM rows, the targets, the stream-K
rule's calibration, the result file's name and the printed per-layer table.

Kept apart from the timing loop because none of it launches anything: it reads plain row dicts, so every number
the results JSON derives from the timings can be checked on a CPU from made-up rows.
"""

from __future__ import annotations

from pathlib import Path

from verl_qerl import kernels

#: the issue's table (and the only models whose rows become targets)
DEFAULT_MODELS = ("qwen2.5-7b", "qwen2.5-32b")
TARGETS = [  # (M predicate, target ratio vs bf16), issue 18's per-layer targets on the H200
    (lambda m: m <= 16, 2.5),
    (lambda m: m == 64, 2.0),
    (lambda m: m == 128, 1.5),
    (lambda m: m == 256, 1.0),
    (lambda m: m >= 1024, 0.95),
]
MARLIN_TARGET = 1.0  # ours per-layer speedup vs vLLM's Marlin FP4, every M (issue 3 stretch) ...
MARLIN_TARGET_RL = 1.5  # ... and issue 18's, at the M rollouts decode at (MARLIN_RL_MS)
MARLIN_RL_MS = range(64, 257)


def marlin_target(m: int) -> float:
    """The per-layer speedup over vLLM's Marlin FP4 that M must reach: issue 18's 1.5x for M = 64-256, else 1.0x."""
    return MARLIN_TARGET_RL if m in MARLIN_RL_MS else MARLIN_TARGET


def sum_layers(recs: list[dict], nlayers: int) -> dict[int, dict[str, float]]:
    """Per M, the sum over the layer's GEMMs of every ``*_ms`` value; a key some GEMM lacks is dropped
    (a sum with a missing layer would mislead)."""
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, dict[str, int]] = {}
    for rec in recs:
        m = rec["M"]
        for key, v in rec.items():
            if key.endswith("_ms") and v is not None:
                sums.setdefault(m, {})[key] = sums.setdefault(m, {}).get(key, 0.0) + v
                counts.setdefault(m, {})[key] = counts.setdefault(m, {}).get(key, 0) + 1
    return {m: {k: round(v, 5) for k, v in d.items() if counts[m][k] == nlayers} for m, d in sums.items()}


def build_targets(rows: list[dict]) -> list[dict]:
    """Targets on the per-layer ("sum") rows: speedup vs BF16 cuBLAS per M band, and (where the Marlin
    column was measured) speedup vs vLLM's Marlin FP4 at every M (:func:`marlin_target`)."""
    targets = []
    rows = [r for r in rows if r["model"] in DEFAULT_MODELS]
    for r in rows:
        if r["layer"] != "sum" or not r.get("ours_graph_ms"):
            continue
        for pred, tgt in TARGETS:
            if pred(r["M"]) and r.get("bf16_graph_ms"):
                targets.append({
                    "name": f"{r['model']} M={r['M']} per-layer speedup vs BF16 cuBLAS (CUDA graph timing)",
                    "measured": round(r["bf16_graph_ms"] / r["ours_graph_ms"], 3), "op": ">=", "target": tgt,
                })
    for r in rows:
        if r["layer"] == "sum" and r.get("ours/marlin") is not None:
            targets.append({
                "name": f"{r['model']} M={r['M']} per-layer speedup vs vLLM Marlin FP4 (CUDA graph timing)",
                "measured": r["ours/marlin"], "op": ">=", "target": marlin_target(r["M"]),
            })
    return targets


def device_tag(name: str | None) -> str:
    """Short GPU tag for the result file name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'."""
    words = (name or "").lower().replace("nvidia", " ").split()
    tag = "".join(c for c in (words[0] if words else "") if c.isalnum() or c in "-_")
    return tag or "gpu"


def result_path(out_arg: str | None, env_out: str | None, device_name: str | None, default_dir: Path) -> Path:
    """``--out`` (else ``$OUT``, else ``default_dir``); a folder (or a suffix-less path) gets
    ``kernel-<gpu>.json`` so runs on different GPUs write different files."""
    path = Path(out_arg) if out_arg else Path(env_out) if env_out else default_dir
    if path.is_dir() or not path.suffix:
        path = path / f"kernel-{device_tag(device_name)}.json"
    return path


def table_lines(rows: list[dict], device_name: str) -> list[str]:
    """The printed per-layer table (one line per model and M)."""
    lines = [
        f"# {device_name}; per decoder layer (qkv+o+gate_up+down), ms; ratio = bf16 / method (higher is "
        "better); ours/marlin = marlin / ours (CUDA graph)",
        f"{'model':12s} {'M':>5s} | {'bf16 g':>8s} {'ours g':>8s} {'x':>5s} | {'bf16 e':>8s} {'ours e':>8s} "
        f"{'x':>5s} | {'splitk g':>8s} {'dq+cubl g':>9s} {'nf4 g':>8s} {'x nf4':>5s} | {'marlin g':>8s} "
        f"{'o/mar':>5s} | {'fp4 floor':>9s}",
    ]
    for r in rows:
        if r["layer"] != "sum":
            continue

        def f(key: str, r=r) -> str:
            v = r.get(key)
            return f"{v:8.4f}" if v else f"{'-':>8s}"

        def ratio(a: str, b: str, r=r) -> str:
            return f"{r[a] / r[b]:5.2f}" if r.get(a) and r.get(b) else f"{'-':>5s}"

        floor = r.get("floor_fp4_ms")
        lines.append(
            f"{r['model']:12s} {r['M']:5d} | {f('bf16_graph_ms')} {f('ours_graph_ms')} "
            f"{ratio('bf16_graph_ms', 'ours_graph_ms')} | {f('bf16_eager_ms')} {f('ours_eager_ms')} "
            f"{ratio('bf16_eager_ms', 'ours_eager_ms')} | {f('kernel_splitk_graph_ms')} "
            f"{f('dequant_cublas_graph_ms')} "
            f"{f('nf4_graph_ms')} {ratio('bf16_graph_ms', 'nf4_graph_ms')} | {f('marlin_graph_ms')} "
            f"{ratio('marlin_graph_ms', 'ours_graph_ms')} | "
            + (f"{floor:9.4f}" if floor is not None else f"{'-':>9s}"))
    return lines


def streamk_calibration(rows: list[dict], rule: float, rule_stages: float = float("inf")) -> dict:
    """How well auto's rule -- stream-K when tiles >= ``rule`` x CTAs or each CTA's range has >= ``rule_stages``
    K stages (cuda/gemm_route.cpp, ``streamk_pays``) -- picks between the forced kernels on the timed GEMMs.

    Per GEMM row with both ``kernel_splitk_graph_ms`` and ``kernel_streamk_graph_ms``: its tiles per CTA
    (``streamk_tiles`` / ``streamk_grid``, both recorded from the extension when the row was timed), stages per
    CTA (ceil(tiles x K stages / grid)) and which kernel is faster. Returns the points, how many the rule gets
    right, the summed time under the rule vs best-of-both, and the tiles threshold (among the observed values,
    and 0 / inf) that minimizes the summed time on these rows with the stages part of the rule kept.
    """
    pts = []
    for r in rows:
        sp, sk, grid = r.get("kernel_splitk_graph_ms"), r.get("kernel_streamk_graph_ms"), r.get("streamk_grid")
        tiles = r.get("streamk_tiles")
        if r.get("layer") == "sum" or not (sp and sk and grid and tiles):
            continue
        pts.append({"model": r["model"], "layer": r["layer"], "M": r["M"], "tiles_per_cta": round(tiles / grid, 4),
                    "stages_per_cta": -(-tiles * (r["K"] // kernels.K_STAGE) // grid), "splitk_ms": sp,
                    "streamk_ms": sk})

    def picks(p: dict, th: float) -> bool:
        return p["tiles_per_cta"] >= th or p["stages_per_cta"] >= rule_stages

    def total(th: float) -> float:
        return sum(p["streamk_ms"] if picks(p, th) else p["splitk_ms"] for p in pts)

    cands = sorted({0.0, float("inf"), *(p["tiles_per_cta"] for p in pts)})
    best = min(cands, key=lambda th: (total(th), th))
    right = sum(picks(p, rule) == (p["streamk_ms"] < p["splitk_ms"]) for p in pts)
    return {"rule": rule, "rule_stages": rule_stages, "rule_right": right, "rule_ms": round(total(rule), 5),
            "oracle_ms": round(sum(min(p["splitk_ms"], p["streamk_ms"]) for p in pts), 5),
            "best_threshold": best if best != float("inf") else None, "best_ms": round(total(best), 5),
            "points": sorted(pts, key=lambda p: p["tiles_per_cta"])}
