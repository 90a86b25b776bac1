"""Runs ``qerl::nvfp4_gemm_lora`` (or, with OP ``linear``, ``qerl::nvfp4_lora_linear``: the shrink in the GEMM's launch)
twice at one shape (the decode test's: N = 768, K = 2048, three slices, rank 32), for compute-sanitizer:
``compute-sanitizer --tool racecheck python3 benchmarks/racecheck/fused_once.py M MODE SPLITS [OP]`` (MODE 0 auto, 1
split-K; SPLITS 0 auto; OP ``gemm_lora`` (default) or ``linear``). No profiler: under the sanitizer it sees no
kernels."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")

from test_lora_fused_gpu import fused, lora_operands  # noqa: E402

from verl_qerl import kernels  # noqa: E402
from verl_qerl.testing.nvfp4_random import random_nvfp4  # noqa: E402


def main() -> None:
    m, mode, splits = (int(a) for a in sys.argv[1:4])
    op = sys.argv[4] if len(sys.argv) > 4 else "gemm_lora"
    if op not in ("gemm_lora", "linear"):
        raise SystemExit(f"OP must be gemm_lora or linear, got {op!r}")
    if not kernels.load_extension(verbose=False):
        raise SystemExit(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")
    n, k, bounds, rank = 768, 2048, [0, 512, 640, 768], 32
    packed, scale, gs = random_nvfp4(n, k, seed=1)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    shrunk, lora_b, mask = lora_operands(m, n, bounds, rank, seed=m)
    lora_a = (torch.randn(3 * rank, k, device="cuda") / k**0.5).to(torch.bfloat16)

    def run() -> torch.Tensor:
        if op == "linear":
            return torch.ops.qerl.nvfp4_lora_linear(x, rw.qweight, rw.qscale, gs, None, n, lora_a, lora_b, mask,
                                                    bounds, mode, splits)
        return fused(x, rw, gs, None, n, shrunk, lora_b, mask, bounds, mode, splits)

    a, b = run(), run()
    torch.cuda.synchronize()
    in_launch = op == "linear" and bool(kernels.extension().lora_shrink_in_launch_runs(m, n, k, mode))
    choice = kernels.extension().gemm_choice(m, n, k, mode)
    print(f"M={m} mode={mode} splits={splits} op={op} ({choice}, shrink in launch {in_launch}): repeat "
          f"bit-identical {bool(torch.equal(a, b))}, finite {bool(torch.isfinite(a).all())}")


if __name__ == "__main__":
    main()
