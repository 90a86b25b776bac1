"""``qerl::lora_expand(out, shrunk, b_t, mask) -> out + mask * (shrunk @ b_t)``: a LoRA expand as one kernel.

The single-adapter LoRA path (``verl_qerl.vllm.lora_fast_path``) computes, per linear layer,
``out + mask * (x @ A^T) @ B^T``: the shrink ``x @ A^T`` is ``qerl::lora_shrink``
(:mod:`verl_qerl.kernels.lora_shrink`); this op is everything after it: the expand against the
(block-diagonal) B, the per-token adapter mask (1: the token's request has the adapter, 0: it has none)
and the residual add of the base layer's output. In torch ops that is a multiply and
an ``addmm``, two kernel launches; at decode batch sizes every launch costs about as much as the work, and a
7B model has 112 such layers per step, so on CUDA it is one Triton kernel (from :data:`CUBLAS_MIN_TOKENS` tokens
on, with bf16 / fp16 operands and outside CUDA-graph capture, the torch ops: cuBLAS; :func:`expand_impl`). It
returns a new tensor (no in-place mutation for torch.compile to functionalize) and allocates only a
shape-determined output, so it captures into CUDA graphs. For ``qerl_nvfp4`` layers the expand usually runs
inside the FP4 GEMM instead (``qerl::nvfp4_gemm_lora``, :mod:`verl_qerl.kernels.ops`); that op calls this one
wherever its GEMM has no LoRA epilogue (larger M, other kernels).

Shapes: out [T, N]; shrunk [T, R]; b_t [R, N] (any strides: vLLM's B is stored [N, R], ``b_t`` is its
transpose view); mask [T, 1] or [T]. Accumulation in float32, output in ``out``'s dtype. CPU tensors, or CUDA
without Triton, use the torch ops (same numbers up to summation order).
"""

from __future__ import annotations

import torch

from .op_library import LIB_NAME, library, tl, triton

_lib = library()
_lib.define("lora_expand(Tensor out, Tensor shrunk, Tensor b_t, Tensor mask) -> Tensor")


def lora_expand_torch(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference: ``out + mask * (shrunk @ b_t)`` in torch ops, in ``out``'s dtype. Operands of one dtype run in
    it (what the CUDA op's cuBLAS route computes, bit for bit); mixed dtypes, which the Triton kernel takes, run in
    float32 and round once to ``out``'s dtype (``addmm`` itself refuses them)."""
    if out.dtype == shrunk.dtype == b_t.dtype:
        return torch.addmm(out, shrunk * mask.reshape(-1, 1).to(shrunk.dtype), b_t)
    f32 = torch.float32
    return torch.addmm(out.to(f32), shrunk.to(f32) * mask.reshape(-1, 1).to(f32), b_t.to(f32)).to(out.dtype)


def _check(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> None:
    if out.dim() != 2 or shrunk.dim() != 2 or b_t.dim() != 2:
        raise ValueError(f"qerl::lora_expand: out, shrunk, b_t must be 2-D, got {tuple(out.shape)}, "
                         f"{tuple(shrunk.shape)}, {tuple(b_t.shape)}")
    t, n = out.shape
    mask_ok = mask.numel() == t and (mask.dim() == 1 or (mask.dim() == 2 and mask.shape[1] == 1))
    if shrunk.shape[0] != t or b_t.shape != (shrunk.shape[1], n) or not mask_ok:
        raise ValueError(f"qerl::lora_expand: out {tuple(out.shape)}, shrunk {tuple(shrunk.shape)}, "
                         f"b_t {tuple(b_t.shape)}, mask {tuple(mask.shape)} do not fit [T,N], [T,R], [R,N], [T]")


if triton is not None:

    @triton.jit
    def _lora_expand_kernel(out_ptr, s_ptr, b_ptr, mask_ptr, y_ptr, T, N, R,
                            stride_ot, stride_on, stride_st, stride_sr, stride_br, stride_bn, stride_mt,
                            stride_yt, stride_yn,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                            IEEE_FP32: tl.constexpr):
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_t = rt < T
        in_n = rn < N
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            in_r = rr < R
            s = tl.load(s_ptr + rt[:, None] * stride_st + rr[None, :] * stride_sr,
                        mask=in_t[:, None] & in_r[None, :], other=0.0)
            b = tl.load(b_ptr + rr[:, None] * stride_br + rn[None, :] * stride_bn,
                        mask=in_r[:, None] & in_n[None, :], other=0.0)
            if IEEE_FP32:
                acc += tl.dot(s, b, input_precision="ieee")
            else:
                acc += tl.dot(s, b)
        m = tl.load(mask_ptr + rt * stride_mt, mask=in_t, other=0.0).to(tl.float32)
        io = rt[:, None] * stride_ot + rn[None, :] * stride_on
        both = in_t[:, None] & in_n[None, :]
        o = tl.load(out_ptr + io, mask=both, other=0.0).to(tl.float32)
        y = o + acc * m[:, None]
        tl.store(y_ptr + rt[:, None] * stride_yt + rn[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty), mask=both)


def lora_expand_triton(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor,
                       warmup: bool = False) -> torch.Tensor:
    """The Triton kernel (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``, for tests). ``warmup``: compile
    and load the kernel for these operands without launching it (the returned tensor is then uninitialised)."""
    if triton is None:
        raise RuntimeError("qerl::lora_expand: Triton is not importable")
    _check(out, shrunk, b_t, mask)
    t, n = out.shape
    r = shrunk.shape[1]
    y = torch.empty_like(out)
    if t == 0 or n == 0:
        return y
    if shrunk.dtype != b_t.dtype:
        shrunk = shrunk.to(b_t.dtype)
    mask = mask.reshape(-1)
    block_t = 16 if t <= 16 else 32 if t <= 32 else 64
    block_n = 64 if t <= 64 else 128
    block_r = 16 if r <= 16 else 32
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
    args = (out, shrunk, b_t, mask, y, t, n, r, out.stride(0), out.stride(1), shrunk.stride(0), shrunk.stride(1),
            b_t.stride(0), b_t.stride(1), mask.stride(0), y.stride(0), y.stride(1))
    meta = dict(BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r, IEEE_FP32=b_t.dtype == torch.float32, num_warps=4)
    if warmup:
        _lora_expand_kernel.warmup(*args, grid=grid, **meta)
    else:
        _lora_expand_kernel[grid](*args, **meta)
    return y


def _expand_cpu(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    _check(out, shrunk, b_t, mask)
    return lora_expand_torch(out, shrunk, b_t, mask)


#: From this many tokens on the CUDA side is ``torch.addmm(out, shrunk * mask, b_t)`` (cuBLAS), as
#: ``qerl::nvfp4_lora_linear`` runs it from C++ (``kExpandCublasMinTokens`` in cuda/qerl_torch.cpp, the same count:
#: the two agree bit for bit, tests/test_lora_expand_gpu.py): at prefill sizes cuBLAS's tensor-core GEMM is as fast
#: as the Triton kernel and the prefill is host-bound, where this Python op costs ~96 us per call (NOTES "Eighth
#: round"). Below it the Triton kernel (one launch; decode runs in CUDA graphs, where host time does not count).
CUBLAS_MIN_TOKENS = 128
#: ... except while a CUDA graph is being captured, up to this many tokens (vLLM's largest captured batch by default):
#: a graph replays no host work, so the Python op's cost is gone, and the Triton kernel is one launch (mask and
#: residual add inside) where cuBLAS's route is two (the mask's multiply, then the GEMM); the profiled 256-token
#: prefill spent 308 us of its 112 layers in that multiply alone (NOTES "Eleventh round"). The C++ side
#: (``kExpandTritonCapturedMaxTokens``) hands the expand to this op under the same rule, so both routes keep the
#: same bits; an eager call and a graph replay of the same shape differ by the summation order of the expand.
TRITON_CAPTURED_MAX_TOKENS = 512


def expand_impl(t: int, cublas_dtypes: bool, capturing: bool) -> str:
    """Which kernel the CUDA side runs for a ``t``-token expand: ``cublas`` (mask multiply + ``addmm``) from
    :data:`CUBLAS_MIN_TOKENS` tokens with bf16 / fp16 operands (``cublas_dtypes``), unless a CUDA graph is being
    captured (``capturing``) and ``t`` is at most :data:`TRITON_CAPTURED_MAX_TOKENS`; else ``triton``."""
    if not cublas_dtypes or t < CUBLAS_MIN_TOKENS:
        return "triton"
    return "triton" if capturing and t <= TRITON_CAPTURED_MAX_TOKENS else "cublas"


#: operand signatures whose Triton kernel an eager cuBLAS call already compiled for a later capture
_warmed: set[tuple] = set()


def _warm_for_capture(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> None:
    """Compile (without launching) the Triton kernel an eager cuBLAS call's shape would run under capture, once per
    operand signature: a capture then only launches it. vLLM (and ``verl_qerl.testing.gpu.capture``) run every
    captured size eagerly first; compiling and loading a module inside a capture is not something to rely on."""
    key = (tuple(out.shape), shrunk.shape[1], out.dtype, out.stride(), shrunk.stride(), b_t.stride(), mask.stride(),
           out.device.index)
    if key not in _warmed:
        lora_expand_triton(out, shrunk, b_t, mask, warmup=True)
        _warmed.add(key)


def _expand_cuda(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    cublas_dtypes = (out.dtype in (torch.bfloat16, torch.float16) and shrunk.dtype == out.dtype
                     and b_t.dtype == out.dtype)
    capturing = torch.cuda.is_current_stream_capturing()
    if triton is None or expand_impl(out.shape[0], cublas_dtypes, capturing) == "cublas":
        if triton is not None and not capturing and out.shape[0] <= TRITON_CAPTURED_MAX_TOKENS:
            _check(out, shrunk, b_t, mask)
            _warm_for_capture(out, shrunk, b_t, mask)
        return _expand_cpu(out, shrunk, b_t, mask)
    return lora_expand_triton(out, shrunk, b_t, mask)


_lib.impl("lora_expand", _expand_cpu, "CPU")
_lib.impl("lora_expand", _expand_cuda, "CUDA")


@torch.library.register_fake(f"{LIB_NAME}::lora_expand")
def _expand_fake(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(out)


def lora_expand(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``out + mask * (shrunk @ b_t)``, one ``qerl::lora_expand`` op (one Triton kernel on CUDA at decode sizes)."""
    return torch.ops.qerl.lora_expand(out, shrunk, b_t, mask)
