"""Runs ``qerl::nvfp4_gemm_lora`` twice at one shape (the decode test's: N = 768, K = 2048, three slices, rank 32),
for compute-sanitizer: ``compute-sanitizer --tool racecheck python3 benchmarks/racecheck/fused_once.py M MODE SPLITS``
(MODE 0 auto, 1 split-K; SPLITS 0 auto). No profiler: under the sanitizer it sees no kernels."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")

from test_lora_fused_gpu import fused, lora_operands, rand_nvfp4  # noqa: E402

from verl_qerl import kernels  # noqa: E402


def main() -> None:
    m, mode, splits = (int(a) for a in sys.argv[1:4])
    if not kernels.load_extension(verbose=False):
        raise SystemExit(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")
    n, k, bounds, rank = 768, 2048, [0, 512, 640, 768], 32
    packed, scale, gs = rand_nvfp4(n, k, seed=1)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    shrunk, lora_b, mask = lora_operands(m, n, bounds, rank, seed=m)
    a = fused(x, rw, gs, None, n, shrunk, lora_b, mask, bounds, mode, splits)
    b = fused(x, rw, gs, None, n, shrunk, lora_b, mask, bounds, mode, splits)
    torch.cuda.synchronize()
    print(f"M={m} mode={mode} splits={splits} ({kernels.extension().gemm_choice(m, n, k, mode)}): "
          f"repeat bit-identical {bool(torch.equal(a, b))}, finite {bool(torch.isfinite(a).all())}")


if __name__ == "__main__":
    main()
