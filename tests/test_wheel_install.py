"""A regular (non-editable) install of the wheel: ``verl_qerl.kernels`` reads ``gemm_modes.h`` at import and
JIT-builds from the kernel sources, so the wheel must carry them (setup.py's build_py copies cuda/ to
verl_qerl/kernels/csrc). Before, the wheel had neither and ``import verl_qerl.kernels`` failed outside the
repository ("CUDA sources not found")."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_ships_the_kernel_sources_and_imports_outside_the_repository(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    build = tmp_path / "src"
    # build from a copy, so the repository gets no build/ or egg-info folders
    subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True)  # (git optional)
    files = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True).stdout
    for rel in files.split():
        dst = build / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / rel).is_file():
            dst.write_bytes((REPO / rel).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(build)], check=True, capture_output=True, text=True)
    (whl,) = wheels.glob("verl_qerl-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    sources = sorted(p.name for p in (REPO / "cuda").iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    assert sources and all(f"verl_qerl/kernels/csrc/{s}" in names for s in sources), sorted(names)[:20]
    # the `+qerl=...` config group and the hydra plugin that puts it on every hydra app's search path
    groups = sorted(p.name for p in (REPO / "verl_qerl" / "verl" / "hydra" / "qerl").glob("*.yaml"))
    assert groups and all(f"verl_qerl/verl/hydra/qerl/{g}" in names for g in groups), sorted(names)[:20]
    assert "hydra_plugins/verl_qerl/verl_qerl_searchpath.py" in names
    assert any(n.startswith("verl_qerl/kernels/gemm_dispatch_") and n.endswith(".json") for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)],
                   check=True, capture_output=True, text=True)
    probe = ("import verl_qerl, verl_qerl.kernels as k; from verl_qerl.kernels import build; "
             "print(verl_qerl.__file__); print(build.source_dir()); print(sorted(k.GEMM_MODES))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    mod, src, modes = out.stdout.splitlines()[-3:]
    assert mod.startswith(str(site)) and src == str(site / "verl_qerl" / "kernels" / "csrc"), out.stdout
    assert "wgmma_rs" in modes
