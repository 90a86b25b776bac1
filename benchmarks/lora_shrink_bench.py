"""The LoRA shrink alone, on one GPU: ``qerl::lora_shrink``'s Triton kernel vs cuBLAS (``F.linear``) per token count.

For 7B's shrink shapes (K = 3584 with R = 32 / 64 / 96: o, gate_up, qkv; K = 18944 with R = 32: down) and
T = 1..256, each implementation is captured ``--calls`` times into one CUDA graph (what a decode step replays) and
the graph replayed ``--repeats`` times: microseconds per call, median. Besides the launcher's own tile choice
(``triton``) it times a few forced tiles (``--sweep``) so the tile heuristic can be checked, and prints the largest
T at which the Triton kernel beats cuBLAS on every shape: the value ``lora_shrink.TRITON_MAX_TOKENS`` should have.
Writes ``lora-shrink-<gpu>.json`` to ``--out`` (default ``$OUT``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from kernel import run_header  # noqa: E402  (device, versions, command, env, date of every kernel benchmark)
from results_format import target_status, write_json  # noqa: E402

from verl_qerl.kernels import lora_shrink as ls  # noqa: E402

SHAPES = {"o": (32, 3584), "gate_up": (64, 3584), "qkv": (96, 3584), "down": (32, 18944)}
SWEEP = list(itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (4, 8)))  # block_t, block_r, num_warps


def graph_us(fn, calls: int, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def triton_version() -> str | None:
    return getattr(ls.triton, "__version__", None)


def triton_wins_up_to(rows: list[dict]) -> int:
    """The largest T such that the Triton kernel is faster than cuBLAS on every shape at every measured T <= it."""
    all_t = sorted({r["T"] for r in rows})
    losing = {r["T"] for r in rows if r["triton_us"] >= r["cublas_us"]}
    best = 0
    for t in all_t:
        if t in losing:
            break
        best = t
    return best


def targets(rows: list[dict], threshold: int) -> list[dict]:
    """What the shipped ``TRITON_MAX_TOKENS`` claims: the kernel runs only where it beats cuBLAS on every shape
    (worst Triton / cuBLAS time ratio at T <= threshold <= 1), and the threshold is no higher than the measured
    crossover."""
    inside = [r["triton_us"] / r["cublas_us"] for r in rows if r["T"] <= threshold]
    return [{"name": f"worst triton/cublas shrink time at T <= {threshold} (all 7B shapes)",
             "measured": max(inside) if inside else None, "op": "<=", "target": 1.0},
            {"name": "TRITON_MAX_TOKENS <= largest T where Triton wins on every shape",
             "measured": threshold, "op": "<=", "target": triton_wins_up_to(rows)}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time forced tiles (slower)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args(argv)
    device = torch.cuda.get_device_name()
    rows = []
    for name, (r, k) in SHAPES.items():
        a = torch.randn(r, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for t in [int(v) for v in args.tokens.split(",")]:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(t, r, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, a).float()
            got = ls.lora_shrink_triton(x, a).float()
            assert (got - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item()), (name, t)
            row = {"shape": name, "T": t, "R": r, "K": k, "config": list(ls.shrink_config(t, r, k)),
                   "triton_us": graph_us(lambda x=x, a=a, y=y: ls.launch_lora_shrink(x, a, y), args.calls,
                                         args.repeats),
                   "cublas_us": graph_us(lambda x=x, a=a: F.linear(x, a), args.calls, args.repeats)}
            if args.sweep:
                sweep = {}
                for bt, br, w in SWEEP:
                    c = ls.ShrinkConfig(bt, br, ls._block_k(bt, br, k, w), w)
                    if bt <= max(1, 2 * t - 1) and br <= r:
                        sweep[",".join(map(str, c))] = graph_us(
                            lambda x=x, a=a, y=y, c=c: ls.launch_lora_shrink(x, a, y, c), args.calls, args.repeats)
                best = min(sweep, key=sweep.get)
                row.update(best_config=best, best_us=sweep[best], sweep_us=sweep)
            rows.append(row)
            print(f"[lora_shrink] {name:8s} T={t:4d} R={r:3d} K={k:6d}: triton {row['triton_us']:7.2f} us "
                  f"{tuple(row['config'])}, cublas {row['cublas_us']:7.2f} us"
                  + (f", best tile {row['best_config']} {row['best_us']:.2f} us" if args.sweep else ""), flush=True)
    max_t = triton_wins_up_to(rows)
    print(f"[lora_shrink] Triton beats cuBLAS on every shape up to T={max_t} "
          f"(TRITON_MAX_TOKENS is {ls.TRITON_MAX_TOKENS})", flush=True)
    header = run_header(device)
    header["versions"]["triton"] = triton_version()
    header["command"] = "python " + " ".join([str(Path(sys.argv[0]))] + (argv if argv is not None else sys.argv[1:]))
    result = {"benchmark": "lora_shrink", **header, "triton_max_tokens": ls.TRITON_MAX_TOKENS,
              "triton_wins_up_to": max_t, "rows": rows, "targets": targets(rows, ls.TRITON_MAX_TOKENS)}
    for t in result["targets"]:
        print(f"[lora_shrink] target {t['name']}: {t['measured']} {t['op']} {t['target']} {target_status(t)}",
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lora-shrink-{device.replace(' ', '-').lower()}.json"
    write_json(path, result)
    print(f"[lora_shrink] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
