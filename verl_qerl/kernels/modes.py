"""The GEMM op's modes and kernel names, read from their one definition shared with C++ (``cuda/gemm_modes.h``).

Why a parse and not a copy: ``qerl::nvfp4_gemm`` takes an integer ``mode``, and the calibration table, ``gemm_choice``
and the benchmarks name the kernels; a second list in Python drifts from the C++ one. The header is an X-macro list
that ``cuda/gemm_route.h`` expands into its enums; this module reads the same lines at import (no CUDA, no
compiler needed), strictly: a line that looks like an entry but does not have exactly the entry's form raises
:class:`GemmModesError` naming the file and line. ``tests/test_gemm_modes.py`` compiles the header with the C++
compiler and checks that both sides see the same table.

Kernel names (calibration table entries, ``gemm_choice``'s answers): ``splitk`` (the split-K mma.sync kernel,
decode and small M), ``streamk`` (the stream-K mma.sync kernel), ``wgmma_rs`` (Hopper wgmma, A from registers),
``wgmma_wide`` (the same with the wide kernel's 128-row tiles at M = 65-128), ``wgmma_ss`` (Hopper wgmma, both
operands in shared memory), ``decode_tma`` (Hopper, M <= 16: the split-K kernel's math fed by the copy engine) and
``dequant_cublas`` (dequantize, then cuBLAS).

The fused kernels among them are also the ``QERL_GEMM_KERNEL`` values (with ``auto``, the default; benchmark
``--variants`` take them too): ``splitk``, ``streamk``, ``wgmma_rs``, ``wgmma_wide``, ``wgmma_ss``, ``decode_tma``.
The dequantize + cuBLAS path is not one: the auto modes choose it by M, and the op's own mode forces it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

#: The header, next to the kernel sources (see :func:`header_path`).
HEADER_NAME = "gemm_modes.h"

_ENTRY = re.compile(
    r'^(QERL_GEMM_MODE|QERL_GEMM_KERNEL_DEF)\(([A-Za-z][A-Za-z0-9]*), (\d+), "([a-z0-9_]+)", "([^"\\]*)"\)$')


class GemmModesError(ValueError):
    """``cuda/gemm_modes.h`` cannot be read or breaks its format; the message names the file and line."""


@dataclass(frozen=True)
class Entry:
    """One line of the header: the C++ enumerator, its integer, its name (Python's key) and what it does."""

    enumerator: str
    value: int
    name: str
    doc: str


def header_path() -> Path:
    """The header in the kernel sources' folder (``$VERL_QERL_CUDA_SRC``, the package's ``csrc`` or ``cuda/``)."""
    from .build import source_dir  # build imports no torch at module level

    return source_dir() / HEADER_NAME


def parse(text: str, path: str = HEADER_NAME) -> tuple[list[Entry], list[Entry]]:
    """(modes, kernels) from the header's text. Raises :class:`GemmModesError` on a malformed entry line, a
    repeated name / enumerator / value, or kernel ids that are not 0, 1, 2, ... in order."""
    tables: dict[str, list[Entry]] = {"QERL_GEMM_MODE": [], "QERL_GEMM_KERNEL_DEF": []}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line.startswith(tuple(f"{macro}(" for macro in tables)):
            continue  # comments, preprocessor lines, blanks
        m = _ENTRY.match(line)
        if not m:
            raise GemmModesError(f'{path}:{lineno}: not an entry of the form MACRO(Enumerator, 0, "name", "doc"): '
                                 f"{line!r}")
        tables[m.group(1)].append(Entry(m.group(2), int(m.group(3)), m.group(4), m.group(5)))
    modes, kernels = tables["QERL_GEMM_MODE"], tables["QERL_GEMM_KERNEL_DEF"]
    for what, entries in (("mode", modes), ("kernel", kernels)):
        if not entries:
            raise GemmModesError(f"{path}: no {what} entries")
        for field in ("enumerator", "value", "name"):
            seen = [getattr(e, field) for e in entries]
            dup = sorted({str(v) for v in seen if seen.count(v) > 1})
            if dup:
                raise GemmModesError(f"{path}: {what} {field}s repeated: {', '.join(dup)}")
    if [e.value for e in kernels] != list(range(len(kernels))):
        raise GemmModesError(f"{path}: kernel ids must be 0, 1, 2, ... in order, got {[e.value for e in kernels]}")
    return modes, kernels


def load(path: Path | None = None) -> tuple[list[Entry], list[Entry]]:
    """:func:`parse` of the header file (default :func:`header_path`)."""
    path = path or header_path()
    try:
        text = Path(path).read_text()
    except OSError as ex:
        raise GemmModesError(f"{path}: cannot read the GEMM mode table ({ex})") from ex
    return parse(text, str(path))


MODE_ENTRIES, KERNEL_ENTRIES = load()
#: mode name -> the integer ``qerl::nvfp4_gemm`` takes (``auto``, ``splitk``, ``dequant_cublas``, ``auto_streamk``,
#: ``streamk``, ``auto_splitk``, ``wgmma_rs``, ``wgmma_ss``, ``decode_tma``).
GEMM_MODES: dict[str, int] = {e.name: e.value for e in MODE_ENTRIES}
#: The modes as an enum (``GemmMode.SPLITK`` == 1); an ``IntEnum`` passes straight to the op.
GemmMode = enum.IntEnum("GemmMode", {e.name.upper(): e.value for e in MODE_ENTRIES})
#: The GEMM paths by id: the calibration table's kernel names and ``gemm_choice``'s answers.
GEMM_KERNEL_NAMES: tuple[str, ...] = tuple(e.name for e in KERNEL_ENTRIES)
