"""The results side of ``benchmarks/grpo_step.py``: one run's row from what ``main_ppo`` left behind, the
comparison of the rows (ratios and ``targets``), and the tables printed on stdout.

Kept apart from the runner because none of it launches anything: it reads files and logs (verl's metrics file,
the ``main_ppo`` log, the decode-step records of :mod:`verl_qerl.vllm.decode_stats`) or plain dicts, so every
number that ends up in the results JSON can be checked on a CPU from made-up inputs.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from results_format import target_status  # benchmarks/: this module's own folder

from verl_qerl.vllm import decode_stats

#: verl's per-phase timers (``timing_s/<phase>``), summarized per run and compared between runs
PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "step")
STEP_RATIO_TARGET = 0.75  # issue 8: QeRL step time <= 0.75x BF16 LoRA's
SCALING_TARGET = 1.6      # issue 9: N-GPU throughput >= 1.6x of 1 GPU (N=2)


# ------------------------------------------------------------------------------------------------
# One run's row: verl's metrics, the main_ppo log, the decode-step records
# ------------------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict]:
    """verl's file logger: one JSON object per line with ``step`` and ``data``; sorted by step."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            rec = json.loads(line)
            data = rec.get("data", rec)
            data.setdefault("training/global_step", rec.get("step"))
            rows.append(data)
    return sorted(rows, key=lambda r: r.get("training/global_step") or 0)


_BASE_BYTES_LINE = re.compile(r"this rank holds (\d+) of (\d+) base bytes")


def base_bytes_held(log_text: str) -> list[int]:
    """Per-rank NVFP4 base bytes the actor logged at build time (``[verl-qerl] actor: ... this rank holds L of T
    base bytes``, one line per FSDP rank); empty when the base was not sharded (``qerl.shard_base=false``)."""
    return [int(m.group(1)) for m in _BASE_BYTES_LINE.finditer(log_text)]


#: vLLM 0.24's start-up lines on its KV cache (vllm/v1/core/kv_cache_utils.py, ``get_kv_cache_configs``:
#: ``"GPU KV cache size: %s tokens"`` with ``f"{num_tokens:,}"``, ``"Maximum concurrency for %s tokens per request:
#: %.2fx"`` with ``f"{max_model_len:,}"``), one pair per engine
_KV_TOKENS_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")  # later vLLMs: "<device> KV cache size: ..."
_CONCURRENCY_LINE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def kv_cache_report(log_text: str) -> dict:
    """What vLLM reported at start-up about its KV cache: ``kv_cache_tokens`` (the pool's capacity in tokens) and
    ``max_concurrency`` (how many requests of ``max_model_len`` tokens fit at once), per engine in log order
    (lists; one engine per GPU replica); empty lists when the log has no such lines."""
    tokens = [int(m.group(1).replace(",", "")) for m in _KV_TOKENS_LINE.finditer(log_text)]
    conc = [(int(m.group(1).replace(",", "")), float(m.group(2))) for m in _CONCURRENCY_LINE.finditer(log_text)]
    return {"kv_cache_tokens": tokens, "max_concurrency": [c for _, c in conc],
            "max_concurrency_len": [n for n, _ in conc]}


def fast_path_report(records: list[dict]) -> dict:
    """What the engines' LoRA managers recorded about the ``qerl_nvfp4`` single-adapter LoRA path
    (``decode_stats.read_fast_path_records``): ``lora_fast_path_layers`` per manager built, in order, and
    ``lora_fast_path_not_used`` (the reasons given where a manager served none), so a row says which LoRA path its
    rollout ran."""
    out: dict = {"lora_fast_path_layers": [r["layers"] for r in records]}
    reasons = sorted({r["not_used"] for r in records if r.get("not_used")})
    if reasons:
        out["lora_fast_path_not_used"] = reasons
    return out


def fast_path_warnings(rows: list[dict]) -> list[str]:
    """A line for each NVFP4 row whose rollout did not run the LoRA fast path on every engine (its gen phase then
    measures vLLM's own LoRA path on our GEMMs, not what QeRL users run), or that has no record of it (a result
    written before the record existed)."""
    out = []
    for r in rows:
        if "error" in r or not str(r.get("qerl", "")).startswith("nvfp4"):
            continue
        layers = r.get("lora_fast_path_layers")
        if layers is None:
            out.append(f"[grpo_step] note: {r['variant']}: no record of the LoRA fast path (older result)")
        elif not layers or min(layers) == 0:
            why = "; ".join(r.get("lora_fast_path_not_used") or ["no LoRA manager recorded"])
            out.append(f"[grpo_step] WARNING: {r['variant']}: the rollout did not run the qerl_nvfp4 LoRA fast path "
                       f"on every engine (layers per manager {layers}: {why})")
    return out


def decode_histogram(stats_dir: Path, steps_logged: int, skip: int = 1) -> dict | None:
    """The rollouts' decode-batch histogram from the per-step records of :mod:`verl_qerl.vllm.decode_stats`: one
    rollout per GRPO step, the first ``skip`` (warm-up) left out of ``measured`` as in :func:`summarize_run`;
    ``per_rollout`` keeps every rollout. None when nothing was recorded."""
    rollouts = [decode_stats.summarize_rollout(r) for r in decode_stats.split_rollouts(
        decode_stats.read_records(stats_dir))]
    if not rollouts:
        return None
    use = rollouts[skip:] if len(rollouts) > skip else rollouts
    out = {"measured": decode_stats.merge_histograms(use), "per_rollout": rollouts,
           "buckets": decode_stats.bucket_table(decode_stats.merge_histograms(use))}
    if len(rollouts) != steps_logged:
        out["note"] = (f"{len(rollouts)} rollouts recorded for {steps_logged} GRPO steps logged: the pairing of "
                       "rollouts with steps is uncertain")
    return out


def summarize_run(steps: list[dict], gpus: int, skip: int = 1) -> dict:
    """Means over steps after the first ``skip`` (warm-up) of the phase times, tokens/s and curves."""
    use = steps[skip:] if len(steps) > skip else steps

    def mean(key: str) -> float | None:
        vals = [s[key] for s in use if isinstance(s.get(key), (int, float))]
        return statistics.fmean(vals) if vals else None

    out = {f"{p}_s": mean(f"timing_s/{p}") for p in PHASES}
    tokens = mean("perf/total_num_tokens")
    out["tokens_per_step"] = tokens
    out["tokens_per_s"] = tokens / out["step_s"] if tokens and out["step_s"] else None
    out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / gpus if out["tokens_per_s"] else None
    out["actor_peak_allocated_gb"] = max((s.get("actor/perf/max_memory_allocated_gb") or 0.0 for s in steps),
                                         default=None)
    out["response_length_mean"] = mean("response_length/mean")
    out["actor_mfu"] = mean("perf/mfu/actor")  # verl's own FLOP estimate over the update phase
    out["steps_measured"] = len(use)
    # every number verl logged for the last step (perf/*, timing_per_token_ms/*, ...): the raw row behind the means
    out["last_step_metrics"] = {k: v for k, v in steps[-1].items() if isinstance(v, (int, float))} if steps else {}
    out["curves"] = {k: [s.get(k) for s in steps] for k in
                     ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "qerl/aqn_sigma",
                      "timing_s/step")}
    return out


# ------------------------------------------------------------------------------------------------
# Comparisons and targets
# ------------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def memory_targets(rows: list[dict], limit_gb: float) -> list[dict]:
    """Issue 8's 32B claim per run: at least one GRPO step logged, nvidia-smi peak of its GPUs <= ``limit_gb``.

    Rows that failed later (e.g. a timeout in step 2) still count: the claim is that a step *completes* within the
    memory, which the logged step and the peak sampled over the whole run show."""
    targets = []
    for r in rows:
        name = f"{r['variant']}-{r['gpus']}gpu"
        targets.append({"name": f"grpo_steps_completed[{name}]", "measured": r.get("steps_logged", 0), "op": ">=",
                        "target": 1})
        targets.append({"name": f"gpu_peak_used_gb[{name}]", "measured": r.get("gpu_peak_used_gb_max"),
                        "op": "<=", "target": limit_gb})
    return targets


#: learning parity (issue 9): the N-GPU run's curves may differ from the 1-GPU run's by sampling noise only
PARITY_METRICS = ("critic/score/mean", "actor/pg_loss", "actor/entropy")
PARITY_Z_LIMIT = 3.0


def paired_z(x: list[float | None], y: list[float | None]) -> tuple[float | None, dict]:
    """|mean(d)| / (sd(d) / sqrt(k)) of the per-step differences d = y - x over the steps both logged.

    Both runs see the same prompts at the same step (same seed, no shuffle), so the step-wise difference
    removes the prompt-difficulty variance; what is left is sampling noise (different replicas sample
    differently) unless the runs learn differently. Curves equal at every step give 0 (flagged
    ``constant`` when neither moves: a degenerate check, e.g. rewards 0 throughout on a random model)."""
    d = [b - a for a, b in zip(x, y, strict=False) if a is not None and b is not None]
    info = {"steps": len(d), "mean_diff": statistics.fmean(d) if d else None,
            "constant": len({v for v in x if v is not None} | {v for v in y if v is not None}) <= 1}
    if len(d) < 3:
        return None, info
    sd = statistics.stdev(d)
    mean = abs(statistics.fmean(d))
    if sd == 0:
        return (0.0 if mean == 0 else float("inf")), info
    return mean / (sd / len(d) ** 0.5), info


def compare(rows: list[dict], mode: str, concurrent: bool = False,
            phase_targets: dict[str, float] | None = None) -> tuple[dict, list[dict]]:
    """Ratios and the ``targets`` entries for ``mode`` ('variants' or 'gpus').

    ``concurrent`` (mode 'gpus'): the runs shared GPU 0, so their times are not comparable and no time target is set
    (the learning-parity targets of mode 'gpus' still are). ``phase_targets`` (mode 'variants'): {phase: limit} of
    the first variant's time over the second's per phase (a preset's, ``grpo_step_settings.PRESET_TARGETS``),
    instead of issue 8's step-only target."""
    ok = [r for r in rows if "error" not in r]
    ratios: dict = {}
    targets: list[dict] = []
    if mode == "variants" and len(ok) >= 2:
        a, b = ok[0], ok[1]
        tag = f"{a['variant']}/{b['variant']}"
        for p in PHASES:
            ratios[f"{p}_time_ratio[{tag}]"] = _ratio(a.get(f"{p}_s"), b.get(f"{p}_s"))
        for key in ("kv_cache_tokens", "max_concurrency"):  # first engine of each (one per GPU)
            ratios[f"{key}_ratio[{tag}]"] = _ratio((a.get(key) or [None])[0], (b.get(key) or [None])[0])
        for phase, limit in (phase_targets or {"step": STEP_RATIO_TARGET}).items():
            name = "grpo_step_time_ratio" if phase == "step" else f"{phase}_time_ratio"
            targets.append({"name": f"{name}[{tag}]", "measured": ratios[f"{phase}_time_ratio[{tag}]"], "op": "<=",
                            "target": limit})
    if mode == "gpus" and len(ok) >= 2:
        one, many = ok[0], ok[1]
        n = many["gpus"]
        ratios["throughput_ratio"] = _ratio(many.get("tokens_per_s"), one.get("tokens_per_s"))
        ratios["scaling_efficiency"] = ratios["throughput_ratio"] / n if ratios["throughput_ratio"] else None
        for p in PHASES:
            ratios[f"{p}_time_ratio[{n}gpu/1gpu]"] = _ratio(many.get(f"{p}_s"), one.get(f"{p}_s"))
        if not concurrent:
            targets.append({"name": f"throughput_{n}gpu_over_1gpu", "measured": ratios["throughput_ratio"],
                            "op": ">=", "target": SCALING_TARGET})
        for key in PARITY_METRICS:
            x, y = one["curves"][key], many["curves"][key]
            pairs = [(u, v) for u, v in zip(x, y, strict=False) if u is not None and v is not None]
            ratios[f"max_abs_diff[{key}]"] = max((abs(u - v) for u, v in pairs), default=None)
            z, info = paired_z(x, y)
            ratios[f"paired_z[{key}]"] = z
            if z is not None:
                note = f"{info['steps']} steps, mean diff {info['mean_diff']:.4g}"
                targets.append({"name": f"learning_parity_paired_z[{key}]", "measured": z, "op": "<=",
                                "target": PARITY_Z_LIMIT,
                                "note": note + ("; degenerate: both curves constant" if info["constant"] else "")})
    return ratios, targets



# ------------------------------------------------------------------------------------------------
# Tables on stdout
# ------------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    """Per run: the mean phase times, throughput and peak memory over the measured steps."""
    head = ("| run | steps | step s | gen s | old_log_prob s | update_actor s | update_weights s | tok/s | "
            "tok/s/GPU | GPU peak GB | actor peak GB |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']}-{r['gpus']}gpu | failed: {r['error']} |" + " |" * 9)
            continue

        def f(key: str, fmt: str = "{:.2f}", r: dict = r) -> str:
            v = r.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        lines.append(f"| {r['variant']}-{r['gpus']}gpu | {r['steps_measured']} | {f('step_s')} | {f('gen_s')} | "
                     f"{f('old_log_prob_s')} | {f('update_actor_s')} | {f('update_weights_s')} | "
                     f"{f('tokens_per_s', '{:.0f}')} | {f('tokens_per_s_per_gpu', '{:.0f}')} | "
                     f"{f('gpu_peak_used_gb_max', '{:.1f}')} | {f('actor_peak_allocated_gb', '{:.1f}')} |")
    return "\n".join(lines)


def kv_table(rows: list[dict]) -> str:
    """Per run: what vLLM reported about its KV cache, and the decode batches of the measured rollouts."""
    lines = ["| run | vLLM KV cache, tokens | max concurrency (x max_model_len) | decode steps | prefill steps | "
             "preemptions | peak KV usage |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        h = (r.get("decode_batches") or {}).get("measured") or {}
        kv = ", ".join(f"{t:,}" for t in r.get("kv_cache_tokens") or []) or "-"
        conc = ", ".join(f"{c:.2f}" for c in r.get("max_concurrency") or []) or "-"
        usage = f"{h['kv_usage_max']:.2f}" if h.get("kv_usage_max") is not None else "-"
        lines.append(f"| {r['variant']}-{r['gpus']}gpu | {kv} | {conc} | {h.get('decode_steps', '-')} | "
                     f"{h.get('prefill_steps', '-')} | {h.get('preemptions', '-')} | {usage} |")
    return "\n".join(lines)


def histogram_table(rows: list[dict]) -> str:
    """The decode-batch (M) histogram of the measured rollouts, side by side: steps, seconds and ms per step in each
    M range of :data:`verl_qerl.vllm.decode_stats.BUCKETS`."""
    runs = [r for r in rows if (r.get("decode_batches") or {}).get("buckets")]
    if not runs:
        return "(no decode-batch records)"
    head = "| M (sequences in the step) | " + " | ".join(
        f"{r['variant']} steps | {r['variant']} s | {r['variant']} ms/step" for r in runs) + " |"
    lines = [head, "|---|" + "---:|" * (3 * len(runs))]
    labels = [f"{lo}" if lo == hi else (f">= {lo}" if hi >= 1 << 30 else f"{lo}-{hi}")
              for lo, hi in decode_stats.BUCKETS]
    for label in labels:
        cells = []
        for r in runs:
            b = next((x for x in r["decode_batches"]["buckets"] if x["m"] == label), None)
            cells.append(f"{b['decode_steps']} | {b['seconds']:.2f} | {b['ms_per_step']:.2f}" if b else "- | - | -")
        if any(c != "- | - | -" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(result: dict) -> None:
    """The tables, ratios and targets on stdout."""
    rows = result["rows"]
    print(table(rows))
    print(kv_table(rows))
    print(histogram_table(rows))
    for line in fast_path_warnings(rows):
        print(line)
    for k, v in result["ratios"].items():
        print(f"[grpo_step] {k}: {v if v is None else round(v, 4)}")
    for t in result["targets"]:
        print(f"[grpo_step] target {t['name']}: {t['measured']} {t['op']} {t['target']} {target_status(t)}")
