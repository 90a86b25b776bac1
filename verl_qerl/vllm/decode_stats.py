"""Per-step batch sizes of a vLLM engine's rollouts: the record format, its reader and the decode-batch histogram.

Why: a rollout's time is a sum over engine steps, and each step's cost depends on how many sequences it ran (the
M of every GEMM). The kernel table gives a per-layer cost per M; this histogram says how many steps ran at each M,
so the rollout can be explained from the table.

Recording (:mod:`verl_qerl.vllm.decode_stats_logger`, a vLLM stat logger) is switched on by the environment
variable :data:`ENV` naming a folder: every ``AsyncLLM`` created in a process where the ``qerl_nvfp4`` plugin is
loaded then appends one JSON line per engine step that produced tokens to ``<folder>/steps-<pid>-<engine>.jsonl``::

    {"t": 1732412345.123, "gen": 256, "prompt": 0, "run": 256, "wait": 0, "pre": 0, "kv": 0.41}

``gen`` = tokens produced in the step (one per sequence that decoded, plus the first token of each prompt whose
prefill finished in it), ``prompt`` = prompt tokens of the prefills that finished in it, ``run`` / ``wait`` = the
scheduler's running / waiting queues after the step, ``pre`` = preemptions, ``kv`` = KV-cache usage (0-1).
Sleep / wake of the engine (verl's ``free_cache_engine`` between rollouts) is recorded as ``{"t": ..., "event":
"sleep"}`` / ``"wake"``, and the KV cache the engine got, once it is up, as ``{"event": "engine", "num_gpu_blocks",
"block_size", "max_model_len", ...}``. Each LoRA manager the engine's worker builds also leaves
``<folder>/lora-fast-path-<pid>-<n>.json`` (:func:`write_fast_path_record`): how many layers run the ``qerl_nvfp4``
single-adapter LoRA path and, where none do, why (a benchmark whose QeRL engine silently ran vLLM's own LoRA path
would compare the wrong thing; the worker's log lines do not always reach the caller's log). Counting happens on
the host, per scheduler step, so CUDA graphs (which pad M up to a captured size and replay without Python) do not
hide it.

This module itself imports nothing from vLLM: the benchmark's driver reads the files with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

#: the folder the per-step records go to; unset = no recording (the stat logger is not even installed)
ENV = "QERL_DECODE_STATS_DIR"
#: seconds without a step that end one rollout when no sleep event is recorded (training lies between rollouts)
ROLLOUT_GAP_S = 5.0
#: histogram buckets of decode steps by M (inclusive ranges), for the printed table: the kernel table's M = 1, 16,
#: 64, 128, 256, 1024 each fall in one bucket
BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 192),
                                        (193, 255), (256, 256), (257, 1 << 30))


#: the per-manager fast-path records' file name prefix (:func:`write_fast_path_record`)
FAST_PATH_PREFIX = "lora-fast-path-"
_fast_path_written = 0


def write_fast_path_record(layers: int, mode: str, not_used: str | None, environ: dict | None = None) -> Path | None:
    """Record, when :data:`ENV` names a folder, that a LoRA manager of this process put ``layers`` linear layers on
    the fast path (``mode`` the ``QERL_LORA_FAST_PATH`` setting, ``not_used`` why it was not used, or None). Written
    whole to a temporary name, then renamed: a reader never sees half a record. Returns the path, or None when
    recording is off."""
    global _fast_path_written
    folder = (os.environ if environ is None else environ).get(ENV)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f"{FAST_PATH_PREFIX}{os.getpid()}-{_fast_path_written}.json"
    _fast_path_written += 1
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"layers": int(layers), "mode": mode, "not_used": not_used}))
    tmp.replace(path)
    return path


def read_fast_path_records(folder: Path) -> list[dict]:
    """The fast-path records of ``folder`` (one per LoRA manager built), in file-name order; files that are not a
    record (a foreign file with the prefix) are skipped."""
    out = []
    for path in sorted(Path(folder).glob(f"{FAST_PATH_PREFIX}*.json")):
        try:
            rec = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("layers"), int):
            out.append(rec)
    return out


def read_records(folder: Path) -> list[dict]:
    """Every record of ``folder``'s ``steps-*.jsonl`` files, sorted by time; a torn last line (the process was
    killed mid-write) is skipped."""
    records = []
    for path in sorted(Path(folder).glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("t"), (int, float)):
                records.append(rec)
    return sorted(records, key=lambda r: r["t"])


def engine_kv(records: Iterable[dict]) -> list[dict]:
    """The ``engine`` events: per engine, ``kv_cache_tokens`` = blocks x block size and ``max_concurrency`` =
    that / ``max_model_len`` (vLLM's own figure counts whole blocks per request, so it can be a little lower)."""
    out = []
    for rec in records:
        if rec.get("event") == "engine" and rec.get("num_gpu_blocks") and rec.get("block_size"):
            tokens = int(rec["num_gpu_blocks"]) * int(rec["block_size"])
            out.append({"kv_cache_tokens": rec.get("kv_cache_size_tokens") or tokens,
                        "max_concurrency": rec.get("kv_cache_max_concurrency") or tokens / rec["max_model_len"],
                        "max_model_len": rec["max_model_len"], "num_gpu_blocks": rec["num_gpu_blocks"],
                        "block_size": rec["block_size"]})
    return out


def split_rollouts(records: Iterable[dict], gap_s: float = ROLLOUT_GAP_S) -> list[list[dict]]:
    """The step records grouped by rollout: a new rollout starts after a ``sleep`` event, after a step that left
    no request running or waiting (a GRPO step's rollout ends when all its responses are done), or after ``gap_s``
    seconds without a step. Events themselves are dropped; empty groups are not returned."""
    rollouts: list[list[dict]] = []
    current: list[dict] = []
    last_t: float | None = None
    for rec in records:
        if "event" in rec:
            if rec["event"] == "sleep" and current:
                rollouts.append(current)
                current = []
            continue
        drained = bool(current) and current[-1].get("run") == 0 and current[-1].get("wait") == 0
        if current and (drained or (last_t is not None and rec["t"] - last_t > gap_s)):
            rollouts.append(current)
            current = []
        current.append(rec)
        last_t = rec["t"]
    if current:
        rollouts.append(current)
    return rollouts


def is_decode_step(rec: dict) -> bool:
    """A step that only decoded: no prefill finished in it, so ``gen`` is its M (sequences in the batch)."""
    return not rec.get("prompt") and rec.get("gen", 0) > 0


def summarize_rollout(steps: Sequence[dict]) -> dict:
    """One rollout's histogram: ``decode_steps_by_m`` {M: steps} over pure decode steps, ``decode_s_by_m`` {M:
    seconds} (each step's time = the gap to the next step's record, the last step left out), the prefill steps
    (steps in which some prefill finished), total tokens, preemptions, peak KV usage and the wall time."""
    by_m: dict[int, int] = {}
    s_by_m: dict[int, float] = {}
    for rec, nxt in zip(steps, list(steps[1:]) + [None], strict=True):
        if not is_decode_step(rec):
            continue
        m = int(rec["gen"])
        by_m[m] = by_m.get(m, 0) + 1
        if nxt is not None:
            s_by_m[m] = s_by_m.get(m, 0.0) + (nxt["t"] - rec["t"])
    prefill = [r for r in steps if not is_decode_step(r)]
    return {
        "steps": len(steps), "decode_steps": sum(by_m.values()), "prefill_steps": len(prefill),
        "prefill_tokens": sum(int(r.get("prompt") or 0) for r in prefill),
        "generated_tokens": sum(int(r.get("gen") or 0) for r in steps),
        "preemptions": sum(int(r.get("pre") or 0) for r in steps),
        "kv_usage_max": max((float(r.get("kv") or 0.0) for r in steps), default=None),
        "wall_s": steps[-1]["t"] - steps[0]["t"] if steps else 0.0,
        "decode_steps_by_m": dict(sorted(by_m.items())),
        "decode_s_by_m": {m: round(s, 6) for m, s in sorted(s_by_m.items())},
    }


def merge_histograms(rollouts: Sequence[dict]) -> dict:
    """The sum of several :func:`summarize_rollout` results (e.g. the measured GRPO steps of one run)."""
    out = {"rollouts": len(rollouts), "steps": 0, "decode_steps": 0, "prefill_steps": 0, "prefill_tokens": 0,
           "generated_tokens": 0, "preemptions": 0, "kv_usage_max": None, "wall_s": 0.0,
           "decode_steps_by_m": {}, "decode_s_by_m": {}}
    for r in rollouts:
        for key in ("steps", "decode_steps", "prefill_steps", "prefill_tokens", "generated_tokens", "preemptions",
                    "wall_s"):
            out[key] += r[key]
        if r["kv_usage_max"] is not None:
            out["kv_usage_max"] = max(out["kv_usage_max"] or 0.0, r["kv_usage_max"])
        for key in ("decode_steps_by_m", "decode_s_by_m"):
            for m, v in r[key].items():
                out[key][int(m)] = out[key].get(int(m), 0) + v
    for key in ("decode_steps_by_m", "decode_s_by_m"):
        out[key] = dict(sorted(out[key].items()))
    return out


def bucket_table(hist: dict) -> list[dict]:
    """:data:`BUCKETS` rows of a histogram: decode steps, their seconds and mean ms per step in each M range (the
    seconds leave out each rollout's last step, one in thousands)."""
    rows = []
    steps = {int(m): v for m, v in hist["decode_steps_by_m"].items()}
    secs = {int(m): v for m, v in hist["decode_s_by_m"].items()}
    for lo, hi in BUCKETS:
        n = sum(v for m, v in steps.items() if lo <= m <= hi)
        if not n:
            continue
        s = sum(v for m, v in secs.items() if lo <= m <= hi)
        label = str(lo) if lo == hi else (f">= {lo}" if hi >= 1 << 30 else f"{lo}-{hi}")
        rows.append({"m": label, "decode_steps": n, "seconds": s, "ms_per_step": 1e3 * s / n})
    return rows
