"""Turn the exploration study's per-run metrics (verl's file logger JSONL) into curves, a table and a results JSON.

Why a separate step: the runs happen on a GPU machine whose outputs come back as a few files, and the analysis
has to work on whatever was logged (a run cut by the time budget still has its first steps). This script reads a
folder of runs (``<arm>-s<seed>/metrics.jsonl``, as :mod:`run_arms` writes them) and writes:

* ``exploration-<device>.png``: reward, held-out accuracy, actor entropy, rollout NLL, AQN sigma and response
  length against the step; per arm the mean over seeds as a line and the min-max over seeds as a band;
* ``exploration-<device>.md``: per arm, mean +- std over seeds of early entropy (steps 1..k), mean and final
  reward, steps to a reward threshold, held-out accuracy at step 0 and at the last validation; then the same
  quantities as paired differences arm - BF16 per seed (same seed = same prompts in the same order);
* ``exploration-<device>.json``: raw curves per run, the per-arm statistics, ``targets`` (the hypotheses with
  their measured values, whatever they are), ``device``, ``versions``, ``command``, ``date``.

Metrics used (verl 0.9.1 names): ``critic/score/mean`` (mean rollout reward, the strict GSM8K score),
``val-core/openai/gsm8k/acc/mean@1`` (greedy held-out accuracy, verl 0.9.1 names it ``acc``; logged at step 0
and every ``test_freq``),
``actor/entropy`` (mean token entropy of the rollouts under the actor, i.e. the *clean* policy: AQN is applied to
the rollout engine only), ``rollout_corr/rollout_log_ppl`` (mean NLL of the sampled tokens under the sampling
engine, an estimate of the *sampler's* entropy, noise included), ``qerl/aqn_sigma``.

Horizon: every statistic is taken over steps 1..H, by default the last step that *every* run reached (runs cut
by a time budget stop at different steps; a final reward or a censored threshold step from uneven horizons would
compare different things). ``--horizon 0`` uses each run's whole curve; the JSON keeps the raw curves either way.

usage: python examples/exploration/summarize.py RUNS_DIR [--out DIR] [--device NAME] [--early-k K] [--horizon H]
       [--seeds 0,1] [--tag NAME]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ARM_ORDER = ("bf16", "nvfp4_noaqn", "nvfp4")
ARM_LABEL = {"bf16": "BF16 LoRA", "nvfp4_noaqn": "NVFP4 LoRA (no AQN)", "nvfp4": "NVFP4 LoRA + AQN (QeRL)"}
ARM_COLOR = {"bf16": "tab:blue", "nvfp4_noaqn": "tab:orange", "nvfp4": "tab:green"}
METRICS = {
    "reward": "critic/score/mean",
    "entropy": "actor/entropy",
    "rollout_nll": "rollout_corr/rollout_log_ppl",
    "aqn_sigma": "qerl/aqn_sigma",
    "response_length": "response_length/mean",
    "step_time": "timing_s/step",
    "gen_time": "timing_s/gen",
    "test_time": "timing_s/testing",
}
VAL_PATTERN = re.compile(r"^val-core/openai/gsm8k/(acc|reward)/mean@\d+$")
RUN_NAME = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


def read_metrics(path: Path) -> dict[int, dict[str, float]]:
    """step -> merged metrics (verl may log a step in more than one line; a torn last line is skipped)."""
    steps: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        data = {k: v for k, v in row.get("data", {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        steps.setdefault(int(row["step"]), {}).update(data)
    return steps


def val_key(steps: dict[int, dict[str, float]]) -> str | None:
    keys = sorted({k for d in steps.values() for k in d if VAL_PATTERN.match(k)})
    return keys[0] if keys else None


def curves(steps: dict[int, dict[str, float]]) -> dict[str, list[list[float]]]:
    """metric -> [[step, value], ...] (finite values only)."""
    out: dict[str, list[list[float]]] = {}
    vk = val_key(steps)
    names = {**METRICS, **({"val_acc": vk} if vk else {})}
    for short, key in names.items():
        pts = [[s, float(d[key])] for s, d in sorted(steps.items()) if key in d and math.isfinite(float(d[key]))]
        if pts:
            out[short] = pts
    return out


def load_runs(runs_dir: Path, seeds: set[int] | None = None) -> dict[str, dict[str, Any]]:
    status = {}
    if (runs_dir / "runs.json").is_file():
        status = {r["name"]: r for r in json.loads((runs_dir / "runs.json").read_text()).get("runs", [])}
    runs = {}
    for path in sorted(runs_dir.glob("*/metrics.jsonl")):
        m = RUN_NAME.match(path.parent.name)
        if not m or (seeds is not None and int(m["seed"]) not in seeds):
            continue
        steps = read_metrics(path)
        runs[path.parent.name] = {
            "arm": m["arm"], "seed": int(m["seed"]), "val_key": val_key(steps), "curves": curves(steps),
            "status": status.get(path.parent.name, {}).get("status"),
            "wall_s": status.get(path.parent.name, {}).get("wall_s"),
        }
    for name, row in status.items():  # runs that never logged still show up
        if name not in runs and (seeds is None or row["seed"] in seeds):
            runs[name] = {"arm": row["arm"], "seed": row["seed"], "val_key": None, "curves": {},
                          "status": row.get("status"), "wall_s": row.get("wall_s")}
    return runs


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _std(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return 0.0 if xs else None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def trailing_mean(pts: list[list[float]], window: int) -> list[list[float]]:
    out = []
    for i, (s, _) in enumerate(pts):
        vals = [v for _, v in pts[max(0, i - window + 1): i + 1]]
        out.append([s, sum(vals) / len(vals)])
    return out


def truncate(curves: dict[str, list[list[float]]], horizon: int) -> dict[str, list[list[float]]]:
    """The curves up to step ``horizon`` (0: whole curves)."""
    if horizon <= 0:
        return curves
    return {k: [p for p in v if p[0] <= horizon] for k, v in curves.items()}


def last_logged_step(curves: dict[str, list[list[float]]]) -> int:
    """The last step with a logged reward (0: none)."""
    return int(max((p[0] for p in curves.get("reward", [])), default=0))


def common_horizon(runs: dict[str, dict[str, Any]]) -> int:
    """The last step every run with logged steps reached (0 when none logged a step)."""
    lasts = [last_logged_step(r["curves"]) for r in runs.values() if r["curves"].get("reward")]
    return min(lasts) if lasts else 0


def run_stats(run: dict[str, Any], *, early_k: int, threshold: float | None, smooth: int,
              horizon: int = 0) -> dict[str, Any]:
    c = truncate(run["curves"], horizon)

    def early(metric: str) -> float | None:
        return _mean([v for s, v in c.get(metric, []) if 1 <= s <= early_k])

    reward = [p for p in c.get("reward", []) if p[0] >= 1]
    last = max([s for s, _ in reward], default=0)
    stats: dict[str, Any] = {
        "early_entropy": early("entropy"), "early_rollout_nll": early("rollout_nll"),
        "final_reward": _mean([v for _, v in reward[-3:]]), "mean_reward": _mean([v for _, v in reward]),
        "last_step": last, "logged_last_step": last_logged_step(run["curves"]),
        "step_time": _mean([v for s, v in c.get("step_time", []) if s >= 2]),
    }
    reached = None
    if threshold is not None:
        for s, v in trailing_mean(reward, smooth):
            if v >= threshold:
                reached = s
                break
    stats["steps_to_threshold"] = reached
    # start-up (Ray, vLLM, FSDP, step-0 validation) ~ wall minus the logged step and validation times
    full = run["curves"]
    busy = sum(v for _, v in full.get("step_time", [])) + sum(v for _, v in full.get("test_time", []))
    stats["startup_s"] = round(run["wall_s"] - busy, 1) if run.get("wall_s") and busy else None
    # censored runs count as (last step + 1): a lower bound, so a ratio from them is conservative
    stats["steps_to_threshold_censored"] = reached if reached is not None else (last + 1 if last else None)
    val = c.get("val_acc", [])
    stats["acc_step0"] = next((v for s, v in val if s == 0), None)
    stats["acc_final"] = val[-1][1] if val and val[-1][0] > 0 else None
    stats["acc_final_step"] = val[-1][0] if val and val[-1][0] > 0 else None
    return stats


def arm_stats(runs: dict[str, dict[str, Any]], arm: str) -> dict[str, Any]:
    members = [r for r in runs.values() if r["arm"] == arm]
    out: dict[str, Any] = {"runs": len(members), "runs_with_steps": sum(1 for r in members if r["stats"]["last_step"])}
    for key in ("early_entropy", "early_rollout_nll", "final_reward", "mean_reward", "steps_to_threshold_censored",
                "acc_step0", "acc_final", "step_time", "last_step", "startup_s"):
        vals = [r["stats"][key] for r in members if r["stats"].get(key) is not None]
        out[key] = {"mean": _mean(vals), "std": _std(vals), "n": len(vals)}
    out["reached_threshold"] = sum(1 for r in members if r["stats"]["steps_to_threshold"] is not None)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


PAIRED_KEYS = ("early_entropy", "early_rollout_nll", "mean_reward", "final_reward", "steps_to_threshold_censored",
               "acc_final")


def paired(runs: dict[str, dict[str, Any]], arm: str, base: str = "bf16") -> dict[str, Any]:
    """Per-seed differences ``arm - base`` of each run statistic: the runs of one seed share the prompts and their
    order, so the paired difference removes the seed-to-seed spread that the per-arm means carry."""
    by_seed = {(r["arm"], r["seed"]): r["stats"] for r in runs.values()}
    seeds = sorted(s for a, s in by_seed if a == arm and (base, s) in by_seed)
    out: dict[str, Any] = {"seeds": seeds}
    for key in PAIRED_KEYS:
        diffs = [by_seed[(arm, s)][key] - by_seed[(base, s)][key] for s in seeds
                 if by_seed[(arm, s)].get(key) is not None and by_seed[(base, s)].get(key) is not None]
        sd = _std(diffs)
        out[key] = {"mean": _mean(diffs), "std": sd, "n": len(diffs), "diffs": diffs,
                    # mean / standard error; with 3 seeds |t| > 4.3 is the two-sided 5% level
                    "t": (_mean(diffs) / (sd / math.sqrt(len(diffs)))) if diffs and sd and sd > 1e-9 else None}
    return out


def paired_table(pairs: dict[str, dict[str, Any]]) -> str:
    head = ("| arm - BF16 (paired by seed) | seeds | early entropy | sampler NLL | mean reward | final reward | "
            "steps to threshold | held-out acc final |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm, p in pairs.items():
        cells = []
        for key in PAIRED_KEYS:
            st = p[key]
            digits = 1 if key == "steps_to_threshold_censored" else (4 if "entropy" in key or "nll" in key else 3)
            t = f" (t {st['t']:+.1f})" if st.get("t") is not None else ""
            cells.append(f"{st['mean']:+.{digits}f} ± {st['std']:.{digits}f}{t}" if st["mean"] is not None else "-")
        lines.append(f"| {ARM_LABEL.get(arm, arm)} | {len(p['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(arms: dict[str, dict[str, Any]], early_k: int, horizon: int = 0) -> list[dict[str, Any]]:
    """The study's hypotheses (quantization, and AQN on top, raise early entropy and speed up reward growth)."""
    def m(arm: str, key: str) -> float | None:
        return arms.get(arm, {}).get(key, {}).get("mean")

    out = []
    for arm in ("nvfp4_noaqn", "nvfp4"):
        out.append({"name": f"early entropy ratio {arm}/bf16 (actor/entropy, mean of steps 1-{early_k})",
                    "measured": _ratio(m(arm, "early_entropy"), m("bf16", "early_entropy")), "op": ">=",
                    "target": 1.0})
    out.append({"name": f"early sampler NLL ratio nvfp4/bf16 (rollout_corr/rollout_log_ppl, steps 1-{early_k})",
                "measured": _ratio(m("nvfp4", "early_rollout_nll"), m("bf16", "early_rollout_nll")), "op": ">=",
                "target": 1.0})
    span = f"steps 1-{horizon}" if horizon else "whole runs"
    for arm in ("nvfp4_noaqn", "nvfp4"):
        out.append({"name": f"mean-reward ratio {arm}/bf16 (rollout reward averaged over {span}; reward growth)",
                    "measured": _ratio(m(arm, "mean_reward"), m("bf16", "mean_reward")), "op": ">=", "target": 1.0})
    for arm in ("nvfp4_noaqn", "nvfp4"):
        out.append({"name": f"steps-to-reward-threshold ratio {arm}/bf16 (mean over seeds; unreached = last step + 1)",
                    "measured": _ratio(m(arm, "steps_to_threshold_censored"), m("bf16", "steps_to_threshold_censored")),
                    "op": "<=", "target": 1.0})
    out.append({"name": "final held-out accuracy nvfp4 (QeRL) minus bf16 (greedy, last validation)",
                "measured": (m("nvfp4", "acc_final") - m("bf16", "acc_final"))
                if m("nvfp4", "acc_final") is not None and m("bf16", "acc_final") is not None else None,
                "op": ">=", "target": 0.0})
    for t in out:
        if t["measured"] is not None:
            t["measured"] = round(t["measured"], 4)
    return out


def fmt(stat: dict[str, Any] | None, digits: int = 3) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def table(arms: dict[str, dict[str, Any]], early_k: int, threshold: float | None) -> str:
    thr = f"{threshold:.3f}" if threshold is not None else "n/a"
    head = (f"| arm | runs | entropy, steps 1-{early_k} | sampler NLL, steps 1-{early_k} | mean reward | "
            f"final reward (last 3) | steps to reward ≥ {thr} (reached) | held-out acc step 0 | "
            "held-out acc final | s/step |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm, a in arms.items():
        lines.append(
            f"| {ARM_LABEL.get(arm, arm)} | {a['runs_with_steps']}/{a['runs']} | {fmt(a['early_entropy'])} | "
            f"{fmt(a['early_rollout_nll'])} | {fmt(a['mean_reward'])} | {fmt(a['final_reward'])} | "
            f"{fmt(a['steps_to_threshold_censored'], 1)} ({a['reached_threshold']}/{a['runs']}) | "
            f"{fmt(a['acc_step0'])} | {fmt(a['acc_final'])} | {fmt(a['step_time'], 1)} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[summarize] matplotlib not installed: no PNG (run this script again where it is)", file=sys.stderr)
        return False
    panels = [("reward", "rollout reward (strict GSM8K)"), ("val_acc", "held-out accuracy (greedy)"),
              ("entropy", "actor entropy of rollouts"), ("rollout_nll", "sampler NLL of sampled tokens"),
              ("aqn_sigma", "AQN sigma"), ("response_length", "response length (tokens)")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    arms = [a for a in ARM_ORDER if any(r["arm"] == a for r in runs.values())]
    arms += sorted({r["arm"] for r in runs.values()} - set(arms))
    for ax, (metric, label) in zip(axes.flat, panels):
        for arm in arms:
            series = [dict((int(s), v) for s, v in r["curves"].get(metric, [])) for r in runs.values()
                      if r["arm"] == arm]
            series = [s for s in series if s]
            if not series:
                continue
            xs = sorted({s for ser in series for s in ser})
            mean = [sum(ser[x] for ser in series if x in ser) / sum(1 for ser in series if x in ser) for x in xs]
            lo = [min(ser[x] for ser in series if x in ser) for x in xs]
            hi = [max(ser[x] for ser in series if x in ser) for x in xs]
            color = ARM_COLOR.get(arm)
            ax.plot(xs, mean, marker="o" if metric == "val_acc" else None, ms=3, color=color,
                    label=f"{ARM_LABEL.get(arm, arm)} (n={len(series)})")
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.set_title(label)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title + "  (line: mean over seeds; band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "vllm", "verl", "transformers", "peft", "ray", "verl-qerl"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_slug() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
            n = torch.cuda.device_count()
            return f"{name}-x{n}" if n > 1 else name
    except ImportError:
        pass
    return "cpu"


def summarize(runs_dir: Path, out_dir: Path, *, device: str | None = None, early_k: int = 0,
              reward_threshold: float | None = None, reward_gain: float = 0.1, smooth: int = 3,
              command: str | None = None, sft_log: Path | None = None,
              probe: Path | None = None, horizon: int | None = None,
              seeds: set[int] | None = None, tag: str = "") -> dict[str, Any]:
    """Summarize the runs under ``runs_dir``; ``horizon`` None = the common horizon (see the module docstring),
    0 = whole curves; ``seeds`` keeps only those seeds."""
    runs = load_runs(runs_dir, seeds)
    if not runs:
        raise SystemExit(f"summarize.py: no <arm>-s<seed>/metrics.jsonl under {runs_dir}"
                         + (f" for seeds {sorted(seeds)}" if seeds is not None else ""))
    if horizon is None:
        horizon = common_horizon(runs)
    elif horizon < 0:
        raise SystemExit(f"summarize.py: --horizon {horizon}: must be >= 0 (0 = whole curves)")
    meta: dict[str, Any] = {}
    if (runs_dir / "meta.json").is_file():
        meta = json.loads((runs_dir / "meta.json").read_text())
    device = device or meta.get("device") or device_slug()
    last = horizon or max((last_logged_step(r["curves"]) for r in runs.values()), default=0)
    early_k = early_k or max(3, int(last) // 3)
    if reward_threshold is None:
        first = [r["curves"]["reward"][0][1] for r in runs.values()
                 if r["curves"].get("reward") and r["curves"]["reward"][0][0] == 1]
        reward_threshold = (sum(first) / len(first) + reward_gain) if first else None
    for r in runs.values():
        r["stats"] = run_stats(r, early_k=early_k, threshold=reward_threshold, smooth=smooth, horizon=horizon)
    arm_names = [a for a in ARM_ORDER if any(r["arm"] == a for r in runs.values())]
    arm_names += sorted({r["arm"] for r in runs.values()} - set(arm_names))
    arms = {a: arm_stats(runs, a) for a in arm_names}
    pairs = {a: paired(runs, a) for a in arm_names if a != "bf16" and "bf16" in arm_names}
    md = table(arms, early_k, reward_threshold)
    result: dict[str, Any] = {
        "name": "exploration",
        "description": "GRPO from a partially trained from-scratch Qwen2 (~25M) on generated GSM8K-format problems: "
                       "BF16 LoRA vs NVFP4 LoRA vs NVFP4 LoRA + AQN, same data, prompts, seeds and budget",
        "device": device,
        "versions": meta.get("versions") or versions(),
        "command": command or meta.get("command") or shlex.join(sys.argv),
        "date": meta.get("date") or dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "settings": {"early_k": early_k, "horizon": horizon, "seeds": sorted({r["seed"] for r in runs.values()}),
                     "reward_threshold": reward_threshold, "reward_gain": reward_gain,
                     "threshold_smoothing_window": smooth, "metrics": METRICS,
                     "val_metric": sorted({r["val_key"] for r in runs.values() if r["val_key"]})},
        # what the launcher recorded in meta.json (campaign.sh's "seeds" is a per-call seed count, not the
        # seeds summarized: those are settings.seeds), kept apart so it cannot overwrite the settings above
        "campaign_meta": {k: v for k, v in meta.items() if k in ("steps", "seeds", "lr", "launcher", "budget_s")},
        "targets": targets(arms, early_k, horizon),
        "arms": arms,
        "paired": pairs,
        "runs": {name: {k: r[k] for k in ("arm", "seed", "status", "wall_s", "stats", "curves")}
                 for name, r in sorted(runs.items())},
    }
    sft_path = sft_log or (Path(meta["sft_log"]) if meta.get("sft_log") else None)
    if sft_path and Path(sft_path).is_file():
        log = json.loads(Path(sft_path).read_text())
        result["sft"] = {k: log.get(k) for k in ("n_params", "steps", "stopped_by", "final_dev_acc",
                                                 "saved_bf16_dev_acc", "wall_s", "device", "eval")}
    if probe and Path(probe).is_file():  # entropy_probe.py: the step-0 paired entropy measurement
        result["entropy_probe"] = json.loads(Path(probe).read_text())
        result["targets"] += result["entropy_probe"].get("targets", [])
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"exploration-{device}" + (f"-{tag}" if tag else "")
    png = out_dir / f"{stem}.png"
    shown = {n: {**r, "curves": truncate(r["curves"], horizon)} for n, r in runs.items()}
    title = f"QeRL exploration study ({device}" + (f", steps 1-{horizon})" if horizon else ")")
    result["plot"] = png.name if plot(shown, png, title) else None
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    span = f"steps 1-{horizon}, the last step every run reached" if horizon else "whole runs"
    lines = [f"# Exploration study ({device})", "", f"Statistics over {span}.", "", md, ""]
    if pairs:
        lines += [paired_table(pairs), "", "(mean ± std over seeds of the per-seed difference; t = mean / standard "
                  "error, |t| > 4.3 is the two-sided 5% level with 3 seeds)", ""]
    lines += ["Targets:", ""]
    for t in result["targets"]:
        lines.append(f"- {t['name']}: measured {t['measured']} (target {t['op']} {t['target']})")
    if "entropy_probe" in result:
        pr = result["entropy_probe"]
        lines += ["", f"Step-0 entropy probe (same weights, teacher-forced, {pr['n_problems']} problems, "
                  f"{pr['n_tokens']} tokens):", "",
                  "| variant | entropy (nats) | KL from bf16 | top-1 agree | ratio [95% CI] |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for v, st in pr["variants"].items():
            r = pr["entropy_ratio_to_bf16"].get(v)
            ci = f"{r['ratio']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]" if r else "1"
            lines.append(f"| {v} | {st['entropy']:.4f} | {st['kl_from_bf16']:.2e} | {st['top1_agree']:.4f} | {ci} |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    for name, r in sorted(runs.items()):
        st = r["stats"]
        print(f"  run {name}: status={r['status']} wall={r['wall_s']} last_step={st['last_step']} "
              f"acc0={st['acc_step0']} acc_final={st['acc_final']} s/step={st['step_time']} "
              f"startup_s={st['startup_s']}")
    print(md)
    if pairs:
        print(paired_table(pairs))
    for t in result["targets"]:
        print(f"  {t['name']}: {t['measured']} ({t['op']} {t['target']})")
    print(f"[summarize] wrote {out_dir / (stem + '.json')}, .md" + (", .png" if result["plot"] else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs_dir", help="folder of <arm>-s<seed>/metrics.jsonl (run_arms.py --out)")
    ap.add_argument("--out", default=None, help="output folder (default: RUNS_DIR)")
    ap.add_argument("--device", default=None, help="device name for the file names (default: meta.json or detect)")
    ap.add_argument("--early-k", type=int, default=0, help="early window in steps (0: a third of the run, >= 3)")
    ap.add_argument("--reward-threshold", type=float, default=None,
                    help="reward threshold (default: mean step-1 reward over all runs + --reward-gain)")
    ap.add_argument("--reward-gain", type=float, default=0.1)
    ap.add_argument("--smooth", type=int, default=3, help="trailing window for the threshold crossing")
    ap.add_argument("--command", default=None, help="the command that produced the runs (for the JSON)")
    ap.add_argument("--sft-log", default=None, help="sft_log.json of the policy's warm start")
    ap.add_argument("--probe", default=None, help="entropy_probe.py's JSON, embedded with its targets")
    ap.add_argument("--horizon", type=int, default=None,
                    help="statistics over steps 1..H (default: the last step every run reached; 0: whole curves)")
    ap.add_argument("--seeds", default=None, help="comma list of seeds to keep (default: all)")
    ap.add_argument("--tag", default="", help="file-name suffix: exploration-<device>-<tag>.{json,md,png}")
    args = ap.parse_args(argv)
    if args.tag and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.tag):
        ap.error(f"--tag {args.tag!r}: letters, digits, '.', '_' and '-' only (it becomes part of file names)")
    try:
        seeds = {int(v) for v in args.seeds.split(",") if v.strip()} if args.seeds else None
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: expected a comma list of integers")
    runs_dir = Path(args.runs_dir)
    if not runs_dir.is_dir():
        ap.error(f"{runs_dir} is not a folder")
    if args.early_k < 0 or args.smooth < 1:
        ap.error("--early-k must be >= 0 and --smooth >= 1")
    summarize(runs_dir, Path(args.out or runs_dir), device=args.device, early_k=args.early_k,
              reward_threshold=args.reward_threshold, reward_gain=args.reward_gain, smooth=args.smooth,
              command=args.command, sft_log=Path(args.sft_log) if args.sft_log else None,
              probe=Path(args.probe) if args.probe else None, horizon=args.horizon, seeds=seeds,
              tag=args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
