"""The LoRA expand alone, on one GPU, as a CUDA graph replays it: ``qerl::lora_expand``'s Triton kernel (one launch:
expand, token mask, residual add) vs the cuBLAS route (the mask's multiply, then ``addmm``), per token count.

Why: from ``lora_expand.CUBLAS_MIN_TOKENS`` tokens the expand runs cuBLAS eagerly (the Python op's host time counts
there), but inside a captured graph (``lora_expand.TRITON_CAPTURED_MAX_TOKENS``) it runs the Triton kernel; this
measures whether that pays on the device. 7B's four expand shapes (out [T, N], block-diagonal B of the fused slices,
R = 96 / 32 / 64 / 32 for qkv / o / gate_up / down), each implementation captured ``--calls`` times into one graph
and replayed ``--repeats`` times: microseconds per call, median. Writes ``lora-expand-<gpu>.json`` to ``--out``
(default ``$OUT``) with a target per token count: the Triton kernel's time per 7B layer set over cuBLAS's <= 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from kernel import run_header  # noqa: E402  (device, versions, command, env, date of every kernel benchmark)
from lora_shrink_bench import graph_us  # noqa: E402
from results_format import report_and_write  # noqa: E402

from verl_qerl.kernels import lora_expand as le  # noqa: E402

#: 7B: layer -> (N, slice bounds); rank 32 per slice
SHAPES = {"qkv": (4608, [0, 3584, 4096, 4608]), "o": (3584, [0, 3584]), "gate_up": (37888, [0, 18944, 37888]),
          "down": (3584, [0, 3584])}
RANK = 32


def operands(t: int, n: int, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [t, n], shrunk [t, S*R], b_t [S*R, n] (the transpose view of the block-diagonal B), mask [t, 1]."""
    slices = len(bounds) - 1
    out = torch.randn(t, n, device="cuda").to(torch.bfloat16)
    shrunk = (torch.randn(t, slices * RANK, device="cuda") / RANK**0.5).to(torch.bfloat16)
    lora_b = torch.zeros(n, slices * RANK, device="cuda", dtype=torch.bfloat16)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        lora_b[lo:hi, i * RANK:(i + 1) * RANK] = torch.randn(hi - lo, RANK, device="cuda").to(torch.bfloat16)
    mask = torch.ones(t, 1, device="cuda", dtype=torch.bfloat16)
    return out, shrunk, lora_b.t(), mask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,256,512")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or le.triton is None:
        print("lora_expand_bench: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    rows, targets = [], []
    for t in [int(v) for v in args.tokens.split(",") if v]:
        tri_sum = cub_sum = 0.0
        for layer, (n, bounds) in SHAPES.items():
            ops = operands(t, n, bounds)
            tri = graph_us(lambda ops=ops: le.lora_expand_triton(*ops), args.calls, args.repeats)
            cub = graph_us(lambda ops=ops: le.lora_expand_torch(*ops), args.calls, args.repeats)
            got, ref = le.lora_expand_triton(*ops), le.lora_expand_torch(*ops)
            err = float((got.float() - ref.float()).abs().max())
            rows.append({"tokens": t, "layer": layer, "N": n, "rank": RANK * (len(bounds) - 1),
                         "triton_us": round(tri, 3), "cublas_us": round(cub, 3), "max_abs_diff": err})
            print(json.dumps(rows[-1]), flush=True)
            tri_sum += tri
            cub_sum += cub
        targets.append({"name": f"T={t}: Triton / cuBLAS expand time per 7B layer set, in a CUDA graph",
                        "measured": round(tri_sum / cub_sum, 3), "op": "<=", "target": 1.0})
        print(f"T={t}: per 7B layer set Triton {tri_sum:.1f} us, cuBLAS (mask multiply + addmm) {cub_sum:.1f} us",
              flush=True)
    name = torch.cuda.get_device_name()
    header = run_header(name)
    header["versions"]["triton"] = getattr(le.triton, "__version__", None)
    res = {**header, "cublas_min_tokens": le.CUBLAS_MIN_TOKENS,
           "triton_captured_max_tokens": le.TRITON_CAPTURED_MAX_TOKENS, "rows": rows, "targets": targets}
    report_and_write(Path(args.out) / f"lora-expand-{name.replace(' ', '-').lower()}.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
