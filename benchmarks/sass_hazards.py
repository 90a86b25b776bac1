"""Register hazards of Hopper warpgroup MMAs in compiled SASS: writes to a register-A operand, or any touch of an
accumulator, while the ``wgmma`` (SASS ``HGMMA``) that reads it may still be in flight.

Why: a register-A ``wgmma.mma_async`` reads its A registers (and its accumulators) asynchronously, until a
``wgmma.wait_group`` retires its group (PTX ISA). ptxas only inserts ``warpgroup.arrive`` for the source's own
fragment variables (C7519); it does not make the source wait. Twice the register-A kernels rewrote a fragment a
queued wgmma still read (the LoRA term's k16 loop; the 64- / 128-token main loop's second half across stages,
benchmarks/NOTES.md "Fourteenth round"), and both passed their GPU tests, because the wgmma had usually finished by
the time the write landed. Timing-dependent races do not show reliably on a GPU; they show in the SASS. This reads
the kernels through :mod:`sass_census` (nvcc with the JIT build's flags, ``nvdisasm --emit-json``) and flags them.

The analysis, per kernel: a forward may-analysis over the control-flow graph (direct branches, ``EXIT``,
``CALL`` / ``RET``) to a fixed point. State: the committed groups (oldest first) and the open group of HGMMAs issued
since the last commit; an HGMMA whose operands carry ``gsb0`` commits the open group, itself included;
``WARPGROUP.DEPBAR.LE gsb0, N`` leaves the N most recent committed groups pending (a predicated one retires
nothing: it may not run); an open group is never retired. At each instruction, every HGMMA that may be pending is
checked against the instruction's written registers (its A registers) and its read and written registers (its
accumulators; an HGMMA may chain onto a pending one's accumulators, which the hardware orders). A subroutine call
clobbers every register its callee region writes (the code only calls reach).

    python benchmarks/sass_hazards.py cuda/nvfp4_gemm_wgmma.cu cuda/nvfp4_gemm_wgmma_wide.cu   # rc 1 on a hazard
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_census import DEFAULT_ARCH, CensusError, Instruction, Kernel, branch_target, census  # noqa: E402

#: Opcode classes whose first operand is not a register they write.
_NO_DEST = {"ST", "STS", "STG", "STL", "STSM", "RED", "REDG", "BAR", "BRA", "BRX", "JMP", "JMX", "EXIT", "RET",
            "CALL", "BSSY", "BSYNC", "BREAK", "BPT", "NOP", "MEMBAR", "FENCE", "CCTL", "ERRBAR", "WARPSYNC",
            "WARPGROUP", "YIELD", "UTMALDG", "UTMASTG", "UBLKCP", "UTMAPF", "UTMACCTL", "DEPBAR", "LDGSTS",
            "LDGDEPBAR", "KILL", "NANOSLEEP", "ACQBULK", "UCGABAR_ARV", "UCGABAR_WAIT", "CGAERRBAR", "SYNCS"}
#: Opcode classes that write a predicate, then a register (``SHFL.BFLY PT, R5, ...``).
_PRED_THEN_DEST = {"SHFL", "ATOM", "ATOMG", "ATOMS"}
#: Groups kept apart in the state; older ones merge into one (the analysis must terminate around loops).
_GROUP_CAP = 6
_REG = re.compile(r"(?<![A-Za-z0-9_])R(\d+)(\.64)?(?![0-9])")
_PRED = re.compile(r"^!?U?P(T|\d+)$")

Groups = tuple[frozenset[int], ...]


@dataclasses.dataclass(frozen=True)
class Hazard:
    kernel: str
    offset: int  # the touching instruction
    text: str
    hgmma: int  # the HGMMA that may still read the register
    kind: str  # "A-write" | "acc-access" | "A-write by HGMMA accumulators"
    registers: tuple[int, ...]

    def describe(self) -> str:
        regs = ", ".join(f"R{r}" for r in self.registers)
        return f"{self.offset:#07x} {self.text}: {self.kind} of HGMMA {self.hgmma:#07x} ({regs})"


@dataclasses.dataclass(frozen=True)
class _Decoded:
    dests: frozenset[int]
    srcs: frozenset[int]
    hgmma: tuple[frozenset[int], frozenset[int], bool] | None  # (A registers, accumulators, commits its group)


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _regs(token: str, width: int = 1) -> set[int]:
    out: set[int] = set()
    for num, wide in _REG.findall(token):
        out.update(range(int(num), int(num) + (2 if wide else width)))
    return out


def _width(opcode: str) -> int:
    """Registers written from the first destination register: 128-bit forms 4, 64-bit / WIDE forms 2, ``LDSM ...4``
    its count."""
    segs = opcode.split(".")
    if segs[0] == "LDSM" and segs[-1].isdigit():
        return int(segs[-1])
    if "128" in segs:
        return 4
    if "64" in segs or "WIDE" in segs or "F64" in segs[1:2] or segs[0] in ("DADD", "DMUL", "DFMA"):
        return 2
    if segs[0] == "CS2R" and "32" not in segs:
        return 2
    if segs[0] == "HMMA":  # mma.sync m16n8k16: 4 FP32 (or 2 packed FP16) accumulators
        return 4 if "F32" in segs else 2
    return 1


def decode(ins: Instruction) -> _Decoded:
    """The registers ``ins`` writes and reads (an over-approximation where the form is not known), or an HGMMA's."""
    ops = _split_operands(ins.operands)
    cls = ins.op_class
    if cls == "HGMMA":
        shape = re.match(r"(\d+)x(\d+)x(\d+)", ins.opcode.split(".")[1])
        if shape is None or not ops:
            raise CensusError(f"HGMMA form not understood: {ins.text()}")
        n = int(shape.group(2))
        acc_width = n // 2 if ".F32" in ins.opcode else n // 4
        acc = frozenset(range(int(ops[0][1:]), int(ops[0][1:]) + acc_width)) if re.match(r"^R\d+$", ops[0]) else \
            frozenset()
        a = frozenset(range(int(ops[1][1:]), int(ops[1][1:]) + 4)) if len(ops) > 1 and re.match(r"^R\d+$", ops[1]) \
            else frozenset()
        return _Decoded(frozenset(), frozenset(), (a, acc, "gsb0" in ops))
    width = _width(ins.opcode)
    dests: set[int] = set()
    src_ops = ops
    if cls not in _NO_DEST and ops and re.match(r"^R\d+$", ops[0]):
        dests, src_ops = set(range(int(ops[0][1:]), int(ops[0][1:]) + width)), ops[1:]
    elif cls in _PRED_THEN_DEST and len(ops) > 1 and _PRED.match(ops[0]) and re.match(r"^R\d+$", ops[1]):
        dests, src_ops = set(range(int(ops[1][1:]), int(ops[1][1:]) + width)), ops[2:]
    srcs: set[int] = set()
    for k, tok in enumerate(src_ops):  # a store's data (its last operand) is as wide as the store
        srcs |= _regs(tok, width if not dests and not tok.startswith(("[", "desc")) and k == len(src_ops) - 1 else 1)
    return _Decoded(frozenset(dests), frozenset(srcs), None)


def _normalized(groups: Groups) -> Groups:
    while groups and not groups[0]:
        groups = groups[1:]
    if len(groups) > _GROUP_CAP:
        groups = (frozenset().union(*groups[:len(groups) - _GROUP_CAP + 1]),) + groups[len(groups) - _GROUP_CAP + 1:]
    return groups


def _join(a: tuple[Groups, frozenset[int]] | None, b: tuple[Groups, frozenset[int]]) -> tuple[Groups, frozenset[int]]:
    """The union of two states, groups aligned from the most recent."""
    if a is None:
        return _normalized(b[0]), b[1]
    n = max(len(a[0]), len(b[0]))
    ga = (frozenset(),) * (n - len(a[0])) + a[0]
    gb = (frozenset(),) * (n - len(b[0])) + b[0]
    return _normalized(tuple(x | y for x, y in zip(ga, gb))), a[1] | b[1]


def hazards(kernel: Kernel) -> list[Hazard]:
    """Every instruction of ``kernel`` that writes an A register, or touches an accumulator, of an HGMMA that may
    still be in flight there (module docstring)."""
    ins = kernel.instructions
    if not any(i.op_class == "HGMMA" for i in ins):
        return []
    index = {i.offset: k for k, i in enumerate(ins)}
    dec = [decode(i) for i in ins]
    calls = [k for k, i in enumerate(ins) if i.op_class == "CALL"]

    def successors(k: int) -> list[int]:
        """Where control may go after instruction k; a call returns to the next instruction (its callee's writes
        count as the call's own: ``clobbered``)."""
        i = ins[k]
        cls, conditional = i.op_class, bool(i.predicate) and not i.predicate.startswith("@PT")
        if i.predicate.startswith("@!PT"):
            return [k + 1]  # never runs
        nxt = [k + 1] if k + 1 < len(ins) else []
        if cls in ("BRX", "JMX"):
            raise CensusError(f"{kernel.name}: indirect branch at {i.offset:#x}: not analysed")
        if cls in ("BRA", "JMP"):
            target = branch_target(i.operands)
            if target is None or target not in index:
                raise CensusError(f"{kernel.name}: branch target of {i.text()} at {i.offset:#x} not found")
            return [index[target]] + (nxt if conditional or ".DIV" in i.opcode else [])
        if cls == "EXIT":
            return nxt if conditional else []
        if cls == "RET":
            return [c + 1 for c in calls] + (nxt if conditional else [])
        return nxt

    # the callee region: what entry cannot reach without entering a call
    reach, work = {0}, [0]
    while work:
        for s in successors(work.pop()):
            if s not in reach and ins[s].op_class != "RET":
                reach.add(s)
                work.append(s)
    clobbered = frozenset().union(*(dec[k].dests for k in range(len(ins)) if k not in reach))
    hg = {k: dec[k].hgmma for k in range(len(ins)) if dec[k].hgmma is not None}

    state: list[tuple[Groups, frozenset[int]] | None] = [None] * len(ins)
    state[0] = ((), frozenset())
    work, found = [0], {}
    while work:
        k = work.pop()
        groups, open_group = state[k]
        pending = set(open_group).union(*groups) if groups else set(open_group)
        d, i = dec[k], ins[k]
        for h in pending:
            a_regs, acc_regs, _ = hg[h]
            if d.hgmma is not None:
                hits = [("A-write by HGMMA accumulators", d.hgmma[1] & a_regs)]
            else:
                written = d.dests | (clobbered if i.op_class == "CALL" else frozenset())
                hits = [("A-write", written & a_regs), ("acc-access", (written | d.srcs) & acc_regs)]
            for kind, regs in hits:
                if regs:
                    found[(k, h, kind)] = tuple(sorted(regs))[:8]
        if d.hgmma is not None:
            open_group = open_group | {k}
            if d.hgmma[2]:
                groups, open_group = _normalized(groups + (open_group,)), frozenset()
        elif i.opcode.startswith("WARPGROUP.DEPBAR") and not i.predicate:
            keep = int(_split_operands(i.operands)[-1], 16)
            groups = _normalized(groups[len(groups) - keep:] if keep > 0 else ())
        for s in successors(k):
            merged = _join(state[s], (groups, open_group))
            if merged != state[s]:
                state[s] = merged
                work.append(s)
    return [Hazard(kernel.name, ins[k].offset, ins[k].text(), ins[h].offset, kind, regs)
            for (k, h, kind), regs in sorted(found.items())]


def check(sources: list[Path], arch: str = DEFAULT_ARCH) -> dict[str, list[Hazard]]:
    """Kernel name -> its hazards, for every kernel of ``sources`` that has HGMMAs."""
    out = {}
    for src in sources:
        for kernel in census(src, arch):
            if any(i.op_class == "HGMMA" for i in kernel.instructions):
                out[kernel.name] = hazards(kernel)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", type=Path, help="CUDA sources (cuda/*.cu)")
    ap.add_argument("--arch", default=DEFAULT_ARCH)
    ap.add_argument("--show", type=int, default=5, help="hazards listed per kernel")
    args = ap.parse_args(argv)
    try:
        result = check(args.sources, args.arch)
    except CensusError as exc:
        print(f"sass_hazards: {exc}", file=sys.stderr)
        return 2
    bad = 0
    for name, found in result.items():
        print(f"{'HAZARD' if found else 'ok    '} {name}: {len(found)} hazard(s)")
        for hz in found[:args.show]:
            print(f"         {hz.describe()}")
        bad += bool(found)
    if not result:
        print("sass_hazards: no kernel with HGMMA in these sources")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
