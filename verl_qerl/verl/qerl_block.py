"""The ``qerl`` block of a verl config: its settings and their own checks (:class:`QeRLConfig`), where it lives in the
config, and reading / writing a composed config by dotted key.

What the block implies for the rest of verl's config is :func:`verl_qerl.verl.config.apply_qerl`'s job; the checks
against ``model.path`` and its NVFP4 twin are :mod:`verl_qerl.verl.model_path_checks`'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..aqn import AQNConfig
from ..modeling.model_conversion import MODES
from ..nvfp4.arch import DEFAULT_IGNORE
from ..nvfp4.checkpoint import PatternError, check_patterns
from ..nvfp4.quantize import DEFAULT_SCALE_RULE, SCALE_RULES
from ..vllm import METHOD_NAME

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


def to_plain(node: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra/verl
        pass
    return node


def get_key(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
        except Exception:  # noqa: BLE001 - missing/interpolation errors read as "unset"
            return default
    return default if node is None else node


def set_key(config: Any, dotted: str, value: Any, changes: list[str]) -> None:
    from omegaconf import OmegaConf, open_dict

    with open_dict(config):
        OmegaConf.update(config, dotted, value, merge=False, force_add=True)
    changes.append(f"{dotted}={value}")


def read_qerl(config: Any) -> QeRLConfig | None:
    """The QeRL block of a verl config (top level or the carrier), or None when QeRL is off."""
    block = get_key(config, "qerl")
    if block is None:
        block = get_key(config, ".".join(CARRIER_PATH))
    if block is None:
        return None
    return QeRLConfig.from_dict(to_plain(block))
