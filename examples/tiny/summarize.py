"""Print the per-step QeRL metrics of a tiny run (the metrics JSONL verl's file logger wrote)."""

from __future__ import annotations

import json
import sys

KEYS = [
    ("qerl/aqn_stage", "stage", "{:.0f}"),
    ("qerl/aqn_sigma", "sigma", "{:.1e}"),
    ("critic/score/mean", "reward", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("actor/grad_norm", "grad_norm", "{:.3f}"),
    ("training/rollout_probs_diff_max", "|p_vllm-p_actor|max", "{:.1e}"),
    ("timing_s/gen", "gen_s", "{:.1f}"),
    ("timing_s/update_actor", "update_s", "{:.1f}"),
    ("timing_s/step", "step_s", "{:.1f}"),
]


def main(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("step " + " ".join(f"{h:>20}" for _, h, _ in KEYS))
    for r in rows:
        d = r["data"]
        cells = [fmt.format(d[k]) if k in d else "-" for k, _, fmt in KEYS]
        print(f"{r['step']:>4} " + " ".join(f"{c:>20}" for c in cells))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
