"""``benchmarks/kernel.py --sweep-splits 1,2,3,4,6,8,12,16``: the split-K kernel at decode M timed at each split count
of the list, next to the count the heuristic picks (``pick_splits`` in cuda/gemm_route.cpp), per GEMM of a decoder
layer, in one run.

Why: at M <= 16 the kernel moves its FP4 bytes at about half the rate cuBLAS moves BF16 ones (7B gate_up at M = 1:
2.2 vs 3.7 TB/s; benchmarks/NOTES.md, "SASS census"), and the small GEMMs sit at ~4x their byte floor. The heuristic
balances CTAs over SMs as if one CTA per SM were resident, while the small-M kernel keeps two (its launch bounds):
under a two-slot model gate_up would take 4 splits instead of 2, qkv 7 instead of 3. Which model is right is a
measurement, and ``qerl::nvfp4_gemm`` takes the split count as an argument, so the sweep needs no code change.

Results: one JSON (``split-sweep-<gpu>.json``) with the rows (per model, layer, M: ms per split count, the best and
the heuristic's), the per-layer sums and as ``targets`` the heuristic's layer time over the best one's (<= 1.05: the
heuristic within 5% of the best count the list offers).
"""

from __future__ import annotations

from collections.abc import Callable

#: the heuristic's layer time may exceed the best swept count's by this factor and still count as picking well
HEURISTIC_TOLERANCE = 1.05


def parse_splits(text: str) -> list[int]:
    """``--sweep-splits`` ("1,2,4,8") -> sorted distinct positive split counts; anything else raises ValueError
    naming the option and the bad items."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if not v.isdigit() or int(v) < 1]
    if bad or not items:
        raise ValueError(f"--sweep-splits: expected a comma list of positive integers, got {text!r} (bad: {bad})")
    return sorted({int(v) for v in items})


def candidate_splits(swept: list[int], stages: int, heuristic: int) -> list[int]:
    """The counts timed for one GEMM: the swept ones the kernel can run (at most one split per K stage) and the
    heuristic's own pick, so its time is always measured in the same run."""
    return sorted({s for s in swept if s <= stages} | {heuristic})


def sweep_row(model: str, layer: str, m: int, n: int, k: int, times_ms: dict[int, float | None],
              heuristic: int) -> dict:
    """One GEMM's record: ms per split count (None where the graph could not be timed), the best count, the
    heuristic's count and its time over the best."""
    timed = {s: t for s, t in times_ms.items() if t is not None}
    if heuristic not in timed:
        raise ValueError(f"{model} {layer} M={m}: the heuristic's split count {heuristic} was not timed")
    best = min(timed, key=lambda s: (timed[s], s))
    return {"model": model, "layer": layer, "M": m, "N": n, "K": k,
            "ms": {str(s): round(t, 5) for s, t in sorted(timed.items())},
            "best_splits": best, "best_ms": round(timed[best], 5),
            "heuristic_splits": heuristic, "heuristic_ms": round(timed[heuristic], 5),
            "heuristic_over_best": round(timed[heuristic] / timed[best], 3)}


def layer_sums(rows: list[dict]) -> list[dict]:
    """Per model and M, the decoder layer's GEMM time with the heuristic's counts and with the best ones."""
    out: dict[tuple[str, int], dict] = {}
    for r in rows:
        s = out.setdefault((r["model"], r["M"]), {"model": r["model"], "M": r["M"], "gemms": 0,
                                                   "heuristic_ms": 0.0, "best_ms": 0.0})
        s["gemms"] += 1
        s["heuristic_ms"] += r["heuristic_ms"]
        s["best_ms"] += r["best_ms"]
    for s in out.values():
        s["heuristic_ms"], s["best_ms"] = round(s["heuristic_ms"], 5), round(s["best_ms"], 5)
        s["heuristic_over_best"] = round(s["heuristic_ms"] / s["best_ms"], 3)
    return list(out.values())


def sweep_targets(sums: list[dict]) -> list[dict]:
    return [{"name": f"{s['model']} M={s['M']}: layer with the heuristic's split counts / with the best swept ones",
             "measured": s["heuristic_over_best"], "op": "<=", "target": HEURISTIC_TOLERANCE} for s in sums]


def run_sweep(models: dict, ms: list[int], swept: list[int],
              time_gemm: Callable[[int, int, int, int], float | None],
              heuristic_splits: Callable[[int, int, int], int],
              layer_shapes: Callable[[dict], list[tuple[str, int, int]]], stage_k: int) -> list[dict]:
    """Every (model, layer, M): ``time_gemm(m, n, k, splits)`` (graph ms) for each candidate count. The timing and
    the heuristic come from the caller (kernel.py: the extension and its CUDA-graph timer), so this loop runs
    without a GPU in the tests."""
    rows = []
    for mname, cfg in models.items():
        for lname, n, k in layer_shapes(cfg):
            for m in ms:
                pick = heuristic_splits(m, n, k)
                times = {s: time_gemm(m, n, k, s) for s in candidate_splits(swept, k // stage_k, pick)}
                row = sweep_row(mname, lname, m, n, k, times, pick)
                print(f"# splits {mname} {lname} M={m}: " + " ".join(f"{s}:{t}" for s, t in row["ms"].items())
                      + f" | best {row['best_splits']}, heuristic {pick} ({row['heuristic_over_best']}x)", flush=True)
                rows.append(row)
    return rows
