"""vLLM ``qerl_nvfp4`` tensor parallelism: TP=2 vs TP=1 greedy tokens, logprobs and AQN, LoRA r32 active.

Issue 9's scale-out check. A random Qwen2.5-7B-shaped model is made here (no downloads) as a BF16 checkpoint
(quantized at load by ``qerl_nvfp4``) and as an NVFP4 checkpoint of it; for each checkpoint kind an engine at
tensor_parallel_size=1 and one at 2 (each in its own subprocess) run the same prompts with the same random
rank-32 peft adapter active::

    source /tmp/site/qerl_env.sh                     # on the 2-GPU machine (benchmarks/GPU.md)
    PYTHONPATH=. python3 benchmarks/tp_parity.py > $OUT/log 2>&1; rc=$?; tail -c 8000 $OUT/log; exit $rc
    python benchmarks/tp_parity.py --tiny            # CPU smoke test: tiny model, vLLM CPU multiproc, gloo

Checkpoints (in ``--work-dir``, reused when complete) come from benchmarks/rollout.py's writers: the BF16 one
generated layer by layer on GPU 0; the NVFP4 one by default written directly on GPU 1 at the same time (each
random tensor quantized as generated, fused q/k/v and gate/up sharing a global scale, the same per-tensor
seeds: the same bits as ``qerl-quantize`` of the BF16 checkpoint, tests/test_rollout_bench.py), or with
``--nvfp4-from quantize`` by ``quantize_checkpoint`` of the BF16 folder (CPU, slower).

Per engine: ``qerl_quant_summary`` (backend, layout, per-layer global scales and shard shapes on every rank);
greedy generation (``--prompts`` x ``--prompt-tokens`` random token ids, ``--new-tokens`` greedy tokens,
top-2 logprobs); then *teacher forcing*: ``prompt_logprobs=2`` on prompt + TP=1's greedy output, so TP=2 scores
exactly TP=1's tokens and a near-tie that flips one greedy token does not derail the comparison; then AQN
through the worker extension (``qerl_aqn_setup/apply/restore`` over ``collective_rpc``, same seed, step and
sigma on both TP sizes), the teacher-forced scoring again under noise, and the restore.

Comparison, per checkpoint kind (completion positions; prompt positions reported too):

* ``tp2_vs_tp1_logprob_max_abs_diff``: max |logprob_TP2 - logprob_TP1| of the shared tokens, teacher-forced
  (target <= 2e-2, the issue's); the same under AQN noise;
* ``greedy_token_match_fraction``: free-running greedy tokens identical position by position, and the first
  divergence per prompt. Random weights give near-uniform distributions over 152k tokens whose top two
  logprobs can be closer than any tolerance, so a fixed fraction is no criterion. The target is derived from
  TP=1's own teacher-forced margins: a step whose margin (its token's logprob minus the best other's) is at
  least 2 x 2e-2 cannot flip under perturbations within the logprob tolerance, so every token before a
  prompt's first *near-tie* (margin < 2 x 2e-2) must match; the target is the fraction of tokens in those
  prefixes;
* ``argmax_flips_outside_near_ties``: teacher-forced positions where TP=2's argmax differs from TP=1's token
  although TP=1's margin was >= 2 x 2e-2 (target 0);
* ``layers_tp2_consistent_with_tp1``: every quantized layer on both TP=2 ranks has TP=1's global scale(s)
  (the TP-wide amax at quantize-at-load) and half of TP=1's N (q/k/v, gate/up) or K (o, down);
* ``aqn_checksum_equal_ranks``: the AQN checksums of the replicated RMSNorm weights (clean, noisy, restored)
  are identical on both TP=2 ranks and equal to TP=1's, for every checkpoint kind.

Noise floor, for reading the logprob numbers: TP=1's decode-time logprobs vs its own teacher-forced ones
(same weights, same tokens, other kernels/batch shapes). Output: ``tp_parity-<device>.json`` in ``--out``
(default ``$OUT`` or ``.``) with ``device``, ``versions``, ``command``, ``date``, ``rows`` (raw per-engine
data), ``comparisons`` and ``targets`` (``{"name", "measured", "op", "target"}``). The JSON is rewritten
after every engine. The comparisons and targets are benchmarks/tp_parity_compare.py's; this file builds the
checkpoints, runs the engines and reports.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from results_format import target_status  # benchmarks/: this script's own folder
from tp_parity_compare import (
    CONTROL,
    KINDS,
    LOGPROB_TOL,
    NEAR_TIE,
    TOP_K,
    compare,
    label,
    make_targets,
    token_records,
)

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # verl_qerl without an install, as the children get it through PYTHONPATH

from verl_qerl.testing.procs import kill_process_trees  # noqa: E402

TAG = "[tp_parity]"


def _load_rollout():
    """benchmarks/rollout.py as a module (its checkpoint writers, shapes, versions, engine shutdown)."""
    spec = importlib.util.spec_from_file_location("qerl_bench_rollout", HERE.parent / "rollout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rb = _load_rollout()

EXTENSION = "verl_qerl.vllm.worker_extension.QeRLWorkerExtension"
#: Kept set in every child on a GPU machine: NVLink multicast off (it can take shared GPUs out of service).
SAFE_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class TPError(RuntimeError):
    """A setup problem the user can fix; printed without a traceback."""


def log(msg: str) -> None:
    print(f"{TAG} {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# Child processes: checkpoint building and one engine
# ------------------------------------------------------------------------------------------------


def build(job: dict) -> dict:
    """Write one checkpoint (or the LoRA adapter) as ``job['what']`` says; returns its path."""
    shape, folder, what = job["shape"], Path(job["folder"]), job["what"]
    t0 = time.perf_counter()
    if what == "bf16":
        rb.write_random_checkpoint(folder, shape, "bf16", seed=job["seed"], device=job.get("device"))
    elif what == "nvfp4-direct":
        rb.write_random_checkpoint(folder, shape, "nvfp4", seed=job["seed"], device=job.get("device"))
    elif what == "nvfp4-quantize":
        rb.quantize_with_progress(Path(job["src"]), folder)
    elif what == "lora":
        rb.write_lora_adapter(folder, rb.qwen2_config(shape, 0, 0), rank=job["rank"])
    else:
        raise TPError(f"unknown build {what!r}")
    log(f"built {what} in {folder} ({time.perf_counter() - t0:.0f} s)")
    return {"folder": str(folder)}


def _summary_of(ranks: list[dict]) -> list[dict]:
    """Keep what the comparison needs from ``qerl_quant_summary`` (per rank)."""
    out = []
    for s in ranks:
        keep = ("method", "global_scale", "shape", "backend", "layout")
        layers = {n: {k: v[k] for k in keep if k in v} for n, v in s["layers"].items()}
        out.append({"pid": s["pid"], "plugin_registered_here": s["plugin_registered_here"],
                    "nvfp4_digest": s["nvfp4_digest"], "vllm_version": s["vllm_version"], "layers": layers,
                    "backends": sorted({v["backend"] for v in s["layers"].values() if "backend" in v}),
                    "layouts": sorted({v["layout"] for v in s["layers"].values() if "layout" in v})})
    return out


def run_engine(job: dict) -> dict:
    """One engine (its TP size): summary, greedy, teacher-forced scoring, AQN; returns the raw row."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kind, tp = job["kind"], job["tp"]
    name = f"{label(kind)} TP={tp}"
    t0 = time.perf_counter()
    llm = LLM(**job["llm"])
    startup_s = time.perf_counter() - t0
    log(f"{name}: engine up in {startup_s:.0f} s")
    lora = LoRARequest("tp-parity-r32", 1, job["lora"]) if job.get("lora") else None
    prompts = job["prompts"]
    timings = {"startup_s": startup_s}

    def score(seqs: list[list[int]]) -> list[list[list[float]]]:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_K, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, lora_request=lora, use_tqdm=False)
        return [token_records(seq[1:], list(o.prompt_logprobs)[1:]) for seq, o in zip(seqs, outs)]

    try:
        t = time.perf_counter()
        summary = _summary_of(llm.collective_rpc("qerl_quant_summary"))
        timings["summary_s"] = time.perf_counter() - t
        t = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], logprobs=TOP_K, ignore_eos=True,
                                detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
        greedy = []
        for o in outs:
            comp = o.outputs[0]
            greedy.append({"tokens": list(comp.token_ids),
                           "logprobs": [float(step[tok].logprob) for tok, step in zip(comp.token_ids, comp.logprobs)]})
        timings["greedy_s"] = time.perf_counter() - t
        seqs = job.get("score_seqs") or [list(p) + g["tokens"] for p, g in zip(prompts, greedy)]
        t = time.perf_counter()
        tf = score(seqs)
        timings["score_s"] = time.perf_counter() - t
        aqn_kw = job["aqn"]
        setup = llm.collective_rpc("qerl_aqn_setup", kwargs={"seed": aqn_kw["seed"]})
        apply = llm.collective_rpc("qerl_aqn_apply", kwargs=aqn_kw)
        llm.reset_prefix_cache()
        tf_noisy = score(seqs)
        restore = llm.collective_rpc("qerl_aqn_restore")
        llm.reset_prefix_cache()
        log(f"{name}: done ({', '.join(f'{k} {v:.1f}' for k, v in timings.items())})")
    finally:
        rb._shutdown(llm)
    return {"kind": kind, "tp": tp, "llm_kwargs": job["llm"], "timings": timings, "summary": summary,
            "prompt_lens": [len(p) for p in prompts], "greedy": greedy, "seqs": seqs, "tf": tf, "tf_noisy": tf_noisy,
            "aqn": {"params": aqn_kw, "setup": setup, "apply": apply, "restore": restore}}


def _child_main(job_file: str, out_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    try:
        res = build(job) if job["kind_of_job"] == "build" else run_engine(job)
    except (TPError, rb.BenchError) as exc:
        print(f"error: {exc}", flush=True)
        return 2
    Path(out_file).write_text(json.dumps(res))
    return 0


# ------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------


class Child:
    """One subprocess running ``job`` (this file with ``--child``); output to its own log."""

    def __init__(self, name: str, job: dict, logs: Path, env: dict[str, str]):
        logs.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "-" for c in name)
        self.name = name
        self.job_file, self.out_file, self.log = (logs / f"{slug}.job.json", logs / f"{slug}.out.json",
                                                  logs / f"{slug}.log")
        self.job_file.write_text(json.dumps(job))
        self.out_file.unlink(missing_ok=True)
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        full_env.update(env)
        self.fh = open(self.log, "w")  # noqa: SIM115 - closed in finish()
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--child", str(self.job_file), str(self.out_file)],
                                     env=full_env, stdout=self.fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.seen = 0
        self.rc = None
        log(f"{name}: started (pid {self.proc.pid}, log {self.log})")

    def echo(self) -> None:
        """Print the child's new ``[tp_parity]`` lines (progress)."""
        lines = self.log.read_text(errors="replace").splitlines()
        for line in lines[self.seen:]:
            if line.startswith(TAG):
                print(line, flush=True)
        self.seen = len(lines)

    def kill(self) -> None:
        kill_process_trees([self.proc], grace_s=0)  # with the engine processes that left its session
        self.rc = "timeout"

    def finish(self) -> dict:
        self.fh.close()
        self.echo()
        wall = time.perf_counter() - self.t0
        if self.rc == 0 and self.out_file.is_file():
            res = json.loads(self.out_file.read_text())
            res["wall_s"] = wall
            log(f"{self.name}: finished in {wall:.0f} s")
            return res
        text = self.log.read_text(errors="replace")
        tail = "\n".join(text.splitlines()[-40:])
        log(f"{self.name} FAILED (rc={self.rc}, {wall:.0f} s); log tail:\n{tail}")
        errs = [ln.strip() for ln in text.splitlines() if "Error" in ln or "error:" in ln]
        return {"error": f"rc={self.rc}: " + (errs[-1] if errs else "see the log"), "log": str(self.log),
                "wall_s": wall}


def run_children(children: list[Child], timeout: float, heartbeat: float = 30.0) -> list[dict]:
    """Wait for all ``children`` (each limited to ``timeout`` s from its start), echoing progress."""
    last = time.perf_counter()
    pending = list(children)
    while pending:
        time.sleep(0.5)
        for ch in list(pending):
            ch.echo()
            rc = ch.proc.poll()
            if rc is not None:
                ch.rc = rc
                pending.remove(ch)
            elif time.perf_counter() - ch.t0 > timeout:
                log(f"{ch.name}: over the {timeout:.0f} s limit; killing it")
                ch.kill()
                pending.remove(ch)
        if pending and time.perf_counter() - last > heartbeat:
            last = time.perf_counter()
            log("running: " + ", ".join(f"{c.name} ({time.perf_counter() - c.t0:.0f} s)" for c in pending))
    return [ch.finish() for ch in children]


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU ")) if out.returncode == 0 else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, vLLM CPU workers (gloo)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="comma list of bf16 (quantized at load), nvfp4 (checkpoint), plain (stock vLLM BF16 control)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per prompt (default 32; tiny 8)")
    p.add_argument("--dtype", default=None, help="engine dtype (default bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--no-lora", action="store_true", help="without the rank-32 adapter")
    p.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (default: enforce_eager)")
    p.add_argument("--parallel-tp1", choices=("auto", "on", "off"), default="auto",
                   help="run the TP=1 engines of both kinds at once on GPU 0 and GPU 1 (auto: with >= 2 GPUs)")
    p.add_argument("--nvfp4-from", choices=("direct", "quantize"), default="direct",
                   help="direct: write the NVFP4 checkpoint from the same seeds on GPU 1 while the BF16 one is "
                        "written (same bits); quantize: quantize_checkpoint of the BF16 folder (CPU)")
    p.add_argument("--disable-custom-all-reduce", action="store_true", help="passed to vLLM (NCCL all-reduce only)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--aqn-seed", type=int, default=1234)
    p.add_argument("--aqn-step", type=int, default=3)
    p.add_argument("--aqn-sigma", type=float, default=1e-2)
    p.add_argument("--work-dir", default=None, help="checkpoints, adapter, logs (default /tmp/qerl-tp-parity)")
    p.add_argument("--out", default=None, help="results folder (default $OUT or .)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None, help="seconds per subprocess (default 300; tiny 600)")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad or not args.kinds:
        p.error(f"unknown checkpoint kind(s) {bad}; choose from {list(KINDS)}")
    args.prompt_tokens = args.prompt_tokens or (16 if args.tiny else 64)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 32)
    args.timeout = args.timeout or (600 if args.tiny else 300)
    if args.prompts < 1 or args.prompt_tokens < 2 or args.new_tokens < 1:
        p.error("--prompts >= 1, --prompt-tokens >= 2 and --new-tokens >= 1 required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    n_gpu = gpu_count()
    on_gpu = n_gpu > 0
    if n_gpu == 1:
        raise TPError("tensor_parallel_size=2 needs 2 GPUs; nvidia-smi lists 1 (use a 2-GPU machine; --tiny runs "
                      "on CPU-only machines)")
    if args.tiny:
        from verl_qerl.testing.tiny import TINY_SHAPE

        shape, model = {**TINY_SHAPE, "vocab_size": 512}, "tiny"
    else:
        shape, model = rb.SHAPES["7b"], "7b"
        if n_gpu < 2:
            raise TPError(f"tensor_parallel_size=2 needs 2 GPUs; found {n_gpu} (use --tiny for the CPU smoke test)")
    dev = rb.device_name() if on_gpu else "cpu"
    if on_gpu and not args.tiny:
        dev = f"{n_gpu}x {dev}"
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    if on_gpu and dtype not in ("bfloat16", "float16") and not args.no_lora:
        # seen on an H200: the engine dies in its first step at lora_shrink's dtype assert
        raise TPError(f"--dtype {dtype} with the LoRA adapter on GPU: vLLM 0.24's LoRA kernels take float16/"
                      "bfloat16 only; add --no-lora")
    parallel_tp1 = on_gpu and n_gpu >= 2 and args.parallel_tp1 != "off" and len(args.kinds) >= 2
    work = Path(args.work_dir or "/tmp/qerl-tp-parity") / model
    logs = work / "logs"
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in dev.lower()).strip("-") or "cpu"
    out_file = out_dir / f"tp_parity-{slug}{'-tiny' if args.tiny else ''}.json"

    base_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if on_gpu:
        base_env.update(SAFE_GPU_ENV)
        base_env.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", os.environ.get("VLLM_ALLREDUCE_USE_SYMM_MEM", "0"))
    else:
        base_env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")

    def env_for(gpus: str | None, tp: int = 1) -> dict:
        env = dict(base_env)
        if on_gpu and gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        if not on_gpu and tp > 1:  # one core per CPU worker (the CPU build otherwise reserves one for the engine)
            bind = "|".join(map(str, range(tp)))
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind)
        return env

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    aqn = {"seed": args.aqn_seed, "step": args.aqn_step, "sigma": args.aqn_sigma}
    result = {
        "benchmark": "tp_parity", "device": dev, "versions": rb.versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "workload": {"model": model, "shape": shape, "kinds": [label(k) for k in args.kinds], "tp_sizes": [1, 2],
                     "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "dtype": dtype, "lora_rank": None if args.no_lora else rb.LORA_RANK,
                     "enforce_eager": not args.cuda_graphs, "aqn": aqn, "logprob_tolerance": LOGPROB_TOL,
                     "near_tie_threshold": NEAR_TIE, "nvfp4_from": args.nvfp4_from,
                     "parallel_tp1": parallel_tp1, "seed": args.seed},
        "env": {k: base_env.get(k, os.environ.get(k)) for k in (
            "QERL_NVFP4_BACKEND", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ATTENTION_BACKEND", "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_ALLREDUCE_USE_SYMM_MEM", *SAFE_GPU_ENV)},
        "build": {}, "rows": [], "comparisons": {}, "errors": [], "targets": [],
    }
    missing: dict[str, str] = {}

    def save() -> None:
        result["targets"] = make_targets(result["comparisons"], args.kinds, missing)
        result["total_s"] = time.perf_counter() - t_start
        out_file.write_text(json.dumps(result, indent=1))

    # -- checkpoints ------------------------------------------------------------------------------
    folders = {"bf16": work / "bf16", "plain": work / "bf16", "nvfp4": work / "nvfp4",
               "lora": work / f"lora-r{rb.LORA_RANK}"}
    need_bf16 = ("bf16" in args.kinds or CONTROL in args.kinds
                 or ("nvfp4" in args.kinds and args.nvfp4_from == "quantize"))
    common = {"kind_of_job": "build", "shape": shape, "seed": args.seed}
    first = []
    if need_bf16:
        first.append(Child("build bf16", {**common, "what": "bf16", "folder": str(folders["bf16"])}, logs,
                           env_for("0")))
    if "nvfp4" in args.kinds and args.nvfp4_from == "direct":
        first.append(Child("build nvfp4", {**common, "what": "nvfp4-direct", "folder": str(folders["nvfp4"])}, logs,
                           env_for("1" if n_gpu >= 2 else "0")))
    if not args.no_lora:
        first.append(Child("build lora", {**common, "what": "lora", "folder": str(folders["lora"]),
                                          "rank": rb.LORA_RANK}, logs, env_for(None)))
    built = dict(zip([c.name for c in first], run_children(first, args.timeout)))
    if "nvfp4" in args.kinds and args.nvfp4_from == "quantize" and "error" not in built.get("build bf16", {}):
        built["build nvfp4"] = run_children([Child("build nvfp4", {
            **common, "what": "nvfp4-quantize", "src": str(folders["bf16"]), "folder": str(folders["nvfp4"])},
            logs, env_for(None))], args.timeout)[0]
    result["build"] = built
    for name, res in built.items():
        if "error" in res:
            result["errors"].append({"stage": name, **res})
    if any("error" in res for res in built.values()):
        save()
        log(f"checkpoint building failed; wrote {out_file}")
        return 1
    log(f"checkpoints ready in {work} ({time.perf_counter() - t_start:.0f} s so far)")

    # -- engines ----------------------------------------------------------------------------------
    def engine_job(kind: str, tp: int, score_seqs: list | None) -> dict:
        llm = dict(model=str(folders[kind]), quantization=None if kind == CONTROL else "qerl_nvfp4", dtype=dtype,
                   tensor_parallel_size=tp,
                   seed=args.seed, skip_tokenizer_init=True, enforce_eager=not args.cuda_graphs or not on_gpu,
                   max_model_len=args.prompt_tokens + args.new_tokens + 16, max_num_seqs=max(args.prompts, 8),
                   enable_prefix_caching=False, worker_extension_cls=EXTENSION)
        if on_gpu:
            llm["gpu_memory_utilization"] = args.gpu_memory_utilization
            if args.disable_custom_all_reduce:
                llm["disable_custom_all_reduce"] = True
        if not args.no_lora:
            llm.update(enable_lora=True, max_lora_rank=rb.LORA_RANK, max_loras=1)
        return {"kind_of_job": "engine", "kind": kind, "tp": tp, "llm": llm, "prompts": prompts,
                "new_tokens": args.new_tokens, "score_seqs": score_seqs, "aqn": aqn,
                "lora": None if args.no_lora else str(folders["lora"])}

    rows: dict[tuple[str, int], dict] = {}

    def record(kind: str, tp: int, res: dict) -> None:
        if "error" in res:
            result["errors"].append({"stage": f"{label(kind)} TP={tp}", **res})
            missing[kind] = f"{label(kind)} TP={tp} failed: {res['error']}"
        else:
            rows[(kind, tp)] = res
            result["rows"].append(res)
        save()

    tp1_children = []
    for i, kind in enumerate(args.kinds):
        job = engine_job(kind, 1, None)
        gpus = str(i % max(n_gpu, 1)) if parallel_tp1 else "0"
        ch = Child(f"{label(kind)} TP=1", job, logs, env_for(gpus))
        if parallel_tp1:
            tp1_children.append((kind, ch))
        else:
            record(kind, 1, run_children([ch], args.timeout)[0])
    for i in range(0, len(tp1_children), max(n_gpu, 1)):  # one TP=1 engine per GPU at a time
        group = tp1_children[i:i + max(n_gpu, 1)]
        for (kind, _), res in zip(group, run_children([c for _, c in group], args.timeout)):
            record(kind, 1, res)
    for kind in args.kinds:
        if (kind, 1) not in rows:
            log(f"{label(kind)}: no TP=1 result, so no TP=2 run")
            continue
        seqs = rows[(kind, 1)]["seqs"]
        res = run_children([Child(f"{label(kind)} TP=2", engine_job(kind, 2, seqs), logs,
                                  env_for("0,1", tp=2))], args.timeout)[0]
        record(kind, 2, res)
        if "error" not in res:
            result["comparisons"][kind] = compare(rows[(kind, 1)], res)
            save()
    if ("bf16", 1) in rows and ("nvfp4", 1) in rows:  # for the record: the two checkpoints hold the same NVFP4 bits
        a, b = rows[("bf16", 1)], rows[("nvfp4", 1)]
        result["cross_kind_tp1"] = {
            "nvfp4_digest_equal": a["summary"][0]["nvfp4_digest"] == b["summary"][0]["nvfp4_digest"],
            "greedy_tokens_equal": [g["tokens"] for g in a["greedy"]] == [g["tokens"] for g in b["greedy"]],
        }
        log(f"TP=1, bf16-ckpt quantized at load vs nvfp4-ckpt: {result['cross_kind_tp1']}")

    # -- report -----------------------------------------------------------------------------------
    save()
    print(f"\n{TAG} wrote {out_file} ({time.perf_counter() - t_start:.0f} s)")
    for err in result["errors"]:
        print(f"{TAG} ERROR {err['stage']}: {err['error']}")
    for kind, c in result["comparisons"].items():
        lp, lpa = c["logprob"], c["logprob_aqn"]
        print(f"\n{label(kind)}: TP=2 vs TP=1 ({c['greedy_tokens']} greedy tokens, LoRA "
              f"{'off' if args.no_lora else f'r{rb.LORA_RANK}'}, {dtype})")
        print(f"  teacher-forced |dlogprob| completion max {lp['completion']['max']:.3g} p99 "
              f"{lp['completion']['p99']:.3g} mean {lp['completion']['mean']:.3g}; "
              f"prompt max {lp['prompt']['max']:.3g}; "
              f"under AQN max {lpa['completion']['max']:.3g}")
        print(f"  greedy tokens identical {c['greedy_token_match_fraction']:.3f} (near-tie-free prefix "
              f"{c['near_tie_free_prefix_fraction']:.3f}); first divergence {c['first_divergence']}; argmax flips "
              f"{c['teacher_forced_argmax_flips']} ({c['argmax_flips_outside_near_ties']} outside near-ties)")
        print(f"  decode logprobs on the shared prefix: max {c['decode_logprob_diff_shared_prefix']['max']}; "
              f"noise floor (TP=1 decode vs its teacher forcing) max {c['tp1_decode_vs_teacher_forced']['max']}")
        print(f"  layers consistent {c['layers']['consistent']}/{c['layers']['layers']}; AQN checksums equal "
              f"{c['aqn']['equal']} ({c['aqn']['names']} norms; "
              f"TP=1 logprob shift under AQN max {c['aqn_logprob_shift_tp1']['max']:.3g})")
    print("\ntargets:")
    for t in result["targets"]:
        m = t["measured"]
        print(f"  {t['name']}: {'-' if m is None else f'{m:.4g}'} {t['op']} {t['target']:.4g} {target_status(t)}",
              flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    rb.child_cli(main, _child_main, (TPError, rb.BenchError))
