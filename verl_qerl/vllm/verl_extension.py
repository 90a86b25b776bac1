"""The QeRL worker extension composed with verl's own (for verl's vLLM rollout).

verl 0.9.1 launches vLLM with ``worker_extension_cls`` set to its ``vLLMColocateWorkerExtension``
(LoRA adapter sync through ``TensorLoRARequest``, weight transfer, logits masking). vLLM takes one
extension class, so QeRL's must *include* verl's: this class inherits both, and verl's
``__new__`` (which installs the ``TensorLoRARequest`` loader in the worker) still runs. Set it
with ``+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=
verl_qerl.vllm.verl_extension.QeRLVerlWorkerExtension``; ``engine_kwargs`` override verl's default.

Importing this module needs verl; the standalone
:class:`verl_qerl.vllm.worker_extension.QeRLWorkerExtension` does not.
"""

from __future__ import annotations

from typing import Any

try:
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "verl_qerl.vllm.verl_extension needs verl (pip install verl==0.9.1); in plain vLLM use "
        "worker_extension_cls='verl_qerl.vllm.worker_extension.QeRLWorkerExtension'"
    ) from exc

from . import compat
from .worker_extension import QeRLWorkerExtension


class QeRLVerlWorkerExtension(QeRLWorkerExtension, vLLMColocateWorkerExtension):
    """verl's colocated-worker extension plus QeRL's AQN methods (``qerl_*``)."""

    def __new__(cls, **kwargs: Any):
        # verl 0.9.1 calls WeightsMapper.get_unstacked_mapper on vLLM >= 0.25; 0.32 renamed it.
        compat.ensure_verl_lora_mapper_alias()
        return super().__new__(cls, **kwargs)
