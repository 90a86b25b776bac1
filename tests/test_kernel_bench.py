"""benchmarks/kernel.py's pure pieces on CPU: the vLLM Marlin column's skip logic, its correctness gate
(kernel_marlin.py), per-layer sums, ratios, targets, the result file name and the printed table
(kernel_results.py), the fused-kernel variants (kernel_variants.py), --profile's modes and the ncu reader
(kernel_diagnostics.py), and the command line's options (kernel.py)."""

from __future__ import annotations

import collections
import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from verl_qerl.nvfp4 import dequantize
from verl_qerl.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kb():
    """benchmarks/kernel.py: the command line and the timing run."""
    return load_script("benchmarks/kernel.py", "kernel_bench")


@pytest.fixture(scope="module")
def kb_marlin():
    """benchmarks/kernel_marlin.py: the vLLM Marlin FP4 anchor."""
    return load_script("benchmarks/kernel_marlin.py")


@pytest.fixture(scope="module")
def kb_results():
    """benchmarks/kernel_results.py: sums, targets, table, result file name, stream-K calibration."""
    return load_script("benchmarks/kernel_results.py")


@pytest.fixture(scope="module")
def kb_diag():
    """benchmarks/kernel_diagnostics.py: --sanitize, --profile, the ncu / SASS listing readers."""
    return load_script("benchmarks/kernel_diagnostics.py")


@pytest.fixture(scope="module")
def kb_variants():
    """benchmarks/kernel_variants.py: the fused-kernel variants."""
    return load_script("benchmarks/kernel_variants.py")


class FakeMarlin(types.SimpleNamespace):
    """Stands in for vllm's marlin_utils_fp4 with the same call contract (weight, scale, multiplier in;
    ``layer.weight`` / ``weight_scale`` / ``weight_global_scale`` / ``workspace`` out)."""

    def __init__(self, swap_nibbles: bool = False, supported: bool = True, fail: bool = False):
        super().__init__(swap_nibbles=swap_nibbles, supported=supported, fail=fail, prepared=[])

    def is_fp4_marlin_supported(self) -> bool:
        return self.supported

    def prepare_fp4_layer_for_marlin(self, layer) -> None:
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        assert layer.weight.dtype == torch.uint8 and tuple(layer.weight.shape) == (n, k // 2)
        assert layer.weight_scale.dtype == torch.float8_e4m3fn and tuple(layer.weight_scale.shape) == (n, k // 16)
        assert layer.weight_global_scale.dtype == torch.float32 and layer.weight_global_scale.numel() == 1
        assert layer.params_dtype == torch.bfloat16
        if self.fail:
            raise RuntimeError("marlin repack failed\nsecond line")
        packed = layer.weight.data
        if self.swap_nibbles:  # a wrong layout: must be caught by the check, never timed
            packed = (packed >> 4) | (packed << 4)
        divisor = 1.0 / layer.weight_global_scale.data.reshape(1)
        w = dequantize(packed, layer.weight_scale.data, divisor, torch.bfloat16)
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        layer.workspace = torch.zeros(4, dtype=torch.int32)
        self.prepared.append((n, k))

    def apply_fp4_marlin_linear(self, input, weight, weight_scale, weight_global_scale, workspace, size_n, size_k,
                                bias=None):
        assert weight.shape == (size_n, size_k) and workspace is not None
        return F.linear(input, weight)


def _q4(n: int, k: int, sets: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(sets):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scale = (torch.rand(n, k // 16, generator=g) * 2 + 0.5).to(torch.float8_e4m3fn)
        out.append((packed, scale, torch.tensor([100.0])))
    return out


# --- skip logic -------------------------------------------------------------------------------------

def _importer(fail: dict[str, BaseException] | None = None, module=None):
    fail = fail or {}

    def imp(name: str):
        if name in fail:
            raise fail[name]
        return module if name.endswith("marlin_utils_fp4") else types.SimpleNamespace(__version__="0.24.0")
    return imp


def test_load_marlin_skips_without_gpu_or_old_gpu(kb_marlin):
    assert kb_marlin.load_marlin(None, importer=_importer(), has_op=lambda n: True) == (None, "no CUDA GPU")
    mod, reason = kb_marlin.load_marlin((7, 0), importer=_importer(), has_op=lambda n: True)
    assert mod is None and "7.0" in reason and "7.5" in reason


@pytest.mark.parametrize("failing", ["vllm", "vllm._custom_ops", "vllm.model_executor.layers.quantization.utils."
                                                                    "marlin_utils_fp4"])
@pytest.mark.parametrize("exc", [ImportError("No module named 'vllm'\nmore"), OSError("libcudart.so.13: cannot"),
                                 RuntimeError("boom")])
def test_load_marlin_import_failures_are_one_line_reasons(kb_marlin, failing, exc):
    mod, reason = kb_marlin.load_marlin((9, 0), importer=_importer({failing: exc}, FakeMarlin()), has_op=lambda n: True)
    assert mod is None
    assert "\n" not in reason and failing in reason and type(exc).__name__ in reason


def test_load_marlin_missing_ops_functions_or_support(kb_marlin):
    mod, reason = kb_marlin.load_marlin((9, 0), importer=_importer(module=FakeMarlin()),
                                        has_op=lambda n: n != "marlin_gemm")
    assert mod is None and "marlin_gemm" in reason and "gptq_marlin_repack" not in reason
    partial = types.SimpleNamespace(prepare_fp4_layer_for_marlin=lambda layer: None)
    mod, reason = kb_marlin.load_marlin((9, 0), importer=_importer(module=partial), has_op=lambda n: True)
    assert mod is None and "apply_fp4_marlin_linear" in reason
    mod, reason = kb_marlin.load_marlin((9, 0), importer=_importer(module=FakeMarlin(supported=False)),
                                 has_op=lambda n: True)
    assert mod is None and "is_fp4_marlin_supported" in reason


def test_load_marlin_ok(kb_marlin):
    fake = FakeMarlin()
    assert kb_marlin.load_marlin((9, 0), importer=_importer(module=fake), has_op=lambda n: True) == (fake, None)


def test_load_marlin_real_environment_never_raises(kb_marlin):
    """Whatever vLLM is (or is not) installed here, the answer is a module or a one-line reason."""
    mod, reason = kb_marlin.load_marlin((9, 0))
    assert (mod is None) != (reason is None)
    if reason is not None:
        assert "\n" not in reason


# --- correctness gate ------------------------------------------------------------------------------

def test_marlin_layer_passes_global_scale_as_multiplier(kb_marlin):
    fake = FakeMarlin()
    (packed, scale, gs), = _q4(32, 64, sets=1)
    layer = kb_marlin.marlin_layer(fake, packed, scale, gs, 32, 64)
    assert fake.prepared == [(32, 64)]
    assert float(layer.weight_global_scale) == pytest.approx(0.01)
    assert torch.equal(packed, _q4(32, 64, sets=1)[0][0])  # the caller's weight is not modified


def test_prepare_marlin_correct_layout_is_timed(kb_marlin):
    q4 = _q4(64, 256)
    xs = {m: torch.randn(m, 256).to(torch.bfloat16) for m in (1, 5, 16)}
    fns, info = kb_marlin.prepare_marlin(FakeMarlin(), q4, 64, 256, xs)
    assert fns is not None and len(fns) == len(q4)
    assert "marlin_error" not in info and 0 < info["marlin_rel_err"] <= kb_marlin.MARLIN_TOL
    assert fns[1](xs[5]).shape == (5, 64)


def test_prepare_marlin_wrong_layout_is_not_timed(kb_marlin):
    q4 = _q4(64, 256)
    xs = {m: torch.randn(m, 256).to(torch.bfloat16) for m in (1, 16)}
    fns, info = kb_marlin.prepare_marlin(FakeMarlin(swap_nibbles=True), q4, 64, 256, xs)
    assert fns is None and info["marlin_rel_err"] > kb_marlin.MARLIN_TOL and "not timed" in info["marlin_error"]


def test_prepare_marlin_error_is_recorded(kb_marlin):
    fns, info = kb_marlin.prepare_marlin(FakeMarlin(fail=True), _q4(64, 256), 64, 256, {1: torch.randn(1, 256)})
    assert fns is None and "RuntimeError" in info["marlin_error"] and "\n" not in info["marlin_error"]


def test_rel_err(kb_marlin):
    ref = torch.ones(2, 3, dtype=torch.float64)
    assert kb_marlin.rel_err(ref.float(), ref) == 0.0
    assert kb_marlin.rel_err(torch.ones(3, 2), ref) == float("inf")
    assert kb_marlin.rel_err(torch.full((2, 3), float("nan")), ref) == float("inf")


# --- sums, ratios, targets, table, file name -------------------------------------------------------

def _recs(marlin: bool = True, missing_marlin_layer: bool = False):
    recs = []
    for i, lname in enumerate(("qkv", "o", "gate_up", "down")):
        for m in (1, 256):
            rec = {"model": "qwen2.5-7b", "layer": lname, "N": 64, "K": 64, "M": m,
                   "bf16_graph_ms": 0.04, "ours_graph_ms": 0.02, "bf16_eager_ms": 0.05, "ours_eager_ms": 0.04}
            if marlin and not (missing_marlin_layer and i == 2):
                rec["marlin_graph_ms"] = 0.025 if m == 1 else 0.015
            recs.append(rec)
    return recs


def test_sum_layers_and_ratio(kb_marlin, kb_results):
    sums = kb_results.sum_layers(_recs(), 4)
    assert sums[1]["bf16_graph_ms"] == pytest.approx(0.16) and sums[1]["marlin_graph_ms"] == pytest.approx(0.1)
    row = kb_marlin.add_marlin_ratio({"model": "m", "M": 1, "layer": "sum", **sums[1]})
    assert row["ours/marlin"] == pytest.approx(1.25)
    sums = kb_results.sum_layers(_recs(missing_marlin_layer=True), 4)
    assert "marlin_graph_ms" not in sums[1] and "ours_graph_ms" in sums[1]
    assert "ours/marlin" not in kb_marlin.add_marlin_ratio({"M": 1, **sums[1]})


def test_build_targets(kb_marlin, kb_results):
    rows = _recs()
    for m, s in kb_results.sum_layers(_recs(), 4).items():
        rows.append(kb_marlin.add_marlin_ratio({"model": "qwen2.5-7b", "M": m, "layer": "sum", **s}))
    targets = kb_results.build_targets(rows)
    marlin = [t for t in targets if "vLLM Marlin FP4" in t["name"]]
    assert [t["name"] for t in marlin] == [
        "qwen2.5-7b M=1 per-layer speedup vs vLLM Marlin FP4 (CUDA graph timing)",
        "qwen2.5-7b M=256 per-layer speedup vs vLLM Marlin FP4 (CUDA graph timing)"]
    assert [t["measured"] for t in marlin] == [1.25, 0.75]
    # issue 18: >= 1.5x Marlin at M = 64-256, the 1.0x stretch elsewhere
    assert [(t["op"], t["target"]) for t in marlin] == [(">=", 1.0), (">=", 1.5)]
    ms = (16, 63, 64, 128, 256, 257, 1024)
    assert [kb_results.marlin_target(m) for m in ms] == [1.0, 1.0, 1.5, 1.5, 1.5, 1.0, 1.0]
    bf16 = [t for t in targets if "BF16 cuBLAS" in t["name"]]
    assert [(t["measured"], t["target"]) for t in bf16] == [(2.0, 2.5), (2.0, 1.0)]  # per-layer targets vs BF16
    # without the Marlin column: only the BF16 targets
    rows = _recs(marlin=False)
    for m, s in kb_results.sum_layers(rows, 4).items():
        rows.append(kb_marlin.add_marlin_ratio({"model": "qwen2.5-7b", "M": m, "layer": "sum", **s}))
    targets = kb_results.build_targets(rows)
    assert all("Marlin" not in t["name"] for t in targets) and len(targets) == 2


def test_table_lines(kb_marlin, kb_results):
    rows = []
    for marlin in (True, False):
        for m, s in kb_results.sum_layers(_recs(marlin=marlin), 4).items():
            rows.append(kb_marlin.add_marlin_ratio({"model": "qwen2.5-7b", "M": m, "layer": "sum",
                                                    "floor_fp4_ms": 0.044, **s}))
    lines = kb_results.table_lines(rows, "NVIDIA H200")
    assert "marlin g" in lines[1] and "o/mar" in lines[1]
    assert len(lines) == 2 + 4
    assert "  0.1000  1.25 |" in lines[2]  # marlin sum and ours/marlin at M=1
    assert lines[4].count(" - ") >= 1 and "  0.0440" in lines[4]


@pytest.mark.parametrize("name,tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                      ("NVIDIA H200 NVL", "h200"), ("", "gpu"), (None, "gpu"), ("NVIDIA", "gpu")])
def test_device_tag(kb_results, name, tag):
    assert kb_results.device_tag(name) == tag


def test_result_path(kb_results, tmp_path):
    assert kb_results.result_path(str(tmp_path), None, "NVIDIA H200", Path("x")) == tmp_path / "kernel-h200.json"
    assert (kb_results.result_path(None, str(tmp_path), "NVIDIA H100 80GB HBM3", Path("x"))
            == tmp_path / "kernel-h100.json")
    assert kb_results.result_path(None, None, "NVIDIA H200", tmp_path) == tmp_path / "kernel-h200.json"
    f = tmp_path / "mine.json"
    assert kb_results.result_path(str(f), str(tmp_path / "other"), "NVIDIA H200", Path("x")) == f


def test_marlin_meta_never_raises(kb_marlin):
    version, meta = kb_marlin.marlin_meta()
    assert isinstance(version, str) and "marlin_gemm" in meta["source"] and str(kb_marlin.MARLIN_TOL) in meta["check"]


def test_ncu_summary_reads_one_row_per_launch_from_plain_or_gzipped_csv(kb_diag, tmp_path):
    import gzip

    header = ('"ID","Process ID","Kernel Name","Block Size","Grid Size","Section Name","Metric Name","Metric Unit",'
              '"Metric Value"')
    recs = [(0, "void qerl::nvfp4_gemm_splitk_kernel<8>(x)", "Duration", "ns", "35,072"),
            (0, "void qerl::nvfp4_gemm_splitk_kernel<8>(x)", "Registers Per Thread", "register/thread", "90"),
            (0, "void qerl::nvfp4_gemm_splitk_kernel<8>(x)", "Block Limit SM", "block", "32"),  # not a quoted metric
            (1, "void marlin::Marlin<1>(y)", "Duration", "ns", "36,672")]
    body = [f'"{i}","1","{k}","(256, 1, 1)","(132, 1, 1)","S","{m}","{u}","{v}"' for i, k, m, u, v in recs]
    text = "==PROF== Connected to process 1\n" + "\n".join([header, *body]) + "\n"
    plain, packed = tmp_path / "n.csv", tmp_path / "n.csv.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    for path in (plain, packed):
        rows = kb_diag.ncu_summary(str(path))
        assert [r["kernel"] for r in rows] == ["void qerl::nvfp4_gemm_splitk_kernel<8>", "void marlin::Marlin<1>"]
        assert rows[0]["Duration"] == "35,072 ns" and rows[0]["Registers Per Thread"] == "90 register/thread"
        assert "Block Limit SM" not in rows[0] and rows[1]["grid"] == "(132, 1, 1)"
    (tmp_path / "bad.csv").write_text("no header here\n")
    with pytest.raises(SystemExit, match="no ncu CSV header"):
        kb_diag.ncu_summary(str(tmp_path / "bad.csv"))


# --- fused-kernel variants (split-K vs the stream-K and wgmma kernels) ------------------------------------

def test_parse_variants_and_models(kb, kb_results, kb_diag, kb_variants, monkeypatch):
    from verl_qerl import kernels

    assert kb_variants.parse_variants(None) == ["splitk"]
    assert kb_variants.parse_variants("streamk") == ["splitk", "streamk"]  # split-K is always the baseline, first
    assert kb_variants.parse_variants(" StreamK,splitk,streamk ") == ["splitk", "streamk"]
    with pytest.raises(ValueError, match=r"unknown kernel variant\(s\) \['v6'\]"):
        kb_variants.parse_variants("splitk,v6")
    monkeypatch.setattr(kernels, "_warned_aliases", set())
    with pytest.warns(FutureWarning) as caught:
        assert kb_variants.parse_variants("v5,wgmma") == ["splitk", "wgmma_rs"]  # former names still work
    assert sorted(str(w.message) for w in caught) == ["--variants: 'v5' is a deprecated name; use 'splitk'",
                                                      "--variants: 'wgmma' is a deprecated name; use 'wgmma_rs'"]
    assert kb_diag.parse_modes("streamk, WGMMA_SS") == {"streamk", "wgmma_ss"}
    with pytest.raises(ValueError, match=r"--sanitize-modes: unknown mode\(s\) \['8'\]"):
        kb_diag.parse_modes("8")
    assert list(kb.select_models(None)) == ["qwen2.5-7b", "qwen2.5-32b"] == list(kb_results.DEFAULT_MODELS)
    assert list(kb.select_models("all")) == list(kb.MODELS) and len(kb.MODELS) == 5
    assert list(kb.select_models("qwen2.5-7b")) == ["qwen2.5-7b"]
    with pytest.raises(ValueError, match="qwen9"):
        kb.select_models("qwen9")


class FakeExt:
    """The extension's ``gemm_choice`` as this test states it: forced stream-K runs for M >= 17."""

    def __init__(self):
        self.asked = []

    def gemm_choice(self, m, n, k, mode):
        from verl_qerl.kernels import GemmMode

        self.asked.append((m, n, k, mode))
        return "streamk" if mode == GemmMode.STREAMK and m >= 17 else "splitk"


def test_variant_applies_and_profile_modes(kb_diag, kb_variants):
    from verl_qerl.kernels import GEMM_MODES as M

    ext = FakeExt()
    assert kb_variants.variant_applies(ext, "splitk", 1, 512, 256)
    assert kb_variants.variant_applies(ext, "splitk", 4096, 512, 256)
    ms = (1, 4, 16, 17, 64, 256, 1024, 4096)
    assert [m for m in ms if kb_variants.variant_applies(ext, "streamk", m, 512, 256)] == [17, 64, 256, 1024]
    # the register-A wgmma kernels are timed at prefill sizes too (the dispatch runs them there); the decode-size
    # kernels and wgmma_ss only up to 1,024 tokens
    assert [v for v in ("splitk", "streamk", "decode_tma", "wgmma_ss", "wgmma_rs", "wgmma_wide", "wgmma_rs_t256")
            if kb_variants.timed_at(v, 4096)] == ["wgmma_rs", "wgmma_wide", "wgmma_rs_t256"]
    assert all(kb_variants.timed_at(v, 1024) for v in ("splitk", "streamk", "decode_tma", "wgmma_ss"))
    assert {a[3] for a in ext.asked} == {M["streamk"]} and (64, 512, 256, M["streamk"]) in ext.asked
    # --profile follows $QERL_GEMM_KERNEL unless --variants is given
    assert kb_diag.profile_modes(None, "splitk") == [("splitk", M["splitk"])]
    assert kb_diag.profile_modes(None, "streamk") == [("streamk", M["streamk"])]
    assert kb_diag.profile_modes(["splitk", "wgmma_rs"], "splitk") == [("splitk", M["splitk"]),
                                                                        ("wgmma_rs", M["wgmma_rs"])]
    assert kb_diag.profile_modes(None, "auto") == [("auto", M["auto"])]  # the default: the op's own choice


class FakeWgmmaExt:
    """gemm_choice: the register-A wgmma kernel from M = 64 on; the tile knob records every value it is set to."""

    def __init__(self):
        self.wide_min_m = 129
        self.knob_log = []

    def gemm_choice(self, m, n, k, mode):  # noqa: ANN001, ANN201
        return "wgmma_rs" if m >= 64 else "splitk"

    def set_wgmma_wide_min_m(self, m):  # noqa: ANN001, ANN201
        prev, self.wide_min_m = self.wide_min_m, m
        self.knob_log.append(m)
        return prev

    def set_wgmma_wide_fit(self, on):  # noqa: ANN001, ANN201
        prev, self.wide_fit = getattr(self, "wide_fit", True), on
        return prev


def test_tile_variant_times_narrow_tiles_and_restores(kb_diag, kb_variants):
    ext = FakeWgmmaExt()
    assert kb_variants.parse_variants("wgmma_rs,wgmma_rs_t128") == ["splitk", "wgmma_rs", "wgmma_rs_t128"]
    # only where the op would run 256-token tiles (M >= 129) and the wgmma kernel runs at all
    ms = (1, 64, 128, 129, 256, 1024, 4096)
    assert [m for m in ms if kb_variants.variant_applies(ext, "wgmma_rs_t128", m, 512, 256)] == [129, 256, 1024, 4096]
    seen = []
    run = kb_variants.narrow_wgmma_tiles(ext, lambda r: seen.append((r, ext.wide_min_m)))
    run(3)
    # narrow during the call, restored after
    assert seen == [(3, kb_variants.NARROW_WIDE_MIN_M)] and ext.wide_min_m == 129
    with pytest.raises(RuntimeError):
        kb_variants.narrow_wgmma_tiles(ext, lambda r: (_ for _ in ()).throw(RuntimeError("boom")))(0)
    assert ext.wide_min_m == 129  # restored on error too
    with pytest.raises(ValueError, match="timing-only"):
        kb_diag.profile_modes(["wgmma_rs_t128"], "splitk")


def test_wide_tile_fits_m_and_t256_variant_restores(kb_variants):
    # the token tile whose tiles hold the fewest rows (widest of equals), as cuda/gemm_route.cpp's wide_block_t
    for m in range(129, 1200):
        rows = {t: -(-m // t) * t for t in (160, 192, 224, 256)}
        least = min(rows.values())
        assert kb_variants.wide_tile(m) == max(t for t, r in rows.items() if r == least), m
    assert [kb_variants.wide_tile(m) for m in (129, 160, 161, 192, 193, 224, 225, 256, 257, 320, 384, 448, 1024)] == \
        [160, 160, 192, 192, 224, 224, 256, 256, 160, 160, 192, 224, 256]
    ext = FakeWgmmaExt()
    ms = (64, 128, 129, 192, 193, 240, 256, 300, 1024)
    assert [m for m in ms if kb_variants.variant_applies(ext, "wgmma_rs_t256", m, 512, 256)] == [129, 192, 193, 300]
    seen = []
    run = kb_variants.tile_variant(ext, "wgmma_rs_t256", lambda r: seen.append((r, ext.wide_fit)))
    run(2)
    assert seen == [(2, False)] and ext.wide_fit is True
    with pytest.raises(RuntimeError):
        kb_variants.tile_variant(ext, "wgmma_rs_t256", lambda r: (_ for _ in ()).throw(RuntimeError("boom")))(0)
    assert ext.wide_fit is True
    assert kb_variants.tile_variant(ext, "wgmma_rs_t128", lambda r: ext.wide_min_m)(0) == kb_variants.NARROW_WIDE_MIN_M


def test_build_targets_only_for_the_issue_models(kb_results):
    rows = [{"model": name, "layer": "sum", "M": 64, "bf16_graph_ms": 0.3, "ours_graph_ms": 0.2}
            for name in ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")]
    assert [t["name"].split()[0] for t in kb_results.build_targets(rows)] == ["qwen2.5-7b", "qwen2.5-32b"]
    assert [t["measured"] for t in kb_results.build_targets(rows)] == [1.5, 1.5]


def test_streamk_calibration(kb_results):
    """Tiles per CTA from the row's shape and grid; the rule's hits, summed times and the best threshold."""
    def row(layer, n, m, sp, sk):  # tiles as the extension reports them: ceil(N / 256) x ceil(M / 64) here
        return {"model": "x", "layer": layer, "N": n, "K": 3584, "M": m, "streamk_grid": 132,
                "streamk_tiles": -(-n // 256) * -(-m // 64), "kernel_splitk_graph_ms": sp,
                "kernel_streamk_graph_ms": sk}

    rows = [row("qkv", 4608, 64, 0.020, 0.030),  # 18 tiles: 0.1364 per CTA, split-K faster
            row("gate_up", 17920, 64, 0.050, 0.045),  # 70 tiles: 0.5303, stream-K faster
            row("gate_up", 37888, 64, 0.100, 0.080),  # 148 tiles: 1.1212
            row("gate_up", 37888, 128, 0.180, 0.140),  # 296 tiles (2 M tiles): 2.2424
            row("down", 3584, 128, 0.084, 0.085),  # 28 tiles: 0.2121, split-K faster
            {"model": "x", "layer": "sum", "M": 64, "kernel_splitk_graph_ms": 1.0, "kernel_streamk_graph_ms": 0.5},
            row("o", 3584, 1, 0.008, None)]  # stream-K not timed: ignored
    cal = kb_results.streamk_calibration(rows, 0.5)
    assert [p["tiles_per_cta"] for p in cal["points"]] == [0.1364, 0.2121, 0.5303, 1.1212, 2.2424]
    assert cal["rule_right"] == 5 and cal["rule_ms"] == pytest.approx(0.020 + 0.084 + 0.045 + 0.080 + 0.140)
    assert cal["oracle_ms"] == cal["rule_ms"] and cal["best_threshold"] == 0.5303
    assert [p["stages_per_cta"] for p in cal["points"]] == [4, 6, 15, 32, 63]  # ceil(tiles x 28 / 132)
    cal = kb_results.streamk_calibration(rows, 0.1)  # too low: qkv and down go to stream-K
    assert cal["rule_right"] == 3 and cal["rule_ms"] == pytest.approx(0.030 + 0.085 + 0.045 + 0.080 + 0.140)
    assert kb_results.streamk_calibration(rows[:1], 0.5)["best_threshold"] is None  # split-K everywhere: never stream-K
    # the stages part of the rule: a 0.2-tiles-per-CTA shape with long K ranges goes to stream-K
    long_k = {**row("down", 5120, 64, 0.083, 0.074), "K": 27648}  # 20 tiles x 216 stages: 33 per CTA
    cal = kb_results.streamk_calibration([*rows, long_k], 0.25, 24)
    assert cal["rule_stages"] == 24 and cal["rule_right"] == 6 and cal["rule_ms"] == pytest.approx(cal["oracle_ms"])
    assert kb_results.streamk_calibration([*rows, long_k], 0.25)["rule_right"] == 5  # tiles alone: split-K, the slower


def test_variant_ratios_sums_and_lines(kb_results, kb_variants):
    recs = []
    for lname in ("qkv", "o", "gate_up", "down"):
        for m in (1, 64):
            rec = {"model": "qwen2.5-7b", "layer": lname, "N": 64, "K": 128, "M": m, "kernel_splitk_graph_ms": 0.02}
            if kb_variants.variant_applies(FakeExt(), "streamk", m, 64, 128):
                rec["kernel_streamk_graph_ms"] = 0.016
            recs.append(kb_variants.add_variant_ratios(rec, ["splitk", "streamk"]))
    assert recs[1]["streamk/splitk"] == 1.25 and "streamk/splitk" not in recs[0]
    sums = kb_results.sum_layers(recs, 4)
    assert sums[64]["kernel_streamk_graph_ms"] == pytest.approx(0.064) and "kernel_streamk_graph_ms" not in sums[1]
    rows = recs + [kb_variants.add_variant_ratios({"model": "qwen2.5-7b", "M": m, "layer": "sum", **s},
                                                  ["splitk", "streamk"]) for m, s in sums.items()]
    lines = kb_variants.variant_lines(rows, ["splitk", "streamk"])
    assert "streamk g" in lines[1] and "streamk/splitk" in lines[1]
    assert len(lines) == 2 + 4 + 1  # four GEMMs and the layer sum at M = 64; nothing at M = 1
    assert lines[-1].split()[:3] == ["qwen2.5-7b", "sum", "64"] and lines[-1].endswith("1.250")
    assert kb_variants.variant_lines(rows, ["splitk"]) == []


def test_gpu_kernel_check_script_uses_real_options(kb, kb_variants):
    """benchmarks/gpu/kernel_check.sh runs on a GPU machine with no second chance: every kernel.py option,
    model and variant it passes must exist here (a renamed flag would otherwise cost a device call)."""
    import re
    import subprocess

    script = REPO / "benchmarks" / "gpu" / "kernel_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    src = (REPO / "benchmarks" / "kernel.py").read_text()
    known = set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', src))
    used = set()
    for cmd in re.findall(r'benchmarks/kernel\.py((?:[^\n"\\]|\\\n)*)', text):  # up to the line end, past \ + newline
        used |= set(re.findall(r"(--[a-z0-9-]+)", cmd))
    assert used and used <= known, sorted(used - known)
    assert {"--variants", "--sanitize", "--profile", "--ms"} <= used
    assert kb_variants.parse_variants("splitk,streamk") == ["splitk", "streamk"]
    models = re.search(r"--models ([a-z0-9.,-]+)", text).group(1)
    assert set(kb.select_models(models)) == (set(kb.MODELS) if models == "all" else set(models.split(",")))
    assert "tests/test_kernels_gpu.py" in text and (REPO / "tests" / "test_kernels_gpu.py").is_file()


def test_gpu_scripts_use_current_kernel_and_mode_names(kb_diag, kb_variants):
    """Every ``--variants`` / ``--sanitize-modes`` value in benchmarks/gpu/*.sh is a current name (a former one
    would warn, an unknown one would cost a device call), and the ncu kernel regexes name kernels in cuda/."""
    import re
    import warnings

    cuda = "\n".join(p.read_text() for p in (REPO / "cuda").glob("*.cu"))
    seen = 0
    for script in sorted((REPO / "benchmarks" / "gpu").glob("*.sh")):
        text = script.read_text()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for value in re.findall(r'--variants "?(?:\$\{[A-Z_]+:-)?([a-z0-9_,]+)', text):
                kb_variants.parse_variants(value)
                seen += 1
            for value in re.findall(r"--sanitize-modes ([a-z0-9_,]+)", text):
                kb_diag.parse_modes(value)
                seen += 1
        for rx in re.findall(r"regex:(nvfp4_gemm_[a-z0-9_]+)", text):
            assert re.search(rf"\b{rx}\w*\s*\(", cuda), (script.name, rx)
    assert seen >= 6


def test_run_header_has_what_every_results_json_needs(kb, monkeypatch):
    """The timing table and the split sweep start their JSON from one header (results standard: device,
    versions, command, date), with the QERL_* variables that chose the routes (and no others)."""
    monkeypatch.setenv("QERL_LORA_SHRINK", "cublas")
    monkeypatch.setenv("NOT_QERL_X", "1")
    h = kb.run_header("NVIDIA H200")
    assert h["device"] == "NVIDIA H200" and h["command"].startswith("python ")
    assert {"torch", "cuda", "python"} <= set(h["versions"]) and "T" in h["date"]
    assert h["env"].get("QERL_LORA_SHRINK") == "cublas" and "NOT_QERL_X" not in h["env"]


@pytest.mark.parametrize("n", range(1, 11))
def test_balanced_orders_put_every_method_after_every_other_equally(kb, n):
    """Every round is a permutation, and within rounds each ordered pair (a right before b) occurs equally often:
    once for even n, twice for odd n. The rotations used before fail this (each method always after the same one)."""
    orders = kb.balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    pairs = collections.Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    want = 1 if n % 2 == 0 else 2
    assert pairs == {(a, b): want for a in range(n) for b in range(n) if a != b}


def test_balanced_orders_reject_what_rotations_do(kb):
    """The check above fails on rotations of one order (the old design): the oracle is not vacuous."""
    n = 4
    rotations = [[(x + i) % n for x in range(n)] for i in range(n)]
    pairs = collections.Counter((a, b) for o in rotations for a, b in zip(o, o[1:]))
    assert pairs != {(a, b): 1 for a in range(n) for b in range(n) if a != b}
    assert kb.balanced_orders(n) != rotations


def test_interleaved_graph_ms_times_every_method_after_every_other(kb, monkeypatch):
    """Each method's replays run in every round, each method follows each other one in some round (in particular
    `ours` is not always timed right after `bf16`), and a method whose graph could not be captured reads None."""
    calls: list[tuple[str, int]] = []
    speed = {"bf16": 1.0, "ours": 2.0, "kernel_x": 3.0, "kernel_y": 4.0}

    def fake_replay(g, reps):
        calls.append((g, reps))
        return [speed[g]] * reps

    monkeypatch.setattr(kb, "replay_ms", fake_replay)
    out = kb.interleaved_graph_ms({"bf16": "bf16", "ours": "ours", "none": None, "kernel_x": "kernel_x",
                                   "kernel_y": "kernel_y"}, reps=10)
    assert out == {"bf16": 1.0, "ours": 2.0, "none": None, "kernel_x": 3.0, "kernel_y": 4.0}
    assert len(calls) == 16 and collections.Counter(g for g, _ in calls) == {k: 4 for k in speed}
    assert {r for _, r in calls} == {3}  # ceil(10 / 4) replays per round, so >= reps in all
    rounds = [[g for g, _ in calls[i:i + 4]] for i in range(0, 16, 4)]
    after_bf16 = [r[r.index("bf16") + 1] for r in rounds if r.index("bf16") < 3]
    assert sorted(after_bf16) == ["kernel_x", "kernel_y", "ours"]


def test_profile_shape_filter_names_what_matched_nothing(kb_diag):
    assert (256, 3584, 3584) in kb_diag.PROFILE_SHAPES  # the narrow GEMM source_profile.sh NK=3584x3584 profiles
    with pytest.raises(ValueError, match=r"N x K in \{\(1, 1\)\}"):
        kb_diag.profile_run(ms={256}, nks={(1, 1)})


def test_lora_gemm_bench_slices_sums_and_targets():
    """benchmarks/lora_gemm_bench.py's pure parts: the LoRA slices of each 7B layer (q / k / v heads, gate / up),
    the per-layer sums and LoRA costs, and its targets (base / with the fast path, against 0.90)."""
    lg = load_script("benchmarks/lora_gemm_bench.py", "lora_gemm_bench")
    cfg = lg.MODELS["qwen2.5-7b"]
    shapes = {name: n for name, n, _ in lg.layer_shapes(cfg)}
    assert lg.slice_bounds("qkv", shapes["qkv"], cfg) == [0, 3584, 4096, 4608]
    assert lg.slice_bounds("gate_up", shapes["gate_up"], cfg) == [0, 18944, 37888]
    assert lg.slice_bounds("down", shapes["down"], cfg) == [0, 3584]
    assert set(lg.SLICES) == set(shapes)
    recs = [{"model": "m", "M": 1, **{f"{k}_us": v for k, v in zip(lg.METHODS, vals)}}
            for vals in ((10, 11, 3, 14, 13, 12, 11.5, 11.5), (20, 21.5, 4, 26, 25, 23, 22.5, 22))]
    lay = lg.layer_sum(recs)
    assert lay["gemm_us"] == 30 and lay["epilogue_cost_us"] == 2.5 and lay["pair_cost_us"] == 10
    assert lay["pair_pdl_cost_us"] == 8 and lay["linear_cost_us"] == 5 and lay["linear_pdl_cost_us"] == 4
    (t,) = lg.build_targets(recs + [lay])
    assert t["measured"] == round(30 / 34, 3) and t["op"] == ">=" and t["target"] == 0.9 and "one op" in t["name"]
    # a file from before the one op: the target falls back to the pair
    old = {k: v for k, v in lay.items() if not k.startswith("linear")}
    (t,) = lg.build_targets([old])
    assert t["measured"] == round(30 / 38, 3) and "shrink + GEMM" in t["name"]


def test_retable_sums_the_tables_picks_and_rebuilds_targets(tmp_path):
    kr = load_script("benchmarks/kernel_retable.py")
    rows = [
        {"model": "qwen2.5-7b", "layer": "qkv", "N": 4608, "K": 3584, "M": 128, "bf16_graph_ms": 0.013,
         "ours_graph_ms": 0.019, "kernel_wgmma_rs_graph_ms": 0.019, "kernel_wgmma_wide_graph_ms": 0.015},
        {"model": "qwen2.5-7b", "layer": "gate_up", "N": 37888, "K": 3584, "M": 128, "bf16_graph_ms": 0.072,
         "ours_graph_ms": 0.061, "kernel_wgmma_rs_graph_ms": 0.061, "kernel_wgmma_wide_graph_ms": 0.063},
        {"model": "qwen2.5-7b", "layer": "sum", "M": 128, "bf16_graph_ms": 0.085, "ours_graph_ms": 0.080},
    ]
    table = {"command": "kernel.py ...", "points": [[4608, 3584, 128, "wgmma_wide"], [37888, 3584, 128, "wgmma_rs"]]}
    result = {"rows": rows, "targets": [{"name": "old", "measured": 1.0, "op": ">=", "target": 1.5}]}
    assert kr.table_layer_sums(rows, table["points"]) == {("qwen2.5-7b", 128): pytest.approx(0.076)}
    out = kr.retable(result, table)
    s = [r for r in out["rows"] if r["layer"] == "sum"][0]
    assert s["table_graph_ms"] == pytest.approx(0.076) and s["auto_graph_ms_as_run"] == 0.080
    assert s["ours_graph_ms"] == 0.080  # the as-run column is not rewritten
    t = [t for t in out["targets"] if "M=128 per-layer speedup vs BF16" in t["name"]]
    assert len(t) == 1 and t[0]["measured"] == pytest.approx(round(0.085 / 0.076, 3))
    assert out["targets_auto_as_run"] == result["targets"] and rows[2]["ours_graph_ms"] == 0.080  # input untouched
    # a pick the row did not time, or a GEMM the table lacks, is named
    # a row without the pick's forced column uses the op's own time where the op ran that kernel (prefill sizes)
    pre = [{"model": "qwen2.5-7b", "layer": "qkv", "N": 4608, "K": 3584, "M": 2048, "bf16_graph_ms": 0.088,
            "ours_runs": "wgmma_rs", "ours_graph_ms": 0.095, "dequant_cublas_graph_ms": 0.102}]
    assert kr.table_layer_sums(pre, [[4608, 3584, 2048, "wgmma_rs"]]) == {("qwen2.5-7b", 2048): 0.095}
    with pytest.raises(ValueError, match="picks wgmma_wide.*the op ran wgmma_rs"):
        kr.table_layer_sums(pre, [[4608, 3584, 2048, "wgmma_wide"]])
    with pytest.raises(ValueError, match="picks decode_tma"):
        kr.table_layer_sums(rows, [[4608, 3584, 128, "decode_tma"], [37888, 3584, 128, "wgmma_rs"]])
    with pytest.raises(ValueError, match="no point"):
        kr.table_layer_sums(rows, [[4608, 3584, 128, "wgmma_wide"]])
    res, tab = tmp_path / "r.json", tmp_path / "t.json"
    res.write_text(json.dumps(result))
    tab.write_text(json.dumps(table))
    with pytest.raises(SystemExit):
        kr.main([str(res), str(tab), "--out", str(res)])
    assert kr.main([str(res), str(tab), "--out", str(tmp_path / "o.json")]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["rows"][2]["table_graph_ms"] == pytest.approx(0.076)
