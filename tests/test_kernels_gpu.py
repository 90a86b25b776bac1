"""GPU tests of the NVFP4 CUDA kernels (run on the GPU machine; skipped without CUDA).

Every check draws fresh random inputs, compares with a float64 reference of the dequantized
weight, and poisons outputs with NaN first (through the caching allocator: a freed NaN-filled
block of the same size is what the op's output gets), so unwritten elements cannot pass.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from verl_qerl import kernels
from verl_qerl.kernels import GemmMode as Mode
from verl_qerl.kernels import reference
from verl_qerl.testing.gpu import poison
from verl_qerl.testing.nvfp4_random import random_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
TOL = 1e-2  # ||out - ref|| / ||ref||, bf16 operands and output


@pytest.fixture(scope="module", autouse=True)
def _ext() -> None:
    if not kernels.load_extension(verbose=False):
        pytest.fail(f"CUDA extension did not load: {kernels.cuda_unavailable_reason()}")


def rand_nvfp4(n: int, k: int, seed: int, big: bool = False):
    return random_nvfp4(n, k, seed, DEV, big)



def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def capture_graph(f, x_static: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:  # noqa: ANN001
    """Warm ``f`` up outside capture (also on a side stream, as torch's docs require), then capture one call
    into a CUDA graph; returns the graph and its static output."""
    f(x_static)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f(x_static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = f(x_static)
    return graph, y_static


def replay_with_fresh_inputs(graph: torch.cuda.CUDAGraph, x_static: torch.Tensor, times: int = 3):  # noqa: ANN201
    """Yields (i, x_new) after copying fresh random bf16 inputs into ``x_static`` and replaying ``graph``."""
    for i in range(times):
        x_new = torch.randn(*x_static.shape, device=DEV).to(torch.bfloat16)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        yield i, x_new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(48, 80), (4608, 3584), (33 * 16, 16 * 7)])
def test_dequant_bit_exact(n: int, k: int, dtype: torch.dtype) -> None:
    packed, scale, gs = rand_nvfp4(n, k, seed=n * 7 + k)
    poison((n, k), dtype)
    w = kernels.dequantize(packed, scale, gs, dtype)
    ref = reference.dequantize_ref(packed.cpu(), scale.cpu(), gs.cpu(), dtype)
    assert not torch.isnan(w).any()
    assert torch.equal(w.cpu(), ref)
    assert torch.equal(kernels.dequantize(packed, scale.view(torch.uint8), gs, dtype), w)


@pytest.mark.parametrize("n,k", [(48, 128), (3584, 18944 // 4), (272, 640)])
def test_dequant_repacked_equals_dequant(n: int, k: int) -> None:
    packed, scale, gs = rand_nvfp4(n, k, seed=n + k)
    rw = kernels.repack(packed, scale)
    # the GPU repack equals the CPU repack bit for bit
    rw_cpu = kernels.repack(packed.cpu(), scale.cpu())
    assert torch.equal(rw.qweight.cpu(), rw_cpu.qweight) and torch.equal(rw.qscale.cpu(), rw_cpu.qscale)
    for dtype in (torch.bfloat16, torch.float32):
        poison((n, k), dtype)
        a = kernels.dequantize_repacked(rw, gs, n, dtype)
        b = kernels.dequantize(packed, scale, gs, dtype)
        assert not torch.isnan(a).any() and torch.equal(a, b)


GEMM_SHAPES = [
    # (M, N, K): tails in M, N not a multiple of 128, a single stage, long K, the model shapes
    (1, 128, 128),
    (1, 4608, 3584),
    (3, 48, 256),
    (8, 3584, 18944),
    (9, 272, 384),
    (16, 37888, 3584),
    (17, 160, 1280),
    (33, 512, 512),
    (64, 7168, 5120),
    (100, 1040, 768),
    (257, 256, 1024),
    (300, 2048, 512),  # M above the auto threshold: dequantize + cuBLAS
]


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_kernel_vs_f64(m: int, n: int, k: int, with_bias: bool) -> None:
    seed = m * 131 + n * 7 + k + int(with_bias)
    packed, scale, gs = rand_nvfp4(n, k, seed=seed)
    rw = kernels.repack(packed, scale)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16) if with_bias else None
    ref = reference.linear_f64(x, packed, scale, gs, bias)
    poison((m, n), torch.bfloat16)
    out = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, Mode.SPLITK)
    torch.cuda.synchronize()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN outputs"
    err = rel(out, ref)
    assert err <= TOL, f"rel err {err:.3e}"
    # deterministic, and every split count gives the same kind of answer
    out2 = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, Mode.SPLITK)
    assert torch.equal(out, out2)
    for s in (1, 2, 3, 7):
        if s <= k // 128:
            poison((m, n), torch.bfloat16)
            o = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, Mode.SPLITK, s)
            assert not torch.isnan(o).any() and rel(o, ref) <= TOL, f"splits={s}"
    # the dispatching public API and the dequant + cuBLAS path agree too
    assert rel(kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw), ref) <= TOL
    poison((m, n), torch.bfloat16)
    o = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, Mode.DEQUANT_CUBLAS)
    assert not torch.isnan(o).any() and rel(o, ref) <= TOL, "dequant_cublas"


#: fused kernel -> the op mode that forces it (split-K, stream-K where it applies, the two wgmma kernels)
VARIANT_MODES = kernels.GEMM_KERNEL_FORCED_MODES
STREAMK_SHAPES = [
    # (M, N, K), block_m 32 / 64 (where stream-K applies); with the CTAs = SMs schedule these give
    (17, 272, 128),  # 2 whole tiles, N % 256 = 16: the second 128-row half of tile 1 does not exist
    (33, 400, 640),  # 2 tiles x 5 stages over 10 CTAs: every tile summed from 5 partials; N % 256 = 144
    (64, 4352, 3584),  # 17 tiles x 28 stages: partial and whole segments, K not a multiple of the range
    (64, 37888, 3584),  # the 7B gate_up of the NOTES prediction (130 CTAs of 32 stages)
    (100, 1040, 768),  # 2 M-tiles (tail 36 tokens) x 5 N-tiles (last one half), 6 stages
    (200, 528, 896),  # 4 M-tiles (tail 8 tokens) x 3 N-tiles, 7 stages
]


@pytest.mark.parametrize("variant", sorted(VARIANT_MODES))
@pytest.mark.parametrize("m,n,k", STREAMK_SHAPES)
def test_gemm_variants_vs_f64(m: int, n: int, k: int, variant: str) -> None:
    """Both fused kernels on the medium-M shapes: float64 reference, NaN-poisoned outputs (every row < M,
    column < N written, nothing else), bias, and bit-identical repeats (the stream-K partials are summed
    in a fixed order whichever CTA arrives last)."""
    seed = m * 977 + n * 3 + k
    packed, scale, gs = rand_nvfp4(n, k, seed=seed)
    rw = kernels.repack(packed, scale)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16) if m % 2 == 0 else None
    ref = reference.linear_f64(x, packed, scale, gs, bias)
    if variant == "streamk" and torch.cuda.get_device_capability()[0] == 9:
        assert kernels.extension().streamk_grid(m, n) > 0, "stream-K must apply on Hopper for block_m 32 / 64"
    if variant.startswith("wgmma") and torch.cuda.get_device_capability() == (9, 0):
        got = kernels.extension().gemm_choice(m, n, k, VARIANT_MODES[variant])
        want = "wgmma_rs" if variant == "wgmma_wide" and not 65 <= m <= 128 else variant  # (the same kernel there)
        assert got == want, f"{variant} must run {want} on sm_90, runs {got}"
    mode = VARIANT_MODES[variant]
    outs = []
    for _ in range(3):
        poison((m, n), torch.bfloat16)
        outs.append(torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, mode))
    torch.cuda.synchronize()
    out = outs[0]
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN outputs"
    err = rel(out, ref)
    assert err <= TOL, f"{variant}: rel err {err:.3e}"
    for o in outs[1:]:
        assert torch.equal(o, out), f"{variant}: not deterministic"


def check_forced_mode(rw, gs: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor,  # noqa: ANN001
                      mode: int) -> None:
    """The op in `mode` on x (cast to bf16) against the float64 reference x @ w^T + b: NaN-poisoned outputs all
    written, within TOL, bit-identical on a second run."""
    x = x.to(torch.bfloat16)
    m, n = x.shape[0], w.shape[0]
    ref = x.double() @ w.T + (b.double() if b is not None else 0.0)
    outs = []
    for _ in range(2):
        poison((m, n), torch.bfloat16)
        outs.append(torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, b, n, mode))
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0]).any(), f"M={m}: unwritten (NaN-poisoned) or NaN outputs"
    err = rel(outs[0], ref)
    assert err <= TOL, f"M={m}: rel err {err:.3e}"
    assert torch.equal(outs[0], outs[1]), f"M={m}: not deterministic"


#: the Hopper wgmma kernels: variant name -> forced op mode (register-A; register-A with the wide kernel's 128-token
#: tiles at M = 65-128; both operands in shared memory)
WGMMA_MODES = {"wgmma_rs": Mode.WGMMA_RS, "wgmma_wide": Mode.WGMMA_WIDE, "wgmma_ss": Mode.WGMMA_SS}


def _needs_wgmma(variant: str = "wgmma_rs") -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernels run on sm_90 (Hopper) only")
    got = kernels.extension().gemm_choice(100 if variant == "wgmma_wide" else 64, 256, 128, WGMMA_MODES[variant])
    assert got == variant, f"sm_90 device but no sm_90a {variant} build (runs {got})"


WGMMA_SHAPES = [
    # (N, K): Qwen2.5-7B qkv, an odd number of 16-row blocks with a half 256-row tile (N % 256 = 112), a single
    # stage, other hidden sizes than Qwen2.5's (Llama-7B-like 4096 / 11008, Qwen2.5-0.5B's 896), and N = 1008
    # (the staged bf16 tile store's 16-byte pieces end at N inside the last, 112-row tile; K = 384: 3 stages)
    (4608, 3584),
    (1136, 640),
    (272, 128),
    (11008, 4096),
    (896, 896),
    (1008, 384),
]


@pytest.mark.parametrize("variant", sorted(WGMMA_MODES))
@pytest.mark.parametrize("n,k", WGMMA_SHAPES)
@contextlib.contextmanager
def wgmma_wide_min_m(m: int, wide_fit: bool = True):  # noqa: ANN201
    """The register-A wgmma kernel's wide tiles start at M = ``m`` inside the block, 192-token ones allowed where
    they pad M less or not (``wide_fit``: 160 / 192 / 224 fitted to M, or 256 only); both restored after."""
    ext = kernels.extension()
    prev = ext.set_wgmma_wide_min_m(m)
    prev_fit = ext.set_wgmma_wide_fit(wide_fit)
    try:
        yield
    finally:
        ext.set_wgmma_wide_min_m(prev)
        ext.set_wgmma_wide_fit(prev_fit)


#: M values every wgmma test covers: both sides of the 64 / 128 / 160 / 192 / 224 / 256-token tile boundaries, tails,
#: a large M; the 256-token tiles (wgmma_rs_t256) with their last tile as 1, 2 and 3 of its 64-token part boxes (129 /
#: 160, 384, 192) and both sides of the 192-token edge where it loads the whole 256-token box again (192 / 193, 448 /
#: 449, 255); the tiles fitted to M (wgmma_rs): 160 at 129 / 160 / 300 / 449 / 800, 192 at 161 / 192 / 384, 224 at
#: 193 / 224 / 448, 256 at 225 / 255 / 256 / 1000 / 4096
WGMMA_MS = (1, 7, 63, 64, 65, 128, 129, 160, 161, 192, 193, 224, 225, 255, 256, 300, 384, 448, 449, 800, 1000, 4096)


@pytest.mark.parametrize("variant", sorted(WGMMA_MODES) + ["wgmma_rs_t128", "wgmma_rs_t256", "wgmma_rs_streamk"])
@pytest.mark.parametrize("n,k", WGMMA_SHAPES)
def test_wgmma_kernel_every_m(n: int, k: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hopper wgmma kernels (modes wgmma_rs, wgmma_ss) at M from 1 to 4096 (every token tile: 64, 128 and the
    register-A kernel's 192 / 256 from M = 129, ``wgmma_rs_t128``: that kernel held at 128-token tiles,
    ``wgmma_rs_t256``: its wide tiles held at 256 tokens; tails in M;
    whole and partial stream-K segments, and the register-A kernel's tiles split over thread-block clusters where its
    tiles are few; ``wgmma_rs_streamk``: the same with the cluster split off, ``QERL_WGMMA_CLUSTER=0``): float64
    reference, NaN-poisoned outputs, bias, bit-identical repeats."""
    if variant == "wgmma_rs_streamk":
        monkeypatch.setenv("QERL_WGMMA_CLUSTER", "0")
        variant = "wgmma_rs"
    narrow = variant == "wgmma_rs_t128"
    only_256 = variant == "wgmma_rs_t256"
    variant = "wgmma_rs" if narrow or only_256 else variant
    _needs_wgmma(variant)
    mode = WGMMA_MODES[variant]
    packed, scale, gs = rand_nvfp4(n, k, seed=n + k)
    rw = kernels.repack(packed, scale)
    g = torch.Generator(device=DEV).manual_seed(n * 3 + k)
    bias = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    w = reference.dequantize_f64(packed, scale, gs)
    with wgmma_wide_min_m(1 << 40 if narrow else 129, wide_fit=not only_256):
        for m in WGMMA_MS:
            if m * n > 4096 * 4608 or (narrow and m < 129):
                continue
            check_forced_mode(rw, gs, w, bias if m % 2 else None, torch.randn(m, k, device=DEV, generator=g), mode)


@pytest.mark.parametrize(("m", "n", "k", "kernel"), [
    (64, 4608, 3584, "nvfp4_gemm_wgmma_kernel<64,"),
    (128, 4608, 3584, "nvfp4_gemm_wgmma_kernel<128,"),
    (200, 4608, 3584, "nvfp4_gemm_wgmma_wide_kernel<224,"),    # a part token tile: the sums stop at M
    (256, 3584, 18944, "nvfp4_gemm_wgmma_wide_kernel<256,"),   # 7B down: 37 stages per rank (split up to 64)
    (129, 3584, 3584, "nvfp4_gemm_wgmma_wide_kernel<160,"),    # one token past 128, a 160-token tile: 4 ranks
    (176, 4608, 3584, "nvfp4_gemm_wgmma_wide_kernel<192,"),
])
def test_wgmma_few_tiles_run_the_cluster_split(m: int, n: int, k: int, kernel: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Few-tile GEMMs (7B qkv / o / down shapes at M = 64-256) run the cluster split-K (one launch of the cluster
    instantiation), and with ``QERL_WGMMA_CLUSTER=0`` stream-K; both within the kernels' rounding of the float64
    reference (the sums are taken in another order: not bit-equal), the cluster's bias and token rows past M too
    (the output is poisoned first: a row it skips would stay NaN)."""
    import re

    from verl_qerl.testing.gpu import kernels_launched

    _needs_wgmma()
    packed, scale, gs = rand_nvfp4(n, k, seed=m)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    bias = (torch.randn(n, device=DEV) * 0.1).to(torch.bfloat16) if m % 2 else None

    def run() -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, int(Mode.WGMMA_RS))

    pattern = re.escape(kernel) + r"\s*"
    names = kernels_launched(run)
    assert len(names) == 1 and re.search(pattern + "true>", names[0].replace(" ", "")), names
    poison((m, n), torch.bfloat16)
    clustered = run()
    assert not torch.isnan(clustered).any(), "unwritten (NaN-poisoned) or NaN outputs"
    monkeypatch.setenv("QERL_WGMMA_CLUSTER", "0")
    names = kernels_launched(run)
    assert len(names) == 1 and re.search(pattern + "false>", names[0].replace(" ", "")), names
    ref = reference.linear_f64(x, packed, scale, gs, bias)
    assert rel(clustered, ref) <= TOL and rel(run(), ref) <= TOL


def test_wgmma_wide_min_m_refuses_small_m() -> None:
    """The tile knob refuses an M the 64-token tiles own, naming the knob; a good value is taken and returned."""
    _needs_wgmma()
    ext = kernels.extension()
    with pytest.raises(RuntimeError, match="set_wgmma_wide_min_m: M must be >= 65"):
        ext.set_wgmma_wide_min_m(64)
    with wgmma_wide_min_m(200):
        assert ext.set_wgmma_wide_min_m(200) == 200


@pytest.mark.parametrize("m", [129, 160, 161, 192, 193, 224, 225, 256, 300, 384, 448, 449, 1024])
def test_wgmma_wide_tile_by_m(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide kernel runs the 160-, 192-, 224- or 256-token tiles whose tiles pad M least (the rule
    benchmarks/kernel_variants.py's wide_tile mirrors for the benchmark), 256 with the knob off; both outputs
    within the rounding of the float64 reference."""
    import re

    from verl_qerl.testing.gpu import kernels_launched
    from verl_qerl.testing.scripts import load_script

    wide_tile = load_script("benchmarks/kernel_variants.py").wide_tile
    _needs_wgmma()
    monkeypatch.setenv("QERL_WGMMA_CLUSTER", "0")  # one kernel name per launch (stream-K)
    n, k = 1024, 1280
    packed, scale, gs = rand_nvfp4(n, k, seed=m)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    ref = reference.linear_f64(x, packed, scale, gs, None)

    def run() -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, int(Mode.WGMMA_RS))

    for wide_fit, tokens in ((True, wide_tile(m)), (False, 256)):
        with wgmma_wide_min_m(129, wide_fit=wide_fit):
            names = [nm.replace(" ", "") for nm in kernels_launched(run)]
            assert len(names) == 1 and re.search(rf"nvfp4_gemm_wgmma_wide_kernel<{tokens},", names[0]), \
                (m, wide_fit, names)
            assert rel(run(), ref) <= TOL


@pytest.mark.parametrize("m", [96, 300])
@pytest.mark.parametrize("variant", sorted(WGMMA_MODES))
def test_wgmma_graph_capture(variant: str, m: int) -> None:
    """The wgmma kernels with stream-K partials (workspace, shared semaphores) capture and replay in a CUDA graph
    (M = 300: the register-A kernel's 192-token tiles)."""
    _needs_wgmma(variant)
    n, k = 3584, 3584
    packed, scale, gs = rand_nvfp4(n, k, seed=41)
    rw = kernels.repack(packed, scale)
    x_static = torch.randn(m, k, device=DEV).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, WGMMA_MODES[variant])

    graph, y_static = capture_graph(f, x_static)
    for i, x_new in replay_with_fresh_inputs(graph, x_static):
        assert rel(y_static, reference.linear_f64(x_new, packed, scale, gs)) <= TOL, f"replay {i}"


def _needs_decode_tma() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the copy-engine decode kernel runs on sm_90 (Hopper) only")
    got = kernels.extension().gemm_choice(1, 256, 128, Mode.DECODE_TMA)
    assert got == "decode_tma", f"sm_90 device but no sm_90a decode_tma build (runs {got})"


#: M values of the decode kernel (block_m 8: 1..8, block_m 16: 9..16) and past it (mode decode_tma runs stream-K /
#: split-K there)
DECODE_MS = (1, 2, 7, 8, 9, 15, 16, 17, 40)


@pytest.mark.parametrize("n,k", WGMMA_SHAPES + [(37888, 3584)])
def test_decode_tma_kernel_every_m(n: int, k: int) -> None:
    """The copy-engine decode kernel (mode decode_tma) at M = 1..16 on Qwen2.5's and other hidden sizes, a single
    stage, an odd number of 16-row blocks and 7B gate_up (296 tiles: ranges crossing tiles, partial segments combined
    by the fix-up): float64 reference, NaN-poisoned outputs, bias, bit-identical repeats; past M = 16 the mode runs
    what gemm_choice names."""
    _needs_decode_tma()
    ext = kernels.extension()
    packed, scale, gs = rand_nvfp4(n, k, seed=n * 5 + k)
    rw = kernels.repack(packed, scale)
    g = torch.Generator(device=DEV).manual_seed(n + 7 * k)
    bias = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    w = reference.dequantize_f64(packed, scale, gs)
    for m in DECODE_MS:
        want = "decode_tma" if m <= 16 else ("streamk" if ext.streamk_grid(m, n) > 0 else "splitk")
        assert ext.gemm_choice(m, n, k, Mode.DECODE_TMA) == want, m
        check_forced_mode(rw, gs, w, bias if m % 2 else None, torch.randn(m, k, device=DEV, generator=g),
                          Mode.DECODE_TMA)


@pytest.mark.parametrize("m", [1, 16])
def test_decode_tma_graph_capture(m: int) -> None:
    """The decode kernel (tensor map of the activations encoded at capture, stream-K partials and shared counters)
    captures and replays in a CUDA graph with fresh inputs."""
    _needs_decode_tma()
    n, k = 3584, 18944  # 7B down: 28 tiles, 148 stages each, split over many CTAs
    packed, scale, gs = rand_nvfp4(n, k, seed=43)
    rw = kernels.repack(packed, scale)
    x_static = torch.randn(m, k, device=DEV).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, Mode.DECODE_TMA)

    graph, y_static = capture_graph(f, x_static)
    for i, x_new in replay_with_fresh_inputs(graph, x_static):
        assert rel(y_static, reference.linear_f64(x_new, packed, scale, gs)) <= TOL, f"replay {i}"


@pytest.mark.parametrize("m", [1, 5, 16])
def test_decode_tma_lora_epilogue(m: int) -> None:
    """qerl::nvfp4_gemm_lora in mode decode_tma adds the LoRA term (three slices, masked tokens) in the decode kernel's
    epilogue, also at M = 9-16 where split-K has none: float64 reference of base + mask * expand, NaN-poisoned
    outputs, bit-identical repeats, within bf16 of mode splitk's result; operands the epilogue cannot take (float32
    shrunk) run the GEMM and the expand after."""
    _needs_decode_tma()
    ext = kernels.extension()
    n, k, r = 4608, 3584, 32
    packed, scale, gs = rand_nvfp4(n, k, seed=44 + m)
    rw = kernels.repack(packed, scale)
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    shrunk = torch.randn(m, 3 * r, device=DEV, generator=g).to(torch.bfloat16)
    bounds = [0, 3584, 4096, 4608]
    # block-diagonal B (slice s's rows use only columns s r .. s r + r): the epilogues read the diagonal blocks, the
    # expand after the GEMM multiplies by all of B (the form vLLM's fast path builds)
    lora_b = torch.zeros(n, 3 * r, device=DEV, dtype=torch.bfloat16)
    for s_i in range(3):
        lora_b[bounds[s_i]:bounds[s_i + 1], s_i * r:(s_i + 1) * r] = (
            torch.randn(bounds[s_i + 1] - bounds[s_i], r, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    mask = (torch.arange(m, device=DEV) % 3 != 1).to(torch.bfloat16)  # some tokens without the adapter
    assert ext.lora_epilogue_runs(m, n, k, Mode.DECODE_TMA)
    expand = torch.zeros(m, n, dtype=torch.float64, device=DEV)
    for s_i in range(3):
        cols = slice(bounds[s_i], bounds[s_i + 1])
        expand[:, cols] = shrunk[:, s_i * r:(s_i + 1) * r].double() @ lora_b[cols, s_i * r:(s_i + 1) * r].double().T
    ref = reference.linear_f64(x, packed, scale, gs, bias) + mask.double()[:, None] * expand

    def lora(s: torch.Tensor, mode: int) -> torch.Tensor:
        poison((m, n), torch.bfloat16)
        return torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, bias, n, s, lora_b, mask, bounds,
                                              int(mode), 0)

    outs = [lora(shrunk, Mode.DECODE_TMA) for _ in range(2)]
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0]).any(), "unwritten (NaN-poisoned) or NaN outputs"
    assert rel(outs[0], ref) <= TOL and torch.equal(outs[0], outs[1])
    assert rel(outs[0], lora(shrunk, Mode.SPLITK).double()) <= TOL
    assert rel(lora(shrunk.float(), Mode.DECODE_TMA), ref) <= TOL


#: gemm_choice's answer -> the op mode that forces that kernel
CHOICE_MODES = {"splitk": Mode.SPLITK, "streamk": Mode.STREAMK, "wgmma_rs": Mode.WGMMA_RS,
                "dequant_cublas": Mode.DEQUANT_CUBLAS, "wgmma_ss": Mode.WGMMA_SS, "decode_tma": Mode.DECODE_TMA}


@pytest.fixture()
def rule_dispatch():  # noqa: ANN201
    """Auto mode without the calibration table (the rule-based dispatch other GPUs use); the table is put back
    afterwards."""
    from verl_qerl.kernels import dispatch

    ext = kernels.extension()
    ext.set_dispatch_table([])
    yield ext
    dispatch.install(ext, tuple(torch.cuda.get_device_capability()))


def test_auto_follows_the_calibration_table() -> None:
    """Auto mode on a device with a table runs the measured kernel of the nearest weight shape and M (log
    distance), bit-equal to that kernel forced; without a table it falls back to the rules."""
    from verl_qerl.kernels import dispatch

    ext = kernels.extension()
    names = list(ext.gemm_kernel_names())
    assert names == list(kernels.GEMM_KERNEL_NAMES) == ["splitk", "streamk", "wgmma_rs", "dequant_cublas", "wgmma_ss",
                                                        "decode_tma"]
    # the binding's mode table is the one Python parsed from cuda/gemm_modes.h
    assert dict(ext.gemm_modes()) == kernels.GEMM_MODES and set(CHOICE_MODES) == set(names)
    n, k = 1136, 640
    packed, scale, gs = rand_nvfp4(n, k, seed=5)
    rw = kernels.repack(packed, scale)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    wg = "wgmma_rs" if hopper else "streamk"
    wg_ss = "wgmma_ss" if hopper else "streamk"
    table = [[n, k, 1, "splitk"], [n, k, 64, wg], [n, k, 256, wg_ss], [n, k, 1024, "dequant_cublas"],
             [99968, 99968, 64, "splitk"]]
    try:
        ext.set_dispatch_table([[a, b, c, names.index(d)] for a, b, c, d in table])
        for m, want in ((1, "splitk"), (5, "splitk"), (40, wg), (64, wg), (200, wg_ss), (500, wg_ss),
                        (800, "dequant_cublas"), (3000, "dequant_cublas")):
            assert ext.gemm_choice(m, n, k, Mode.AUTO) == want, m
            # another shape near this one (log distance) follows it, not the far-away point
            assert ext.gemm_choice(m, n + 16, k, Mode.AUTO) == want, m
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            auto = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, Mode.AUTO)
            forced = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, CHOICE_MODES[want])
            assert torch.equal(auto, forced), m
        with pytest.raises(RuntimeError, match="unknown kernel id"):
            ext.set_dispatch_table([[n, k, 1, 9]])
        ext.set_dispatch_table([])
        assert ext.table_pick(64, n, k) == -1
    finally:
        dispatch.install(ext, tuple(torch.cuda.get_device_capability()))
    if torch.cuda.get_device_capability() == (9, 0) and dispatch.DEFAULT_TABLE.is_file():
        shipped = dispatch.load_table(dispatch.DEFAULT_TABLE, names)
        for pn, pk, pm, kern in shipped["points"]:
            assert ext.gemm_choice(pm, pn, pk, Mode.AUTO) == kern, (pn, pk, pm)


def test_streamk_env_switch_dispatch_and_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """QERL_GEMM_KERNEL=streamk makes linear() run the stream-K kernel (bit-equal to mode streamk), =splitk (and its
    former name v5) runs split-K (bit-equal to mode splitk), the default (auto) runs what ``gemm_choice`` reports
    for the shape, M <= 16 keeps split-K either way, and the stream-K path captures in a graph."""
    n, k = 2320, 1408  # 10 N-tiles (last one half), 11 stages
    packed, scale, gs = rand_nvfp4(n, k, seed=77)
    rw = kernels.repack(packed, scale)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    ext = kernels.extension()
    for m in (8, 24, 64, 120):
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        sp = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, Mode.SPLITK)
        sk = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, Mode.STREAMK)
        monkeypatch.delenv("QERL_GEMM_KERNEL", raising=False)
        auto = kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw)
        forced_mode = CHOICE_MODES[ext.gemm_choice(m, n, k, Mode.AUTO)]
        assert torch.equal(auto, torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, bias, n, forced_mode))
        for name in ("splitk", "v5"):
            monkeypatch.setenv("QERL_GEMM_KERNEL", name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the former name's warning (tested on CPU)
                assert torch.equal(kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw), sp), name
        monkeypatch.setenv("QERL_GEMM_KERNEL", "streamk")
        assert torch.equal(kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw), sk)
        if m <= 16:
            assert torch.equal(sk, sp)  # stream-K does not apply: split-K ran
        assert rel(sk, reference.linear_f64(x, packed, scale, gs, bias)) <= TOL
    monkeypatch.setenv("QERL_GEMM_KERNEL", "nope")
    with pytest.raises(ValueError, match="QERL_GEMM_KERNEL"):
        kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw)
    monkeypatch.setenv("QERL_GEMM_KERNEL", "streamk")
    monkeypatch.setenv("QERL_STREAMK_MIN_TILES_PER_CTA", "0,25")  # a typo the C++ atof would read as 0
    with pytest.raises(ValueError, match="QERL_STREAMK_MIN_TILES_PER_CTA"):
        kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw)
    monkeypatch.delenv("QERL_STREAMK_MIN_TILES_PER_CTA")

    m = 48
    x_static = torch.randn(m, k, device=DEV).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw)

    graph, y_static = capture_graph(f, x_static)
    for i, x_new in replay_with_fresh_inputs(graph, x_static):
        assert torch.equal(y_static, torch.ops.qerl.nvfp4_gemm(x_new, rw.qweight, rw.qscale, gs, bias, n,
                                                               Mode.STREAMK)), i


def test_auto_picks_streamk_by_shape(rule_dispatch) -> None:  # noqa: ANN001
    """Auto runs stream-K exactly where its 256-row tiles number >= the tuned fraction of its CTAs or
    each CTA's range has >= 24 K stages: the 7B gate_up shape (148 tiles at M = 64) and the 32B down shape
    (20 tiles, 33 stages per CTA) take stream-K, 7B qkv (18 tiles, 4 stages per CTA) and 7B down (14 tiles, 16
    stages) split-K, M <= 16 split-K and M above the threshold dequant + cuBLAS; moving the tunable flips the choice,
    and the result is bit-equal to the forced kernel the choice names."""
    ext = rule_dispatch
    gemm_max_m, penalty, min_tiles, min_stages = ext.get_tuning()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = ext.streamk_grid(64, 37888)
    if grid == 0:
        pytest.skip("stream-K does not apply on this device (shared memory per CTA)")
    assert min_tiles == pytest.approx(0.25) and grid == sms  # documented default; one CTA per SM
    # tiles of 256 rows x block_m tokens, as the kernel's schedule counts them (block_m 8 / 16: never stream-K)
    assert [ext.streamk_tiles(m, 37888) for m in (64, 128, 33, 32, 17, 16, 1)] == [148, 296, 148, 148, 148, 0, 0]
    assert ext.streamk_tiles(64, 4608) == 18 and ext.streamk_tiles(40, 1040) == 5
    assert ext.gemm_choice(64, 37888, 3584, Mode.AUTO) == "streamk"
    assert ext.gemm_choice(64, 4608, 3584, Mode.AUTO) == "splitk"
    assert min_stages == 24
    if sms == 132:  # H100 / H200 SXM: 20 x 216 / 132 = 33 and 14 x 148 / 132 = 16 stages per CTA
        assert ext.gemm_choice(64, 5120, 27648, Mode.AUTO) == "streamk"
        assert ext.gemm_choice(64, 3584, 18944, Mode.AUTO) == "splitk"
    assert ext.gemm_choice(16, 37888, 3584, Mode.AUTO) == "splitk"
    assert ext.gemm_choice(int(gemm_max_m) + 1, 37888, 3584, 0) == "dequant_cublas"
    assert ext.gemm_choice(64, 37888, 3584, Mode.AUTO_SPLITK) == "splitk"
    assert ext.gemm_choice(64, 4608, 3584, Mode.AUTO_STREAMK) == "streamk"
    m, n, k = 40, 1040, 768  # 5 tiles of 256 rows
    packed, scale, gs = rand_nvfp4(n, k, seed=91)
    rw = kernels.repack(packed, scale)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    forced = {c: torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, mode)
              for c, mode in (("splitk", Mode.SPLITK), ("streamk", Mode.STREAMK))}
    try:
        for value, want in ((0.0, "streamk"), (5 / grid, "streamk"), (5 / grid + 1e-6, "splitk"), (1e9, "splitk")):
            ext.set_tuning(-1, -1, value)
            assert ext.gemm_choice(m, n, k, Mode.AUTO) == want, value
            assert torch.equal(torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, Mode.AUTO),
                               forced[want])
    finally:
        ext.set_tuning(-1, -1, min_tiles)
    assert ext.get_tuning()[2] == min_tiles


def test_gemm_large_values_finite() -> None:
    m, n, k = 16, 256, 2048
    packed, scale, gs = rand_nvfp4(n, k, seed=5, big=True)
    rw = kernels.repack(packed, scale)
    x = (torch.randn(m, k, device=DEV) * 30).to(torch.bfloat16)
    out = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, n, Mode.SPLITK)
    ref = reference.linear_f64(x, packed, scale, gs)
    assert torch.isfinite(out).all() and rel(out, ref) <= TOL


def test_fp16_and_fp32_activations_use_dequant_path() -> None:
    n, k = 256, 512
    packed, scale, gs = rand_nvfp4(n, k, seed=8)
    rw = kernels.repack(packed, scale)
    for dt in (torch.float16, torch.float32):
        x = torch.randn(5, k, device=DEV, dtype=dt)
        out = kernels.linear(x, packed, scale, gs, kernel_weight=rw)
        assert out.dtype == dt and rel(out, reference.linear_f64(x, packed, scale, gs)) <= TOL


def test_autograd_gpu() -> None:
    n, k = 256, 512
    packed, scale, gs = rand_nvfp4(n, k, seed=12)
    rw = kernels.repack(packed, scale)
    x = torch.randn(6, k, device=DEV).to(torch.bfloat16).requires_grad_()
    out = kernels.linear(x, packed, scale, gs, kernel_weight=rw)
    gr = torch.randn_like(out)
    out.backward(gr)
    w = reference.dequantize_f64(packed, scale, gs)
    assert rel(x.grad, gr.double() @ w) <= TOL


def test_cuda_graph_capture_and_compile() -> None:
    m, n, k = 4, 3584, 3584  # splits > 1 (semaphores) inside the graph
    packed, scale, gs = rand_nvfp4(n, k, seed=31)
    rw = kernels.repack(packed, scale)
    bias = torch.randn(n, device=DEV).to(torch.bfloat16)
    x_static = torch.randn(m, k, device=DEV).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, packed, scale, gs, bias, kernel_weight=rw) * 2.0

    graph, y_static = capture_graph(f, x_static)
    for i, x_new in replay_with_fresh_inputs(graph, x_static):
        ref = 2.0 * reference.linear_f64(x_new, packed, scale, gs, bias)
        assert rel(y_static, ref) <= TOL, f"replay {i}"

    # the dequant + cuBLAS path (M >= 256) captures too
    mb, nb, kb = 320, 2048, 512
    pb, sb, gb = rand_nvfp4(nb, kb, seed=32)
    rwb = kernels.repack(pb, sb)
    xb_static = torch.randn(mb, kb, device=DEV).to(torch.bfloat16)
    torch.ops.qerl.nvfp4_gemm(xb_static, rwb.qweight, rwb.qscale, gb, None, nb, Mode.DEQUANT_CUBLAS)
    gb_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gb_graph):
        yb_static = torch.ops.qerl.nvfp4_gemm(xb_static, rwb.qweight, rwb.qscale, gb, None, nb, Mode.DEQUANT_CUBLAS)
    xb_new = torch.randn(mb, kb, device=DEV).to(torch.bfloat16)
    xb_static.copy_(xb_new)
    gb_graph.replay()
    torch.cuda.synchronize()
    assert rel(yb_static, reference.linear_f64(xb_new, pb, sb, gb)) <= TOL

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for mm in (1, 7, 40):
        x = torch.randn(mm, k, device=DEV).to(torch.bfloat16)
        assert rel(cf(x), 2.0 * reference.linear_f64(x, packed, scale, gs, bias)) <= TOL

    cg = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        y = cg(x).clone()
        assert rel(y, 2.0 * reference.linear_f64(x, packed, scale, gs, bias)) <= TOL


def test_zz_refusals_and_other_shapes() -> None:
    """Shapes the kernel layout cannot hold are refused with the shape named; linear() still
    computes them through dequantize + cuBLAS. (Last in the file: it exercises C++ errors.)"""
    with pytest.raises(kernels.LayoutError, match="K=192"):
        kernels.repack(*rand_nvfp4(64, 192, seed=1)[:2])
    with pytest.raises(kernels.LayoutError, match="N=24"):
        kernels.repack(*rand_nvfp4(24, 128, seed=2)[:2])
    packed, scale, gs = rand_nvfp4(64, 192, seed=3)
    x = torch.randn(4, 192, device=DEV).to(torch.bfloat16)
    assert rel(kernels.linear(x, packed, scale, gs), reference.linear_f64(x, packed, scale, gs)) <= TOL
    packed, scale, gs = rand_nvfp4(64, 256, seed=4)
    rw = kernels.repack(packed, scale)
    with pytest.raises(RuntimeError, match="K="):
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 128, device=DEV).to(torch.bfloat16), rw.qweight, rw.qscale,
                                  gs, None, 64, Mode.SPLITK)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 256, device=DEV).half(), rw.qweight, rw.qscale, gs, None, 64,
                                  Mode.SPLITK)
    # modes and split counts outside cuda/gemm_modes.h are refused by name
    x = torch.randn(4, 256, device=DEV).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"unknown mode 3 \(0 auto, 1 splitk"):
        torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, 64, 3)
    with pytest.raises(RuntimeError, match="unknown mode 18"):  # the former 16 + splits encoding
        torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, 64, 18)
    with pytest.raises(RuntimeError, match="splits=2 .* needs mode 1 \\(splitk\\)"):
        torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, None, 64, Mode.STREAMK, 2)
    with pytest.raises(RuntimeError, match="unknown mode 10"):
        kernels.extension().gemm_choice(4, 64, 256, 10)
