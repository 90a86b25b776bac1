"""SASS census of the CUDA kernels, on a machine without a GPU: what ptxas made of each kernel, and whether a change
altered it.

Why: a kernel prediction in benchmarks/NOTES.md starts from an instruction count ("~125 instructions per warp per
half-stage"), and a clean-up of shared device code is safe exactly when every kernel's instruction stream is
unchanged. Both are facts of the compiled code, readable before any GPU call: nvcc compiles each ``cuda/*.cu``
with the flags the JIT build uses (``verl_qerl.kernels.build``), ``nvdisasm --emit-json`` disassembles the cubin
(the ``nvidia-cuda-nvdisasm`` wheel carries the binary; the CUDA toolkit here has none), and this script counts.

Per kernel: registers and spill bytes (``ptxas -v``), instructions by class (the opcode before its first dot:
``HGMMA``, ``LOP3``, ``IMAD`` ...), and every loop (a backward branch and the instructions it jumps back over) with
its own class counts, innermost first, so the main loop of a kernel is one line. ``--against REV`` builds the same
sources from git revision REV and says, per kernel, whether the instruction stream is identical (opcodes, operands
and predicates, in order) or where it first differs; ``--expect-identical`` makes a difference the exit status.

    python3 benchmarks/sass_census.py cuda/nvfp4_gemm_wgmma_wide.cu
    python3 benchmarks/sass_census.py --against HEAD~1 --expect-identical cuda/*.cu
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # verl_qerl without an install

from verl_qerl.kernels.build import NVCC_FLAGS, SM90A_DEFINE  # noqa: E402 - after the path setup

#: the pip wheel that carries nvdisasm (pinned in examples/setup_env.sh)
NVDISASM_WHEEL = "nvidia-cuda-nvdisasm==13.5.37"
#: the GPU target of the census (the kernels are tuned on sm_90a; ``--arch sm_80`` reads the mma.sync build)
DEFAULT_ARCH = "sm_90a"
#: opcode classes a main loop is recognised by (tensor-core work)
MMA_CLASSES = ("HGMMA", "HMMA")
#: copy-engine issue (bulk copy, TMA): a branch around them is one thread's producer path
PRODUCER_CLASSES = ("UBLKCP", "UTMALDG")
#: math and shared-memory reads: a branch region holding any of them is work, not a producer path
WORK_CLASSES = ("FFMA", "FADD", "FMUL", "HMUL2", "HGMMA", "HMMA", "LDS", "LDSM")


class CensusError(RuntimeError):
    """A census that cannot be taken: no nvcc / nvdisasm, a source that does not compile, a bad revision."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    offset: int  # byte offset in the kernel's text section
    opcode: str  # e.g. "LOP3.LUT"
    operands: str
    predicate: str = ""

    @property
    def op_class(self) -> str:
        return self.opcode.split(".")[0]

    def text(self) -> str:
        """The instruction as compared between builds: symbols in an anonymous namespace lose the hash of the source
        path that the compiler puts in their names (the same code built from two folders is the same code)."""
        operands = _ANON_NAMESPACE_HASH.sub("_GLOBAL__N__#_", self.operands)
        return f"{self.predicate + ' ' if self.predicate else ''}{self.opcode} {operands}".strip()


_ANON_NAMESPACE_HASH = re.compile(r"_GLOBAL__N__[0-9a-fA-F]+_")


@dataclasses.dataclass(frozen=True)
class Loop:
    """The instructions from a backward branch's target to the branch itself (offsets inclusive)."""

    start: int
    end: int
    counts: dict[str, int]

    @property
    def size(self) -> int:
        return sum(self.counts.values())


@dataclasses.dataclass
class Kernel:
    name: str  # demangled
    mangled: str
    source: str
    instructions: list[Instruction]
    registers: int | None = None
    spill_bytes: int | None = None

    @property
    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(i.op_class for i in self.instructions).most_common())

    def loops(self) -> list[Loop]:
        """Every backward branch's body, innermost (smallest) first."""
        by_offset = {i.offset: i for i in self.instructions}
        out = []
        for ins in self.instructions:
            if ins.op_class not in ("BRA", "JMP") or ins.predicate.startswith("@!PT"):
                continue
            target = branch_target(ins.operands)
            if target is None or target > ins.offset:
                continue
            body = [by_offset[o] for o in range(target, ins.offset + 16, 16) if o in by_offset]
            counts = dict(collections.Counter(i.op_class for i in body).most_common())
            out.append(Loop(target, ins.offset, counts))
        return sorted(out, key=lambda lp: (lp.size, lp.start))

    def main_loop(self) -> Loop | None:
        """The k loop of a GEMM: of the innermost loops with tensor-core instructions (no other such loop inside),
        the one with the most of them (a short loop of a few MMAs beside it, e.g. a LoRA term's extra ranks, is not
        the k loop); else the largest loop."""
        loops = self.loops()
        mma = [lp for lp in loops if any(lp.counts.get(c) for c in MMA_CLASSES)]
        if mma:
            innermost = [lp for lp in mma
                         if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in mma)]
            return max(innermost, key=lambda lp: (sum(lp.counts.get(c, 0) for c in MMA_CLASSES), -lp.size))
        return loops[-1] if loops else None

    def producer_only(self, loop: Loop) -> int:
        """How many instructions of ``loop`` only the copy-issuing thread runs (:meth:`producer_offsets`)."""
        return len(self.producer_offsets(loop))

    def producer_offsets(self, loop: Loop) -> set[int]:
        """Offsets of the instructions of ``loop`` that only a copy-issuing thread runs: for each copy-engine issue
        (``UBLKCP``, ``UTMALDG``) the innermost forward branch inside the loop that skips over it, as ``if (tid == 0)
        { issue copies }`` compiles -- unless that region also holds math or shared-memory reads (then the branch is
        one every warp takes alike, e.g. ``if (next < count)``, and ptxas predicated the copy in place: nothing is
        one thread's alone). A static reading: the loop's size minus this is what every other warp executes."""
        inside = [i for i in self.instructions if loop.start <= i.offset <= loop.end]
        regions = []
        for ins in inside:
            target = branch_target(ins.operands) if ins.op_class == "BRA" and ins.predicate else None
            if target is not None and ins.offset < target <= loop.end + 16:
                regions.append((ins.offset, target))
        skipped: set[int] = set()
        for ins in inside:
            if ins.op_class not in PRODUCER_CLASSES:
                continue
            around = [r for r in regions if r[0] < ins.offset < r[1]]
            if around:
                lo, hi = min(around, key=lambda r: r[1] - r[0])
                body = [i for i in inside if lo < i.offset < hi]
                if not any(i.op_class in WORK_CLASSES for i in body):
                    skipped.update(i.offset for i in body)
        return skipped


def branch_target(operands: str) -> int | None:
    """The absolute target of a direct branch (nvdisasm's JSON gives it as the operand's hex offset)."""
    m = re.search(r"0x[0-9a-fA-F]+", operands.split(",")[-1])
    return int(m.group(0), 16) if m else None


def find_nvdisasm() -> str:
    """nvdisasm from $NVDISASM, PATH, or the nvidia-cuda-nvdisasm wheel in this Python's site-packages."""
    explicit = os.environ.get("NVDISASM")
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise CensusError(f"NVDISASM={explicit}: not an executable file")
        return explicit
    found = shutil.which("nvdisasm")
    if found:
        return found
    for entry in sys.path:
        hits = sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "bin", "nvdisasm")))
        if hits:
            return hits[-1]
    raise CensusError(f"nvdisasm not found (not on PATH, no $NVDISASM, no wheel): pip install {NVDISASM_WHEEL}")


def find_nvcc() -> str:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if not nvcc:
        raise CensusError("nvcc not found (set NVCC=/path/to/nvcc)")
    return nvcc


def nvcc_command(nvcc: str, source: Path, cubin: Path, arch: str, include: Path) -> list[str]:
    """The JIT build's flags (verl_qerl.kernels.build) for one architecture, to a cubin, with ptxas's report."""
    num = arch.removeprefix("sm_")
    cmd = [nvcc, "-cubin", *NVCC_FLAGS, "-std=c++17", f"-gencode=arch=compute_{num},code={arch}", "-Xptxas", "-v",
           f"-I{include}"]
    if arch == "sm_90a":
        cmd.append(SM90A_DEFINE)  # the wgmma kernels' device code (the JIT build sets it for sm_90a too)
    return cmd + ["-o", str(cubin), str(source)]


def parse_ptxas_report(text: str) -> dict[str, tuple[int, int]]:
    """``ptxas -v`` output -> {mangled kernel: (registers, spill store + load bytes)}."""
    out: dict[str, tuple[int, int]] = {}
    current = None
    spills = 0
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current, spills = m.group(1), 0
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            spills = int(m.group(1)) + int(m.group(2))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            out[current] = (int(m.group(1)), spills)
            current = None
    return out


def demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return list(names)
    res = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True, check=False)
    lines = res.stdout.splitlines()
    return lines if res.returncode == 0 and len(lines) == len(names) else list(names)


def parse_disassembly(doc: list, source: str) -> list[Kernel]:
    """nvdisasm ``--emit-json`` output -> the kernels (functions) with their instruction streams."""
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[1], list)):
        raise CensusError(f"{source}: nvdisasm JSON is not [header, functions] (schema changed?)")
    kernels = []
    for fn in doc[1]:
        start = int(fn.get("start", 0))
        instrs = [Instruction(start + 16 * i, ins["opcode"], ins.get("operands", ""), ins.get("predicate", ""))
                  for i, ins in enumerate(fn.get("sass-instructions", []))]
        kernels.append(Kernel(fn["function-name"], fn["function-name"], source, instrs))
    for kernel, name in zip(kernels, demangle([k.mangled for k in kernels])):
        kernel.name = name
    return kernels


def census(source: Path, arch: str = DEFAULT_ARCH, include: Path | None = None) -> list[Kernel]:
    """Compile ``source`` for ``arch`` and read back its kernels (entry functions with code)."""
    if not source.is_file():
        raise CensusError(f"{source}: no such CUDA source")
    nvcc, nvdisasm = find_nvcc(), find_nvdisasm()
    with tempfile.TemporaryDirectory(prefix="sass_census_") as tmp:
        cubin = Path(tmp) / (source.stem + ".cubin")
        build = subprocess.run(nvcc_command(nvcc, source, cubin, arch, include or source.parent), capture_output=True,
                               text=True, check=False)
        if build.returncode != 0:
            raise CensusError(f"{source}: nvcc failed for {arch}:\n{build.stderr[-4000:]}")
        dis = subprocess.run([nvdisasm, "--emit-json", str(cubin)], capture_output=True, text=True, check=False)
        if dis.returncode != 0:
            raise CensusError(f"{source}: nvdisasm failed: {dis.stderr[-2000:]}")
        kernels = parse_disassembly(json.loads(dis.stdout), str(source))
    report = parse_ptxas_report(build.stderr + build.stdout)
    for k in kernels:
        k.registers, k.spill_bytes = report.get(k.mangled, (None, None))
    return [k for k in kernels if k.instructions]


def sources_at(rev: str, sources: list[Path], dest: Path) -> list[Path]:
    """The ``cuda/`` tree (and any other folder of ``sources``) as of git revision ``rev``, under ``dest``."""
    folders = sorted({str(s.resolve().parent.relative_to(REPO)) for s in sources})
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *folders], capture_output=True, check=False)
    if archive.returncode != 0:
        raise CensusError(f"--against {rev}: git archive failed: {archive.stderr.decode(errors='replace')[-500:]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return [dest / s.resolve().relative_to(REPO) for s in sources]


def _every_warp(k: Kernel) -> int | None:
    """Main-loop instructions on every warp's path (the copy-issuing thread's branch left out), or None."""
    main = k.main_loop()
    return None if main is None else main.size - k.producer_only(main)


def _changed_row(k: Kernel, o: Kernel) -> dict:
    a, b = [i.text() for i in k.instructions], [i.text() for i in o.instructions]
    if a == b and (k.registers, k.spill_bytes) == (o.registers, o.spill_bytes):
        return {"kernel": k.name, "status": "identical", "instructions": len(a)}
    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"kernel": k.name, "status": "changed", "instructions": len(a), "before": len(b),
            "registers": k.registers, "registers_before": o.registers, "spill_bytes": k.spill_bytes,
            "spill_bytes_before": o.spill_bytes, "main_loop_every_warp": _every_warp(k),
            "main_loop_every_warp_before": _every_warp(o), "first_difference": first,
            "now": a[first] if first < len(a) else None, "was": b[first] if first < len(b) else None}


def _template_name(name: str) -> str:
    """A demangled kernel name without its parameter list (``ns::f<64, true>(int, float)`` -> ``ns::f<64, true>``;
    the list is the parenthesis group that ends the name, not ``(anonymous namespace)``)."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


def compare(new: list[Kernel], old: list[Kernel]) -> list[dict]:
    """Per kernel: identical, changed (first differing instruction, registers, spills, main-loop size), added or
    removed. Kernels are matched by their demangled names: a mangled name in an anonymous namespace carries a hash of
    the source's path, which differs between the working tree and the revision's copy. What is left is matched by
    name without the parameter list where that is unique on both sides, so a kernel whose arguments changed (a new
    parameter type) is compared too, with ``signature_before``."""
    old_by = {k.name: k for k in old}
    rows: list[dict] = []
    unmatched = []
    for k in new:
        o = old_by.pop(k.name, None)
        if o is None:
            unmatched.append(k)
        else:
            rows.append(_changed_row(k, o))
    left_by: dict[str, list[Kernel]] = {}
    for o in old_by.values():
        left_by.setdefault(_template_name(o.name), []).append(o)
    new_count: dict[str, int] = {}
    for k in unmatched:
        new_count[_template_name(k.name)] = new_count.get(_template_name(k.name), 0) + 1
    for k in unmatched:
        base = _template_name(k.name)
        olds = left_by.get(base, [])
        if len(olds) == 1 and new_count[base] == 1:
            o = olds.pop()
            del old_by[o.name]
            row = _changed_row(k, o)
            row["status"], row["signature_before"] = "changed", o.name
            row.setdefault("before", len(o.instructions))
            rows.append(row)
        else:
            rows.append({"kernel": k.name, "status": "added"})
    rows += [{"kernel": o.name, "status": "removed"} for o in old_by.values()]
    return rows


def kernel_row(k: Kernel) -> dict:
    main = k.main_loop()
    return {"kernel": k.name, "source": k.source, "registers": k.registers, "spill_bytes": k.spill_bytes,
            "instructions": len(k.instructions), "classes": k.counts,
            "loops": [{"start": lp.start, "end": lp.end, "instructions": lp.size, "classes": lp.counts}
                      for lp in k.loops()],
            "main_loop": None if main is None else {"start": main.start, "end": main.end,
                                                    "instructions": main.size, "classes": main.counts,
                                                    "producer_only": k.producer_only(main)}}


def format_counts(counts: dict[str, int], top: int = 8) -> str:
    items = list(counts.items())
    text = " ".join(f"{c}:{n}" for c, n in items[:top])
    return text + (f" +{sum(n for _, n in items[top:])} other" if len(items) > top else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*", type=Path, help="CUDA sources (default: cuda/*.cu)")
    ap.add_argument("--arch", default=DEFAULT_ARCH, help="sm_90a (default), sm_89, sm_80 ...")
    ap.add_argument("--kernel", default=None, help="only kernels whose demangled name matches this regex")
    ap.add_argument("--against", metavar="REV", help="also build the sources at git revision REV and compare")
    ap.add_argument("--expect-identical", action="store_true",
                    help="with --against: exit 1 unless every kernel's instruction stream is unchanged")
    ap.add_argument("--json", type=Path, help="write the census (and the comparison) to this file")
    args = ap.parse_args(argv)
    if args.expect_identical and not args.against:
        ap.error("--expect-identical goes with --against REV")
    sources = args.sources or sorted((REPO / "cuda").glob("*.cu"))
    pick = re.compile(args.kernel) if args.kernel else None
    try:
        kernels = [k for s in sources for k in census(s, args.arch) if not pick or pick.search(k.name)]
        comparison = None
        if args.against:
            with tempfile.TemporaryDirectory(prefix="sass_census_rev_") as tmp:
                old_sources = sources_at(args.against, sources, Path(tmp))
                old = [k for s in old_sources for k in census(s, args.arch) if not pick or pick.search(k.name)]
            comparison = compare(kernels, old)
    except CensusError as exc:
        print(f"sass_census: {exc}", file=sys.stderr)
        return 2
    for k in kernels:
        main_loop = k.main_loop()
        print(f"{k.name}\n  {Path(k.source).name}, {args.arch}: {k.registers} registers, {k.spill_bytes} B spilled, "
              f"{len(k.instructions)} instructions: {format_counts(k.counts)}")
        if main_loop is not None:
            producer = k.producer_only(main_loop)
            print(f"  main loop [{main_loop.start:#x}..{main_loop.end:#x}] {main_loop.size} instructions"
                  + (f" ({main_loop.size - producer} on every warp's path, {producer} only on the copy-issuing "
                     f"thread's)" if producer else "") + f": {format_counts(main_loop.counts, 12)}")
    status = 0
    if comparison is not None:
        print(f"\nagainst {args.against}:")
        for row in comparison:
            line = f"  {row['status']:9} {row['kernel']}"
            if row["status"] == "changed":
                line += (f" ({row['before']} -> {row['instructions']} instructions, registers "
                         f"{row['registers_before']} -> {row['registers']}, spilled {row['spill_bytes_before']} -> "
                         f"{row['spill_bytes']} B, main loop on every warp's path {row['main_loop_every_warp_before']}"
                         f" -> {row['main_loop_every_warp']}; first difference at #{row['first_difference']}: "
                         f"{row['was']!r} -> {row['now']!r})")
                if "signature_before" in row:
                    line += f"\n            (parameters changed; was {row['signature_before']})"
            print(line)
        if args.expect_identical and any(r["status"] != "identical" for r in comparison):
            status = 1
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "against": args.against,
                                         "kernels": [kernel_row(k) for k in kernels], "comparison": comparison},
                                        indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
