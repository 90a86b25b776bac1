"""benchmarks/kernel_splits.py (``kernel.py --sweep-splits``) on CPU: the option's parsing, which split counts one
GEMM is timed at, the best / heuristic bookkeeping, the layer sums and targets, and the sweep loop with a timer
standing in for the GPU (the GPU run itself is the benchmark). Also that kernel.py refuses a bad list."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verl_qerl.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ks():
    return load_script("benchmarks/kernel_splits.py", "kernel_splits")


def test_parse_splits(ks):
    assert ks.parse_splits("8, 1,2,2,16") == [1, 2, 8, 16]
    for bad in ("", "0,2", "2,x", "-1", "1.5"):
        with pytest.raises(ValueError, match="--sweep-splits"):
            ks.parse_splits(bad)


def test_candidates_include_the_heuristic_and_respect_the_stages(ks):
    assert ks.candidate_splits([1, 2, 4, 8, 32], stages=28, heuristic=3) == [1, 2, 3, 4, 8]
    assert ks.candidate_splits([1, 2], stages=1, heuristic=1) == [1]


def test_row_best_and_heuristic(ks):
    row = ks.sweep_row("m7", "gate_up", 1, 37888, 3584, {1: 0.05, 2: 0.035, 4: 0.030, 8: None, 7: 0.030}, 2)
    assert row["best_splits"] == 4  # a tie goes to the smaller count; untimed counts are dropped
    assert row["ms"] == {"1": 0.05, "2": 0.035, "4": 0.03, "7": 0.03}
    assert row["heuristic_splits"] == 2 and row["heuristic_over_best"] == pytest.approx(0.035 / 0.030, abs=1e-3)
    with pytest.raises(ValueError, match="gate_up M=1: the heuristic's split count 8 was not timed"):
        ks.sweep_row("m7", "gate_up", 1, 37888, 3584, {1: 0.05, 8: None}, 8)


def test_layer_sums_and_targets(ks):
    rows = [ks.sweep_row("m7", "qkv", 1, 4608, 3584, {3: 0.009, 7: 0.006}, 3),
            ks.sweep_row("m7", "o", 1, 3584, 3584, {4: 0.008, 7: 0.008}, 4),
            ks.sweep_row("m7", "qkv", 16, 4608, 3584, {3: 0.010}, 3)]
    sums = {(s["model"], s["M"]): s for s in ks.layer_sums(rows)}
    assert sums[("m7", 1)]["gemms"] == 2
    assert sums[("m7", 1)]["heuristic_ms"] == pytest.approx(0.017)
    assert sums[("m7", 1)]["best_ms"] == pytest.approx(0.014)
    assert sums[("m7", 16)]["heuristic_over_best"] == 1.0
    targets = {t["name"].split(":")[0]: t for t in ks.sweep_targets(list(sums.values()))}
    assert targets["m7 M=1"]["measured"] == pytest.approx(0.017 / 0.014, abs=1e-3) and targets["m7 M=1"]["op"] == "<="
    assert targets["m7 M=16"]["target"] == ks.HEURISTIC_TOLERANCE


def test_run_sweep_times_every_candidate_once(ks, capsys):
    calls = []

    def time_gemm(m, n, k, s):
        calls.append((m, n, k, s))
        return 1.0 / s + (0.1 * s if s > 4 else 0.0)  # best at 4

    shapes = lambda cfg: [("a", 256, 512), ("b", 128, 1024)]  # noqa: E731 - 4 and 8 stages of 128
    rows = ks.run_sweep({"toy": {}}, [1, 16], [1, 2, 4, 8], time_gemm, lambda m, n, k: 2, shapes, 128)
    assert [(r["layer"], r["M"]) for r in rows] == [("a", 1), ("a", 16), ("b", 1), ("b", 16)]
    assert sorted({c[3] for c in calls if c[1] == 256}) == [1, 2, 4]  # 8 > 4 stages: not run
    assert sorted({c[3] for c in calls if c[1] == 128}) == [1, 2, 4, 8]
    assert len(calls) == len(set(calls))
    assert all(r["best_splits"] == 4 and r["heuristic_splits"] == 2 for r in rows)
    assert "best 4, heuristic 2" in capsys.readouterr().out


def test_kernel_py_refuses_a_bad_list():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel.py"), "--sweep-splits", "0,2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--sweep-splits" in out.stderr
