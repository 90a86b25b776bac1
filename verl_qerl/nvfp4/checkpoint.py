"""Read and write NVFP4 checkpoints (Hugging Face folders of safetensors shards).

Written layout: compressed-tensors NVFP4A16 (``<module>.weight_packed`` uint8 [N, K/2],
``<module>.weight_scale`` float8_e4m3fn [N, K/16], ``<module>.weight_global_scale`` fp32 [1], the
divisor), with a ``quantization_config`` in config.json that vLLM's stock compressed-tensors loader
and llm-compressor accept. Read layouts: that one, and ModelOpt NVFP4 (``<module>.weight`` uint8,
``weight_scale`` E4M3, ``weight_scale_2`` fp32 *multiplier*). Tensors are read lazily one at a
time through ``safetensors.safe_open`` so nothing holds a whole model.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .arch import DEFAULT_IGNORE, fused_group
from .format import (
    BLOCK_SIZE,
    CT_WEIGHT_GLOBAL_SCALE,
    CT_WEIGHT_PACKED,
    CT_WEIGHT_SCALE,
    SCALE_DTYPE,
    block_scale_problem,
)
from .quant_config import (
    CT_FORMAT,
    FORMAT_BF16,
    FORMAT_CT,
    FORMAT_MODELOPT,
    LAYOUT_TENSOR_NAMES,
    NVFP4_ONLY_SUFFIXES,
    QuantConfigError,
    declared_quant_config,
    read_json_object,
)
from .quantize import SCALE_RULES, NVFP4FormatError, NVFP4Weight, quantize

__all__ = ["CT_FORMAT", "FORMAT_BF16", "FORMAT_CT", "FORMAT_MODELOPT", "CheckpointError", "CheckpointReader",
           "PatternError", "check_patterns", "ct_quantization_config", "ct_tensors", "detect_format",
           "matches_pattern", "validate_nvfp4"]

#: The compressed-tensors version whose config schema we write (the one vLLM 0.24/0.32 pin).
CT_CONFIG_VERSION = "0.17.0"

#: Top-level config.json key recording the scale rule (``verl_qerl.nvfp4.SCALE_RULES``) a checkpoint
#: was quantized with. Outside ``quantization_config`` on purpose: compressed-tensors validates that
#: block with pydantic (extra keys are ignored today, and slated to be refused); transformers and
#: vLLM keep or ignore unknown top-level keys.
SCALE_RULE_KEY = "qerl_scale_rule"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read as asked; the message names the file or tensor."""


class PatternError(ValueError):
    """A module name pattern that cannot work; the message names the option and the pattern."""


def ct_quantization_config(ignore: Iterable[str] = DEFAULT_IGNORE) -> dict:
    """The ``quantization_config`` block of an NVFP4A16 compressed-tensors checkpoint; ``ignore``: the full names
    of the Linear layers stored dense (compressed-tensors and vLLM's stock loader take an ignore entry as an exact
    name or ``re:<regex>`` only, never as the dotted suffix :func:`matches_pattern` also accepts)."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": BLOCK_SIZE,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
    }
    return {
        "config_groups": {
            "group_0": {
                "format": CT_FORMAT,
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": CT_FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "version": CT_CONFIG_VERSION,
    }


def ct_tensors(module: str, weight: NVFP4Weight) -> dict[str, torch.Tensor]:
    """The three tensors compressed-tensors stores for one quantized Linear named ``module``."""
    return {
        f"{module}.{CT_WEIGHT_PACKED}": weight.packed.contiguous(),
        f"{module}.{CT_WEIGHT_SCALE}": weight.scale.contiguous(),
        f"{module}.{CT_WEIGHT_GLOBAL_SCALE}": weight.global_scale.reshape(1).to(torch.float32).contiguous(),
    }


def matches_pattern(module: str, patterns: Iterable[str]) -> bool:
    """verl-qerl's ignore/target rule: an exact module name, a dotted suffix, or ``re:<regex>``. compressed-tensors
    takes the exact name and ``re:`` forms only, so what is written into a checkpoint is full names."""
    for pat in patterns:
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return True
        elif module == pat or module.endswith("." + pat):
            return True
    return False


def check_patterns(patterns: Iterable[Any], option: str) -> list[str]:
    """``patterns`` as a list, each a non-empty string and every ``re:`` one a valid regular
    expression; otherwise a :class:`PatternError` naming ``option`` (the flag or key) and the pattern."""
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for pat in patterns:
        if not isinstance(pat, str) or not pat:
            raise PatternError(f"{option}: {pat!r} is not a module name pattern (an exact module name, a dotted "
                               "suffix such as 'down_proj', or 're:<regex>')")
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as err:
                raise PatternError(f"{option}: {pat!r} is not a valid regular expression ({err})") from err
        out.append(pat)
    return out


def check_ignore(linear: Sequence[str], patterns: Iterable[str], option: str,
                 must_match: Iterable[str] = ()) -> None:
    """The ignore list ``patterns`` against the model's Linear layers ``linear``: each of ``must_match`` (the
    user's own patterns) keeps at least one layer in BF16, and no fused group (q/k/v, gate/up: one GEMM and one
    global scale in vLLM) is split between BF16 and NVFP4. Otherwise a :class:`PatternError` naming ``option``.

    Why: a misspelled pattern (``donw_proj``) matched nothing and left those layers quantized without a word, and
    ``q_proj`` alone wrote a checkpoint vLLM then refused (its fused layer must be all quantized or all not).
    """
    patterns, names = list(patterns), list(linear)
    for pat in must_match:
        if not any(matches_pattern(n, [pat]) for n in names):
            leaves = sorted({n.rpartition(".")[2] for n in names})
            example = f"exact names such as {names[0]!r}, " if names else ""
            raise PatternError(f"{option}: {pat!r} matches no Linear layer of the model (its layers: "
                               f"{', '.join(leaves) or 'none'}; {example}dotted suffixes or 're:<regex>'); a "
                               "misspelled pattern would leave the layers it meant quantized")
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(fused_group(n), []).append(n)
    for key, members in groups.items():
        kept = [m for m in members if matches_pattern(m, patterns)]
        if kept and len(kept) < len(members):
            rest = [m for m in members if m not in kept]
            leaves = "/".join(m.rpartition(".")[2] for m in members)
            raise PatternError(f"{option}: keeps {kept[0]} in BF16 but not {rest[0]}: {leaves} are one fused layer "
                               f"({key}) in vLLM and share one global scale; ignore all of them or none")


def detect_format(config: dict, folder: Path | None = None) -> str:
    """Which weight layout a checkpoint's config.json (and hf_quant_config.json) declares: one of
    :data:`~verl_qerl.nvfp4.quant_config.CHECKPOINT_FORMATS`, read as the vLLM method reads it."""
    from .quant_config import detect_format as classify

    try:
        return classify(config, folder)
    except QuantConfigError as err:
        where = f"{folder}: " if folder is not None else ""
        raise CheckpointError(f"{where}{err}") from err


def read_config_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, the shard index) as a dict; errors name the file."""
    try:
        return read_json_object(path)
    except QuantConfigError as err:
        raise CheckpointError(str(err)) from err


@contextlib.contextmanager
def open_shard(path: Path) -> Iterator[Any]:
    """``safe_open`` of one shard; a truncated or corrupt file raises :class:`CheckpointError` naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); the shard is damaged or "
                              "incomplete: copy or download it again") from err


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file`` (format ``pt``) whose write errors (a full disk, a file-size limit) are
    :class:`OSError` naming the file, as any other write error: safetensors raises its own error type."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as err:
        raise OSError(f"{path}: cannot write ({err})") from err


def recorded_scale_rule(config: dict) -> str | None:
    """The scale rule a checkpoint's config.json says it was quantized with, or None (not recorded)."""
    rule = config.get(SCALE_RULE_KEY)
    return None if rule is None else str(rule)


def matching_scale_rules(nvfp4: CheckpointReader, source: CheckpointReader) -> list[str]:
    """The scale rules under which ``source``'s dense weights give ``nvfp4``'s bytes, judged on one layer.

    The smallest NVFP4 layer that ``source`` holds densely is re-quantized under each rule with the
    checkpoint's own global scale (so fused layers need no siblings); a rule matches when block
    scales and codes are identical. An empty list means neither rule made the checkpoint from these
    weights (calibrated scales, another model, or another tool).
    """
    layers = [m for m in nvfp4.nvfp4_modules() if f"{m}.weight" in source]
    if not layers:
        return []
    sizes = {m: int(torch.tensor(source.metadata(f"{m}.weight")[1]).prod()) for m in layers}
    module = min(layers, key=lambda m: (sizes[m], m))
    stored, dense = nvfp4.read_nvfp4(module), source.get(f"{module}.weight")
    if tuple(dense.shape) != stored.shape:
        return []
    matches = []
    for rule in SCALE_RULES:
        q = quantize(dense, stored.global_scale, name=f"{module}.weight", rule=rule)
        same_scales = torch.equal(q.scale.view(torch.uint8), stored.scale.view(torch.uint8))
        if same_scales and torch.equal(q.packed, stored.packed):
            matches.append(rule)
    return matches


@dataclass
class CheckpointReader:
    """Lazy, name-indexed access to the safetensors shards of a Hugging Face checkpoint folder."""

    folder: Path
    config: dict = field(init=False)
    format: str = field(init=False)
    #: The quantization dict the checkpoint declares (config.json or hf_quant_config.json), or None.
    quant_config: dict | None = field(init=False)
    _where: dict[str, str] = field(init=False, repr=False)

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder).expanduser()  # (`~/models/x` from a config reaches the workers unexpanded)
        if not self.folder.exists():
            raise CheckpointError(f"{self.folder}: no such folder")
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a directory (a checkpoint is a folder with config.json and "
                                  "*.safetensors)")
        cfg_path = self.folder / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: missing (not a Hugging Face checkpoint folder)")
        self.config = read_config_json(cfg_path)
        try:
            self.quant_config = declared_quant_config(self.config, self.folder)
        except QuantConfigError as err:
            raise CheckpointError(f"{self.folder}: {err}") from err
        self.format = detect_format(self.config, self.folder)
        self._where = self._index()
        if self.format == FORMAT_BF16:
            self._refuse_undeclared_nvfp4()

    def _refuse_undeclared_nvfp4(self) -> None:
        """A folder with NVFP4 tensors whose config declares no NVFP4 format (e.g. ``save_pretrained`` of a model
        after ``quantize_model``: uint8 ``weight_packed`` but no quantization_config) would read as a BF16 model
        with missing Linear weights; transformers would even load it with random ones. Say what it is."""
        stray = sorted(n for n in self._where if n.endswith(NVFP4_ONLY_SUFFIXES))
        if stray:
            raise CheckpointError(
                f"{self.folder}: has NVFP4 tensors (e.g. {stray[0]!r}) but config.json declares no NVFP4 "
                "quantization_config (saved with save_pretrained after quantize_model?); write NVFP4 checkpoints "
                "with verl_qerl.modeling.export_merged(..., dtype='nvfp4') or qerl-quantize")

    def _index(self) -> dict[str, str]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_config_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            for shard in sorted(set(weight_map.values())):
                if not (self.folder / shard).is_file():
                    raise CheckpointError(f"{index}: names shard {shard!r}, which is missing")
            # the index against the shards' own headers: a stale index (a shard rewritten, a tensor moved) would
            # otherwise read as a damaged shard, or lose tensors the index does not list
            held: dict[str, str] = {}
            for shard in sorted(set(weight_map.values())):
                with open_shard(self.folder / shard) as f:
                    held.update(dict.fromkeys(f.keys(), shard))
            for name, shard in sorted(weight_map.items()):
                if held.get(name) != shard:
                    where = f"is in {held[name]!r}" if name in held else "is in no shard"
                    raise CheckpointError(f"{index}: lists {name!r} in {shard!r}, but it {where}: the index is stale "
                                          "(rewrite it from the shards, or remove it if there is one shard)")
            unlisted = sorted(set(held) - set(weight_map))
            if unlisted:
                raise CheckpointError(f"{index}: does not list {len(unlisted)} tensor(s) its shards hold (e.g. "
                                      f"{unlisted[0]!r} in {held[unlisted[0]]!r}): the index is stale (rewrite it "
                                      "from the shards)")
            return dict(weight_map)
        shards = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not shards:
            bins = sorted(p.name for p in self.folder.glob("*.bin"))
            hint = f" (found {bins}: convert to safetensors first)" if bins else ""
            raise CheckpointError(f"{self.folder}: no *.safetensors weights{hint}")
        where = {}
        for shard in shards:
            with open_shard(self.folder / shard) as f:
                for name in f.keys():
                    where[name] = shard
        return where

    @property
    def shards(self) -> list[str]:
        return sorted(set(self._where.values()))

    def names(self) -> list[str]:
        return list(self._where)

    def shard_names(self, shard: str) -> list[str]:
        return [n for n, s in self._where.items() if s == shard]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing")
        with open_shard(self.folder / self._where[name]) as f:
            return f.get_tensor(name)

    def metadata(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape of a tensor without reading its data."""
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing")
        with open_shard(self.folder / self._where[name]) as f:
            sl = f.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
            return dtype, tuple(sl.get_shape())

    def iter_shard(self, shard: str) -> Iterator[tuple[str, torch.Tensor]]:
        with open_shard(self.folder / shard) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    def nvfp4_modules(self) -> list[str]:
        """Names of the modules stored as NVFP4 in this checkpoint."""
        names = LAYOUT_TENSOR_NAMES.get(self.format)
        if names is None:
            return []
        # a tensor only an NVFP4 module has: compressed-tensors' packed codes; ModelOpt's second scale (its
        # packed codes are a plain ``weight``)
        suffix = "." + (names[0] if self.format == FORMAT_CT else names[2])
        return [n[: -len(suffix)] for n in self._where if n.endswith(suffix)]

    def _nvfp4_names(self, module: str) -> tuple[str, str, str]:
        names = LAYOUT_TENSOR_NAMES.get(self.format)
        if names is None:
            raise CheckpointError(f"{self.folder}: not an NVFP4 checkpoint (format {self.format})")
        for n in names:
            if f"{module}.{n}" not in self._where:
                raise CheckpointError(f"{self.folder}: module {module!r} lacks tensor '{module}.{n}'")
        return tuple(f"{module}.{n}" for n in names)  # type: ignore[return-value]

    def _global_scale(self, name: str) -> torch.Tensor:
        """The divisor: compressed-tensors stores it, ModelOpt its reciprocal."""
        third = self.get(name).to(torch.float32)
        return torch.reciprocal(third.reshape(1)) if self.format == FORMAT_MODELOPT else third.reshape(-1)

    def read_nvfp4(self, module: str) -> NVFP4Weight:
        """One quantized layer, validated, as compressed-tensors tensors (divisor global scale)."""
        packed_name, scale_name, gs_name = self._nvfp4_names(module)
        packed, scale = self.get(packed_name), self.get(scale_name)
        return validate_nvfp4(module, packed, scale, self._global_scale(gs_name))

    def check_nvfp4(self, module: str, expected_shape: tuple[int, int] | None = None) -> None:
        """What :meth:`read_nvfp4` would refuse, from the shard headers and the global scale alone
        (no packed weights read): to check every layer before a model changes."""
        packed_name, scale_name, gs_name = self._nvfp4_names(module)
        meta = []
        for name in (packed_name, scale_name):
            dtype, shape = self.metadata(name)
            if dtype is None:
                raise NVFP4FormatError(f"{name}: stored with a dtype torch cannot read")
            meta.append(torch.empty(shape, dtype=dtype, device="meta"))
        validate_nvfp4(module, meta[0], meta[1], self._global_scale(gs_name), expected_shape=expected_shape)


_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BOOL": torch.bool,
}


def validate_nvfp4(
    module: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    expected_shape: tuple[int, int] | None = None,
) -> NVFP4Weight:
    """Check dtypes and shapes of one layer's NVFP4 tensors; errors name the tensor."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NVFP4FormatError(f"{module}: packed weight must be uint8 [N, K/2], got {packed.dtype} "
                               f"{tuple(packed.shape)}")
    if scale.dtype == torch.uint8:
        scale = scale.view(SCALE_DTYPE)
    if scale.dtype != SCALE_DTYPE:
        raise NVFP4FormatError(f"{module}.weight_scale: must be float8_e4m3fn, got {scale.dtype}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (n, k // BLOCK_SIZE):
        group = k // scale.shape[1] if scale.dim() == 2 and scale.shape[1] else "?"
        raise NVFP4FormatError(f"{module}.weight_scale: shape {tuple(scale.shape)} does not fit packed weight "
                               f"[{n}, {k}/2] with block size {BLOCK_SIZE} (implied group size {group})")
    problem = block_scale_problem(scale)  # NaN or negative block scales (meta tensors: shapes only)
    if problem:
        raise NVFP4FormatError(f"{module}.weight_scale: {problem}")
    if global_scale.numel() != 1:
        raise NVFP4FormatError(f"{module}: global scale must hold one value, got shape {tuple(global_scale.shape)}")
    g = float(global_scale.reshape(()))
    if not (g > 0 and g < float("inf")):
        raise NVFP4FormatError(f"{module}: global scale must be finite and > 0, got {g}")
    if expected_shape is not None and (n, k) != tuple(expected_shape):
        raise NVFP4FormatError(f"{module}: checkpoint weight is [{n}, {k}] but the model expects "
                               f"{list(expected_shape)}")
    return NVFP4Weight(packed, scale, global_scale.to(torch.float32).reshape(1))
