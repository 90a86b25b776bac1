"""A quick speed check of the machine a timed run is on, so that runs merged across machines can be checked.

Why: ``grpo_step.py --baseline`` sets one machine's run against another's. On 2026-11-24 a QeRL re-run came back
10-37 % slower in every phase, vLLM's decode included, which the change under test could not touch: the machine was
slower, and nothing in the results said so (benchmarks/NOTES.md). This records, before the run, three fixed
workloads: single-thread Python (start-up, Ray, vLLM's scheduler are CPU-bound), a BF16 GEMM and a device copy
(GPU only). It runs in its own process, so the parent never holds a CUDA context while the timed run measures memory.

    python3 benchmarks/machine_check.py        # prints one JSON line
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: a row's metric this far from the other row's (either way) says the machines differ
MISMATCH = 0.10


def _cpu_ms() -> float:
    def work() -> int:
        return sum(i * i % 7 for i in range(1_000_000))

    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        work()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def median_cuda_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, each between two CUDA events, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def _gpu() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(256 * 2**20, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)

    gemm_ms = median_cuda_ms(lambda: a @ b, 20)
    copy_ms = median_cuda_ms(lambda: y.copy_(x), 20)
    return {"gemm_bf16_tflops": 2 * 8192**3 / (gemm_ms * 1e-3) / 1e12,
            "copy_tbps": 2 * x.numel() * 4 / (copy_ms * 1e-3) / 1e12}


def measure() -> dict:
    """The check in this process: ``cpu_ms`` (lower is faster), and on a GPU ``gemm_bf16_tflops``, ``copy_tbps``."""
    return {"cpu_ms": _cpu_ms(), **_gpu()}


def measure_in_subprocess(timeout: float = 300.0) -> dict:
    """:func:`measure` in a fresh Python process (no CUDA context left in the caller); ``{"error": ...}`` if it
    fails, so that a run is never lost to its check."""
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], capture_output=True, text=True,
                              timeout=timeout)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001 - the check is informative only
        return {"error": f"{type(exc).__name__}: {exc}"}


def mismatches(a: dict | None, b: dict | None) -> list[str]:
    """How two checks differ beyond :data:`MISMATCH`, one line per metric; a missing check is one line too."""
    if not a or not b or "error" in a or "error" in b:
        return ["no machine check on both rows: whether they ran on equally fast machines is unknown"]
    out = []
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x > 0 and y > 0 and \
                max(x, y) / min(x, y) > 1 + MISMATCH:
            out.append(f"{key}: {x:.4g} vs {y:.4g} ({max(x, y) / min(x, y):.2f}x apart)")
    return out


if __name__ == "__main__":
    print(json.dumps(measure()))
