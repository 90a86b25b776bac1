"""The ``qerl`` config block for ``python -m verl.trainer.main_ppo`` and what it implies for verl.

Users write one block (``+qerl=nvfp4`` from the shipped hydra group, or ``+qerl.mode=nvfp4 ...``)::

    qerl:
      mode: nvfp4                 # nvfp4 (QeRL) | bf16 (plain LoRA) | nf4 (QLoRA)
      quantized_checkpoint: null  # an NVFP4 twin of a BF16 model.path to build the actor from (else quantize)
      ignore: [lm_head]           # modules kept in BF16
      scale_rule: bf16            # how BF16 weights are quantized (verl_qerl.nvfp4.SCALE_RULES), actor and vLLM alike
      aqn: {enable, sigma_start, sigma_end, num_stages, schedule, seed, apply_to, ...}

In the driver, before verl validates its own config, :func:`apply_qerl` checks the block against the
rest of the config (clear errors for combinations that cannot work) and fills in the verl settings
the mode needs — only where the user left verl's default, and with an error where they chose
something incompatible. It then copies the block to ``actor_rollout_ref.model.lora.qerl``, a
free-form dict that reaches the FSDP engine and the vLLM servers (top-level keys do not).

Where the nvfp4 base weights come from (no BF16 copy of the Linear weights in the first two):

* ``actor_rollout_ref.model.path`` = an NVFP4 checkpoint (compressed-tensors NVFP4A16 from
  ``qerl-quantize`` or ``benchmarks/rollout.py``'s writer, or ModelOpt NVFP4): the actor is built
  from its config on the meta device and filled from its tensors, vLLM loads it with
  ``qerl_nvfp4`` directly. The way to train a model whose BF16 checkpoint does not fit (32B on
  one 80 GB GPU). ``quantized_checkpoint`` stays null (or names the same folder); modes bf16 and
  nf4 are refused (there are no BF16 weights to train from).
* BF16 ``model.path`` + ``quantized_checkpoint`` = its NVFP4 twin: the actor is built from the
  twin the same way; vLLM reads the BF16 ``model.path`` and quantizes it at load (same numbers).
* BF16 ``model.path`` alone: verl loads it, the actor quantizes its Linear layers in place.

Wherever BF16 weights are quantized (the actor in place, vLLM at load), ``scale_rule`` says how and
``ignore`` which layers stay BF16, and both sides use them; non-default values reach vLLM through
``engine_kwargs.vllm.hf_overrides``. A BF16 ``model.path`` whose config.json declares a ``qerl_nvfp4``
quantize-at-load block sets them where the ``qerl`` values are the defaults (vLLM reads that block), and refuses
``qerl`` values that disagree with it. An
NVFP4 twin must have been made from ``model.path`` with that rule (recorded in its config.json by
``qerl-quantize``, otherwise checked on one layer), or the actor and vLLM would hold different weights.
"""

from __future__ import annotations

import logging
from typing import Any

from ..aqn import AQNConfig, schedule_table, short_run
from ..aqn.schedule import min_stages
from ..nvfp4.arch import DEFAULT_IGNORE
from ..nvfp4.checkpoint import matches_pattern
from ..vllm import VERL_WORKER_EXTENSION
from .model_path_checks import (
    check_ignore_against_model_path,
    check_ignore_against_nvfp4_base,
    check_ignore_matches,
    check_no_quantize_at_load_block,
    check_twin_folder,
    check_twin_scale_rule,
    checkpoint_format,
    follow_declared_block,
    nvfp4_base_source,
    vllm_quantize_at_load,
)
from .qerl_block import (
    AQN_NULL_MEANS_DEFAULT,
    CARRIER_PATH,
    CONFIG_GROUPS,
    HF_OVERRIDES,
    VLLM_QUANTIZATION,
    QeRLConfig,
    QeRLConfigError,
    get_key,
    read_qerl,
    set_key,
    to_plain,
)

__all__ = [  # (the block's names stay importable from here, where callers and the entry point have them)
    "AQN_NULL_MEANS_DEFAULT", "CARRIER_PATH", "CONFIG_GROUPS", "HF_OVERRIDES", "TRAINER_MODE", "VLLM_QUANTIZATION",
    "QeRLConfig", "QeRLConfigError", "apply_qerl", "check_ignore_matches", "checkpoint_format", "nvfp4_base_source",
    "read_qerl",
]

logger = logging.getLogger("verl_qerl")


def _default_target_modules() -> list[str]:
    """The projections of Qwen2/Llama decoder layers (peft's "all-linear" matches nn.Linear only)."""
    from ..modeling.lora import DEFAULT_LORA_TARGETS

    return list(DEFAULT_LORA_TARGETS)


TRAINER_MODE = "qerl_sync"


def _lora_rank(config: Any) -> int:
    """The LoRA rank verl's FSDP engine uses: ``model.lora_rank`` (it decides LoRA by ``lora_rank > 0`` alone); an
    error naming the key for anything but a whole number, and for a ``model.lora.rank`` (the Megatron engine's key)
    that disagrees with it: the FSDP actor would then train without LoRA (and without NVFP4) while vLLM serves one."""
    def as_int(key: str) -> int:
        value = get_key(config, key, 0)
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise QeRLConfigError(f"{key}={value!r}: must be an integer (the LoRA rank; the paper uses 32)")
        return value

    rank, megatron = as_int("actor_rollout_ref.model.lora_rank"), as_int("actor_rollout_ref.model.lora.rank")
    if megatron and megatron != rank:
        raise QeRLConfigError(f"actor_rollout_ref.model.lora.rank={megatron} but actor_rollout_ref.model.lora_rank="
                              f"{rank}: verl's FSDP engine reads lora_rank only; set lora_rank={megatron} (and "
                              "leave lora.rank unset or equal)")
    return rank


def _check_run_length(config: Any, qerl: QeRLConfig) -> None:
    """A run shorter than the AQN stages skips most of the schedule (one step: no noise at all).

    Refused here when ``trainer.total_training_steps`` fixes the length; otherwise verl derives it
    from the data set and the trainer warns once it knows (:class:`verl_qerl.verl.trainer.AQNDriver`).
    With ``qerl.aqn.total_steps`` the schedule spans that many steps instead (validated against the
    stages by :class:`AQNConfig`), so the question is whether the run gets to a noisy stage of it.
    """
    steps = get_key(config, "trainer.total_training_steps")
    if steps is None or isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        return
    if qerl.aqn.total_steps is not None:
        _check_run_reaches_noise(steps, qerl.aqn)
        return
    short = short_run(steps, qerl.aqn)
    if short:
        stages = qerl.aqn.num_stages
        raise QeRLConfigError(
            f"trainer.total_training_steps={steps} is fewer than qerl.aqn.num_stages={stages}: {short}; run at least "
            f"{stages} steps, lower qerl.aqn.num_stages (>= {min_stages(qerl.aqn.noise_from_start)}), or turn AQN off "
            "(qerl.aqn.enable=false)")


def _check_run_reaches_noise(steps: int, aqn: AQNConfig) -> None:
    """Refuse a run of ``steps`` that ends before the first noisy stage of a schedule spanning
    ``qerl.aqn.total_steps``: AQN would be on and add no noise, without a word. Runs that reach a
    noisy stage pass, however much of the schedule they leave out."""
    if not aqn.enable:
        return
    noisy = [row for row in schedule_table(aqn.total_steps, aqn) if row.sigma > 0 and row.first_step <= row.last_step]
    if not noisy or noisy[0].first_step <= steps:
        return  # (no noisy stage at all is AQNConfig's to refuse)
    first = noisy[0]
    raise QeRLConfigError(
        f"trainer.total_training_steps={steps} ends before the first noisy AQN step: qerl.aqn.total_steps="
        f"{aqn.total_steps} spreads qerl.aqn.num_stages={aqn.num_stages} stages over {aqn.total_steps} steps, and "
        f"stage {first.stage} (the first with noise) starts at step {first.first_step}, so the run gets no noise; "
        f"lower qerl.aqn.total_steps (or leave it unset: the schedule then spans the run), run at least "
        f"{first.first_step} steps, or turn AQN off (qerl.aqn.enable=false)")


def _check_packed_attention(config: Any) -> None:
    """``attn_implementation=qerl_varlen`` serves packed rows only: it needs ``use_remove_padding=True``.

    transformers drops the padding mask for an attention it has no mask builder for, so a padded batch would
    otherwise reach it without its mask.
    """
    from .varlen_attention import QERL_VARLEN

    attn = get_key(config, "actor_rollout_ref.model.override_config.attn_implementation")
    if attn == QERL_VARLEN and not get_key(config, "actor_rollout_ref.model.use_remove_padding", True):
        raise QeRLConfigError(f"actor_rollout_ref.model.override_config.attn_implementation={QERL_VARLEN} with "
                              "actor_rollout_ref.model.use_remove_padding=False: this attention takes packed "
                              "sequences only; set use_remove_padding=True (or use attn_implementation=sdpa)")


def apply_qerl(config: Any) -> QeRLConfig | None:
    """Validate the ``qerl`` block against a composed verl config and fill in what the mode implies.

    Returns the parsed block, or None when the config has none (the plugin then changes nothing).
    """
    qerl = read_qerl(config)
    if qerl is None:
        return None
    changes: list[str] = []
    rank = _lora_rank(config)
    if rank <= 0:
        raise QeRLConfigError(
            f"actor_rollout_ref.model.lora_rank={rank} with qerl.mode={qerl.mode}: QeRL trains LoRA adapters on a "
            "frozen base, so set a rank > 0 (the paper uses 32)"
        )
    if qerl.mode == "nf4" and tuple(qerl.ignore) != tuple(DEFAULT_IGNORE):
        raise QeRLConfigError(f"qerl.ignore={list(qerl.ignore)} with qerl.mode=nf4: vLLM's bitsandbytes keeps only its "
                              f"own default ({list(DEFAULT_IGNORE)}) dense, so the rollout would sample from other "
                              "weights than the actor trains; leave qerl.ignore at its default with nf4")
    if qerl.mode == "nvfp4" and not matches_pattern("lm_head", qerl.ignore):
        raise QeRLConfigError(f"qerl.ignore={list(qerl.ignore)} leaves out lm_head: the actor would train on an NVFP4 "
                              "LM head while vLLM's LM head is never a quantized layer (it samples from the BF16 "
                              "one); keep lm_head in qerl.ignore, e.g. qerl.ignore=[lm_head,down_proj]")
    _check_run_length(config, qerl)
    nvfp4_base_source(get_key(config, "actor_rollout_ref.model.path"), qerl)
    check_no_quantize_at_load_block(config, qerl)
    qerl = follow_declared_block(config, qerl, changes)
    check_ignore_against_model_path(config, qerl)
    if qerl.mode == "nvfp4":
        check_twin_folder(qerl)
        check_ignore_against_nvfp4_base(config, qerl)
        check_twin_scale_rule(config, qerl)
    rollout = get_key(config, "actor_rollout_ref.rollout.name")
    if rollout != "vllm":
        raise QeRLConfigError(f"actor_rollout_ref.rollout.name={rollout!r}: QeRL rolls out on vLLM; set it to 'vllm'")
    if not get_key(config, "trainer.use_v1", True):
        raise QeRLConfigError("trainer.use_v1=false: the QeRL trainer hook is a v1 trainer mode; use the v1 trainer")
    if get_key(config, "actor_rollout_ref.model.lora.merge", False):
        raise QeRLConfigError("actor_rollout_ref.model.lora.merge=true: adapters cannot be merged into a 4-bit base; "
                              "leave it false (only LoRA tensors are synced to vLLM)")
    _check_packed_attention(config)
    strategy = get_key(config, "actor_rollout_ref.actor.strategy")
    if strategy not in ("fsdp", "fsdp2"):
        raise QeRLConfigError(f"actor_rollout_ref.actor.strategy={strategy!r}: QeRL's actor hook is for the FSDP "
                              "engine; use fsdp2 (or fsdp)")
    mode_now = get_key(config, "trainer.v1.trainer_mode", "sync")
    if mode_now not in ("sync", TRAINER_MODE):
        raise QeRLConfigError(f"trainer.v1.trainer_mode={mode_now!r}: QeRL supports the 'sync' trainer (it runs as "
                              f"'{TRAINER_MODE}', which drives AQN per step)")
    if mode_now != TRAINER_MODE:
        set_key(config, "trainer.v1.trainer_mode", TRAINER_MODE, changes)

    if get_key(config, "actor_rollout_ref.model.target_modules") == "all-linear":
        set_key(config, "actor_rollout_ref.model.target_modules", _default_target_modules(), changes)
    load_format = get_key(config, "actor_rollout_ref.rollout.load_format", "dummy")
    if "dummy" in str(load_format):
        # vLLM must read the real base weights once; afterwards only LoRA tensors travel each step
        set_key(config, "actor_rollout_ref.rollout.load_format", "safetensors", changes)

    vllm_kwargs = to_plain(get_key(config, "actor_rollout_ref.rollout.engine_kwargs.vllm", {})) or {}
    want_quant = VLLM_QUANTIZATION[qerl.mode]
    have_quant = vllm_kwargs.get("quantization")
    if have_quant not in (None, want_quant):
        raise QeRLConfigError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.quantization={have_quant!r} conflicts "
                              f"with qerl.mode={qerl.mode} (which needs {want_quant!r})")
    if want_quant and have_quant is None:
        set_key(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.quantization", want_quant, changes)
    vllm_quantize_at_load(config, qerl, changes)
    rollout_quant = get_key(config, "actor_rollout_ref.rollout.quantization")
    if rollout_quant is not None:
        raise QeRLConfigError(f"actor_rollout_ref.rollout.quantization={rollout_quant!r}: leave it null; QeRL "
                              "selects the vLLM method from qerl.mode")
    ext = vllm_kwargs.get("worker_extension_cls")
    if ext not in (None, VERL_WORKER_EXTENSION):
        raise QeRLConfigError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={ext!r}: QeRL "
                              f"needs {VERL_WORKER_EXTENSION} (a subclass of verl's extension)")
    if ext is None:
        set_key(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls", VERL_WORKER_EXTENSION,
                changes)

    set_key(config, ".".join(CARRIER_PATH), qerl.to_dict(), changes[:0])  # the carrier is not a user setting
    if changes:
        logger.warning("[verl-qerl] qerl.mode=%s%s sets: %s", qerl.mode,
                       " + AQN" if qerl.aqn.enable else "", ", ".join(changes))
    return qerl
