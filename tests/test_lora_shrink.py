"""``qerl::lora_shrink``: ``x @ a^T`` as one op (one Triton kernel on CUDA for decode token counts).

The Triton kernel is checked on the CPU with Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: the
variable is read when the kernel is defined) against a float64 reference, on inputs that are views into larger
buffers poisoned with NaN beyond the tensor's edges (a read past the K, T or R mask brings a NaN in) and an output
view into a NaN-poisoned buffer (an unwritten element stays NaN; a write past the edges lands in the guard). The
kernel has no ``tl.dot``, so the interpreter's broken bfloat16 ``tl.dot`` does not matter here and bfloat16 is
checked on the CPU too. The compiled kernel runs in ``test_kernel_bf16_on_cuda`` (skipped without a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from verl_qerl.kernels import lora_shrink as ls

REPO = Path(__file__).resolve().parents[1]

_INTERPRETED = r"""
import itertools, json, torch
from verl_qerl.kernels import lora_shrink as ls
g = torch.Generator().manual_seed(0)
worst, configs = {}, set()

def poisoned_view(rows, cols, dtype, extra_rows=2, extra_cols=5):
    # a [rows, cols] view into a NaN buffer: row stride cols + extra_cols, NaN rows below and NaN columns right
    full = torch.full((rows + extra_rows, cols + extra_cols), float("nan"), dtype=dtype)
    full[:rows, :cols] = torch.randn(rows, cols, generator=g).to(dtype)
    return full, full[:rows, :cols]

def check(x, a, dtype, config=None, tag=()):
    t, k = x.shape
    r = a.shape[0]
    out_full = torch.full((t + 3, r + 4), float("nan"), dtype=dtype)
    y = out_full[1:t + 1, 2:r + 2]
    ls.launch_lora_shrink(x, a, y, config=config)
    configs.add(config or ls.shrink_config(t, r, k))
    guard = out_full.clone()
    guard[1:t + 1, 2:r + 2] = 0
    assert torch.isnan(guard).sum().item() == guard.numel() - y.numel(), ("wrote outside the output", tag)
    assert not torch.isnan(y).any(), ("left output elements unwritten or read a poisoned input", tag)
    want = x.double() @ a.double().t()
    err = (y.double() - want).abs()
    rel = (err.max() / want.abs().max()).item()
    worst[str(dtype)] = max(worst.get(str(dtype), 0.0), rel)
    # per element: one rounding to the output dtype (1 ulp: the interpreter's bf16 store truncates) plus the fp32 sum
    ulp = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    ulps = (err / (ulp * want.abs() + 1e-5 * want.abs().max())).max().item()
    worst["per_element"] = max(worst.get("per_element", 0.0), ulps)

# the configuration the launcher picks: T across the token tiles (17 needs two 16-row tiles), R below / across the
# rank tiles, K not a multiple of any K block (37: smaller than one block); fp16 / bf16 on a subset
shapes = [("float32", t, r, k) for t, r, k in itertools.product((1, 3, 17), (8, 32, 96), (1000, 37))]
shapes += [(d, t, r, 1000) for d in ("float16", "bfloat16") for t, r in ((1, 32), (3, 96), (17, 8))]
for dtype, t, r, k in shapes:
    dtype = getattr(torch, dtype)
    _, x = poisoned_view(t, k, dtype)
    _, a = poisoned_view(r, k, dtype)
    check(x, a, dtype, tag=(str(dtype), t, r, k))
# every tile shape the launcher can pick, forced, on one odd shape (T=5, R=20, K=300: partial tiles everywhere,
# K blocks of 16..512 with a partial last block)
_, x = poisoned_view(5, 300, torch.float32)
_, a = poisoned_view(20, 300, torch.float32)
for bt, br in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
    bk = max(16, min(512, 2048 // (bt * br)))
    check(x, a, torch.float32, config=ls.ShrinkConfig(bt, br, bk, 4), tag=("forced", bt, br, bk))
# contiguous operands (the layout vLLM's concatenated A has), and transposed (column-major) x
x = torch.randn(5, 300, generator=g)
a = torch.randn(24, 300, generator=g)
check(x, a, torch.float32, tag="contiguous")
check(torch.randn(300, 5, generator=g).t(), a, torch.float32, tag="column-major x")
print(json.dumps({"worst": worst, "configs": sorted(map(list, configs))}))
"""


def _interpret(code: str) -> dict:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(ls.triton is None, reason="Triton is not importable")
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU runs the compiled kernel instead (test_kernel_bf16_on_cuda); the GPU image's Triton "
                           "interpreter fails on its own numpy conversions (TypeError: only 0-dimensional arrays ...)")
def test_triton_kernel_matches_reference_in_the_interpreter():
    res = _interpret(_INTERPRETED)
    worst = res["worst"]
    assert worst["torch.float32"] <= 1e-5, worst
    assert worst["torch.float16"] <= 2e-3, worst  # one fp16 rounding of the fp32 sum
    assert worst["torch.bfloat16"] <= 1e-2, worst  # one bf16 rounding
    assert worst["per_element"] <= 1.0, worst
    assert len(res["configs"]) >= 25 + 3, res["configs"]  # the forced tiles and several picked ones ran


def test_config_covers_every_row_and_column_with_a_bounded_tile():
    """The launcher's tile choice: tiles of at most 16 x 16, K blocks within the per-thread load and product
    budgets, and at decode token counts small tiles, i.e. many programs."""
    for t in (1, 2, 3, 8, 17, 64, 128):
        for r in (8, 32, 64, 96, 256):
            for k in (37, 3584, 18944):
                c = ls.shrink_config(t, r, k, sm_count=132)
                assert c.block_t <= 16 and c.block_r <= 16, (t, r, k, c)
                threads = 32 * c.num_warps
                assert c.block_t * c.block_r * c.block_k <= ls._PRODUCTS_PER_THREAD * threads, (t, r, k, c)
                assert (c.block_t + c.block_r) * c.block_k <= ls._LOADS_PER_THREAD * threads, (t, r, k, c)
                assert c.block_t <= max(1, 2 * t - 1) and c.block_r <= max(1, 2 * r - 1), (t, r, k, c)
                assert c.block_k >= 16 and c.block_k & (c.block_k - 1) == 0, c
    # T = 1: one program per rank row (R = 32 -> 32 programs; a 2-D tile would leave most SMs idle)
    assert ls.shrink_config(1, 32, 18944, sm_count=132)[:2] == (1, 1)
    assert ls.shrink_config(1, 96, 3584, sm_count=132)[:2] == (1, 1)


def test_op_on_cpu_equals_torch_and_traces():
    g = torch.Generator().manual_seed(1)
    x, a = torch.randn(6, 40, generator=g), torch.randn(12, 40, generator=g)
    got = ls.lora_shrink(x, a)
    torch.testing.assert_close(got, F.linear(x, a), rtol=0, atol=0)  # the CPU path is F.linear
    torch.library.opcheck(torch.ops.qerl.lora_shrink.default, (x, a), test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda x_, a_: ls.lora_shrink(x_, a_) * 2.0, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, a), 2.0 * F.linear(x, a))


def test_op_names_what_does_not_fit():
    with pytest.raises(ValueError, match=r"qerl::lora_shrink: x \(4, 8\) and a \(3, 7\)"):
        ls.lora_shrink(torch.zeros(4, 8), torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"qerl::lora_shrink: x and a must be 2-D, got \(4,\) and \(3, 4\)"):
        ls.lora_shrink(torch.zeros(4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"qerl::lora_shrink: x is torch.float32, a is torch.bfloat16"):
        ls.lora_shrink(torch.zeros(4, 8), torch.zeros(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"qerl::lora_shrink: x is torch.int64"):
        ls.lora_shrink(torch.zeros(4, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long))
    # the fake impl checks too: a shape mistake fails while torch.compile traces, with the same message
    with pytest.raises(Exception, match=r"qerl::lora_shrink: x \(4, 8\) and a \(3, 7\)"):
        torch.compile(ls.lora_shrink, fullgraph=True, backend="aot_eager")(torch.zeros(4, 8), torch.zeros(3, 7))


def test_triton_wins_where_it_was_measured_to():
    """The rule against the H200 measurements it was set from (lora_shrink.py's comment): Triton vs cuBLAS at T = 32
    and 64 on the four 7B shapes (qkv K 3584 R 96, o R 32, gate_up R 64, down K 18944 R 32)."""
    faster = {(32, "qkv"): True, (32, "o"): True, (32, "gate_up"): True, (32, "down"): False,
              (64, "qkv"): False, (64, "o"): True, (64, "gate_up"): True, (64, "down"): False}
    shapes = {"qkv": (96, 3584), "o": (32, 3584), "gate_up": (64, 3584), "down": (32, 18944)}
    for (t, name), want in faster.items():
        assert ls.triton_wins(t, *shapes[name]) is want, (t, name)
    assert all(ls.triton_wins(t, 96, 18944) for t in range(1, ls.TRITON_MAX_TOKENS + 1))
    assert not ls.triton_wins(ls.TRITON_WIDE_MAX_TOKENS + 1, 1, 8)


def test_shrink_mode_is_validated(monkeypatch):
    monkeypatch.setenv(ls.SHRINK_ENV, "cuBLAS")
    assert ls.shrink_mode() == "cublas"
    assert ls.shrink_impl(1, torch.device("cuda")) == "cublas"
    monkeypatch.setenv(ls.SHRINK_ENV, "fast")
    with pytest.raises(ValueError, match=r"QERL_LORA_SHRINK='fast'"):
        ls.shrink_mode()
    monkeypatch.delenv(ls.SHRINK_ENV)
    t_max = ls.TRITON_MAX_TOKENS
    assert ls.shrink_impl(1, torch.device("cpu")) == "torch"
    if ls.triton is not None:
        assert ls.shrink_impl(1, torch.device("cuda")) == "triton"
        assert ls.shrink_impl(t_max, torch.device("cuda")) == "triton"
        assert ls.shrink_impl(t_max + 1, torch.device("cuda")) == "cublas"  # no shapes: the token rule alone
        # with the shapes, 17-64 tokens stay on Triton where K and T x R are small (7B o / gate_up; qkv up to 42)
        assert ls.shrink_impl(64, torch.device("cuda"), 32, 3584) == "triton"
        assert ls.shrink_impl(64, torch.device("cuda"), 96, 3584) == "cublas"
        assert ls.shrink_impl(32, torch.device("cuda"), 32, 18944) == "cublas"
        assert ls.shrink_impl(65, torch.device("cuda"), 8, 256) == "cublas"
        monkeypatch.setenv(ls.SHRINK_ENV, "cublas")
        assert ls.shrink_impl(1, torch.device("cuda"), 32, 3584) == "cublas"
        monkeypatch.setenv(ls.SHRINK_ENV, "triton")
        assert ls.shrink_impl(8192, torch.device("cuda")) == "triton"


def test_launch_signal_only_on_cuda():
    """The kernel can signal programmatic dependent launch only on CUDA (sm_90+, a Triton with grid dependency
    control); the interpreter runs it without."""
    assert ls.can_signal_next(torch.device("cpu")) is False


@pytest.mark.skipif(not torch.cuda.is_available() or ls.triton is None, reason="needs CUDA and Triton")
def test_kernel_bf16_on_cuda(monkeypatch):
    """The compiled kernel at 7B's LoRA shrink shapes (R = 32 o / down, 64 gate_up, 96 qkv; K = 3584, 18944 down),
    decode token counts, against an fp32 reference; also forced at T = 256 and T = 8192 (above the threshold the op
    itself uses cuBLAS), and captured in a CUDA graph."""
    monkeypatch.setenv(ls.SHRINK_ENV, "triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (1, 3, 8, 64, 256):
        for r, k in ((32, 3584), (64, 3584), (96, 3584), (32, 18944), (8, 1000), (256, 4096)):
            x = torch.randn(t, k, device="cuda", generator=g, dtype=torch.bfloat16)
            a = torch.randn(r, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
            want = x.float() @ a.float().t()
            got = ls.lora_shrink(x, a)
            assert got.dtype == torch.bfloat16 and got.shape == (t, r)
            err = (got.float() - want).abs().max().item()
            assert err <= 1e-2 * max(1.0, want.abs().max().item()), (t, r, k, err)
    x = torch.randn(8192, 3584, device="cuda", generator=g, dtype=torch.bfloat16)
    a = torch.randn(96, 3584, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(ls.lora_shrink(x, a).float(), x.float() @ a.float().t(), rtol=2e-2, atol=2e-2)
    # in a CUDA graph: shape-determined allocation, new inputs copied into the static buffer are what it reads
    monkeypatch.delenv(ls.SHRINK_ENV)
    xs = torch.randn(8, 18944, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(32, 18944, device="cuda", dtype=torch.bfloat16) * 0.02
    ls.lora_shrink(xs, a)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = ls.lora_shrink(xs, a)
    xs.copy_(torch.randn(8, 18944, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want = xs.float() @ a.float().t()
    assert (ys.float() - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item())


def test_bench_crossover_and_targets():
    """benchmarks/lora_shrink_bench.py: the threshold it reports is the largest T below which Triton wins on every
    shape (a win at a larger T after a loss does not count), and its targets check the shipped threshold."""
    from verl_qerl.testing.scripts import load_script

    bench = load_script("benchmarks/lora_shrink_bench.py", "lora_shrink_bench")
    us = {("o", 1): (1.0, 5.0), ("o", 2): (2.0, 5.0), ("o", 4): (6.0, 5.0), ("o", 8): (4.0, 5.0),
          ("down", 1): (3.0, 5.0), ("down", 2): (4.0, 5.0), ("down", 4): (4.5, 5.0), ("down", 8): (4.0, 5.0)}
    rows = [{"shape": s, "T": t, "triton_us": tr, "cublas_us": cb} for (s, t), (tr, cb) in us.items()]
    assert bench.triton_wins_up_to(rows) == 2  # o loses at 4; every shape winning at 8 comes after that loss
    ok, crossover = bench.targets(rows, 2)
    assert ok["measured"] == pytest.approx(0.8) and ok["op"] == "<=" and ok["target"] == 1.0
    assert (crossover["measured"], crossover["target"]) == (2, 2)
    too_high, crossover = bench.targets(rows, 4)
    assert too_high["measured"] == pytest.approx(1.2)  # T = 4 on o: Triton 6 us vs cuBLAS 5 us
    assert crossover["measured"] > crossover["target"]
