"""What LoRA costs per decode step: no LoRA vs vLLM's LoRA path vs the single-adapter fast path.

One variant per call (one engine start with CUDA graphs, one eager engine: a 7B start is 30-60 s, so the
variants do not fit one 280 s call); ``--merge`` adds an earlier call's JSON, and once rows of ``none`` and of a
LoRA variant are both present the issue-19 targets (decode-step ratio without / with LoRA >= 0.90) are filled.

* ``graphs``: a CUDA-graph engine (``enforce_eager=False``, what verl runs); at each batch size B,
  ``--repeats`` times: generate 1 token and ``--steps + 1`` tokens from B short random prompts; decode step
  time = (the difference) / steps; the row keeps the median and all repeats, and the median 1-token generate
  as ``prefill_ms`` (the prefill of B prompts plus one sampling step, what rollout.py times once); with
  ``--prefill-profile B`` one more 1-token generate at that B runs under torch.profiler (host and device): its wall
  time against its summed kernel time says whether the prefill is device-bound or host-bound, and the top kernels
  and CPU ops say where it goes.
* ``eager``: an eager engine, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so torch.profiler sees
  the GPU work: the GPU kernels of ``--steps`` decode steps (the profile of a 1-token generate subtracted: the
  prefill), grouped by kernel name (time and launches per decode step); and, per linear LoRA layer, the ops and
  kernels its LoRA term adds to one forward of B tokens (``qerl_lora_layer_ops``).

Variants: ``none`` (``enable_lora`` off), ``vllm`` (adapter on, ``QERL_LORA_FAST_PATH=off``), ``fast`` (adapter
on, ``QERL_LORA_FAST_PATH=auto``, the shrink as ``qerl::lora_shrink`` decides: Triton up to its token threshold),
``fast_cublas`` (the fast path with the shrink forced to cuBLAS, ``QERL_LORA_SHRINK=cublas``: the fast path as it
was before the Triton shrink), ``fast_separate`` (the fast path with the expand as its own kernel after the GEMM,
``QERL_LORA_FUSED_EXPAND=off``: the fast path as it was before ``qerl::nvfp4_gemm_lora``), ``fast_shrink_apart``
(the shrink as its own launch before ``qerl::nvfp4_gemm_lora``, ``QERL_LORA_FUSED_EXPAND=expand``: the fast path as
it was before ``qerl::nvfp4_lora_linear``); the adapter is rank 32
on q/k/v/o/gate/up/down, as in rollout.py. Every row
records ``lora_fast_path_layers`` (0 on vLLM's path; 112 at 7B on the fast path) and, on the fast path,
``lora_shrink``: the ``QERL_LORA_SHRINK`` mode, the implementation the op picks at the row's decode token count
(``triton`` / ``cublas``; ``torch`` on a CPU engine), the threshold, and on eager rows the ``_lora_shrink_kernel``
launches per decode step that the profile saw. Commands: benchmarks/NOTES.md
("LoRA per-step profile"); ``--model tiny`` runs the pipeline on the CPU (eager only, CPU ops instead of kernels).
``--max-num-seqs`` (default: the largest batch) sets vLLM's ``max_num_seqs``: vLLM captures CUDA graphs up to twice it
(at most 512 tokens), so ``--max-num-seqs 256`` profiles a 256-token B = 1 prefill inside the graphs, as verl runs the
engine; a ``--merge`` of a file measured on another workload (prompt length, ``max_num_seqs``) is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

import rollout  # noqa: E402  (the checkpoint and adapter writers, device and version helpers)
from results_format import target_status  # noqa: E402

# variant -> (QERL_LORA_FAST_PATH, QERL_LORA_SHRINK, QERL_LORA_FUSED_EXPAND); None: the variable unset
VARIANT_ENV = ("QERL_LORA_FAST_PATH", "QERL_LORA_SHRINK", "QERL_LORA_FUSED_EXPAND")
VARIANTS = {"none": (None, None, None), "vllm": ("off", None, None), "fast": ("auto", "auto", "auto"),
            "fast_cublas": ("auto", "cublas", "auto"), "fast_separate": ("auto", "auto", "off"),
            "fast_shrink_apart": ("auto", "auto", "expand")}
KEEP_TARGET = 0.90
PREFILL_TARGET = 1.3  # prefill time with LoRA / without (issue 19), the median of --repeats 1-token generates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    p.add_argument("--model", default="7b", choices=["7b", "tiny"])
    p.add_argument("--parts", default="graphs,eager", help="comma list of graphs, eager")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--profile-batches", default="1,8", help="batch sizes of the eager kernel profile")
    p.add_argument("--steps", type=int, default=128, help="decode steps per timed generate (graphs)")
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps under the profiler (eager)")
    p.add_argument("--prefill-profile", default="", help="batch sizes whose 1-token generate (the prefill) the "
                   "graphs part profiles once, host and device: wall time, kernel time, top kernels and CPU ops")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM max_num_seqs (default: the largest batch); vLLM captures CUDA graphs up to 2x it tokens "
                   "(at most 512), so e.g. 256 puts a B = 1 prefill of 256 tokens inside the graphs, as verl runs "
                   "the engine; recorded in the workload when set")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--work-dir", default="/tmp/lora-profile")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--merge", default=None, help="an earlier lora_profile JSON of this device to extend")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.profile_batches = [int(b) for b in args.profile_batches.split(",") if b]
    args.prefill_profile = [int(b) for b in args.prefill_profile.split(",") if b]
    args.parts = [x for x in args.parts.split(",") if x]
    bad = set(args.parts) - {"graphs", "eager"}
    if bad:
        p.error(f"--parts: unknown {sorted(bad)}; use graphs and/or eager")
    largest = max(args.batches + args.profile_batches)
    if args.max_num_seqs is not None and args.max_num_seqs < largest:
        p.error(f"--max-num-seqs {args.max_num_seqs} is below the largest batch {largest}")
    return args


def workload(args: argparse.Namespace) -> dict:
    """What the rows' numbers depend on besides the variant; ``--merge`` refuses a file whose workload differs."""
    w = {"model": args.model, "prompt_tokens": args.prompt_tokens, "lora_rank": rollout.LORA_RANK}
    if args.max_num_seqs is not None:
        w["max_num_seqs"] = args.max_num_seqs  # only when set: files written before the switch still merge
    return w


def merge_rows(result: dict, earlier: dict, source: str) -> dict:
    """``result`` with the rows, kernel tables and layer ops of ``earlier`` (a lora_profile JSON read from
    ``source``) that it does not re-measure. ValueError naming ``source`` when it is not a lora_profile JSON of the same
    device, or was measured on another workload (the ratios would compare different runs)."""
    if earlier.get("benchmark") != "lora_profile" or earlier.get("device") != result["device"]:
        raise ValueError(f"--merge {source}: not a lora_profile JSON of {result['device']}")
    theirs = earlier.get("workload", {})
    diff = sorted(k for k in set(theirs) | set(result["workload"]) if theirs.get(k) != result["workload"].get(k))
    if diff:
        ours = result["workload"]
        parts = ", ".join(f"{k} {theirs.get(k)} there, {ours.get(k)} here" for k in diff)
        raise ValueError(f"--merge {source}: another workload ({parts})")
    rerun = {(r["variant"], r["part"], r["batch"]) for r in result["rows"]}
    merged = dict(result)
    merged["rows"] = [r for r in earlier["rows"] if (r["variant"], r["part"], r["batch"]) not in rerun] + result["rows"]
    merged["kernel_tables"] = {**earlier.get("kernel_tables", {}), **result["kernel_tables"]}
    merged["lora_layer_ops"] = {**earlier.get("lora_layer_ops", {}), **result["lora_layer_ops"]}
    return merged


def _engine(args, build: dict, eager: bool):
    from vllm import LLM

    kw = dict(model=build["nvfp4"], quantization="qerl_nvfp4", dtype="bfloat16", seed=0, skip_tokenizer_init=True,
              max_model_len=args.prompt_tokens + max(args.steps, args.profile_steps) + 16,
              max_num_seqs=args.max_num_seqs or max(args.batches + args.profile_batches), enable_prefix_caching=False,
              enforce_eager=eager, worker_extension_cls="verl_qerl.vllm.worker_extension.QeRLWorkerExtension")
    if args.on_gpu:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.variant != "none":
        kw.update(enable_lora=True, max_lora_rank=rollout.LORA_RANK, max_loras=1)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, kw, time.perf_counter() - t0


def _generate(llm, lora, prompts: list[list[int]], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
    return time.perf_counter() - t


def _profiled_generate(llm, lora, prompts, max_tokens: int, on_gpu: bool):  # noqa: ANN202 - (profile, wall s)
    """One ``max_tokens`` generate under torch.profiler (CPU, and CUDA on a GPU engine): (the profile, its wall s)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts) as prof:
        wall = _generate(llm, lora, prompts, max_tokens)
        if on_gpu:
            torch.cuda.synchronize()
    return prof, wall


def _by_name(prof, on_gpu: bool) -> dict[str, list[float]]:
    """Per kernel name: [device us, launches] (on a CPU engine: top-level aten / qerl / _C ops, [CPU us, calls])."""
    from torch.autograd import DeviceType

    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if on_gpu and e.device_type == DeviceType.CUDA:
            agg[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            agg[e.name][1] += 1
        elif not on_gpu and e.cpu_parent is None and e.name.startswith(("aten::", "qerl::", "_C::")):
            agg[e.name][0] += e.cpu_time_total
            agg[e.name][1] += 1
    return agg


def _kernel_table(llm, lora, prompts, steps: int, on_gpu: bool) -> dict[str, dict[str, float]]:
    """Per decode step: device time (us) and launches per kernel name (CPU ops on a CPU engine)."""
    prefill = _by_name(_profiled_generate(llm, lora, prompts, 1, on_gpu)[0], on_gpu)
    full = _by_name(_profiled_generate(llm, lora, prompts, steps + 1, on_gpu)[0], on_gpu)
    table = {}
    for name in full:
        us = (full[name][0] - prefill.get(name, [0.0, 0.0])[0]) / steps
        n = (full[name][1] - prefill.get(name, [0.0, 0.0])[1]) / steps
        if n > 0 or us > 0:
            table[name] = {"us_per_step": round(us, 3), "launches_per_step": round(n, 3)}
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["us_per_step"]))


def _prefill_profile(llm, lora, prompts, on_gpu: bool, top: int = 20) -> dict:
    """One profiled 1-token generate (the prefill): is it device-bound or host-bound, and where does it go?

    Returns the wall time, the summed kernel time (one stream, so ~ the device's busy time), the top kernels
    and the top CPU ops by self time (what the host spends the wall on when the kernels do not fill it).
    """
    prof, wall = _profiled_generate(llm, lora, prompts, 1, on_gpu)
    kernels = _by_name(prof, on_gpu) if on_gpu else {}
    cpu = sorted(((a.key, a.self_cpu_time_total, a.count) for a in prof.key_averages()),
                 key=lambda t: -t[1])[:top]
    return {"wall_ms": 1e3 * wall, "kernel_ms": sum(v[0] for v in kernels.values()) / 1e3,
            "launches": int(sum(v[1] for v in kernels.values())),
            "top_kernels": [{"name": k[:160], "us": round(v[0], 1), "launches": int(v[1])}
                            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
            "top_cpu_self": [{"name": k[:160], "self_us": round(us, 1), "count": n} for k, us, n in cpu]}


def run(args) -> dict:
    import random

    import torch

    args.on_gpu = torch.cuda.is_available()
    work = Path(args.work_dir)
    build = rollout.build_model({"model": args.model, "work_dir": str(work), "backends": ["qerl_nvfp4"],
                                 "bf16_checkpoint": "never", "nvfp4_direct": True, "seed": 0, "lora": True})
    lora = None
    if args.variant != "none":
        from vllm.lora.request import LoRARequest

        lora = LoRARequest("profile-r32", 1, build["lora"])
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000 if args.model == "7b" else 400) for _ in range(args.prompt_tokens)]
               for _ in range(max(args.batches + args.profile_batches))]
    rows, tables, layer_ops = [], {}, {}

    def shrink_record(batch: int, fast_layers: int, table: dict | None = None) -> dict | None:
        """What ran as the LoRA shrink at this decode batch (None off the fast path)."""
        if not fast_layers:
            return None
        from verl_qerl.kernels import lora_shrink

        device = torch.device("cuda" if args.on_gpu else "cpu")
        rec = {"mode": lora_shrink.shrink_mode(), "impl": lora_shrink.shrink_impl(batch, device),
               "triton_max_tokens": lora_shrink.TRITON_MAX_TOKENS}
        if table is not None and args.on_gpu:
            rec["shrink_kernel_launches_per_step"] = sum(v["launches_per_step"] for k, v in table.items()
                                                         if "_lora_shrink_kernel" in k)
        return rec

    parts = args.parts if args.on_gpu else [p for p in args.parts if p == "eager"]
    for part in parts:
        llm, kw, startup = _engine(args, build, eager=part == "eager")
        try:
            fast_layers = llm.collective_rpc("qerl_lora_fast_path_layers")[0] if lora else 0
            print(f"[lora_profile] {args.variant} {part}: engine up in {startup:.0f} s, "
                  f"fast-path layers {fast_layers}", flush=True)
            if part == "graphs":
                for b in args.batches:
                    _generate(llm, lora, prompts[:b], 8)  # warm-up
                    steps_ms, prefill_ms = [], []
                    for _ in range(args.repeats):
                        t1 = _generate(llm, lora, prompts[:b], 1)
                        tn = _generate(llm, lora, prompts[:b], args.steps + 1)
                        steps_ms.append(1e3 * (tn - t1) / args.steps)
                        prefill_ms.append(1e3 * t1)
                    row = {"model": args.model, "variant": args.variant, "batch": b, "part": "graphs",
                           "decode_ms_per_step": statistics.median(steps_ms), "repeats_ms": steps_ms,
                           "prefill_ms": statistics.median(prefill_ms), "prefill_repeats_ms": prefill_ms,
                           "steps": args.steps, "lora_fast_path_layers": fast_layers, "startup_s": startup,
                           "lora_shrink": shrink_record(b, fast_layers)}
                    if b in args.prefill_profile:
                        row["prefill_profile"] = prof = _prefill_profile(llm, lora, prompts[:b], args.on_gpu)
                        print(f"[lora_profile] {args.variant} B={b:3d} prefill profiled: wall {prof['wall_ms']:.2f}"
                              f" ms, kernels {prof['kernel_ms']:.2f} ms in {prof['launches']} launches", flush=True)
                        for k in prof["top_kernels"][:12]:
                            print(f"    {k['us']:10.1f} us {k['launches']:6d} x  {k['name'][:110]}")
                        print("    CPU self time:")
                        for k in prof["top_cpu_self"][:15]:
                            print(f"    {k['self_us']:10.1f} us {k['count']:6d} x  {k['name'][:110]}")
                    rows.append(row)
                    shrink = row["lora_shrink"]["impl"] if row["lora_shrink"] else "-"
                    print(f"[lora_profile] {args.variant} B={b:3d} decode {row['decode_ms_per_step']:.3f} ms/step "
                          f"prefill {row['prefill_ms']:.2f} ms (shrink: {shrink}) "
                          f"(repeats {', '.join(f'{x:.3f}' for x in steps_ms)}; prefill "
                          f"{', '.join(f'{x:.1f}' for x in prefill_ms)})", flush=True)
            else:
                for b in args.profile_batches:
                    _generate(llm, lora, prompts[:b], 4)  # warm-up
                    table = _kernel_table(llm, lora, prompts[:b], args.profile_steps, args.on_gpu)
                    tables[f"{args.variant}/B={b}"] = table
                    total = sum(v["us_per_step"] for v in table.values())
                    launches = sum(v["launches_per_step"] for v in table.values())
                    rows.append({"model": args.model, "variant": args.variant, "batch": b, "part": "eager",
                                 "kernel_us_per_step": total, "launches_per_step": launches,
                                 "lora_fast_path_layers": fast_layers, "startup_s": startup,
                                 "lora_shrink": shrink_record(b, fast_layers, table)})
                    print(f"[lora_profile] {args.variant} B={b} eager: {total:.0f} us of "
                          f"{'kernels' if args.on_gpu else 'CPU ops'}, {launches:.0f} launches per decode step",
                          flush=True)
                    for name, v in list(table.items())[:25]:
                        print(f"    {v['us_per_step']:10.2f} us {v['launches_per_step']:8.2f} x  {name[:110]}")
                    if lora:
                        ops = llm.collective_rpc("qerl_lora_layer_ops", args=(b,))[0]
                        layer_ops[f"{args.variant}/B={b}"] = ops
                        one = next(iter(ops.values()))
                        print(f"    per LoRA layer ({len(ops)} layers), e.g. {next(iter(ops))}: ops {one['ops']}"
                              f", kernels {one['kernels']} (beyond the base GEMM: {one['lora_ops']})", flush=True)
        finally:
            rollout._shutdown(llm)
    return {"rows": rows, "kernel_tables": tables, "lora_layer_ops": layer_ops, "llm_kwargs": kw}


def targets(rows: list[dict]) -> list[dict]:
    """Decode-step ratio without / with LoRA (= tok/s with / without) per batch, for each LoRA variant."""
    graph = {(r["variant"], r["batch"]): r["decode_ms_per_step"] for r in rows if r["part"] == "graphs"}
    prefill = {(r["variant"], r["batch"]): r["prefill_ms"] for r in rows
               if r["part"] == "graphs" and "prefill_ms" in r}
    out = []
    for variant in ("fast", "fast_separate", "fast_cublas", "vllm"):
        for (v, b), ms in sorted(graph.items()):
            if v != variant:
                continue
            base = graph.get(("none", b))
            out.append({"name": f"decode tok/s, {variant} LoRA / no LoRA, B={b}",
                        "measured": None if base is None else base / ms, "op": ">=", "target": KEEP_TARGET})
            pre, pre_base = prefill.get((v, b)), prefill.get(("none", b))
            if pre is not None:
                out.append({"name": f"prefill time, {variant} LoRA / no LoRA, B={b}",
                            "measured": None if pre_base is None else pre / pre_base, "op": "<=",
                            "target": PREFILL_TARGET})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name, value in zip(VARIANT_ENV, VARIANTS[args.variant]):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the profiler sees its GPU work
    rollout.isolate_compile_cache()  # after the variant's settings: its own compiled graphs
    device = rollout.device_name()
    res = run(args)
    result = {"benchmark": "lora_profile", "device": device, "versions": rollout.versions(),
              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "workload": workload(args),
              "rows": res["rows"], "kernel_tables": res["kernel_tables"], "lora_layer_ops": res["lora_layer_ops"]}
    if args.merge:
        try:
            result = merge_rows(result, json.loads(Path(args.merge).read_text()), args.merge)
        except ValueError as e:
            print(f"error: {e}", flush=True)
            return 2
    result["targets"] = targets(result["rows"])
    for t in result["targets"]:
        m = "-" if t["measured"] is None else f"{t['measured']:.3f}"
        print(f"[lora_profile] target {t['name']}: {m} {t['op']} {t['target']} {target_status(t)}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lora-profile-{args.model}-{device.replace(' ', '-').lower()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    print(f"[lora_profile] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
