"""benchmarks/gpu/stage_candidates.sh and candidates_check.sh on CPU: the staging makes complete, importable copies of
the repository at the commits asked for (and refuses what is not a commit, leaving nothing half-written); the check
refuses folders that are not staged copies and, without a GPU, stops a candidate at its build step with the reason
in its log (on the GPU machine the same path goes on to the tests and the timing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAGE = REPO / "benchmarks" / "gpu" / "stage_candidates.sh"
CHECK = REPO / "benchmarks" / "gpu" / "candidates_check.sh"


def _git_ok() -> bool:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    if not _git_ok():
        pytest.skip("not a git checkout")
    dest = tmp_path_factory.mktemp("cand")
    out = subprocess.run(["bash", str(STAGE), "HEAD", "HEAD~1"], capture_output=True, text=True,
                         env=dict(os.environ, DEST=str(dest)), timeout=120)
    assert out.returncode == 0, out.stderr
    return dest, out.stdout


def test_stage_makes_complete_copies(staged):
    dest, stdout = staged
    folders = sorted(p for p in dest.iterdir())
    assert len(folders) == 2 and not any(p.name.endswith(".tmp") for p in folders)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    copy = dest / head
    for rel in ("cuda/qerl_nvfp4.h", "verl_qerl/kernels/__init__.py", "benchmarks/kernel.py",
                "benchmarks/kernel_results.py", "benchmarks/results_format.py", "benchmarks/gpu/steps.sh",
                "tests/test_kernels_gpu.py", "tests/test_lora_fused_gpu.py", "benchmarks/lora_gemm_bench.py",
                "tests/conftest.py", "pytest.ini"):
        assert (copy / rel).is_file(), rel
    assert (copy / "cuda" / "nvfp4_gemm_wgmma.cu").read_bytes() == subprocess.run(
        ["git", "-C", str(REPO), "show", "HEAD:cuda/nvfp4_gemm_wgmma.cu"], capture_output=True).stdout
    assert "candidates_check.sh" in stdout and str(copy) in stdout
    # the copy's kernel.py and its sibling modules import from the copy alone (the GPU machine runs it there)
    out = subprocess.run([sys.executable, "benchmarks/kernel.py", "--sweep-splits", "x"], cwd=copy,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(copy)))
    assert out.returncode == 2 and "--sweep-splits" in out.stderr  # parsed by the copy's own option table


def test_stage_refuses_what_is_not_a_commit(tmp_path):
    if not _git_ok():
        pytest.skip("not a git checkout")
    out = subprocess.run(["bash", str(STAGE), "no-such-rev-x"], capture_output=True, text=True,
                         env=dict(os.environ, DEST=str(tmp_path / "c")), timeout=60)
    assert out.returncode == 2 and "no-such-rev-x is not a commit" in out.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_check_refuses_unstaged_folders_and_stops_at_the_build_without_a_gpu(staged, tmp_path):
    dest, _ = staged
    out_dir = tmp_path / "out"
    bad = subprocess.run(["bash", str(CHECK), str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, OUT=str(out_dir)), timeout=60)
    assert bad.returncode == 2 and "is not a staged repository copy" in bad.stderr
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the check would build and time for real")
    folder = sorted(dest.iterdir())[0]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # python3 = this venv's, as on the GPU
    run = subprocess.run(["bash", str(CHECK), str(folder)], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, OUT=str(out_dir), PATH=path), timeout=300)
    log = (out_dir / f"{folder.name}.log").read_text()
    assert run.returncode == 1
    assert log.count(f"[{folder.name}] build rc=1") == 1 and f"[candidates_check] {folder.name} rc=1" in log
    assert "NOT loaded" in log and not (out_dir / f"{folder.name}-kernel.json").exists()


def test_check_skips_the_tests_of_the_folders_named_in_cand_skip_tests(staged, tmp_path):
    """CAND_SKIP_TESTS (the HEAD copies) goes from the build straight to timing; other folders still run their tests.
    A stand-in ``python3`` first on PATH records what it was asked to run: the build check and the table succeed,
    pytest only leaves a mark."""
    dest, _ = staged
    folder = sorted(dest.iterdir())[0]
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
prev=""
for a in "$@"; do
  if [ "$prev" = "--out" ]; then mkdir -p "$(dirname "$a")"; echo '{{}}' > "$a"; fi
  prev=$a
done
exit 0
""")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CAND_TESTS="tests/test_x.py")
    for skip in (folder.name, ""):
        out_dir = tmp_path / f"out-{bool(skip)}"
        calls.write_text("")
        run = subprocess.run(["bash", str(CHECK), str(folder)], capture_output=True, text=True, cwd=REPO,
                             env=dict(env, OUT=str(out_dir), CAND_SKIP_TESTS=f"other,{skip}"), timeout=120)
        log = (out_dir / f"{folder.name}.log").read_text()
        assert run.returncode == 0, log + run.stderr
        asked = calls.read_text()
        assert "benchmarks/kernel.py" in asked and (out_dir / f"{folder.name}-kernel.json").exists()
        if skip:
            assert "pytest" not in asked and "tests skipped (CAND_SKIP_TESTS)" in log
        else:
            assert "tests/test_kernels_gpu.py -k wgmma" in asked and "tests/test_x.py" in asked


def test_decode_skeleton_edits_match_the_kernel(tmp_path: Path) -> None:
    """benchmarks/gpu/decode_skeleton.sh edits the decode kernel with sed; a pattern that no longer matches would time
    the full kernel as a "skeleton" without a word. Each of its three edits, applied to a copy of the kernel as the
    script does, changes what it is meant to change."""
    import re

    script = (REPO / "benchmarks" / "gpu" / "decode_skeleton.sh").read_text()
    skip, wonly, w4k = re.findall(r"sed -i '([^']+)' \$F", script)
    kernel = (REPO / "cuda" / "nvfp4_gemm_decode_tma.cu").read_text()

    def edited(*exprs: str) -> str:
        f = tmp_path / "k.cu"
        f.write_text(kernel)
        for e in exprs:
            subprocess.run(["sed", "-i", e, str(f)], check=True)
        return f.read_text()

    sk = edited(skip)
    assert sk.count("if (M < 0) mma_k16_step(") == 1 and "load_2d(base" in sk
    w = edited(skip, wonly)
    assert "load_2d(base" not in w and "bulk_copy(base + C::S_OFF" not in w
    assert "X_HALF_BYTES + DT_W_BYTES" not in w and "(i % STAGES), DT_W_BYTES);" in w  # each slot expects weights only
    h = edited(skip, w4k)
    assert h.count("DT_W_BYTES / 2, bar)") == 2 and "W_VEC / 2" in h


def _patch_for_header(tmp_path: Path, old: str, new: str) -> Path:
    """A unified diff against HEAD's cuda/qerl_nvfp4.h replacing ``old`` with ``new``."""
    import difflib

    text = subprocess.run(["git", "-C", str(REPO), "show", "HEAD:cuda/qerl_nvfp4.h"], capture_output=True,
                          text=True).stdout
    assert old in text
    diff = difflib.unified_diff(text.splitlines(keepends=True), text.replace(old, new, 1).splitlines(keepends=True),
                                "a/cuda/qerl_nvfp4.h", "b/cuda/qerl_nvfp4.h")
    patch = tmp_path / "cand.patch"
    patch.write_text("".join(diff))
    return patch


def test_stage_applies_a_patch_to_head_without_touching_the_checkout(tmp_path):
    """A FILE.patch argument stages HEAD with the patch applied, in a folder named after it; the working tree and the
    index are left as they were. A patch that does not apply is refused, naming it, with nothing staged."""
    if not _git_ok():
        pytest.skip("not a git checkout")
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout
    patch = _patch_for_header(tmp_path, "#pragma once", "#pragma once\n// candidate marker")
    dest = tmp_path / "cand"
    out = subprocess.run(["bash", str(STAGE), str(patch)], capture_output=True, text=True,
                         env=dict(os.environ, DEST=str(dest), STAGE_COMPILE="0"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "// candidate marker" in (dest / "cand" / "cuda" / "qerl_nvfp4.h").read_text()
    assert "// candidate marker" not in (REPO / "cuda" / "qerl_nvfp4.h").read_text()
    assert subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True,
                          text=True).stdout == status
    bad = tmp_path / "bad.patch"
    bad.write_text(patch.read_text().replace("#pragma once", "#pragma twice"))
    out = subprocess.run(["bash", str(STAGE), str(bad)], capture_output=True, text=True,
                         env=dict(os.environ, DEST=str(tmp_path / "c2"), STAGE_COMPILE="0"), timeout=60)
    assert out.returncode == 2 and "bad.patch does not apply to HEAD" in out.stderr
    assert not (tmp_path / "c2" / "bad").exists()


def test_stage_refuses_a_patch_that_does_not_compile(tmp_path):
    """A patched copy is compiled before it is staged (.ci/compile_cuda.sh on the copy, stopping at the first error):
    one that does not build is refused, naming the patch, with nothing staged, so it cannot cost a GPU call (a
    candidate once reached the GPU machine with a broken string literal in the binding)."""
    import difflib
    import shutil

    if not _git_ok():
        pytest.skip("not a git checkout")
    if shutil.which(os.environ.get("NVCC", "nvcc")) is None:
        pytest.skip("no nvcc")
    text = subprocess.run(["git", "-C", str(REPO), "show", "HEAD:cuda/nvfp4_dequant.cu"], capture_output=True,
                          text=True).stdout
    assert text, "cuda/nvfp4_dequant.cu is the first source compile_cuda.sh builds"
    lines = text.splitlines(keepends=True)
    broken = ["#error this candidate does not build\n"] + lines
    patch = tmp_path / "broken.patch"
    patch.write_text("".join(difflib.unified_diff(lines, broken, "a/cuda/nvfp4_dequant.cu", "b/cuda/nvfp4_dequant.cu")))
    dest = tmp_path / "c3"
    out = subprocess.run(["bash", str(STAGE), str(patch)], capture_output=True, text=True,
                         env=dict(os.environ, DEST=str(dest)), timeout=300)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "broken.patch does not compile" in out.stderr and "this candidate does not build" in out.stderr
    assert not (dest / "broken").exists() and not (dest / "broken.tmp").exists()


@pytest.mark.parametrize("patch", sorted((REPO / "benchmarks" / "candidates").glob("*.patch")), ids=lambda p: p.stem)
def test_kept_candidates_still_apply_to_head(patch):
    """Every kernel candidate kept as a patch (benchmarks/candidates/README.md) applies to HEAD: a change to the files
    it touches must rebase it (or delete it) rather than leave a candidate nobody can stage."""
    out = subprocess.run(["git", "-C", str(REPO), "apply", "--check", str(patch)], capture_output=True, text=True)
    assert out.returncode == 0, f"{patch.name} no longer applies to HEAD: {out.stderr}"


@pytest.mark.parametrize("patch", sorted((REPO / "benchmarks" / "candidates").glob("*.patch")), ids=lambda p: p.stem)
def test_kept_candidates_touch_only_what_staging_carries(patch):
    """A kept candidate changes only what stage_candidates.sh puts in a staged copy (the kernels, their Python side,
    the kernel benchmarks, the GPU kernel tests): a hunk elsewhere would be dropped when staged, and one made by
    diffing against a newer main would silently revert that file when the patch is merged."""
    import re

    files = re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), flags=re.M)
    assert files, f"{patch.name} has no file diffs"
    allowed = re.compile(r"^(cuda/|verl_qerl/kernels/|benchmarks/(kernel[a-z_]*|lora_[a-z_]*bench)\.py$|"
                         r"tests/test_[a-z_]*gpu\.py$)")
    assert [f for f in files if not allowed.match(f)] == [], f"{patch.name} touches files staging does not carry"


PER_GPU = REPO / "benchmarks" / "gpu" / "candidates_per_gpu.sh"


def test_per_gpu_lanes_refuse_a_folder_name_in_two_lanes(staged, tmp_path):
    dest, _ = staged
    folder = sorted(dest.iterdir())[0]
    run = subprocess.run(["bash", str(PER_GPU), f"CAND_MS=64 :: {folder}", f":: {folder}"], capture_output=True,
                         text=True, cwd=REPO, env=dict(os.environ, OUT=str(tmp_path / "out")), timeout=60)
    assert run.returncode == 2 and f"folder name {folder.name} is in lanes 0 and 1" in run.stderr
    bad = subprocess.run(["bash", str(PER_GPU), str(folder)], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, OUT=str(tmp_path / "out")), timeout=60)
    assert bad.returncode == 2 and "no '::'" in bad.stderr


def test_per_gpu_lanes_run_each_lane_and_archive_them(staged, tmp_path):
    """Without a GPU every lane stops at its build step (as candidates_check.sh does alone); the archive still holds
    each lane's logs under g<i>/, and lanes.txt says each lane's status."""
    import tarfile

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the lanes would build and time for real")
    dest, _ = staged
    a, b = sorted(dest.iterdir())
    out = tmp_path / "out"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    run = subprocess.run(["bash", str(PER_GPU), f'CAND_MS=64 CAND_TESTS="x.py y.py" :: {a}', f":: {b}"],
                         capture_output=True, text=True, cwd=REPO, timeout=600,
                         env=dict(os.environ, OUT=str(out), PATH=path, MAX_JOBS="1"))
    assert run.returncode == 1, run.stdout + run.stderr
    lanes = (out / "lanes.txt").read_text()
    assert "lane 0 rc=1" in lanes and "lane 1 rc=1" in lanes
    with tarfile.open(out / "lanes.tgz") as tar:
        names = tar.getnames()
        assert f"g0/{a.name}.log" in names and f"g1/{b.name}.log" in names
        log = tar.extractfile(f"g1/{b.name}.log").read().decode()
    assert f"[{b.name}] build rc=1" in log


def test_staged_benchmarks_import_only_staged_modules():
    """The benchmark scripts staging carries (stage_candidates.sh: benchmarks/kernel*.py, lora_*bench.py,
    results_format.py) import no benchmark module it leaves out: `lora_shrink_bench.py` once imported `rollout` and
    failed on the GPU machine at its first line (NOTES, "Outcome of `shrink-splitk`")."""
    import re

    # the benchmark names stage_candidates.sh's own `grep -E '^benchmarks/(...)\.py$'` selects, read from the script
    found = re.search(r"grep -E '\^benchmarks/\(([^)]*)\)\\\.py\$'", STAGE.read_text())
    assert found, "stage_candidates.sh no longer selects benchmarks with grep -E '^benchmarks/(...)\\.py$'"
    staged_re = re.compile(rf"^({found.group(1)})$")
    bench = REPO / "benchmarks"
    local = {p.stem for p in bench.glob("*.py")}
    for script in sorted(bench.glob("*.py")):
        if not staged_re.match(script.stem):
            continue
        imported = set(re.findall(r"^(?:from|import)\s+([A-Za-z_]\w*)", script.read_text(), flags=re.M))
        missing = sorted(m for m in imported & local if not staged_re.match(m))
        assert missing == [], f"{script.name} imports {missing}, which stage_candidates.sh does not carry"
