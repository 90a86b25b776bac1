"""benchmarks/sass_hazards.py against the real compiler and disassembler: a register-A wgmma loop that rewrites its
fragment registers while the wgmma may still read them must be flagged, the same loop with a wait per step must
not, and the project's wgmma kernels (cuda/nvfp4_gemm_wgmma*.cu) must have no hazard at all (CPU only: nvcc for
sm_90a and nvdisasm, as tests/test_sass_census.py). The races it catches pass GPU tests when the wgmma happens to
finish before the write lands (benchmarks/NOTES.md, "Fourteenth round")."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_qerl.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sh(sass_census):  # skips where nvcc / nvdisasm are missing
    return load_script("benchmarks/sass_hazards.py", "sass_hazards")


# One m64n8k16 register-A wgmma per iteration of a loop that does not unroll: each iteration's loads write the same
# A registers. IN_LOOP is what runs after each wgmma.
FRAGMENT_LOOP = r"""
__global__ void frag_loop(float* out, const unsigned* a, unsigned long long desc, int n) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const unsigned f0 = a[4 * i], f1 = a[4 * i + 1], f2 = a[4 * i + 2], f3 = a[4 * i + 3];
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, "
                 "1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(f0), "r"(f1), "r"(f2), "r"(f3), "l"(desc), "r"(1));
    IN_LOOP
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  out[threadIdx.x] = d[0] + d[1] + d[2] + d[3];
#endif
}
"""
COMMIT = r'asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");'
WAIT = r'asm volatile("wgmma.wait_group.sync.aligned N;\n" ::: "memory");'


def _loop_hazards(sh, tmp_path: Path, name: str, in_loop: str) -> list:
    src = tmp_path / f"{name}.cu"
    src.write_text(FRAGMENT_LOOP.replace("IN_LOOP", in_loop))
    (kernel,) = sh.census(src)
    assert sum(i.op_class == "HGMMA" for i in kernel.instructions) >= 1
    return sh.hazards(kernel)


@pytest.mark.parametrize("in_loop", ["", COMMIT + WAIT.replace("N", "1")], ids=["no-wait", "commit-wait1"])
def test_fragment_rewritten_while_the_wgmma_may_read_it_is_flagged(sh, tmp_path, in_loop):
    """No wait, or a wait that leaves the newest group in flight: the next iteration's loads write A registers of a
    wgmma that may still be pending (the LoRA term's loop before its fix)."""
    found = _loop_hazards(sh, tmp_path, "racy", in_loop)
    assert found and {h.kind for h in found} == {"A-write"}
    assert all(h.offset < h.hgmma for h in found)  # the loop's loads, above the wgmma they overwrite (back edge)


def test_fragment_loop_with_a_wait_per_step_is_clean(sh, tmp_path):
    assert _loop_hazards(sh, tmp_path, "safe", COMMIT + WAIT.replace("N", "0")) == []


def test_project_wgmma_kernels_have_no_register_hazard(sh):
    """Every HGMMA kernel of the three wgmma sources: no A register written, no accumulator touched, while a wgmma
    that reads it may be in flight. Fails on the 64- / 128-token main loop with one wait per stage (its second half's
    fragments rewritten by the next stage's decode) and on the LoRA term's loop without its wait."""
    result = sh.check([REPO / "cuda" / f for f in
                       ("nvfp4_gemm_wgmma.cu", "nvfp4_gemm_wgmma_wide.cu", "nvfp4_gemm_wgmma_ss.cu")])
    assert len(result) >= 12  # plain / LoRA, 64 / 128 / 256 tokens, stream-K / cluster, the shared-memory kernel
    bad = {name: [h.describe() for h in found[:3]] for name, found in result.items() if found}
    assert not bad, bad


def test_cli_exit_codes(sh, tmp_path, capsys):
    racy = tmp_path / "racy.cu"
    racy.write_text(FRAGMENT_LOOP.replace("IN_LOOP", ""))
    safe = tmp_path / "safe.cu"
    safe.write_text(FRAGMENT_LOOP.replace("IN_LOOP", COMMIT + WAIT.replace("N", "0")))
    assert sh.main([str(racy)]) == 1 and "HAZARD" in capsys.readouterr().out
    assert sh.main([str(safe)]) == 0
    assert sh.main([str(tmp_path / "missing.cu")]) == 2
    assert "missing.cu" in capsys.readouterr().err
