"""A vLLM stat logger that writes one line per engine step (:mod:`verl_qerl.vllm.decode_stats` has the format).

Installed by the ``qerl_nvfp4`` plugin only when ``QERL_DECODE_STATS_DIR`` is set (benchmarks): it then wraps
``vllm.v1.engine.async_llm.load_stat_logger_plugin_factories``, the hook through which ``AsyncLLM`` adds the
``vllm.stat_logger_plugins`` entry points to its loggers, so every ``AsyncLLM`` of the process gets this logger
as well, whoever builds it (verl's rollout server passes none of its own). A custom logger makes ``AsyncLLM`` turn
its per-step stats on even when the caller disabled stats logging (vLLM's own console logger stays off then).
No entry point is registered: an installed entry point would turn per-step stats on for every user.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from .decode_stats import ENV

logger = logging.getLogger(__name__)


class DecodeStepLogger(AggregateStatLoggerBase):
    """Appends a line per step that produced tokens to ``$QERL_DECODE_STATS_DIR/steps-<pid>-<n>.jsonl`` (``n``
    counts the loggers of the process; line-buffered: a killed process loses at most the line being written).

    An aggregate logger (one for all engines of the ``AsyncLLM``, each record naming its engine ``e``) because
    vLLM forwards sleep / wake only to aggregate loggers, not to per-engine ones."""

    _made = 0

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None) -> None:
        self.vllm_config = vllm_config
        folder = Path(os.environ[ENV])
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"steps-{os.getpid()}-{DecodeStepLogger._made}.jsonl"
        DecodeStepLogger._made += 1
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if iteration_stats is None or not iteration_stats.num_generation_tokens:
            return
        rec = {"t": round(iteration_stats.iteration_timestamp, 6), "e": engine_idx,
               "gen": iteration_stats.num_generation_tokens,
               "prompt": int(getattr(iteration_stats, "num_prompt_tokens", 0) or 0),
               "pre": int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)}
        if scheduler_stats is not None:
            rec.update(run=scheduler_stats.num_running_reqs, wait=scheduler_stats.num_waiting_reqs,
                       kv=round(float(scheduler_stats.kv_cache_usage), 4))
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        # AsyncLLM.sleep passes 1, wake_up 0 (the base class calls the first argument is_awake; its callers do not)
        event = "sleep" if sleep else "wake"
        self._file.write(json.dumps({"t": round(time.time(), 6), "event": event, "level": level}) + "\n")

    def log_engine_initialized(self) -> None:
        """Called once the engines are up: records the KV cache they got (blocks x block size = tokens), which
        does not depend on vLLM's own start-up log reaching the caller."""
        cache = self.vllm_config.cache_config
        rec = {"t": round(time.time(), 6), "event": "engine", "num_gpu_blocks": cache.num_gpu_blocks,
               "block_size": cache.block_size, "max_model_len": self.vllm_config.model_config.max_model_len}
        for key in ("kv_cache_size_tokens", "kv_cache_max_concurrency"):  # set in process 0 by some vLLM versions
            if getattr(cache, key, None) is not None:
                rec[key] = getattr(cache, key)
        self._file.write(json.dumps(rec) + "\n")
        logger.info("[verl-qerl] decode step stats -> %s", self.path)


def install() -> bool:
    """Add :class:`DecodeStepLogger` to the stat loggers of every ``AsyncLLM`` created in this process from now on.
    Idempotent; False (with a warning) when this vLLM has no such hook."""
    try:
        from vllm.v1.engine import async_llm
    except ImportError as err:  # pragma: no cover - vLLM without the V1 engine
        logger.warning("[verl-qerl] %s is set but vLLM's AsyncLLM cannot be imported (%s): no step stats", ENV, err)
        return False
    original = getattr(async_llm, "load_stat_logger_plugin_factories", None)
    if original is None:
        logger.warning("[verl-qerl] %s is set but this vLLM's AsyncLLM has no load_stat_logger_plugin_factories: "
                       "no step stats", ENV)
        return False
    if getattr(original, "_qerl_decode_steps", False):
        return True

    def load_stat_logger_plugin_factories():
        return [*original(), DecodeStepLogger]

    load_stat_logger_plugin_factories._qerl_decode_steps = True
    async_llm.load_stat_logger_plugin_factories = load_stat_logger_plugin_factories
    return True
