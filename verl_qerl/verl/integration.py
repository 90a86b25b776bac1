"""The three places QeRL hooks into verl 0.9.1, each installed as a post-import hook.

1. ``verl.utils.config.validate_config`` (driver): :func:`verl_qerl.verl.config.apply_qerl` checks the
   ``qerl`` block and fills in what its mode implies before verl validates the config.
2. ``verl.trainer.ppo.v1.trainer_sync`` (TaskRunner): registers the ``qerl_sync`` trainer mode.
3. ``FSDPEngine._build_lora_module`` (training workers): converts the model's Linear layers to the
   mode's frozen base (``NVFP4Linear`` for nvfp4, bitsandbytes NF4 for nf4) right before verl calls
   ``get_peft_model``, and lets peft wrap them. This is the one patch verl cannot avoid today
   (``patches/`` has the upstream hook that replaces it).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

from ._hooks import when_imported

logger = logging.getLogger("verl_qerl")


def _patch_validate_config(module: ModuleType) -> None:
    original = module.validate_config
    if getattr(original, "_qerl_wrapped", False):
        return

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        from .config import apply_qerl

        apply_qerl(config)
        return original(config, *args, **kwargs)

    validate_config._qerl_wrapped = True  # type: ignore[attr-defined]
    module.validate_config = validate_config


def _register_trainer(module: ModuleType) -> None:
    from .trainer import register_trainer

    register_trainer(module)


def convert_for_lora(module, model_config):
    """Swap the Linear layers of the HF ``module`` for the QeRL mode's frozen base layers, in place."""
    from .config import QeRLConfig, _plain

    block = (_plain(getattr(model_config, "lora", None)) or {}).get("qerl")
    qerl = QeRLConfig.from_dict(block) if block else None
    if qerl is None or qerl.mode == "bf16":
        return qerl
    from ..modeling import quantize_model

    quantize_model(module, mode=qerl.mode, ignore=qerl.ignore, checkpoint=qerl.quantized_checkpoint)
    logger.warning("[verl-qerl] actor: Linear layers converted to %s (ignore=%s)", qerl.mode, list(qerl.ignore))
    return qerl


def _patch_fsdp_engine(module: ModuleType) -> None:
    engine_cls = module.FSDPEngine
    original = engine_cls._build_lora_module
    if getattr(original, "_qerl_wrapped", False):
        return

    @functools.wraps(original)
    def _build_lora_module(self, hf_module):
        qerl = convert_for_lora(hf_module, self.model_config)
        if qerl is None or qerl.mode != "nvfp4":
            return original(self, hf_module)
        from ..modeling import peft_custom_modules

        with peft_custom_modules():
            return original(self, hf_module)

    _build_lora_module._qerl_wrapped = True  # type: ignore[attr-defined]
    engine_cls._build_lora_module = _build_lora_module


def install_hooks() -> list[str]:
    """Install the post-import hooks; returns a short description of each."""
    when_imported("verl.utils.config", _patch_validate_config)
    when_imported("verl.trainer.ppo.v1.trainer_sync", _register_trainer)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _patch_fsdp_engine)
    return ["qerl config check", "trainer mode qerl_sync", "FSDP LoRA hook"]
