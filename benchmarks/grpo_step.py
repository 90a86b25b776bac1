"""GRPO step time, per phase, through ``python -m verl.trainer.main_ppo``: QeRL vs BF16 LoRA, 1 vs N GPUs.

One *run* is one ``main_ppo`` process (its own Ray cluster, ``RAY_TMPDIR`` and metrics file) for a
few GRPO steps on local GSM8K-format prompts (``verl_qerl.testing.data``). The script reads verl's
per-step metrics (``timing_s/gen``, ``timing_s/old_log_prob``, ``timing_s/update_actor``,
``timing_s/update_weights``, ``timing_s/step``, ``perf/total_num_tokens``, rewards, losses), samples
``nvidia-smi`` for the peak memory of the run's GPUs (the actor's own peak is in verl's metrics; vLLM's
memory is not), drops the first step (CUDA graphs, allocator warm-up) from the means, and writes one
JSON with the raw rows and the ``targets`` of the comparison asked for:

* ``--compare variants`` (issue 8): each variant on one GPU; step-time ratio of the first variant
  (QeRL) over the second (BF16 LoRA), target <= 0.75. ``--concurrent`` runs the variants at the same
  time on different GPUs (halves the wall time; each still owns its GPU).
* ``--compare gpus`` (issue 9): the first variant on 1 GPU, then on ``--gpus`` GPUs (FSDP2 over all
  ranks, one vLLM replica per GPU); throughput ratio target >= 1.6, and learning parity: the reward,
  pg_loss and entropy curves step by step, paired z of their differences <= 3 (sampling noise only;
  use a model that earns rewards, e.g. the exploration SFT model, or the check is degenerate).
  ``--concurrent`` runs both at once (GPU 0 shared): parity only, no time target.

``--baseline FILE`` (repeatable) reuses the rows of an earlier results JSON of this script (same settings,
same device) instead of running them again: a GPU call is limited to 10 minutes, so a comparison of long
runs is split over calls and the last one writes the JSON with every row and the targets::

    python benchmarks/grpo_step.py --variants lora                           # call 1: the BF16 LoRA run
    python benchmarks/grpo_step.py --variants qerl,lora \
        --baseline benchmarks/results/grpo_step-7b-variants-<gpu>.json     # call 2: runs qerl only

``--merge-only`` runs nothing and writes the comparison from ``--baseline`` files alone (device and versions are
theirs), so variants measured on separate machines are combined afterwards on any machine.

``--preset reasoning`` (issue 20) is the workload of reasoning RL, where long rollouts should dominate the step:
32 prompts x 8 = 256 sequences per step, every response exactly 2048 tokens (``ignore_eos``: a random model has no
natural length, and a fixed one makes both variants decode the same tokens), sampled at temperature 1 over the
151,936 ids of Qwen2.5's tokenizer (``--tokenizer``, default ``.tokenizers/qwen2.5`` written by ``qerl-pretrained
qwen2.5-coder-0.5b --tokenizer-only --out .tokenizers/qwen2.5``; verl masks every logit at or above
``len(tokenizer)``, so the tiny 512-id tokenizer of plain runs lets the model sample only 512 ids), LoRA rank 32 and
the paper's learning rates (1e-5 for the 4-bit variants, 5e-6 for BF16 LoRA; the rate does not change the cost),
``gpu_memory_utilization`` 0.5 for both variants (verl's default; QeRL's 4-bit weights leave its vLLM ~9 GB more KV
cache, and each run records what vLLM reported: ``kv_cache_tokens``, ``max_concurrency``), micro-batch 4 (8.7k
tokens, 1.7x the activations of the measured 8 x 640 setting) and its own targets: QeRL / BF16 LoRA step <= 0.80,
gen <= 0.70, old_log_prob and update_actor <= 1.05. Every run also records the rollouts' decode-batch histogram
(``decode_batches``: engine steps per number of sequences decoding, from ``verl_qerl.vllm.decode_stats``).

Its time at 7B on one H200, from the 16 x 8 x <= 512 runs (results/grpo_step-7b-variants-nvidia-h200.json): start-up
~295 s; the actor costs 0.204 ms (update_actor) + 0.068 ms (old_log_prob) per padded token, so 256 x 2176 = 557k
tokens take ~114 + 38 s (+5% for attention at 2176 tokens); generation is 2048 decode steps at M = 256 of ~16-18 ms,
~35-39 s. One step is ~195 s, and 3 steps (1 warm-up + 2 measured) + start-up ~885 s: more than one 10-minute call.
So a run goes detached over two back-to-back calls on one warm machine (``benchmarks/gpu/detached.sh``), one variant
per machine (a machine is held at most 30 minutes), the second variant merging the first's JSON with ``--baseline``
(``benchmarks/GPU.md`` has the calls). ``--steps 2`` (1 measured step) still needs ~685 s.

Models: ``7b`` / ``32b`` / ``72b`` (random Qwen2.5-shaped weights written on the spot, ``benchmarks/rollout.py``)
or the path of a local HF checkpoint. ``72b`` is for NVFP4 variants only (written directly in NVFP4, 44.5 GB;
its BF16 checkpoint would be 145 GB) and one GPU with every memory setting on: micro-batch 1, gradient
checkpointing (the default), vLLM sleep mode (verl's default ``free_cache_engine``) and the actor offloaded
between phases (``actor_rollout_ref.actor.fsdp_config.param_offload=True optimizer_offload=True`` as extra
overrides; ``benchmarks/GPU.md`` has the command). ``--tiny`` is the CPU smoke test (tiny model, verl-qerl's CPU
platform).

This file launches the runs; ``grpo_step_settings.py`` holds the variants, presets and the ``--baseline`` rule, and
``grpo_step_results.py`` turns what a run left behind into its row, compares the rows and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # this script's sibling modules
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # verl_qerl without an install (benchmarks/rollout.py does the same)

import machine_check  # noqa: E402 - benchmarks/: the speed check recorded with each run
from grpo_step_results import (  # noqa: E402 - benchmarks/: the results side (row summaries, targets, tables)
    PARITY_METRICS,  # noqa: F401 - re-exported: tests reach the whole benchmark through this script
    PARITY_Z_LIMIT,  # noqa: F401
    base_bytes_held,
    compare,
    decode_histogram,
    fast_path_report,
    fast_path_warnings,  # noqa: F401 - re-exported for the tests
    kv_cache_report,
    memory_targets,
    paired_z,  # noqa: F401
    read_metrics,
    report,
    summarize_run,
)
from grpo_step_settings import (  # noqa: E402 - benchmarks/: variants, presets, --baseline
    DEFAULT_TOKENIZER,
    GENERIC,
    PAPER_LR,
    PRESET_TARGETS,
    PRESETS,
    TOKENIZER_COMMAND,
    VARIANTS,
    StepBenchError,
    baseline_origin,
    load_baselines,
    lr_for,
)
from memory_table import MODELS as SHAPES  # noqa: E402 - rollout.py's 7b/32b + the Qwen2.5-72B shape
from results_format import target_status, write_json  # noqa: E402, F401 - target_status re-exported
from rollout import BenchError, device_name, tokenizer_identity, versions, write_random_checkpoint  # noqa: E402

from verl_qerl.testing.procs import kill_process_trees  # noqa: E402
from verl_qerl.verl.launch import (  # noqa: E402
    cpu_platform_overrides,
    grpo_overrides,
    sdpa_overrides,
    varlen_overrides,
)
from verl_qerl.vllm import decode_stats  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def build_inputs(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path]:
    """(model folder, train parquet, val parquet); random weights for 7b/32b/72b, the tiny model for --tiny."""
    from verl_qerl.testing.data import write_arith_parquet

    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from verl_qerl.testing.tiny import make_tiny_model

        model = work / "tiny-model"
        if not (model / "config.json").is_file():
            make_tiny_model(model)
    elif args.model in SHAPES:
        # NVFP4-only comparisons get the NVFP4 checkpoint written directly (the actor and vLLM both read it, no
        # BF16 copy anywhere: 32B BF16 is 65 GB, over the GPU machine's disk); any BF16/NF4 variant needs BF16
        fmt = "nvfp4" if all(VARIANTS[v].startswith("nvfp4") for v in args.variants.split(",")) else "bf16"
        if fmt == "bf16" and args.model == "72b":
            raise StepBenchError(f"--model 72b --variants {args.variants}: NVFP4 variants only (qerl, nvfp4); a "
                                 "BF16 72B checkpoint is 145 GB, more than the GPU machine's disk")
        # the layout of benchmarks/rollout.py (<dir>/<model>/<fmt>): one random checkpoint serves both scripts
        try:
            model = write_random_checkpoint(Path(args.ckpt_dir) / args.model / fmt, SHAPES[args.model], fmt,
                                            seed=args.seed, tokenizer=Path(args.tokenizer) if args.tokenizer else None)
        except BenchError as exc:
            raise StepBenchError(str(exc)) from exc
    else:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise StepBenchError(f"--model {args.model}: not one of {sorted(SHAPES)} and no config.json there")
    if args.data:
        train, val = Path(args.data) / "train.parquet", Path(args.data) / "test.parquet"
        for f in (train, val):
            if not f.is_file():
                raise StepBenchError(f"--data {args.data}: {f.name} missing (needs train.parquet, test.parquet)")
        return model.resolve(), train.resolve(), val.resolve()
    n_train = args.batch * (args.steps + 1)
    train, val = write_arith_parquet(work / "data", n_train=n_train, n_val=max(args.batch, 8), seed=args.seed)
    return model.resolve(), train.resolve(), val.resolve()


def main_ppo_overrides(args: argparse.Namespace, variant: str, gpus: int, model: Path, train: Path,
                       val: Path) -> list[str]:
    """The hydra overrides of one run (same for every variant except ``+qerl=``)."""
    ov = grpo_overrides(
        qerl=VARIANTS[variant], model=model, train_files=train, val_files=val, train_batch_size=args.batch,
        max_prompt_length=args.prompt_length, max_response_length=args.response_length, n=args.n,
        lora_rank=args.lora_rank, lora_alpha=args.lora_rank, lr=lr_for(args, variant), mini_batch_size=args.batch,
        micro_batch_size=args.micro_batch, gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
        steps=args.steps, gpus=gpus, tp=args.tp, shuffle=False,
        max_model_len=args.prompt_length + args.response_length + 8,
    ) + [
        f"actor_rollout_ref.model.enable_gradient_checkpointing={args.gradient_checkpointing}",
        f"qerl.replay_poll_s={args.replay_poll_s}",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.project_name=qerl-grpo-step",
        f"trainer.experiment_name={variant}-{gpus}gpu",
    ]
    if args.ignore_eos:  # every response runs its full length: a fixed-length reasoning trace
        ov.append("actor_rollout_ref.rollout.ignore_eos=True")
    if VARIANTS[variant] == "nvfp4":  # the AQN variant: the fewest stages AQN allows (needs >= 3 steps)
        ov.append("qerl.aqn.num_stages=3")
    if args.reward:
        ov += [f"reward.custom_reward_function.path={Path(args.reward).resolve()}",
               "reward.custom_reward_function.name=compute_score"]
    if args.tiny:  # the CPU platform of examples/tiny/grpo.sh
        ov += cpu_platform_overrides(gpus)
    else:
        ov += attention_overrides(args.attention)
    if args.enforce_eager and not args.tiny:
        ov.append("actor_rollout_ref.rollout.enforce_eager=True")
    return ov + list(args.extra)



def attention_overrides(attention: str) -> list[str]:
    """The actor's attention: ``flash`` (verl's default, needs flash-attn), ``varlen`` (packed rows on PyTorch's
    FlashAttention-2), ``sdpa`` (padded batches); ``auto``: flash where flash-attn is installed, else varlen."""
    if attention == "auto":
        attention = "flash" if _has_flash_attn() else "varlen"
    if attention == "flash":
        if not _has_flash_attn():
            raise StepBenchError("--attention flash: the flash-attn package is not installed (use varlen or sdpa)")
        return []
    return varlen_overrides() if attention == "varlen" else sdpa_overrides()


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------


class GpuMemorySampler:
    """Peak ``memory.used`` (MiB) per GPU index from ``nvidia-smi``, sampled every ``period`` seconds."""

    def __init__(self, indices: list[int], period: float = 0.5) -> None:
        self.indices, self.period = indices, period
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                return  # no nvidia-smi (CPU): nothing to sample
            for line in out.strip().splitlines():
                idx, used = (int(float(x)) for x in line.split(","))
                if idx in self.indices:
                    self.peak[idx] = max(self.peak.get(idx, 0.0), float(used))
            self._stop.wait(self.period)

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)



def cpu_share(index: int, count: int, cpus: list[int] | None = None) -> list[int]:
    """Run ``index`` of ``count`` concurrent runs: its contiguous share of the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if not 0 <= index < count or len(cpus) < count:
        raise StepBenchError(f"--cpu-split: {count} runs cannot share {len(cpus)} CPUs (run {index})")
    per = len(cpus) // count
    return cpus[index * per:(index + 1) * per]


def run_one(args: argparse.Namespace, variant: str, gpus: int, gpu_ids: list[int], inputs: tuple[Path, Path, Path],
            work: Path, cpus: list[int] | None = None) -> dict:
    """Launch one ``main_ppo`` run, wait (bounded), and summarize it. ``cpus``: the run and every process it
    starts (Ray, vLLM, the actor) are pinned to them, and torch's thread pools sized to them."""
    name = f"{variant}-{gpus}gpu"
    run_dir = work / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics, log = run_dir / "metrics.jsonl", run_dir / "main_ppo.log"
    metrics.unlink(missing_ok=True)
    stats_dir = run_dir / "decode-steps"
    shutil.rmtree(stats_dir, ignore_errors=True)
    model, train, val = inputs
    ov = main_ppo_overrides(args, variant, gpus, model, train, val)
    env = dict(os.environ)
    env.update({"VERL_FILE_LOGGER_PATH": str(metrics), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", decode_stats.ENV: str(stats_dir),
                # Ray's unix socket paths must stay under 107 bytes: a short folder per run
                "RAY_TMPDIR": f"/tmp/rq-{os.getpid()}-{name[:12]}"})
    if args.tiny:
        env.update({"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "VLLM_CPU_KVCACHE_SPACE": "1"})
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_ids)
    if cpus:
        env["OMP_NUM_THREADS"] = str(len(cpus))
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *ov]
    print(f"[grpo_step] {name}: GPUs {gpu_ids}{f', CPUs {cpus[0]}-{cpus[-1]}' if cpus else ''} -> {log}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh, GpuMemorySampler(gpu_ids) as mem:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # inherited by everything it starts
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=pin)
        try:
            rc: int | str = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:  # main_ppo leaves Ray workers and vLLM engines behind, some outside its session
            kill_process_trees([proc], grace_s=3.0)
    wall = time.perf_counter() - t0
    steps = read_metrics(metrics)
    row = {"variant": variant, "qerl": VARIANTS[variant], "gpus": gpus, "gpu_ids": gpu_ids, "cpus": cpus, "rc": rc,
           "wall_s": wall, "steps_logged": len(steps), "gpu_peak_used_mib": {str(k): v for k, v in mem.peak.items()},
           "overrides": ov, "log": str(log)}
    if mem.peak:
        row["gpu_peak_used_gb_max"] = max(mem.peak.values()) / 1024
    log_text = log.read_text(errors="replace")
    held = base_bytes_held(log_text)
    if held:
        row["actor_base_gb_per_rank"] = max(held) / 1e9
    row.update(kv_cache_report(log_text))
    if not row["kv_cache_tokens"]:  # vLLM's log did not reach main_ppo's: the engines' own record
        engines = decode_stats.engine_kv(decode_stats.read_records(stats_dir))
        if engines:
            row.update(kv_cache_tokens=[e["kv_cache_tokens"] for e in engines],
                       max_concurrency=[round(e["max_concurrency"], 2) for e in engines],
                       max_concurrency_len=[e["max_model_len"] for e in engines],
                       kv_cache_source="stat logger: num_gpu_blocks x block_size")
    row.update(fast_path_report(decode_stats.read_fast_path_records(stats_dir)))
    if steps:
        row.update(summarize_run(steps, gpus))
    hist = decode_histogram(stats_dir, len(steps))
    if hist:
        row["decode_batches"] = hist
    if rc != 0 or not steps:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        row["error"] = f"rc={rc}, {len(steps)} steps logged"
        print(f"[grpo_step] {name} FAILED ({row['error']}, {wall:.0f} s); log tail:\n" + "\n".join(tail), flush=True)
    else:
        print(f"[grpo_step] {name}: {len(steps)} steps, step {row['step_s']:.2f} s (gen {row['gen_s']:.2f}, "
              f"old_log_prob {row['old_log_prob_s'] or 0:.2f}, update {row['update_actor_s']:.2f}), "
              f"{row['tokens_per_s'] or 0:.0f} tok/s, wall {wall:.0f} s; vLLM KV cache {row['kv_cache_tokens']} "
              f"tokens, max concurrency {row['max_concurrency']}", flush=True)
    return row




# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def _lr_arg(value: str) -> float | str:
    if value == "paper":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a number or 'paper'") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = GENERIC
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a workload: 'reasoning' = 32 prompts x 8 responses of exactly 2048 tokens over Qwen2.5's "
                   "vocabulary, the paper's LoRA rank and learning rates, --steps 3 (module docstring); explicit "
                   "flags override its values")
    p.add_argument("--model", default="7b", help="7b | 32b | 72b (random weights) | a local HF checkpoint folder")
    p.add_argument("--variants", default="qerl,lora", help=f"comma list of {','.join(VARIANTS)} (first = numerator)")
    p.add_argument("--compare", choices=("variants", "gpus"), default="variants")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of the multi-GPU run (--compare gpus)")
    p.add_argument("--concurrent", action="store_true",
                   help="run at once: the variants one GPU each; with --compare gpus the 1-GPU run shares GPU 0 "
                        "with the N-GPU run (learning parity only: no time target)")
    p.add_argument("--cpu-split", action="store_true",
                   help="with --concurrent: pin each run (and all it starts) to its own equal share of the CPUs, "
                        "so that host-bound parts of one run's decode loop do not compete with the other's")
    p.add_argument("--steps", type=int, default=None,
                   help=f"GRPO steps per run (the first is dropped from means; default {g['steps']})")
    p.add_argument("--batch", type=int, default=None, help=f"prompts per step (data.train_batch_size; {g['batch']})")
    p.add_argument("--n", type=int, default=None, help=f"responses per prompt ({g['n']})")
    p.add_argument("--prompt-length", type=int, default=None, help=f"({g['prompt_length']})")
    p.add_argument("--response-length", type=int, default=None, help=f"({g['response_length']})")
    p.add_argument("--ignore-eos", action="store_true", default=None,
                   help="every response runs --response-length tokens (vLLM ignore_eos)")
    p.add_argument("--micro-batch", type=int, default=None, help=f"({g['micro_batch']})")
    p.add_argument("--lora-rank", type=int, default=None, help=f"({g['lora_rank']})")
    p.add_argument("--lr", type=_lr_arg, default=None,
                   help=f"actor learning rate, or 'paper' for each variant's of the QeRL paper {PAPER_LR} "
                   f"({g['lr']})")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size (1 = one replica per GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help=f"({g['gpu_memory_utilization']})")
    p.add_argument("--gradient-checkpointing", default="True")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in vLLM (faster start)")
    p.add_argument("--attention", choices=("auto", "flash", "varlen", "sdpa"), default="auto",
                   help="the actor's attention: flash-attn (verl's default), varlen (packed rows on PyTorch's "
                        "FlashAttention-2, no flash-attn needed), sdpa (padded batches); auto: flash if installed, "
                        "else varlen")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder for the random 7b/32b/72b checkpoints (default: a tiny 512-id BPE, "
                   f"with which verl lets the model sample only 512 ids; --preset reasoning: {DEFAULT_TOKENIZER}, "
                   f"written by `{TOKENIZER_COMMAND}`)")
    p.add_argument("--data", default=None, help="folder with train.parquet/test.parquet (default: generated "
                   "GSM8K-format problems, verl_qerl.testing.data)")
    p.add_argument("--reward", default=None, help="a reward .py with compute_score (default: verl's GSM8K scorer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay-poll-s", type=float, default=0.1,
                   help="qerl.replay_poll_s: seconds between the trainer's checks for finished rollouts (2.0 = "
                        "verl's own polling, as in results written before this option)")
    p.add_argument("--timeout", type=float, default=None, help=f"seconds per run ({g['timeout']:.0f})")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="add targets: each run logs >= 1 step with its GPUs' nvidia-smi peak <= this (32B: 80)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, verl-qerl's CPU platform")
    p.add_argument("--work-dir", default="/tmp/qerl-grpo-step")
    p.add_argument("--ckpt-dir", default="/tmp/qerl-rollout",
                   help="random 7b/32b/72b checkpoints, <dir>/<model>/<fmt> (shared with benchmarks/rollout.py)")
    p.add_argument("--out", default=None, help="results folder (default $OUT or benchmarks/results)")
    p.add_argument("--tag", default=None, help="results file name suffix (default: model and compare mode)")
    p.add_argument("--baseline", action="append", default=[], metavar="FILE",
                   help="an earlier results JSON of this script (same settings and device): its rows are reused, "
                        "not run again (repeatable)")
    p.add_argument("--merge-only", action="store_true",
                   help="run nothing: write the comparison from the --baseline files alone (every planned run must "
                        "be in them; device and versions are theirs, so this works on a machine without a GPU)")
    p.add_argument("extra", nargs="*", help="more hydra overrides for every run")
    args = p.parse_args(argv)
    if args.merge_only and not args.baseline:
        p.error("--merge-only needs the --baseline files to merge")
    if args.cpu_split and not args.concurrent:
        p.error("--cpu-split splits the CPUs between concurrent runs: it needs --concurrent")
    preset = PRESETS.get(args.preset, {})
    for key, default in GENERIC.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    repeated = sorted({v for v in variants if variants.count(v) > 1})
    if repeated:
        p.error(f"--variants {args.variants}: {repeated} named more than once (each variant is one run)")
    for key in ("steps", "batch", "n", "prompt_length", "response_length", "micro_batch", "lora_rank", "tp"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} {getattr(args, key)}: must be a positive integer")
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout}: must be a positive number of seconds")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    if args.compare == "gpus" and args.gpus < 2:
        p.error(f"--compare gpus --gpus {args.gpus}: the multi-GPU run needs --gpus >= 2 (it is compared with a "
                "1-GPU run)")
    if args.batch * args.n % args.micro_batch:
        p.error(f"--batch {args.batch} x --n {args.n} must be a multiple of --micro-batch {args.micro_batch}")
    if not 0 < args.replay_poll_s <= 10:
        p.error(f"--replay-poll-s {args.replay_poll_s}: must be seconds in (0, 10]")
    if args.tokenizer and (args.tiny or args.model not in SHAPES):
        p.error(f"--tokenizer is for the random {'/'.join(SHAPES)} checkpoints; --tiny and a local --model "
                "folder bring their own tokenizer")
    args.tokenizer_id = None  # what --baseline compares: the tokenizer's content, not its path
    if args.tokenizer:
        try:
            args.tokenizer_id = tokenizer_identity(Path(args.tokenizer))
        except BenchError as exc:
            p.error(f"--tokenizer: {exc}")
    return args


def plan_runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (variant, GPUs) runs of the comparison, in the order that makes the first the numerator."""
    variants = args.variants.split(",")
    return [(variants[0], 1), (variants[0], args.gpus)] if args.compare == "gpus" else [(v, 1) for v in variants]


def execute(args: argparse.Namespace, todo: list[tuple[str, int]], inputs: tuple[Path, Path, Path] | None,
            work: Path) -> dict[tuple[str, int], dict]:
    """Run the runs not taken from a baseline: one after another on GPU 0 (N-GPU runs on 0..N-1), or with
    ``--concurrent`` at once, each 1-GPU run on its own GPU."""
    concurrent = args.concurrent
    plan = [(v, g, list(range(g)) if g > 1 else [i if concurrent else 0]) for i, (v, g) in enumerate(todo)]
    if concurrent and plan:
        from concurrent.futures import ThreadPoolExecutor

        shares = [cpu_share(i, len(plan)) if args.cpu_split else None for i in range(len(plan))]
        with ThreadPoolExecutor(len(plan)) as pool:
            ran = list(pool.map(lambda job, cpus: run_one(args, *job, inputs, work, cpus), plan, shares))
    else:
        ran = [run_one(args, *job, inputs, work) for job in plan]
    return dict(zip(todo, ran, strict=True))




def build_result(args: argparse.Namespace, argv: list[str] | None, device: str, rows: list[dict],
                 concurrent_gpus: bool, versions_of_rows: dict | None = None) -> dict:
    """The results JSON: settings, rows, ratios and targets (a preset's per-phase targets in mode 'variants')."""
    ratios, targets = compare(rows, args.compare, concurrent=concurrent_gpus,
                              phase_targets=PRESET_TARGETS.get(args.preset))
    if args.memory_limit_gb:
        targets += memory_targets(rows, args.memory_limit_gb)
    return {
        "benchmark": "grpo_step", "compare": args.compare, "device": device,
        "versions": versions() if versions_of_rows is None else versions_of_rows,
        "command": "python " + " ".join([str(Path(sys.argv[0]))] + [shlex.quote(a) for a in (argv or sys.argv[1:])]),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "model": "tiny" if args.tiny else args.model, "settings": {k: v for k, v in vars(args).items() if k != "extra"},
        "lr_per_variant": {v: lr_for(args, v) for v in args.variants.split(",")},
        "rows": rows, "ratios": ratios, "targets": targets, "baselines": list(args.baseline),
    }


def write_result(args: argparse.Namespace, result: dict, out: Path) -> Path:
    """``grpo_step-<tag>-<device>.json`` in ``out``."""
    model_tag = "tiny" if args.tiny else (args.model if args.model in SHAPES else Path(args.model).name)
    tag = args.tag or f"{model_tag}-{args.preset + '-' if args.preset else ''}{args.compare}"
    dev = result["device"].lower().replace(" ", "-").split("(")[0].strip("-")
    path = out / f"grpo_step-{tag}-{dev}.json"
    return write_json(path, result, indent=2, default=str)  # whole or not at all: never a truncated results file




def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir)
    out = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    wanted = plan_runs(args)
    try:
        origin_versions = None
        if args.merge_only:
            device, origin_versions = baseline_origin(args.baseline)
        else:
            device = "cpu (tiny smoke test)" if args.tiny else device_name()
        reused = load_baselines(args.baseline, args, device)
        todo = [job for job in wanted if job not in reused]
        if args.merge_only and todo:
            missing = ", ".join(f"{v} on {g} GPU(s)" for v, g in todo)
            raise StepBenchError(f"--merge-only: no --baseline row for {missing}")
        inputs = build_inputs(args, work) if todo else None
    except StepBenchError as exc:
        print(f"[grpo_step] error: {exc}", file=sys.stderr)
        return 2
    for v, g in wanted:
        if (v, g) in reused:
            print(f"[grpo_step] {v}-{g}gpu: from baseline {reused[(v, g)]['from_baseline']}", flush=True)
    if inputs:
        print(f"[grpo_step] inputs ready in {time.perf_counter() - t0:.0f} s: model {inputs[0]}", flush=True)
    check = machine_check.measure_in_subprocess() if todo else None
    if check is not None:
        print(f"[grpo_step] machine check: {json.dumps(check)}", flush=True)
    done = execute(args, todo, inputs, work)
    for row in done.values():
        row["machine_check"] = check
    rows = [reused[job] if job in reused else done[job] for job in wanted]  # --variants order: first = numerator
    result = build_result(args, argv, device, rows,
                          concurrent_gpus=args.compare == "gpus" and args.concurrent and len(todo) > 1,
                          versions_of_rows=origin_versions)
    if args.baseline and len(rows) >= 2:
        # rows from another call may come from another machine: say when the two machines' checks differ
        result["machine_mismatch"] = machine_check.mismatches(rows[0].get("machine_check"),
                                                              rows[1].get("machine_check"))
        for line in result["machine_mismatch"]:
            print(f"[grpo_step] WARNING machine mismatch between the compared rows: {line}", flush=True)
    path = write_result(args, result, out)
    report(result)
    print(f"[grpo_step] wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
