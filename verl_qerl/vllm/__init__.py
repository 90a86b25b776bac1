"""QeRL for vLLM: the ``qerl_nvfp4`` quantization method and the AQN worker extension.

``LLM(model, quantization="qerl_nvfp4", worker_extension_cls=
"verl_qerl.vllm.worker_extension.QeRLWorkerExtension")``; the method is registered in every vLLM
process by the ``vllm.general_plugins`` entry point (:func:`verl_qerl.vllm.plugin.register`).
Submodules import vLLM; this package file does not, so ``import verl_qerl.vllm`` stays cheap.
"""

from __future__ import annotations

METHOD_NAME = "qerl_nvfp4"
WORKER_EXTENSION = "verl_qerl.vllm.worker_extension.QeRLWorkerExtension"
VERL_WORKER_EXTENSION = "verl_qerl.vllm.verl_extension.QeRLVerlWorkerExtension"

__all__ = ["METHOD_NAME", "VERL_WORKER_EXTENSION", "WORKER_EXTENSION"]
