"""What the GPU tests do alike: poison the next output allocation, capture a call into a CUDA graph, list the
kernels a call launches."""

from __future__ import annotations

from collections.abc import Callable

import torch


def poison(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> None:
    """Leave a NaN-filled block in the caching allocator for the next allocation of this size (an op that leaves
    part of its output unwritten then shows NaN)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.fill_(float("nan"))
    del t


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run ``fn`` once on a side stream (lazy initialisation, workspaces, Triton compiles happen outside the
    capture), then capture it; returns the graph and the output tensor its replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def kernels_launched(fn: Callable[[], object]) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches, in order (after a warm-up call: Triton compiles, lazy init)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
