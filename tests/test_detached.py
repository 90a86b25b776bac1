"""benchmarks/gpu/detached.sh: a job spread over several GPU calls (start, wait, results copied to $OUT)."""

import os
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "detached.sh"


def _run(args: list[str], out: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out)}
    # the script's root is /tmp/detached: give every test its own job name
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=tmp, timeout=60)


@pytest.fixture
def name(tmp_path: Path) -> str:
    n = f"qerl-test-{os.getpid()}-{tmp_path.name}"
    yield n
    subprocess.run(["rm", "-rf", f"/tmp/detached/{n}"], check=False)


def test_results_in_subfolders_arrive_under_distinct_names(tmp_path: Path, name: str) -> None:
    out = tmp_path / "OUT"
    out.mkdir()
    job = (f"mkdir -p /tmp/detached/{name}/out/32b && echo seven > /tmp/detached/{name}/out/r.json && "
           f"echo thirty-two > /tmp/detached/{name}/out/32b/r.json && echo done")
    assert _run(["start", name, "bash", "-c", job], out, tmp_path).returncode == 0
    res = _run(["wait", name, "30"], out, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (out / "r.json").read_text() == "seven\n"
    assert (out / "32b--r.json").read_text() == "thirty-two\n"  # not overwriting r.json
    assert "done" in (out / f"{name}.log").read_text()


def test_wait_reports_still_running_then_the_exit_status(tmp_path: Path, name: str) -> None:
    out = tmp_path / "OUT"
    out.mkdir()
    assert _run(["start", name, "bash", "-c", "sleep 3; exit 7"], out, tmp_path).returncode == 0
    assert _run(["wait", name, "0"], out, tmp_path).returncode == 75
    t0 = time.monotonic()
    assert _run(["wait", name, "30"], out, tmp_path).returncode == 7
    assert time.monotonic() - t0 < 20


def test_wait_on_a_job_never_started_here(tmp_path: Path, name: str) -> None:
    res = _run(["wait", name, "1"], tmp_path, tmp_path)
    assert res.returncode == 3 and "never started" in res.stderr
