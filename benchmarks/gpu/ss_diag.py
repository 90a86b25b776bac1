"""DIAGNOSTIC (temporary): time the wgmma SS kernel with parts switched off (QERL_SS_DEBUG bits: 1 no dequant fence,
2 no decode, 4 no wgmma, 8 no weight loads) on the 7B gate_up GEMM at M = 64 and 1024; prints us per call."""

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from verl_qerl import kernels  # noqa: E402

kernels.load_extension()
dev = "cuda"
n, k = 37888, 3584
packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
scale = torch.randint(1, 0x58, (n, k // 16), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
rw = kernels.repack(packed, scale)
gs = torch.tensor([100.0], device=dev)
for m in (64, 1024):
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    for dbg in (0, 1, 2, 3, 4, 6, 8, 12):
        os.environ["QERL_SS_DEBUG"] = str(dbg)
        f = lambda: torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, 8)  # noqa: E731
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            f()
        b.record()
        torch.cuda.synchronize()
        print(f"M={m} dbg={dbg:2d}: {a.elapsed_time(b) / 20 * 1000:8.1f} us", flush=True)
