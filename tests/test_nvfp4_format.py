"""The NVFP4 number format: bit-exact against compressed-tensors, and its properties.

compressed-tensors 0.17.0 (vLLM's pin) is the oracle here, driven the way llm-compressor's min-max
observer drives it: statistics in the model's dtype. Float32 statistics give the ``fp32`` scale
rule, bfloat16 ones the ``bf16`` rule (llm-compressor 0.14 / compressed-tensors 0.19 themselves are
checked in test_llmcompressor_oracle.py, in their own environment).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_qerl.nvfp4 import (
    DEFAULT_SCALE_RULE,
    E2M1_MAGNITUDES,
    SCALE_RULES,
    NVFP4FormatError,
    cast_to_e2m1_codes,
    dequantize,
    fused_global_scale,
    pack_fp4,
    quantize,
    unpack_fp4,
)

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])
GRID = torch.tensor(E2M1_MAGNITUDES)


STATS_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ct_compress(
    weight: torch.Tensor, global_scale: torch.Tensor | None = None, rule: str = "fp32"
) -> dict[str, torch.Tensor]:
    """What llm-compressor's min-max NVFP4A16 flow produces, through compressed-tensors' own functions.

    The model (and so the observer's statistics and the weight_scale parameter) is in the rule's
    dtype: float32 for ``fp32``, bfloat16 for ``bf16``.
    """
    w = weight.to(STATS_DTYPE[rule])
    n, k = w.shape
    gs = generate_gparam(w.min(), w.max()) if global_scale is None else global_scale
    groups = w.reshape(n, k // 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights, global_scale=gs)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_global_scale": gs}
    return NVFP4PackedCompressor.compress(state, SCHEME)


def ct_decompress(packed, scale, gs) -> torch.Tensor:
    state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}
    return NVFP4PackedCompressor.decompress(state, SCHEME)["weight"]


def stable_seed(*key: object) -> int:
    """A seed from ``key`` that is the same in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("rule, dtype", [("fp32", torch.float32), ("fp32", torch.bfloat16), ("fp32", torch.float16),
                                         ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("shape", [(16, 16), (48, 32), (64, 128), (96, 2048), (7, 160)])
def test_bit_exact_with_compressed_tensors(shape, dtype, rule):
    gen = torch.Generator().manual_seed(stable_seed(shape, dtype, rule))
    for trial in range(5):
        std = float(torch.rand((), generator=gen) * 2 + 1e-3)
        w = (torch.randn(shape, generator=gen) * std).to(dtype)
        if trial == 1:
            w[0, :16] = 0  # an all-zero block
        if trial == 2:
            w[:, 3] *= 50  # outliers
        if trial == 3:
            w[-1, :8] = -0.0  # negative zeros (code 0, not 8, in compressed-tensors)
            w[0, 1] = -1e-30 if dtype != torch.float16 else -1e-7  # a tiny negative (code 8)
        ref = ct_compress(w, rule=rule)
        ours = quantize(w, rule=rule)
        assert_same_bytes(ours.packed, ref["weight_packed"])
        assert_same_bytes(ours.scale, ref["weight_scale"])
        assert_same_bytes(ours.global_scale, ref["weight_global_scale"])
        # compressed-tensors' decompressor reproduces our dequantized weights exactly
        theirs = ct_decompress(ours.packed, ours.scale, ours.global_scale)
        assert torch.equal(theirs, ours.dequantize(theirs.dtype))


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_fused_global_scale_matches_compressed_tensors_rule(rule):
    gen = torch.Generator().manual_seed(1)
    dtype = STATS_DTYPE[rule]
    q, k, v = ((torch.randn(64, 128, generator=gen) * s).to(dtype) for s in (0.02, 0.05, 0.01))
    shared = fused_global_scale([q, k, v], rule=rule)
    # llm-compressor's fused rule: compressed-tensors' global scale of the largest amax of the parts ...
    amax = torch.stack([t.abs().amax() for t in (q, k, v)]).amax()
    assert_same_bytes(shared, generate_gparam(-amax, amax))
    # ... which is the minimum of the parts' own global scales
    parts = [generate_gparam(t.min(), t.max()) for t in (q, k, v)]
    assert torch.equal(shared, parts[1])  # k has the largest amax
    for part in (q, k, v):
        ref = ct_compress(part, shared, rule=rule)
        ours = quantize(part, shared, rule=rule)
        assert_same_bytes(ours.packed, ref["weight_packed"])
        assert_same_bytes(ours.scale, ref["weight_scale"])
        assert torch.equal(ours.global_scale, shared)


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_an_all_zero_part_does_not_force_the_fused_global_scale_to_one(rule):
    q = torch.randn(32, 64) * 0.03
    v = torch.zeros(32, 64)
    assert float(quantize(v, rule=rule).global_scale) == 1.0  # alone, an all-zero weight gets 1.0
    shared = fused_global_scale([q, v], rule=rule)
    assert torch.equal(shared, fused_global_scale([q], rule=rule))  # llm-compressor: from the group's amax
    assert float(shared) > 1000


def test_rules_differ_by_bf16_rounding_and_unknown_rules_are_refused():
    assert DEFAULT_SCALE_RULE == "bf16" and set(SCALE_RULES) == {"bf16", "fp32"}
    w = torch.randn(16, 64).to(torch.bfloat16) * 0.0371
    g32, g16 = (quantize(w, rule=r).global_scale for r in ("fp32", "bf16"))
    assert not torch.equal(g32, g16)
    assert float(g16) == float(g16.to(torch.bfloat16))  # the bf16 rule's global scale is a bf16 value
    assert abs(float(g16) / float(g32) - 1) < 2 ** -7
    with pytest.raises(NVFP4FormatError, match=r"scale_rule='ct019': unknown NVFP4 scale rule; choose one of bf16"):
        quantize(w, rule="ct019")


def test_every_grid_value_round_trips_exactly():
    # Blocks made of grid values times a power of two, each block holding a +-6 so amax_b = 6 * 2^e.
    # With global scale 1, the block scale is exactly 2^e and every value must come back bit-exact.
    values = torch.cat([GRID, -GRID])
    for e in range(-6, 7):
        blocks = []
        for shift in range(16):
            blk = values.roll(shift)
            blk[shift % 16] = 6.0 if shift % 2 else -6.0
            blocks.append(blk)
        w = torch.stack(blocks) * 2.0**e
        q = quantize(w, global_scale=torch.ones(1))
        assert torch.equal(q.dequantize(torch.float32), w), e
        assert torch.equal(q.scale.float(), torch.full((16, 1), 2.0**e))


def test_codes_of_grid_and_ties():
    for i, m in enumerate(E2M1_MAGNITUDES):
        assert int(cast_to_e2m1_codes(torch.tensor([m]))) == i
        if m > 0:  # -0.0 is code 0 (below)
            assert int(cast_to_e2m1_codes(torch.tensor([-m]))) == i | 8
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    for x, want in ties.items():
        for sign in (1, -1):
            code = int(cast_to_e2m1_codes(torch.tensor([sign * x])))
            assert E2M1_MAGNITUDES[code & 7] == want, (sign * x, code)
            assert (code >> 3) == (sign < 0)
    # just off the ties, round to nearest
    eps = 1e-4
    for x, _ in ties.items():
        lo = E2M1_MAGNITUDES[int(cast_to_e2m1_codes(torch.tensor([x - eps]))) & 7]
        hi = E2M1_MAGNITUDES[int(cast_to_e2m1_codes(torch.tensor([x + eps]))) & 7]
        assert lo < x < hi
    assert int(cast_to_e2m1_codes(torch.tensor([100.0]))) == 7  # saturates
    # signs as compressed-tensors gives them: a negative value that rounds to zero keeps its sign (code 8),
    # a negative zero does not (code 0)
    assert cast_to_e2m1_codes(torch.tensor([-1e-30, -0.0, 0.0, -0.2])).tolist() == [8, 0, 0, 8]


def test_rounding_boundaries_are_the_table_midpoints_and_round_as_compressed_tensors():
    """The boundaries are derived from the E2M1 table (the midpoints, ties to the even code); on every
    boundary and one float32 step either side, the codes decode to what compressed-tensors' own E2M1 cast
    gives, for both signs."""
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    from verl_qerl.nvfp4.format import E2M1_BOUNDARIES, E2M1_TIE_ROUNDS_UP

    assert E2M1_BOUNDARIES == (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    assert E2M1_TIE_ROUNDS_UP == (False, True, False, True, False, True, False)
    b = torch.tensor(E2M1_BOUNDARIES, dtype=torch.float32)
    x = torch.cat([torch.nextafter(b, torch.zeros_like(b)), b, torch.nextafter(b, torch.full_like(b, 7.0))])
    x = torch.cat([x, -x])
    theirs = FP4_E2M1_DATA.cast_to_fp4(x.clone())
    ours = torch.cat([GRID, -GRID])[cast_to_e2m1_codes(x).long()]
    assert torch.equal(ours, theirs), torch.stack([x, ours, theirs])[:, ours != theirs]


def _nearest_grid_error(scaled: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """How much further the chosen value is than the nearest grid value (0 for round-to-nearest)."""
    grid = torch.cat([GRID, -GRID]).to(torch.float64)
    best = (scaled.unsqueeze(-1) - grid).abs().amin(-1)
    return (scaled - got).abs() - best


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    kb=st.integers(1, 6),
    log_std=st.floats(-30, 30),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_round_to_nearest_and_error_bound_per_block(n, kb, log_std, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, kb * 16, generator=gen, dtype=torch.float64) * 2.0**log_std).to(dtype)
    q = quantize(w)
    deq = q.dequantize(torch.float64)
    assert torch.isfinite(deq).all()
    eff = (q.scale.to(torch.float64) / q.global_scale.double()).repeat_interleave(16, 1)
    scaled = (w.double() / eff).clamp(-6, 6)
    got = deq / eff
    # round to nearest (tolerance: the quantizer divides in fp32, this check in fp64)
    assert (_nearest_grid_error(scaled, got) <= 1e-5).all()
    # per-block bound: at most half the widest grid gap (1.0 between 4 and 6) plus the clamp overshoot
    assert ((w.double() - deq).abs() <= eff * (1.0 + 1e-6) + 1e-300).all()
    # and no worse than 1/8 of the block's amax-derived step in the relative sense for the largest values
    amax_b = w.double().abs().reshape(n, kb, 16).amax(-1)
    assert ((w.double() - deq).abs().reshape(n, kb, 16).amax(-1) <= amax_b / 6 * 1.07 + 1e-300).all()


def test_zeros_denormals_and_huge_values():
    z = torch.zeros(4, 32)
    q = quantize(z)
    assert float(q.global_scale) == 1.0
    assert torch.equal(q.scale.float(), torch.full((4, 2), 0.125))
    assert torch.equal(q.packed, torch.zeros(4, 16, dtype=torch.uint8))
    assert torch.equal(q.dequantize(torch.float32), z)

    tiny = torch.full((2, 16), 1e-40)  # fp32 subnormals
    tiny[0, 0] = -1e-40
    qt = quantize(tiny)
    assert torch.isfinite(qt.dequantize(torch.float32)).all()
    assert torch.isfinite(qt.global_scale).all()

    mixed = torch.randn(2, 32)
    mixed[0, 5] = 1e-30  # far below the block's step: must become +0
    mixed[0, 6] = -1e-30  # ... or -0 (code 8), as compressed-tensors does
    codes = unpack_fp4(quantize(mixed).packed)
    assert int(codes[0, 5]) == 0 and int(codes[0, 6]) == 8

    huge = torch.randn(3, 48) * 1e37
    qh = quantize(huge)
    deq = qh.dequantize(torch.float32)
    assert torch.isfinite(deq).all()
    rel = (deq.double() - huge.double()).norm() / huge.double().norm()
    assert rel < 0.15


def test_bf16_input_equals_its_fp32_upcast():
    w = torch.randn(32, 64).to(torch.bfloat16)
    a, b = quantize(w), quantize(w.float())
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


def test_pack_unpack_layout_and_inverse():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (5, 32)
    assert torch.equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))  # even element in the low nibble
    assert torch.equal(unpack_fp4(packed), codes)


def test_dequantize_any_float_dtype_and_uint8_scale_view():
    q = quantize(torch.randn(16, 64))
    ref = q.dequantize(torch.float64)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize(q.packed, q.scale, q.global_scale, dt), ref.to(torch.float32).to(dt))
    assert torch.equal(dequantize(q.packed, q.scale.view(torch.uint8), q.global_scale, torch.float32),
                       ref.float())


@pytest.mark.parametrize(
    "weight, match",
    [
        (torch.randn(8, 24), r"K=24 is not a multiple of the NVFP4 block size 16"),
        (torch.randn(8, 8), r"K=8"),
        (torch.randint(0, 5, (8, 32)), r"dtype torch.int64"),
        (torch.randn(32), r"2-D"),
        (torch.randn(2, 8, 32), r"2-D"),
        (torch.ones(4, 32).to(torch.float8_e4m3fn), r"float8_e4m3fn"),
    ],
)
def test_bad_input_is_refused_with_the_name(weight, match):
    with pytest.raises(NVFP4FormatError, match=match) as err:
        quantize(weight, name="model.layers.0.mlp.down_proj.weight")
    assert "model.layers.0.mlp.down_proj.weight" in str(err.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_refused(bad):
    w = torch.randn(4, 32)
    w[1, 7] = bad
    with pytest.raises(NVFP4FormatError, match=r"lm\.x\.weight: contains 1 NaN/Inf"):
        quantize(w, name="lm.x.weight")


def test_shape_mismatch_in_dequantize_and_pack():
    q = quantize(torch.randn(8, 64))
    with pytest.raises(NVFP4FormatError, match="block scale shape"):
        dequantize(q.packed, q.scale[:, :2], q.global_scale)
    with pytest.raises(NVFP4FormatError, match="even K"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(NVFP4FormatError, match="uint8"):
        unpack_fp4(torch.zeros(2, 3, dtype=torch.int32))


def test_bf16_rule_does_not_depend_on_how_a_device_divides():
    """CUDA divides a bf16 tensor by a scalar as ``a * (1 / b)`` in fp32, the CPU as ``a / b``: after the
    bf16 rounding the two agree for every bf16 amax, so the bf16 rule gives the same scales on either."""
    a = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    divided = (a / 6.0).to(torch.bfloat16)
    multiplied = (a * torch.tensor(1 / 6.0, dtype=torch.float32)).to(torch.bfloat16)
    assert torch.equal(divided, multiplied)
    # the same holds for the global scale's two bf16 roundings (1 / amax is correctly rounded in fp32 on both)
    assert torch.equal((1.0 / a).to(torch.bfloat16), torch.reciprocal(a.to(torch.bfloat16)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rule", sorted(SCALE_RULES))
def test_quantize_on_the_gpu_gives_the_cpu_bytes(rule):
    """verl's actor quantizes on its GPU, `qerl-quantize` on the CPU, vLLM at load on its GPU: one format, so the
    same torch ops must give the same bytes on both devices (ties, all-zero blocks, subnormal-sized blocks)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 512, generator=g) * torch.logspace(-6, 2, 300)[:, None]
    w[0, :16] = 0.0                                                  # an all-zero block
    w[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # E2M1 ties at a block max of 6
    w[2] = w[2].to(torch.bfloat16).float()
    for weight in (w, w.to(torch.bfloat16)):
        cpu = quantize(weight, rule=rule)
        gpu = quantize(weight.cuda(), rule=rule)
        assert torch.equal(gpu.packed.cpu(), cpu.packed)
        assert torch.equal(gpu.scale.cpu().view(torch.uint8), cpu.scale.view(torch.uint8))
        assert torch.equal(gpu.global_scale.cpu(), cpu.global_scale)
