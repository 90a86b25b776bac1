"""The places QeRL hooks into verl 0.9.1, each installed as a post-import hook.

1. ``verl.utils.config.validate_config`` (driver): :func:`verl_qerl.verl.config.apply_qerl` checks the
   ``qerl`` block and fills in what its mode implies before verl validates the config.
2. ``verl.trainer.ppo.v1.trainer_sync`` (TaskRunner): registers the ``qerl_sync`` trainer mode.
3. ``FSDPEngine._build_lora_module`` (training workers): converts the model's Linear layers to the
   mode's frozen base (``NVFP4Linear`` for nvfp4, bitsandbytes NF4 for nf4) right before verl calls
   ``get_peft_model``, and lets peft wrap them. This is the one patch verl cannot avoid today
   (``patches/`` has the upstream hook that replaces it).
4. ``FSDPEngine._build_module`` (training workers): when the actor's weights come from an NVFP4
   checkpoint (``model.path`` itself, or ``qerl.quantized_checkpoint``), the module is built from
   the config with its parameters on the meta device and filled from that checkpoint
   (``NVFP4Linear`` buffers copied, everything else in verl's dtype), instead of verl's
   ``from_pretrained``: no dense copy of the Linear weights ever exists. Hook 3 then finds the
   layers already converted and only wraps them in LoRA.
5. ``FSDPEngine._build_fsdp_module`` (training workers, ``strategy=fsdp2``, nvfp4 with
   ``qerl.shard_base``): right before verl's ``apply_fsdp2`` wraps the decoder layers, every
   ``NVFP4Linear`` becomes an FSDP2 unit of its own holding 1/N of the quantized rows
   (:func:`verl_qerl.modeling.fsdp.shard_nvfp4_base`), with verl's mesh, offload policy and
   ``reshard_after_forward``. verl then shards and loads the rest as usual (its
   ``set_model_state_dict`` broadcast fills the sharded base too).
6. The FSDP engine module again (training workers, every mode, BF16 LoRA included): on machines without
   flash-attn, the ``qerl_varlen`` attention for packed rows and chunked token log-probs in place of verl's
   per-row loop (:func:`_install_no_flash_attn_paths`).
"""

from __future__ import annotations

import functools
import logging
import os
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


def _qerl_of(model_config):
    from .qerl_block import QeRLConfig, to_plain

    block = (to_plain(getattr(model_config, "lora", None)) or {}).get("qerl")
    return QeRLConfig.from_dict(block) if block else None


def nvfp4_actor_source(model_config, qerl=None):
    """The checkpoint folder the nvfp4 actor is built from without a dense copy, or None (verl loads
    ``model.path`` in BF16 and hook 3 quantizes it): :func:`~verl_qerl.verl.model_path_checks.nvfp4_base_source`
    of the worker's local copy of ``model.path``."""
    from .model_path_checks import nvfp4_base_source

    qerl = qerl if qerl is not None else _qerl_of(model_config)
    if qerl is None or qerl.mode != "nvfp4":
        return None
    local = getattr(model_config, "local_path", None) or getattr(model_config, "path", None)
    return nvfp4_base_source(local, qerl)


def build_nvfp4_actor(auto_class, source, qerl, *, torch_dtype, config, trust_remote_code=False,
                      pretrained_model_name_or_path=None):
    """``auto_class.from_pretrained`` for the nvfp4 actor: from ``config`` on meta, filled from ``source``.

    Inside verl's init context: on a rank that builds on the meta device (``init_empty_weights``),
    meta shells that FSDP fills by broadcast from rank 0; elsewhere the real weights.
    """
    import torch

    from ..modeling.model_conversion import build_nvfp4_model

    probe = torch.nn.Module()
    probe.register_parameter("p", torch.nn.Parameter(torch.empty(1)))
    on_meta = probe.p.is_meta  # accelerate's init_empty_weights (verl's context on ranks that get a broadcast)
    model = build_nvfp4_model(config, source, dtype=torch_dtype, ignore=qerl.ignore, auto_class=auto_class,
                              meta=on_meta, trust_remote_code=trust_remote_code)
    gen = None if pretrained_model_name_or_path is None else os.path.join(pretrained_model_name_or_path,
                                                                          "generation_config.json")
    if gen is not None and os.path.isfile(gen):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path)
    logger.warning("[verl-qerl] actor: built from the NVFP4 checkpoint %s on %s (dtype %s; no dense Linear "
                   "weights)", source, "meta (filled by broadcast)" if on_meta else "cpu", torch_dtype)
    return model


class _NVFP4AutoClass:
    """Stands in for verl's HF auto class during ``_build_module``: ``from_pretrained`` builds the nvfp4 actor."""

    def __init__(self, auto_class, source, qerl) -> None:
        self._auto_class, self._source, self._qerl = auto_class, source, qerl

    def from_pretrained(self, pretrained_model_name_or_path=None, *args, torch_dtype=None, config=None,
                        trust_remote_code=False, **kwargs):
        if args or config is None:
            raise TypeError("verl-qerl: unexpected from_pretrained call in FSDPEngine._build_module "
                            f"(args={args}, config={'set' if config is not None else None}); verl changed?")
        return build_nvfp4_actor(self._auto_class, self._source, self._qerl, torch_dtype=torch_dtype or kwargs.get(
            "dtype"), config=config, trust_remote_code=trust_remote_code,
            pretrained_model_name_or_path=pretrained_model_name_or_path)

    def __getattr__(self, name):
        return getattr(self._auto_class, name)


def convert_for_lora(module, model_config):
    """Swap the Linear layers of the HF ``module`` for the QeRL mode's frozen base layers, in place."""
    qerl = _qerl_of(model_config)
    if qerl is None or qerl.mode == "bf16":
        return qerl
    from ..modeling import NVFP4Linear, quantize_model

    if qerl.mode == "nvfp4" and any(isinstance(m, NVFP4Linear) for m in module.modules()):
        logger.warning("[verl-qerl] actor: Linear layers already NVFP4 (built from the checkpoint); LoRA only")
        return qerl

    import time

    import torch

    from .model_path_checks import check_ignore_matches

    check_ignore_matches([n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)], qerl)
    # verl builds the actor on the CPU; quantizing 7B of weights there took ~280 s of a GRPO run's start-up (the
    # same torch ops on the worker's GPU give the same bits in seconds; NOTES "Sixteenth round")
    on = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    quantize_model(module, mode=qerl.mode, ignore=qerl.ignore, checkpoint=qerl.quantized_checkpoint,
                   scale_rule=qerl.scale_rule, compute_device=on if qerl.mode == "nvfp4" else None)
    logger.warning("[verl-qerl] actor: Linear layers converted to %s (ignore=%s, scale rule %s) in %.1f s on %s",
                   qerl.mode, list(qerl.ignore), qerl.scale_rule, time.perf_counter() - t0,
                   on if on is not None and qerl.mode == "nvfp4" else "the model's device")
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

    original_build = engine_cls._build_module
    if getattr(original_build, "_qerl_wrapped", False):
        return

    @functools.wraps(original_build)
    def _build_module(self):
        qerl = _qerl_of(self.model_config)
        source = nvfp4_actor_source(self.model_config, qerl)
        if source is None or getattr(self.model_config, "model_type", "language_model") != "language_model":
            return original_build(self)
        import verl.utils.model as verl_model

        get_class = verl_model.get_hf_auto_model_class

        def get_hf_auto_model_class(*args, **kwargs):
            return _NVFP4AutoClass(get_class(*args, **kwargs), source, qerl)

        verl_model.get_hf_auto_model_class = get_hf_auto_model_class  # _build_module imports it at call time
        try:
            return original_build(self)
        finally:
            verl_model.get_hf_auto_model_class = get_class

    _build_module._qerl_wrapped = True  # type: ignore[attr-defined]
    engine_cls._build_module = _build_module

    original_fsdp = engine_cls._build_fsdp_module
    if getattr(original_fsdp, "_qerl_wrapped", False):
        return

    @functools.wraps(original_fsdp)
    def _build_fsdp_module(self, hf_module):
        qerl = _qerl_of(self.model_config)
        if (qerl is None or qerl.mode != "nvfp4" or not qerl.shard_base
                or getattr(self.engine_config, "strategy", None) != "fsdp2"):
            return original_fsdp(self, hf_module)
        verl_apply = module.apply_fsdp2  # _build_fsdp_module reads it from its module's globals at call time

        def apply_fsdp2(model, fsdp_kwargs, config):
            shard_base_for_verl(model, fsdp_kwargs)
            return verl_apply(model, fsdp_kwargs, config)

        module.apply_fsdp2 = apply_fsdp2
        try:
            return original_fsdp(self, hf_module)
        finally:
            module.apply_fsdp2 = verl_apply

    _build_fsdp_module._qerl_wrapped = True  # type: ignore[attr-defined]
    engine_cls._build_fsdp_module = _build_fsdp_module


def shard_base_for_verl(model, fsdp_kwargs: dict) -> int:
    """:func:`~verl_qerl.modeling.fsdp.shard_nvfp4_base` with the FSDP2 settings verl gives its layers.

    ``fsdp_kwargs`` is what verl's ``_build_fsdp_module`` passes to ``apply_fsdp2`` (``mesh``,
    ``offload_policy``, ``reshard_after_forward``; its ``mp_policy`` is not used: the base's units
    cast nothing). Returns the number of layers sharded (0: the model has no ``NVFP4Linear``, or the mesh has
    one rank, where the base stays in buffers: sharding over one rank saves nothing and costs time).
    """
    from ..modeling.fsdp import base_bytes, nvfp4_layers, shard_nvfp4_base

    if not nvfp4_layers(model):
        return 0
    mesh = fsdp_kwargs.get("mesh")
    if mesh is not None and mesh.size() == 1:
        # One rank holds every row anyway; the units would only add their per-layer hooks and gather copies to
        # each pass (2-6 % of a 7B LoRA step on one H200: benchmarks/train_step.py --fsdp2, benchmarks/NOTES.md).
        logger.warning("[verl-qerl] actor: NVFP4 base kept whole (one FSDP2 rank: qerl.shard_base has nothing to "
                       "shard)")
        return 0
    layers = shard_nvfp4_base(model, mesh=mesh, offload_policy=fsdp_kwargs.get("offload_policy"),
                              reshard_after_forward=fsdp_kwargs.get("reshard_after_forward", True))
    held = base_bytes(layers)
    # one line per rank, parsed by benchmarks/grpo_step_results.py (actor_base_gb_per_rank)
    logger.warning("[verl-qerl] actor: NVFP4 base of %d layers sharded over %s FSDP2 ranks (gathered per layer); "
                   "this rank holds %d of %d base bytes", len(layers), mesh.size() if mesh is not None else "all",
                   held["local"], held["total"])
    return len(layers)


def _install_no_flash_attn_paths(module: ModuleType) -> None:
    """Where flash-attn is missing: the ``qerl_varlen`` attention, and chunked token log-probs.

    Registers :data:`~verl_qerl.verl.varlen_attention.QERL_VARLEN` with transformers (PyTorch's own packed
    FlashAttention-2; selected by config, :func:`verl_qerl.verl.launch.varlen_overrides`), and, when verl has
    neither flash-attn's cross-entropy kernel nor the NPU one, replaces its per-row Python loop
    (``logprobs_from_logits_v2``) by :func:`verl_qerl.verl.logprobs.verl_logprobs_from_logits` in verl's
    ``torch_functional`` and in the FSDP engine module (which imported the name).
    """
    from . import varlen_attention

    varlen_attention.register()
    import verl.utils.torch_functional as verl_F

    if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE or getattr(verl_F, "NPU_CROSS_ENTROPY_LOSS_AVAILABLE", False):
        return
    from .logprobs import verl_logprobs_from_logits

    verl_F.logprobs_from_logits = verl_logprobs_from_logits
    if hasattr(module, "logprobs_from_logits"):
        module.logprobs_from_logits = verl_logprobs_from_logits


def _register_hydra_search_path(module: ModuleType) -> None:
    """Register the search-path plugin that adds the ``qerl`` config group with hydra by hand as well: hydra finds it
    by scanning the ``hydra_plugins`` namespace package, which setuptools' editable installs (``pip install -e``,
    setuptools >= 64) hide from that scan outside the repository folder (hydra issue #2359), and ``+qerl=nvfp4``
    would then set the string ``qerl: nvfp4`` instead of the group."""
    plugins = module.Plugins.instance()  # hydra's own scan runs here
    name = "hydra_plugins.verl_qerl.verl_qerl_searchpath.VerlQeRLSearchPathPlugin"
    if name in getattr(plugins, "class_name_to_class", {}):
        return  # the scan found it (a regular install, or run from the repository folder): once is enough
    from hydra_plugins.verl_qerl.verl_qerl_searchpath import VerlQeRLSearchPathPlugin

    plugins.register(VerlQeRLSearchPathPlugin)


def install_hooks() -> list[str]:
    """Install the post-import hooks; returns a short description of each."""
    when_imported("verl.utils.config", _patch_validate_config)
    when_imported("verl.trainer.ppo.v1.trainer_sync", _register_trainer)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _patch_fsdp_engine)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _install_no_flash_attn_paths)
    when_imported("hydra.core.plugins", _register_hydra_search_path)
    return ["qerl config group", "qerl config check", "trainer mode qerl_sync", "FSDP LoRA hook",
            "FSDP NVFP4 model build", "FSDP2 NVFP4 base sharding", "no-flash-attn attention and log-probs"]
