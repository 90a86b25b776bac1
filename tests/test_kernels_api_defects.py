"""CPU tests of verl_qerl.kernels' Python layer: environment settings read the way the C++ side and the user mean
them, a bad setting raised rather than swallowed, and the public functions' argument checks (global_scale, n).

The CUDA extension is faked where a test needs a "GPU" (torch.cuda patched, ``build.load`` returning a recorder),
so all of it runs without one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from verl_qerl import kernels, nvfp4
from verl_qerl.kernels import build, dispatch, modes, ops

REPO = Path(__file__).resolve().parent.parent


# --- 1. tuning variables: only what atoll / atof read as Python does ------------------------------------------


@pytest.fixture
def clean_tuning_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in kernels.TUNING_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("name", "raw"), [
    ("QERL_GEMM_MAX_M", "1_000"),  # Python's int: 1000; atoll: 1
    ("QERL_GEMM_MAX_M", "\u0663\u0662"),  # Arabic-Indic 32; atoll: 0
    ("QERL_GEMM_MAX_M", "\uff16\uff14"),  # full-width 64; atoll: 0
    ("QERL_SPLIT_PENALTY", "1_0.5"),  # Python's float: 10.5; atof: 1
    ("QERL_SPLIT_PENALTY", "\u0660.\u0665"),  # Arabic-Indic 0.5; atof: 0
    ("QERL_STREAMK_MIN_TILES_PER_CTA", "1_0"),
    ("QERL_STREAMK_MIN_TILES_PER_CTA", "infinity"),
    ("QERL_GEMM_MAX_M", "64\n1"),
])
def test_tuning_env_refuses_what_the_extension_reads_differently(clean_tuning_env: pytest.MonkeyPatch, name: str,
                                                                   raw: str) -> None:
    clean_tuning_env.setenv(name, raw)
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(raw))} is not a non-negative"):
        kernels.check_tuning_env()


@pytest.mark.parametrize("name", sorted(kernels.TUNING_ENV))
@pytest.mark.parametrize("raw", ["", "   "])
def test_tuning_env_refuses_an_empty_but_set_value(clean_tuning_env: pytest.MonkeyPatch, name: str, raw: str) -> None:
    """getenv gives the C++ side "" (not NULL), which atoll / atof read as 0, not as the default."""
    clean_tuning_env.setenv(name, raw)
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(raw))} .*unset it to use the default"):
        kernels.check_tuning_env()


@pytest.mark.parametrize(("name", "raw"), [
    ("QERL_GEMM_MAX_M", "64"), ("QERL_GEMM_MAX_M", "+64"), ("QERL_GEMM_MAX_M", " 64 "), ("QERL_GEMM_MAX_M", "0"),
    ("QERL_SPLIT_PENALTY", "0.05"), ("QERL_SPLIT_PENALTY", ".5"), ("QERL_SPLIT_PENALTY", "5."),
    ("QERL_SPLIT_PENALTY", "1e-3"), ("QERL_SPLIT_PENALTY", "+2.5E+1"), ("QERL_STREAMK_MIN_TILES_PER_CTA", " 0.3 "),
    ("QERL_STREAMK_MIN_TILES_PER_CTA", "1"),
])
def test_tuning_env_accepts_plain_ascii_numbers(clean_tuning_env: pytest.MonkeyPatch, name: str, raw: str) -> None:
    clean_tuning_env.setenv(name, raw)
    kernels.check_tuning_env()


@pytest.mark.parametrize(("name", "raw"), [("QERL_GEMM_MAX_M", "1e3"), ("QERL_GEMM_MAX_M", "-1"),
                                           ("QERL_GEMM_MAX_M", "1.0"), ("QERL_SPLIT_PENALTY", "nan"),
                                           ("QERL_SPLIT_PENALTY", "-0.1"), ("QERL_SPLIT_PENALTY", "0x1p3"),
                                           ("QERL_STREAMK_MIN_TILES_PER_CTA", "0,25")])
def test_tuning_env_still_refuses_typos(clean_tuning_env: pytest.MonkeyPatch, name: str, raw: str) -> None:
    clean_tuning_env.setenv(name, raw)
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(raw))} is not a non-negative"):
        kernels.check_tuning_env()


# --- 2. load_extension: a bad setting raises; other failures fall back ------------------------------------------


class FakeExt:
    """The extension's Python surface load_extension touches, recording the dispatch table it is given."""

    def __init__(self) -> None:
        self.table: list | None = None

    def gemm_modes(self) -> dict[str, int]:
        return dict(modes.GEMM_MODES)

    def gemm_kernel_names(self) -> list[str]:
        return list(modes.GEMM_KERNEL_NAMES)

    def init_workspace(self, device: int) -> None:
        pass

    def set_dispatch_table(self, points: list) -> None:
        self.table = points


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeExt, list[str]]:
    """An H200-like "GPU" with a working extension; load_extension's state is reset and restored; the returned list
    records calls of ops.register_cuda_fallbacks (the silent fallback to the torch references)."""
    ext, fallbacks = FakeExt(), []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(build, "load", lambda verbose=False: ext)
    monkeypatch.setattr(ops, "register_cuda_fallbacks", lambda: fallbacks.append("fallbacks"))
    for attr, value in (("tried", False), ("ext", None), ("reason", "not loaded yet"), ("workspace_devices", set())):
        monkeypatch.setattr(kernels._State, attr, value)
    for name in ("VERL_QERL_DISABLE_CUDA_KERNELS", dispatch.TABLE_ENV):
        monkeypatch.delenv(name, raising=False)
    return ext, fallbacks


@pytest.mark.parametrize("what", ["missing", "malformed"])
def test_bad_dispatch_table_env_raises_from_load_extension(fake_gpu, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path, what: str) -> None:
    """install() documents that a bad $QERL_GEMM_DISPATCH_TABLE raises; load_extension used to swallow it and run
    every op on the torch reference instead, with one log line."""
    _, fallbacks = fake_gpu
    path = tmp_path / "table.json"
    if what == "malformed":
        path.write_text("{not json")
    monkeypatch.setenv(dispatch.TABLE_ENV, str(path))
    with pytest.raises(dispatch.DispatchTableError, match=re.escape(str(path))):
        kernels.load_extension()
    assert not fallbacks
    assert kernels._State.ext is None and not kernels._State.tried  # fixed setting: the next call tries again


def test_dispatch_table_off_still_loads(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    ext, fallbacks = fake_gpu
    monkeypatch.setenv(dispatch.TABLE_ENV, " Off ")
    assert kernels.load_extension() is True
    assert ext.table == [] and not fallbacks and kernels.cuda_unavailable_reason() == ""


def test_a_failing_build_still_falls_back(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only settings raise: a build that fails (no nvcc, ...) still means "use the torch references"."""
    _, fallbacks = fake_gpu

    def broken(verbose: bool = False) -> None:
        raise RuntimeError("ninja: build stopped")

    monkeypatch.setattr(build, "load", broken)
    assert kernels.load_extension() is False
    assert fallbacks == ["fallbacks"] and "ninja" in kernels.cuda_unavailable_reason()


# --- 3. boolean switches ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    ("", False), ("0", False), (" 0", False), ("0 ", False), ("false", False), ("No", False), ("OFF", False),
    ("1", True), (" 1 ", True), ("true", True), ("YES", True), ("on", True),
])
def test_env_flag_reads_off_as_off(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("QERL_TEST_FLAG", raw)
    assert build.env_flag("QERL_TEST_FLAG") is expected
    monkeypatch.delenv("QERL_TEST_FLAG")
    assert build.env_flag("QERL_TEST_FLAG") is False


@pytest.mark.parametrize("raw", ["2", "enable", "0.0", "y"])
def test_env_flag_refuses_other_values_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("QERL_TEST_FLAG", raw)
    with pytest.raises(ValueError, match=rf"QERL_TEST_FLAG={re.escape(repr(raw))}"):
        build.env_flag("QERL_TEST_FLAG")


@pytest.mark.parametrize("raw", ["false", "no", "off", " 0", "0 "])
def test_anatomy_and_no_build_switches_read_off_as_off(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("QERL_ANATOMY_STAMPS", raw)
    assert build.anatomy_build() is False
    monkeypatch.setenv("VERL_QERL_NO_CUDA_BUILD", "maybe")
    with pytest.raises(ValueError, match="VERL_QERL_NO_CUDA_BUILD='maybe'"):
        build.setup_ext_modules()
    monkeypatch.setenv("QERL_ANATOMY_STAMPS", "stamps")
    with pytest.raises(ValueError, match="QERL_ANATOMY_STAMPS='stamps'"):
        build.anatomy_build()


@pytest.mark.parametrize("raw", ["false", "no", "off", " 0"])
def test_disable_switch_off_does_not_disable(fake_gpu, monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(dispatch.TABLE_ENV, "off")
    monkeypatch.setenv("VERL_QERL_DISABLE_CUDA_KERNELS", raw)
    assert kernels.load_extension() is True, kernels.cuda_unavailable_reason()


def test_disable_switch_on_disables_and_a_bad_value_raises(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_QERL_DISABLE_CUDA_KERNELS", "maybe")
    with pytest.raises(ValueError, match="VERL_QERL_DISABLE_CUDA_KERNELS='maybe'"):
        kernels.load_extension()
    monkeypatch.setenv("VERL_QERL_DISABLE_CUDA_KERNELS", "yes")
    assert kernels.load_extension() is False
    assert "VERL_QERL_DISABLE_CUDA_KERNELS" in kernels.cuda_unavailable_reason()


# --- 4. VERL_QERL_CUDA_SRC --------------------------------------------------------------------------------------


def test_cuda_src_without_the_sources_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VERL_QERL_CUDA_SRC", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=rf"VERL_QERL_CUDA_SRC.*{re.escape(str(tmp_path))}"):
        build.source_dir()
    with pytest.raises(FileNotFoundError, match="VERL_QERL_CUDA_SRC"):
        modes.header_path()


def test_cuda_src_with_the_sources_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_QERL_CUDA_SRC", str(REPO / "cuda"))
    assert build.source_dir() == REPO / "cuda"
    monkeypatch.setenv("VERL_QERL_CUDA_SRC", "")  # empty: as unset
    assert (build.source_dir() / build.CU_SOURCES[0]).is_file()


# --- 5. TORCH_CUDA_ARCH_LIST with +PTX -------------------------------------------------------------------------


@pytest.mark.parametrize(("arch_list", "define"), [
    ("9.0a+PTX", True), ("8.0;9.0a+PTX", True), ("8.0 9.0a+PTX", True), ("9.0a", True),
    ("9.0+PTX", False), ("8.0;9.0", False),
])
def test_arch_list_with_ptx_keeps_the_sm90a_define(arch_list: str, define: bool) -> None:
    assert build.arch_flags([(9, 0)], arch_list) == ([build.SM90A_DEFINE] if define else [])


# --- 6. and 7. global_scale and n in linear / linear_lora / dequantize_repacked ---------------------------------


@pytest.fixture(scope="module")
def weight() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, kernels.RepackedWeight]:
    q = nvfp4.quantize(torch.randn(256, 128, generator=torch.Generator().manual_seed(0)))
    return q.packed, q.scale, q.global_scale, kernels.repack(q.packed, q.scale)


def _calls(weight, gs: torch.Tensor) -> dict:
    packed, scale, _, kw = weight
    x = torch.randn(2, 128)
    return {
        "dequantize_repacked": lambda: kernels.dequantize_repacked(kw, gs, 256),
        "linear": lambda: kernels.linear(x, packed, scale, gs),
        "linear ": lambda: kernels.linear(x, None, None, gs, kernel_weight=kw, n=256),
        "linear_lora": lambda: kernels.linear_lora(x, gs, None, kernel_weight=kw, n=256, lora_b=torch.randn(256, 8),
                                                   mask=torch.ones(2), slice_bounds=[0, 256],
                                                   shrunk=torch.randn(2, 8)),
    }


@pytest.mark.parametrize("caller", ["dequantize_repacked", "linear", "linear ", "linear_lora"])
def test_a_two_value_global_scale_is_named(weight, caller: str) -> None:
    call = _calls(weight, torch.tensor([1.0, 2.0]))[caller]
    with pytest.raises(ValueError, match=rf"^{caller.strip()}: global_scale must hold one value, got shape \(2,\)"):
        call()


@pytest.mark.parametrize("bad", [0.0, float("nan"), -3.0, float("inf")])
def test_dequantize_repacked_refuses_a_bad_global_scale_value(weight, bad: float) -> None:
    with pytest.raises(ValueError, match="dequantize_repacked: global_scale must be finite and > 0"):
        _calls(weight, torch.tensor([bad]))["dequantize_repacked"]()


def test_linear_checks_only_the_shape_of_global_scale(weight) -> None:
    """linear runs inside vLLM's compiled forward: its check must not read the value (a float() of a CUDA tensor
    syncs and breaks CUDA-graph capture), so a zero there passes the Python check."""
    out = _calls(weight, torch.zeros(1))["linear"]()
    assert out.shape == (2, 256)


@pytest.mark.parametrize("n", [100, 128, 300, 1000, 200, 136, 250])
def test_dequantize_repacked_refuses_an_n_that_is_not_the_weights(weight, n: int) -> None:
    _, _, gs, kw = weight
    with pytest.raises(ValueError, match=rf"^dequantize_repacked: n={n} "):
        kernels.dequantize_repacked(kw, gs, n)
    assert kernels.dequantize_repacked(kw, gs, 256).shape == (256, 128)
    assert kernels.dequantize_repacked(kw, gs, 144).shape == (144, 128)  # another multiple of 16 in (128, 256]


@pytest.mark.parametrize("n", [200, 136, 250])
def test_check_n_needs_a_multiple_of_16(weight, n: int) -> None:
    _, _, gs, kw = weight
    with pytest.raises(ValueError, match=rf"^linear: n={n} .*multiple of 16"):
        kernels.linear(torch.randn(2, 128), None, None, gs, kernel_weight=kw, n=n)


# --- 8. modes.py's docstring ------------------------------------------------------------------------------------


def test_modes_docstring_lists_only_accepted_kernel_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel name a paragraph about QERL_GEMM_KERNEL values lists is one gemm_kernel_variant accepts."""
    paragraphs = [p for p in modes.__doc__.split("\n\n") if "QERL_GEMM_KERNEL" in p]
    assert paragraphs
    for p in paragraphs:
        named = [t for t in re.findall(r"``([a-z0-9_]+)``", p) if t in modes.GEMM_KERNEL_NAMES]
        assert named
        for name in named:
            monkeypatch.setenv("QERL_GEMM_KERNEL", name)
            assert kernels.gemm_kernel_variant() == name
    assert "dequant_cublas" in modes.__doc__  # still documented, as a kernel name


def test_checked_paths_still_compile(weight) -> None:
    """The checks added to dequantize_repacked (which linear calls for a kernel_weight without the fused GEMM) read
    the value in eager mode only: torch.compile(fullgraph=True) still traces linear and dequantize_repacked."""
    _, _, gs, kw = weight
    x = torch.randn(3, 128)

    def f(x: torch.Tensor) -> torch.Tensor:
        w = kernels.dequantize_repacked(kw, gs, 256, torch.float32)
        return kernels.linear(x, None, None, gs, kernel_weight=kw, n=256) + x @ w.T

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert out.shape == (3, 256) and torch.allclose(out, f(x), rtol=1e-4, atol=1e-3)
