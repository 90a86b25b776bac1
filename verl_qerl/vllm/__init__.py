"""QeRL for vLLM: the ``qerl_nvfp4`` quantization method and the AQN worker extensions.

``LLM(model, quantization=METHOD_NAME, worker_extension_cls=STANDALONE_WORKER_EXTENSION)``; the method
is registered in every vLLM process by the ``vllm.general_plugins`` entry point
(:func:`verl_qerl.vllm.plugin.register`). Submodules import vLLM; this package file does not, so
``import verl_qerl.vllm`` stays cheap.
"""

from __future__ import annotations

from ..nvfp4.quant_config import QERL_QUANT_METHOD as METHOD_NAME

#: ``worker_extension_cls`` for plain vLLM: the AQN methods alone.
STANDALONE_WORKER_EXTENSION = "verl_qerl.vllm.worker_extension.QeRLWorkerExtension"

#: ``worker_extension_cls`` under verl: the AQN methods plus verl's own extension (LoRA adapter sync,
#: weight transfer), which verl's vLLM server would otherwise install and which this setting replaces.
VERL_WORKER_EXTENSION = "verl_qerl.vllm.verl_extension.QeRLVerlWorkerExtension"

__all__ = ["METHOD_NAME", "STANDALONE_WORKER_EXTENSION", "VERL_WORKER_EXTENSION"]
