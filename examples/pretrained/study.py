"""The exploration study on a real pretrained policy: BF16 LoRA, NVFP4 LoRA, NVFP4 LoRA + AQN, BF16 LoRA + AQN.

Three steps, each a sub-command, so that one GPU session can run them back to back and a CPU can check them:

* ``data``: generated GSM8K-format arithmetic (``examples/exploration/problems.py``) at one difficulty level of
  ``base_accuracy.py`` (pick the level where the base model starts at 10-40%);
* ``arms``: the four arms x N seeds as concurrent ``main_ppo`` runs through ``examples/exploration/run_arms.py``
  (its process handling, seeding and GPU sharing), with the study's settings: the numeric-answer reward
  (:mod:`verl_qerl.verl.reward`: ``\\boxed{N}``, ``#### N`` or "The answer is N", since a pretrained instruct
  model ignores the ``####`` instruction), AQN on from step 1 (``qerl.aqn.noise_from_start=true``) in both AQN
  arms, and sizes for a 0.5B model. Every arm differs only in its ``+qerl`` group (and ``qerl.aqn.enable=true``
  for BF16 + AQN); a seed fixes the prompts, their order, the LoRA init and vLLM sampling across arms;
* ``summarize``: ``summarize.py``'s per-run statistics, plus what this study reports: per-step curves with 95%
  t-intervals over seeds, per-arm step-0 held-out accuracy beside early entropy (a 4-bit copy of a small model can
  raise entropy simply by being worse), and paired contrasts (same seed) with the mean difference, its 95%
  t-interval and the standardized effect size d_z with an approximate 95% interval, for NVFP4 vs BF16, AQN on
  either base, and NVFP4 + AQN vs BF16. A results JSON with ``targets``; the step-0 KL from BF16 per variant comes
  from ``entropy_probe.py`` (``--probe``), which scores every variant on the same teacher-forced tokens.

usage:
  python examples/pretrained/study.py data --out DIR [--level L3] [--n-train 4096] [--n-test 256]
  python examples/pretrained/study.py arms --model MODEL --data DIR --out RUNS [run_arms options] [-- overrides]
  python examples/pretrained/study.py summarize RUNS [--out DIR] [--probe probe.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "exploration"))
sys.path.insert(0, str(HERE))

import run_arms  # noqa: E402
import summarize as expl  # noqa: E402

#: The four arms (run_arms.py names) and how the study labels them.
STUDY_ARMS = ("bf16", "nvfp4_noaqn", "nvfp4", "bf16_aqn")
LABEL = {"bf16": "BF16 LoRA", "nvfp4_noaqn": "NVFP4 LoRA", "nvfp4": "NVFP4 LoRA + AQN", "bf16_aqn": "BF16 LoRA + AQN"}
#: Paired contrasts (arm, base): quantization, AQN on each base, and QeRL against the baseline.
CONTRASTS = (("nvfp4_noaqn", "bf16"), ("nvfp4", "nvfp4_noaqn"), ("bf16_aqn", "bf16"), ("nvfp4", "bf16"))
CONTRAST_KEYS = ("early_entropy", "early_rollout_nll", "mean_reward", "final_reward", "acc_step0", "acc_final")
#: Study defaults passed to run_arms.py ahead of the user's own flags (later flags win in argparse).
ARM_DEFAULTS = ["--arms", ",".join(STUDY_ARMS), "--seeds", "5", "--steps", "100", "--reward", "numeric",
                "--aqn-from-start", "--project", "qerl-pretrained-study", "--lr", "2e-5", "--lora-rank", "32",
                "--lora-alpha", "64", "--train-batch-size", "32", "--mini-batch-size", "16", "--micro-batch-size", "32",
                "--n", "8", "--max-prompt-length", "256", "--max-response-length", "384", "--test-freq", "10",
                "--gpu-memory-utilization", "0.1", "--kv-cache-mb", "4096"]

# two-sided 95% Student t quantiles by degrees of freedom (df > 30: normal)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    """The two-sided 95% Student t quantile for ``df`` degrees of freedom (table, conservative between rows)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if df > 30:
        return 1.96
    return _T975.get(df) or _T975[max(k for k in _T975 if k <= df)]


def paired_effect(diffs: list[float]) -> dict[str, Any]:
    """Mean of per-seed differences with its 95% t-interval, and d_z = mean / sd with an approximate 95% interval
    (standard error sqrt(1/n + d_z^2 / (2n))); intervals need >= 2 seeds."""
    n = len(diffs)
    out: dict[str, Any] = {"n": n, "diffs": diffs, "mean": None, "ci95": None, "dz": None, "dz_ci95": None}
    if not n:
        return out
    mean = sum(diffs) / n
    out["mean"] = mean
    if n < 2:
        return out
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    out["sd"] = sd
    out["ci95"] = [mean - half, mean + half]
    if sd > 1e-12:
        dz = mean / sd
        se = math.sqrt(1 / n + dz * dz / (2 * n))
        out["dz"] = dz
        out["dz_ci95"] = [dz - 1.96 * se, dz + 1.96 * se]
    return out


def contrasts(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``"<arm> - <base>"`` -> statistic -> :func:`paired_effect` over the seeds both arms have."""
    by = {(r["arm"], r["seed"]): r["stats"] for r in runs.values()}
    out = {}
    for arm, base in CONTRASTS:
        seeds = sorted(s for a, s in by if a == arm and (base, s) in by)
        if not seeds:
            continue
        row = {"seeds": seeds}
        for key in CONTRAST_KEYS:
            diffs = [by[(arm, s)][key] - by[(base, s)][key] for s in seeds
                     if by[(arm, s)].get(key) is not None and by[(base, s)].get(key) is not None]
            row[key] = paired_effect(diffs)
        out[f"{arm} - {base}"] = row
    return out


def step_bands(runs: dict[str, dict[str, Any]], metric: str) -> dict[str, list[list[float]]]:
    """arm -> [[step, mean, lo95, hi95, n], ...] over the seeds that logged ``metric`` at that step."""
    out: dict[str, list[list[float]]] = {}
    for arm in sorted({r["arm"] for r in runs.values()}):
        series = [dict((int(s), v) for s, v in r["curves"].get(metric, [])) for r in runs.values() if r["arm"] == arm]
        rows = []
        for step in sorted({s for ser in series for s in ser}):
            vals = [ser[step] for ser in series if step in ser]
            m = sum(vals) / len(vals)
            if len(vals) > 1:
                sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
                half = t975(len(vals) - 1) * sd / math.sqrt(len(vals))
            else:
                half = 0.0
            rows.append([step, m, m - half, m + half, len(vals)])
        out[arm] = rows
    return out


def study_targets(arms: dict[str, Any], pairs: dict[str, Any], early_k: int) -> list[dict[str, Any]]:
    """The claims the study tests, each with its measured paired mean and interval (recorded whatever they are)."""
    claims = [
        ("nvfp4_noaqn - bf16", "early_entropy", ">", 0.0, f"NVFP4 raises early actor entropy (steps 1-{early_k})"),
        ("nvfp4_noaqn - bf16", "early_rollout_nll", ">", 0.0, "NVFP4 raises early sampler NLL"),
        ("nvfp4_noaqn - bf16", "mean_reward", ">", 0.0, "NVFP4 speeds reward growth (mean rollout reward)"),
        ("nvfp4 - nvfp4_noaqn", "mean_reward", ">", 0.0, "AQN helps on the NVFP4 base (mean rollout reward)"),
        ("bf16_aqn - bf16", "mean_reward", ">", 0.0, "AQN helps on the BF16 base (mean rollout reward)"),
        ("nvfp4 - bf16", "acc_final", ">=", 0.0, "QeRL (NVFP4 + AQN) held-out accuracy >= BF16 LoRA"),
        ("nvfp4_noaqn - bf16", "acc_step0", ">=", -0.02, "step-0 damage: NVFP4 starts within 2 points of BF16"),
    ]
    out = []
    for pair, key, op, target, name in claims:
        eff = pairs.get(pair, {}).get(key, {})
        out.append({"name": f"{name} [{pair}, {key}, paired by seed]", "measured": eff.get("mean"), "op": op,
                    "target": target, "ci95": eff.get("ci95"), "dz": eff.get("dz"), "dz_ci95": eff.get("dz_ci95"),
                    "n_seeds": eff.get("n")})
    return out


def _fmt_ci(e: dict[str, Any], digits: int = 3) -> str:
    if not e or e.get("mean") is None:
        return "-"
    s = f"{e['mean']:+.{digits}f}"
    if e.get("ci95"):
        s += f" [{e['ci95'][0]:+.{digits}f}, {e['ci95'][1]:+.{digits}f}]"
    if e.get("dz") is not None:
        s += f", d_z {e['dz']:+.2f} [{e['dz_ci95'][0]:+.2f}, {e['dz_ci95'][1]:+.2f}]"
    return s


def summarize_study(runs_dir: Path, out_dir: Path, *, probe: Path | None = None, early_k: int = 0,
                    horizon: int | None = None, device: str | None = None) -> dict[str, Any]:
    """Write ``study-<device>.{json,md,png}`` from the runs under ``runs_dir``; returns the JSON."""
    runs = expl.load_runs(runs_dir)
    if not runs:
        raise SystemExit(f"study.py summarize: no <arm>-s<seed>/metrics.jsonl under {runs_dir}")
    horizon = expl.common_horizon(runs) if horizon is None else horizon
    last = horizon or max((expl.last_logged_step(r["curves"]) for r in runs.values()), default=0)
    early_k = early_k or max(3, min(10, int(last) // 3))
    for r in runs.values():
        r["stats"] = expl.run_stats(r, early_k=early_k, threshold=None, smooth=3, horizon=horizon)
    names = [a for a in STUDY_ARMS if any(r["arm"] == a for r in runs.values())]
    names += sorted({r["arm"] for r in runs.values()} - set(names))
    arms = {a: expl.arm_stats(runs, a) for a in names}
    pairs = contrasts(runs)
    device = device or expl.device_slug()
    shown = {n: {**r, "curves": expl.truncate(r["curves"], horizon)} for n, r in runs.items()}
    bands = {m: step_bands(shown, m) for m in ("reward", "val_acc", "entropy", "rollout_nll", "response_length",
                                                "aqn_sigma")}
    result: dict[str, Any] = {
        "name": "pretrained_exploration_study", "device": device, "versions": expl.versions(),
        "settings": {"early_k": early_k, "horizon": horizon, "arms": names,
                     "seeds": sorted({r["seed"] for r in runs.values()}), "metrics": expl.METRICS},
        "targets": study_targets(arms, pairs, early_k), "arms": arms, "paired": pairs, "bands": bands,
        "runs": {n: {k: r[k] for k in ("arm", "seed", "status", "wall_s", "stats", "curves")}
                 for n, r in sorted(runs.items())},
    }
    if probe and probe.is_file():
        result["entropy_probe"] = json.loads(probe.read_text())
        result["targets"] += result["entropy_probe"].get("targets", [])
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"study-{device}"
    result["plot"] = f"{stem}.png" if plot_bands(bands, out_dir / f"{stem}.png", f"{device}, steps 1-{last}") else None
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Pretrained exploration study ({device})", "",
             f"| arm | runs | held-out acc step 0 | entropy steps 1-{early_k} | sampler NLL | mean reward | "
             "held-out acc final |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a, st in arms.items():
        lines.append(f"| {LABEL.get(a, a)} | {st['runs_with_steps']}/{st['runs']} | {expl.fmt(st['acc_step0'])} | "
                     f"{expl.fmt(st['early_entropy'], 4)} | {expl.fmt(st['early_rollout_nll'], 4)} | "
                     f"{expl.fmt(st['mean_reward'])} | {expl.fmt(st['acc_final'])} |")
    lines += ["", "Paired by seed: mean difference [95% t-interval], d_z [approx. 95% interval]", "",
              "| contrast | seeds | " + " | ".join(CONTRAST_KEYS) + " |",
              "| --- | ---: |" + " ---: |" * len(CONTRAST_KEYS)]
    for name, row in pairs.items():
        lines.append(f"| {name} | {len(row['seeds'])} | " + " | ".join(_fmt_ci(row[k]) for k in CONTRAST_KEYS) + " |")
    lines += ["", "Targets:", ""] + [f"- {t['name']}: measured {t['measured']} (target {t['op']} {t['target']}; "
                                     f"95% CI {t.get('ci95')})" for t in result["targets"]]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def plot_bands(bands: dict[str, dict[str, list[list[float]]]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [("reward", "rollout reward"), ("val_acc", "held-out accuracy (greedy)"),
              ("entropy", "actor entropy (clean policy)"), ("rollout_nll", "sampler NLL (noise included)"),
              ("response_length", "response length (tokens)"), ("aqn_sigma", "AQN sigma")]
    colors = {"bf16": "tab:blue", "nvfp4_noaqn": "tab:orange", "nvfp4": "tab:green", "bf16_aqn": "tab:purple"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (metric, label) in zip(axes.flat, panels):
        for arm, rows in bands.get(metric, {}).items():
            if not rows:
                continue
            xs, m, lo, hi = ([r[i] for r in rows] for i in range(4))
            ax.plot(xs, m, color=colors.get(arm), label=LABEL.get(arm, arm),
                    marker="o" if metric == "val_acc" else None, ms=3)
            ax.fill_between(xs, lo, hi, color=colors.get(arm), alpha=0.2, linewidth=0)
        ax.set_title(label)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"QeRL on a pretrained policy ({title}); line: mean over seeds, band: 95% t-interval")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cmd_data(argv: list[str]) -> int:
    from base_accuracy import LEVELS
    from problems import write_splits

    ap = argparse.ArgumentParser(prog="study.py data", description="generated problems at one difficulty level")
    ap.add_argument("--out", required=True)
    ap.add_argument("--level", default="L3", choices=sorted(LEVELS))
    ap.add_argument("--n-train", type=int, default=4096)
    ap.add_argument("--n-test", type=int, default=256)
    ap.add_argument("--n-dev", type=int, default=256, help="dev.jsonl problems with gold solutions (entropy_probe.py)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if min(args.n_train, args.n_test, args.n_dev) < 1:
        ap.error("--n-train, --n-test and --n-dev must be >= 1")
    paths = write_splits(args.out, n_sft=1, n_train=args.n_train, n_dev=args.n_dev, n_test=args.n_test, seed=args.seed,
                         difficulty=LEVELS[args.level])
    meta = json.loads(paths["meta"].read_text())
    paths["meta"].write_text(json.dumps({**meta, "level": args.level}, indent=1))
    print(f"[study] {args.level}: wrote {paths['train']} and {paths['test']}")
    return 0


def arm_argv(argv: list[str]) -> list[str]:
    """run_arms.py's argument list: the study defaults, then the user's flags (which override them)."""
    if "--" in argv:
        i = argv.index("--")
        return [*ARM_DEFAULTS, *argv[:i], "--", *argv[i + 1:]]
    return [*ARM_DEFAULTS, *argv]


def cmd_arms(argv: list[str]) -> int:
    return run_arms.main(arm_argv(argv))


def cmd_summarize(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="study.py summarize")
    ap.add_argument("runs_dir")
    ap.add_argument("--out", default=None)
    ap.add_argument("--probe", default=None, help="entropy_probe.py JSON (step-0 entropy and KL from BF16)")
    ap.add_argument("--early-k", type=int, default=0)
    ap.add_argument("--horizon", type=int, default=None)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    runs = Path(args.runs_dir)
    if not runs.is_dir():
        ap.error(f"{runs} is not a folder")
    summarize_study(runs, Path(args.out or runs), probe=Path(args.probe) if args.probe else None,
                    early_k=args.early_k, horizon=args.horizon, device=args.device)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"data": cmd_data, "arms": cmd_arms, "summarize": cmd_summarize}
    if not argv or argv[0] not in commands:
        print(__doc__.split("usage:")[1].rstrip(), file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
