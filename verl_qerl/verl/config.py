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

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..aqn import AQNConfig, schedule_table, short_run
from ..aqn.schedule import min_stages
from ..modeling.model_conversion import MODES
from ..nvfp4.arch import DEFAULT_IGNORE
from ..nvfp4.checkpoint import PatternError, check_patterns, matches_pattern
from ..nvfp4.quant_config import FORMAT_BF16
from ..nvfp4.quantize import DEFAULT_SCALE_RULE, SCALE_RULES
from ..vllm import METHOD_NAME, VERL_WORKER_EXTENSION

logger = logging.getLogger("verl_qerl")


def _default_target_modules() -> list[str]:
    """The projections of Qwen2/Llama decoder layers (peft's "all-linear" matches nn.Linear only)."""
    from ..modeling.lora import DEFAULT_LORA_TARGETS

    return list(DEFAULT_LORA_TARGETS)


TRAINER_MODE = "qerl_sync"
VLLM_QUANTIZATION = {"nvfp4": METHOD_NAME, "nf4": "bitsandbytes", "bf16": None}
#: The ``qerl`` config group's options (verl_qerl/verl/hydra/qerl/*.yaml).
CONFIG_GROUPS = ("nvfp4", "nvfp4_noaqn", "bf16", "nf4")

#: AQN keys the group yamls ship as null, meaning the AQN default: hydra refuses ``+qerl.aqn.<key>=...`` for a key
#: that holds a non-null scalar, and existing command lines add these with ``+``.
AQN_NULL_MEANS_DEFAULT = ("include_final_norm", "rounding")

#: Where the engine and the vLLM servers find the block.
CARRIER_PATH = ("actor_rollout_ref", "model", "lora", "qerl")
#: vLLM's config overrides; its ``quantization_config`` replaces the one model.path's config.json declares.
HF_OVERRIDES = "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides"


class QeRLConfigError(ValueError):
    """A QeRL setting that cannot work with the rest of the config; the message names the key."""


@dataclass(frozen=True)
class QeRLConfig:
    mode: str = "nvfp4"
    quantized_checkpoint: str | None = None
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    #: how BF16 weights are quantized to NVFP4, by the actor and by vLLM alike (verl_qerl.nvfp4.SCALE_RULES)
    scale_rule: str = DEFAULT_SCALE_RULE
    #: AQN on by default, as a block without ``aqn`` (:meth:`from_dict`) and the README have it
    aqn: AQNConfig = field(default_factory=AQNConfig)
    #: seconds between the sync trainer's checks for finished rollouts. verl 0.9.1's ReplayBuffer polls every
    #: 2.0 s, so every step's rollout phase is rounded up to a multiple of 2 s (seen on H200: 25M-model steps log
    #: gen = 4.05 / 6.05 / 10.05 s, 7B ones 6.2 / 8.2 s); the qerl_sync trainer sets this interval instead.
    replay_poll_s: float = 0.1
    #: nvfp4 under FSDP2: store 1/N of the quantized base per rank and all-gather it per layer
    #: (:func:`verl_qerl.modeling.fsdp.shard_nvfp4_base`); false keeps the whole base on every rank. On a
    #: one-rank mesh the base is kept whole either way (nothing to shard; the units would only cost time).
    #: FSDP1 (``strategy=fsdp``) always keeps it whole.
    shard_base: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.shard_base, bool):
            raise QeRLConfigError(f"qerl.shard_base={self.shard_base!r}: must be true or false")
        poll = self.replay_poll_s
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < float(poll) <= 10:
            raise QeRLConfigError(f"qerl.replay_poll_s={self.replay_poll_s!r}: must be seconds in (0, 10]")
        if self.mode not in MODES:
            raise QeRLConfigError(f"qerl.mode={self.mode!r}: unknown mode; choose one of {', '.join(MODES)}")
        if self.scale_rule not in SCALE_RULES:
            raise QeRLConfigError(f"qerl.scale_rule={self.scale_rule!r}: unknown NVFP4 scale rule; choose one of "
                                  f"{', '.join(SCALE_RULES)}")
        if self.quantized_checkpoint is not None and self.mode != "nvfp4":
            raise QeRLConfigError(f"qerl.quantized_checkpoint is only used with qerl.mode=nvfp4, not {self.mode!r}")
        if self.mode != "nvfp4":
            # read by the nvfp4 path only: elsewhere a changed value would be dropped without a word
            unused = [f"qerl.{key}={value!r}" for key, value, default in (
                ("scale_rule", self.scale_rule, DEFAULT_SCALE_RULE), ("shard_base", self.shard_base, True))
                if value != default]
            if unused:
                raise QeRLConfigError(f"{unused[0]} is only used with qerl.mode=nvfp4 (it sets how the NVFP4 base is "
                                      f"quantized / stored), not {self.mode!r}; leave it at its default")
        try:
            object.__setattr__(self, "ignore", tuple(check_patterns(self.ignore, "qerl.ignore")))
        except PatternError as err:
            raise QeRLConfigError(str(err)) from err
        if self.mode == "bf16" and self.ignore != tuple(DEFAULT_IGNORE):
            raise QeRLConfigError(f"qerl.ignore={list(self.ignore)} with qerl.mode=bf16: nothing is quantized in this "
                                  "mode, so the list would be ignored; leave qerl.ignore at its default "
                                  f"({list(DEFAULT_IGNORE)})")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> QeRLConfig:
        if not isinstance(values, Mapping):
            if isinstance(values, str) and values in CONFIG_GROUPS:
                raise QeRLConfigError(
                    f"qerl={values!r}: hydra did not find verl-qerl's `qerl` config group, so +qerl={values} set a "
                    "string instead of the group's settings. The group is added by hydra_plugins/verl_qerl (found by "
                    "hydra's plugin scan) and by the verl plugin where it is loaded before hydra composes; check "
                    "that `pip show verl-qerl` lists this environment and that the driver logs '[verl-qerl ...] "
                    "plugin active'")
            raise QeRLConfigError(f"qerl={values!r}: expected a block of settings (e.g. +qerl=nvfp4 picks the "
                                  "nvfp4 group; single keys as qerl.mode=nvfp4)")
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise QeRLConfigError(f"qerl.{unknown[0]}: unknown key; known keys are {sorted(known)}")
        # only a missing block means the defaults: qerl.aqn=false / null read as "AQN off" but would turn it on
        aqn = values.pop("aqn", {})
        if not isinstance(aqn, (Mapping, AQNConfig)):
            raise QeRLConfigError(f"qerl.aqn={aqn!r}: expected a block of AQN settings (e.g. qerl.aqn.sigma_end=1e-4); "
                                  "to turn AQN off set qerl.aqn.enable=false")
        if isinstance(aqn, Mapping):
            # the group yamls ship these as null (= the default) so that hydra's `+qerl.aqn.<key>=` still works
            aqn = {k: v for k, v in aqn.items() if not (k in AQN_NULL_MEANS_DEFAULT and v is None)}
        try:
            aqn_cfg = aqn if isinstance(aqn, AQNConfig) else AQNConfig.from_dict(dict(aqn))
        except ValueError as err:
            raise QeRLConfigError(f"qerl.aqn: {err}") from err
        ignore = values.pop("ignore", DEFAULT_IGNORE) or ()
        if isinstance(ignore, str):
            ignore = [ignore]
        if not isinstance(ignore, Sequence):  # (a list, a tuple, OmegaConf's ListConfig)
            raise QeRLConfigError(f"qerl.ignore={ignore!r}: expected a list of module name patterns (e.g. "
                                  "qerl.ignore=[lm_head,down_proj])")
        return cls(aqn=aqn_cfg, ignore=tuple(ignore), **values)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "quantized_checkpoint": self.quantized_checkpoint, "ignore": list(self.ignore),
                "scale_rule": self.scale_rule, "aqn": self.aqn.to_dict(), "replay_poll_s": self.replay_poll_s,
                "shard_base": self.shard_base}


def _plain(node: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra/verl
        pass
    return node


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
        except Exception:  # noqa: BLE001 - missing/interpolation errors read as "unset"
            return default
    return default if node is None else node


def read_qerl(config: Any) -> QeRLConfig | None:
    """The QeRL block of a verl config (top level or the carrier), or None when QeRL is off."""
    block = _get(config, "qerl")
    if block is None:
        block = _get(config, ".".join(CARRIER_PATH))
    if block is None:
        return None
    return QeRLConfig.from_dict(_plain(block))


def checkpoint_format(path: Any) -> str | None:
    """The weight format of a local checkpoint folder (one of
    :data:`~verl_qerl.nvfp4.quant_config.CHECKPOINT_FORMATS`, read as vLLM's ``qerl_nvfp4`` reads
    it), or None when ``path`` is not a local folder with a config.json (a hub id or a remote path:
    verl copies it later and the actor hook checks it then)."""
    from pathlib import Path

    from ..nvfp4.checkpoint import CheckpointError, detect_format, read_config_json

    if not path:
        return None
    folder = Path(str(path)).expanduser()
    if not (folder / "config.json").is_file():
        return None
    try:
        return detect_format(read_config_json(folder / "config.json"), folder)
    except CheckpointError as err:
        raise QeRLConfigError(f"actor_rollout_ref.model.path={str(path)!r}: {err}") from err


def nvfp4_base_source(path: Any, qerl: QeRLConfig) -> str | None:
    """The NVFP4 checkpoint the actor's base is built from, given ``model.path`` (or the worker's local
    copy of it): ``path`` itself when it is an NVFP4 checkpoint, else ``qerl.quantized_checkpoint``
    (None: the actor quantizes the BF16 weights verl loads).

    The one check of the two sources, run by the driver's config check and again by the actor hook:
    an NVFP4 ``path`` works only as the nvfp4 base (it holds no BF16 weights to train from), and
    ``qerl.quantized_checkpoint`` may then only name the same folder.
    """
    from pathlib import Path

    fmt = checkpoint_format(path)
    if fmt in (None, FORMAT_BF16):
        return qerl.quantized_checkpoint
    if qerl.mode != "nvfp4":
        raise QeRLConfigError(
            f"actor_rollout_ref.model.path={str(path)!r} is an NVFP4 checkpoint ({fmt}), but qerl.mode={qerl.mode} "
            "trains from BF16 weights, which it does not have: use qerl.mode=nvfp4, or point "
            "actor_rollout_ref.model.path at the BF16 model")
    qc = qerl.quantized_checkpoint
    if qc and Path(str(qc)).expanduser().resolve() != Path(str(path)).expanduser().resolve():
        raise QeRLConfigError(
            f"qerl.quantized_checkpoint={qc!r} with actor_rollout_ref.model.path={str(path)!r}, which is already an "
            "NVFP4 checkpoint: the actor and vLLM both load model.path; leave qerl.quantized_checkpoint null")
    return str(path)


def _lora_rank(config: Any) -> int:
    """The LoRA rank verl's FSDP engine uses: ``model.lora_rank`` (it decides LoRA by ``lora_rank > 0`` alone); an
    error naming the key for anything but a whole number, and for a ``model.lora.rank`` (the Megatron engine's key)
    that disagrees with it: the FSDP actor would then train without LoRA (and without NVFP4) while vLLM serves one."""
    def as_int(key: str) -> int:
        value = _get(config, key, 0)
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
    steps = _get(config, "trainer.total_training_steps")
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


def _check_twin_folder(qerl: QeRLConfig) -> None:
    """``qerl.quantized_checkpoint`` as the driver sees it: a folder with a config.json, or refused now rather than
    when the training workers start (minutes later); a path the driver does not see at all (a worker-only disk) is
    only warned about."""
    from pathlib import Path

    twin = qerl.quantized_checkpoint
    if not twin:
        return
    folder = Path(str(twin)).expanduser()
    if not folder.exists():
        logger.warning("[verl-qerl] qerl.quantized_checkpoint=%s does not exist on the driver; the actor workers "
                       "must find it there (a local folder of an NVFP4 checkpoint, e.g. from qerl-quantize)", twin)
        return
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise QeRLConfigError(f"qerl.quantized_checkpoint={str(twin)!r}: not a checkpoint folder (a folder with "
                              "config.json and *.safetensors, e.g. what qerl-quantize writes)")


def _check_twin_scale_rule(config: Any, qerl: QeRLConfig) -> None:
    """A BF16 ``model.path``'s NVFP4 twin must be what vLLM makes of ``model.path`` under ``qerl.scale_rule``."""
    from pathlib import Path

    from ..nvfp4.checkpoint import CheckpointReader, matching_scale_rules, recorded_scale_rule

    path, twin = _get(config, "actor_rollout_ref.model.path"), qerl.quantized_checkpoint
    if not twin or checkpoint_format(path) != FORMAT_BF16 or checkpoint_format(twin) in (None, FORMAT_BF16):
        return
    twin_reader = CheckpointReader(Path(str(twin)).expanduser())
    recorded = recorded_scale_rule(twin_reader.config)
    if recorded is not None:
        rules, how = [recorded], "its config.json records"
    else:
        rules = matching_scale_rules(twin_reader, CheckpointReader(Path(str(path)).expanduser()))
        how = "re-quantizing one layer of model.path matches"
    if qerl.scale_rule in rules:
        return
    if rules:
        raise QeRLConfigError(
            f"qerl.quantized_checkpoint={twin!r} was made with scale rule {rules[0]!r} ({how} it), but "
            f"qerl.scale_rule={qerl.scale_rule!r}: vLLM would quantize actor_rollout_ref.model.path differently from "
            f"the actor's weights; set qerl.scale_rule={rules[0]}")
    logger.warning("[verl-qerl] qerl.quantized_checkpoint=%s is not what either NVFP4 scale rule makes of "
                   "actor_rollout_ref.model.path=%s (calibrated scales, or another model?): the actor will hold its "
                   "weights, vLLM its own quantization of model.path", twin, path)


def check_ignore_matches(linear: list[str], qerl: QeRLConfig) -> None:
    """Each ``qerl.ignore`` pattern beyond the default keeps a Linear layer of the model in BF16 (a misspelling
    would leave them quantized, silently), and no fused group is split; otherwise a :class:`QeRLConfigError`."""
    from ..nvfp4.checkpoint import PatternError, check_ignore

    try:
        check_ignore(linear, qerl.ignore, "qerl.ignore", must_match=[p for p in qerl.ignore if p not in DEFAULT_IGNORE])
    except PatternError as err:
        raise QeRLConfigError(str(err)) from err


def _check_ignore_against_model_path(config: Any, qerl: QeRLConfig) -> None:
    """:func:`check_ignore_matches` on ``model.path``'s architecture where its config.json is local (a hub id or
    a remote path: the actor hook checks on the built model)."""
    from pathlib import Path

    from ..nvfp4.checkpoint import read_config_json

    path = _get(config, "actor_rollout_ref.model.path")
    if qerl.mode != "nvfp4" or tuple(qerl.ignore) == tuple(DEFAULT_IGNORE) or not path:
        return
    cfg_file = Path(str(path)).expanduser() / "config.json"
    if not cfg_file.is_file():
        return
    from ..checkpoint_conversion import linear_module_names

    model_config = read_config_json(cfg_file)
    for key in ("quantization_config", "compression_config"):
        model_config.pop(key, None)
    try:
        linear = linear_module_names(model_config)
    except ValueError:
        return  # an architecture the actor hook refuses with its own message
    check_ignore_matches(linear, qerl)


def _check_ignore_against_nvfp4_base(config: Any, qerl: QeRLConfig) -> None:
    """``qerl.ignore`` against the NVFP4 checkpoint the actor's base is read from (an NVFP4 ``model.path``, else
    ``qerl.quantized_checkpoint``), where the driver sees it: a layer the list keeps in BF16 that the checkpoint stores
    in NVFP4 has no BF16 weight to train from. Refused here, naming the key, the folder and the layers; the actor
    would otherwise fail only after Ray and vLLM started, with an error about ``ignore=``. Reads config.json and
    the shard headers (tensor names) only."""
    from pathlib import Path

    from ..nvfp4.checkpoint import CheckpointError, CheckpointReader

    path = _get(config, "actor_rollout_ref.model.path")
    base = nvfp4_base_source(path, qerl)
    if not base or checkpoint_format(base) in (None, FORMAT_BF16):
        return  # no NVFP4 base, or one the driver does not see (the actor hook meets it)
    key = "actor_rollout_ref.model.path" if base == str(path) else "qerl.quantized_checkpoint"
    try:
        stored = CheckpointReader(Path(str(base)).expanduser()).nvfp4_modules()
    except CheckpointError as err:
        raise QeRLConfigError(f"{key}={str(base)!r}: {err}") from err
    conflicts = [m for m in stored if matches_pattern(m, qerl.ignore)]
    if not conflicts:
        return
    patterns = [p for p in qerl.ignore if any(matches_pattern(m, [p]) for m in conflicts)]
    flags = " ".join(f"--ignore {p}" for p in patterns if p not in DEFAULT_IGNORE)
    raise QeRLConfigError(
        f"qerl.ignore={list(qerl.ignore)} keeps {len(conflicts)} layer(s) in BF16 that {key}={str(base)!r} stores in "
        f"NVFP4 (e.g. {', '.join(conflicts[:3])}; pattern(s) {patterns}): the checkpoint holds no BF16 weights for "
        f"them to train from; drop {patterns} from qerl.ignore, or quantize the BF16 model again keeping them dense "
        f"(qerl-quantize SRC DST {flags or '--ignore PATTERN'}) and point {key} at that folder")


def _follow_declared_block(config: Any, qerl: QeRLConfig, changes: list[str]) -> QeRLConfig:
    """``qerl`` with the ignore list / scale rule that a local BF16 ``model.path`` declares in a ``qerl_nvfp4``
    quantize-at-load ``quantization_config`` of its config.json.

    vLLM quantizes such a folder as its block says, the actor as ``qerl.ignore`` / ``qerl.scale_rule`` say; unless
    they are one reading the rollout samples from other weights than the ones trained, without an error. A
    ``qerl`` value left at its default follows the block (and is then passed to vLLM like any other); a value that
    disagrees with what the block declares is refused naming both, as a conflicting ``hf_overrides`` is. Keys the
    block leaves out bind nothing; an ``hf_overrides.quantization_config`` replaces the block for vLLM, so then
    :func:`_vllm_quantize_at_load` ties that one to ``qerl`` instead.
    """
    from pathlib import Path

    from ..checkpoint_conversion import linear_module_names
    from ..nvfp4.checkpoint import read_config_json
    from ..nvfp4.quant_config import declared_quant_config, declared_scale_rule, quantize_at_load_layers

    path = _get(config, "actor_rollout_ref.model.path")
    if (qerl.mode != "nvfp4" or checkpoint_format(path) != FORMAT_BF16
            or _get(config, f"{HF_OVERRIDES}.quantization_config") is not None):
        return qerl
    folder = Path(str(path)).expanduser()
    model_config = read_config_json(folder / "config.json")
    block = declared_quant_config(model_config, folder)
    declared_ignore, declared_targets = quantize_at_load_layers(block)
    declared_rule = declared_scale_rule(block)
    where = f"{folder / 'config.json'}: quantization_config"
    found: dict[str, Any] = {}
    if declared_rule is not None and declared_rule != qerl.scale_rule:
        if qerl.scale_rule != DEFAULT_SCALE_RULE:
            raise QeRLConfigError(
                f"qerl.scale_rule={qerl.scale_rule!r} conflicts with {where}.scale_rule={declared_rule!r} "
                "(actor_rollout_ref.model.path, which vLLM quantizes at load as its block says): the actor and vLLM "
                f"would hold different weights; set qerl.scale_rule={declared_rule} or leave it at its default "
                f"({DEFAULT_SCALE_RULE}, which follows the block)")
        found["scale_rule"] = declared_rule
    if declared_ignore is not None or declared_targets is not None:
        try:
            declared_ignore = check_patterns(declared_ignore or [], f"{where}.ignore")
            declared_targets = None if declared_targets is None else check_patterns(declared_targets,
                                                                                    f"{where}.targets")
        except PatternError as err:
            raise QeRLConfigError(str(err)) from err
        dense = list(dict.fromkeys([*DEFAULT_IGNORE, *declared_ignore]))  # vLLM's LM head is never quantized
        for key in ("quantization_config", "compression_config"):
            model_config.pop(key, None)
        try:
            linear: list[str] | None = linear_module_names(model_config)
        except ValueError:
            linear = None  # an architecture the actor hook refuses with its own message
        if linear is not None and declared_targets is not None:  # layers no target selects stay BF16 in vLLM
            dense += [n for n in linear if not matches_pattern(n, dense) and not matches_pattern(n, declared_targets)]
        if tuple(qerl.ignore) == tuple(DEFAULT_IGNORE):
            if tuple(dense) != tuple(DEFAULT_IGNORE):
                found["ignore"] = tuple(dense)
        else:
            def kept(patterns: Sequence[str]) -> set[str]:
                return {n for n in linear if matches_pattern(n, patterns)} if linear is not None else set(patterns)

            only = sorted(kept(qerl.ignore) ^ kept(dense))
            if only:
                raise QeRLConfigError(
                    f"qerl.ignore={list(qerl.ignore)} conflicts with {where} (ignore={declared_ignore}, targets="
                    f"{declared_targets}) of actor_rollout_ref.model.path, which vLLM quantizes at load as its block "
                    f"says: only one side keeps {only[:5]} in BF16; set qerl.ignore={dense} or leave it at its "
                    f"default ({list(DEFAULT_IGNORE)}, which follows the block)")
    if not found:
        return qerl
    for key, value in found.items():
        if _get(config, "qerl") is not None:  # a later read_qerl of the top-level block sees the same values
            _set(config, f"qerl.{key}", list(value) if key == "ignore" else value, [])
        changes.append(f"qerl.{key}={list(value) if key == 'ignore' else value} (declared by {where})")
    return dataclasses.replace(qerl, **found)


def _check_no_quantize_at_load_block(config: Any, qerl: QeRLConfig) -> None:
    """Modes other than nvfp4 on a BF16 ``model.path`` whose config.json declares a ``qerl_nvfp4`` quantize-at-load
    ``quantization_config``: vLLM follows that block (it quantizes the folder to NVFP4 with no ``quantization``
    argument, and took it over a ``bitsandbytes`` one) while the actor trains on the BF16 (or NF4) weights, so the
    rollout would sample from other weights than the ones trained, without an error. Refused here, naming both."""
    from pathlib import Path

    from ..nvfp4.checkpoint import read_config_json
    from ..nvfp4.quant_config import declared_quant_config

    path = _get(config, "actor_rollout_ref.model.path")
    if qerl.mode == "nvfp4" or checkpoint_format(path) != FORMAT_BF16:
        return
    folder = Path(str(path)).expanduser()
    block = declared_quant_config(read_config_json(folder / "config.json"), folder)
    if not block or str(block.get("quant_method", "")).lower() != METHOD_NAME:
        return
    raise QeRLConfigError(
        f"actor_rollout_ref.model.path={str(path)!r} declares a {METHOD_NAME} quantization_config in its config.json "
        f"({block}): vLLM would quantize it to NVFP4 at load while qerl.mode={qerl.mode} trains "
        f"{'BF16' if qerl.mode == 'bf16' else 'NF4'} weights, so the rollout would sample from other weights than the "
        f"ones trained; use qerl.mode=nvfp4 with this folder, or point model.path at a copy whose config.json has no "
        "quantization_config")


def _vllm_quantize_at_load(config: Any, qerl: QeRLConfig, changes: list[str]) -> None:
    """Give vLLM's quantize-at-load the actor's scale rule and ignore list (passed only where not the default).

    Without the ignore list vLLM would quantize the layers ``qerl.ignore`` keeps in BF16 on the actor (or keep
    ``lm_head`` in BF16 where ``qerl.ignore=[]`` quantizes it), and the rollout would sample from other weights than
    the ones trained, without an error anywhere.
    """
    path_format = checkpoint_format(_get(config, "actor_rollout_ref.model.path"))
    if qerl.mode != "nvfp4" or path_format not in (None, FORMAT_BF16):
        return  # a quantized model.path: vLLM and the actor both read its bytes
    key = HF_OVERRIDES
    overrides = dict(_plain(_get(config, key, {})) or {})
    have = overrides.get("quantization_config")
    want = {"quant_method": VLLM_QUANTIZATION["nvfp4"], "scale_rule": qerl.scale_rule, "ignore": list(qerl.ignore)}
    if have is not None:
        have = dict(_plain(have))
        filled = {**have, "scale_rule": have.get("scale_rule", DEFAULT_SCALE_RULE),
                  "ignore": list(have.get("ignore", DEFAULT_IGNORE) or [])}
        if filled != want:
            raise QeRLConfigError(f"{key}.quantization_config={have} conflicts with qerl.scale_rule="
                                  f"{qerl.scale_rule} / qerl.ignore={list(qerl.ignore)} (which need {want}); "
                                  "leave it unset")
        return
    if qerl.scale_rule != DEFAULT_SCALE_RULE or tuple(qerl.ignore) != tuple(DEFAULT_IGNORE):
        _set(config, key, {**overrides, "quantization_config": want}, changes)


def _set(config: Any, dotted: str, value: Any, changes: list[str]) -> None:
    from omegaconf import OmegaConf, open_dict

    with open_dict(config):
        OmegaConf.update(config, dotted, value, merge=False, force_add=True)
    changes.append(f"{dotted}={value}")


def _check_packed_attention(config: Any) -> None:
    """``attn_implementation=qerl_varlen`` serves packed rows only: it needs ``use_remove_padding=True``.

    transformers drops the padding mask for an attention it has no mask builder for, so a padded batch would
    otherwise reach it without its mask.
    """
    from .varlen_attention import QERL_VARLEN

    attn = _get(config, "actor_rollout_ref.model.override_config.attn_implementation")
    if attn == QERL_VARLEN and not _get(config, "actor_rollout_ref.model.use_remove_padding", True):
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
    nvfp4_base_source(_get(config, "actor_rollout_ref.model.path"), qerl)
    _check_no_quantize_at_load_block(config, qerl)
    qerl = _follow_declared_block(config, qerl, changes)
    _check_ignore_against_model_path(config, qerl)
    if qerl.mode == "nvfp4":
        _check_twin_folder(qerl)
        _check_ignore_against_nvfp4_base(config, qerl)
        _check_twin_scale_rule(config, qerl)
    rollout = _get(config, "actor_rollout_ref.rollout.name")
    if rollout != "vllm":
        raise QeRLConfigError(f"actor_rollout_ref.rollout.name={rollout!r}: QeRL rolls out on vLLM; set it to 'vllm'")
    if not _get(config, "trainer.use_v1", True):
        raise QeRLConfigError("trainer.use_v1=false: the QeRL trainer hook is a v1 trainer mode; use the v1 trainer")
    if _get(config, "actor_rollout_ref.model.lora.merge", False):
        raise QeRLConfigError("actor_rollout_ref.model.lora.merge=true: adapters cannot be merged into a 4-bit base; "
                              "leave it false (only LoRA tensors are synced to vLLM)")
    _check_packed_attention(config)
    strategy = _get(config, "actor_rollout_ref.actor.strategy")
    if strategy not in ("fsdp", "fsdp2"):
        raise QeRLConfigError(f"actor_rollout_ref.actor.strategy={strategy!r}: QeRL's actor hook is for the FSDP "
                              "engine; use fsdp2 (or fsdp)")
    mode_now = _get(config, "trainer.v1.trainer_mode", "sync")
    if mode_now not in ("sync", TRAINER_MODE):
        raise QeRLConfigError(f"trainer.v1.trainer_mode={mode_now!r}: QeRL supports the 'sync' trainer (it runs as "
                              f"'{TRAINER_MODE}', which drives AQN per step)")
    if mode_now != TRAINER_MODE:
        _set(config, "trainer.v1.trainer_mode", TRAINER_MODE, changes)

    if _get(config, "actor_rollout_ref.model.target_modules") == "all-linear":
        _set(config, "actor_rollout_ref.model.target_modules", _default_target_modules(), changes)
    load_format = _get(config, "actor_rollout_ref.rollout.load_format", "dummy")
    if "dummy" in str(load_format):
        # vLLM must read the real base weights once; afterwards only LoRA tensors travel each step
        _set(config, "actor_rollout_ref.rollout.load_format", "safetensors", changes)

    vllm_kwargs = _plain(_get(config, "actor_rollout_ref.rollout.engine_kwargs.vllm", {})) or {}
    want_quant = VLLM_QUANTIZATION[qerl.mode]
    have_quant = vllm_kwargs.get("quantization")
    if have_quant not in (None, want_quant):
        raise QeRLConfigError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.quantization={have_quant!r} conflicts "
                              f"with qerl.mode={qerl.mode} (which needs {want_quant!r})")
    if want_quant and have_quant is None:
        _set(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.quantization", want_quant, changes)
    _vllm_quantize_at_load(config, qerl, changes)
    rollout_quant = _get(config, "actor_rollout_ref.rollout.quantization")
    if rollout_quant is not None:
        raise QeRLConfigError(f"actor_rollout_ref.rollout.quantization={rollout_quant!r}: leave it null; QeRL "
                              "selects the vLLM method from qerl.mode")
    ext = vllm_kwargs.get("worker_extension_cls")
    if ext not in (None, VERL_WORKER_EXTENSION):
        raise QeRLConfigError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={ext!r}: QeRL "
                              f"needs {VERL_WORKER_EXTENSION} (a subclass of verl's extension)")
    if ext is None:
        _set(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls", VERL_WORKER_EXTENSION,
             changes)

    _set(config, ".".join(CARRIER_PATH), qerl.to_dict(), changes[:0])  # the carrier is not a user setting
    if changes:
        logger.warning("[verl-qerl] qerl.mode=%s%s sets: %s", qerl.mode,
                       " + AQN" if qerl.aqn.enable else "", ", ".join(changes))
    return qerl
