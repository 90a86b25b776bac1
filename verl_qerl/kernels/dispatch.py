"""Auto mode's calibration table: which GEMM kernel is fastest for a weight shape and token count.

Why a table: the GEMMs the op can run (the split-K decode kernel ``splitk``, the mma.sync ``streamk`` kernel, the
Hopper wgmma kernels ``wgmma_rs`` / ``wgmma_ss``, the Hopper copy-engine decode kernel ``decode_tma``, dequantize +
cuBLAS ``dequant_cublas``) cross over at M and shape points that depend on the GPU; hand-set thresholds drift every
time a kernel changes. ``benchmarks/kernel.py`` times all of them per GEMM shape and M (CUDA-graph timing) and
writes the winners as a table (:func:`table_from_rows`); the package ships the table measured on an H200
(``gemm_dispatch_h200.json``) and :func:`install` hands it to the extension for devices of the capability it was
measured on. The C++ side (``table_pick`` in cuda/gemm_route.cpp) takes the nearest measured weight shape (log N,
log K) and then its nearest measured M (log M). Without a table (other GPUs), the op keeps its rule-based dispatch.

File format (JSON): ``{"device": str, "capability": [major, minor], "command": str, "points": [[n, k, m, kernel],
...]}`` with ``kernel`` one of :data:`verl_qerl.kernels.modes.GEMM_KERNEL_NAMES` (the extension's
``gemm_kernel_names()``, both from cuda/gemm_modes.h). Tables written before the kernels were named by role
(``v5``, ``wgmma``, ``dqmm``) still load: :data:`FORMER_NAMES` maps those names to the current ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .modes import GEMM_KERNEL_NAMES

#: Environment variable naming a table file to use instead of the shipped one ("off": no table).
TABLE_ENV = "QERL_GEMM_DISPATCH_TABLE"
#: The table measured on one H200 (benchmarks/NOTES.md, "v6 wgmma").
DEFAULT_TABLE = Path(__file__).with_name("gemm_dispatch_h200.json")
#: Kernel names in tables and benchmark rows written before the names by role -> the current names.
FORMER_NAMES = {"v5": "splitk", "wgmma": "wgmma_rs", "dqmm": "dequant_cublas"}
#: benchmark row key (CUDA-graph ms) -> kernel name, for the kernels each row forces (``benchmarks/kernel.py``
#: writes ``kernel_<name>_graph_ms`` and ``dequant_cublas_graph_ms``; the former keys are read too).
ROW_KEYS = {"kernel_splitk_graph_ms": "splitk", "kernel_streamk_graph_ms": "streamk",
            "kernel_wgmma_rs_graph_ms": "wgmma_rs", "kernel_wgmma_wide_graph_ms": "wgmma_wide",
            "kernel_wgmma_ss_graph_ms": "wgmma_ss",
            "kernel_decode_tma_graph_ms": "decode_tma",
            "dequant_cublas_graph_ms": "dequant_cublas",
            "kernel_graph_ms": "splitk", "kernel_wgmma_graph_ms": "wgmma_rs", "dqmm_graph_ms": "dequant_cublas"}


class DispatchTableError(ValueError):
    """A calibration table that cannot be used; the message names the file and the problem."""


def row_times(row: dict[str, Any]) -> dict[str, float]:
    """Kernel name -> CUDA-graph ms of one GEMM row of ``benchmarks/kernel.py``: its forced-kernel columns, and the
    op's own column as a time of the kernel it ran (``ours_runs``, a former name mapped) where the row has no column
    of that kernel, so that a size whose variants were not timed one by one still has its measured kernel. Under
    ``kernel.py --pdl`` the op's column without PDL (``ours_nopdl``) is the one taken: the forced columns run
    without it."""
    timed: dict[str, float] = {}
    for key, name in ROW_KEYS.items():  # a current key wins over a former one for the same kernel
        if row.get(key) and name not in timed:
            timed[name] = row[key]
    ran = FORMER_NAMES.get(row.get("ours_runs"), row.get("ours_runs"))
    ours = row.get("ours_nopdl_graph_ms") or row.get("ours_graph_ms")
    if ran in GEMM_KERNEL_NAMES and ours and ran not in timed:
        timed[ran] = ours
    return timed


def table_from_rows(rows: list[dict[str, Any]], device: str, capability: tuple[int, int], command: str) -> dict:
    """Per (N, K, M) GEMM row of ``benchmarks/kernel.py``, the kernel with the smallest CUDA-graph time among those
    the row measured (:func:`row_times`; rows of the per-layer sums are skipped)."""
    points = []
    for r in rows:
        if r.get("layer") == "sum" or "N" not in r:
            continue
        timed = row_times(r)
        if timed:
            points.append([int(r["N"]), int(r["K"]), int(r["M"]), min(timed, key=timed.get)])
    return {"device": device, "capability": list(capability), "command": command, "points": points}


def load_table(path: Path, names: list[str]) -> dict:
    """Read and validate a table file, former kernel names (:data:`FORMER_NAMES`) replaced by the current ones;
    raises :class:`DispatchTableError` naming the file."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as ex:
        raise DispatchTableError(f"GEMM dispatch table {path}: cannot read it ({ex})") from ex
    pts = table.get("points") if isinstance(table, dict) else None
    cap = table.get("capability") if isinstance(table, dict) else None
    if not isinstance(pts, list) or not pts or not (isinstance(cap, list) and len(cap) == 2):
        raise DispatchTableError(f"GEMM dispatch table {path}: needs a non-empty 'points' list and 'capability'")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in cap):  # ["9", "0"] would never match a device
        raise DispatchTableError(f"GEMM dispatch table {path}: capability {cap!r} must be two integers, e.g. [9, 0]")
    for p in pts:
        if isinstance(p, list) and len(p) == 4 and isinstance(p[3], str):
            p[3] = FORMER_NAMES.get(p[3], p[3])
        ok = isinstance(p, list) and len(p) == 4 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in p[:3])
        if not ok or p[3] not in names:
            raise DispatchTableError(f"GEMM dispatch table {path}: bad point {p!r} (want [n, k, m, one of {names}])")
    seen: dict[tuple[int, int, int], str] = {}
    for n, k, m, kernel in pts:  # the C++ side takes the first of two points for one (n, k, m): refuse the doubt
        if seen.setdefault((n, k, m), kernel) != kernel:
            raise DispatchTableError(f"GEMM dispatch table {path}: (n, k, m) = {(n, k, m)} has two kernels, "
                                     f"{seen[(n, k, m)]} and {kernel}")
    return table


def install(ext: Any, capability: tuple[int, int]) -> str:
    """Give the extension the table for this device (``$QERL_GEMM_DISPATCH_TABLE``, else the shipped one) when the
    table was measured on this capability; returns what was done (for logs). A bad file named by the environment
    variable raises; the shipped file is tested in CI."""
    raw = os.environ.get(TABLE_ENV, "").strip()
    if raw.lower() == "off":
        ext.set_dispatch_table([])
        return f"{TABLE_ENV}=off: rule-based dispatch"
    path = Path(raw) if raw else DEFAULT_TABLE
    if not raw and not path.is_file():
        ext.set_dispatch_table([])
        return f"no shipped table ({path.name}): rule-based dispatch"
    names = list(ext.gemm_kernel_names())
    table = load_table(path, names)
    if tuple(table["capability"]) != tuple(capability):
        ext.set_dispatch_table([])
        return f"table {path.name} is for capability {tuple(table['capability'])}, device is {capability}: rules"
    ext.set_dispatch_table([[n, k, m, names.index(kern)] for n, k, m, kern in table["points"]])
    return f"table {path.name}: {len(table['points'])} points"
