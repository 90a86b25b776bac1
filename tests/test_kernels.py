"""CPU tests of verl_qerl.kernels: layout round trips, fallbacks vs a float64 oracle, fake impls.

The oracles are written here from the format's definition and the kernel's register layout (not imported
from the package): E2M1 from its table, E4M3 decoded from its bits, the repacked tiles decoded the way the
CUDA kernel reads them (lane, word, register, half, scale byte). A shared mistake in the package's
references (which the CPU ops and fallbacks all call) cannot hide behind a comparison with itself.
"""

from __future__ import annotations

import pytest
import torch

from verl_qerl import kernels, nvfp4
from verl_qerl.kernels import layout, reference

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_to_f64(raw: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes -> float64, from the bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent
    0 is subnormal (m / 8 * 2^-6); S.1111.111 is NaN (no infinities)."""
    b = raw.view(torch.uint8).to(torch.int64) if raw.dtype != torch.uint8 else raw.to(torch.int64)
    e, m = (b >> 3) & 0xF, (b & 7).to(torch.float64)
    mag = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.pow(2.0, (e - 7).to(torch.float64)))
    val = torch.where((b >> 7) == 1, -mag, mag)
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(val, float("nan")), val)


def e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] 4-bit codes (even element in the low nibble)."""
    return torch.stack([(packed & 0xF).long(), (packed >> 4).long()], -1).reshape(packed.shape[0], -1)


def e2m1_to_f64(codes: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def oracle_weight(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """W[n, k] = e2m1(code) * e4m3(scale[n, k // 16]) / g, exact in float64 (every factor is exact there)."""
    s = e4m3_to_f64(scale)
    return e2m1_to_f64(e2m1_codes(packed)) * s.repeat_interleave(16, 1) / float(gs.reshape(()).double())


def oracle_dequantize(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The format's dequantize, bit for bit: ``e2m1 * fl32(scale / g)`` rounded to float32, then to ``dtype``.

    Emulated in float64: scale and g are float32 values, so float64's quotient rounded to float32 is float32's
    correctly rounded quotient (53 >= 2 * 24 + 2 bits), and e2m1 (2 significant bits) times a float32 is exact
    in float64 before its one rounding to float32."""
    eff = (e4m3_to_f64(scale) / float(gs.reshape(()).double())).to(torch.float32).to(torch.float64)
    prod = e2m1_to_f64(e2m1_codes(packed)) * eff.repeat_interleave(16, 1)
    return prod.to(torch.float32).to(dtype)


# The repacked layout as the CUDA kernel reads it (cuda/nvfp4_common.cuh decode_raw / scale_two, the GEMM's
# fragment loads), written from the mma.sync m16n8k16 A-fragment rules: lane = 4 g + t holds rows g and g + 8,
# columns 2t, 2t + 1 (+ 8); register a0 (row g, cols 2t..), a1 (row g + 8), a2 (row g, cols + 8), a3 (both).
_MASK, _MASK_A3_LO, _MASK_A3_HI = 0x81C081C0, 0x80C080C0, 0x01000100


def _rotl32(w: torch.Tensor, s: int) -> torch.Tensor:
    return ((w << s) | (w >> (32 - s))) & 0xFFFFFFFF


def _bf16_bits_to_f64(bits: torch.Tensor) -> torch.Tensor:
    word = bits.to(torch.int64) << 16
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.view(torch.float32).to(torch.float64)


def oracle_from_tiles(qweight: torch.Tensor, qscale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """[N_pad, K] float64 weight read from the kernel layout element by element, as the GEMM computes it:
    the fragment's bf16 ``e2m1 * 2^-126`` times the bf16 scale ``(byte << 4) | 0x7000`` (= scale * 2^119), then
    the epilogue's ``128 / g``. Every step is exact, so this equals :func:`oracle_weight` bit for bit."""
    tiles_n, stages = qweight.shape[:2]
    row = torch.arange(tiles_n * 128).view(-1, 1)
    col = torch.arange(stages * 128).view(1, -1)
    i, b, r16 = row // 128, (row % 128) // 16, row % 16  # 128-row tile, n16 block in it, row in the block
    s, t, c64 = col // 128, (col % 128) // 64, col % 64  # stage, k64 tile in the stage, column in the tile
    step, c16 = c64 // 16, c64 % 16  # k16 MMA step (word of the lane), column in the step
    g, upper = r16 % 8, r16 // 8
    lane = 4 * g + (c16 % 8) // 2
    reg = upper + 2 * (c16 // 8)
    half = c16 % 2
    tile = 2 * b + t  # 512 weight bytes and 64 scale bytes per (n16, k64) tile, tile-major inside a stage
    stage_base = i * stages + s
    wq = qweight.reshape(-1).to(torch.int64)
    byte0 = stage_base * 8192 + tile * 512 + lane * 16 + step * 4
    word = wq[byte0] | (wq[byte0 + 1] << 8) | (wq[byte0 + 2] << 16) | (wq[byte0 + 3] << 24)
    regs = torch.stack([
        word & _MASK,
        _rotl32(word, 4) & _MASK,
        _rotl32(word, 10) & _MASK,
        (_rotl32(word, 6) & _MASK_A3_LO) | (_rotl32(word, 14) & _MASK_A3_HI),
    ], -1)
    frag = (regs.gather(-1, reg.expand_as(word).unsqueeze(-1)).squeeze(-1) >> (16 * half)) & 0xFFFF
    sbyte = qscale.reshape(-1).to(torch.int64)[stage_base * 1024 + tile * 64 + g * 8 + step * 2 + upper]
    w = _bf16_bits_to_f64(frag) * _bf16_bits_to_f64((sbyte << 4) | 0x7000)
    return w * 128 / float(gs.reshape(()).double())


def random_nvfp4(n: int, k: int, seed: int, zero_blocks: bool = False):
    """Random codes (all 16 values), random positive E4M3 scales incl. subnormals, random g."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    sbytes = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen)  # no NaN, no sign
    if zero_blocks:
        sbytes[0, 0] = 0
        sbytes[-1, -1] = 0
    gs = torch.tensor([2688.0 / (0.05 + torch.rand(1, generator=gen).item())], dtype=torch.float32)
    return packed, sbytes.view(torch.float8_e4m3fn), gs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("n,k", [(16, 128), (128, 128), (48, 256), (272, 384)])
def test_repack_roundtrip(n: int, k: int) -> None:
    packed, scale, _ = random_nvfp4(n, k, seed=n + k)
    rw = kernels.repack(packed, scale)
    n_pad = (n + 127) // 128 * 128
    assert rw.qweight.shape == (n_pad // 128, k // 128, 8192) and rw.qweight.dtype == torch.uint8
    assert rw.qscale.shape == (n_pad // 128, k // 128, 1024) and rw.qscale.dtype == torch.uint8
    codes = reference.unpack_codes(packed)
    assert torch.equal(layout.unrepack_codes(rw.qweight, n), codes)
    assert torch.equal(layout.unrepack_scales(rw.qscale, n), scale.to(torch.float32))
    # padding rows decode to zero codes
    pad_codes = layout.unrepack_codes(rw.qweight, n_pad)[n:]
    assert int(pad_codes.count_nonzero()) == 0


def test_repack_bit_placement_is_a_permutation() -> None:
    """Every bit of a word is used by exactly one (register, half, code bit)."""
    bits = sorted(layout._SRC[r][h][b] for r in range(4) for h in range(2) for b in range(4))
    assert bits == list(range(32))


def test_e4m3_decoder_agrees_with_torch_on_every_byte() -> None:
    """The test's own E4M3 decoder and torch's float8_e4m3fn cast: two implementations, all 256 bytes."""
    raw = torch.arange(256, dtype=torch.uint8)
    ours, theirs = e4m3_to_f64(raw), raw.view(torch.float8_e4m3fn).to(torch.float64)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs)) and int(torch.isnan(ours).sum()) == 2
    assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    assert float(ours[0x08]) == 2.0**-6 and float(ours[0x01]) == 2.0**-9 and float(ours[0x7E]) == 448.0


def test_scale_encoding_all_e4m3() -> None:
    """All finite non-negative E4M3 values (subnormals included) survive the byte re-encoding."""
    raw = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN in e4m3fn
    f = raw.view(torch.float8_e4m3fn).to(torch.float32)
    enc = layout.encode_scale_bytes(raw)
    assert torch.equal(layout.decode_scale_bytes(enc), f)
    assert int(enc[0]) == 0 and bool((enc[1:] > 0).all())


def test_zero_scale_blocks_decode_to_zero() -> None:
    packed, scale, gs = random_nvfp4(128, 128, seed=3, zero_blocks=True)
    rw = kernels.repack(packed, scale)
    w = reference.dequantize_repacked_ref(rw.qweight, rw.qscale, gs, 128, torch.float32)
    assert float(w[0, :16].abs().sum()) == 0.0 and float(w[-1, -16:].abs().sum()) == 0.0
    assert torch.equal(w, oracle_dequantize(packed, scale, gs, torch.float32))
    assert torch.equal(oracle_from_tiles(rw.qweight, rw.qscale, gs), oracle_weight(packed, scale, gs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_matches_oracle(dtype: torch.dtype) -> None:
    packed, scale, gs = random_nvfp4(64, 256, seed=7)
    w = kernels.dequantize(packed, scale, gs, dtype)
    assert w.dtype == dtype and w.shape == (64, 256)
    # bit for bit the format's definition (fp32 math, then one rounding to dtype) ...
    assert torch.equal(w, oracle_dequantize(packed, scale, gs, dtype))
    # ... which is the exact value up to the fp32 steps and the final rounding (relative)
    ref = oracle_weight(packed, scale, gs)
    tol = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}[dtype]
    nz = ref != 0
    floor = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # subnormal spacing
    assert bool(((w.double() - ref).abs() <= tol * ref.abs() + floor).all())
    assert bool((w.double()[~nz] == 0).all())
    # uint8 view of the scales is accepted and gives the same bits
    assert torch.equal(kernels.dequantize(packed, scale.view(torch.uint8), gs, dtype), w)


def test_dequantize_repacked_equals_dequantize() -> None:
    packed, scale, gs = random_nvfp4(144, 384, seed=11)
    rw = kernels.repack(packed, scale)
    a = kernels.dequantize_repacked(rw, gs, 144, torch.bfloat16)
    b = kernels.dequantize(packed, scale, gs, torch.bfloat16)
    assert torch.equal(a, b) and torch.equal(a, oracle_dequantize(packed, scale, gs, torch.bfloat16))


@pytest.mark.parametrize("n,k", [(16, 128), (272, 384), (128, 512)])
def test_repacked_layout_reads_back_as_the_kernel_reads_it(n: int, k: int) -> None:
    """The tiles decoded element by element from the kernel's fragment rules hold the weight, bit for bit;
    padding rows hold zeros. Catches a permutation shared by repack and unrepack (their round trip can't)."""
    packed, scale, gs = random_nvfp4(n, k, seed=n * k, zero_blocks=True)
    rw = kernels.repack(packed, scale)
    w = oracle_from_tiles(rw.qweight, rw.qscale, gs)
    assert torch.equal(w[:n], oracle_weight(packed, scale, gs))
    assert int(w[n:].count_nonzero()) == 0


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_fallback_matches_f64(m: int, with_bias: bool) -> None:
    n, k = 96, 256
    packed, scale, gs = random_nvfp4(n, k, seed=m)
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    ref = reference.linear_f64(x, packed, scale, gs, bias)
    ref_oracle = x.double() @ oracle_weight(packed, scale, gs).T + (bias.double() if with_bias else 0)
    assert rel_err(ref, ref_oracle) < 1e-12
    out32 = kernels.linear(x, packed, scale, gs, bias)
    assert out32.shape == (m, n) and rel_err(out32, ref) < 1e-5
    xb = x.to(torch.bfloat16)
    refb = reference.linear_f64(xb, packed, scale, gs, bias)
    outb = kernels.linear(xb, packed, scale, gs, bias)
    assert outb.dtype == torch.bfloat16 and rel_err(outb, refb) < 1e-2
    rw = kernels.repack(packed, scale)
    outk = kernels.linear(xb, packed, scale, gs, bias, kernel_weight=rw)
    assert rel_err(outk, refb) < 1e-2
    # the repacked path alone (what vLLM's kernel layout runs): checked against the weight read from the tiles
    w_tiles = oracle_from_tiles(rw.qweight, rw.qscale, gs)[:n]
    tiles_ref = xb.double() @ w_tiles.T + (bias.to(torch.bfloat16).double() if with_bias else 0)
    outk2 = kernels.linear(xb.view(1, m, k), None, None, gs, bias, kernel_weight=rw, n=n)
    assert outk2.shape == (1, m, n) and outk2.dtype == torch.bfloat16 and rel_err(outk2[0], tiles_ref) < 1e-2
    outk32 = kernels.linear(x, None, None, gs, bias, kernel_weight=rw, n=n)
    assert rel_err(outk32, x.double() @ w_tiles.T + (bias.double() if with_bias else 0)) < 1e-5


def test_ops_cpu_and_shapes() -> None:
    n, k = 80, 128
    packed, scale, gs = random_nvfp4(n, k, seed=5)
    qw, qs = torch.ops.qerl.nvfp4_repack(packed, scale.view(torch.uint8))
    assert qw.shape == (1, 1, 8192) and qs.shape == (1, 1, 1024)
    x = torch.randn(3, k).to(torch.bfloat16)
    out = torch.ops.qerl.nvfp4_gemm(x, qw, qs, gs, None, n, 0)
    ref = x.double() @ oracle_weight(packed, scale, gs).T
    assert out.shape == (3, n) and out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.ops.qerl.nvfp4_dequant(packed, scale.view(torch.uint8), gs, dtype)
        assert torch.equal(w, oracle_dequantize(packed, scale, gs, dtype))
        wr = torch.ops.qerl.nvfp4_dequant_repacked(qw, qs, gs, n, dtype)
        assert torch.equal(wr, oracle_dequantize(packed, scale, gs, dtype))


def test_pdl_argument_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pdl`` changes when a CUDA kernel may start, never the result: the ops take it (CPU: the reference either
    way); ``$QERL_PDL`` is 1 by default, 0 turns it off, anything else names the variable."""
    n, k = 80, 128
    packed, scale, gs = random_nvfp4(n, k, seed=6)
    qw, qs = torch.ops.qerl.nvfp4_repack(packed, scale.view(torch.uint8))
    x = torch.randn(3, k).to(torch.bfloat16)
    base = torch.ops.qerl.nvfp4_gemm(x, qw, qs, gs, None, n, 0)
    assert torch.equal(torch.ops.qerl.nvfp4_gemm(x, qw, qs, gs, None, n, 0, 0, True), base)
    assert torch.equal(torch.ops.qerl.nvfp4_gemm(x, qw, qs, gs, None, n, pdl=True), base)
    rw = kernels.RepackedWeight(qw, qs)
    assert torch.equal(kernels.linear(x, None, None, gs, kernel_weight=rw, n=n, pdl=True),
                       kernels.linear(x, None, None, gs, kernel_weight=rw, n=n))
    monkeypatch.delenv(kernels.PDL_ENV, raising=False)
    assert kernels.pdl_enabled()
    monkeypatch.setenv(kernels.PDL_ENV, "0")
    assert not kernels.pdl_enabled()
    monkeypatch.setenv(kernels.PDL_ENV, "yes")
    with pytest.raises(ValueError, match=r"QERL_PDL='yes'"):
        kernels.pdl_enabled()


def test_autograd_through_gemm_op() -> None:
    n, k = 32, 128
    packed, scale, gs = random_nvfp4(n, k, seed=9)
    qw, qs = kernels.repack(packed, scale)
    x = torch.randn(4, k, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(n, requires_grad=True)
    out = torch.ops.qerl.nvfp4_gemm(x, qw, qs, gs, bias, n, 0)
    g = torch.randn_like(out)
    out.backward(g)
    w = oracle_weight(packed, scale, gs)
    assert rel_err(x.grad, g.double() @ w) < 1e-5
    assert torch.allclose(bias.grad, g.sum(0))


def test_layout_refuses_bad_shapes() -> None:
    packed, scale, _ = random_nvfp4(24, 64, seed=1)
    with pytest.raises(kernels.LayoutError, match="N=24"):
        kernels.repack(packed, scale)
    packed, scale, _ = random_nvfp4(32, 192, seed=1)
    with pytest.raises(kernels.LayoutError, match="K=192"):
        kernels.repack(packed, scale)


def test_import_does_not_touch_cuda() -> None:
    assert kernels.gemm_supported(256, torch.bfloat16) and not kernels.gemm_supported(192, torch.bfloat16)
    assert not kernels.gemm_supported(256, torch.float16)
    if not torch.cuda.is_available():
        assert kernels.cuda_available() is False
        assert "cuda" in kernels.cuda_unavailable_reason().lower()


def test_fake_impls_under_compile() -> None:
    """torch.compile(fullgraph=True) traces the ops through their fake impls (CPU backend)."""
    n, k = 64, 128
    packed, scale, gs = random_nvfp4(n, k, seed=21)
    qw, qs = kernels.repack(packed, scale)
    bias = torch.randn(n).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.qerl.nvfp4_gemm(x, qw, qs, gs, bias, n, 0)
        w = torch.ops.qerl.nvfp4_dequant_repacked(qw, qs, gs, n, torch.bfloat16)
        return y + (x @ w.T) * 0.5

    x = torch.randn(5, k).to(torch.bfloat16)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert out.shape == (5, n) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), f(x).float(), rtol=2e-2, atol=2e-2)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx = torch.empty(7, k, dtype=torch.bfloat16)
        fqw = torch.empty(tuple(qw.shape), dtype=torch.uint8)
        fqs = torch.empty(tuple(qs.shape), dtype=torch.uint8)
        fgs = torch.empty(1)
        y = torch.ops.qerl.nvfp4_gemm(fx, fqw, fqs, fgs, None, n, 0)
        assert y.shape == (7, n) and y.dtype == torch.bfloat16
        w = torch.ops.qerl.nvfp4_dequant(torch.empty(n, k // 2, dtype=torch.uint8),
                                         torch.empty(n, k // 16, dtype=torch.uint8), fgs, torch.float16)
        assert w.shape == (n, k) and w.dtype == torch.float16
        a, b = torch.ops.qerl.nvfp4_repack(torch.empty(n, k // 2, dtype=torch.uint8),
                                           torch.empty(n, k // 16, dtype=torch.uint8))
        assert a.shape == (1, k // 128, 8192) and b.shape == (1, k // 128, 1024)


def test_reference_matches_format_module() -> None:
    """The kernels' torch references and verl_qerl.nvfp4 give the oracle's bits on quantized real weights."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) * 0.1
    q = nvfp4.quantize(w)
    rw = kernels.repack(q.packed, q.scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = oracle_dequantize(q.packed, q.scale, q.global_scale, dtype)
        assert torch.equal(reference.dequantize_ref(q.packed, q.scale, q.global_scale, dtype), want)
        assert torch.equal(nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype), want)
        assert torch.equal(reference.dequantize_repacked_ref(rw.qweight, rw.qscale, q.global_scale, 64, dtype), want)
    x = torch.randn(3, 256).to(torch.bfloat16)
    out = kernels.linear(x, q.packed, q.scale, q.global_scale, kernel_weight=rw)
    assert rel_err(out, reference.linear_f64(x, q.packed, q.scale, q.global_scale)) < 1e-2


def test_build_targets_sm90a_for_hopper() -> None:
    """The JIT build compiles Hopper for sm_90a (wgmma needs it; plain sm_90 has no wgmma) and tells the wgmma
    launcher so; other GPUs keep their own target; an explicit TORCH_CUDA_ARCH_LIST is left to torch."""
    from verl_qerl.kernels import build

    assert build.arch_flags([(9, 0)], None) == ["-gencode=arch=compute_90a,code=sm_90a", build.SM90A_DEFINE]
    assert build.arch_flags([(8, 9), (8, 0)], None) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_89,code=sm_89"]
    assert build.arch_flags([(9, 0)], "9.0") == []
    assert build.arch_flags([(9, 0)], "8.0;9.0a") == [build.SM90A_DEFINE]
    assert "nvfp4_gemm_wgmma.cu" in build.CU_SOURCES and "nvfp4_gemm_wgmma_ss.cu" in build.CU_SOURCES
