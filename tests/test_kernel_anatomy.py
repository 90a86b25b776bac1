"""benchmarks/kernel_anatomy.py's pure pieces on CPU (the line fit, the stream-K stage count, the per-CTA stamp
summary) and the stamped build's plumbing: ``QERL_ANATOMY_STAMPS=1`` JIT-builds under its own name with the define
(never the ahead-of-time module), and the stamp row width agrees between the header, the binding and the script."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from verl_qerl.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ka():
    return load_script("benchmarks/kernel_anatomy.py", "kernel_anatomy")


def test_fit_line_recovers_a_line_and_refuses_one_x(ka) -> None:
    a, b = ka.fit_line([8, 16, 31, 41], [0.8 + 1.66 * x for x in (8, 16, 31, 41)])
    assert a == pytest.approx(0.8) and b == pytest.approx(1.66)
    with pytest.raises(ValueError, match="at least two K"):
        ka.fit_line([8, 8], [1.0, 2.0])


def test_stages_per_cta_is_the_busiest_ctas_share(ka) -> None:
    # 7B gate_up at M = 256: 296 tiles x 28 stages over 132 CTAs -> 63 (62.8 rounded up); M = 129 has the same tiles
    assert ka.stages_per_cta(256, 37888, 3584, 132) == 63
    assert ka.stages_per_cta(129, 37888, 3584, 132) == 63
    assert ka.stages_per_cta(257, 37888, 3584, 132) == 126  # a second token tile
    assert ka.stages_per_cta(256, 3584, 18944, 132) == 32


def _row(entry_ns: int, exit_ns: int, ghz: float, **cyc: int) -> list[int]:
    span = exit_ns - entry_ns
    f = dict(entry_ns=entry_ns, exit_ns=exit_ns, cycles=int(span * ghz), first_data=0, loop=0, loop_wait=0, ends=0,
             segments=1, sm=0, end_sub0=0, end_sub1=0, end_sub2=0, end_sub3=0, end_sub4=0)
    f.update(cyc)
    return [f[k] for k in f]


def test_stamp_summary_reads_span_clock_and_phases(ka) -> None:
    rows = [_row(1_000, 21_000, 2.0, loop=20_000, ends=10_000, first_data=2_000),
            _row(1_500, 25_000, 2.0, loop=30_000, ends=6_000, first_data=4_000, segments=3),
            [0] * len(ka.STAMP_FIELDS)]  # a CTA that never ran (grid smaller than the table)
    s = ka.stamp_summary(rows)
    assert s["ctas"] == 2
    assert s["span_us"] == pytest.approx(24.0)           # first entry 1,000 ns -> last exit 25,000 ns
    assert s["entry_spread_us"] == pytest.approx(0.5)
    assert s["exit_spread_us"] == pytest.approx(4.0)
    assert s["clock_GHz"] == pytest.approx(2.0, rel=1e-3)
    assert s["loop_us_mean"] == pytest.approx(12.5) and s["loop_us_max"] == pytest.approx(15.0)
    assert s["ends_us_max"] == pytest.approx(5.0) and s["first_data_us_mean"] == pytest.approx(1.5)
    assert s["segments_mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="anatomy_stamps: no CTA"):
        ka.stamp_summary([[0] * len(ka.STAMP_FIELDS)])


def test_stamp_row_width_agrees_between_header_binding_and_script(ka) -> None:
    """cuda/anatomy_stamps.cuh's kFields, the binding's tensor width and STAMP_FIELDS name the same columns: a field
    added in one place only would shift every column the script reads."""
    header = (REPO / "cuda/anatomy_stamps.cuh").read_text()
    n_fields = int(re.search(r"constexpr int kFields = (\d+);", header).group(1))
    enum = re.search(r"enum Field \{([^}]*)\}", header).group(1)
    assert len([f for f in enum.replace("\n", " ").split(",") if f.strip()]) == n_fields
    binding = (REPO / "cuda/qerl_torch.cpp").read_text()
    assert f"torch::zeros({{ctas, {n_fields}}}, torch::kInt64)" in binding
    assert len(ka.STAMP_FIELDS) == n_fields


@pytest.mark.parametrize("anatomy", [False, True])
def test_anatomy_build_has_its_own_name_and_define(anatomy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With QERL_ANATOMY_STAMPS=1 the JIT build gets the define in both compilers' flags and its own extension name,
    and an installed ahead-of-time module is not used (it holds the measured kernels, not the stamped ones)."""
    import torch.utils.cpp_extension as cpp

    from verl_qerl.kernels import build

    calls = []
    monkeypatch.setattr(cpp, "load", lambda **kw: calls.append(kw) or types.SimpleNamespace(jit=kw["name"]))
    monkeypatch.setitem(sys.modules, "verl_qerl._C", types.SimpleNamespace(aot=True))
    monkeypatch.setattr("verl_qerl._C", sys.modules["verl_qerl._C"], raising=False)
    monkeypatch.setenv("QERL_ANATOMY_STAMPS", "1" if anatomy else "0")
    mod = build.load()
    if not anatomy:
        assert getattr(mod, "aot", False) and not calls
        return
    (kw,) = calls
    assert kw["name"] == build.JIT_NAME + "_anatomy"
    assert build.ANATOMY_DEFINE in kw["extra_cflags"] and build.ANATOMY_DEFINE in kw["extra_cuda_cflags"]


def test_cluster_switch_restores_the_callers_setting(ka, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep / stamps toggle QERL_WGMMA_CLUSTER per measurement and give back what the caller had set."""
    import os

    monkeypatch.setenv("QERL_WGMMA_CLUSTER", "0")
    with ka._cluster_split(True):
        assert os.environ["QERL_WGMMA_CLUSTER"] == "1"
    assert os.environ["QERL_WGMMA_CLUSTER"] == "0"
    monkeypatch.delenv("QERL_WGMMA_CLUSTER")
    with ka._cluster_split(False):
        assert os.environ["QERL_WGMMA_CLUSTER"] == "0"
    assert "QERL_WGMMA_CLUSTER" not in os.environ


def test_stamp_kernel_follows_the_forced_mode(ka) -> None:
    assert [ka.stamp_kernel(m, "wgmma_rs") for m in (64, 65, 128, 129, 256)] == ["wgmma"] * 3 + ["wide"] * 2
    assert [ka.stamp_kernel(m, "wgmma_wide") for m in (64, 65, 128, 129)] == ["wgmma"] + ["wide"] * 3
    with pytest.raises(ValueError, match="--mode 'splitk'"):
        ka.stamp_kernel(100, "splitk")
