"""Which weight layout a checkpoint declares: the one reading of a quantization config for every consumer.

The actor's checkpoint reader (``load_nvfp4_model``, ``qerl-quantize``, the NVFP4 actor), the verl config
check and the ``qerl_nvfp4`` vLLM method all call :func:`classify_quant_config`, so a ``config.json``
cannot mean one layout to the trainer and another to the rollout. Layouts (:data:`CHECKPOINT_FORMATS`):

* :data:`FORMAT_BF16` ``"bf16"``: dense weights, quantized while loading. No quantization config, or
  ``{"quant_method": "qerl_nvfp4"}`` (optionally with ``checkpoint_format: "bf16"``, ``ignore``,
  ``targets``): the vLLM method's own config, which says "quantize this BF16 checkpoint at load".
* :data:`FORMAT_CT` ``"compressed-tensors"``: NVFP4A16 / NVFP4 ``nvfp4-pack-quantized``
  (``weight_packed``, ``weight_scale``, ``weight_global_scale`` divisor), as ``qerl-quantize``,
  llm-compressor and the ``compressed-tensors`` package write it.
* :data:`FORMAT_MODELOPT` ``"modelopt"``: ModelOpt NVFP4 / W4A16_NVFP4 (``weight`` uint8,
  ``weight_scale``, ``weight_scale_2`` multiplier), declared in config.json or hf_quant_config.json.

Anything else (another quantization method, a group size other than 16, integer or 8-bit weights,
a quantized KV cache) is refused with the setting named, on every side alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .format import (
    BLOCK_SIZE,
    CT_WEIGHT_GLOBAL_SCALE,
    CT_WEIGHT_PACKED,
    CT_WEIGHT_SCALE,
    MODELOPT_WEIGHT,
    MODELOPT_WEIGHT_SCALE,
    MODELOPT_WEIGHT_SCALE_2,
)
from .quantize import DEFAULT_SCALE_RULE, SCALE_RULES

FORMAT_BF16 = "bf16"
FORMAT_CT = "compressed-tensors"
FORMAT_MODELOPT = "modelopt"
CHECKPOINT_FORMATS = (FORMAT_BF16, FORMAT_CT, FORMAT_MODELOPT)

#: Tensor-name suffixes of one quantized module, per quantized layout: (packed codes, block scales,
#: global scale). The global scale is a divisor in compressed-tensors, a multiplier in ModelOpt.
LAYOUT_TENSOR_NAMES: dict[str, tuple[str, str, str]] = {
    FORMAT_CT: (CT_WEIGHT_PACKED, CT_WEIGHT_SCALE, CT_WEIGHT_GLOBAL_SCALE),
    FORMAT_MODELOPT: (MODELOPT_WEIGHT, MODELOPT_WEIGHT_SCALE, MODELOPT_WEIGHT_SCALE_2),
}
#: Tensor-name suffixes only an NVFP4 checkpoint has (not ModelOpt's ``weight`` / ``weight_scale``, which a BF16 or
#: FP8 checkpoint may hold too): their presence in a folder whose config declares no NVFP4 format is an error.
NVFP4_ONLY_SUFFIXES = (f".{CT_WEIGHT_PACKED}", f".{CT_WEIGHT_GLOBAL_SCALE}", f".{MODELOPT_WEIGHT_SCALE_2}")

#: ``quant_method`` of the qerl_nvfp4 vLLM method's own config (and the method's registered name).
QERL_QUANT_METHOD = "qerl_nvfp4"

#: compressed-tensors' name for the NVFP4 packed layout.
CT_FORMAT = "nvfp4-pack-quantized"

#: ModelOpt ``quant_algo`` values that are NVFP4 weights (W4A4 runs weight-only here).
MODELOPT_FP4_ALGOS = ("NVFP4", "W4A16_NVFP4")

#: The file ModelOpt writes its settings to when config.json has no quantization_config.
MODELOPT_CONFIG_FILE = "hf_quant_config.json"


class QuantConfigError(ValueError):
    """A quantization config that no side of qerl_nvfp4 can serve; the message names the setting."""


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; a clear error naming the file otherwise."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise QuantConfigError(f"{path}: not valid JSON (not UTF-8 text: {err.reason})") from err
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise QuantConfigError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from err
    if not isinstance(value, dict):
        raise QuantConfigError(f"{path}: not a JSON object (it holds a {type(value).__name__})")
    return value


def declared_quant_config(config: Mapping[str, Any], folder: Path | None = None) -> dict[str, Any] | None:
    """The quantization dict a checkpoint declares: config.json's ``quantization_config`` (or
    ``compression_config``), else the whole hf_quant_config.json beside it, else None."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if qc is not None and not isinstance(qc, Mapping):
        raise QuantConfigError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
    if not qc and folder is not None and (Path(folder) / MODELOPT_CONFIG_FILE).is_file():
        return read_json_object(Path(folder) / MODELOPT_CONFIG_FILE)
    return dict(qc) if qc else None


def modelopt_block(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ModelOpt settings of a quantization dict, flat (hf_quant_config.json nests them under
    ``quantization``); None when the dict is not ModelOpt's."""
    nested = cfg.get("quantization")
    producer = cfg.get("producer")
    if isinstance(nested, Mapping) and ("quant_algo" in nested or (
            isinstance(producer, Mapping) and producer.get("name") == "modelopt")):
        return dict(nested)
    method = str(cfg.get("quant_method", "")).lower()
    if method.startswith("modelopt") or "quant_algo" in cfg:
        return dict(cfg)
    return None


def _check_compressed_tensors(cfg: Mapping[str, Any]) -> None:
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise QuantConfigError("compressed-tensors quantization_config has no config_groups")
    for gname, group in groups.items():
        fmt = group.get("format") or cfg.get("format")
        w = group.get("weights") or {}
        where = f"quantization_config.config_groups.{gname}"
        if fmt != CT_FORMAT:
            raise QuantConfigError(f"{where}.format={fmt!r}: only {CT_FORMAT!r} (NVFP4) compressed-tensors "
                                   "checkpoints are supported; give a BF16 checkpoint to quantize at load")
        if w.get("num_bits") != 4 or w.get("type") != "float":
            raise QuantConfigError(f"{where}.weights: num_bits={w.get('num_bits')} type={w.get('type')!r}; "
                                   "NVFP4 needs 4-bit float weights")
        if w.get("group_size") != BLOCK_SIZE:
            raise QuantConfigError(f"{where}.weights.group_size={w.get('group_size')}; NVFP4 needs {BLOCK_SIZE}")
        if w.get("strategy") not in (None, "tensor_group") or w.get("symmetric") is False:
            raise QuantConfigError(f"{where}.weights: strategy={w.get('strategy')!r} symmetric={w.get('symmetric')}; "
                                   "NVFP4 is symmetric 'tensor_group'")
    if cfg.get("kv_cache_scheme"):
        raise QuantConfigError("quantization_config.kv_cache_scheme is set; qerl_nvfp4 does not quantize the "
                               "KV cache")


def _check_modelopt(mo: Mapping[str, Any]) -> None:
    algo = str(mo.get("quant_algo", "")).upper()
    if algo not in MODELOPT_FP4_ALGOS:
        raise QuantConfigError(f"ModelOpt quant_algo={algo!r}; qerl_nvfp4 serves {MODELOPT_FP4_ALGOS}")
    gs = mo.get("group_size", BLOCK_SIZE)
    if gs != BLOCK_SIZE:
        raise QuantConfigError(f"ModelOpt group_size={gs}; NVFP4 needs {BLOCK_SIZE}")
    if mo.get("kv_cache_quant_algo"):
        raise QuantConfigError(f"ModelOpt kv_cache_quant_algo={mo['kv_cache_quant_algo']!r}; qerl_nvfp4 does not "
                               "quantize the KV cache")


def classify_quant_config(cfg: Mapping[str, Any] | None) -> str:
    """Which of :data:`CHECKPOINT_FORMATS` a checkpoint's quantization dict describes.

    Raises :class:`QuantConfigError` for a quantized checkpoint qerl_nvfp4 cannot serve (not NVFP4,
    group size other than 16, asymmetric, quantized KV cache), naming the setting.
    """
    if not cfg:
        return FORMAT_BF16
    method = str(cfg.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    if method == QERL_QUANT_METHOD:
        fmt = str(cfg.get("checkpoint_format", FORMAT_BF16))
        if fmt not in CHECKPOINT_FORMATS:
            raise QuantConfigError(f"quantization_config.checkpoint_format={fmt!r}; expected one of "
                                   f"{CHECKPOINT_FORMATS}")
        gs = cfg.get("group_size", BLOCK_SIZE)
        if gs != BLOCK_SIZE:
            raise QuantConfigError(f"quantization_config.group_size={gs}; NVFP4 needs {BLOCK_SIZE}")
        rule = cfg.get("scale_rule", DEFAULT_SCALE_RULE)
        if rule not in SCALE_RULES:
            raise QuantConfigError(f"quantization_config.scale_rule={rule!r}; expected one of {SCALE_RULES}")
        return fmt
    if method == "compressed-tensors":
        _check_compressed_tensors(cfg)
        return FORMAT_CT
    mo = modelopt_block(cfg)
    if mo is not None:
        _check_modelopt(mo)
        return FORMAT_MODELOPT
    raise QuantConfigError(f"checkpoint quantized with quant_method={method!r}; qerl_nvfp4 serves BF16 checkpoints "
                           "(quantized at load), compressed-tensors NVFP4 and ModelOpt NVFP4")


def detect_format(config: Mapping[str, Any], folder: Path | None = None) -> str:
    """The layout of the checkpoint whose config.json is ``config`` (``folder``: where to look for
    hf_quant_config.json)."""
    return classify_quant_config(declared_quant_config(config, folder))


def quantize_at_load_layers(cfg: Mapping[str, Any] | None) -> tuple[list[str] | None, list[str] | None]:
    """``(ignore, targets)`` module patterns a ``qerl_nvfp4`` quantize-at-load config declares (None
    where it declares none); ``targets`` None also when it names the class ``Linear`` (every layer)."""
    if not cfg or str(cfg.get("quant_method", "")).lower() != QERL_QUANT_METHOD:
        return None, None
    ignore = _pattern_list(cfg.get("ignore"))
    targets = _pattern_list(cfg.get("targets"))
    if targets is not None and (not targets or "Linear" in targets):
        targets = None
    return ignore, targets


def declared_scale_rule(cfg: Mapping[str, Any] | None) -> str | None:
    """The ``scale_rule`` a ``qerl_nvfp4`` quantize-at-load config declares, or None where it declares none (its
    readers then use :data:`DEFAULT_SCALE_RULE`). vLLM and ``load_nvfp4_model`` quantize a BF16 folder with it, so
    ``qerl-quantize`` and verl's config check read it here too: one folder, one set of NVFP4 bytes."""
    if not cfg or str(cfg.get("quant_method", "")).lower() != QERL_QUANT_METHOD:
        return None
    rule = cfg.get("scale_rule")
    return None if rule is None else str(rule)


def _pattern_list(value: Any) -> list[str] | None:
    """A config's pattern list; a single string is one pattern (``list("down_proj")`` would be its characters)."""
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)
