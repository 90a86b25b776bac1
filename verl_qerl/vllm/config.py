"""The ``qerl_nvfp4`` vLLM quantization config: which checkpoint layout, which layers, and load-time checks.

Registered with ``register_quantization_config`` when this module is imported. vLLM builds the
config object in the front-end process and pickles it into the engine core and the workers;
unpickling imports this module, so the decorator has run wherever the object lives, even before
vLLM loads the ``vllm.general_plugins`` entry point there. The object therefore holds only plain
Python values.

One method name serves four checkpoint layouts (``checkpoint_format``):

* ``bf16``: an unquantized checkpoint (no ``quantization_config``), quantized while loading with
  exactly :func:`verl_qerl.nvfp4.quantize`, fused q/k/v and gate/up sharing a global scale, under
  ``scale_rule`` (default ``verl_qerl.nvfp4.DEFAULT_SCALE_RULE``; another one is chosen with
  ``hf_overrides={"quantization_config": {"quant_method": "qerl_nvfp4", "scale_rule": "fp32"}}``);
* ``compressed-tensors``: NVFP4A16 / NVFP4 ``nvfp4-pack-quantized`` (ours from ``qerl-quantize``,
  llm-compressor's, or any written by the ``compressed-tensors`` package);
* ``modelopt``: ModelOpt NVFP4 / W4A16_NVFP4 (``weight`` uint8, ``weight_scale_2`` multiplier).

Errors a user can make (a checkpoint with missing scales, a group size other than 16, an
architecture we do not support, a non-NVFP4 quantized checkpoint) are raised here, while vLLM
builds its config in the front-end process, with the tensor or setting named: before any engine
process starts, not mid-generation.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from verl_qerl.nvfp4 import quant_config
from verl_qerl.nvfp4.arch import DEFAULT_IGNORE, SUPPORTED_MODEL_TYPES
from verl_qerl.nvfp4.checkpoint import PatternError, check_ignore, check_patterns, matches_pattern
from verl_qerl.nvfp4.format import BLOCK_SIZE
from verl_qerl.nvfp4.quant_config import (
    CHECKPOINT_FORMATS,
    FORMAT_BF16,
    FORMAT_CT,
    FORMAT_MODELOPT,
    LAYOUT_TENSOR_NAMES,
    NVFP4_ONLY_SUFFIXES,
    QuantConfigError,
    modelopt_block,
    quantize_at_load_layers,
)
from verl_qerl.nvfp4.quantize import DEFAULT_SCALE_RULE, SCALE_RULES

from . import METHOD_NAME, compat

logger = logging.getLogger(__name__)

#: Set to 1 to skip the architecture allow-list (at your own risk; AQN and LoRA untested there).
ALLOW_UNTESTED_ARCH_ENV = "QERL_NVFP4_ALLOW_UNTESTED_ARCH"


#: Keys of the native ``{"quant_method": "qerl_nvfp4", ...}`` quantization_config.
NATIVE_KEYS: tuple[str, ...] = ("quant_method", "checkpoint_format", "ignore", "targets", "scale_rule", "group_size")

#: Keys of a compressed-tensors quantization_config block, also accepted in a native dict whose
#: ``checkpoint_format`` is compressed-tensors (a checkpoint's block relabelled ``qerl_nvfp4``).
CT_BLOCK_KEYS: tuple[str, ...] = ("config_groups", "format", "global_compression_ratio", "kv_cache_scheme",
                                  "quantization_status", "sparsity_config", "transform_config", "version",
                                  "total_num_heads", "total_num_kv_heads")


class QeRLNvFp4Error(ValueError):
    """A checkpoint or setting ``qerl_nvfp4`` cannot serve; the message names what and where."""


def _checked_patterns(value: Any, option: str) -> list[str]:
    """:func:`~verl_qerl.nvfp4.checkpoint.check_patterns` (a string is one pattern, not its characters; a bad
    ``re:`` pattern is named), its error raised as :class:`QeRLNvFp4Error`."""
    try:
        return check_patterns(value, option)
    except PatternError as err:
        raise QeRLNvFp4Error(str(err)) from err
    except TypeError as err:  # not iterable (a number, a dict's value of the wrong kind)
        raise QeRLNvFp4Error(f"{option}: {value!r} is not a list of module name patterns") from err


def _is_ignored(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors rules (exact, dotted suffix, ``re:``) plus ModelOpt's ``*`` wildcards."""
    patterns = list(patterns)
    if matches_pattern(name, patterns):
        return True
    return any("*" in p and (fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p)) for p in patterns)


def _ct_group_targets(config: Mapping[str, Any]) -> tuple[list[str], bool]:
    """(targets, W4A4?) of a compressed-tensors block's ``config_groups`` (a group without targets: every Linear)."""
    targets: list[str] = []
    activation_scales = False
    for name, group in (config.get("config_groups") or {}).items():
        targets.extend(_checked_patterns(group.get("targets") or ["Linear"],
                                         f"quantization_config.config_groups.{name}.targets"))
        activation_scales |= bool(group.get("input_activations"))
    return targets or ["Linear"], activation_scales


def model_linear_shapes(hf_config: Any) -> dict[str, tuple[int, int]] | None:
    """{HF module name: (out_features, in_features)} of the model's ``nn.Linear`` layers, built on the meta
    device from ``hf_config`` (no weights: what the checkpoint's names and shapes must agree with); None where
    the model cannot be built that way (an architecture outside the allow-list, run with
    ``QERL_NVFP4_ALLOW_UNTESTED_ARCH=1``), leaving those checks to the workers' loaders."""
    from verl_qerl.checkpoint_conversion import linear_module_shapes

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    config = text.to_dict() if hasattr(text, "to_dict") else dict(text)
    for key in ("quantization_config", "compression_config"):
        config.pop(key, None)
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    try:
        return linear_module_shapes(config)
    except Exception as err:  # noqa: BLE001 - a best-effort front-end check; the loaders still check each tensor
        logger.warning("qerl_nvfp4: cannot list the model's Linear layers from its config (%s: %s); the ignore / "
                       "targets patterns and tensor shapes are not checked before loading", type(err).__name__, err)
        return None


def classify_quant_config(cfg: Mapping[str, Any] | None) -> str:
    """Which of :data:`CHECKPOINT_FORMATS` a checkpoint's quantization dict describes: the one
    classifier of :mod:`verl_qerl.nvfp4.quant_config` (shared with the actor's checkpoint reader),
    its errors raised as :class:`QeRLNvFp4Error`."""
    try:
        return quant_config.classify_quant_config(cfg)
    except QuantConfigError as err:
        raise QeRLNvFp4Error(str(err)) from err


@register_quantization_config(METHOD_NAME)
class QeRLNvFp4Config(QuantizationConfig):
    """vLLM config of the ``qerl_nvfp4`` method: NVFP4 weights (E2M1 + E4M3 per 16 + FP32), BF16 activations.

    ``checkpoint_format`` picks the parameter names the linear method registers (they must match
    the checkpoint's tensor names). ``ignore`` / ``targets`` follow compressed-tensors' rules
    (ModelOpt ``exclude_modules`` with ``*`` wildcards too). ``activation_scales`` is True for W4A4
    checkpoints, whose input scales are loaded into placeholders and dropped (we run W4A16).
    ``scale_rule`` is how a BF16 checkpoint is quantized at load (``verl_qerl.nvfp4.SCALE_RULES``);
    the training side's ``quantize_model`` must use the same one for the two to hold equal weights.
    """

    def __init__(
        self,
        checkpoint_format: str = FORMAT_BF16,
        ignore: Iterable[str] | None = None,
        targets: Iterable[str] | None = None,
        activation_scales: bool = False,
        scale_rule: str = DEFAULT_SCALE_RULE,
    ) -> None:
        super().__init__()
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise QeRLNvFp4Error(f"checkpoint_format={checkpoint_format!r}; expected one of {CHECKPOINT_FORMATS}")
        if scale_rule not in SCALE_RULES:
            raise QeRLNvFp4Error(f"scale_rule={scale_rule!r}; expected one of {SCALE_RULES}")
        self.scale_rule = scale_rule
        self.checkpoint_format = checkpoint_format
        self.ignore = _checked_patterns(ignore if ignore is not None else DEFAULT_IGNORE, "quantization_config.ignore")
        self.targets = _checked_patterns(targets if targets is not None else ["Linear"], "quantization_config.targets")
        self.activation_scales = bool(activation_scales)
        self.model_type: str | None = None
        #: Whether this config is a native qerl_nvfp4 dict (what a user or verl-qerl writes), whose patterns
        #: :meth:`check_layers` holds to the model; a checkpoint's own compressed-tensors / ModelOpt lists are
        #: not: other tools write them for other architectures too (vision towers, MoE gates).
        self.native = False
        #: The native dict's patterns beyond the defaults, each of which must match a Linear layer of the model.
        self.user_ignore: list[str] = []
        self.user_targets: list[str] = []

    def __repr__(self) -> str:
        return (f"QeRLNvFp4Config(checkpoint_format={self.checkpoint_format!r}, ignore={self.ignore}, "
                f"targets={self.targets}, activation_scales={self.activation_scales}, scale_rule={self.scale_rule!r})")

    # -- vLLM's QuantizationConfig interface ------------------------------------------------------

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # fp32 is for exact CPU comparisons; the GPU kernel runs bf16/fp16 activations.
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # The torch fallback runs anywhere bf16 does; the FP4 kernel checks its own arch at run time.
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Empty: a checkpoint without quantization_config builds ``QeRLNvFp4Config()`` (BF16, quantize at load).
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QeRLNvFp4Config:
        """The config of a checkpoint's (or ``hf_overrides``') quantization dict.

        A native ``qerl_nvfp4`` dict is read by its own keys whatever its ``checkpoint_format`` (unknown keys
        refused, ``targets`` defaulting to every Linear, a string being one pattern); ``config_groups`` are
        read for a compressed-tensors block. Reading a native dict as compressed-tensors used to find no
        ``config_groups``, hence no targets, and served every layer unquantized without a word.
        """
        fmt = classify_quant_config(config)
        if str(config.get("quant_method", "")).lower() == METHOD_NAME:
            return cls._from_native(config, fmt)
        if fmt == FORMAT_CT:
            targets, activation_scales = _ct_group_targets(config)
            return cls(FORMAT_CT, ignore=config.get("ignore") or [], targets=targets,
                       activation_scales=activation_scales)
        if fmt == FORMAT_MODELOPT:
            mo = modelopt_block(config) or {}
            ignore = mo.get("exclude_modules") or mo.get("ignore") or config.get("ignore") or []
            activation_scales = str(mo.get("quant_algo", "")).upper() == "NVFP4"
            return cls(FORMAT_MODELOPT, ignore=ignore, activation_scales=activation_scales)
        return cls(fmt)  # no quantization dict: a BF16 checkpoint, defaults

    @classmethod
    def _from_native(cls, config: Mapping[str, Any], fmt: str) -> QeRLNvFp4Config:
        """A native ``{"quant_method": "qerl_nvfp4", ...}`` dict: keys checked, patterns checked, user patterns
        remembered for :meth:`check_layers` (which runs once the model's layers are known)."""
        known = NATIVE_KEYS + (CT_BLOCK_KEYS if fmt == FORMAT_CT else ())
        unknown = [k for k in config if k not in known]
        if unknown:
            raise QeRLNvFp4Error(f"quantization_config (quant_method={METHOD_NAME!r}): unknown key(s) "
                                 f"{', '.join(map(repr, unknown))}; known keys: {', '.join(map(repr, known))}")
        for key in ("ignore", "targets"):  # named errors first (a number, an empty or non-string pattern, bad regex)
            if config.get(key) is not None:
                _checked_patterns(config[key], f"quantization_config.{key}")
        ignore, targets = quantize_at_load_layers(config)  # the reading the actor's side uses, strings as one
        activation_scales = False
        if targets is None and fmt == FORMAT_CT and config.get("config_groups") and "targets" not in config:
            targets, activation_scales = _ct_group_targets(config)  # a checkpoint's block, relabelled
        out = cls(fmt, ignore=ignore, targets=targets, activation_scales=activation_scales,
                  scale_rule=config.get("scale_rule", DEFAULT_SCALE_RULE))
        out.native = True
        wild = [p for p in [*(ignore or ()), *(targets or ())] if "*" in p and not p.startswith("re:")]
        if wild:  # vLLM's skip test would take ModelOpt's wildcards, the actor's quantize_model would not
            example = "re:" + wild[0].replace("*", ".*")
            raise QeRLNvFp4Error(f"quantization_config: pattern {wild[0]!r}: '*' wildcards are not module patterns "
                                 "of a qerl_nvfp4 config (the training side would not read it the same way); use an "
                                 f"exact name, a dotted suffix or 're:<regex>' (e.g. {example!r})")
        if ignore is not None:
            out.user_ignore = [p for p in out.ignore if p not in DEFAULT_IGNORE]
        if targets is not None:
            out.user_targets = [p for p in out.targets if p != "Linear"]
        return out

    @classmethod
    def from_config_dict_json(cls, text: str) -> QeRLNvFp4Config:
        """For ``hf_overrides={"quantization_config_dict_json": ...}``: a native qerl_nvfp4 dict as JSON."""
        return cls.from_config({"quant_method": METHOD_NAME, **json.loads(text)})

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Claim NVFP4 checkpoints when the user asked for ``qerl_nvfp4`` (vLLM probes custom methods first).

        Never claims anything the user did not ask for, so stock ``compressed-tensors`` /
        ``modelopt_fp4`` loads are untouched; nor a ``qerl_nvfp4`` checkpoint where the user asked for another
        method (``quantization="bitsandbytes"`` was silently replaced by NVFP4: vLLM now says the two disagree).
        Asked for ``qerl_nvfp4`` on a checkpoint it cannot serve, it raises with the reason rather than vLLM's
        generic "does not match".
        """
        if str(hf_quant_cfg.get("quant_method", "")).lower() == METHOD_NAME:
            return METHOD_NAME if user_quant in (None, METHOD_NAME) else None
        if user_quant != METHOD_NAME:
            return None
        classify_quant_config(hf_quant_cfg)  # raises for what we cannot serve
        return METHOD_NAME

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """Front-end checks with the model at hand: architecture, which Linear layers the patterns select, and
        (local folders) the tensors' presence, dtypes and shapes against config.json."""
        shapes = None
        if hf_config is not None:
            self.model_type = check_architecture(hf_config)
            shapes = model_linear_shapes(hf_config)
            if shapes is not None:
                self.check_layers(list(shapes))
        folder = Path(model_name)
        if folder.is_dir():
            check_checkpoint_tensors(folder, self.checkpoint_format, linear_shapes=shapes)

    def check_layers(self, linear: list[str]) -> None:
        """The patterns against the model's Linear layers (HF names, ``linear``): every pattern of a native dict
        matches a layer, no fused group (q/k/v, gate/up) is split, and at least one layer is quantized.

        A misspelled ``ignore`` pattern (``donw_proj``) left the layers it meant in NVFP4, a misspelled target
        left them in BF16, and a config selecting no layer served the whole model unquantized, all silently.
        Only the native dict's own patterns must match (:attr:`user_ignore`, :attr:`user_targets`).
        """
        if self.native:
            try:
                check_ignore(linear, self.ignore, "quantization_config.ignore", must_match=self.user_ignore)
            except PatternError as err:
                raise QeRLNvFp4Error(str(err)) from err
        for pat in self.user_targets:
            if not any(_is_ignored(n, [pat]) for n in linear):
                leaves = sorted({n.rpartition(".")[2] for n in linear})
                raise QeRLNvFp4Error(f"quantization_config.targets: {pat!r} matches no Linear layer of the model "
                                     f"(its layers: {', '.join(leaves) or 'none'}; exact names, dotted suffixes or "
                                     "'re:<regex>'); the layers it meant would stay unquantized")
        # vLLM's LM head is a VocabParallelEmbedding, never quantized by this method whatever the patterns say
        quantized = [n for n in linear if n.rpartition(".")[2] != "lm_head" and self._targeted(n)
                     and not _is_ignored(n, self.ignore)]
        if linear and not quantized:
            raise QeRLNvFp4Error(f"quantization_config (ignore={self.ignore}, targets={self.targets}) quantizes no "
                                 f"layer of this model ({len(linear)} Linear layers, e.g. {linear[0]!r}): "
                                 f"{METHOD_NAME} would serve it unquantized; fix the patterns, or drop "
                                 f"quantization={METHOD_NAME!r} to serve the model in BF16")

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        self.ignore = list(hf_to_vllm_mapper.apply_list(self.ignore))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            if self.is_skipped(prefix):
                return UnquantizedLinearMethod()
            from .linear_method import QeRLNvFp4LinearMethod

            return QeRLNvFp4LinearMethod(self, prefix)
        moe = compat.moe_layer_types()
        if moe and isinstance(layer, moe):
            raise QeRLNvFp4Error(f"{prefix}: mixture-of-experts layers are not supported by qerl_nvfp4 "
                                 f"(supported model types: {', '.join(SUPPORTED_MODEL_TYPES)})")
        return None  # embeddings, lm_head, attention (KV cache) stay unquantized

    # -- layer selection --------------------------------------------------------------------------

    def _shard_names(self, prefix: str) -> list[str]:
        """Checkpoint module names behind a vLLM layer: ``...qkv_proj`` -> ``...q_proj``, ``k_proj``, ``v_proj``."""
        parent, _, leaf = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(leaf)
        if not shards:
            return [prefix]
        return [f"{parent}.{s}" if parent else s for s in shards]

    def _targeted(self, name: str) -> bool:
        return any(t == "Linear" for t in self.targets) or _is_ignored(name, [t for t in self.targets if t != "Linear"])

    def is_skipped(self, prefix: str) -> bool:
        """Whether a linear layer stays unquantized; a fused layer must be all-or-nothing."""
        names = self._shard_names(prefix)
        skipped = [_is_ignored(n, self.ignore) or not self._targeted(n) for n in names]
        if _is_ignored(prefix, self.ignore):
            return True
        if all(skipped):
            return True
        if any(skipped):
            raise QeRLNvFp4Error(f"{prefix}: vLLM fuses {names} into one layer, but the checkpoint quantizes only "
                                 f"some of them ({[n for n, s in zip(names, skipped) if not s]}); fused parts must "
                                 "be all quantized or all ignored")
        return False


def check_architecture(hf_config: Any) -> str:
    """The model_type, if qerl_nvfp4 supports it; otherwise a clear error (before any engine starts)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_type = str(getattr(text, "model_type", None) or getattr(hf_config, "model_type", ""))
    archs = list(getattr(hf_config, "architectures", None) or [])
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    from verl_qerl.kernels.build import SettingError, env_flag

    try:  # a switch like the others (1/true/yes/on): "true" was read as off, and refused with "set it to 1"
        allowed = env_flag(ALLOW_UNTESTED_ARCH_ENV)
    except SettingError as err:
        raise QeRLNvFp4Error(str(err)) from err
    if allowed:
        logger.warning("qerl_nvfp4: model_type %r (%s) is untested; %s is on, so going ahead", model_type, archs,
                       ALLOW_UNTESTED_ARCH_ENV)
        return model_type
    raise QeRLNvFp4Error(f"qerl_nvfp4 does not support model_type={model_type!r} (architectures {archs}); "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}. Set {ALLOW_UNTESTED_ARCH_ENV}=1 to try "
                         "a dense decoder anyway")


def check_checkpoint_tensors(folder: Path, checkpoint_format: str, max_listed: int = 5,
                             linear_shapes: Mapping[str, tuple[int, int]] | None = None) -> None:
    """Header-only scan of a local checkpoint: every NVFP4 module has its three tensors, group size 16, and
    (given ``linear_shapes``, the model's Linear layers as config.json describes them) the shape the model has.

    vLLM does not check that a quantized model's parameters were all loaded, so a checkpoint
    missing a scale would otherwise serve garbage; a tensor larger than its parameter can be cut to
    size by vLLM's tensor-parallel slicing without a word. Reads safetensors headers only (no data).
    """
    from verl_qerl.nvfp4.checkpoint import _SAFETENSORS_DTYPES

    shapes = _safetensors_index(folder)
    if shapes is None:
        return  # not a local safetensors folder (e.g. .bin): the worker-side checks still apply
    linear_shapes = linear_shapes or {}
    if checkpoint_format == FORMAT_BF16:
        stray = sorted(n for n in shapes if n.endswith(NVFP4_ONLY_SUFFIXES))
        if stray:
            raise QeRLNvFp4Error(f"{folder}: has NVFP4 tensors (e.g. {stray[0]!r}) but its config declares no "
                                 "NVFP4 quantization_config; qerl_nvfp4 would try to quantize it as BF16")
        wrong = [f"{m}.weight: shape {list(shapes[f'{m}.weight'][1])}, but config.json's model needs {list(want)}"
                 for m, want in linear_shapes.items()
                 if f"{m}.weight" in shapes and tuple(shapes[f"{m}.weight"][1]) != tuple(want)]
        if wrong:
            more = f" (and {len(wrong) - max_listed} more)" if len(wrong) > max_listed else ""
            raise QeRLNvFp4Error(f"{folder}: the checkpoint does not match its config.json: "
                                 f"{'; '.join(wrong[:max_listed])}{more}")
        return
    packed_name, scale_name, gscale_name = LAYOUT_TENSOR_NAMES[checkpoint_format]
    modules: set[str] = set()
    for name, (dtype, _shape) in shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf in (scale_name, gscale_name) or (leaf == packed_name and _SAFETENSORS_DTYPES.get(dtype) == torch.uint8):
            modules.add(module)
    if not modules:
        raise QeRLNvFp4Error(f"{folder}: checkpoint_format={checkpoint_format!r} but the checkpoint holds no NVFP4 "
                             f"tensors (no '*.{packed_name}' uint8 nor '*.{scale_name}'); a BF16 checkpoint is "
                             f"quantized at load with checkpoint_format '{FORMAT_BF16}' (the default)")
    problems: list[str] = []
    for module in sorted(modules):
        entries = {leaf: shapes.get(f"{module}.{leaf}") for leaf in (packed_name, scale_name, gscale_name)}
        missing = [f"{module}.{leaf}" for leaf, v in entries.items() if v is None]
        if missing:
            problems.append(f"missing {', '.join(missing)}")
            continue
        (pdt, pshape), (sdt, sshape), (_gdt, gshape) = entries.values()
        if pdt != "U8" or len(pshape) != 2:
            problems.append(f"{module}.{packed_name}: expected uint8 [N, K/2], got {pdt} {list(pshape)}")
            continue
        if sdt not in ("F8_E4M3", "U8") or len(sshape) != 2 or sshape[0] != pshape[0]:
            problems.append(f"{module}.{scale_name}: expected float8_e4m3fn [N, K/16] for N={pshape[0]}, got {sdt} "
                            f"{list(sshape)}")
            continue
        k = pshape[1] * 2
        if sshape[1] * BLOCK_SIZE != k:
            implied = k / sshape[1] if sshape[1] else float("nan")
            problems.append(f"{module}: block scale {list(sshape)} for K={k} implies group size {implied:g}; "
                            f"NVFP4 (and qerl_nvfp4) needs {BLOCK_SIZE}")
            continue
        if int(torch.tensor(gshape).prod()) != 1:
            problems.append(f"{module}.{gscale_name}: expected one value, got shape {list(gshape)}")
            continue
        want = linear_shapes.get(module)
        if want is not None and (pshape[0], k) != tuple(want):
            problems.append(f"{module}.{packed_name}: shape {list(pshape)}, but config.json's model needs "
                            f"[{want[0]}, {want[1] // 2}] (an [{want[0]}, {want[1]}] weight, two FP4 codes a byte)")
    if problems:
        more = f" (and {len(problems) - max_listed} more)" if len(problems) > max_listed else ""
        raise QeRLNvFp4Error(f"{folder}: NVFP4 checkpoint is incomplete or malformed: "
                             f"{'; '.join(problems[:max_listed])}{more}")


def _safetensors_index(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """name -> (safetensors dtype string, shape) from the headers of every shard in ``folder``."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        out.update(_safetensors_header(path))
    return out


def _safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One shard's tensors (name -> (dtype string, shape)), its header checked against the file's size.

    A shard cut short (an interrupted copy or download) used to surface as a bare JSON parse error naming
    no file, or, cut inside the tensor data, to pass here and fail later in a worker; it is named here, in
    the words of :func:`verl_qerl.nvfp4.checkpoint.open_shard`.
    """

    def damaged(reason: str) -> QeRLNvFp4Error:
        return QeRLNvFp4Error(f"{path}: not a readable safetensors file ({reason}); the shard is damaged or "
                              "incomplete: copy or download it again")

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise damaged(f"{size} bytes, fewer than the 8 of the header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            raise damaged(f"a {header_len}-byte header in a {size}-byte file")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise damaged(f"header is not valid JSON: {err}") from err
    if not isinstance(header, dict):
        raise damaged("header is not a JSON object")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    data_end = 0
    try:
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            out[name] = (str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
            data_end = max(data_end, int(meta["data_offsets"][1]))
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise damaged(f"malformed header entry ({type(err).__name__}: {err})") from err
    if data_end > size - 8 - header_len:
        raise damaged(f"its tensors need {data_end} bytes of data, the file holds {size - 8 - header_len}")
    return out
