"""``qerl::lora_expand``: ``out + mask * (shrunk @ b_t)`` as one op (one Triton kernel on CUDA).

The Triton kernel is checked on the CPU with Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess:
the variable is read when the kernel is defined) in float32 and float16 against a float64 reference; the
interpreter's bfloat16 ``tl.dot`` is broken (it multiplies the raw bit patterns), so bfloat16 is checked on a
GPU (``test_kernel_bf16_on_cuda``) and by the engine tests in ``test_vllm_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_qerl.kernels import lora_expand as le

REPO = Path(__file__).resolve().parents[1]

_INTERPRETED = r"""
import itertools, json, torch
from verl_qerl.kernels import lora_expand as le
g = torch.Generator().manual_seed(0)
worst = {}
# T across the block sizes (16 / 32 / 64 rows, 128-column tiles above 64), R below / across the 16- and 32-wide
# rank steps, N not a multiple of the tile
for dtype, t, r, n in itertools.product(("float32", "float16"), (1, 5, 17, 40, 70), (8, 32, 96), (100, 64)):
    dt = getattr(torch, dtype)
    out, s = torch.randn(t, n, generator=g).to(dt), torch.randn(t, r, generator=g).to(dt)
    b = torch.randn(n, r, generator=g).to(dt)  # stored [N, R] as vLLM does; the op gets the transpose view
    mask = (torch.arange(t) % 3 != 1).to(dt).unsqueeze(1)
    want = out.double() + mask.double() * (s.double() @ b.double().t())
    got = le.lora_expand_triton(out, s, b.t(), mask)
    assert got.dtype == dt and got.shape == out.shape
    rel = ((got.double() - want).abs().max() / want.abs().max()).item()
    worst[dtype] = max(worst.get(dtype, 0.0), rel)
    # rows without the adapter are the base output, bit for bit
    assert torch.equal(got[1::3], out[1::3]), (dtype, t, r, n)
print(json.dumps(worst))
"""


@pytest.mark.skipif(le.triton is None, reason="Triton is not importable")
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU runs the compiled kernel instead (test_kernel_bf16_on_cuda); the GPU image's Triton "
                           "interpreter fails on its own numpy conversions (TypeError: only 0-dimensional arrays ...)")
def test_triton_kernel_matches_reference_in_the_interpreter():
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    worst = json.loads(proc.stdout.strip().splitlines()[-1])
    assert worst["float32"] <= 1e-6, worst
    assert worst["float16"] <= 2e-3, worst  # one fp16 rounding of the output


def test_op_on_cpu_equals_torch_and_traces():
    g = torch.Generator().manual_seed(1)
    out, s, b = torch.randn(6, 40, generator=g), torch.randn(6, 12, generator=g), torch.randn(40, 12, generator=g)
    mask = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0], [1.0]])
    got = le.lora_expand(out, s, b.t(), mask)
    torch.testing.assert_close(got, out + mask * (s @ b.t()), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[[1, 4]], out[[1, 4]])
    torch.library.opcheck(torch.ops.qerl.lora_expand.default, (out, s, b.t(), mask),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_names_the_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match=r"qerl::lora_expand: out \(4, 8\), shrunk \(4, 3\), b_t \(2, 8\)"):
        le.lora_expand(torch.zeros(4, 8), torch.zeros(4, 3), torch.zeros(2, 8), torch.ones(4, 1))


@pytest.mark.skipif(not torch.cuda.is_available() or le.triton is None, reason="needs CUDA and Triton")
def test_kernel_bf16_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    for t, r, n in ((1, 96, 4608), (8, 64, 37888), (64, 32, 3584), (300, 96, 4608)):
        out = torch.randn(t, n, device="cuda", generator=g, dtype=torch.bfloat16)
        s = torch.randn(t, r, device="cuda", generator=g, dtype=torch.bfloat16)
        b = torch.randn(n, r, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1
        mask = (torch.arange(t, device="cuda") % 4 != 3).to(torch.bfloat16).unsqueeze(1)
        want = out.float() + mask.float() * (s.float() @ b.float().t())
        got = le.lora_expand(out, s, b.t(), mask)
        assert (got.float() - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item()), (t, r, n)
        assert torch.equal(got[3::4], out[3::4])


def test_expand_route_by_tokens_dtype_and_capture():
    """Triton below CUBLAS_MIN_TOKENS; from there cuBLAS eagerly, Triton while a CUDA graph is captured up to
    TRITON_CAPTURED_MAX_TOKENS (no host time to save there, one launch instead of two); Triton for operand dtypes the
    cuBLAS route does not take."""
    from verl_qerl.kernels.lora_expand import CUBLAS_MIN_TOKENS as lo
    from verl_qerl.kernels.lora_expand import TRITON_CAPTURED_MAX_TOKENS as hi
    from verl_qerl.kernels.lora_expand import expand_impl

    assert lo < hi
    assert [expand_impl(t, True, False) for t in (1, lo - 1, lo, hi, hi + 1)] == ["triton"] * 2 + ["cublas"] * 3
    assert [expand_impl(t, True, True) for t in (1, lo - 1, lo, hi, hi + 1)] == ["triton"] * 4 + ["cublas"]
    assert {expand_impl(t, False, c) for t in (1, lo, hi + 1) for c in (False, True)} == {"triton"}
