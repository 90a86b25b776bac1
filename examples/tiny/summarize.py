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


def format_table(rows: list[dict]) -> list[str]:
    """One line per step, each column as wide as its widest cell (header included), right-aligned."""
    header = ["step"] + [h for _, h, _ in KEYS]
    body = [[str(r["step"])] + [fmt.format(r["data"][k]) if k in r["data"] else "-" for k, _, fmt in KEYS]
            for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [header, *body]]


def main(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    for line in format_table(rows):
        print(line)
    return 0 if rows else 1

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
