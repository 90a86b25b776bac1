"""Key vLLM's compile cache on the ``QERL_*`` settings of ``qerl_nvfp4`` engines.

vLLM stores its torch.compile artifacts (the AOT-compiled model under ``VLLM_CACHE_ROOT``, the inductor cache) under
``VllmConfig.compute_hash()``, and for the quantization method that hash only sees its name
(``ModelConfig.quantization``). Our switches are read while vLLM traces the model and are baked into the compiled
graph as op arguments: ``QERL_PDL`` (the GEMM ops' ``pdl``), ``QERL_GEMM_KERNEL`` (their ``mode``),
``QERL_NVFP4_BACKEND``, ``QERL_LORA_SHRINK`` and the rest. Without a key, an engine started after a change of setting
replays the graph compiled under the old one: two engines with ``QERL_PDL=0`` and ``1`` measured the same graphs
(benchmarks/NOTES.md, "Sixth round"). :func:`install` wraps ``ModelConfig.compute_hash`` so that, for
``quantization="qerl_nvfp4"``, the hash also covers every ``QERL_*`` environment variable of the process (sorted
name=value pairs; over-keying only costs a compile). Other engines keep vLLM's hash. The LoRA fast path's modes are
keyed on ``LoRAConfig`` as well (:mod:`verl_qerl.vllm.lora_fast_path`), which also covers BF16 engines it serves.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

QUANT_NAME = "qerl_nvfp4"
PREFIX = "QERL_"


def settings(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """The process's ``QERL_*`` environment variables, sorted: what the key covers."""
    env = os.environ if environ is None else environ
    return sorted((k, v) for k, v in env.items() if k.startswith(PREFIX))


def keyed(original: Callable[[Any], str]) -> Callable[[Any], str]:
    """``ModelConfig.compute_hash`` that also covers :func:`settings` for ``qerl_nvfp4`` model configs."""

    @functools.wraps(original)
    def compute_hash(self: Any) -> str:
        key = original(self)
        if getattr(self, "quantization", None) != QUANT_NAME:
            return key
        extra = "|".join(f"{k}={v}" for k, v in settings())
        return hashlib.sha256(f"{key}|{extra}".encode()).hexdigest()

    compute_hash.qerl_keyed = True  # type: ignore[attr-defined]
    return compute_hash


def install() -> bool:
    """Wrap ``ModelConfig.compute_hash`` once per process; False (one log line) where this vLLM lacks it."""
    try:
        from vllm.config.model import ModelConfig
    except ImportError as exc:
        logger.info("qerl: vLLM's ModelConfig not importable (%s); compile cache not keyed on QERL_*", exc)
        return False
    original = getattr(ModelConfig, "compute_hash", None)
    if not callable(original):
        logger.info("qerl: this vLLM's ModelConfig has no compute_hash; compile cache not keyed on QERL_*")
        return False
    if not getattr(original, "qerl_keyed", False):
        ModelConfig.compute_hash = keyed(original)
    return True
