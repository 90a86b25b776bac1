"""benchmarks/kernel_ab.py (a candidate against HEAD from interleaved kernel.py runs) and the call that uses it,
benchmarks/gpu/candidate_ab.sh, on CPU: the means and their change are computed per GEMM from each tree's own runs,
bad inputs are named, and without a GPU the script stops at the build but still archives what it has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import kernel_ab  # noqa: E402

AB = REPO / "benchmarks" / "gpu" / "candidate_ab.sh"


def _results(path: Path, times_us: dict[tuple[str, int], float], bf16_us: float = 50.0) -> Path:
    rows = [{"model": "qwen2.5-7b", "layer": layer, "M": m, "kernel_wgmma_rs_graph_ms": t / 1e3,
             "bf16_graph_ms": bf16_us / 1e3} for (layer, m), t in times_us.items()]
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_change_is_of_the_means_of_each_trees_runs(tmp_path: Path) -> None:
    h1 = _results(tmp_path / "h1.json", {("qkv", 256): 20.0, ("o", 256): 10.0})
    h2 = _results(tmp_path / "h2.json", {("qkv", 256): 22.0, ("o", 256): 10.0})
    c1 = _results(tmp_path / "c1.json", {("qkv", 256): 19.0, ("o", 256): 11.0})
    c2 = _results(tmp_path / "c2.json", {("qkv", 256): 20.0, ("o", 256): 11.0})
    entries = kernel_ab.compare([kernel_ab.load_rows(h1), kernel_ab.load_rows(h2)],
                                [kernel_ab.load_rows(c1), kernel_ab.load_rows(c2)])
    by_layer = {e["layer"]: e for e in entries}
    assert by_layer["qkv"]["head_us"] == pytest.approx([20.0, 22.0])
    assert by_layer["qkv"]["change_pct"] == pytest.approx(100 * (19.5 / 21.0 - 1))   # -7.1 %, not run-by-run
    assert by_layer["o"]["change_pct"] == pytest.approx(10.0)
    assert by_layer["o"]["bf16_us"] == pytest.approx(50.0)
    text = kernel_ab.format_table(entries)
    assert "-7.1 %" in text and "+10.0 %" in text


def test_rows_missing_from_a_run_are_left_out_and_a_missing_column_is_named(tmp_path: Path) -> None:
    h = kernel_ab.load_rows(_results(tmp_path / "h.json", {("qkv", 64): 12.0, ("o", 64): 11.0}))
    c = kernel_ab.load_rows(_results(tmp_path / "c.json", {("qkv", 64): 12.0}))
    assert [e["layer"] for e in kernel_ab.compare([h], [c])] == ["qkv"]
    with pytest.raises(ValueError, match="kernel_splitk_graph_ms"):
        kernel_ab.compare([h], [c], variant="splitk")


def test_a_file_without_rows_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "notes.json"
    bad.write_text(json.dumps({"device": "x"}))
    with pytest.raises(SystemExit):
        kernel_ab.main(["--head", str(bad), "--cand", str(bad)])
    assert "notes.json: no 'rows'" in capsys.readouterr().err


def test_script_refuses_bad_arguments(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    one = subprocess.run(["bash", str(AB), str(tmp_path)], capture_output=True, text=True, cwd=REPO, env=env)
    assert one.returncode == 2 and "usage" in one.stderr
    (tmp_path / "a" / "x").mkdir(parents=True)
    (tmp_path / "b" / "x").mkdir(parents=True)
    same = subprocess.run(["bash", str(AB), str(tmp_path / "a" / "x"), str(tmp_path / "b" / "x")],
                          capture_output=True, text=True, cwd=REPO, env=env)
    assert same.returncode == 2 and "both folders are named x" in same.stderr


def test_script_without_a_gpu_stops_at_the_build_and_archives_the_logs(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would build and time for real")
    head, cand = tmp_path / "head", tmp_path / "cand"
    for d in (head, cand):  # not staged copies: candidates_check.sh refuses them, the archive still comes back
        d.mkdir()
    out = tmp_path / "out"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    run = subprocess.run(["bash", str(AB), str(head), str(cand)], capture_output=True, text=True, cwd=REPO,
                         timeout=300, env=dict(os.environ, OUT=str(out), PATH=path, AB_WORK=str(tmp_path / "w")))
    assert run.returncode != 0, run.stdout + run.stderr
    assert not (out / "ab-summary.txt").exists()  # no timing ran: no summary
    with tarfile.open(out / "ab.tgz") as tar:
        assert tar.getnames()  # the archive exists (the refusals are in the call's output)
    assert "is not a staged repository copy" in run.stderr


def test_script_refuses_a_bad_round_count(tmp_path: Path) -> None:
    (tmp_path / "h").mkdir()
    (tmp_path / "c").mkdir()
    run = subprocess.run(["bash", str(AB), str(tmp_path / "h"), str(tmp_path / "c")], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, OUT=str(tmp_path / "out"), AB_ROUNDS="0"))
    assert run.returncode == 2 and "AB_ROUNDS=0 is not a positive integer" in run.stderr
