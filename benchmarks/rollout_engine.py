"""One backend of ``benchmarks/rollout.py`` in one engine: start vLLM with the job's arguments, time every batch
size (a warm-up, a prefill-only and the full ``generate``), print each row as it is measured, shut the engine down.

Kept apart because this is what runs inside a child process (``rollout.py --child``, one per backend and model)
and the only part that imports vLLM; the parent reads the rows printed with ``ROW_PREFIX`` back from the child's
log when the child dies before it finished (``rollout.run_child``).
"""

from __future__ import annotations

import json
import statistics
import time

from rollout_prepare import BenchError  # benchmarks/: this module's own folder

ROW_PREFIX = "[rollout-row] "  # one JSON row per measured batch in a child's log
PREFILL_REPEATS = 3  # prefill-only generates per batch; their median is the row's prefill_s


def _shutdown(llm) -> None:
    import gc

    shutdown = getattr(llm, "shutdown", None)
    if shutdown is None:
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as exc:  # noqa: BLE001 - best effort at exit
        print(f"[rollout] cleanup: {type(exc).__name__}: {exc}", flush=True)


def bench_backend(job: dict) -> dict:
    """Start one engine and time every batch size; returns the rows."""
    from vllm import LLM, SamplingParams

    backend = job["backend"]
    if backend == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise BenchError(f"backend nf4 needs bitsandbytes importable ({exc}); stage it (benchmarks/GPU.md)") \
                from exc
    kw = dict(job["llm"])
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    quant = None
    try:
        quant = llm.llm_engine.vllm_config.model_config.quantization
    except Exception:  # noqa: BLE001 - informative only
        pass
    fast_layers = None
    if kw.get("enable_lora"):  # proof of which LoRA path ran: the count of layers on the single-adapter fast path
        try:
            fast_layers = llm.collective_rpc("qerl_lora_fast_path_layers")[0]
        except Exception as exc:  # noqa: BLE001 - informative only
            print(f"[rollout] could not count fast-path layers: {type(exc).__name__}: {exc}", flush=True)
    lora_request = None
    if job.get("lora"):
        from vllm.lora.request import LoRARequest

        lora_request = LoRARequest("bench-r32", 1, job["lora"])
    prompts, warm = job["prompts"], job["warm_prompts"]
    new = job["new_tokens"]

    def generate(ids: list[list[int]], max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                seed=None)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, lora_request=lora_request,
                            use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    rows = []
    try:
        for b in job["batches"]:
            generate(warm[:b], 8)
            # the prefill-only generate, PREFILL_REPEATS times: one timing of a few milliseconds moves with the
            # host (a 3.7x outlier once, while another job on the host started engines); the median is reported
            prefill_runs = [generate(prompts[:b], 1)[0] for _ in range(PREFILL_REPEATS)]
            prefill_s = statistics.median(prefill_runs)
            total_s, n_out = generate(prompts[:b], new)
            decode_s = max(total_s - prefill_s, 1e-9)
            row = {
                "model": job["model"], "backend": backend, "batch": b, "lora": bool(lora_request),
                "prompt_tokens": len(prompts[0]), "new_tokens": new, "output_tokens": n_out,
                "total_s": total_s, "tok_s": n_out / total_s,
                "prefill_s": prefill_s, "prefill_s_runs": prefill_runs,
                "prefill_tok_s": b * len(prompts[0]) / prefill_s,
                "decode_s": decode_s, "decode_tok_s": (n_out - b) / decode_s,
                "decode_ms_per_step": 1e3 * decode_s / max(new - 1, 1),
                "startup_s": startup_s, "quantization": quant, "lora_fast_path_layers": fast_layers,
                "load_format": kw.get("load_format", "auto"),
            }
            rows.append(row)
            # machine-readable too: the parent keeps these rows when a later batch times out or crashes
            print(ROW_PREFIX + json.dumps(row), flush=True)
            print(f"[rollout] {job['model']} {backend:10s} B={b:4d} {row['tok_s']:10.1f} tok/s  prefill "
                  f"{prefill_s * 1e3:8.1f} ms  decode {row['decode_tok_s']:10.1f} tok/s"
                  + (f"  fast-path layers {fast_layers}" if fast_layers is not None else ""), flush=True)
    finally:
        _shutdown(llm)
    return {"rows": rows}
