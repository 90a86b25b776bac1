"""verl_qerl.vllm.decode_stats(_logger): per-step batch sizes of vLLM rollouts, and the decode-batch histogram.

The engine test runs a real vLLM ``AsyncLLM`` (CPU) with ``QERL_DECODE_STATS_DIR`` set and checks the recorded
steps against the schedule that the requests' ``max_tokens`` imply; the others check the reader and the
histogram on hand-written records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl_qerl.vllm import decode_stats as ds

REPO = Path(__file__).resolve().parent.parent


def _steps(t0: float, ms: list[int], dt: float = 0.01, prompt_first: int = 0) -> list[dict]:
    out = []
    for i, m in enumerate(ms):
        out.append({"t": t0 + i * dt, "gen": m, "prompt": prompt_first if i == 0 else 0, "run": m, "wait": 0,
                    "pre": 0, "kv": 0.1 * (i % 3)})
    return out


def test_rollouts_split_on_sleep_or_on_a_gap_and_histogram_counts_decode_steps():
    a = _steps(100.0, [4, 4, 4, 3, 3, 1], prompt_first=40)  # step 1 finishes 4 prefills: not a decode step
    b = _steps(200.0, [2, 2, 1])
    c = _steps(200.2, [5])
    records = a + [{"t": 150.0, "event": "sleep", "level": 1}, {"t": 199.0, "event": "wake", "level": 0}] + b + c
    rollouts = ds.split_rollouts(sorted(records, key=lambda r: r["t"]), gap_s=5.0)
    assert [len(r) for r in rollouts] == [6, 4]  # sleep ends a; b and c are 0.2 s apart: one rollout
    assert [len(r) for r in ds.split_rollouts(a + b, gap_s=5.0)] == [6, 3]  # no events: the 94 s gap splits
    drained = [dict(x, run=0 if i == len(a) - 1 else x["run"]) for i, x in enumerate(a)]
    moved = [dict(x, t=x["t"] - 99.9) for x in b]  # right after a, no sleep: split because a left nothing running
    assert [len(r) for r in ds.split_rollouts(drained + moved, gap_s=5.0)] == [6, 3]
    assert [len(r) for r in ds.split_rollouts(a + moved, gap_s=5.0)] == [9]
    s = ds.summarize_rollout(rollouts[0])
    assert s["decode_steps_by_m"] == {1: 1, 3: 2, 4: 2} and s["decode_steps"] == 5
    assert s["prefill_steps"] == 1 and s["prefill_tokens"] == 40 and s["generated_tokens"] == 19
    assert s["decode_s_by_m"] == {3: pytest.approx(0.02), 4: pytest.approx(0.02)}  # the last step has no end
    assert s["kv_usage_max"] == pytest.approx(0.2) and s["wall_s"] == pytest.approx(0.05)
    merged = ds.merge_histograms([s, ds.summarize_rollout(rollouts[1])])
    assert merged["decode_steps_by_m"] == {1: 2, 2: 2, 3: 2, 4: 2, 5: 1} and merged["rollouts"] == 2
    rows = ds.bucket_table(merged)
    assert [(r["m"], r["decode_steps"]) for r in rows] == [("1", 2), ("2-8", 7)]
    assert rows[0]["seconds"] == pytest.approx(0.18)  # b's M = 1 step lasted until c's step
    assert rows[1]["ms_per_step"] == pytest.approx(1e3 * (0.02 + 0.02 + 0.02) / 7)


def test_engine_records_give_the_kv_capacity():
    recs = [{"t": 1.0, "event": "engine", "num_gpu_blocks": 1000, "block_size": 16, "max_model_len": 2184},
            {"t": 2.0, "event": "engine", "num_gpu_blocks": None, "block_size": 16, "max_model_len": 2184},
            {"t": 3.0, "gen": 4}]
    (kv,) = ds.engine_kv(recs)
    assert kv["kv_cache_tokens"] == 16000 and kv["max_concurrency"] == pytest.approx(16000 / 2184)


def test_buckets_cover_every_m_once():
    for m in (1, 2, 8, 9, 16, 17, 64, 65, 128, 129, 192, 193, 255, 256, 257, 4096):
        assert sum(lo <= m <= hi for lo, hi in ds.BUCKETS) == 1, m


def test_reader_sorts_files_and_skips_a_torn_line(tmp_path):
    (tmp_path / "steps-1-0.jsonl").write_text('{"t": 2.0, "gen": 3}\n{"t": 3.0, "ge')
    (tmp_path / "steps-2-0.jsonl").write_text('{"t": 1.0, "gen": 2}\n')
    (tmp_path / "other.txt").write_text('{"t": 0.5, "gen": 9}\n')
    assert [r["t"] for r in ds.read_records(tmp_path)] == [1.0, 2.0]
    assert ds.read_records(tmp_path / "missing") == []


DRIVER = textwrap.dedent("""
    import asyncio, sys
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    async def main(model):
        args = AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
                               max_num_batched_tokens=256, seed=0, disable_log_stats=True,
                               enable_prefix_caching=False)
        engine = AsyncLLM.from_engine_args(args)
        async def one(i, n):
            params = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
            async for out in engine.generate({"prompt_token_ids": [5 + i, 17, 99, 3, 250]}, params, f"r{i}"):
                last = out
            return len(last.outputs[0].token_ids)
        got = await asyncio.gather(*(one(i, n) for i, n in enumerate((3, 5, 7, 9))))
        print("TOKENS", list(got), flush=True)
        cache = engine.vllm_config.cache_config
        print("BLOCKS", cache.num_gpu_blocks, cache.block_size, flush=True)
        engine.shutdown()

    asyncio.run(main(sys.argv[1]))
""")


def test_async_engine_records_every_step(tiny_bf16, tmp_path):
    """4 requests of 5 prompt tokens (max_num_seqs 4) for 3/5/7/9 tokens. Their prefills may land in one or two
    steps (they reach the engine asynchronously), so the check is the schedule's invariants: every token and prompt
    token counted once, and each pure decode step's M is the number of sequences running after the step before it
    (nothing waits), down to 0; vLLM's disable_log_stats does not stop the recording."""
    stats = tmp_path / "stats"
    env = dict(os.environ, QERL_DECODE_STATS_DIR=str(stats), VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tiny_bf16)], env=env, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0 and "TOKENS [3, 5, 7, 9]" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    records = ds.read_records(stats)
    assert records, f"nothing recorded in {stats}: {sorted(p.name for p in stats.glob('*'))}"
    assert [r["event"] for r in records if "event" in r] == ["engine"]  # no sleep on CPU
    blocks, block_size = (int(x) for x in proc.stdout.split("BLOCKS")[1].split()[:2])
    (kv,) = ds.engine_kv(records)  # the engine's KV cache, as vLLM's own config holds it
    assert (kv["num_gpu_blocks"], kv["block_size"], kv["max_model_len"]) == (blocks, block_size, 128)
    assert kv["kv_cache_tokens"] == blocks * block_size or kv["kv_cache_tokens"] == pytest.approx(
        blocks * block_size, rel=0.01)
    (rollout,) = ds.split_rollouts(records)
    s = ds.summarize_rollout(rollout)
    assert s["generated_tokens"] == 3 + 5 + 7 + 9 and s["prefill_tokens"] == 4 * 5
    assert 1 <= s["prefill_steps"] <= 2 and s["decode_steps"] == len(rollout) - s["prefill_steps"]
    assert max(s["decode_steps_by_m"]) == 4 and min(s["decode_steps_by_m"]) == 1
    for before, rec in zip(rollout, rollout[1:]):
        assert rec["wait"] == 0
        if ds.is_decode_step(rec):
            assert rec["gen"] == before["run"], rollout
    assert rollout[-1]["run"] == 0


def test_nothing_is_installed_without_the_variable(monkeypatch):
    """Without QERL_DECODE_STATS_DIR the plugin leaves vLLM's stat-logger hook alone (no per-step stats for users)."""
    monkeypatch.delenv(ds.ENV, raising=False)
    code = ("from vllm.v1.engine import async_llm as a; f = a.load_stat_logger_plugin_factories; "
            "from verl_qerl.vllm import plugin; plugin._registered = False; plugin.register(); "
            "import json; print(json.dumps([a.load_stat_logger_plugin_factories is f, "
            "getattr(a.load_stat_logger_plugin_factories, '_qerl_decode_steps', False)]))")
    env = {k: v for k, v in os.environ.items() if k != ds.ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False]
    env[ds.ENV] = "/tmp/unused"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True], out.stderr[-3000:]
