"""vLLM worker extension for QeRL: Adaptive Quantization Noise on the rollout engine's RMSNorm weights.

vLLM mixes the class named by ``worker_extension_cls`` into every worker's class; its methods are
then callable by name through ``collective_rpc`` (``LLM.collective_rpc``, ``AsyncLLM.collective_rpc``,
verl's ``vLLMHttpServer.collective_rpc``), once per tensor-parallel rank. The noise itself is
:class:`verl_qerl.aqn.NormNoiser`: seeded by ``(seed, step, tensor name)`` on the CPU, so every
rank (RMSNorm weights are replicated) and the training side draw the same values; written
``clean + noise`` in place with ``copy_`` (CUDA graphs and torch.compile hold the storage), never
accumulated, and restored bit-exactly.

Method names carry a ``qerl_`` prefix because vLLM refuses an extension whose attributes collide
with the worker's. After changing the noise, drop cached prefixes (``LLM.reset_prefix_cache()``;
verl's ``clear_kv_cache``): KV blocks computed under the old norms would otherwise be reused.

Use ``worker_extension_cls="verl_qerl.vllm.worker_extension.QeRLWorkerExtension"`` in plain vLLM,
and :class:`verl_qerl.vllm.verl_extension.QeRLVerlWorkerExtension` under verl (it keeps verl's
own extension, which carries LoRA and weight sync).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from verl_qerl.aqn import DEFAULT_TARGETS, AQNConfig, NormNoiser
from verl_qerl.aqn._checks import check_sigma, check_step

from . import compat


class QeRLWorkerExtension:
    """AQN and inspection methods mixed into vLLM workers; call them with ``collective_rpc``.

    Every method returns plain data (str / float / dict / CPU tensors) so results travel back
    through vLLM's msgpack IPC. No ``__init__``/``__new__``: vLLM constructs the worker, and a
    composed verl extension needs its own ``__new__`` to run.
    """

    # -- AQN --------------------------------------------------------------------------------------

    def qerl_aqn_setup(
        self,
        seed: int = 0,
        targets: list[str] | tuple[str, ...] = DEFAULT_TARGETS,
        include_final_norm: bool = False,
        rounding: str = "stochastic",
    ) -> dict[str, Any]:
        """Choose the RMSNorm weights to perturb and snapshot their clean values.

        Idempotent for the same settings; with new settings the old noise is removed first.
        ``targets``: RMSNorm module names (``input_layernorm``, ``post_attention_layernorm``: the
        norms feeding q/k/v and gate/up, as in the paper). Returns the names and the clean checksum.
        """
        # targets as given: AQNConfig refuses a bare string by name (a tuple of it would be its characters)
        cfg = AQNConfig(seed=seed, targets=targets, include_final_norm=include_final_norm, rounding=rounding)
        key = (cfg.seed, cfg.targets, cfg.include_final_norm, cfg.rounding)
        noiser = getattr(self, "_qerl_noiser", None)
        if noiser is None or getattr(self, "_qerl_noiser_key", None) != key:
            if noiser is not None:
                noiser.restore()
            model = compat.worker_model(self)
            self._qerl_noiser = NormNoiser.from_config(model.named_parameters(), cfg)
            self._qerl_noiser_key = key
        return {"names": list(self._qerl_noiser.names), "clean_checksum": self._qerl_noiser.clean_checksum()}

    def _qerl_require_noiser(self, seed: int | None) -> NormNoiser:
        noiser = getattr(self, "_qerl_noiser", None)
        if noiser is None or (seed is not None and self._qerl_noiser_key[0] != seed):
            key = getattr(self, "_qerl_noiser_key", None)
            kwargs = {} if key is None else {"targets": key[1], "include_final_norm": key[2], "rounding": key[3]}
            self.qerl_aqn_setup(seed=0 if seed is None else seed, **kwargs)
        return self._qerl_noiser

    def qerl_aqn_apply(self, step: int, sigma: float, seed: int | None = None) -> dict[str, Any]:
        """Write ``clean + Z(seed, step, name) * sigma`` into the targeted norms, in place.

        Computed from the clean snapshot every time (calls never accumulate); ``sigma=0`` writes the
        clean weights. ``seed`` (optional) re-targets the noiser with that seed. Returns the checksum
        now held and what landed (``qerl/aqn_sigma_effective``, ``qerl/aqn_changed_frac``).
        """
        step, sigma = check_step(step), check_sigma(sigma)  # named errors, not int(7.5) == 7 or float(None)
        noiser = self._qerl_require_noiser(seed)
        noiser.apply(step, sigma)
        _sync(self)
        return {"checksum": noiser.checksum(), "step": step, "sigma": sigma, **noiser.metrics()}

    def qerl_aqn_restore(self) -> dict[str, Any]:
        """Write the clean snapshot back, bit-exactly; returns the checksum (equal to the clean one)."""
        noiser = self._qerl_require_noiser(None)
        noiser.restore()
        _sync(self)
        return {"checksum": noiser.checksum(), "clean_checksum": noiser.clean_checksum()}

    def qerl_aqn_checksum(self) -> dict[str, Any]:
        """Checksums of what the norms hold now and of the clean snapshot, and the noise in place."""
        noiser = self._qerl_require_noiser(None)
        return {"checksum": noiser.checksum(), "clean_checksum": noiser.clean_checksum(),
                "current": list(noiser.current) if noiser.current is not None else None}

    def qerl_aqn_refresh_clean(self) -> dict[str, Any]:
        """Adopt the norms' current values as clean (after a full weight sync wrote new norms)."""
        noiser = self._qerl_require_noiser(None)
        noiser.refresh_clean()
        _sync(self)
        return {"clean_checksum": noiser.clean_checksum()}

    # -- inspection -------------------------------------------------------------------------------

    def qerl_named_tensors(self, names: list[str] | None = None, suffix: str | None = None) -> bytes:
        """Model parameters (by exact ``names`` or name ``suffix``) as safetensors bytes; see :func:`decode_tensors`.

        Bytes, not tensors: vLLM's msgpack IPC turns tensors nested in an untyped RPC result into
        lists unless insecure (pickle) serialization is enabled.
        """
        out = {}
        for name, param in compat.worker_model(self).named_parameters():
            if (names is not None and name in names) or (suffix is not None and name.endswith(suffix)):
                out[name] = param.detach().to("cpu").clone()
        return encode_tensors(out)

    def qerl_lora_fast_path_layers(self) -> int:
        """How many linear LoRA layers of this rank run on the single-adapter fast path (0 without LoRA)."""
        from .lora_fast_path import count_fast_path_layers

        return count_fast_path_layers(compat.worker_model(self))

    def qerl_lora_layer_ops(self, tokens: int | None = None) -> dict[str, dict[str, Any]]:
        """Per linear LoRA layer: the ops / CUDA kernels its LoRA term adds to one forward (see
        :func:`verl_qerl.vllm.lora_fast_path.lora_layer_ops`)."""
        from .lora_fast_path import lora_layer_ops

        return lora_layer_ops(compat.worker_model(self), tokens)

    def qerl_quant_summary(self) -> dict[str, Any]:
        """Per linear layer: quant method class, and for ``qerl_nvfp4`` layers the backend and scales.

        Also a digest of all NVFP4 bytes (packed weights, block scales, global scales), to compare
        engines that should hold identical quantized weights.
        """
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        layers: dict[str, Any] = {}
        digest = hashlib.blake2b(digest_size=16)
        for name, module in compat.worker_model(self).named_modules():
            method = getattr(module, "quant_method", None)
            if method is None or not isinstance(module, (LinearBase, VocabParallelEmbedding)):
                continue  # LoRA wrappers forward quant_method too; report the base layer once
            info: dict[str, Any] = {"method": type(method).__name__,
                                    "lora_fast_path": bool(getattr(module, "qerl_lora_fast_path", False))}
            state = getattr(module, "qerl_state", None)
            if state is not None and state.layout is not None:  # a finalized qerl_nvfp4 layer
                from .linear_method import QeRLNvFp4LinearMethod

                info.update(backend=state.backend, layout=state.layout, format=state.checkpoint_format,
                            uniform_scale=state.uniform_scale, scale_rule=method.config.scale_rule,
                            global_scale=module.weight_global_scale.detach().cpu().tolist(),
                            shape=[module.output_size_per_partition, module.input_size_per_partition])
                for t in QeRLNvFp4LinearMethod.canonical_nvfp4(module):  # layout-independent digest
                    digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            layers[name.replace(".base_layer", "")] = info
        from . import plugin

        return {"layers": layers, "nvfp4_digest": digest.hexdigest(), "pid": os.getpid(),
                "plugin_registered_here": plugin.is_registered(), "vllm_version": list(compat.vllm_version())}

    def qerl_dequantized_weights(self) -> bytes:
        """Every ``qerl_nvfp4`` layer's weight as the engine computes with it (fp32), keyed by layer, as
        safetensors bytes (:func:`decode_tensors`)."""
        from .linear_method import QeRLNvFp4LinearMethod

        out = {}
        for name, module in compat.worker_model(self).named_modules():
            if isinstance(getattr(module, "quant_method", None), QeRLNvFp4LinearMethod):
                w = QeRLNvFp4LinearMethod.dequantized_weight(module, torch.float32)
                out[name.replace(".base_layer", "")] = w.cpu()
        return encode_tensors(out)


def encode_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """CPU tensors -> safetensors bytes (travel through vLLM's RPC as plain bytes)."""
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})


def decode_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_tensors`, for the caller of ``collective_rpc``."""
    from safetensors.torch import load

    return load(bytes(blob))


def _sync(worker: Any) -> None:
    """Make in-place writes visible before the next step (host-to-device copies are queued on CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
