"""``qerl::lora_shrink(x, a) -> x @ a^T``: a LoRA shrink as one kernel launch at decode token counts.

The single-adapter LoRA path (``verl_qerl.vllm.lora_fast_path``) runs, per linear layer, the shrink ``x @ A^T``
(``x`` [T, K] activations, ``A`` [R, K] the concatenated LoRA A of the layer's fused slices) and then
``qerl::lora_expand``. At decode, T is 1..64 and R = 32..96 while K is the layer's input size (3584, or 18944 for a
7B down projection): cuBLAS runs that skinny GEMM as a split-K kernel plus a split-K reduce kernel, two launches of
a few microseconds each for work that moves ~1 MB. Here it is one Triton kernel with no second pass: each program
owns a ``BLOCK_T x BLOCK_R`` tile of the output (down to 1 x 1, so T = 1, R = 32 already gives 32 programs) and
loops over all of K, loading the next K block before reducing the current one (the loads of one block are in
flight while the previous one is multiplied), accumulating in float32 and storing once in ``x``'s dtype. No
split-K partials, atomics or pre-zeroed buffers: the output is one shape-determined ``torch.empty``, so the op
captures into CUDA graphs and, being a registered op with a fake impl, traces under torch.compile.

Above :data:`TRITON_MAX_TOKENS` tokens the op calls cuBLAS (``F.linear``) itself, except where :func:`triton_wins`
(up to 64 tokens, short K, a small output): without split-K the kernel's parallelism is the number of output tiles,
and beyond that cuBLAS's tensor-core GEMM (its two launches amortised over real work) is the faster one.
``QERL_LORA_SHRINK=auto|triton|cublas`` (default ``auto``) forces one side on CUDA, for measurements. CPU tensors,
or CUDA without Triton, use ``F.linear``.

The kernel does not signal programmatic dependent launch (``signal_next`` is for tests): measured on an H200
(``benchmarks/lora_gemm_bench.py``, NOTES "Sixth round"), a GEMM launched while the shrink ran could not place all
of its CTAs beside the shrink's programs and finished later than after a plain launch (7B layer at one token: shrink
+ GEMM 27.8 us over the base GEMM with the signal, 20.9 without). The fast path's GEMM still goes out with ``pdl``
and starts as the shrink's programs exit.

Shapes: x [T, K], a [R, K], any strides (vLLM's concatenated A is a contiguous [R, K] view); same floating dtype
(bfloat16, float16, float32) and device. Returns [T, R] in that dtype.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .op_library import LIB_NAME, library, tl, triton

try:  # Triton >= 3.4: grid dependency control (programmatic dependent launch, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - depends on the Triton version
    gdc_launch_dependents = None

_lib = library()
_lib.define("lora_shrink(Tensor x, Tensor a) -> Tensor")

#: Largest token count T for which the op runs the Triton kernel on CUDA (``auto`` mode); above it, cuBLAS.
#: Why a threshold: the kernel has no split-K, so its parallelism is ``ceil(T / BLOCK_T) * ceil(R / BLOCK_R)``
#: programs, each streaming ``(BLOCK_T + BLOCK_R) * K`` elements, and the bytes per program grow with the tile.
#: Measured on an H200 (``benchmarks/lora_shrink_bench.py --sweep``, CUDA graphs, the four 7B shapes): the kernel
#: takes 1.5-3.1 us at T = 1 against cuBLAS's 5.6 us (split-K GEMM + reduce), and wins on every shape up to T = 16;
#: at T = 32 the down projection (K = 18944) is already slower (7.5 vs 6.6 us), at T = 64 every shape but o.
TRITON_MAX_TOKENS = 16

#: Up to :data:`TRITON_WIDE_MAX_TOKENS` tokens the kernel still beats cuBLAS where K and the output are small
#: (:func:`triton_wins`): measured on an H200 (``benchmarks/shrink_ablation.py`` on branch ``next/shrink-cluster``,
#: CUDA graphs, NOTES "Tenth round"), us Triton vs cuBLAS at T = 32: qkv (K 3584, R 96) 4.72 vs 6.10, o (R 32) 2.57
#: vs 6.04, gate_up (R 64) 3.79 vs 6.08, down (K 18944) 7.38 vs 6.32; at T = 64: qkv 6.69 vs 6.15, o 3.75 vs 6.08,
#: gate_up 5.10 vs 6.08, down 13.0 vs 6.39. Its programs each loop over all of K for a tile of the T x R output, so
#: its time grows with K and with T x R; cuBLAS's pair stays at ~6 us.
TRITON_WIDE_MAX_TOKENS = 64
TRITON_WIDE_MAX_K = 4096
TRITON_WIDE_MAX_OUTPUTS = 4096  # T x R


def triton_wins(t: int, r: int, k: int) -> bool:
    """Whether ``auto`` runs the Triton kernel for a ``t``-token shrink into ``r`` ranks over ``k`` inputs: up to
    :data:`TRITON_MAX_TOKENS` tokens always; up to :data:`TRITON_WIDE_MAX_TOKENS` where ``k`` and ``t * r`` are small
    (the measured shapes above). The C++ fused op (``shrink_triton_wins`` in cuda/qerl_torch.cpp) applies the same
    rule, so both routes run the same kernel and give the same bits."""
    if t <= TRITON_MAX_TOKENS:
        return True
    return t <= TRITON_WIDE_MAX_TOKENS and k <= TRITON_WIDE_MAX_K and t * r <= TRITON_WIDE_MAX_OUTPUTS

#: ``QERL_LORA_SHRINK``: ``auto`` (Triton where :func:`triton_wins`, cuBLAS elsewhere), ``triton`` (always the
#: kernel), ``cublas`` (always ``F.linear``). Read at every call on CUDA (a CUDA graph keeps what it captured).
SHRINK_ENV = "QERL_LORA_SHRINK"
SHRINK_MODES = ("auto", "triton", "cublas")

_TILE_SIZES = (1, 2, 4, 8, 16)
_NUM_WARPS = 4
#: Per-thread budgets that set BLOCK_K for a tile: elements of x and a loaded per K block (held twice: the block
#: being reduced and the next one in flight), and products formed per K block before the in-thread sums.
_LOADS_PER_THREAD = 64
_PRODUCTS_PER_THREAD = 128
_MIN_BLOCK_K = 16
_MAX_BLOCK_K = 4096
# Rough per-SM figures (H100 / H200 class) used only to rank tile shapes against each other: bytes loaded per
# cycle from L2, fp32 FMAs per cycle, cycles to reduce one output element across the program's threads, and the
# latency of one K block's loads (the part a single program per SM cannot hide).
_SM_BYTES_PER_CYCLE = 64
_SM_FMA_PER_CYCLE = 128
_REDUCE_CYCLES_PER_OUTPUT = 16
_LOAD_LATENCY_CYCLES = 600
_DEFAULT_SM_COUNT = 132


class ShrinkConfig(NamedTuple):
    """One launch configuration: output tile ``block_t x block_r``, K block, warps per program."""

    block_t: int
    block_r: int
    block_k: int
    num_warps: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _block_k(block_t: int, block_r: int, k: int, num_warps: int) -> int:
    threads = 32 * num_warps
    bk = min(_pow2_floor(_LOADS_PER_THREAD * threads // (block_t + block_r)),
             _pow2_floor(_PRODUCTS_PER_THREAD * threads // (block_t * block_r)), _MAX_BLOCK_K, _pow2_ceil(k))
    return max(_MIN_BLOCK_K, bk)


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def shrink_config(t: int, r: int, k: int, sm_count: int | None = None, elem_bytes: int = 2) -> ShrinkConfig:
    """The tile the launcher uses for ``[t, k] x [r, k]^T``: the one with the least estimated time on
    ``sm_count`` SMs (the current CUDA device's, else 132), from load bytes, FMAs, per-block reductions and the
    unhidden load latency of a program's K loop. Small T gets small tiles (T = 1: one program per rank row)."""
    if sm_count is None:
        sm_count = _sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else _DEFAULT_SM_COUNT
    best: tuple[float, ShrinkConfig] | None = None
    for bt in _TILE_SIZES:
        if bt > _pow2_ceil(t):
            break
        for br in _TILE_SIZES:
            if br > _pow2_ceil(r):
                break
            bk = _block_k(bt, br, k, _NUM_WARPS)
            blocks = _cdiv(k, bk)
            waves = _cdiv(_cdiv(t, bt) * _cdiv(r, br), sm_count)
            per_block = max((bt + br) * bk * elem_bytes / _SM_BYTES_PER_CYCLE, bt * br * bk / _SM_FMA_PER_CYCLE)
            per_block += bt * br * _REDUCE_CYCLES_PER_OUTPUT
            cycles = max(waves * blocks * per_block, blocks * _LOAD_LATENCY_CYCLES)
            if best is None or cycles < best[0]:
                best = (cycles, ShrinkConfig(bt, br, bk, _NUM_WARPS))
    assert best is not None
    return best[1]


def shrink_mode() -> str:
    """The ``QERL_LORA_SHRINK`` setting, validated."""
    mode = os.environ.get(SHRINK_ENV, "auto").strip().lower() or "auto"
    if mode not in SHRINK_MODES:
        raise ValueError(f"{SHRINK_ENV}={mode!r}; expected one of {', '.join(SHRINK_MODES)}")
    return mode


def shrink_impl(t: int, device: torch.device, r: int | None = None, k: int | None = None) -> str:
    """Which implementation the op runs for ``t`` tokens (into ``r`` ranks over ``k`` inputs; without them, the
    token rule alone) on ``device``: ``triton`` (the kernel), ``cublas`` (``F.linear`` on CUDA) or ``torch``
    (``F.linear`` on the CPU)."""
    if device.type != "cuda":
        return "torch"
    mode = shrink_mode()
    if triton is None or mode == "cublas":
        return "cublas"
    if mode == "triton" or t <= TRITON_MAX_TOKENS:
        return "triton"
    if r is not None and k is not None and triton_wins(t, r, k):
        return "triton"
    return "cublas"


def _check(x: torch.Tensor, a: torch.Tensor) -> None:
    if x.dim() != 2 or a.dim() != 2:
        raise ValueError(f"qerl::lora_shrink: x and a must be 2-D, got {tuple(x.shape)} and {tuple(a.shape)}")
    if x.shape[1] != a.shape[1]:
        raise ValueError(f"qerl::lora_shrink: x {tuple(x.shape)} and a {tuple(a.shape)} do not fit [T, K], [R, K]")
    if x.dtype != a.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"qerl::lora_shrink: x is {x.dtype}, a is {a.dtype}; both must be one of bfloat16, "
                         "float16, float32")
    if x.device != a.device:
        raise ValueError(f"qerl::lora_shrink: x is on {x.device}, a on {a.device}")


if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(x_ptr, a_ptr, y_ptr, T, R, K,
                            stride_xt, stride_xk, stride_ar, stride_ak, stride_yt, stride_yr,
                            BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                            LAUNCH_DEPENDENTS: tl.constexpr):
        if LAUNCH_DEPENDENTS:  # the next kernel, if a programmatic dependent launch, may start now
            gdc_launch_dependents()
        pid_t = tl.program_id(0)
        pid_r = tl.program_id(1)
        rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        # x is loaded as [BLOCK_T, 1, BLOCK_K] and a as [1, BLOCK_R, BLOCK_K], in the layout of their product:
        # loaded as 2-D tiles, the loop-carried blocks went through shared memory every K block to change layout
        t3 = rt[:, None, None]
        r3 = rr[None, :, None]
        k3 = tl.arange(0, BLOCK_K)[None, None, :]
        x_rows = x_ptr + t3 * stride_xt
        a_rows = a_ptr + r3 * stride_ar
        in_t = t3 < T
        in_r = r3 < R
        xs = tl.load(x_rows + k3 * stride_xk, mask=in_t & (k3 < K), other=0.0)
        av = tl.load(a_rows + k3 * stride_ak, mask=in_r & (k3 < K), other=0.0)
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        # K block b is reduced while block b + 1's loads are in flight (Triton does not pipeline loads that feed no
        # tl.dot; the last "next" load is fully masked)
        for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
            kn = k0 + k3
            in_k = kn < K
            xs_next = tl.load(x_rows + kn * stride_xk, mask=in_t & in_k, other=0.0)
            av_next = tl.load(a_rows + kn * stride_ak, mask=in_r & in_k, other=0.0)
            acc += tl.sum(xs.to(tl.float32) * av.to(tl.float32), axis=2)
            xs = xs_next
            av = av_next
        tl.store(y_ptr + rt[:, None] * stride_yt + rr[None, :] * stride_yr, acc.to(y_ptr.dtype.element_ty),
                 mask=(rt[:, None] < T) & (rr[None, :] < R))


def can_signal_next(device: torch.device) -> bool:
    """Whether the kernel can signal programmatic dependent launch on ``device``: CUDA, sm_90+, a Triton with grid
    dependency control (the interpreter and older GPUs cannot)."""
    return (gdc_launch_dependents is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_lora_shrink(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, config: ShrinkConfig | None = None,
                       signal_next: bool = False) -> None:
    """Run the Triton kernel into ``y`` [T, R] (any strides; every element written). ``config`` overrides the
    tile (benchmarks, tests). ``signal_next``: every program first lets a programmatic dependent launch after it
    start (where :func:`can_signal_next`; tests use it to have a GEMM start while its input is being written).
    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""
    if triton is None:
        raise RuntimeError("qerl::lora_shrink: Triton is not importable")
    _check(x, a)
    t, k = x.shape
    r = a.shape[0]
    if y.shape != (t, r) or y.dtype != x.dtype:
        raise ValueError(f"qerl::lora_shrink: output {tuple(y.shape)} {y.dtype}, expected {(t, r)} {x.dtype}")
    if t == 0 or r == 0:
        return
    c = config or shrink_config(t, r, k, None if x.device.type == "cuda" else _DEFAULT_SM_COUNT, x.element_size())
    grid = (triton.cdiv(t, c.block_t), triton.cdiv(r, c.block_r))
    _lora_shrink_kernel[grid](x, a, y, t, r, k, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
                              y.stride(0), y.stride(1), BLOCK_T=c.block_t, BLOCK_R=c.block_r, BLOCK_K=c.block_k,
                              LAUNCH_DEPENDENTS=signal_next and can_signal_next(x.device), num_warps=c.num_warps)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, config: ShrinkConfig | None = None) -> torch.Tensor:
    """``x @ a^T`` by the Triton kernel, into a new [T, R] tensor."""
    _check(x, a)
    y = torch.empty((x.shape[0], a.shape[0]), dtype=x.dtype, device=x.device)
    launch_lora_shrink(x, a, y, config)
    return y


def _shrink_cpu(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check(x, a)
    return F.linear(x, a)


def _shrink_cuda(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check(x, a)
    if shrink_impl(x.shape[0], x.device, a.shape[0], x.shape[1]) == "triton":
        return lora_shrink_triton(x, a)
    return F.linear(x, a)


_lib.impl("lora_shrink", _shrink_cpu, "CPU")
_lib.impl("lora_shrink", _shrink_cuda, "CUDA")


@torch.library.register_fake(f"{LIB_NAME}::lora_shrink")
def _shrink_fake(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check(x, a)
    return x.new_empty((x.shape[0], a.shape[0]))


def lora_shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x @ a^T`` ([T, K] x [R, K] -> [T, R]), one ``qerl::lora_shrink`` op (one Triton kernel on CUDA up to
    :data:`TRITON_MAX_TOKENS` tokens)."""
    return torch.ops.qerl.lora_shrink(x, a)
