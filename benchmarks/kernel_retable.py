"""A kernel-table results file's per-layer figures under the calibration table that run wrote.

Why: ``benchmarks/kernel.py`` times, side by side in one run, BF16 cuBLAS, ``auto`` (the op's dispatch with the
table *shipped at run time*) and every forced kernel variant, then writes a new table (the fastest measured kernel
per GEMM shape and M). When the run adds a kernel the shipped table did not know (e.g. ``wgmma_wide``), its
``auto`` column and the ``targets`` built on it describe the previous table's choices. This script sums, per layer
and M, the graph time of the kernel the *new* table picks for each GEMM (from the same run's forced-kernel rows:
the same weights, the same rounds) and writes a copy of the results file whose ``sum`` rows carry it as
``table_graph_ms`` and whose ``targets`` use it; the as-run targets are kept as ``targets_auto_as_run``.

    python3 benchmarks/kernel_retable.py RESULTS.json DISPATCH.json --out RESULTS-retabled.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results_format import read_json, write_json  # noqa: E402 - benchmarks/: this script's own folder

from verl_qerl.kernels.dispatch import ROW_KEYS, row_times  # noqa: E402


def table_layer_sums(rows: list[dict], points: list[list]) -> dict[tuple[str, int], float]:
    """(model, M) -> sum over the layer's GEMM rows of the graph ms of the kernel ``points`` pick for (N, K, M).
    Raises ValueError naming the GEMM where the table has no point or the row has no time for the pick."""
    pick = {(int(p[0]), int(p[1]), int(p[2])): p[3] for p in points}
    sums: dict[tuple[str, int], float] = {}
    for r in rows:
        if r.get("layer") == "sum" or "N" not in r:
            continue
        key = (int(r["N"]), int(r["K"]), int(r["M"]))
        name = pick.get(key)
        if name is None:
            raise ValueError(f"{r['model']} {r['layer']} M={r['M']}: the table has no point for (N, K, M) = {key}")
        t = row_times(r).get(name)
        if not t:
            column = next((k for k, v in ROW_KEYS.items() if v == name), f"kernel_{name}_graph_ms")
            raise ValueError(f"{r['model']} {r['layer']} M={r['M']}: the table picks {name}, which the row did not "
                             f"time (no {column}, and the op ran {r.get('ours_runs')})")
        sums[(r["model"], int(r["M"]))] = sums.get((r["model"], int(r["M"])), 0.0) + t
    return sums


def retable(result: dict, table: dict) -> dict:
    """A copy of ``result`` with ``table_graph_ms`` on its ``sum`` rows and ``targets`` rebuilt on it."""
    from kernel_results import build_targets

    sums = table_layer_sums(result["rows"], table["points"])
    out = json.loads(json.dumps(result))
    for r in out["rows"]:
        if r.get("layer") == "sum" and (r["model"], int(r["M"])) in sums:
            r["auto_graph_ms_as_run"] = r.get("ours_graph_ms")
            r["table_graph_ms"] = round(sums[(r["model"], int(r["M"]))], 5)
    as_table = [dict(r, ours_graph_ms=r["table_graph_ms"]) if "table_graph_ms" in r else r for r in out["rows"]]
    out["targets_auto_as_run"] = result.get("targets", [])
    out["targets"] = build_targets(as_table)
    out["retabled"] = {"table": table.get("command"), "note": "targets on the per-layer sums of the kernel this "
                       "run's dispatch table picks per GEMM (its forced-kernel rows); targets_auto_as_run: on the "
                       "op's auto column, which read the table shipped at run time"}
    return out


def read_input(path: str, what: str, key: str) -> dict:
    """The JSON object at ``path`` with a list under ``key`` (``rows`` of a kernel.py results file, ``points`` of a
    dispatch table); anything else raises ValueError naming the argument (``what``) and the file."""
    data = read_json(path, what)
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        kind = "a benchmarks/kernel.py results JSON" if key == "rows" else "a gemm_dispatch-*.json table"
        raise ValueError(f"{what} {path}: not {kind} (no '{key}' list)")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a benchmarks/kernel.py results JSON")
    ap.add_argument("table", help="the dispatch table the same run wrote (gemm_dispatch-*.json)")
    ap.add_argument("--out", required=True, help="where to write the re-tabled results (not the input file)")
    args = ap.parse_args(argv)
    if Path(args.out).resolve() == Path(args.results).resolve():
        ap.error("--out must not be the results file itself (the as-run file is kept)")
    if Path(args.out).resolve() == Path(args.table).resolve():
        ap.error(f"--out {args.out}: that is the dispatch table given as input, which it would overwrite")
    try:
        result = read_input(args.results, "results", "rows")
        table = read_input(args.table, "table", "points")
        out = retable(result, table)
    except ValueError as exc:
        ap.error(str(exc))
    write_json(Path(args.out), out, end="\n")  # whole or not at all
    for t in out["targets"]:
        print(f"{t['name']}: {t['measured']} {t['op']} {t['target']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
