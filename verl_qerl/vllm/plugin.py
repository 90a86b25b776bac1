"""vLLM plugin entry point: ``vllm.general_plugins: qerl_nvfp4 = verl_qerl.vllm.plugin:register``.

vLLM calls :func:`register` in every process it starts (front end, engine core, workers) before
it resolves quantization names. Importing :mod:`verl_qerl.vllm.config` registers ``qerl_nvfp4``
through ``register_quantization_config``; the linear method registers itself for vLLM's v2 weight
loader when imported; :func:`verl_qerl.vllm.lora_fast_path.install` hooks vLLM's LoRA manager so
single-adapter engines run LoRA on ``qerl_nvfp4`` layers through our ops; :func:`verl_qerl.vllm.compile_cache.install`
keys vLLM's compile cache on the ``QERL_*`` settings of ``qerl_nvfp4`` engines. With ``QERL_DECODE_STATS_DIR`` set
(benchmarks), :mod:`verl_qerl.vllm.decode_stats_logger` records every engine step's batch size. Nothing here
touches CUDA, so the plugin is safe in CPU-only processes.
"""

from __future__ import annotations

import logging
import os

from .decode_stats import ENV as DECODE_STATS_ENV

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Register the ``qerl_nvfp4`` quantization method with vLLM. Idempotent."""
    global _registered
    if _registered:
        return
    from . import compat, compile_cache, config, linear_method, lora_fast_path  # noqa: F401  (imports register)

    compat.warn_if_untested()
    compile_cache.install()
    lora_fast_path.install()
    if os.environ.get(DECODE_STATS_ENV):
        from . import decode_stats_logger

        decode_stats_logger.install()
    _registered = True
    logger.debug("qerl_nvfp4 registered (vLLM %s)", ".".join(map(str, compat.vllm_version())))


def is_registered() -> bool:
    """Whether :func:`register` ran in this process (vLLM's entry-point loading calls it)."""
    return _registered
