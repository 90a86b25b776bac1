""".ci/compile_cuda.sh's verdicts, with a stand-in nvcc that prints what ptxas would: the script must fail on
register spills and on wgmma instructions ptxas serialized (an info line, not a warning: nvcc exits 0), and pass
a clean build. The real compile of every source runs in CI itself (.ci/run)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "compile_cuda.sh"

SERIALIZED = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
              "insufficient register resources for the function '_Z6kernelv'")
SPILL = "ptxas info    :     8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"
CLEAN = "ptxas info    :     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"


def fake_nvcc(tmp_path: Path, ptxas_line: str) -> Path:
    """An nvcc that answers --version, writes the object it is asked for, prints `ptxas_line` and a register count."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"""#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "fake nvcc"; echo "Cuda compilation tools, release 13.0"; exit 0; fi
out=
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
[ -n "$out" ] && : > "$out"
echo "ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'"
echo "{ptxas_line}"
echo "ptxas info    : Used 200 registers, used 1 barriers"
""")
    nvcc.chmod(0o755)
    return nvcc


def run_script(nvcc: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NVCC=str(nvcc), PYTHON="/nonexistent/python")  # no torch: the binding check is skipped
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("line", "why"), [(SERIALIZED, "ptxas serialized wgmma instructions"),
                                           (SPILL, "register spills / stack frame")])
def test_compile_cuda_fails_on(tmp_path: Path, line: str, why: str) -> None:
    res = run_script(fake_nvcc(tmp_path, line))
    assert res.returncode == 1, res.stdout + res.stderr
    assert why in res.stderr and "compile_cuda.sh: FAILED" in res.stderr


def test_compile_cuda_passes_a_clean_build(tmp_path: Path) -> None:
    res = run_script(fake_nvcc(tmp_path, CLEAN))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compile_cuda.sh: all CUDA sources compile" in res.stdout and "FAIL" not in res.stderr
