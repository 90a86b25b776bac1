"""``actor_rollout_ref.model.path`` and ``qerl.quantized_checkpoint`` against the ``qerl`` block, in the driver.

Where the nvfp4 base comes from (an NVFP4 ``model.path``, its NVFP4 twin, or the BF16 weights quantized in place), that
the twin was made with the block's scale rule, that ``qerl.ignore`` names layers the model has and the NVFP4 base
stores in BF16, that a ``qerl_nvfp4`` quantize-at-load block in ``model.path``'s config.json and the ``qerl`` block
are one reading, and what vLLM's quantize-at-load is told. Each check reads local config.json files and safetensors
headers only, and refuses with a :class:`~verl_qerl.verl.qerl_block.QeRLConfigError` naming the key; paths the driver
does not see are left to the actor hook.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from ..nvfp4.arch import DEFAULT_IGNORE
from ..nvfp4.checkpoint import PatternError, check_patterns, matches_pattern
from ..nvfp4.quant_config import FORMAT_BF16
from ..nvfp4.quantize import DEFAULT_SCALE_RULE
from ..vllm import METHOD_NAME
from .qerl_block import HF_OVERRIDES, VLLM_QUANTIZATION, QeRLConfig, QeRLConfigError, get_key, set_key, to_plain

logger = logging.getLogger("verl_qerl")


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


def check_twin_folder(qerl: QeRLConfig) -> None:
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


def check_twin_scale_rule(config: Any, qerl: QeRLConfig) -> None:
    """A BF16 ``model.path``'s NVFP4 twin must be what vLLM makes of ``model.path`` under ``qerl.scale_rule``."""
    from pathlib import Path

    from ..nvfp4.checkpoint import CheckpointReader, matching_scale_rules, recorded_scale_rule

    path, twin = get_key(config, "actor_rollout_ref.model.path"), qerl.quantized_checkpoint
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


def check_ignore_against_model_path(config: Any, qerl: QeRLConfig) -> None:
    """:func:`check_ignore_matches` on ``model.path``'s architecture where its config.json is local (a hub id or
    a remote path: the actor hook checks on the built model)."""
    from pathlib import Path

    from ..nvfp4.checkpoint import read_config_json

    path = get_key(config, "actor_rollout_ref.model.path")
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


def check_ignore_against_nvfp4_base(config: Any, qerl: QeRLConfig) -> None:
    """``qerl.ignore`` against the NVFP4 checkpoint the actor's base is read from (an NVFP4 ``model.path``, else
    ``qerl.quantized_checkpoint``), where the driver sees it: a layer the list keeps in BF16 that the checkpoint stores
    in NVFP4 has no BF16 weight to train from. Refused here, naming the key, the folder and the layers; the actor
    would otherwise fail only after Ray and vLLM started, with an error about ``ignore=``. Reads config.json and
    the shard headers (tensor names) only."""
    from pathlib import Path

    from ..nvfp4.checkpoint import CheckpointError, CheckpointReader

    path = get_key(config, "actor_rollout_ref.model.path")
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


def follow_declared_block(config: Any, qerl: QeRLConfig, changes: list[str]) -> QeRLConfig:
    """``qerl`` with the ignore list / scale rule that a local BF16 ``model.path`` declares in a ``qerl_nvfp4``
    quantize-at-load ``quantization_config`` of its config.json.

    vLLM quantizes such a folder as its block says, the actor as ``qerl.ignore`` / ``qerl.scale_rule`` say; unless
    they are one reading the rollout samples from other weights than the ones trained, without an error. A
    ``qerl`` value left at its default follows the block (and is then passed to vLLM like any other); a value that
    disagrees with what the block declares is refused naming both, as a conflicting ``hf_overrides`` is. Keys the
    block leaves out bind nothing; an ``hf_overrides.quantization_config`` replaces the block for vLLM, so then
    :func:`vllm_quantize_at_load` ties that one to ``qerl`` instead.
    """
    from pathlib import Path

    from ..checkpoint_conversion import linear_module_names
    from ..nvfp4.checkpoint import read_config_json
    from ..nvfp4.quant_config import declared_quant_config, declared_scale_rule, quantize_at_load_layers

    path = get_key(config, "actor_rollout_ref.model.path")
    if (qerl.mode != "nvfp4" or checkpoint_format(path) != FORMAT_BF16
            or get_key(config, f"{HF_OVERRIDES}.quantization_config") is not None):
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
        if get_key(config, "qerl") is not None:  # a later read_qerl of the top-level block sees the same values
            set_key(config, f"qerl.{key}", list(value) if key == "ignore" else value, [])
        changes.append(f"qerl.{key}={list(value) if key == 'ignore' else value} (declared by {where})")
    return dataclasses.replace(qerl, **found)


def check_no_quantize_at_load_block(config: Any, qerl: QeRLConfig) -> None:
    """Modes other than nvfp4 on a BF16 ``model.path`` whose config.json declares a ``qerl_nvfp4`` quantize-at-load
    ``quantization_config``: vLLM follows that block (it quantizes the folder to NVFP4 with no ``quantization``
    argument, and took it over a ``bitsandbytes`` one) while the actor trains on the BF16 (or NF4) weights, so the
    rollout would sample from other weights than the ones trained, without an error. Refused here, naming both."""
    from pathlib import Path

    from ..nvfp4.checkpoint import read_config_json
    from ..nvfp4.quant_config import declared_quant_config

    path = get_key(config, "actor_rollout_ref.model.path")
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


def vllm_quantize_at_load(config: Any, qerl: QeRLConfig, changes: list[str]) -> None:
    """Give vLLM's quantize-at-load the actor's scale rule and ignore list (passed only where not the default).

    Without the ignore list vLLM would quantize the layers ``qerl.ignore`` keeps in BF16 on the actor (or keep
    ``lm_head`` in BF16 where ``qerl.ignore=[]`` quantizes it), and the rollout would sample from other weights than
    the ones trained, without an error anywhere.
    """
    path_format = checkpoint_format(get_key(config, "actor_rollout_ref.model.path"))
    if qerl.mode != "nvfp4" or path_format not in (None, FORMAT_BF16):
        return  # a quantized model.path: vLLM and the actor both read its bytes
    key = HF_OVERRIDES
    overrides = dict(to_plain(get_key(config, key, {})) or {})
    have = overrides.get("quantization_config")
    want = {"quant_method": VLLM_QUANTIZATION["nvfp4"], "scale_rule": qerl.scale_rule, "ignore": list(qerl.ignore)}
    if have is not None:
        have = dict(to_plain(have))
        filled = {**have, "scale_rule": have.get("scale_rule", DEFAULT_SCALE_RULE),
                  "ignore": list(have.get("ignore", DEFAULT_IGNORE) or [])}
        if filled != want:
            raise QeRLConfigError(f"{key}.quantization_config={have} conflicts with qerl.scale_rule="
                                  f"{qerl.scale_rule} / qerl.ignore={list(qerl.ignore)} (which need {want}); "
                                  "leave it unset")
        return
    if qerl.scale_rule != DEFAULT_SCALE_RULE or tuple(qerl.ignore) != tuple(DEFAULT_IGNORE):
        set_key(config, key, {**overrides, "quantization_config": want}, changes)
