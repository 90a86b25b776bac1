"""A kernel candidate against HEAD from interleaved timings: per GEMM and per layer, each tree's runs and the change
of the means (``benchmarks/gpu/candidate_ab.sh`` writes the runs in the order HEAD, candidate, candidate, HEAD, so
clock drift over the call shows as a spread between a tree's own runs rather than as a change)::

    python3 benchmarks/kernel_ab.py --head h1.json h2.json --cand c1.json c2.json [--variant wgmma_rs]

Inputs are ``benchmarks/kernel.py`` results (their ``rows``); the column compared is ``kernel_<variant>_graph_ms``
(a forced kernel: ``ours`` follows the dispatch table, which may pick different kernels in the two trees).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

Key = tuple[str, str, int]


def load_rows(path: str | Path) -> dict[Key, dict]:
    """kernel.py's rows by (model, layer, M); a file without rows is an error naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as exc:  # not JSON (OSError, e.g. a missing file, already names it)
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows:
        raise ValueError(f"{path}: no 'rows' (not a benchmarks/kernel.py results file?)")
    return {(r["model"], r["layer"], int(r["M"])): r for r in rows}


def compare(head: list[dict[Key, dict]], cand: list[dict[Key, dict]], variant: str = "wgmma_rs") -> list[dict]:
    """One entry per (model, layer, M) present in every run: each tree's times (us), the means' change in percent,
    and BF16 cuBLAS's time from the first HEAD run."""
    col = f"kernel_{variant}_graph_ms"
    runs = head + cand
    keys = sorted(set.intersection(*(set(r) for r in runs)))
    out = []
    for key in keys:
        if any(col not in r[key] for r in runs):
            raise ValueError(f"{key}: no {col} in every run (time the variant with --variants ...,{variant})")
        hv = [r[key][col] * 1e3 for r in head]
        cv = [r[key][col] * 1e3 for r in cand]
        hm, cm = sum(hv) / len(hv), sum(cv) / len(cv)
        bf16 = head[0][key].get("bf16_graph_ms")
        out.append({"model": key[0], "layer": key[1], "M": key[2], "head_us": hv, "cand_us": cv,
                    "change_pct": 100.0 * (cm / hm - 1.0), "bf16_us": bf16 * 1e3 if bf16 else None})
    return out


def format_table(entries: list[dict], variant: str = "wgmma_rs") -> str:
    lines = [f"forced {variant}, us: HEAD runs -> candidate runs, change of the means; bf16 = cuBLAS (first HEAD run)"]
    for e in entries:
        head = " ".join(f"{v:8.1f}" for v in e["head_us"])
        cand = " ".join(f"{v:8.1f}" for v in e["cand_us"])
        bf16 = f"  bf16 {e['bf16_us']:8.1f}" if e["bf16_us"] is not None else ""
        change = f"{e['change_pct']:+5.1f} %"
        lines.append(f"{e['model']:12s} {e['layer']:8s} M={e['M']:5d}  {head} -> {cand}  {change}{bf16}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", nargs="+", required=True, help="kernel.py results of HEAD's tree")
    ap.add_argument("--cand", nargs="+", required=True, help="kernel.py results of the candidate's tree")
    ap.add_argument("--variant", default="wgmma_rs", help="the forced kernel compared (default wgmma_rs)")
    args = ap.parse_args(argv)
    try:
        entries = compare([load_rows(p) for p in args.head], [load_rows(p) for p in args.cand], args.variant)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(format_table(entries, args.variant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
