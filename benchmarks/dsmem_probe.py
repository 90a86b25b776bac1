"""Build and run benchmarks/dsmem_probe.cu on the GPU machine and write its results JSON (no torch needed).

The probe times, with every SM at it, a thread-block cluster's CTAs moving FP32 partial sums between their shared
memories: pulled with 16-byte ``ld.shared::cluster`` loads (what the cluster split-K's reduction does today) or pushed
with ``st.async`` / one ``cp.async.bulk.shared::cluster`` per share. The decision it serves (benchmarks/NOTES.md, "Open
leads after the twenty-third round", lead 4): rewrite the reduction as pushes only if a push mode moves the bytes at
>= 2x the pull rate per SM at the wide kernel's cluster size (3); the ``targets`` entry says so.

    python3 benchmarks/dsmem_probe.py --out $OUT          # ~1 min on a bare H200 (nvcc build included)
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_format import report_and_write  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "dsmem_probe.cu"
NVCC_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-DQERL_HAVE_SM90A=1",
              f"-I{ROOT / 'cuda'}"]
#: the wide kernel's cluster size at M = 256 (7B qkv / o), where the decision is made
DECISION_CLUSTER = 3
#: a push mode must move the bytes this much faster than the pull mode to pay for rewriting the reduction
DECISION_SPEEDUP = 2.0


def parse_tsv(text: str) -> tuple[str, list[dict]]:
    """(device line, rows) from the probe's output: a ``# device`` line, a header line, then one row per mode and
    cluster size. Numbers are converted; a row whose field count differs from the header's raises ValueError."""
    device, header, rows = "", None, []
    for line in text.splitlines():
        if line.startswith("# device"):
            device = line.split("\t")[1]
            continue
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if header is None:
            header = fields
            continue
        if len(fields) != len(header):
            raise ValueError(f"dsmem_probe: row {line!r} has {len(fields)} fields, the header {len(header)}")
        row = {}
        for key, value in zip(header, fields):
            try:
                row[key] = int(value)
            except ValueError:
                try:
                    row[key] = float(value)
                except ValueError:
                    row[key] = value
        rows.append(row)
    if header is None:
        raise ValueError("dsmem_probe: no header line in the probe's output")
    return device, rows


def decision_targets(rows: list[dict]) -> list[dict]:
    """The best push mode's per-SM rate over the pull mode's at the decision cluster size, each net of the rounds'
    cluster barrier (the ``barrier_only`` row: the reduction pays its barriers whichever way the bytes move); None
    where a mode is missing, moved wrong data (a wrong transfer is no rate) or did not outlast the barrier."""
    at = {r["mode"]: r for r in rows if r["cluster"] == DECISION_CLUSTER}
    name = (f"best push / pull per-SM rate at cluster size {DECISION_CLUSTER}, net of the round's cluster barrier "
            "(every SM moving partials)")
    if "barrier_only" not in at:
        return [{"name": name, "measured": None, "op": ">=", "target": DECISION_SPEEDUP,
                 "note": "no barrier_only row at this cluster size: no net rate"}]
    barrier_us = at["barrier_only"]["us_per_round"]

    def net_rate(mode: str) -> float | None:
        r = at.get(mode)
        if r is None or r["bad"] != 0 or r["us_per_round"] <= barrier_us:
            return None
        return (r["cluster"] - 1) * r["share_bytes"] / (r["us_per_round"] - barrier_us)

    pull = net_rate("pull_ld_v4")
    pushes = [v for v in (net_rate("push_st_async"), net_rate("push_bulk")) if v is not None]
    measured = round(max(pushes) / pull, 3) if pull and pushes else None
    return [{"name": name, "measured": measured, "op": ">=", "target": DECISION_SPEEDUP}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for dsmem-probe-<gpu>.json")
    ap.add_argument("--rounds", type=int, default=200, help="rounds per timed launch (default 200)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds the probe may run (default 120)")
    args = ap.parse_args(argv)
    if args.rounds <= 0 or args.timeout <= 0:
        ap.error(f"--rounds {args.rounds} / --timeout {args.timeout}: must be positive")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        ap.error("nvcc is not on PATH: the probe is built here (CUDA 12.3+ for sm_90a)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "dsmem_probe"
        subprocess.run([nvcc, *NVCC_FLAGS, str(SOURCE), "-o", str(exe)], check=True)
        try:  # (a probe that hangs on an mbarrier must not take the whole device call with it)
            run = subprocess.run([str(exe), str(args.rounds)], capture_output=True, text=True, timeout=args.timeout)
            stdout, stderr, rc = run.stdout, run.stderr, run.returncode
        except subprocess.TimeoutExpired as ex:
            stdout = ex.stdout.decode() if isinstance(ex.stdout, bytes) else (ex.stdout or "")
            stderr, rc = f"timed out after {args.timeout} s", 124
    print(stdout, end="")
    if rc != 0:  # the rows measured before the failure are kept, the error is printed and recorded
        print(f"# dsmem_probe exited {rc}: {stderr.strip()}", file=sys.stderr)
    device, rows = parse_tsv(stdout)
    nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    result = {"device": device, "versions": {"nvcc": nvcc_version, "python": platform.python_version()},
              "command": "python3 " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "rows": rows,
              "errors": [f"probe exited {rc}: {stderr.strip()}"] if rc != 0 else [],
              "targets": decision_targets(rows)}
    name = device.lower().replace(" ", "-") or "gpu"
    report_and_write(Path(args.out) / f"dsmem-probe-{name}.json", result)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
