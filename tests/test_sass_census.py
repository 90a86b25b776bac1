"""benchmarks/sass_census.py against the real compiler and disassembler: nvcc builds small kernels whose SASS is
known in part (a loop of four independent FMAs, an mma.sync loop), nvdisasm reads them back, and the census must
find those loops, their counts, the register report and, against a second build, what changed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sc(sass_census):
    return sass_census


# four independent FMA chains in a loop that must not unroll: exactly four FFMA per iteration
FMA_LOOP = r"""
__global__ void fma4(float* out, const float* a, int n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  const float x = a[threadIdx.x];
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const float y = a[i];
    s0 = fmaf(x, y, s0); s1 = fmaf(y, y, s1); s2 = fmaf(x, s2, y); s3 = fmaf(s3, y, x);
  }
  out[threadIdx.x] = s0 + s1 + s2 + s3;  // COMMENT
}
"""

# a small loop without tensor work before a loop of two mma.sync: the census's main loop is the MMA one
MMA_LOOP = r"""
__global__ void mma2(float* out, const unsigned* a, int n) {
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  unsigned t = 0;
#pragma unroll 1
  for (int i = 0; i < n; ++i) t = t * 3u + a[i];
  const unsigned b0 = a[threadIdx.x] ^ t, b1 = a[threadIdx.x + 32];
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const unsigned a0 = a[i], a1 = a[i + 1], a2 = a[i + 2], a3 = a[i + 3];
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a3), "r"(a2), "r"(a1), "r"(a0), "r"(b1), "r"(b0));
  }
  out[threadIdx.x] = c[0] + c[1] + c[2] + c[3];
}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_finds_the_loop_and_its_four_fmas(sc, tmp_path):
    (kernel,) = sc.census(_write(tmp_path, "fma4.cu", FMA_LOOP))
    assert kernel.name.startswith("fma4(")  # demangled
    assert isinstance(kernel.registers, int) and kernel.registers > 0 and kernel.spill_bytes == 0
    loop = kernel.main_loop()
    assert loop is not None and loop.counts.get("FFMA") == 4
    assert loop.counts.get("BRA", 0) >= 1 and loop.start < loop.end
    assert kernel.counts["FFMA"] >= 4 and sum(kernel.counts.values()) == len(kernel.instructions)


def test_main_loop_is_the_tensor_core_loop(sc, tmp_path):
    (kernel,) = sc.census(_write(tmp_path, "mma2.cu", MMA_LOOP))
    loops = kernel.loops()
    assert len(loops) >= 2
    main = kernel.main_loop()
    assert main.counts.get("HMMA") == 2
    assert any(not lp.counts.get("HMMA") for lp in loops)  # the other loop exists and was passed over


# a one-MMA loop before the two-MMA k loop: the main loop is the one with more tensor work, not the first found
MMA_SIDE_LOOP = MMA_LOOP.replace("for (int i = 0; i < n; ++i) t = t * 3u + a[i];", """for (int i = 0; i < n; ++i) {
    t = t * 3u + a[i];
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%4,%4}, "
                 "{%0,%1,%2,%3};\\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(t));
  }""")


def test_main_loop_is_the_loop_with_the_most_tensor_work(sc, tmp_path):
    (kernel,) = sc.census(_write(tmp_path, "mma_side.cu", MMA_SIDE_LOOP))
    hmma = sorted(lp.counts.get("HMMA", 0) for lp in kernel.loops())
    assert 1 in hmma and 2 in hmma, hmma  # both loops compiled as written
    assert kernel.main_loop().counts.get("HMMA") == 2


def test_compare_tells_identical_from_changed(sc, tmp_path):
    base = sc.census(_write(tmp_path, "a.cu", FMA_LOOP))
    same = sc.census(_write(tmp_path, "b.cu", FMA_LOOP.replace("COMMENT", "another comment")))
    (row,) = sc.compare(same, base)
    assert row["status"] == "identical" and row["instructions"] == len(base[0].instructions)
    changed = sc.census(_write(tmp_path, "c.cu", FMA_LOOP.replace("s3 = fmaf(s3, y, x);", "s3 = fmaf(s3, y, x) * y;")))
    (row,) = sc.compare(changed, base)
    assert row["status"] == "changed" and row["now"] != row["was"]
    assert 0 <= row["first_difference"] <= min(row["instructions"], row["before"])
    renamed = sc.census(_write(tmp_path, "d.cu", FMA_LOOP.replace("fma4", "fma4b")))
    assert sorted(r["status"] for r in sc.compare(renamed, base)) == ["added", "removed"]


def test_compare_matches_a_kernel_whose_parameters_changed(sc, tmp_path):
    """A new parameter type (a kernel taking a struct of two tensor maps instead of one) is still the same kernel:
    compared by its name without the parameter list, with the old signature and the main loop's size on both sides."""
    base = sc.census(_write(tmp_path, "a.cu", FMA_LOOP))
    retyped = sc.census(_write(tmp_path, "e.cu", FMA_LOOP.replace("int n)", "long long n)")))
    (row,) = sc.compare(retyped, base)
    assert row["status"] == "changed", row
    assert row["signature_before"] == base[0].name != row["kernel"]
    assert row["main_loop_every_warp_before"] == base[0].main_loop().size
    assert isinstance(row["main_loop_every_warp"], int) and row["spill_bytes"] == 0
    # two overloads left on one side are ambiguous: reported as added / removed, not guessed
    both = _write(tmp_path, "f.cu", FMA_LOOP.replace("int n)", "long long n)")
                  + FMA_LOOP.replace("int n)", "short n)"))
    statuses = sorted(r["status"] for r in sc.compare(sc.census(both), base))
    assert statuses == ["added", "added", "removed"], statuses
    assert sc._template_name("void ns::(anonymous namespace)::k<64, true>(ns::Maps, int (*)(int))") == \
        "void ns::(anonymous namespace)::k<64, true>"


def test_against_a_revision_of_the_repository(sc, tmp_path):
    """The real sources at HEAD against the working tree: the dequant kernels compile to the same stream unless
    the working tree changed them (then the test says which)."""
    src = REPO / "cuda" / "nvfp4_dequant.cu"
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "cuda"], capture_output=True, text=True)
    if dirty.returncode != 0:
        pytest.skip("not a git checkout")
    if dirty.stdout.strip():
        pytest.skip(f"cuda/ has uncommitted changes: {dirty.stdout.split()[:4]}")
    out = tmp_path / "census.json"
    assert sc.main([str(src), "--against", "HEAD", "--expect-identical", "--json", str(out)]) == 0
    import json

    doc = json.loads(out.read_text())
    assert doc["kernels"] and all(r["status"] == "identical" for r in doc["comparison"])
    assert {r["kernel"] for r in doc["comparison"]} == {k["kernel"] for k in doc["kernels"]}


def test_clear_errors(sc, tmp_path, monkeypatch, capsys):
    with pytest.raises(sc.CensusError, match="nope.cu: no such CUDA source"):
        sc.census(tmp_path / "nope.cu")
    bad = _write(tmp_path, "bad.cu", "__global__ void k() { undefined_thing(); }\n")
    with pytest.raises(sc.CensusError, match="bad.cu: nvcc failed for sm_90a"):
        sc.census(bad)
    assert sc.main([str(bad)]) == 2 and "bad.cu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sc.main([str(bad), "--expect-identical"])  # only with --against
    monkeypatch.setenv("NVDISASM", str(tmp_path / "missing-nvdisasm"))
    with pytest.raises(sc.CensusError, match="NVDISASM=.*missing-nvdisasm: not an executable"):
        sc.find_nvdisasm()


# loops whose copies thread 0 issues inside a branch every thread takes: one copy (ptxas predicates it in place) or
# four (ptxas branches around them on the thread test)
PRODUCER_LOOP = r"""
__global__ void prod(float* out, const float4* src, int n) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bar;
  const unsigned sa = unsigned(__cvta_generic_to_shared(sm)), ba = unsigned(__cvta_generic_to_shared(&bar));
  float s = out[threadIdx.x];
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    if (i + 1 < n) {
      s = fmaf(s, 1.5f, 2.0f);
      if (threadIdx.x == 0) {
#pragma unroll
        for (int b = 0; b < COPIES; ++b)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 512, [%2];\n"
                       :: "r"(sa + 512 * b), "l"(src + 32 * (i + b * n)), "r"(ba) : "memory");
      }
    }
    s = fmaf(s, s, 1.0f);
  }
  out[threadIdx.x] = s;
}
"""


@pytest.mark.parametrize("copies", [1, 4])
def test_producer_path_is_a_branch_around_the_copies_only(sc, tmp_path, copies):
    """What only the copy-issuing thread runs is told apart from what every warp runs: the two FMAs (one inside the
    enclosing branch every thread takes) are never counted as one thread's; the four copies are (ptxas branches
    around them on the thread test); the single copy is not (ptxas predicates it in place, every warp runs the
    instructions around it)."""
    (kernel,) = sc.census(_write(tmp_path, f"prod{copies}.cu", PRODUCER_LOOP.replace("COPIES", str(copies))))
    main = kernel.main_loop()
    skipped = kernel.producer_offsets(main)
    in_loop = [i for i in kernel.instructions if main.start <= i.offset <= main.end]
    copy_ops = [i.offset for i in in_loop if i.op_class == "UBLKCP"]
    fmas = [i.offset for i in in_loop if i.op_class == "FFMA"]
    assert len(copy_ops) == copies and len(fmas) == 2 and not set(fmas) & skipped
    if copies == 4:
        assert set(copy_ops) <= skipped and 0 < kernel.producer_only(main) < main.size
    else:
        assert kernel.producer_only(main) == 0
